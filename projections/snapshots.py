"""State snapshots of one events partition's store on the compacted topic `<ns>.snapshots`.

Why: a worker taking over a partition must not replay its whole history;
restoring a snapshot costs about the size of the state, and the worker then
folds only the events after the snapshot's tracking position.

Layout of partition p of the snapshots topic (it holds events partition p's
snapshots; every key of a per-partition `Store` belongs to that partition):

* chunks, key `snap|<snapshotId>|<chunkNo:08d>`: `MAGIC` + CRC-32 of the
  payload + payload. The payloads of one snapshot, concatenated in chunk
  order, are the store's pairs in key order, each `>II` (key length, value
  length) + key + value; a chunk is cut every `CHUNK_BYTES` of that stream,
  wherever it falls (a pair may span chunks, so any value size fits);
* then one manifest, key `manifest`, JSON: `snapshotId`, `chunks`, `bytes`
  (payload bytes), `keys`, `position` (the tracking offset of events partition
  p found in the snapshot), `positions` (every tracking offset in it),
  `firstOffset` (log offset of chunk 0), `createdAt`, `previous`;
* after the manifest is acknowledged, tombstones for the previous snapshot's
  chunks (and any chunks a crashed writer left without a manifest).

Compaction then keeps one manifest and one snapshot's chunks per partition.
A snapshot is complete when its manifest is there and every chunk is present
with a good CRC; `restore` takes the latest complete one and never a partial
one (chunks without a manifest are invisible; a manifest whose chunks were
tombstoned falls back to an older complete snapshot still in the log).

Consistency: `Store.snapshot_items` reads a RocksDB checkpoint, so a judge
applying batches on another thread cannot tear a snapshot -- its state and
its tracking offset are from the same instant.
"""

from __future__ import annotations

import contextlib
import json
import logging
import struct
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition

from threadlog.kernel import kafka_config
from threadlog.kernel.errors import invalid_argument, unavailable

from .store import Store, offset_key_parts

log = logging.getLogger("threadlog.snapshots")

CHUNK_BYTES = 512 * 1024
MANIFEST_KEY = b"manifest"
CHUNK_PREFIX = b"snap|"
MAGIC = b"TLS1"
FORMAT = 1
_PAIR = struct.Struct(">II")
_HEADER = len(MAGIC) + 4
# Restore writes the store in batches of about this many bytes.
APPLY_BYTES = 4 * 1024 * 1024
# The latest manifest is searched from the end of the log backwards: the last
# record first (where a writer that finished puts it), then windows of this
# many records, growing 16x each time.
TAIL_WINDOW = 16


@dataclass(frozen=True)
class SnapshotInfo:
    snapshot_id: str
    partition: int
    chunks: int
    bytes: int  # payload bytes (the encoded pairs)
    keys: int
    position: int | None  # tracking offset of events partition `partition` in the snapshot
    positions: dict[tuple[str, int], int]  # every tracking offset in the snapshot
    first_offset: int  # log offset of chunk 0 (of the manifest when there are no chunks)
    tombstoned: int  # chunk keys of earlier snapshots tombstoned after this manifest
    seconds: float


def summary(info: SnapshotInfo | RestoreInfo) -> dict[str, Any]:
    """`info` as JSON-ready fields (operators' stats): all but the tuple-keyed `positions`."""
    return {k: v for k, v in asdict(info).items() if k != "positions"}


@dataclass(frozen=True)
class RestoreInfo:
    position: int | None
    keys: int
    bytes_read: int  # keys + values of every record read from the snapshots topic
    records_read: int
    seconds: float
    snapshot_id: str = ""
    positions: dict[tuple[str, int], int] = field(default_factory=dict)


@dataclass(frozen=True)
class Origin:
    """The log a snapshot's state was folded from: the events topic, and its Kafka
    topic id when known (a topic deleted and created again under the same name
    gets another id; None: the id could not be read, see projections/incarnation.py)."""

    topic: str
    topic_id: str | None = None


# -- encoding ------------------------------------------------------------------


def chunk_key(snapshot_id: str, n: int) -> bytes:
    return CHUNK_PREFIX + f"{snapshot_id}|{n:08d}".encode()


def parse_chunk_key(k: bytes) -> tuple[str, int] | None:
    if not k.startswith(CHUNK_PREFIX):
        return None
    sid, sep, n = k[len(CHUNK_PREFIX):].decode(errors="replace").rpartition("|")
    if not sep or not n.isdigit():
        return None
    return sid, int(n)


