"""A RocksDB store: materialized state plus tracking offsets.

One invariant lives here: **state and the position it reflects are written in
one atomic batch** (`apply`), so a crash between a fold and its offset is
impossible and a restarted folder resumes exactly where its state stands
(pyeventsourcing's "tracking" records). The events state has one store per
partition (projections/partition_stores.py); the delivery run index has its own.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import threading
import uuid
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

from rocksdict import AccessType, BlockBasedOptions, Cache, Checkpoint, Options, Rdict, WriteBatch

from .keys import dec_str, key

OFFSET_TAG = b"\x00off"
DELETED = None  # a mutation value of None deletes the key


def _offset_key(topic: str, partition: int) -> bytes:
    return key(OFFSET_TAG, topic) + struct.pack(">I", partition)


def offset_key_parts(k: bytes) -> tuple[str, int] | None:
    """(topic, partition) if `k` is a tracking-offset key (`_offset_key`), else None."""
    if not k.startswith(OFFSET_TAG):
        return None
    try:
        topic, pos = dec_str(k, len(OFFSET_TAG))
    except (ValueError, IndexError, UnicodeDecodeError):
        return None
    if len(k) - pos != 4:
        return None
    return topic, struct.unpack(">I", k[pos:])[0]


# One block cache for every store of the process (a worker has one store per
# partition it owns; RocksDB's default is a cache per store).
BLOCK_CACHE_BYTES = 128 * 1024 * 1024
_cache: Cache | None = None
_cache_lock = threading.Lock()


def _block_cache() -> Cache:
    global _cache
    with _cache_lock:
        if _cache is None:
            _cache = Cache(BLOCK_CACHE_BYTES)
        return _cache


def _options() -> Options:
    opt = Options(raw_mode=True)
    opt.create_if_missing(True)
    opt.set_max_background_jobs(2)
    opt.set_write_buffer_size(16 * 1024 * 1024)
    # Most point reads of a judged proposal miss: the id it claims, the blobs
    # it references, its proposal id (was it applied before?), GC markers.
    # Without filters a miss searched every table file: 13.7 us a get against
    # 6.2 us with them (bench/judge_cpu.py --appends 30000 --profile), about
    # 0.15 ms of the judge's CPU per checkpoint append. Whole-key bloom filters
    # on the tables (pinned for level 0, the youngest files) and the memtable.
    table = BlockBasedOptions()
    table.set_bloom_filter(10, False)
    table.set_block_cache(_block_cache())
    table.set_cache_index_and_filter_blocks(True)
    table.set_pin_l0_filter_and_index_blocks_in_cache(True)
    opt.set_block_based_table_factory(table)
    opt.set_memtable_prefix_bloom_ratio(0.1)
    opt.set_memtable_whole_key_filtering(True)
    return opt


DROPPED = ".dropped-"  # `.<name>.dropped-<id>`: a directory being deleted (`discard`)
SNAPSHOT = ".snapshot-"  # `.<name>.snapshot-<id>`: a checkpoint a snapshot reads (`Store.snapshot_items`)
BESIDE = ".restoring"  # `.<name>.restoring`: a restore beside a kept store (`PartitionStores.beside`)


def discard(path: Path, last: str | None = None) -> None:
    """Delete the directory `path` so that a crash at any moment leaves it whole or gone.

    Why: deleted in place, a crash midway left part of it -- a store whose
    RocksDB files were half gone (unopenable), or a slot whose incarnation
    marker was gone while old partitions' state stayed, which the next open took
    as it was (a review: SIGKILL during `rebuild`'s delete, then an open served
    the previous namespace's state). Renamed first (atomic on one filesystem) to
    a hidden name beside it, then deleted; `sweep` deletes what a crash left.
    A directory that cannot be renamed (a mount point, a symlink) is emptied in
    place instead, `last` (an entry's name) moved out last.
    """
    path = Path(path)
    if not path.exists():
        return
    if not path.is_symlink():
        gone = path.parent / f".{path.name}{DROPPED}{uuid.uuid4().hex}"
        try:
            os.rename(path, gone)
        except OSError:
            pass  # a mount point (EBUSY), a parent not ours to write (EACCES): emptied in place
        else:
            shutil.rmtree(gone, ignore_errors=True)
            return
    # In place (a symlink's target stays where the operator put it): every entry
    # moved into a hidden folder inside, `last` moved last -- a slot's marker,
    # so that a crash midway leaves a marker with fewer stores, never stores
    # without their marker -- then the folder deleted.
    inside = path / f"{DROPPED}{uuid.uuid4().hex}"
    inside.mkdir()
    entries = sorted((e for e in path.iterdir() if e != inside), key=lambda e: e.name == last)
    for entry in entries:
        os.rename(entry, inside / entry.name)
    shutil.rmtree(inside, ignore_errors=True)


def leftover(name: str, of: str = "") -> bool:
    """Is `name` what a crash leaves (of the entry named `of`, or of any): a
    directory `discard` had renamed, or the RocksDB checkpoint of a snapshot
    being taken?"""
    return name.startswith(f".{of}") and (DROPPED in name or SNAPSHOT in name or name.endswith(BESIDE))


def sweep(directory: Path, of: str = "") -> None:
    """Delete what a crash left in `directory` (`leftover`; with `of`, only that
    entry's): kept, they were disk for good -- snapshot checkpoints are hard
    links, doubling a store's disk once it compacted. Call it holding the slot
    `directory` is (or, with `of`, the slot named `of` in it)."""
    try:
        entries = list(Path(directory).iterdir())
    except OSError:
        return
    for entry in entries:
        if leftover(entry.name, of):
            shutil.rmtree(entry, ignore_errors=True)


class Store:
    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = Rdict(str(self.path), _options())
        self._lock = threading.Lock()
        self._closed = False

    # -- reads -------------------------------------------------------------
    def get(self, k: bytes) -> bytes | None:
        return self._db.get(k)

    def get_json(self, k: bytes) -> Any:
        raw = self._db.get(k)
        return None if raw is None else json.loads(raw)

    def scan(self, prefix: bytes, start: bytes | None = None) -> Iterator[tuple[bytes, bytes]]:
        """Keys with `prefix`, ascending by bytes, from `start` (inclusive) if given."""
        it = self._db.iter()
        it.seek(start if start is not None and start > prefix else prefix)
        while it.valid():
            k = it.key()
            if not k.startswith(prefix):
                break
            yield k, it.value()
            it.next()

    def offset(self, topic: str, partition: int) -> int:
        raw = self._db.get(_offset_key(topic, partition))
        return 0 if raw is None else struct.unpack(">q", raw)[0]

    def snapshot_items(self) -> Generator[tuple[bytes, bytes], None, None]:
        """Every key/value of the store as of one instant, ascending by key.

        The instant is the generator's first `next()`: a RocksDB checkpoint
        (hard links beside the store, memtable flushed) taken then and read
        back read-only, so batches `apply`-ed meanwhile on other threads are
        either wholly in or wholly out -- state and tracking offsets agree.
        (rocksdict 0.3's `Rdict.snapshot().iter()` does not read at the
        snapshot: it sees later writes, hence a checkpoint.) The checkpoint is
        deleted when the generator finishes or is closed: use
        `contextlib.closing` when not reading to the end.
        """
        path = self.path.parent / f".{self.path.name}{SNAPSHOT}{uuid.uuid4().hex}"
        try:
            Checkpoint(self._db).create_checkpoint(str(path))
            db = Rdict(str(path), Options(raw_mode=True), access_type=AccessType.read_only())
            try:
                it = db.iter()
                it.seek_to_first()
                while it.valid():
                    yield it.key(), it.value()
                    it.next()
                del it
            finally:
                db.close()
        finally:
            shutil.rmtree(path, ignore_errors=True)

    def is_empty(self) -> bool:
        return next(self.scan(b""), None) is None

    # -- the one write path --------------------------------------------------
    def apply(self, mutations: dict[bytes, bytes | None], positions: dict[tuple[str, int], int]) -> None:
        """Atomically write `mutations` and advance `positions` (topic, partition) -> next offset.

        A position only moves forward: state at a position reflects everything
        before it, so writing an earlier one would make a folder fold records
        again (reference counts, sequence numbers). Enforced here, once, for
        every folder, rather than trusted to each caller.
        """
        for (topic, partition), nxt in positions.items():
            current = self.offset(topic, partition)
            if nxt < current:
                raise ValueError(f"position of {topic}[{partition}] would move back from {current} to {nxt}")
        wb = WriteBatch(raw_mode=True)
        for k, v in mutations.items():
            if v is None:
                wb.delete(k)
            else:
                wb.put(k, v)
        for (topic, partition), nxt in positions.items():
            wb.put(_offset_key(topic, partition), struct.pack(">q", nxt))
        self._db.write(wb)

    @property
    def lock(self) -> threading.Lock:
        """Held by a writer from its position check to its `apply`."""
        return self._lock

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._db.close()

    def destroy(self) -> None:
        """Close and delete everything (a rebuild starts from an empty store)."""
        self.close()
        discard(self.path)
