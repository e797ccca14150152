"""State owned by partition: one RocksDB store per `<ns>.events` partition.

Why one store per partition (Kafka Streams keeps one per task): ownership of
partitions moves between workers. A worker that owns partitions {0, 2} must
answer reads from exactly their state -- not from a copy of partition 1 it
folded while it owned it, which stops moving the moment ownership leaves. With
a store per partition, "what this worker may answer" is "the stores it has
open", a worker hands a partition over by closing its store (the directory
stays: if the partition comes back, folding resumes from its position), and a
store can be snapshotted and restored on its own.

Every key a judge writes belongs to the partition of the proposal being
judged: one partition owns each thread's state (processors/judge.py refuses a
proposal keyed for another partition; a fork's second step is a proposal on
the destination's partition). So the stores never overlap, and a key is found
in at most one of them.

`PartitionStores` is also the read surface over the partitions open here: a
`get` asks each open store (at most one holds the key), a `scan` merges their
ordered scans -- the same surface as one `Store`, so the stores' facades do
not care how state is split.
"""

from __future__ import annotations

import fcntl
import heapq
import json
import os
import threading
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from .incarnation import MARKER
from .store import BESIDE, DROPPED, Store, discard, sweep


class Slot:
    """A state directory held by one process (a lock file, released at exit).

    Each client takes the first free numbered slot, so a restarted process
    reuses its stores and resumes from their positions, while concurrent
    clients of one namespace never share one.
    """

    def __init__(self, path: Path, locks: list[IO[bytes]]) -> None:
        self.path = path
        self._locks = locks

    def release(self) -> None:
        for lock in self._locks:
            if not lock.closed:
                lock.close()  # closing the descriptor drops the flock


def _lock_names(path: str | os.PathLike) -> list[Path]:
    """Every lock file of the slot at `path`: `<name>.lock` beside the name it is
    held by, and beside its real directory when that name is a symlink.

    Why both: a slot may be a symlink (to a bigger disk) and be named either
    way. Locked only under the name a process claimed, a `rebuild --store`
    naming the real directory saw no holder and dropped the slot under it;
    locked only under the real path, one naming the link did (reviews)."""
    named = Path(os.path.abspath(path))
    real = named.resolve()
    return [_lock_file(named)] if real == named else [_lock_file(named), _lock_file(real)]


def _take(path: Path) -> list[IO[bytes]] | None:
    """The slot's locks (`_lock_names`) taken, or None (none kept) while another process holds one."""
    taken: list[IO[bytes]] = []
    for name in _lock_names(path):
        handle = open(name, "ab")  # noqa: SIM115 - held for the slot's life
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            for other in taken:
                other.close()
            return None
        taken.append(handle)
    return taken


def claim_slot(base: str | os.PathLike, max_slots: int = 64) -> Slot:
    base = Path(base)
    base.mkdir(parents=True, exist_ok=True)
    for n in range(max_slots):
        path = base / f"slot-{n}"
        handles = _take(path)
        if handles is None:
            continue
        if (path / "CURRENT").exists():
            # A slot from before state was split by partition (one RocksDB for
            # everything): derived state, rebuilt from the log.
            discard(path)
        _sweep_slot(path)
        path.mkdir(parents=True, exist_ok=True)
        return Slot(path, handles)
    raise RuntimeError(f"no free state slot under {base} ({max_slots} in use)")


def _lock_file(path: str | os.PathLike) -> Path:
    """The lock file of the slot at `path` (`<base>/slot-N.lock`)."""
    return Path(path).parent / f"{Path(path).name}.lock"


