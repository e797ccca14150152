"""Reading a partition of `<ns>.deliveries` forward from Kafka, for catch-up readers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from concurrent.futures import Future as CFuture
from typing import TYPE_CHECKING

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition

from ..kernel import kafka_config
from ..kernel.errors import unavailable

if TYPE_CHECKING:
    from .service import DeliveryService

log = logging.getLogger("threadlog.delivery")


class ConsumerPool:
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
                # Before the wait is queued: a waiter queued and then given up left a
                # live future that a wake-up could go to, lost (a review).
                left = deadline - loop.time()
                if left <= 0:
                    raise unavailable(f"all {self.max_open} delivery read consumers stayed busy for {timeout}s")
                fut = loop.create_future()
                self._waiters.append((loop, fut))
            # A wake-up can be lost to a waiter that timed out at the same moment:
            # look again at least every half second.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(fut, min(left, 0.5))
        try:
            return Consumer(kafka_config.consumer(
                self._bootstrap, f"{self._client_id}.dlvread{n}", self._kafka,
                **{"enable.partition.eof": True, "fetch.wait.max.ms": kafka_config.READER_WAIT_MS,
                   # A reader starts at a run's own record: if retention deleted it, the
                   # reset to the earliest kept record showed the run's later chunks as if
                   # they were its start. Fail instead (Fetcher._fetch): the run is gone.
                   "auto.offset.reset": "error"},
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


def _being_cancelled() -> bool:
    """Is the running task being cancelled (as opposed to an awaited future)?"""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def _close(consumer: Consumer) -> None:
    try:
        consumer.close()
    except Exception:  # pragma: no cover
        pass


# A reader that has not asked for its next batch this long after the last one
# (an SSE client that stopped reading: its send blocks) gives its pooled
# consumer back, and takes one again, at its position, when it does ask. Why:
# the pool is bounded (ConsumerPool), and 16 stalled browsers held every
# consumer, so every other catch-up read failed UNAVAILABLE.
PARK_AFTER_S = 1.0
# A catch-up batch holds the run's records up to this many bytes of values (and
# at least one). Why: a reader yields a batch record by record, and one whose
# client stopped reading keeps its batch -- as many records as librdkafka had
# fetched, 16 MiB and more -- for as long as it is stalled (a review: ~72 MiB of
# RSS per stalled SSE reader of large chunks, where a live reader's queue is
# bounded at 16 MiB).
MAX_BATCH_BYTES = 4 * 2**20


class Fetcher:
    """A pooled consumer reading one partition forward, run on the service's executor."""

    def __init__(self, svc: DeliveryService, run_id: str, partition: int, start: int) -> None:
        self.svc = svc
        self.key = run_id.encode("utf-8")
        self.partition = partition
        self.position = start
        self._consumer: Consumer | None = None
        self._job: CFuture | None = None
        self._park: asyncio.TimerHandle | None = None

    async def next_batch(self, stop_at: int) -> list:
        """The run's messages in [position, stop_at), a batch at a time ([] once there).
        `stop_at` is the same on every call of one fetcher."""
        if self._park is not None:
            self._park.cancel()
            self._park = None
        if self._job is None:
            if self.position >= stop_at:
                return []
            if self._consumer is None:
                self._consumer = await self.svc.pool.take(self.svc.timeout)
                start = self.position if self.position >= 0 else OFFSET_BEGINNING
                self._consumer.assign([TopicPartition(self.svc.topic, self.partition, start)])
        consumer = self._consumer
        assert consumer is not None  # taken with the first job, kept until release()
        if self._job is None:
            self._job = self.svc.executor.submit(self._fetch, consumer, stop_at)
        job = self._job
        try:
            msgs, self.position = await asyncio.wrap_future(job)
        except asyncio.CancelledError:
            if job.cancelled() and not _being_cancelled():
                # The job, not this task: the client closing cancels queued fetches
                # (`executor.shutdown(cancel_futures=True)`). A CancelledError is no
                # Exception: an SSE stream took it for its own cancellation and
                # ended with no last bytes, not the cut a closing client sends (a review).
                raise unavailable("this ThreadLog is closed") from None
            raise
        # Prefetch: the next batch is read from Kafka while the caller decodes and
        # yields this one (measured: replay spent a fifth of its time waiting here).
        self._job = (self.svc.executor.submit(self._fetch, consumer, stop_at)
                     if self.position < stop_at else None)
        self._park = asyncio.get_running_loop().call_later(PARK_AFTER_S, self.release)
        return msgs

    def _fetch(self, consumer: Consumer, stop_at: int) -> tuple[list, int]:
        # The deadline bounds a stall, not the scan: the next record of a quiet run
        # may lie behind millions of other runs' records of the partition, and a
        # scan that keeps moving must not fail for taking longer than one timeout.
        deadline = time.monotonic() + self.svc.timeout
        position = self.position
        mine: list = []
        size = 0
        while position < stop_at and not mine:
            if self.svc.closing.is_set():
                raise unavailable("this ThreadLog is closed")
            if time.monotonic() > deadline:
                raise unavailable(f"{self.svc.topic}[{self.partition}] not readable up to {stop_at}: nothing "
                                  f"read for {self.svc.timeout}s (at {position})")
            before = position
            for msg in kafka_config.drain(consumer, 1000, 0.2):
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        position = max(position, msg.offset())
                    elif err.code() in (KafkaError.OFFSET_OUT_OF_RANGE, KafkaError._AUTO_OFFSET_RESET):
                        # No retry brings deleted records back.
                        raise unavailable(f"{self.svc.topic}[{self.partition}]@{position} is gone (retention)",
                                          retryable=False)
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
                    size += len(msg.value() or b"")
                    if size >= MAX_BATCH_BYTES:
                        # The rest of this drain is read again, from `position`, by the
                        # next batch: the consumer is this fetch's alone until it returns.
                        try:
                            consumer.seek(TopicPartition(self.svc.topic, self.partition, position))
                        except KafkaException as exc:  # the batch so far stands; the next asks again
                            raise unavailable(f"{self.svc.topic}[{self.partition}]: could not read on from "
                                              f"{position}: {exc}") from None
                        break
            if position > before:
                deadline = time.monotonic() + self.svc.timeout
        return mine, position

    def release(self) -> None:
        """Give the consumer back (done, or parked: the next batch takes one again
        and reads from `position`, the prefetched batch read again)."""
        if self._park is not None:
            self._park.cancel()
            self._park = None
        consumer, self._consumer = self._consumer, None
        job, self._job = self._job, None
        if consumer is None:
            return
        if job is not None and not job.done():
            # Cancelled mid-fetch: the thread still holds the consumer.
            job.add_done_callback(lambda _f: self.svc.pool.give(consumer))
        else:
            self.svc.pool.give(consumer)
