"""Restores off the judge's thread (processors/restores.py), broker-free: real
RocksDB stores under PartitionStores; the restorer (a snapshot read, in
production) is a function writing keys and a position, held on an event so a
test decides when it ends."""

from __future__ import annotations

import threading
import time

from threadlog.processors.restores import Restores
from threadlog.projections.partition_stores import PartitionStores

TOPIC = "ns.events"


class Restorer:
    """Fills a store with one key and position 7 once released (or fails, or sees the cancel)."""

    def __init__(self, fail: bool = False) -> None:
        self.release = threading.Event()
        self.fail = fail
        self.cancelled: list[int] = []

    def __call__(self, p: int, store, cancel: threading.Event):
        while not self.release.wait(0.01):
            if cancel.is_set():
                self.cancelled.append(p)
                store.apply({b"partial": b"1"}, {})  # keys without a position: a restore cut short
                raise RuntimeError("cancelled")
        if self.fail:
            store.apply({b"partial": b"1"}, {})
            raise RuntimeError("the snapshot does not decode")
        store.apply({b"k": b"v"}, {(TOPIC, p): 7})
        return None


def _finished(restores: Restores, seconds: float = 10.0) -> list:
    deadline = time.monotonic() + seconds
    while True:
        done = restores.finished()
        if done or not restores:
            return done
        assert time.monotonic() < deadline, "no restore ended"
        time.sleep(0.01)  # polled as the judge's loop polls it


def test_a_restored_partition_is_served_only_once_its_restore_ended(tmp_path):
    stores, restorer = PartitionStores(tmp_path, TOPIC), Restorer()
    restores = Restores(stores, restorer)
    try:
        restores.start(0)
        assert restores.partitions == [0] and restores.finished() == []
        assert stores.partitions == [] and stores.get(b"k") is None  # the store being filled is not read
        restorer.release.set()
        assert [p for p, _ in _finished(restores)] == [0]
        assert stores.partitions == [0] and stores.get(b"k") == b"v" and stores.offset(TOPIC, 0) == 7
        assert not restores
    finally:
        restores.close()
        stores.close()


def test_a_partition_revoked_mid_restore_is_not_served_and_resumes_from_it_when_it_returns(tmp_path):
    stores, restorer = PartitionStores(tmp_path, TOPIC), Restorer()
    restores = Restores(stores, restorer)
    try:
        restores.start(0)
        assert restores.drop(0) is True and restores.drop(1) is False
        assert restores.partitions == [] and 0 in restores  # not assigned here, still running
        restorer.release.set()
        assert _finished(restores) == []  # ended, not wanted: closed, not served
        assert stores.partitions == [] and not restores
        # Back later: the restored store, kept on disk, is resumed from.
        assert stores.open(0).offset(TOPIC, 0) == 7
    finally:
        restores.close()
        stores.close()


def test_a_partition_given_back_before_its_restore_ended_keeps_that_restore(tmp_path):
    stores, restorer = PartitionStores(tmp_path, TOPIC), Restorer()
    restores = Restores(stores, restorer)
    try:
        restores.start(0)
        restores.drop(0)
        restores.start(0)  # assigned again: no second restore of the same directory
        restorer.release.set()
        assert [p for p, _ in _finished(restores)] == [0]
        assert stores.offset(TOPIC, 0) == 7
    finally:
        restores.close()
        stores.close()


def test_a_failed_restore_serves_an_empty_store_folded_from_offset_0(tmp_path):
    stores, restorer = PartitionStores(tmp_path, TOPIC), Restorer(fail=True)
    restores = Restores(stores, restorer)
    try:
        restores.start(0)
        restorer.release.set()
        assert _finished(restores) == [(0, None)]
        assert stores.partitions == [0] and stores.store_of(0).is_empty()  # never folded onto a partial restore
    finally:
        restores.close()
        stores.close()


def test_closing_cancels_a_restore_and_what_it_left_is_never_folded_onto(tmp_path):
    stores, restorer = PartitionStores(tmp_path, TOPIC), Restorer()
    restores = Restores(stores, restorer)
    restores.start(0)
    restores.close()  # returns: the restore saw the cancel
    assert restorer.cancelled == [0] and not restores
    assert stores.open(0).is_empty()  # keys without a position are dropped when the slot opens
    stores.close()