def encode_chunks(pairs: Iterator[tuple[bytes, bytes]], chunk_bytes: int = CHUNK_BYTES,
                  on_pair: Callable[[bytes, bytes], None] | None = None) -> Iterator[bytes]:
    """The chunk values (header + payload) of `pairs`, cut every `chunk_bytes` of payload."""
    buf = bytearray()
    for k, v in pairs:
        if on_pair is not None:
            on_pair(k, v)
        buf += _PAIR.pack(len(k), len(v))
        buf += k
        buf += v
        while len(buf) >= chunk_bytes:
            payload = bytes(buf[:chunk_bytes])
            del buf[:chunk_bytes]
            yield _frame(payload)
    if buf:
        yield _frame(bytes(buf))


def _frame(payload: bytes) -> bytes:
    return MAGIC + struct.pack(">I", zlib.crc32(payload)) + payload


def _payload(value: bytes) -> bytes | None:
    """The payload of a chunk value, or None when its header or CRC is wrong."""
    if len(value) < _HEADER or value[: len(MAGIC)] != MAGIC:
        return None
    payload = value[_HEADER:]
    (crc,) = struct.unpack(">I", value[len(MAGIC) : _HEADER])
    return payload if zlib.crc32(payload) == crc else None


def decode_pairs(payloads: Iterator[bytes]) -> Iterator[tuple[bytes, bytes]]:
    """The pairs of a snapshot's payloads, concatenated in chunk order."""
    buf = bytearray()
    for payload in payloads:
        buf += payload
        pos, end = 0, len(buf)
        while end - pos >= _PAIR.size:
            klen, vlen = _PAIR.unpack_from(buf, pos)
            stop = pos + _PAIR.size + klen + vlen
            if stop > end:
                break
            k0 = pos + _PAIR.size
            yield bytes(buf[k0 : k0 + klen]), bytes(buf[k0 + klen : stop])
            pos = stop
        del buf[:pos]
    if buf:
        raise ValueError(f"snapshot stream ends inside a pair ({len(buf)} bytes left)")


def _tracking_position(positions: dict[tuple[str, int], int], partition: int,
                       tracking_topic: str | None) -> int | None:
    if tracking_topic is not None:
        return positions.get((tracking_topic, partition))
    mine = {t: v for (t, p), v in positions.items() if p == partition}
    if len(mine) == 1:
        return next(iter(mine.values()))
    events = [v for t, v in mine.items() if t.endswith(".events")]
    return events[0] if len(events) == 1 else None


# -- reading the log -------------------------------------------------------------


@dataclass
class _Segment:
    """What one read of the snapshots partition saw."""

    manifests: list[dict[str, Any]] = field(default_factory=list)  # in log order
    chunks: dict[str, dict[int, bytes]] = field(default_factory=dict)  # kept snapshot ids only
    live: set[bytes] = field(default_factory=set)  # chunk keys whose latest record is not a tombstone
    dead: set[bytes] = field(default_factory=set)  # chunk keys whose latest record is a tombstone
    records: int = 0
    bytes: int = 0


def _consumer(bootstrap: str, client_id: str, kafka: Mapping[str, Any] | None) -> Consumer:
    return Consumer(kafka_config.consumer(
        bootstrap, f"{client_id}.snapshots", kafka,
        # No transactions on this topic; EOF events say a read reached the end.
        **{"enable.partition.eof": True, "isolation.level": "read_uncommitted", "fetch.wait.max.ms": 10},
    ))


_RETRIABLE = {KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE,
              KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._TIMED_OUT, KafkaError._TRANSPORT,
              KafkaError.REQUEST_TIMED_OUT}


def _position(k: bytes, v: bytes) -> tuple[tuple[str, int], int] | None:
    """((topic, partition), offset) of a stored tracking position (projections/store.py
    writes them), or None for any other pair."""
    where = offset_key_parts(k)
    return None if where is None or len(v) != 8 else (where, struct.unpack(">q", v)[0])


def _unless_cancelled(cancel: threading.Event | None, topic: str, partition: int) -> None:
    """UNAVAILABLE once `cancel` is set: checked before each request and each write of a restore."""
    if cancel is not None and cancel.is_set():
        raise unavailable(f"{topic}[{partition}]: restore cancelled (the reader is stopping)")


