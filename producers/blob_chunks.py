"""Blob content on `<ns>.blobs`: the chunk writer a put streams through, the reader a get fetches by offset.

A blob version is a run of chunk records, each keyed by its own *chunk key*
(blob key, version id, index), written straight to the compacted topic by an
idempotent producer -- no decider hop, no transaction: nobody can see a chunk
until the decider commits a manifest naming it. The manifest (an event on
`<ns>.events`) records where each chunk landed, (partition, offset, length),
so a read is a direct fetch at those offsets, never a scan.

Chunk keys are unique per version, so compaction never merges two versions;
a superseded version is reclaimed by tombstones for its chunk keys, written
in the same transaction as the manifest that replaced it. A reader therefore
verifies every record it fetches (chunk key, blob key, version, index,
length): a record at a manifest's offset either is exactly that chunk, or the
chunk is gone (compacted after a newer version replaced it) and the caller
re-reads the manifest. A stale or foreign chunk is never returned.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition
from threadlog.schemas import Codec, CodecError

from threadlog.kernel import kafka_config
from threadlog.kernel.errors import unavailable
from threadlog.kernel.partitioning import partition_for

from .pump import ProducerPump, for_good, produce_refused, within

if TYPE_CHECKING:
    from confluent_kafka.cimpl import DeliveryCallback  # only in the stubs

log = logging.getLogger("threadlog.blobs")

# Content bytes per chunk record. The topic allows 2 MiB records; 512 KiB keeps
# a range read's over-fetch small and a put's memory bounded (see WINDOW) while
# costing little throughput (measured in bench/blobs_bench.py).
CHUNK_SIZE = 512 * 1024
# The largest chunk content a manifest may name (the decider re-checks it).
MAX_CHUNK = 1024 * 1024
# Chunks of one put awaiting their acknowledgement: a put holds at most about
# WINDOW * CHUNK_SIZE bytes of the body (plus the caller's own buffer).
WINDOW = 16
CHUNK_TYPE = "threadlog.BlobChunk"

_VERSION = re.compile(r"[0-9a-f]{32}")


def new_version() -> str:
    """A put's version id: random, so chunk keys of two puts never collide."""
    return uuid.uuid4().hex


def is_version(value: object) -> bool:
    return isinstance(value, str) and _VERSION.fullmatch(value) is not None


def chunk_key(blob_key: str, version: str, index: int) -> str:
    """The Kafka key of one chunk: `<blob key>/<version>/<index>`.

    Injective: the version (32 hex) and the index (decimal) have fixed shapes
    and sit at the end, so the string splits back from the right into exactly
    one (blob key, version, index), whatever the blob key contains.
    """
    return f"{blob_key}/{version}/{index}"


def _zigzag_long(n: int) -> bytes:
    """Avro's encoding of a long: zig-zag, then base-128 varint."""
    n = (n << 1) ^ (n >> 63)
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def encode_chunk(codec: Codec, blob_key: str, version: str, index: int, data: bytes | bytearray | memoryview) -> bytes:
    """`codec.encode(CHUNK_TYPE, record)`, byte for byte, with one copy of `data`.

    fastavro's writer copies a bytes field through a buffer at ~180 MiB/s
    (measured), which capped put throughput. `data` is the record's last field,
    and Avro's binary encoding of a record is the concatenation of its fields',
    so the record encoded with empty data ends in the encoding of length 0 (one
    zero byte): replace it with the real length and append the bytes.
    """
    head = codec.encode(CHUNK_TYPE, {"blobKey": blob_key, "version": version, "index": index, "data": b""})
    assert head[-1:] == b"\x00"
    return b"".join((head[:-1], _zigzag_long(len(data)), data))


@dataclass(frozen=True)
class ChunkRef:
    partition: int
    offset: int
    length: int

    def as_avro(self) -> dict:
        return {"partition": self.partition, "offset": self.offset, "length": self.length}


class ChunkGone(Exception):
    """A chunk a manifest names is not at its offset any more (compacted away)."""


