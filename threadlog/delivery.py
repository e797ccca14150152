"""`tl.delivery(run_id, epoch=None)`: a run's durable, replayable output stream (SPEC 11).

Layout. A run lives in one partition of `<ns>.deliveries` (key = run id). Every
`append` is ONE record holding the whole batch, so a batch is all or nothing.
Chunk i of the record at Kafka offset X has the opaque offset
`"<partition>.<X>.<i>.<tag>"`, tag = 8 hex digits of a hash of the run id; a
reader seeks to X and skips to i. The run index (`projections/run_index.py`)
is a fold of the topic that says which records stand (fencing, close) and
where a run's first record is, so `"-1"` is a seek too.

Fencing, the one rule that matters: **an append returns only after the run
index has folded every record before its own and found it standing** (by the
verdict the fold will record for it: it depends only on what came before). The
index folds in read_committed order, so a claim marker written before the
record -- even in a transaction still open when the record landed -- is folded
first (the fold waits for it), and the append then raises RUN_CLAIM_LOST; every
reader drops the record by the same verdict. Never "acknowledged but dropped".

Reading. A reader first passes a read barrier on the index (so it reflects
every write acknowledged before it began), then reads what was folded before
it subscribed from Kafka with a pooled consumer, then takes new records from
the index follower's live feed (no consumer per waiting reader). Positions
only grow along the log, so "a position already yielded" is "not after the
last one yielded": duplicates can never be yielded twice.

Upsert re-persists positions: one record whose chunks replace the given
positions. `snapshot()` and every reader that reaches a position later show
the replacement at the original position; a reader that already yielded a
position does not yield it again (the index keeps the replacement; a reader
looks it up when it yields the position).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import re
import threading
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from concurrent.futures import Future as CFuture
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import orjson
from confluent_kafka import OFFSET_BEGINNING, Consumer, IsolationLevel, KafkaError, TopicPartition
from confluent_kafka.admin import OffsetSpec

from . import kafka_config
from .errors import (
    INVALID_OFFSET,
    RUN_CLAIM_LOST,
    RUN_LOG_CLOSED,
    RUN_NOT_FOUND,
    ThreadLogError,
    invalid_argument,
    unavailable,
)
from .producers.deliveries import DeliveryWriter
from .projections import run_index
from .projections.barrier import ReadBarrier
from .projections.delivery_follower import DeliveryIndex, Item, Subscription
from .validation import dumps, is_int, json_problem, require_id

if TYPE_CHECKING:
    from .client import ThreadLog

log = logging.getLogger("threadlog.delivery")

Offset = str
_OFFSET = re.compile(r"^(0|[1-9][0-9]{0,9})\.(0|[1-9][0-9]{0,18})\.(0|[1-9][0-9]{0,9})\.([0-9a-f]{8})$")
_LAST = 2**62  # "every chunk of this record" when used as a chunk index


@functools.lru_cache(maxsize=4096)
def run_tag(run_id: str) -> str:
    return hashlib.blake2b(run_id.encode("utf-8"), digest_size=4).hexdigest()


def encode_offset(run_id: str, partition: int, kafka_offset: int, index: int) -> Offset:
    return f"{partition}.{kafka_offset}.{index}.{run_tag(run_id)}"


def parse_offset(run_id: str, partition: int, offset: Any) -> tuple[int, int]:
    """(Kafka offset, chunk index) of an offset string minted for this run, else INVALID_OFFSET.

    Only the shape and the run are checked here; whether the position exists
    is the run index's answer (`DeliveryLog._require_position`).
    """
    if not isinstance(offset, str):
        raise ThreadLogError(INVALID_OFFSET, f"an offset is a str, got {type(offset).__name__}")
    m = _OFFSET.match(offset)
    if m is None:
        raise ThreadLogError(INVALID_OFFSET, f"malformed offset {offset[:80]!r}")
    p, x, i, tag = int(m[1]), int(m[2]), int(m[3]), m[4]
    if tag != run_tag(run_id) or p != partition:
        raise ThreadLogError(INVALID_OFFSET, f"offset {offset!r} was not minted by the log of run {run_id!r}")
    return x, i


def _chunks_record(chunks: Any, label: str) -> tuple[dict, int]:
    """(fields of a chunks record holding `chunks`, how many); INVALID_ARGUMENT
    unless every chunk is a JSON object.

    Fast path (appends are hot): the whole batch as ONE JSON array by orjson,
    proven plain JSON by decoding it back and comparing -- NaN (orjson writes
    null), a tuple, a datetime or anything else orjson coerced compares unequal,
    and what it refuses (a non-str key, an int beyond 64 bits, a lone surrogate)
    raises. Readers then parse the record in one orjson call. Only otherwise
    does the slow, precise walk run, to say what is wrong -- or to accept what
    plain JSON holds but orjson cannot round-trip (tuples, big ints), stored as
    one text per chunk and parsed by `json`.
    """
    if not isinstance(chunks, (list, tuple)):
        raise invalid_argument(f"{label} must be a list of chunk dicts, got {type(chunks).__name__}")
    n = len(chunks)
    try:
        if n and all(isinstance(chunk, dict) for chunk in chunks):
            batch = orjson.dumps(chunks)
            if orjson.loads(batch) == list(chunks):
                return {"batch": batch, "count": n}, n
    except (TypeError, ValueError, RecursionError):  # orjson's errors subclass these
        pass
    return {"chunks": [_chunk_text(chunk, f"{label}[{i}]") for i, chunk in enumerate(chunks)]}, n


def _decode_chunks(rec: dict) -> list | None:
    """Every chunk value of a chunks record, in order (None where a text is not JSON);
    None if the record is corrupt as a whole."""
    batch = rec.get("batch")
    if batch:
        try:
            values = orjson.loads(batch)
        except orjson.JSONDecodeError:
            try:
                values = json.loads(batch)  # what orjson refuses but plain JSON allows
            except ValueError:
                return None
        return values if isinstance(values, list) and len(values) == rec["count"] else None
    texts = rec["chunks"]
    try:
        return json.loads("[" + ",".join(texts) + "]")  # one parse per record, not per chunk
    except ValueError:
        return [_parse_or_none(text) for text in texts]


def _chunk_text(chunk: Any, label: str) -> str:
    if not isinstance(chunk, dict):
        raise invalid_argument(f"{label} must be a dict (a JSON object), got {type(chunk).__name__}")
    problem = json_problem(chunk, label)
    if problem:
        raise invalid_argument(problem)
    return dumps(chunk)


def _parse_or_none(text: str) -> dict | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


class _ConsumerPool:
    """Catch-up readers reuse consumers: creating one costs a bootstrap round trip.

    At most `max_open` consumers exist at once; a reader beyond that waits for
    one to come back (up to its request timeout, then UNAVAILABLE). Why a bound:
    a consumer is ~4 librdkafka threads and a dozen fds, and every reader that
    catches up holds one -- unbounded, 500 concurrent SSE joins made 2,040
    threads and 4,500 fds and stalled every other call for seconds.
    """

    def __init__(self, bootstrap: str, client_id: str, max_idle: int = 8,
                 kafka: kafka_config.Props | None = None, max_open: int = 16) -> None:
        self._bootstrap = bootstrap
        self._kafka = kafka
        self._client_id = client_id
        self._max_idle = max_idle
        self.max_open = max_open
        self._idle: list[Consumer] = []
        self._lock = threading.Lock()
        self._n = 0
        self.open = 0  # consumers in existence: idle + taken
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._closed = False

    async def take(self, timeout: float) -> Consumer:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            with self._lock:
                if self._closed:
                    raise unavailable("this ThreadLog is closed")
                if self._idle:
                    return self._idle.pop()
                if self.open < self.max_open:
                    self.open += 1
                    self._n += 1
                    n = self._n
                    break
                fut = loop.create_future()
                self._waiters.append((loop, fut))
            left = deadline - loop.time()
            if left <= 0:
                raise unavailable(f"all {self.max_open} delivery read consumers stayed busy for {timeout}s")
            # A wake-up can be lost to a waiter that timed out at the same moment:
            # look again at least every half second.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(fut, min(left, 0.5))
        try:
            return Consumer(kafka_config.consumer(
                self._bootstrap, f"{self._client_id}.dlvread{n}", self._kafka,
                **{"enable.partition.eof": True, "fetch.wait.max.ms": kafka_config.TXN_READER_WAIT_MS},
            ))
        except BaseException:
            self._gone()
            raise

    def give(self, consumer: Consumer) -> None:
        """Back from a reader (any thread)."""
        try:
            consumer.unassign()
        except Exception:
            _close(consumer)
            self._gone()
            return
        with self._lock:
            if not self._closed and len(self._idle) < self._max_idle:
                self._idle.append(consumer)
                self._wake_one()
                return
        _close(consumer)
        self._gone()

    def _gone(self) -> None:
        with self._lock:
            self.open -= 1
            self._wake_one()

    def _wake_one(self) -> None:
        # Called with the lock held.
        while self._waiters:
            loop, fut = self._waiters.pop(0)
            if fut.done():
                continue
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits there
                loop.call_soon_threadsafe(_resolve, fut)
                return

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            self.open -= len(idle)
        for c in idle:
            _close(c)


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def _close(consumer: Consumer) -> None:
    try:
        consumer.close()
    except Exception:  # pragma: no cover
        pass


class DeliveryService:
    """What one client needs for delivery logs: run index, writer, readers' consumers."""

    metrics = None  # threadlog.metrics.Metrics, when attached

    def __init__(self, tl: ThreadLog) -> None:
        rt = tl.runtime
        assert rt.layout is not None and rt.index_store is not None and rt.admin is not None
        self.tl = tl
        self.topic = rt.topics.deliveries
        self.partitions = rt.layout.deliveries
        self.store = rt.index_store
        self.codec = rt.codec
        self.admin = rt.admin
        self.timeout = tl.opts.request_timeout
        self.first_chunk_wait = tl.opts.first_chunk_wait_ms / 1000.0
        self.index = DeliveryIndex(tl.opts.bootstrap_servers, self.topic, self.partitions, rt.index_store,
                                   rt.codec, rt.client_id, kafka=tl.opts.kafka)
        self.barrier = ReadBarrier(rt.admin, self.index, timeout=self.timeout)
        self.writer = DeliveryWriter(bootstrap=tl.opts.bootstrap_servers, topic=self.topic,
                                     partitions=self.partitions, codec=rt.codec, client_id=rt.client_id,
                                     timeout=self.timeout, kafka=tl.opts.kafka)
        self.pool = _ConsumerPool(tl.opts.bootstrap_servers, rt.client_id, kafka=tl.opts.kafka)
        self.executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix="delivery-read")
        self.closing = threading.Event()

    def start(self) -> None:
        self.index.start()

    def stop(self) -> None:
        self.closing.set()
        self.index.stop()
        self.writer.close()
        self.executor.shutdown(wait=True, cancel_futures=True)
        self.pool.close()

    async def claim(self, run_id: str, floor: int) -> int:
        """Propose a claim of `run_id` on its delivery partition; return the epoch
        the run index granted (max(fence, floor) + 1, see projections/run_index.py).

        The grant happens where fencing happens: from the claim's offset on,
        every record of an older epoch is dropped by every reader, and no
        record of an epoch never granted ever stands."""
        x = await self.writer.write(run_id, {"runId": run_id, "kind": run_index.CLAIM, "epoch": floor,
                                             "writtenAt": time.time() * 1000.0})
        await self.index.wait({self.writer.partition_of(run_id): x + 1}, self.timeout)
        folded = run_index.record_verdict(self.store, run_id, x)
        if not folded or "claim" not in folded:
            raise unavailable(f"claim of run {run_id!r} at offset {x} was not folded")
        return int(folded["claim"])

    async def high_watermark(self, partition: int) -> int:
        """Next offset of the partition: everything below it is stored (committed or not)."""
        futures = self.admin.list_offsets({TopicPartition(self.topic, partition): OffsetSpec.latest()},
                                          isolation_level=IsolationLevel.READ_UNCOMMITTED,
                                          request_timeout=self.timeout)
        (fut,) = futures.values()
        try:
            res = await asyncio.wait_for(asyncio.wrap_future(fut), self.timeout)
        except TimeoutError:
            raise unavailable(f"end offset of {self.topic}[{partition}] not answered in {self.timeout}s") from None
        except Exception as exc:
            raise unavailable(f"cannot read the end offset of {self.topic}[{partition}]: {exc}") from None
        return res.offset


