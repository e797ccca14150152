"""Read barrier: every read reflects every write acknowledged before it began.

A read asks the broker for the end (high watermark) of the partitions it
depends on, *after* it began, and waits until the follower -- a read_committed
consumer -- has moved past there.

Why the high watermark and not the last stable offset (LSO): a commit is
acknowledged when the coordinator has decided it, but it writes the commit
markers to the transaction's partitions one by one, afterwards. A client can
hold the reply (its marker on `replies` written) while the marker on `events`
is not: the LSO still sits before the event, so an LSO barrier would let the
client's next read miss its own acknowledged write. Every record of that
transaction is below the high watermark, and a read_committed consumer only
moves past them once their marker is written -- so waiting for the follower to
pass the high watermark includes every acknowledged write (at the price of
also waiting out transactions in flight, bounded by the transaction timeout).

Markers are control records no consumer yields, and the high watermark often
lies just past one; the follower's position comes from the consumer's
end-of-partition report, never from the last event it saw (comparing to that
would hang forever: the classic barrier bug).

Concurrent reads share broker round trips: a read joins the next request that
starts after it began, never one already in flight (that one may predate a
write the read must see).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from confluent_kafka import OFFSET_END, Consumer, KafkaError, KafkaException, TopicPartition
from threadlog.producers.pump import within

from threadlog.kernel import kafka_config
from threadlog.kernel.errors import unavailable

from .follower import Follower

# How long a round waits for its answers before it also asks the current leaders again.
PROBE_S = 1.0


class LatestOffsets:
    """The latest offsets (high watermarks) of a topic's partitions, asked of the
    cluster by one consumer that never reads a record.

    Why a consumer and not `AdminClient.list_offsets`: measured here, a round of
    four partitions through the admin client cost ~1 050 us of CPU (a future
    per partition, the admin thread's events, the loop's wake-ups) and 1.33 ms;
    through `Consumer.offsets_for_times` at "latest" (the same ListOffsets
    request) the call itself costs 130 us and 0.30 ms, a whole awaited round
    (`EndOffsets.end_offsets`) 402 us and 0.66 ms. Every proposal that names
    positions (`seen`) and every read barrier waits for a round.

    librdkafka serialises calls on one handle, so every call runs as one job
    on one thread: a leader refresh is part of the job that needs it, bounded
    by that job's time, never a separate call a resend would queue behind.
    """

    def __init__(self, bootstrap: str, client_id: str, kafka: kafka_config.Props | None = None) -> None:
        # read_uncommitted: the high watermark, not the last stable offset (see the module doc).
        self._consumer = Consumer(kafka_config.consumer(bootstrap, f"{client_id}.ends", kafka,
                                                        **{"isolation.level": "read_uncommitted"}))
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"ends:{client_id}")
        self._closed = False

    def ends(self, topic: str, partitions: int, timeout: float, refresh: bool = False) -> dict[int, int]:
        """Every partition's latest offset, within `timeout` (blocking); with
        `refresh`, after asking who leads the topic's partitions now. A
        partition whose leader could not be asked raises its error, or comes
        back negative (`_complete`). UNAVAILABLE once closed."""
        if self._closed:
            raise unavailable("this client is closed")
        deadline = time.monotonic() + timeout
        asked = [TopicPartition(topic, p, OFFSET_END) for p in range(partitions)]
        try:
            if refresh:
                try:
                    self._consumer.list_topics(topic, timeout=max(0.05, timeout / 2))
                except KafkaException:
                    pass  # the request below fails again, or the old leaders answer
            got = self._consumer.offsets_for_times(asked, max(0.05, deadline - time.monotonic()))
            self._consumer.poll(0)  # serve the handle's logs and error events
        except RuntimeError:  # closed meanwhile
            raise unavailable("this client is closed") from None
        out: dict[int, int] = {}
        for tp in got:
            if tp.error is not None:
                raise KafkaException(tp.error)
            out[tp.partition] = tp.offset
        return out

    async def ends_async(self, topic: str, partitions: int, timeout: float, refresh: bool = False
                         ) -> dict[int, int]:
        try:
            job = asyncio.get_running_loop().run_in_executor(self._pool, self.ends, topic, partitions, timeout,
                                                             refresh)
            return await job
        except RuntimeError:  # submitted after close
            raise unavailable("this client is closed") from None
        except asyncio.CancelledError:
            if self._closed:  # dropped from the queue by close(), not cancelled by its caller
                raise unavailable("this client is closed") from None
            raise

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._consumer.close()


class EndOffsets:
    """The end offsets of a topic's partitions, read after the caller began, in shared rounds.

    A proposal's `seen` needs only this; a thin client reads it from Kafka
    itself (one hop) rather than through a worker (three). Rounds live on the
    event loop of the call that started them: use one instance from one loop
    (as a client does: it runs on the loop that opened it).
    """

    def __init__(self, source: LatestOffsets, topic: str, partitions: int, timeout: float = 30.0) -> None:
        self.source = source
        self.topic = topic
        self.partitions = partitions
        self.timeout = timeout
        self._inflight: asyncio.Future | None = None
        self._next: asyncio.Future | None = None
        self._tasks: set[asyncio.Task] = set()
        # Ask who leads before the next request. Why: a client sends ListOffsets
        # with the leader epoch of its cached metadata and may keep that cache
        # for topic.metadata.refresh.interval.ms (5 min). After a broker restart
        # the epoch had moved on and every round failed FENCED_LEADER_EPOCH for
        # minutes (tests/test_broker_outage.py); after a node of a cluster died,
        # rounds kept going to it long after another replica led its partitions
        # (tests/test_cluster_failover.py). So a round that failed that way, or
        # was not answered within PROBE_S, or lacked a leader, refreshes first.
        self._stale = False

    def _attempt(self, left: float) -> tuple[float, bool]:
        """(timeout, refresh first?) of the next request: a retry gets what is left of
        the deadline, not a whole timeout again, and at most PROBE_S before it is sent
        again (rather than wait the whole timeout on a leader that died: measured, a
        client's first read after a failover failed a whole 5 s timeout)."""
        refresh, self._stale = self._stale, False
        return max(0.05, min(PROBE_S, left)), refresh

    def _failed(self, exc: KafkaException, deadline: float) -> bool:
        """After a failed request: True to send again at once, False to pause first;
        raises UNAVAILABLE when it cannot succeed or the deadline has passed."""
        self._stale = True  # whatever failed, the next request asks who leads first
        if time.monotonic() >= deadline:
            if _timed_out(exc):
                raise unavailable(f"end offsets of {self.topic} not answered in {self.timeout}s") from None
            raise unavailable(f"cannot read end offsets of {self.topic}: {exc}") from None
        if _timed_out(exc):
            return True
        # Retriable (e.g. a just-created topic without a leader yet) until the deadline.
        if not _retriable(exc):
            raise unavailable(f"cannot read end offsets of {self.topic}: {exc}") from None
        return False

    def _incomplete(self, out: dict[int, int], deadline: float) -> None:
        self._stale = True  # a partition without a known leader: ask who leads now
        if time.monotonic() >= deadline:
            raise unavailable(f"end offsets of {self.topic} unknown (no leader?): {out}")

    def end_offsets_sync(self) -> dict[int, int]:
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                out = self.source.ends(self.topic, self.partitions, *self._attempt(deadline - time.monotonic()))
                if _complete(out):
                    return out
                self._incomplete(out, deadline)
            except KafkaException as exc:
                if self._failed(exc, deadline):
                    continue
            time.sleep(0.05)

    async def _round(self) -> dict[int, int]:
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                out = await self.source.ends_async(self.topic, self.partitions,
                                                   *self._attempt(deadline - time.monotonic()))
                if _complete(out):
                    return out
                self._incomplete(out, deadline)
            except KafkaException as exc:
                if self._failed(exc, deadline):
                    continue
            await asyncio.sleep(0.05)

    async def end_offsets(self) -> dict[int, int]:
        """End offsets of every partition, asked after this call began (shared rounds)."""
        loop = asyncio.get_running_loop()
        if self._inflight is None:
            fut = self._inflight = loop.create_future()
            self._spawn(fut)
            return await self._within_timeout(fut)
        # A round is in flight and may have been sent before we began: wait for the next.
        if self._next is None:
            self._next = loop.create_future()
        nxt = self._next
        return await self._within_timeout(nxt)

    async def _within_timeout(self, fut: asyncio.Future) -> dict[int, int]:
        """A caller waits at most one timeout, even behind a round in flight (each round
        has its own deadline: a read joining the next one during an outage waited up
        to twice the request timeout). Shielded: the round is shared with other callers."""
        waiter = asyncio.get_running_loop().create_future()

        def relay(done: asyncio.Future) -> None:
            if done.cancelled():
                if not waiter.done():
                    waiter.cancel()
                return
            exc = done.exception()  # retrieved even when this caller gave up
            if waiter.done():
                return
            if exc is not None:
                waiter.set_exception(exc)
            else:
                waiter.set_result(done.result())

        fut.add_done_callback(relay)
        try:
            # (asyncio.wait_for(asyncio.shield(fut)) did the same at twice the GIL time,
            # paid by every proposal that names positions: see `within`.)
            return await within(waiter, self.timeout)
        except TimeoutError:
            raise unavailable(f"end offsets of {self.topic} not answered in {self.timeout}s") from None

    def _spawn(self, fut: asyncio.Future) -> None:
        task = asyncio.get_running_loop().create_task(self._run_round(fut))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_round(self, fut: asyncio.Future) -> None:
        try:
            result = await self._round()
        except BaseException as exc:
            if not fut.done():
                fut.set_exception(exc)
        else:
            if not fut.done():
                fut.set_result(result)
        finally:
            self._inflight = None
            if self._next is not None:
                nxt, self._next = self._next, None
                self._inflight = nxt
                self._spawn(nxt)


class ReadBarrier(EndOffsets):
    """End offsets, then a wait until `follower` has folded past them.

    `replaced()`: were the topics deleted and created again under this process
    (its reason, else None)? Asked when a round finds a folded position past its
    partition's end. Why: the new log is shorter than the old one the state was
    folded from, so every barrier passed at once and reads answered the deleted
    namespace's state -- also after a write to the new one was acknowledged --
    until the incarnation watch's next round (up to 10 s; a review). A leader
    whose high watermark is a moment behind its predecessor's looks the same,
    which the topic ids tell apart."""

    def __init__(self, source: LatestOffsets, follower: Follower, timeout: float = 30.0,
                 replaced: Callable[[], str | None] | None = None) -> None:
        super().__init__(source, follower.topic, follower.partitions, timeout)
        self.follower = follower
        self.replaced = replaced

    def _folded(self) -> dict[int, int] | None:
        """The folded positions, read *before* a round is sent: a position read
        after its answer may have moved past the end it gives on a healthy log
        (a record written and folded meanwhile)."""
        if self.replaced is None:
            return None
        return {p: self.follower.applied(p) for p in range(self.partitions)}

    def _check(self, folded: dict[int, int] | None, ends: dict[int, int]) -> bool:
        """Is a folded position past its partition's end (ask `replaced`)?"""
        return folded is not None and any(folded[p] > end for p, end in ends.items())

    def _vet(self, reason: str | None) -> None:
        # None: not replaced (a new leader a moment behind). `replaced` asks the
        # broker at most once a second (projections/incarnation.py `Watch.confirm`).
        if reason is not None:
            raise unavailable(reason)

    async def _round(self) -> dict[int, int]:
        folded = self._folded()
        out = await super()._round()
        if self._check(folded, out):
            assert self.replaced is not None
            try:
                reason = await asyncio.wait_for(asyncio.to_thread(self.replaced), min(5.0, self.timeout))
            except TimeoutError:
                reason = None  # unknown (e.g. mid-failover): not held for it; the watch asks again
            self._vet(reason)
        return out

    def end_offsets_sync(self) -> dict[int, int]:
        folded = self._folded()
        out = super().end_offsets_sync()
        if self._check(folded, out):
            assert self.replaced is not None
            self._vet(self.replaced())
        return out

    async def wait(self, partitions: list[int] | None = None) -> None:
        """Return once every write acknowledged before this call is folded."""
        start = time.monotonic()
        offsets = await self.end_offsets()
        if partitions is not None:
            offsets = {p: offsets[p] for p in partitions}
        left = max(0.1, self.timeout - (time.monotonic() - start))
        await self.follower.wait(offsets, left)

    def wait_sync(self, partitions: list[int] | None = None) -> None:
        offsets = self.end_offsets_sync()
        if partitions is not None:
            offsets = {p: offsets[p] for p in partitions}
        self.follower.wait_sync(offsets, self.timeout)


def _complete(offsets: dict[int, int]) -> bool:
    """Every partition has a real end offset. librdkafka reports a partition it
    could not ask (its leader is down) as a negative sentinel (-1001) rather than
    an error: a barrier built on it would pass on an empty store and break
    read-your-writes, so such a round is retried, then fails UNAVAILABLE."""
    return all(o >= 0 for o in offsets.values())


# Local errors of a request cut off by a broker going away: the next round asks
# the leaders the refreshed metadata names. (On the 3-node cluster a round in
# flight to the killed node failed _DESTROY_BROKER when librdkafka dropped it.)
_CUT_OFF = frozenset({KafkaError._DESTROY_BROKER, KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN})


def _retriable(exc: KafkaException) -> bool:
    err = exc.args[0] if exc.args else None
    return (bool(getattr(err, "retriable", lambda: False)()) or "leader" in str(exc).lower() or _stale_leader(exc)
            or _cut_off(exc))


# Errors that mean "your idea of the partition's leader is out of date": cured
# by fresh metadata, which a client may not fetch by itself for minutes.
_STALE_LEADER = frozenset({
    KafkaError.FENCED_LEADER_EPOCH, KafkaError.UNKNOWN_LEADER_EPOCH,
    KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE,
})




def _cut_off(exc: KafkaException) -> bool:
    return kafka_config.error_code(exc) in _CUT_OFF


def _timed_out(exc: KafkaException) -> bool:
    # Also "timed out in queue": the request waited in librdkafka's queue past its
    # timeout, unsent -- e.g. this process frozen a moment, or its connection not up
    # yet. Not retriable by librdkafka's flag, so it failed the read at once: a
    # thin client's read answered UNAVAILABLE at the moment its owner came back
    # from a 2.5 s SIGSTOP (a chaos helper, 2026-12-06), well within its deadline.
    return kafka_config.error_code(exc) in (KafkaError._TIMED_OUT, KafkaError._TIMED_OUT_QUEUE)


def _stale_leader(exc: KafkaException) -> bool:
    return kafka_config.error_code(exc) in _STALE_LEADER