def _watermarks(consumer: Consumer, topic: str, partition: int, deadline: float,
                cancel: threading.Event | None = None) -> tuple[int, int]:
    """(low, high) of the partition; a leader election or a topic just created is waited out."""
    last = ""
    while True:
        _unless_cancelled(cancel, topic, partition)
        try:
            low, high = consumer.get_watermark_offsets(
                TopicPartition(topic, partition), timeout=max(0.1, min(5.0, deadline - time.monotonic())))
            if low >= 0 and high >= 0:
                return low, high
            last = f"no leader (offsets {low}, {high})"
        except KafkaException as exc:
            err = exc.args[0] if exc.args else None
            if not (isinstance(err, KafkaError) and (err.retriable() or err.code() in _RETRIABLE)):
                raise unavailable(f"cannot read the offsets of {topic}[{partition}]: "
                                  f"{kafka_config.error_text(exc)}") from None
            last = kafka_config.error_text(exc)
        if time.monotonic() >= deadline:
            raise unavailable(f"cannot read the offsets of {topic}[{partition}]: {last}")
        time.sleep(0.05)  # a retry backoff, not synchronization


def _read(consumer: Consumer, topic: str, partition: int, start: int, stop: int, stall: float,
          keep: Callable[[str], bool], seg: _Segment | None = None,
          cancel: threading.Event | None = None) -> _Segment:
    """Records [start, stop) of the partition (a compacted log may have gaps),
    failing UNAVAILABLE when `stall` seconds pass with no record read.

    A stall, not a deadline: a restore reads one snapshot, as long as its state
    is large. Bounded by the request timeout as a whole, a restore of a large
    partition always failed and its new owner folded the whole history instead
    (a review)."""
    seg = seg if seg is not None else _Segment()
    if start >= stop:
        return seg
    consumer.assign([TopicPartition(topic, partition, start)])
    quiet_until = time.monotonic() + stall
    try:
        while True:
            _unless_cancelled(cancel, topic, partition)
            left = quiet_until - time.monotonic()
            if left <= 0:
                raise unavailable(f"{topic}[{partition}]: nothing read for {stall:g}s between {start} and {stop}")
            msgs = kafka_config.drain(consumer, 1000, min(left, 0.5))
            for msg in msgs:
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        return seg
                    raise unavailable(f"cannot read {topic}[{partition}]: {err.str()}")
                off = msg.offset()
                if off >= stop:
                    return seg
                _take(seg, msg, keep)
                if off + 1 >= stop:
                    return seg
            if msgs:  # after taking them: the stall is time spent waiting, not working
                quiet_until = time.monotonic() + stall
    finally:
        consumer.unassign()


_MANIFEST_INTS = ("bytes", "keys", "firstOffset", "partition")  # optional; `chunks` is required


def _well_formed(m: Any) -> bool:
    """Is `m` a manifest every later step can read without raising?

    Why checked here, once: a manifest is read by every restore and every
    writer's discovery, and anyone who may write the snapshots topic can put
    one there. Tried (a review): `"chunks": 1e400` (an OverflowError) or a
    manifest nested 200 000 levels deep (a RecursionError) escaped, so every
    later snapshot write of the partition failed for good and restores fell
    back to judging from offset 0 instead of taking the older snapshot."""
    if not isinstance(m, dict) or m.get("format") != FORMAT or not isinstance(m.get("snapshotId"), str):
        return False
    if type(m.get("chunks")) is not int or m["chunks"] < 0:
        return False
    if any(k in m and type(m[k]) is not int for k in _MANIFEST_INTS):
        return False
    if m.get("position") is not None and type(m["position"]) is not int:
        return False
    positions = m.get("positions", [])
    return isinstance(positions, list) and all(
        isinstance(e, list) and len(e) == 3 and isinstance(e[0], str) and type(e[1]) is int and type(e[2]) is int
        for e in positions)