class _Fetcher:
    """A pooled consumer reading one partition forward, run on the service's executor."""

    def __init__(self, svc: DeliveryService, run_id: str, partition: int, start: int) -> None:
        self.svc = svc
        self.key = run_id.encode("utf-8")
        self.partition = partition
        self.position = start
        self._consumer: Consumer | None = None
        self._job: CFuture | None = None

    async def next_batch(self, stop_at: int) -> list:
        """The run's messages in [position, stop_at), a batch at a time ([] once there).
        `stop_at` is the same on every call of one fetcher."""
        if self._job is None:
            if self.position >= stop_at:
                return []
            if self._consumer is None:
                self._consumer = await self.svc.pool.take(self.svc.timeout)
                start = self.position if self.position > 0 else OFFSET_BEGINNING
                self._consumer.assign([TopicPartition(self.svc.topic, self.partition, start)])
        consumer = self._consumer
        assert consumer is not None  # taken with the first job, kept until release()
        if self._job is None:
            self._job = self.svc.executor.submit(self._fetch, consumer, stop_at)
        msgs, self.position = await asyncio.wrap_future(self._job)
        # Prefetch: the next batch is read from Kafka while the caller decodes and
        # yields this one (measured: replay spent a fifth of its time waiting here).
        self._job = (self.svc.executor.submit(self._fetch, consumer, stop_at)
                     if self.position < stop_at else None)
        return msgs

    def _fetch(self, consumer: Consumer, stop_at: int) -> tuple[list, int]:
        deadline = time.monotonic() + self.svc.timeout
        position = self.position
        mine: list = []
        while position < stop_at and not mine:
            if self.svc.closing.is_set():
                raise unavailable("this ThreadLog is closed")
            if time.monotonic() > deadline:
                raise unavailable(f"{self.svc.topic}[{self.partition}] not readable up to {stop_at} "
                                  f"in {self.svc.timeout}s (at {position})")
            for msg in kafka_config.drain(consumer, 1000, 0.2):
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        position = max(position, msg.offset())
                    elif err.code() == KafkaError.OFFSET_OUT_OF_RANGE:
                        raise unavailable(f"{self.svc.topic}[{self.partition}]@{position} is gone (retention)")
                    else:
                        log.warning("delivery reader: %s", err)
                    continue
                off = msg.offset()
                if off < position:
                    continue
                position = off + 1
                if off >= stop_at:
                    # The live feed delivers it; never read past the hand-off point.
                    position = stop_at
                    break
                if msg.key() == self.key:
                    mine.append(msg)
        return mine, position

    def release(self) -> None:
        consumer, self._consumer = self._consumer, None
        if consumer is None:
            return
        job = self._job
        if job is not None and not job.done():
            # Cancelled mid-fetch: the thread still holds the consumer.
            job.add_done_callback(lambda _f: self.svc.pool.give(consumer))
        else:
            self.svc.pool.give(consumer)


