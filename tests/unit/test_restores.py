"""Restores off the judge's thread (processors/restores.py), broker-free: real
RocksDB stores under PartitionStores; the restorer (a snapshot read, in
production) is a function writing keys and a position, held on an event so a
test decides when it ends."""

from __future__ import annotations

import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest
from threadlog.processors import restores as restores_mod
from threadlog.processors.restores import Restores
from threadlog.projections import partition_stores as partition_stores_mod
from threadlog.projections import snapshots
from threadlog.projections.partition_stores import PartitionStores
from threadlog.projections.store import Store, _offset_key

from threadlog.kernel.errors import UNAVAILABLE, ThreadLogError

TOPIC = "ns.events"


class Restorer:
    """Fills a store with one key and position 7 once released (or fails, or sees
    the cancel); `ran` lists the partitions it was called for, `cancelled` those
    whose cancel it saw."""

    def __init__(self, fail: bool = False) -> None:
        self.release = threading.Event()
        self.fail = fail
        self.ran: list[int] = []
        self.cancelled: list[int] = []

    def __call__(self, p: int, store, cancel: threading.Event):
        self.ran.append(p)
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


@pytest.fixture
def rig(tmp_path):
    """make(fail=False, restore=None) -> (stores, restorer, restores); all released and closed after the test."""
    made: list[tuple[PartitionStores, Restorer, Restores]] = []

    def make(fail: bool = False, restore: Callable | None = None, peek: Callable | None = None, gap: int = 10):
        stores, restorer = PartitionStores(tmp_path, TOPIC), Restorer(fail=fail)
        restores = Restores(stores, restore or restorer, peek, resume_gap=gap)
        made.append((stores, restorer, restores))
        return stores, restorer, restores

    yield make
    for stores, restorer, restores in made:
        restorer.release.set()
        restores.close()
        stores.close()


def _finished(restores: Restores, seconds: float = 10.0) -> list:
    """The first non-empty `finished`, or [] once no restore is left."""
    deadline = time.monotonic() + seconds
    while True:
        done = restores.finished()
        if done or not restores:
            return done
        assert time.monotonic() < deadline, "no restore ended"
        time.sleep(0.01)  # polled as the judge's loop polls it


def _served(restores: Restores, seconds: float = 10.0) -> list:
    """Every partition `finished` serves until no restore is left (as the judge's loop polls it)."""
    served: list = []
    deadline = time.monotonic() + seconds
    while restores:
        assert time.monotonic() < deadline, f"restores left: {restores.partitions}"
        served += restores.finished()
        time.sleep(0.01)
    return served


