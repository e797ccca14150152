"""The follower: folds every partition of `<ns>.events` into this process's store.

It reads committed transactions only, resumes from the positions stored with
the state, and publishes how far each partition is applied so read barriers
and the decider can wait on it. A poison event is logged and skipped; the
follower never dies on input.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition
from threadlog.schemas import Codec, CodecError

from threadlog.kernel import kafka_config
from threadlog.kernel.errors import ThreadLogError, not_owner, unavailable
from threadlog.kernel.stuck import Liveness
from threadlog.kernel.topics import INCARNATION_HEADER

from .fold import EventMeta, apply_event
from .store import Store
from .view import View

log = logging.getLogger("threadlog.follower")


class Follower:
    def __init__(
        self,
        bootstrap: str,
        topic: str,
        partitions: int,
        store: Store,
        codec: Codec,
        client_id: str,
        on_event: Callable[[int, int, EventMeta, dict], None] | None = None,
        *,
        kafka: kafka_config.Props | None = None,
    ) -> None:
        self.topic = topic
        self.partitions = partitions
        self.store = store
        self.codec = codec
        self.on_event = on_event
        self._cond = threading.Condition()
        # Next offset known to be folded, per partition: the stored position, or
        # the end of the log when the consumer reported reaching it (which is
        # past trailing transaction markers, which are never delivered).
        self._applied = {p: store.offset(topic, p) for p in range(partitions)}
        self._async_waiters: list[tuple[dict[int, int], asyncio.Future, asyncio.AbstractEventLoop]] = []
        self._stop = threading.Event()
        self.skipped = 0  # poison events seen (for tests and operators)
        # The incarnation check (`_foreign`), set by the runtime before `start`:
        # the topic id records of this state's incarnation carry (bytes), and
        # the question whether the topics were replaced (a reason, or None).
        self.incarnation: bytes | None = None
        self.replaced: Callable[[], str | None] | None = None
        # Partitions folded here (all of them, unless a subclass takes part in a group).
        self.owned: set[int] = set(range(partitions))
        # Partitions whose position the log no longer holds (`_sort`): never fetched,
        # on purpose, so no consumer watchdog may call them stuck (Judge._watch).
        self.unreadable: set[int] = set()
        self._settings = kafka_config.consumer(
            bootstrap,
            f"{client_id}.follower",
            kafka,
            **{"enable.partition.eof": True, "fetch.wait.max.ms": kafka_config.FOLLOWER_WAIT_MS,
               **self._consumer_extra()},
        )
        self._consumer = Consumer(self._settings)
        self._liveness = Liveness()
        self._begin()
        self._thread = threading.Thread(target=self._run, name=f"follower:{topic}", daemon=True)

    def _consumer_extra(self) -> dict:
        return {}

    def _begin(self) -> None:
        """Start consuming: every owned partition (all), from its stored position."""
        self._assign()

    def _assignment(self) -> list[TopicPartition]:
        """The owned partitions, from where they are applied."""
        return [TopicPartition(self.topic, p, self._applied[p] if self._applied[p] > 0 else OFFSET_BEGINNING)
                for p in sorted(self.owned)]

    def _assign(self) -> None:
        self._consumer.assign(self._assignment())
        self._liveness.restart()

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def halt(self) -> None:
        """Fold nothing more (from any thread, at once); `stop` still closes the consumer."""
        self._stop.set()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        try:
            self._consumer.close()
        except Exception:  # pragma: no cover
            pass

    # -- progress ------------------------------------------------------------
    def applied(self, partition: int) -> int:
        with self._cond:
            return self._applied[partition]

    def advance(self, positions: dict[int, int]) -> None:
        """Record that `partition -> next offset` is folded (by us or the decider)."""
        with self._cond:
            changed = False
            for p, nxt in positions.items():
                if nxt > self._applied[p]:
                    self._applied[p] = nxt
                    changed = True
            if not changed:
                return
            self._cond.notify_all()
            still = []
            for targets, fut, loop in self._async_waiters:
                if self._reached_quietly(targets):
                    loop.call_soon_threadsafe(_resolve, fut)
                else:
                    still.append((targets, fut, loop))
            self._async_waiters = still

    def _reached(self, targets: dict[int, int]) -> bool:
        for p, t in targets.items():
            if p not in self.owned:
                raise not_owner(f"partition {p} of {self.topic} is not folded here")
            if self._applied[p] < t:
                if p in self.unreadable:
                    # Never reached: said now and why, not as a timeout (a review).
                    raise self._unreadable(p)
                return False
        return True

    def _unreadable(self, p: int) -> ThreadLogError:
        return unavailable(f"partition {p} of {self.topic} cannot be folded here: its position "
                           f"{self._applied[p]} is no longer in the log (records deleted, or the topic "
                           "deleted and created again)")

    def _fail_waiters_of(self, p: int) -> None:
        """`p` just turned out unreadable: the waits for it to move fail now, saying
        why (they were registered before, and waited out their timeout); a
        blocking wait wakes and asks `_reached`, which now raises."""
        with self._cond:
            self._fail_waits(lambda targets: targets.get(p, 0) > self._applied.get(p, 0), self._unreadable(p))

    def _drop_waiters(self, partitions: set[int]) -> None:
        """Fail the waits on partitions no longer folded here (call holding `_cond`)."""
        self._fail_waits(partitions.intersection, not_owner(f"partitions {sorted(partitions)} moved away"))

    def _fail_waits(self, hit: Callable[[dict[int, int]], Any], error: ThreadLogError) -> None:
        """Fail with `error` the async waits whose targets `hit` says, and wake the
        blocking ones (call holding `_cond`)."""
        still = []
        for targets, fut, loop in self._async_waiters:
            if hit(targets):
                loop.call_soon_threadsafe(_fail, fut, error)
            else:
                still.append((targets, fut, loop))
        self._async_waiters = still
        self._cond.notify_all()

    def _reached_quietly(self, targets: dict[int, int]) -> bool:
        return all(self._applied.get(p, 0) >= t for p, t in targets.items())

    def wait_sync(self, targets: dict[int, int], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._reached(targets):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise unavailable(f"projection of {self.topic} did not reach {targets} in {timeout}s")
                self._cond.wait(left)

    async def wait(self, targets: dict[int, int], timeout: float) -> None:
        loop = asyncio.get_running_loop()
        with self._cond:
            if self._reached(targets):
                return
            fut = loop.create_future()
            self._async_waiters.append((targets, fut, loop))
        try:
            await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise unavailable(f"projection of {self.topic} did not reach {targets} in {timeout}s") from None
        finally:
            # A cancelled wait too (a worker's caller hung up): left registered, it
            # stayed until its target was reached -- never, for a far-off floor --
            # and every judged batch walked it under the lock (a review: 3 000
            # hung-up requests, ~3 ms more per batch).
            if not fut.done() or fut.cancelled():
                with self._cond:
                    self._async_waiters = [w for w in self._async_waiters if w[1] is not fut]

    # -- the loop --------------------------------------------------------------
    def _between_batches(self) -> None:
        """On the follower's thread, before each poll (ownership changes, in subclasses)."""

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._between_batches()
                msgs = kafka_config.drain(self._consumer, 2000, 0.1)
            except Exception:  # pragma: no cover - librdkafka hiccup
                log.exception("follower consume failed")
                time.sleep(0.1)
                continue
            self._liveness.saw(msgs, full=len(msgs) >= 2000)
            if msgs:
                try:
                    self._handle(msgs)
                except Exception:  # pragma: no cover - a bug must not stop folding
                    log.exception("follower failed on a batch; retrying from stored positions")
                    self._rewind()
            # A consumer that stopped reading is replaced (threadlog/kernel/stuck.py):
            # every run's appends wait for this fold's verdicts, its live readers for its records.
            self._consumer = self._liveness.check(self._consumer, self.topic, self.owned, self._applied,
                                                  self._settings, self._assignment)

    @property
    def restarts(self) -> int:
        """Consumers replaced because they stopped reading (operators, tests)."""
        return self._liveness.restarts

    def _rewind(self) -> None:
        for p in sorted(self.owned):
            try:
                self._consumer.seek(TopicPartition(self.topic, p, self.store.offset(self.topic, p)))
            except Exception:
                pass
        time.sleep(0.1)

    def _foreign(self, msgs: list[kafka_config.Consumed]) -> bool:
        """Does this batch come from another incarnation of the topic than the state's?

        A record written by a client of a newer incarnation names its topic id
        (INCARNATION_HEADER, threadlog/kernel/topics.py says why). On the first
        such record, `replaced()` asks the broker now (the incarnation watch,
        which halts this follower when the ids changed): True drops the batch
        unfolded. "Unchanged" (a client of an older incarnation, a forged
        header) folds it; the watch asks the broker at most once a second, so
        headers cannot make every batch cost a DescribeTopics. Records without
        the header pass."""
        mine = self.incarnation
        if mine is None or self.replaced is None:
            return False
        for msg in msgs:
            headers = msg.headers()
            if headers:
                for name, value in headers:
                    if name == INCARNATION_HEADER and value != mine:
                        if self.replaced() is None:
                            return False
                        log.error("%s: records of another incarnation of the topic: not folding them", self.topic)
                        return True
        return False

    def _sort(self, msgs: list[kafka_config.Consumed]) -> tuple[dict[int, list[kafka_config.Consumed]], dict[int, int]]:
        """A consumer batch as (records by partition, in order; end-of-partition offsets)."""
        if self._foreign(msgs):
            return {}, {}
        eof: dict[int, int] = {}
        by_partition: dict[int, list[kafka_config.Consumed]] = {}
        for msg in msgs:
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    eof[msg.partition()] = msg.offset()
                elif err.code() == KafkaError._AUTO_OFFSET_RESET:
                    # Our stored position is not in the log (a judge refuses librdkafka's
                    # reset to 0): the topic was deleted and created again, or records
                    # were deleted. The partition waits; the incarnation watch stops us.
                    self.unreadable.add(msg.partition())
                    log.error("%s[%s]: the stored position is not in the log any more (%s): not folding it",
                              self.topic, msg.partition(), err)
                    self._fail_waiters_of(msg.partition())
                else:
                    log.warning("%s consumer error: %s", self.topic, err)
                continue
            by_partition.setdefault(msg.partition(), []).append(msg)
        return by_partition, eof

    def _handle(self, msgs: list[kafka_config.Consumed]) -> None:
        by_partition, eof = self._sort(msgs)
        advanced: dict[int, int] = {}
        with self.store.lock:
            view = View(self.store)
            positions: dict[tuple[str, int], int] = {}
            for p, items in by_partition.items():
                stored = self.store.offset(self.topic, p)
                last = None
                for msg in items:
                    if msg.offset() < stored:
                        continue  # already folded (by the decider of this process)
                    self._fold(view, p, msg)
                    last = msg.offset()
                if last is not None:
                    positions[(self.topic, p)] = last + 1
                    advanced[p] = last + 1
            if positions:
                self.store.apply(view.buffer, positions)
        for p, items in by_partition.items():
            advanced[p] = max(advanced.get(p, 0), items[-1].offset() + 1)
        for p, off in eof.items():
            advanced[p] = max(advanced.get(p, 0), off)
        if advanced:
            self.advance(advanced)

    def _fold(self, view: View, partition: int, msg: kafka_config.Consumed) -> None:
        try:
            _, env = self.codec.decode(msg.value(), expect="threadlog.Event")
            _, payload = self.codec.decode(env["payload"], expect=env["type"])
        except CodecError as exc:
            self.skipped += 1
            log.error("undecodable event at %s[%d]@%d skipped: %s", self.topic, partition, msg.offset(), exc)
            return
        meta = EventMeta(env["key"], env["seq"], env["decidedAt"], env["commandId"], env["type"])
        child = view.child()
        try:
            apply_event(child, meta, payload)
        except Exception:
            self.skipped += 1
            log.exception("fold of %s at %s[%d]@%d failed; skipped", meta.type, self.topic, partition, msg.offset())
            return
        child.merge()
        if self.on_event is not None:
            self.on_event(partition, msg.offset(), meta, payload)


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def _fail(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