class ChunkSink:
    """One idempotent producer per client for chunk records and tombstones."""

    def __init__(self, bootstrap: str, topic: str, partitions: int, codec: Codec, client_id: str,
                 timeout: float, *, kafka: kafka_config.Props | None = None) -> None:
        self.topic = topic
        self.partitions = partitions
        self.codec = codec
        self.timeout = timeout
        settings = kafka_config.producer(
            bootstrap, f"{client_id}.blobs", kafka,
            **{
                "linger.ms": 2,
                "batch.size": 4 * CHUNK_SIZE,
                # A delivery that cannot succeed fails within the client's request
                # timeout (librdkafka's default is 5 minutes): a put is bounded.
                "message.timeout.ms": int(timeout * 1000),
            },
        )
        self._pump = ProducerPump(Producer(settings), f"blobs-pump:{client_id}", settings)

    def produce(self, key: str, value: bytes | None, on_delivery: DeliveryCallback | None = None) -> int:
        """Produce to the chunk key's partition (where its tombstone will go too)."""
        partition = partition_for(key, self.partitions)
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                self._pump.produce(self.topic, value, key.encode("utf-8"), partition=partition,
                                      on_delivery=on_delivery)
                return partition
            except BufferError:  # local queue full: let the pump drain it
                if time.monotonic() > deadline:  # it never drains (a producer failed for good)
                    raise unavailable("blob chunk not written: the chunk producer's queue stayed full") from None
                time.sleep(0.002)
            except KafkaException as exc:
                raise produce_refused(exc, "blob chunk") from None

    @property
    def producer(self) -> Producer:
        """The producer records go to now (ProducerPump replaces one that stopped delivering)."""
        return self._pump.producer

    def close(self) -> None:
        self._pump.stop(flush_timeout=10)


class ChunkWriter:
    """Streams one blob version into chunk records; remembers where each landed.

    Not thread-safe; one per put. Call `write` with pieces of any size, then
    `finish` for the chunk locations, or `discard` to tombstone what was written.
    """

    def __init__(self, sink: ChunkSink, blob_key: str, version: str) -> None:
        self.sink = sink
        self.blob_key = blob_key
        self.version = version
        self.size = 0
        self._loop = asyncio.get_running_loop()
        self._buf = bytearray()
        self._produced = 0
        self._pending: deque[tuple[int, asyncio.Future]] = deque()
        self._refs: list[ChunkRef] = []

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        self.size += len(view)
        if self._buf:
            need = CHUNK_SIZE - len(self._buf)
            self._buf += view[:need]
            view = view[need:]
            if len(self._buf) < CHUNK_SIZE:
                return
            await self._emit(self._buf)
            self._buf = bytearray()
        while len(view) >= CHUNK_SIZE:
            await self._emit(view[:CHUNK_SIZE])
            view = view[CHUNK_SIZE:]
        if len(view):
            self._buf += view

    async def finish(self) -> list[ChunkRef]:
        if self._buf:
            await self._emit(self._buf)
            self._buf = bytearray()
        while self._pending:
            await self._settle_one()
        return list(self._refs)

    def discard(self) -> None:
        """Tombstone every chunk produced so far (the put will not commit).

        Synchronous on purpose: it must also run when the put is cancelled. The
        tombstones follow their chunks through the same idempotent producer and
        partition, so they land after them and compaction reclaims both.
        """
        for index in range(self._produced):
            self.sink.produce(chunk_key(self.blob_key, self.version, index), None)
        for _, fut in self._pending:
            if not fut.done():
                fut.cancel()
        self._pending.clear()

    async def _emit(self, piece: bytes | bytearray | memoryview) -> None:
        index = self._produced
        value = encode_chunk(self.sink.codec, self.blob_key, self.version, index, piece)
        fut = self._loop.create_future()
        loop = self._loop
        length = len(piece)

        def delivered(err: KafkaError | None, msg: Message) -> None:
            if err is not None:
                # Not delivery_failure: a chunk timed out or purged in flight has an
                # unknown fate, but the put's is known -- failed, its manifest never
                # proposed. Purged in flight, its producer failed for good.
                gone = for_good(err) or err.code() == KafkaError._PURGE_INFLIGHT
                result: object = unavailable(f"blob chunk not written: {err}", retryable=not gone)
            else:
                # A delivered record has its partition and offset.
                result = ChunkRef(cast(int, msg.partition()), cast(int, msg.offset()), length)
            loop.call_soon_threadsafe(_settle, fut, result)

        self.sink.produce(chunk_key(self.blob_key, self.version, index), value, delivered)
        self._produced += 1
        self._pending.append((index, fut))
        while len(self._pending) >= WINDOW:
            await self._settle_one()

    async def _settle_one(self) -> None:
        index, fut = self._pending[0]
        try:
            # librdkafka reports within message.timeout.ms (the request timeout
            # unless a user's property says otherwise); this bounds the put anyway.
            ref = await within(fut, self.sink.timeout + 5)
        except TimeoutError:
            raise unavailable(f"blob chunk not acknowledged within {self.sink.timeout + 5:g}s: the blob "
                              "was not stored") from None
        self._pending.popleft()
        assert index == len(self._refs)
        self._refs.append(ref)