def _until(predicate, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "the condition did not hold"
        time.sleep(0.01)  # polled: a restore thread's progress announces nothing


def test_a_restored_partition_is_served_only_once_its_restore_ended(rig):
    stores, restorer, restores = rig()
    restores.start(0)
    assert restores.partitions == [0] and restores.finished() == []
    assert stores.partitions == [] and stores.get(b"k") is None  # the store being filled is not read
    restorer.release.set()
    assert [p for p, _ in _finished(restores)] == [0]
    assert stores.partitions == [0] and stores.get(b"k") == b"v" and stores.offset(TOPIC, 0) == 7
    assert not restores


def test_a_partition_revoked_mid_restore_cancels_it_and_is_not_served(rig):
    """A revoked restore held one of the PARALLEL threads, which partitions still
    assigned here may wait for (a review): it is cancelled at its next read, and
    what it wrote is never folded onto."""
    stores, restorer, restores = rig()
    restores.start(0)
    _until(lambda: stores.has_local(0))  # running: its fresh store exists
    assert restores.drop(0) is True and restores.drop(1) is False
    assert restores.partitions == []  # not assigned here any more
    _until(lambda: restorer.cancelled == [0])
    assert _finished(restores) == [] and not restores
    assert stores.partitions == [] and stores.open(0).is_empty()


def test_a_restore_that_ended_before_its_revoke_is_kept_for_a_return(rig):
    stores, restorer, restores = rig()
    restores.start(0)
    restorer.release.set()
    _until(lambda: restores._jobs[0].future.done())
    restores.drop(0)
    assert _finished(restores) == [] and stores.partitions == []  # closed, not served
    assert stores.open(0).offset(TOPIC, 0) == 7  # back later: resumed from it


def test_a_revoked_restore_frees_its_thread_for_a_partition_still_assigned(rig):
    """Tried (a review): partitions 0-3 restoring on the four threads, all four
    moved to another worker, partition 4 given here: it waited for all four
    snapshots to be read in full."""
    stores, restorer, restores = rig()
    for p in range(4):
        restores.start(p)
    _until(lambda: sorted(restorer.ran) == [0, 1, 2, 3])
    restores.start(4)
    for p in range(4):
        restores.drop(p)
    _until(lambda: 4 in restorer.ran)  # before any snapshot was released: a cancelled one freed its thread
    _until(lambda: sorted(restorer.cancelled) == [0, 1, 2, 3])
    restorer.release.set()
    assert [p for p, _ in _served(restores)] == [4] and stores.partitions == [4]


def test_a_partition_given_back_mid_restore_is_restored_not_folded_from_offset_0(rig):
    stores, restorer, restores = rig()
    restores.start(0)
    restores.drop(0)
    restores.start(0)  # assigned again: restored anew once the cancelled one ended (never two at once)
    restorer.release.set()
    assert [p for p, _ in _finished(restores)] == [0]
    assert stores.offset(TOPIC, 0) == 7


def test_a_failed_restore_serves_an_empty_store_folded_from_offset_0(rig):
    stores, restorer, restores = rig(fail=True)
    restores.start(0)
    restorer.release.set()
    assert _finished(restores) == [(0, None)]
    assert stores.partitions == [0] and stores.store_of(0).is_empty()  # never folded onto a partial restore


def test_closing_cancels_a_restore_and_what_it_left_is_never_folded_onto(rig):
    stores, restorer, restores = rig()
    restores.start(0)
    _until(lambda: restorer.ran == [0])
    restores.close()  # returns: the restore saw the cancel
    assert restorer.cancelled == [0] and not restores
    assert stores.open(0).is_empty()  # keys without a position are dropped when the slot opens


def test_a_restore_refused_after_it_wrote_its_position_is_never_resumed_from(rig):
    """snapshots.restore writes the position with its last batch, then may refuse
    the store (a key count or position its manifest contradicts). Tried: such a
    restore of a partition revoked meanwhile: its directory is gone, not kept."""
    release = threading.Event()

    def refused_late(p, store, cancel):
        release.wait(10)
        store.apply({b"k": b"partial"}, {(TOPIC, p): 7})
        raise RuntimeError("decoded to 3 keys, its manifest says 5")

    stores, _restorer, restores = rig(restore=refused_late)
    restores.start(0)
    restores.drop(0)
    release.set()
    assert _finished(restores) == [] and not restores
    assert not stores.has_local(0)


def test_a_restored_store_that_cannot_be_served_is_tried_again_not_dropped(rig, monkeypatch):
    """Dropped, the partition would stay assigned by the group and judged by no
    one until the next rebalance. Tried: the first replace fails (a full disk)."""
    monkeypatch.setattr(restores_mod, "RETRY_S", 0.05)
    stores, restorer, restores = rig(fail=True)
    real, calls = stores.replace, []

    def full_once(p):
        calls.append(p)
        if len(calls) == 1:
            raise OSError("No space left on device")
        return real(p)

    monkeypatch.setattr(stores, "replace", full_once)
    restores.start(0)
    restorer.release.set()
    assert _finished(restores) == [(0, None)] and calls == [0, 0]
    assert stores.partitions == [0]


def test_a_restored_store_failing_to_be_served_says_why_until_it_is_served(rig, monkeypatch):
    """`unserved` (what readiness reports): the last error of each restored
    partition still assigned here that failed to be served, until it is served."""
    monkeypatch.setattr(restores_mod, "RETRY_S", 0.05)
    stores, restorer, restores = rig(fail=True)
    real, full = stores.replace, threading.Event()
    full.set()

    def replace(p):
        if full.is_set():
            raise OSError("No space left on device")
        return real(p)

    monkeypatch.setattr(stores, "replace", replace)
    restores.start(0)
    restorer.release.set()
    _until(lambda: restores.finished() == [] and restores.unserved != {})  # polled as the judge polls it
    assert restores.unserved == {0: "OSError: No space left on device"} and restores.partitions == [0]
    full.clear()
    assert _finished(restores) == [(0, None)] and restores.unserved == {} and stores.partitions == [0]


def test_a_restore_still_queued_when_revoked_is_skipped_and_runs_if_given_back(rig):
    """Restores of partitions another worker now owns must not take the slots of
    those still assigned here. Tried: six started (four run at once), the last two
    revoked while queued: never read; one of them given back before its skip was
    collected: restored after all, not folded from offset 0."""
    stores, restorer, restores = rig()
    for p in range(6):
        restores.start(p)
    restores.drop(4)
    restores.drop(5)
    assert restores.partitions == [0, 1, 2, 3]
    restorer.release.set()
    _until(lambda: all(restores._jobs[p].future.done() for p in (4, 5)))
    restores.start(5)  # given back after its skip, before it was collected
    served = [p for p, _ in _served(restores)]
    assert sorted(restorer.ran) == [0, 1, 2, 3, 5] and sorted(served) == [0, 1, 2, 3, 5]
    assert stores.offset(TOPIC, 5) == 7 and not stores.has_local(4)


def test_closing_never_starts_a_queued_restore(rig):
    _stores, restorer, restores = rig()
    for p in range(8):
        restores.start(p)
    restores.close()
    assert len(restorer.ran) <= 4 and sorted(restorer.cancelled) == sorted(restorer.ran)


def test_a_restore_thread_that_raises_anyway_fails_alone(rig):
    """Tried (a review): a restore whose cleanup raised too (its store's destroy
    failing) made `finished` raise for every partition, every round: the others
    were never served and the worker never ready; `close` raised out of stop."""

    def restorer(p, store, cancel):
        if p == 0:
            def boom() -> None:  # Store.destroy closes, then deletes: the delete fails
                store.close()
                raise OSError("Device or resource busy")

            store.destroy = boom
            raise RuntimeError("the snapshot does not decode")
        store.apply({b"k": b"v"}, {(TOPIC, p): 7})

    stores, _restorer, restores = rig(restore=restorer)
    restores.start(0)
    restores.start(1)
    assert sorted(_served(restores)) == [(0, None), (1, None)] and stores.offset(TOPIC, 1) == 7



def test_a_process_that_exits_mid_restore_is_not_held_by_it(tmp_path):
    """Tried: a process whose worker never stopped (its main thread returned, or
    an embedded client was never closed) while a restore ran waited at exit for
    the restore to end -- the interpreter joins a ThreadPoolExecutor's threads.
    Here the restore never ends: the process must exit anyway."""
    script = f"""
import threading
from threadlog.processors.restores import Restores
from threadlog.projections.partition_stores import PartitionStores

started = threading.Event()

def restorer(p, store, cancel):
    started.set()
    threading.Event().wait()  # a snapshot read that never ends, and no stop to cancel it

Restores(PartitionStores({str(tmp_path)!r}, "ns.events"), restorer).start(0)
assert started.wait(10)
print("restoring", flush=True)
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("the process still waited for its restore 30 s after its main thread ended")
    assert "restoring" in out and proc.returncode == 0, err


def test_a_restore_cancelled_while_writing_its_state_stops_before_its_position(tmp_path, monkeypatch):
    """Tried: a restore revoked (or whose owner stops) after its snapshot was read
    wrote the whole state before it saw the cancel, holding a restore thread, and
    a stopping worker, that long. Now it stops before its next write batch; the
    position (written last) is never written, so the store is never folded onto."""
    monkeypatch.setattr(snapshots, "APPLY_BYTES", 1024)
    pairs = [(b"key-%04d" % i, b"v" * 200) for i in range(40)]
    pairs.append((_offset_key(TOPIC, 0), struct.pack(">q", 7)))
    payloads = [snapshots._payload(chunk) for chunk in snapshots.encode_chunks(iter(pairs))]
    store = Store(tmp_path / "s")
    cancel = threading.Event()
    batches: list[int] = []
    apply = store.apply

    def first_batch_then_revoked(mutations, positions):
        batches.append(len(mutations))
        cancel.set()  # the revoke lands while the first batch is written
        apply(mutations, positions)

    store.apply = first_batch_then_revoked  # type: ignore[method-assign]
    try:
        with pytest.raises(ThreadLogError) as raised:
            snapshots._fill(store, payloads, cancel, TOPIC, 0)  # type: ignore[arg-type]
        assert raised.value.code == UNAVAILABLE and len(batches) == 1
        assert store.offset(TOPIC, 0) == 0 and store.get(b"key-0039") is None
    finally:
        store.close()


def test_a_snapshot_its_manifest_refuses_never_writes_its_position(tmp_path):
    """Tried (a review): the key count and position were checked against the
    manifest after the last batch had written the position; a process exiting
    in between (restore threads are daemon threads) left a store with a
    position its manifest contradicts, resumed from at the next start. Now the
    check comes first, and a refused store holds no position."""
    pairs = [(b"key-%04d" % i, b"v") for i in range(10)] + [(_offset_key(TOPIC, 0), struct.pack(">q", 7))]
    payloads = [snapshots._payload(chunk) for chunk in snapshots.encode_chunks(iter(pairs))]
    store = Store(tmp_path / "s")
    vetted: list[tuple[int, list[int]]] = []

    def refuse(keys, positions):
        vetted.append((keys, [struct.unpack(">q", v)[0] for v in positions.values()]))
        raise ThreadLogError(UNAVAILABLE, "decoded to 11 keys, its manifest says 12")

    try:
        with pytest.raises(ThreadLogError):
            snapshots._fill(store, payloads, None, TOPIC, 0, refuse)  # type: ignore[arg-type]
        assert vetted == [(11, [7])] and store.offset(TOPIC, 0) == 0
    finally:
        store.close()


# -- a partition given back to a local store far behind its end (`floor`) -----------------
KEPT = 3  # the position of the local store kept from an earlier ownership


def _kept(stores: PartitionStores, p: int = 0) -> None:
    store = stores.open(p)
    store.apply({b"old": b"1"}, {(TOPIC, p): KEPT})
    stores.close_partition(p)  # given up: closed, its directory kept


def _snapshot_at(position: int, fail: bool = False, release: threading.Event | None = None) -> Callable:
    """A restorer filling the store beside the kept one up to `position`."""

    def restore(p, store, cancel):
        while release is not None and not release.wait(0.01):
            if cancel.is_set():
                raise ThreadLogError(UNAVAILABLE, "restore cancelled")
        store.apply({b"new": b"1"}, {(TOPIC, p): position})
        if fail:
            raise RuntimeError("decoded to 3 keys, its manifest says 5")
        return snapshots.RestoreInfo(position, 1, 10, 2, 0.01, "snap")

    return restore


def _entries(stores: PartitionStores) -> list:
    return list(stores.path.iterdir())


def _no_restore(p, store, cancel):
    raise AssertionError("restored though the kept store was resumed")


@pytest.mark.parametrize("latest", [None, KEPT + 9])  # no snapshot; one less than the gap (10) ahead
def test_a_kept_store_is_resumed_unless_a_snapshot_is_far_enough_ahead(rig, latest):
    stores, _restorer, restores = rig(restore=_no_restore, peek=lambda p, cancel: latest)
    _kept(stores)
    restores.start(0, floor=KEPT)
    assert _finished(restores) == [(0, None)]  # served, nothing restored
    assert stores.offset(TOPIC, 0) == KEPT and stores.get(b"old") == b"1"


def test_a_snapshot_far_ahead_of_a_kept_store_is_restored_in_its_place(rig):
    """Tried (a probe's helper, 2026-12-05): the store a worker kept of a partition
    it gave up was resumed whatever its age, and every record since judged again,
    however recent the partition's snapshot."""
    stores, _restorer, restores = rig(restore=_snapshot_at(KEPT + 10), peek=lambda p, cancel: KEPT + 10)
    _kept(stores)
    restores.start(0, floor=KEPT)
    [(p, info)] = _finished(restores)
    assert p == 0 and info is not None and info.position == KEPT + 10
    assert stores.offset(TOPIC, 0) == KEPT + 10 and stores.get(b"new") == b"1" and stores.get(b"old") is None
    assert not any(e.name.startswith(".") for e in _entries(stores))  # nothing left beside it


@pytest.mark.parametrize("how", ["fails", "older", "unknown"])
def test_a_kept_store_outlives_a_snapshot_restore_that_does_not_beat_it(rig, how):
    """Restored beside it, the kept store stays whole until the snapshot is in:
    a restore that fails (after writing), one that fell back to a snapshot older
    than the store, or a snapshot position that could not be read, resume it."""
    restore = _snapshot_at(KEPT + 10, fail=True) if how == "fails" else _snapshot_at(KEPT - 1)

    def peek(p, cancel):
        if how == "unknown":
            raise ThreadLogError(UNAVAILABLE, "cannot read the offsets")
        return KEPT + 10

    stores, _restorer, restores = rig(restore=restore, peek=peek)
    _kept(stores)
    restores.start(0, floor=KEPT)
    assert _finished(restores) == [(0, None)]
    assert stores.offset(TOPIC, 0) == KEPT and stores.get(b"old") == b"1" and stores.get(b"new") is None
    assert not any(e.name.startswith(".") for e in _entries(stores))


def test_a_kept_store_outlives_a_revoke_mid_restore_and_is_compared_again_when_given_back(rig):
    release = threading.Event()
    stores, _restorer, restores = rig(restore=_snapshot_at(KEPT + 10, release=release),
                                      peek=lambda p, cancel: KEPT + 10)
    _kept(stores)
    restores.start(0, floor=KEPT)
    _until(lambda: any(e.name.startswith(".") for e in _entries(stores)))  # restoring beside it
    restores.drop(0)
    assert _finished(restores) == [] and not restores
    assert stores.open(0).offset(TOPIC, 0) == KEPT  # the kept store, whole
    stores.close_partition(0)
    restores.start(0, floor=KEPT)  # given back: compared with the snapshot again
    release.set()
    assert [p for p, _ in _finished(restores)] == [0] and stores.offset(TOPIC, 0) == KEPT + 10


def test_a_kept_store_outlives_a_failed_swap(rig, monkeypatch):
    """Tried (a review): the restored store's move into place failed (a full
    disk): the kept store had been deleted first, so neither was left and the
    partition was judged again from offset 0. Now it is moved aside first and back."""
    stores, _restorer, restores = rig(restore=_snapshot_at(KEPT + 10), peek=lambda p, cancel: KEPT + 10)
    _kept(stores)
    real = partition_stores_mod.os.rename

    def full_disk(src, dst):
        if str(src).endswith(".restoring") and str(dst).endswith("events-0"):  # the move into place only
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(partition_stores_mod.os, "rename", full_disk)
    restores.start(0, floor=KEPT)
    assert _finished(restores) == [(0, None)]
    assert stores.offset(TOPIC, 0) == KEPT and stores.get(b"old") == b"1"
    assert not any(e.name.startswith(".") for e in _entries(stores))


def test_a_kept_store_that_does_not_open_is_restored_anew_not_folded_from_offset_0(rig, monkeypatch):
    """Tried (a review): a reader's iterator kept the closed store's RocksDB lock,
    the restore thread could not open it, and the partition was judged again
    from offset 0. The judge no longer serves a store it may hand over (opened
    unserved: `Judge._resumable`); one that still does not open is restored from
    its snapshot as if no store were kept."""
    stores, _restorer, restores = rig(restore=_snapshot_at(KEPT + 5), peek=lambda p, cancel: KEPT + 5)
    _kept(stores)

    def locked(p):
        raise OSError("lock hold by current process")

    monkeypatch.setattr(stores, "local", locked)
    restores.start(0, floor=KEPT)  # the snapshot is not `gap` (10) ahead: the store would be resumed
    [(p, info)] = _finished(restores)
    assert p == 0 and info is not None and stores.offset(TOPIC, 0) == KEPT + 5 and stores.get(b"old") is None
