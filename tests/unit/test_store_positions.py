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