def _take(seg: _Segment, msg: kafka_config.Consumed, keep: Callable[[str], bool]) -> None:
    k, v = msg.key() or b"", msg.value()
    seg.records += 1
    seg.bytes += len(k) + (len(v) if v is not None else 0)
    if k == MANIFEST_KEY:
        if v is None:
            return
        try:
            m = json.loads(v)
            if not _well_formed(m):
                raise ValueError("not a manifest")
        except (ValueError, KeyError, TypeError, OverflowError, RecursionError):
            log.warning("malformed snapshot manifest at %s[%s]@%s ignored", msg.topic(), msg.partition(),
                        msg.offset())
            return
        seg.manifests.append(m)
        return
    parsed = parse_chunk_key(k)
    if parsed is None:
        return
    sid, n = parsed
    if v is None:
        seg.live.discard(k)
        seg.dead.add(k)
        held = seg.chunks.get(sid)
        if held is not None:
            held.pop(n, None)
        return
    seg.live.add(k)
    seg.dead.discard(k)
    if keep(sid):
        seg.chunks.setdefault(sid, {})[n] = v


def _complete(m: dict[str, Any], seg: _Segment) -> list[bytes] | None:
    """The payloads of manifest `m`'s snapshot in chunk order, if all are present and sound."""
    held = seg.chunks.get(m["snapshotId"], {})
    payloads = []
    for n in range(int(m["chunks"])):
        value = held.get(n)
        payload = None if value is None else _payload(value)
        if payload is None:
            return None
        payloads.append(payload)
    if sum(len(p) for p in payloads) != int(m.get("bytes", -1)):
        return None
    return payloads


# -- writing ------------------------------------------------------------------------


