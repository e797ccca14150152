"""Read models: folds of `<ns>.events` into RocksDB, with read barriers and rebuild."""