def _settle(fut: asyncio.Future, result: object) -> None:
    if fut.done():
        return
    if isinstance(result, BaseException):
        fut.set_exception(result)
    else:
        fut.set_result(result)


class ChunkReader:
    """Fetches chunks at known offsets with a small pool of assigned (group-less) consumers.

    read_uncommitted on purpose: chunks are not transactional, and a decider
    transaction open on a blobs partition (tombstones) must not hold a read back.
    """

    # A fetch position this many offsets before the next wanted chunk seeks
    # ahead instead of reading through other blobs' records.
    SEEK_GAP = 4
    # Measured on the local broker (bench/blobs_bench.py and a 4 KiB range
    # probe): a 1 MiB per-partition fetch halves a small range read's latency
    # against 4 MiB (less prefetched past the chunk) at the same whole-blob
    # rate; librdkafka's default fetch.queue.backoff.ms (1 s, applied once the
    # prefetch queue is full) made whole reads of 32 MiB blobs stall at random.
    SETTINGS = {
        "isolation.level": "read_uncommitted",
        "enable.partition.eof": True,
        "fetch.wait.max.ms": 5,
        "max.partition.fetch.bytes": MAX_CHUNK + 64 * 1024,
        "fetch.max.bytes": 16 * MAX_CHUNK,
        "queued.max.messages.kbytes": 16 * 1024,  # bounds the prefetch past the chunks wanted
        "fetch.queue.backoff.ms": 1,
    }

    def __init__(self, bootstrap: str, topic: str, partitions: int, codec: Codec, client_id: str, timeout: float,
                 pool: int = 8, *, kafka: kafka_config.Props | None = None) -> None:
        self.topic = topic
        self.partitions = partitions
        self.codec = codec
        self.timeout = timeout
        self._bootstrap = bootstrap
        self._kafka = kafka
        self._client_id = client_id
        self._pool = pool
        self._idle: list[Consumer] = []
        self._lock = threading.Lock()
        self._closed = False

    def _acquire(self) -> Consumer:
        with self._lock:
            if self._closed:
                raise unavailable("blob reader closed")
            if self._idle:
                return self._idle.pop()
        return Consumer(kafka_config.consumer(
            self._bootstrap, f"{self._client_id}.blob-reader", self._kafka, **self.SETTINGS))

    def _release(self, consumer: Consumer) -> None:
        try:
            consumer.unassign()
        except Exception:  # pragma: no cover
            consumer.close()
            return
        with self._lock:
            if not self._closed and len(self._idle) < self._pool:
                self._idle.append(consumer)
                return
        consumer.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for c in idle:
            try:
                c.close()
            except Exception:  # pragma: no cover
                pass

    def fetch(self, blob_key: str, version: str, wanted: list[tuple[int, ChunkRef]]) -> dict[int, bytes]:
        """Return {index: content} for each (index, ref); raise ChunkGone if one is not there.

        Blocking; call it in a worker thread.
        """
        if not wanted:
            return {}
        by_partition: dict[int, deque[tuple[int, ChunkRef]]] = {}
        for index, ref in sorted(wanted, key=lambda w: (w[1].partition, w[1].offset)):
            if not 0 <= ref.partition < self.partitions:
                raise ChunkGone(f"chunk {index} names partition {ref.partition}; {self.topic} has {self.partitions}")
            by_partition.setdefault(ref.partition, deque()).append((index, ref))
        out: dict[int, bytes] = {}
        consumer = self._acquire()
        paused: list[TopicPartition] = []
        try:
            consumer.assign([TopicPartition(self.topic, p, q[0][1].offset) for p, q in by_partition.items()])
            ahead: dict[int, int] = {}  # partition -> offset we skipped ahead to
            rechecked: set[tuple[int, int]] = set()  # (partition, offset) looked up twice
            # A deadline on silence: it restarts with every chunk read, so a blob
            # larger than a request timeout's worth of reading can still be read.
            deadline = time.monotonic() + self.timeout
            while any(by_partition.values()):
                if time.monotonic() > deadline:
                    raise unavailable(f"blob chunks of {blob_key!r}: none fetched from {self.topic} "
                                      f"for {self.timeout}s")
                moved: set[int] = set()  # partitions sought during this batch: ignore the rest of it
                for msg in kafka_config.drain(consumer, 256, 0.1):
                    p = msg.partition()
                    queue = by_partition.get(p)
                    if not queue or p in moved:
                        continue  # not ours, complete, or fetched before a seek
                    index, ref = queue[0]
                    err = msg.error()
                    if err is not None and err.code() != KafkaError._PARTITION_EOF:
                        log.warning("blob reader: %s", err)
                        continue
                    o = msg.offset()
                    if err is None and o < ref.offset:
                        if ref.offset - o > self.SEEK_GAP and ahead.get(p) != ref.offset:
                            consumer.seek(TopicPartition(self.topic, p, ref.offset))
                            ahead[p] = ref.offset
                            moved.add(p)
                        continue
                    if err is None and o == ref.offset:
                        out[index] = self._verify(msg, blob_key, version, index, ref)
                        deadline = time.monotonic() + self.timeout
                        queue.popleft()
                        if not queue:  # stop fetching what we no longer need
                            paused.append(TopicPartition(self.topic, p))
                            consumer.pause(paused[-1:])
                        continue
                    # A later record, or the end of the partition, instead of the chunk.
                    # Offsets are never reused, so the chunk was removed (compacted once
                    # a newer version replaced it) -- unless what we saw was fetched
                    # before a seek: look once more from the exact offset first.
                    if (p, ref.offset) in rechecked:
                        raise ChunkGone(f"{self.topic}[{p}]@{ref.offset} no longer holds chunk {index}")
                    rechecked.add((p, ref.offset))
                    consumer.seek(TopicPartition(self.topic, p, ref.offset))
                    moved.add(p)
            return out
        finally:
            if paused:  # the pause would outlive the assignment (librdkafka keeps it per partition)
                consumer.resume(paused)
            self._release(consumer)

    def _verify(self, msg: kafka_config.Consumed, blob_key: str, version: str, index: int, ref: ChunkRef) -> bytes:
        """The record at a manifest's offset must be exactly the chunk it names."""
        where = f"{self.topic}[{ref.partition}]@{ref.offset}"
        value = msg.value()
        if msg.key() != chunk_key(blob_key, version, index).encode("utf-8") or value is None:
            raise ChunkGone(f"{where} is not chunk {index} of version {version}")
        try:
            _, rec = self.codec.decode(value, expect=CHUNK_TYPE)
        except CodecError as exc:
            raise ChunkGone(f"{where}: {exc.message}") from None
        if (rec["blobKey"], rec["version"], rec["index"], len(rec["data"])) != (blob_key, version, index, ref.length):
            raise ChunkGone(f"{where} does not match the manifest (version {version}, chunk {index})")
        return rec["data"]