class DeliveryLog:
    """One run's delivery log, written as driver `epoch` (SPEC 11)."""

    def __init__(self, tl: ThreadLog, run_id: str, epoch: int | None = None) -> None:
        require_id(run_id, "run_id")
        if epoch is None:
            epoch = 0
        if not is_int(epoch) or epoch < 0:
            raise invalid_argument(f"epoch must be an int >= 0 or None, got {epoch!r}")
        self._tl = tl
        self.run_id = run_id
        self.epoch = epoch
        self._partition: int | None = None
        self._sfx: list[str] = []

    # -- plumbing -------------------------------------------------------------------
    @property
    def _svc(self) -> DeliveryService:
        self._tl._check_open()
        svc = self._tl._delivery
        assert svc is not None
        return svc

    @property
    def partition(self) -> int:
        if self._partition is None:
            self._partition = self._svc.writer.partition_of(self.run_id)
        return self._partition

    def _offset(self, kafka_offset: int, index: int) -> Offset:
        return encode_offset(self.run_id, self.partition, kafka_offset, index)

    def _state(self) -> dict:
        return run_index.run_state(self._svc.store, self.run_id) or {"fence": 0, "reps": 0}

    def _precheck(self) -> None:
        """Refuse without writing when the index already knows the outcome
        (the verdict after writing is the one that counts)."""
        state = self._state()
        if state["fence"] > self.epoch:
            raise self._lost(state["fence"])
        if "closedAt" in state:
            raise ThreadLogError(RUN_LOG_CLOSED, f"the delivery log of run {self.run_id!r} is closed")

    def _lost(self, fence: int | None = None) -> ThreadLogError:
        newer = f" (epoch {fence} was claimed)" if fence is not None else ""
        return ThreadLogError(RUN_CLAIM_LOST, f"driver epoch {self.epoch} of run {self.run_id!r} "
                                              f"was superseded{newer}")

    async def _write_and_verify(self, record: dict) -> int:
        svc = self._svc
        record = {"runId": self.run_id, "epoch": self.epoch, "writtenAt": time.time() * 1000.0, **record}
        kafka_offset = await svc.writer.write(self.run_id, record)
        # THE fencing rule: acknowledge only what stands by the run index's verdict.
        code = await self._verdict(kafka_offset, record["kind"])
        if code == RUN_CLAIM_LOST:
            raise self._lost(self._state()["fence"])
        if code == RUN_LOG_CLOSED:
            raise ThreadLogError(RUN_LOG_CLOSED, f"the delivery log of run {self.run_id!r} was closed "
                                                 "before this write")
        if code is not None:
            raise ThreadLogError(code, f"delivery record of run {self.run_id!r} refused by the run index")
        return kafka_offset

    async def _verdict(self, x: int, kind: str) -> str | None:
        """Why the index drops (or will drop) this run's record at Kafka offset `x`; None if it stands.

        A chunks record's verdict depends only on the records BEFORE it (the claim
        fence and the close), so it is decided once the index has folded up to `x`
        -- usually at once, since this driver's previous append waited for that --
        instead of waiting for the fold to reach the record itself (measured: that
        wait was two thirds of an append). The fold decides the same verdict later,
        by the same `run_index.verdict`, so readers and this caller never disagree.
        """
        svc = self._svc
        if kind == run_index.CHUNKS:
            await svc.index.wait({self.partition: x}, svc.timeout)
            # Order matters: the state is read BEFORE looking for the record's own
            # verdict. The fold writes a batch of records atomically, so if the record
            # is still unfolded after the state was read, that state is exactly the
            # fold of everything before `x` (folded >= x already held).
            state = self._state()
            folded = run_index.record_verdict(svc.store, self.run_id, x)
            if folded is None:
                return run_index.verdict(state["fence"], state.get("closedAt"), x, self.epoch)
        else:
            await svc.index.wait({self.partition: x + 1}, svc.timeout)
            folded = run_index.record_verdict(svc.store, self.run_id, x)
            if folded is None:
                raise unavailable(f"delivery record {self.partition}@{x} of run {self.run_id!r} "
                                  "was not folded (undecodable?)")
        return folded.get("drop")

    # -- writes -----------------------------------------------------------------------
    async def append(self, chunks: list[dict]) -> list[Offset]:
        fields, n = _chunks_record(chunks, "chunks")
        if not n:
            return []
        self._precheck()
        x = await self._write_and_verify({"kind": run_index.CHUNKS, **fields})
        if self._svc.metrics is not None:
            self._svc.metrics.appended(n)
        return list(self._offsets(x, 0, n))

    async def upsert(self, entries: Iterable[tuple[Offset, dict]]) -> list[Offset]:
        if not isinstance(entries, (list, tuple)):
            raise invalid_argument(f"upsert takes a list of (offset, chunk) pairs, got {type(entries).__name__}")
        svc = self._svc
        positions: list[tuple[int, int]] = []
        seen: set[tuple[int, int]] = set()
        for n, entry in enumerate(entries):
            if not isinstance(entry, (list, tuple)) or len(entry) != 2:
                raise invalid_argument(f"upsert entry [{n}] must be an (offset, chunk) pair")
            pos = parse_offset(self.run_id, self.partition, entry[0])
            if pos in seen:
                raise ThreadLogError(INVALID_OFFSET, f"offset {entry[0]!r} appears twice in one upsert")
            seen.add(pos)
            positions.append(pos)
        texts = [_chunk_text(entry[1], f"upsert entry [{n}] chunk") for n, entry in enumerate(entries)]
        if not texts:
            return []
        await svc.barrier.wait([self.partition])
        for (x, i), entry in zip(positions, entries, strict=True):
            self._require_position(x, i, entry[0])
        self._precheck()
        await self._write_and_verify({
            "kind": run_index.UPSERT, "chunks": texts,
            "targets": [{"offset": x, "index": i} for x, i in positions],
        })
        return [self._offset(x, i) for x, i in positions]

    def _require_position(self, x: int, i: int, text: str) -> None:
        count = run_index.chunk_count(self._svc.store, self.run_id, x)
        if count is None or i >= count:
            raise ThreadLogError(INVALID_OFFSET, f"offset {text!r} is not a chunk of the log of run {self.run_id!r}")

    async def close(self) -> None:
        svc = self._svc
        state = self._state()
        if state["fence"] > self.epoch or "closedAt" in state:
            return  # a superseded driver's close is ignored; closing twice is harmless
        x = await svc.writer.write(self.run_id, {"runId": self.run_id, "epoch": self.epoch, "kind": run_index.CLOSE,
                                                 "writtenAt": time.time() * 1000.0})
        # Folded before returning: from here on this client's appends and reads see it.
        await svc.index.wait({self.partition: x + 1}, svc.timeout)

    # -- reads --------------------------------------------------------------------------
    def read(self, after: Offset, *, follow: bool = True) -> AsyncIterator[tuple[Offset, dict]]:
        """(offset, chunk) strictly after `after` ("-1", "now" or an offset); waits; ends on close.

        `follow=False` (an extension, for tools) ends at what is stored when the
        iteration starts instead of waiting, and an unknown run yields nothing.
        """
        items = self._iterate(after, follow=follow)
        svc = self._tl._delivery  # not _svc: a closed client fails when iterated, as before
        metrics = svc.metrics if svc is not None else None
        return items if metrics is None else metrics.reading(items)

    async def snapshot(self) -> list[tuple[Offset, dict]]:
        """What is stored now, in order; never waits for new chunks; [] for an unknown run."""
        return [item async for item in self._iterate("-1", follow=False)]

    async def _start(self, after: Offset, follow: bool) -> tuple[int, tuple[int, int], Subscription | None]:
        """Where to start reading: (Kafka offset, floor position, live subscription if any)."""
        svc = self._svc
        p = self.partition
        if after == "now":
            hw_task = asyncio.ensure_future(svc.high_watermark(p))
            try:
                await svc.barrier.wait([p])
            finally:
                hw = await hw_task
            return hw, (hw - 1, _LAST), None
        if after != "-1":
            x, i = parse_offset(self.run_id, p, after)
            await svc.barrier.wait([p])
            self._require_position(x, i, after)
            return x, (x, i), None
        await svc.barrier.wait([p])
        state = run_index.run_state(svc.store, self.run_id)
        if state and "first" in state:
            return state["first"], (-1, -1), None
        if not follow:
            return -1, (-1, -1), None  # nothing stored: an empty snapshot
        # Nothing yet: wait (bounded) for the first chunk or a close.
        sub = svc.index.subscribe(self.run_id, p)
        try:
            state = run_index.run_state(svc.store, self.run_id)
            if state and "first" in state:
                return state["first"], (-1, -1), sub
            deadline = time.monotonic() + svc.first_chunk_wait
            held: list[Item] = []
            while True:
                while sub.items:
                    held.append(sub.items.popleft())
                if any(it.dropped is None and it.record["kind"] in (run_index.CHUNKS, run_index.CLOSE)
                       for it in held):
                    break
                if sub.failure is not None:
                    raise sub.failure
                left = deadline - time.monotonic()
                if sub.overflowed:  # a flood of this run's records: look again
                    svc.index.unsubscribe(sub)
                    return await self._start(after, follow)
                if left <= 0:
                    raise ThreadLogError(RUN_NOT_FOUND, f"run {self.run_id!r} has no delivery log: nothing "
                                                        f"was appended or closed within {svc.first_chunk_wait}s")
                await sub.wait(left)
            sub.items.extendleft(reversed(held))
            # Nothing of this run stood before live_from: start at the live feed.
            return sub.live_from, (-1, -1), sub
        except BaseException:
            svc.index.unsubscribe(sub)
            raise

    async def _iterate(self, after: Offset, follow: bool) -> AsyncIterator[tuple[Offset, dict]]:
        svc = self._svc
        p = self.partition
        if not isinstance(after, str):
            raise ThreadLogError(INVALID_OFFSET, f"after must be an offset str, '-1' or 'now', got {after!r}")
        start, floor, sub = await self._start(after, follow)
        if start < 0:
            return
        state = run_index.run_state(svc.store, self.run_id) or {}
        closed_at = state.get("closedAt")
        if closed_at is not None and closed_at < start:
            if sub is not None:
                svc.index.unsubscribe(sub)
            return
        last = floor
        position = start
        try:
            while True:
                if follow and sub is None:
                    sub = svc.index.subscribe(self.run_id, p)
                # Live: hand over to the feed at live_from. Not following: stop at what
                # the index has folded (>= the barrier, so every acknowledged write).
                end = sub.live_from if sub is not None else svc.index.applied(p)
                # 1. Catch up from Kafka: everything below `end` is folded already.
                fetcher = _Fetcher(svc, self.run_id, p, position)
                try:
                    while True:
                        msgs = await fetcher.next_batch(end)
                        if not msgs:
                            break
                        reps = bool((run_index.run_state(svc.store, self.run_id) or {}).get("reps", 0))
                        for msg in msgs:
                            verdict = run_index.record_verdict(svc.store, self.run_id, msg.offset())
                            if verdict is None or "drop" in verdict or "u" in verdict:
                                continue  # claim marker, dropped record, upsert (applied by position)
                            if "close" in verdict:
                                return
                            _, rec = svc.codec.decode(msg.value(), expect="threadlog.Delivery")
                            batch, last = self._chunks(msg.offset(), rec, last, reps)
                            for out in batch:
                                yield out
                finally:
                    fetcher.release()
                position = max(position, end)
                if not follow:
                    return
                assert sub is not None
                # 2. Live: records at or after live_from, straight from the index follower.
                while True:
                    if not sub.items:
                        await sub.wait(None)
                    if sub.failure is not None:
                        raise sub.failure
                    if sub.overflowed:
                        # Fell too far behind: catch up from Kafka again.
                        svc.index.unsubscribe(sub)
                        sub = None
                        break
                    item = sub.items.popleft()
                    if item.offset < position:
                        continue
                    position = item.offset + 1
                    if item.dropped is not None:
                        continue
                    kind = item.record["kind"]
                    if kind == run_index.CLOSE:
                        return
                    if kind != run_index.CHUNKS:
                        continue
                    batch, last = self._chunks(item.offset, item.record, last)
                    for out in batch:
                        yield out
        finally:
            if sub is not None:
                svc.index.unsubscribe(sub)

    def _chunks(self, x: int, rec: dict, last: tuple[int, int],
                reps: bool | None = None) -> tuple[list, tuple[int, int]]:
        """The (offset, chunk) pairs of a standing chunks record after position `last`,
        with upserted replacements at their original positions; and the new last position.
        `reps`: whether the run has upserts (looked up if None; a caller reading many
        records looks once). A list, not a generator: one generator level less per
        chunk on the replay path."""
        n = run_index.record_size(rec)
        if last[0] > x:
            return [], last
        start = last[1] + 1 if last[0] == x else 0
        if start >= n:
            return [], last
        svc = self._svc
        values = _decode_chunks(rec)
        if values is None:
            log.error("chunks record %s@%d of run %r is corrupt; skipped", svc.topic, x, self.run_id)
            return [], (x, n - 1)
        if start:
            values = values[start:]
        if reps is None:
            reps = bool((run_index.run_state(svc.store, self.run_id) or {}).get("reps", 0))
        if reps:
            for i in range(start, n):
                text = run_index.replacement(svc.store, self.run_id, x, i)
                if text is not None:
                    values[i - start] = _parse_or_none(text)
        offsets = self._offsets(x, start, n)
        if set(map(type, values)) <= {dict}:  # the usual case, checked in C
            return list(zip(offsets, values, strict=True)), (x, n - 1)
        out = [(o, chunk) for o, chunk in zip(offsets, values, strict=True) if isinstance(chunk, dict)]
        log.error("%d chunks of %s@%d of run %r are not JSON objects; skipped",
                  len(values) - len(out), svc.topic, x, self.run_id)
        return out, (x, n - 1)

    def _offsets(self, x: int, start: int, n: int) -> Iterator[Offset]:
        """`encode_offset` of chunks start..n-1 of the record at `x`, without a format per
        chunk (hot on replay): "<partition>.<x>." + a cached "<i>.<tag>"."""
        sfx = self._sfx
        if len(sfx) < n:
            tag = run_tag(self.run_id)
            sfx.extend(f"{i}.{tag}" for i in range(len(sfx), n))
        return map(f"{self.partition}.{x}.".__add__, sfx[start:n])

    # -- introspection (replay tool, HTTP route) ------------------------------------------
    async def records(self, after: Offset = "-1") -> list[dict]:
        """Every record of the run now stored from the cursor on, with the index's
        verdict: claims, dropped chunks and why, upserts, the close. For debugging."""
        svc = self._svc
        p = self.partition
        await svc.barrier.wait([p])
        if after == "-1":
            start = (run_index.run_state(svc.store, self.run_id) or {}).get("seen", 0)
        else:
            start, _ = parse_offset(self.run_id, p, after)
        end = svc.index.applied(p)
        out: list[dict] = []
        fetcher = _Fetcher(svc, self.run_id, p, start)
        try:
            while True:
                msgs = await fetcher.next_batch(end)
                if not msgs:
                    break
                for msg in msgs:
                    _, rec = svc.codec.decode(msg.value(), expect="threadlog.Delivery")
                    verdict = run_index.record_verdict(svc.store, self.run_id, msg.offset()) or {}
                    row: dict[str, Any] = {"partition": p, "kafkaOffset": msg.offset(), "kind": rec["kind"],
                                           "epoch": rec["epoch"], "writtenAt": rec["writtenAt"]}
                    if rec["kind"] in (run_index.CHUNKS, run_index.UPSERT):
                        row["chunks"] = run_index.record_size(rec)
                    if rec["kind"] == run_index.UPSERT:
                        row["targets"] = [self._offset(t["offset"], t["index"]) for t in rec["targets"]]
                    if rec["kind"] == run_index.CLAIM:
                        # A claim proposes a floor; the epoch is what the fold granted.
                        row["floor"], row["epoch"] = rec["epoch"], verdict.get("claim", rec["epoch"])
                    else:
                        row["stands"] = "drop" not in verdict
                        if "drop" in verdict:
                            row["dropped"] = verdict["drop"]
                    out.append(row)
        finally:
            fetcher.release()
        return out

    async def chunk_at(self, offset: Offset) -> dict:
        """The chunk stored at `offset` (as a reader would yield it there)."""
        svc = self._svc
        x, i = parse_offset(self.run_id, self.partition, offset)
        await svc.barrier.wait([self.partition])
        self._require_position(x, i, offset)
        fetcher = _Fetcher(svc, self.run_id, self.partition, x)
        try:
            for msg in await fetcher.next_batch(x + 1):
                _, rec = svc.codec.decode(msg.value(), expect="threadlog.Delivery")
                batch, _ = self._chunks(x, rec, (x, i - 1))
                if batch:
                    return batch[0][1]
        finally:
            fetcher.release()
        raise unavailable(f"chunk {offset!r} could not be read back")