@dataclass
class _Run:
    """One snapshot being written."""

    snapshot_id: str
    keys: list[bytes] = field(default_factory=list)  # chunk keys produced
    nbytes: int = 0
    pairs: int = 0
    positions: dict[tuple[str, int], int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    undelivered: bool = False  # records of it were refused or not acknowledged in time

    def on_pair(self, k: bytes, v: bytes) -> None:
        self.pairs += 1
        if (found := _position(k, v)) is not None:
            self.positions[found[0]] = found[1]

    def delivered(self, err: KafkaError | None, msg: Message) -> None:
        off = msg.offset()
        if err is not None:
            self.errors.append(err.str())
        elif off is not None:
            self.offsets.append(off)


class SnapshotWriter:
    """Writes snapshots of per-partition stores to the snapshots topic.

    One writer serves any number of partitions (calls are serialized). The
    first `write` of a partition reads that partition of the topic once, to
    learn which chunk keys are live (the previous snapshot's, and any a
    crashed writer left), so they are tombstoned after the new manifest.
    """

    def __init__(self, bootstrap: str, topic: str, client_id: str, kafka: Mapping[str, Any] | None = None,
                 *, origin: Origin | None = None, chunk_bytes: int = CHUNK_BYTES,
                 timeout: float = 60.0) -> None:
        if not 1024 <= chunk_bytes <= CHUNK_BYTES:
            raise invalid_argument(f"chunk_bytes must be within 1 KiB..{CHUNK_BYTES}, got {chunk_bytes}")
        self.bootstrap = bootstrap
        self.topic = topic
        self.client_id = client_id
        self.kafka = kafka
        self.origin = origin  # the log the stores are folded from: named in each manifest
        self.chunk_bytes = chunk_bytes
        self.timeout = timeout
        self._settings = kafka_config.producer(
            bootstrap, f"{client_id}.snapshots", kafka,
            # Cheap in librdkafka, no new dependency; state is mostly JSON.
            **{"linger.ms": 5, "compression.type": "lz4"})
        self._producer = Producer(self._settings)
        self.replacements = 0  # producers replaced after a write they did not deliver (operators, tests)
        self._lock = threading.Lock()
        # Set by `abort` (any thread, no lock): a write in progress gives up at its
        # next chunk or wait, and no new one starts.
        self._aborting = threading.Event()
        # Partitions given up (`abandon`, any thread): a write of one gives up as above.
        self._abandoned: frozenset[int] = frozenset()
        # partition -> chunk keys live on the topic that the next snapshot supersedes
        self._stale: dict[int, set[bytes]] = {}
        self._last: dict[int, str] = {}
        self._closed = False

    def write(self, partition: int, store: Store, timeout: float | None = None) -> SnapshotInfo:
        """A consistent copy of `store` to partition `partition`; returns once its
        manifest and the previous snapshot's tombstones are acknowledged."""
        with self._lock:
            if self._closed or self._aborting.is_set():
                raise invalid_argument("the snapshot writer is closed")
            return self._write(partition, store, timeout if timeout is not None else self.timeout)

    def abort(self) -> None:
        """Give up the write in progress, if any, and take no more (from any thread).

        Why: a worker stopping gracefully has already said it owns nothing, yet its
        judge holds the partitions until it stops, and it stopped only after the
        snapshot being written (seconds for a large store, up to twice the request
        timeout): all that time no worker served them. A half-written snapshot is
        never restored (it has no manifest), and the next owner's writer
        tombstones its chunks."""
        self._aborting.set()

    def abandon(self, given_up: set[int], owned: set[int]) -> None:
        """Ownership moved (any thread): a write of a partition given up gives up at its
        next chunk (none starts), one owned again may be written.

        Why (a review, reproduced): a write in progress when its partition moved
        finished, and its manifest was then the newest on the topic while the new
        owner -- which looks at the topic on its first write only -- never
        tombstoned it: a whole snapshot kept on the compacted topic for good, and
        read by every restore."""
        self._abandoned = (self._abandoned | given_up) - owned  # one assignment: readers see either

    def _check_abort(self, sid: str, partition: int) -> None:
        if self._aborting.is_set():
            raise unavailable(f"snapshot {sid} abandoned: the writer is stopping")
        if partition in self._abandoned:
            raise unavailable(f"snapshot {sid} abandoned: partition {partition} moved to another owner")

    def forget(self, partition: int) -> None:
        """The partition was given up: what this writer knew of its topic partition
        is stale (another owner wrote snapshots there and tombstoned ours), so the
        next write discovers it again -- else their chunks were never tombstoned
        and stayed on the compacted topic for good."""
        with self._lock:
            self._stale.pop(partition, None)
            self._last.pop(partition, None)

    def _write(self, partition: int, store: Store, timeout: float) -> SnapshotInfo:
        t0 = time.monotonic()
        deadline = t0 + timeout
        if partition not in self._stale:
            self._stale[partition] = self._discover(partition, deadline)
        run = _Run(f"{int(time.time() * 1000):013d}-{uuid.uuid4().hex[:12]}")
        try:
            return self._run(partition, store, run, t0, deadline)
        except BaseException:
            # Whatever of this snapshot reached the topic is superseded by the next one.
            self._stale[partition].update(run.keys)
            if run.undelivered and not self._aborting.is_set():
                self._replace_producer()
            raise

    def _replace_producer(self) -> None:
        """A new producer for the next write; the old one's records are purged.

        Why: librdkafka can leave a producer's partitions without a leader for
        good after a broker restart (#5430, producers/pump.py says more): every
        later snapshot would time out too, and takeovers would restore from
        older and older snapshots, folding more and more history. A write is
        rare (minutes apart), so a failed one replaces the producer: a
        connection, against snapshots stopped for good."""
        old, self._producer = self._producer, Producer(self._settings)
        self.replacements += 1
        log.warning("%s: a snapshot was not delivered; its producer is replaced", self.topic)
        try:
            old.purge()  # what is queued or in flight belongs to the failed write (superseded)
            old.flush(0)
        except Exception:  # pragma: no cover - it is dropped either way
            log.exception("purging a replaced snapshot producer failed")

    def _run(self, partition: int, store: Store, run: _Run, t0: float, deadline: float) -> SnapshotInfo:
        sid = run.snapshot_id
        with contextlib.closing(store.snapshot_items()) as items:
            for value in encode_chunks(items, self.chunk_bytes, run.on_pair):
                self._check_abort(sid, partition)
                k = chunk_key(sid, len(run.keys))
                self._produce(k, value, partition, run, deadline)
                run.keys.append(k)
                run.nbytes += len(value) - _HEADER
                if run.errors:
                    break
        self._await(f"snapshot {sid} chunks", run, deadline)
        self._check_abort(sid, partition)
        first = min(run.offsets) if run.offsets else -1
        position = _tracking_position(run.positions, partition, None if self.origin is None else self.origin.topic)
        manifest = {
            "format": FORMAT, "snapshotId": sid, "partition": partition, "chunks": len(run.keys),
            "bytes": run.nbytes, "keys": run.pairs, "position": position,
            "positions": [[t, p, o] for (t, p), o in sorted(run.positions.items())],
            "firstOffset": first, "createdAt": int(time.time() * 1000), "previous": self._last.get(partition),
        }
        if self.origin is not None:  # checked by `restore` (`_from_origin`)
            manifest["topic"], manifest["topicId"] = self.origin.topic, self.origin.topic_id
        run.offsets.clear()
        self._produce(MANIFEST_KEY, json.dumps(manifest).encode(), partition, run, deadline)
        self._await(f"snapshot {sid} manifest", run, deadline)
        if first < 0:
            first = run.offsets[0] if run.offsets else -1
        self._last[partition] = sid
        stale = self._stale[partition]
        for k in sorted(stale):
            self._produce(k, None, partition, run, deadline)
        self._await(f"tombstones of the snapshots before {sid}", run, deadline)
        if stale:
            # The manifest again, as the log's last record: a restore finds it
            # reading one record (compaction keeps only this copy anyway).
            self._produce(MANIFEST_KEY, json.dumps(manifest).encode(), partition, run, deadline)
            self._await(f"snapshot {sid} manifest", run, deadline)
        self._stale[partition] = set(run.keys)
        return SnapshotInfo(sid, partition, len(run.keys), run.nbytes, run.pairs, position, dict(run.positions),
                            first, len(stale), time.monotonic() - t0)

    def _produce(self, k: bytes, v: bytes | None, partition: int, run: _Run, deadline: float) -> None:
        while True:
            try:
                self._producer.produce(self.topic, v, k, partition=partition, on_delivery=run.delivered)
                self._producer.poll(0)
                return
            except BufferError:  # the local queue is full: let deliveries drain it
                if time.monotonic() > deadline:
                    run.undelivered = True
                    raise unavailable(f"{self.topic}[{partition}]: producer queue full past the deadline") from None
                self._producer.poll(0.05)

    def _await(self, what: str, run: _Run, deadline: float) -> None:
        while True:  # in slices: an abort does not wait out the deadline
            left = self._producer.flush(max(0.0, min(0.2, deadline - time.monotonic())))
            if not left or time.monotonic() >= deadline or self._aborting.is_set():
                break
        if left:  # (on an abort too: `_write` does not replace the producer of an aborted writer)
            run.undelivered = True
            raise unavailable(f"{what} not acknowledged by {self.topic} in time ({left} records pending)")
        if run.errors:
            run.undelivered = True
            raise unavailable(f"{what} not written to {self.topic}: {run.errors[0]}")

    def _discover(self, partition: int, deadline: float) -> set[bytes]:
        consumer = _consumer(self.bootstrap, self.client_id, self.kafka)
        try:
            low, high = _watermarks(consumer, self.topic, partition, deadline)
            seg = _read(consumer, self.topic, partition, low, high, max(0.1, deadline - time.monotonic()),
                        keep=lambda _sid: False)
        finally:
            consumer.close()
        if seg.manifests:
            self._last.setdefault(partition, seg.manifests[-1]["snapshotId"])
        return seg.live

    def close(self, timeout: float = 10.0) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._producer.flush(timeout)


# -- restoring -------------------------------------------------------------------------


def restore(bootstrap: str, topic: str, partition: int, store: Store, client_id: str,
            kafka: Mapping[str, Any] | None = None, timeout: float = 30.0,
            origin: Origin | None = None, cancel: threading.Event | None = None) -> RestoreInfo | None:
    """Fill the empty `store` from the latest complete snapshot on partition `partition` of `topic`.

    None when the partition holds no complete snapshot (the caller folds from
    offset 0). Reads the tail of the log for the latest manifest, then from its
    first chunk on; only if that snapshot is incomplete, the whole partition
    (to fall back to an older complete snapshot still in the log). Tracking
    offsets are written in the last batch: a store with keys but no offset is a
    restore that did not finish and must be destroyed, not folded onto.

    With `origin`, only a snapshot of that log is taken (`_from_origin`): of
    this partition, of this incarnation of the events topic, at a position the
    log has reached -- and the restored store must stand at that position, else
    UNAVAILABLE (the caller folds from offset 0 instead). `cancel` set: UNAVAILABLE
    at the next read or write (the owner is stopping).
    """
    t0 = time.monotonic()
    if not store.is_empty():
        raise invalid_argument(f"restore needs an empty store; {store.path} has keys")
    consumer = _consumer(bootstrap, client_id, kafka)
    try:
        # `timeout` bounds each request and each stall of reading, not the restore.
        # 1. The latest manifest: the end of the log backwards, keeping what is read.
        found = _latest_manifest(consumer, topic, partition, timeout, origin, cancel)
        if found is None:
            return None
        low, high, usable, latest, tails, stop = found
        records = sum(tail.records for tail in tails)
        nbytes = sum(tail.bytes for tail in tails)
        if latest is None:
            return None
        # 2. Its chunks before the tail read so far, from its first chunk on.
        sid = latest["snapshotId"]
        first = int(latest.get("firstOffset", -1))
        seg = _Segment()
        if int(latest["chunks"]) > 0:
            seg = _read(consumer, topic, partition, max(low, first if first >= 0 else low), stop, timeout,
                        keep=lambda s: s == sid, cancel=cancel)
            records, nbytes = records + seg.records, nbytes + seg.bytes
        for tail in reversed(tails):  # oldest to newest: later records win
            held = seg.chunks.setdefault(sid, {})
            for k in tail.dead:
                parsed = parse_chunk_key(k)
                if parsed is not None and parsed[0] == sid:
                    held.pop(parsed[1], None)
            held.update(tail.chunks.get(sid, {}))
        chosen = latest
        payloads = _complete(latest, seg) if usable(latest) else None
        if payloads is None:
            # 3. Incomplete (its chunks tombstoned by a racing writer, or corrupt):
            # the newest complete snapshot anywhere in the partition.
            log.warning("snapshot %s on %s[%s] is incomplete; searching the whole partition", sid, topic,
                        partition)
            seg = _read(consumer, topic, partition, low, high, timeout, keep=lambda _s: True, cancel=cancel)
            records, nbytes = records + seg.records, nbytes + seg.bytes
            for m in reversed(seg.manifests):
                payloads = _complete(m, seg) if usable(m) else None
                if payloads is not None:
                    chosen = m
                    break
            if payloads is None:
                return None
    finally:
        consumer.close()

    def vet(keys: int, positions: dict[bytes, bytes | None]) -> None:
        """Does what was decoded agree with the manifest? Asked before the
        positions are written: a store refused here never holds one."""
        if keys != int(chosen.get("keys", keys)):
            raise unavailable(f"snapshot {chosen['snapshotId']} of {topic}[{partition}] decoded to {keys} keys, "
                              f"its manifest says {chosen.get('keys')}: the store is incomplete")
        if origin is None:
            return
        found = (_position(k, v) for k, v in positions.items() if v is not None)
        at = dict(f for f in found if f is not None).get((origin.topic, partition), 0)
        if at != chosen["position"]:
            raise unavailable(f"snapshot {chosen['snapshotId']} of {topic}[{partition}] restored a store at "
                              f"{origin.topic}[{partition}]@{at}, its manifest says {chosen['position']}: not "
                              "folded onto")

    keys = _fill(store, payloads, cancel, topic, partition, vet)
    positions = {(str(t), int(p)): int(o) for t, p, o in chosen.get("positions", [])}
    return RestoreInfo(chosen.get("position"), keys, nbytes, records, time.monotonic() - t0,
                       chosen["snapshotId"], positions)


def _latest_manifest(consumer: Consumer, topic: str, partition: int, timeout: float, origin: Origin | None,
                     cancel: threading.Event | None
                     ) -> tuple[int, int, Callable[[dict[str, Any]], bool], dict[str, Any] | None, list[_Segment],
                                int] | None:
    """(the partition's low and high watermarks, which manifests are of `origin`'s
    log, the latest manifest or None, the segments read for it newest first, the
    offset they start at); None for an empty partition. Read from the end of
    the log backwards in growing windows, so a recent snapshot costs a few
    records to find."""
    low, high = _watermarks(consumer, topic, partition, time.monotonic() + timeout, cancel)
    if high <= low:
        return None
    usable = _from_origin(consumer, origin, partition, timeout, cancel)
    latest: dict[str, Any] | None = None
    tails: list[_Segment] = []
    stop, window = high, 1
    while stop > low and latest is None:
        start = max(low, stop - window)
        tail = _read(consumer, topic, partition, start, stop, timeout, keep=lambda _sid: True, cancel=cancel)
        tails.append(tail)
        if tail.manifests:
            latest = tail.manifests[-1]
        stop, window = start, (TAIL_WINDOW if window == 1 else window * 16)
    return low, high, usable, latest, tails, stop


def latest_position(bootstrap: str, topic: str, partition: int, client_id: str,
                    kafka: Mapping[str, Any] | None = None, timeout: float = 30.0,
                    origin: Origin | None = None, cancel: threading.Event | None = None) -> int | None:
    """The position of the latest snapshot of `origin`'s partition on `topic`
    (None: none, or the latest is not of that log), read as `restore` finds it,
    without its chunks: is a snapshot worth restoring over a kept local store?
    (A latest snapshot that turns out incomplete is refused by `restore`'s
    caller when what it falls back to is older: processors/restores.py.)"""
    consumer = _consumer(bootstrap, client_id, kafka)
    try:
        found = _latest_manifest(consumer, topic, partition, timeout, origin, cancel)
        if found is None:
            return None
        _, _, usable, latest, _, _ = found
        position = None if latest is None or not usable(latest) else latest.get("position")
        return position if type(position) is int else None
    finally:
        consumer.close()


def _from_origin(consumer: Consumer, origin: Origin | None, partition: int,
                 timeout: float, cancel: threading.Event | None = None) -> Callable[[dict[str, Any]], bool]:
    """Which manifests are of `origin`'s log at `partition` (every one without an origin).

    Why: the judge folds the log on from the restored position, so state from
    any other log would be judged onto as if it were this one's -- measured: a
    snapshot of another namespace's partition was restored and the new owner
    served that namespace's threads; after `<ns>.events` was deleted and created
    again (its snapshots topic kept), the old life's snapshot was restored at
    position 6 and the new log's acknowledged writes below 6 were never judged.
    So: this partition; this topic and, when both are known, its topic id
    (another incarnation has another); a position past 0 that the log has
    reached. A manifest of an earlier version, without a topic, is not taken
    (its partition is folded from offset 0: slower, never wrong).
    """
    if origin is None:
        return lambda _m: True
    end: list[tuple[int, int]] = []  # the log's (start, end), asked once

    def usable(m: dict[str, Any]) -> bool:
        position = m.get("position")
        # `type(...) is int`: JSON's true equals 1 in Python, so a manifest naming
        # partition `true` passed as partition 1's (a review).
        if (type(m.get("partition")) is not int or m.get("partition") != partition
                or m.get("topic") != origin.topic
                or (origin.topic_id is not None and m.get("topicId") != origin.topic_id)
                or type(position) is not int or position < 1):
            log.warning("snapshot %s on partition %d is not of %s[%d] (topic id %s): not restored",
                        m.get("snapshotId"), partition, origin.topic, partition, origin.topic_id)
            return False
        if not end:
            end.append(_watermarks(consumer, origin.topic, partition, time.monotonic() + timeout, cancel))
        start, stop = end[0]
        if position > stop:
            log.warning("snapshot %s stands at %s[%d]@%d, past the log's end %d: not restored",
                        m.get("snapshotId"), origin.topic, partition, position, stop)
            return False
        if position < start:
            # The records from there to the start are deleted: no judge could go on
            # from it (a review: a new owner restored such a snapshot and was stuck).
            log.warning("snapshot %s stands at %s[%d]@%d, before the log's start %d: not restored",
                        m.get("snapshotId"), origin.topic, partition, position, start)
            return False
        return True

    return usable


def _fill(store: Store, payloads: list[bytes], cancel: threading.Event | None, topic: str, partition: int,
          vet: Callable[[int, dict[bytes, bytes | None]], None] | None = None) -> int:
    """Write the snapshot's pairs into `store`, tracking offsets in the last batch.

    `cancel` is checked before each batch, the last included. Why: writing a
    large state takes as long as reading it, and a restore whose partition was
    revoked (or whose owner stops) held a restore thread, and a stopping
    process, until it was written whole. `vet(keys, tracking offsets)` is
    asked before the last batch too: a restore cut short or refused there
    leaves a store without a position, destroyed and never folded onto
    (checked after the last batch, a process exiting in between left one
    with a position its manifest contradicts, resumed from at the next start)."""
    batch: dict[bytes, bytes | None] = {}
    held: dict[bytes, bytes | None] = {}  # tracking offsets: written last
    size = keys = 0
    for k, v in decode_pairs(iter(payloads)):
        keys += 1
        if offset_key_parts(k) is not None:
            held[k] = v
            continue
        batch[k] = v
        size += len(k) + len(v)
        if size >= APPLY_BYTES:
            _unless_cancelled(cancel, topic, partition)
            store.apply(batch, {})
            batch, size = {}, 0
    batch.update(held)
    _unless_cancelled(cancel, topic, partition)
    if vet is not None:
        vet(keys, held)
    if batch:
        store.apply(batch, {})
    return keys
