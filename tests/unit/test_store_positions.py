"""`Store.apply`: state and position in one batch; a position never moves back (real RocksDB)."""

from __future__ import annotations

import pytest
from threadlog.projections.store import Store


def test_a_position_only_moves_forward_and_a_refused_batch_writes_nothing(tmp_path):
    store = Store(tmp_path / "s")
    try:
        store.apply({b"k": b"1"}, {("events", 0): 5})
        store.apply({b"k": b"2"}, {("events", 0): 5})  # the same position again is fine
        with pytest.raises(ValueError, match="would move back from 5 to 4"):
            store.apply({b"k": b"3", b"other": b"x"}, {("events", 0): 4})
        assert store.get(b"k") == b"2" and store.get(b"other") is None
        assert store.offset("events", 0) == 5
        store.apply({}, {("events", 1): 1})  # another partition has its own position
        assert (store.offset("events", 0), store.offset("events", 1)) == (5, 1)
    finally:
        store.close()


def test_a_partition_store_left_with_keys_but_no_position_is_emptied_for_every_role(tmp_path):
    # What a worker killed during a snapshot restore leaves (keys written, the
    # position last and never): any later opener -- an embedded client included,
    # which folds from offset 0 without a restore step -- must start empty.
    from threadlog.projections.partition_stores import PartitionStores

    partial = Store(tmp_path / "events-0")
    partial.apply({b"state": b"from a snapshot"}, {})
    partial.close()
    kept = Store(tmp_path / "events-1")
    kept.apply({b"state": b"folded"}, {("ns.events", 1): 3})
    kept.close()
    stores = PartitionStores(tmp_path, "ns.events")
    try:
        assert stores.open(0).is_empty() and stores.offset("ns.events", 0) == 0
        assert stores.open(1).get(b"state") == b"folded" and stores.offset("ns.events", 1) == 3
    finally:
        stores.close()