def hold_slot(path: str | os.PathLike) -> Slot | None:
    """The slot at `path` (a `<base>/slot-N` directory) held by this process, or
    None while another process holds it -- the same locks `claim_slot` takes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handles = _take(path)
    if handles is None:
        return None
    _sweep_slot(path)
    return Slot(path, handles)


def _sweep_slot(path: Path) -> None:
    """What a crash left of the slot at `path`, now held: the slot itself being
    discarded (beside it) and its stores or snapshot checkpoints (inside)."""
    sweep(path.parent, of=f"{path.name}.")
    sweep(path)


def slot_held(path: str | os.PathLike) -> bool:
    """Is the slot at `path` held now (the lock `claim_slot` and `hold_slot` take)?
    Asked without creating anything (`hold_slot` makes the lock file and its
    folder): a caller that refuses before it holds the slot leaves no `<slot>.lock`."""
    for name in _lock_names(path):
        try:
            handle = open(name, "rb")  # noqa: SIM115 - closed below
        except FileNotFoundError:
            continue  # never claimed under this name: nobody holds it so
        with handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # dropped as it closes
            except BlockingIOError:
                return True
    return False


def slot_holder(path: str | os.PathLike) -> int | None:
    """The pid holding the slot at `path`, when /proc/locks says (Linux), else None."""
    for name in _lock_names(path):
        try:
            inode = os.stat(name).st_ino
            with open("/proc/locks") as locks:
                for line in locks:
                    fields = line.split()
                    if len(fields) > 5 and fields[1] == "FLOCK" and fields[5].endswith(f":{inode}"):
                        return int(fields[4])
        except (OSError, ValueError):
            pass
    return None


class PartitionStores:
    """The stores of the events partitions this process owns, under one directory."""

    def __init__(self, path: str | os.PathLike, topic: str) -> None:
        self.path = Path(path)
        self.topic = topic
        self._stores: dict[int, Store] = {}
        self._guard = threading.Lock()
        # Held by the judge from reading state to writing its batch (tests hold
        # it to make a judge lag behind the log). Not reentrant on purpose: a
        # test's holder releases it from another thread than the one that took it.
        self.lock = threading.Lock()

    def dir_of(self, partition: int) -> Path:
        return self.path / f"events-{partition}"

    # -- ownership ----------------------------------------------------------------------
    def open(self, partition: int) -> Store:
        with self._guard:
            store = self._stores.get(partition)
            if store is None:
                store = Store(self.dir_of(partition))
                if store.offset(self.topic, partition) == 0 and not store.is_empty():
                    # Keys without a position: a snapshot restore that did not finish
                    # (a judge writes state and position in one batch, so nothing else
                    # leaves this). Folding from offset 0 onto it would judge the log
                    # against part of its own future: checked here, once, for every
                    # role (a worker, an embedded client, `serve`) that opens the slot.
                    store.destroy()
                    store = Store(self.dir_of(partition))
                self._stores[partition] = store
            return store

    def close_partition(self, partition: int) -> None:
        """Stop serving a partition; its directory stays for a later return."""
        with self._guard:
            store = self._stores.pop(partition, None)
        if store is not None:
            with self.lock:
                store.close()

    def replace(self, partition: int) -> Store:
        """An empty store for `partition`, served at once, dropping what was there."""
        store = self.fresh(partition)
        self.adopt(partition, store)
        return store

    def fresh(self, partition: int) -> Store:
        """An empty store for `partition`, dropping what was there, and not served
        until `adopt`: a restore fills it on its own thread, unseen by reads."""
        with self._guard:
            old = self._stores.pop(partition, None)
        if old is not None:
            old.destroy()
        else:
            discard(self.dir_of(partition))
        return Store(self.dir_of(partition))

    def local(self, partition: int) -> Store:
        """`partition`'s store from an earlier ownership, opened but not served until `adopt`."""
        return Store(self.dir_of(partition))

    def beside(self, partition: int) -> Store:
        """An empty store next to `partition`'s (closed, unserved) one, which stays
        whole until `swap_in`: a restore that may fail keeps the store it would
        replace. A crash leaves it to `sweep`."""
        path = self.path / f".{self.dir_of(partition).name}{BESIDE}"
        discard(path)
        return Store(path)

    def swap_in(self, partition: int, store: Store) -> Store:
        """`store` (from `beside`, filled) in place of `partition`'s directory:
        closed, moved, and returned opened there, not served until `adopt`. The
        old directory is moved aside first and back if the move in fails (a
        review: deleted first, a failed rename lost both); a crash in between
        leaves no local store (restored again) and the old one to `sweep`."""
        source, target = Path(store.path), self.dir_of(partition)
        store.close()
        aside = self.path / f".{target.name}{DROPPED}{uuid.uuid4().hex}"
        if target.exists():
            os.rename(target, aside)
        try:
            os.rename(source, target)
        except BaseException:
            if aside.exists():
                os.rename(aside, target)
            raise
        discard(aside)
        return Store(target)

    def adopt(self, partition: int, store: Store) -> None:
        """Serve `store` (from `fresh`, filled) as `partition`'s."""
        with self._guard:
            if partition in self._stores:
                raise RuntimeError(f"partition {partition} already has a store")
            self._stores[partition] = store

    def has_local(self, partition: int) -> bool:
        """A directory from an earlier ownership exists (folding resumes there)."""
        return (self.dir_of(partition) / "CURRENT").exists()

    def store_of(self, partition: int) -> Store:
        store = self._stores.get(partition)
        if store is None:
            raise KeyError(partition)
        return store

    @property
    def partitions(self) -> list[int]:
        return sorted(self._stores)

    # -- the read surface (as one Store) ------------------------------------------------
    def _chosen(self, partitions: Iterable[int] | None) -> list[Store]:
        stores = dict(self._stores)
        if partitions is None:
            return [stores[p] for p in sorted(stores)]
        return [stores[p] for p in partitions if p in stores]

    def get(self, k: bytes, partitions: Iterable[int] | None = None) -> bytes | None:
        for store in self._chosen(partitions):
            raw = store.get(k)
            if raw is not None:
                return raw
        return None

    def get_json(self, k: bytes) -> Any:
        raw = self.get(k)
        return None if raw is None else json.loads(raw)

    def scan(self, prefix: bytes, start: bytes | None = None,
             partitions: Iterable[int] | None = None) -> Iterator[tuple[bytes, bytes]]:
        """Keys with `prefix` over the chosen partitions, ascending (a k-way merge)."""
        scans = [store.scan(prefix, start) for store in self._chosen(partitions)]
        if len(scans) == 1:
            return scans[0]
        return heapq.merge(*scans, key=lambda kv: kv[0])

    def offset(self, topic: str, partition: int) -> int:
        store = self._stores.get(partition)
        return 0 if store is None else store.offset(topic, partition)

    def close(self) -> None:
        with self._guard:
            stores, self._stores = self._stores, {}
        for store in stores.values():
            store.close()

    def destroy(self) -> None:
        self.close()
        discard(self.path, last=MARKER)  # whole or gone, whenever a crash comes (`discard`)
