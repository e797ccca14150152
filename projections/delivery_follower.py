"""The run index follower: folds `<ns>.deliveries` and feeds live delivery readers.

It is the events `Follower` (same consumer settings, stored positions, read
barrier, poison handling) with another fold: each record is decoded as a
`threadlog.Delivery` and folded by `run_index.fold_record`. It also hands every
folded record to the readers tailing that run (`subscribe`), so a reader that
is caught up waits on a queue, not on a Kafka consumer of its own: a thousand
browsers tailing runs cost one consumer per process.

Hand-off without gap or overlap: `subscribe` returns `live_from[p]`, and under
one lock every record at or after it is delivered to the subscription, every
record before it was folded already (the reader reads those from Kafka, see
`threadlog.delivery`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from confluent_kafka import KafkaError
from threadlog.schemas import Codec, CodecError

from threadlog.kernel.errors import ThreadLogError, unavailable
from threadlog.kernel.kafka_config import Consumed, Props
from threadlog.kernel.partitioning import partition_for
from threadlog.kernel.topics import reply_of

from .follower import Follower
from .run_index import decided, fold_record, run_state
from .store import Store
from .view import View

if TYPE_CHECKING:
    from threadlog.processors.verdict_push import VerdictPush

log = logging.getLogger("threadlog.deliveries")


@dataclass(frozen=True)
class Item:
    """One folded record of a run, as a live reader receives it."""

    partition: int
    offset: int
    record: dict  # the decoded threadlog.Delivery
    dropped: str | None  # None: the record stands; else why the fold dropped it
    size: int = 0  # bytes of the record as stored (what a queue of it holds, about)


# What one live reader may have queued before it is dropped from the feed: a
# count alone let a client that reads nothing (an SSE socket at window 0) pin
# 20 000 records of up to 1 MB each -- 666 MB of RSS for one stalled browser.
MAX_QUEUED_BYTES = 16 * 1024 * 1024


class Subscription:
    """A reader's queue of a run's records at or after `live_from`. Read it with
    `popleft` and `put_back` (they keep its byte count)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, run_id: str, partition: int, max_items: int,
                 max_bytes: int = MAX_QUEUED_BYTES) -> None:
        self.loop = loop
        self.run_id = run_id
        self.partition = partition
        self.live_from = 0
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.items: collections.deque[Item] = collections.deque()
        self.queued_bytes = 0
        # A reader that falls this far behind (records or bytes) is dropped from the
        # live feed and catches up from Kafka again (memory stays bounded per slow client).
        self.overflowed = False
        self.failure: ThreadLogError | None = None
        self._wake = asyncio.Event()

    # follower thread
    def deliver(self, items: list[Item]) -> None:
        try:
            self.loop.call_soon_threadsafe(self._put, items)
        except RuntimeError:  # the reader's loop is gone
            pass

    def fail(self, error: ThreadLogError) -> None:
        try:
            self.loop.call_soon_threadsafe(self._fail, error)
        except RuntimeError:
            pass

    # reader's loop
    def _put(self, items: list[Item]) -> None:
        if self.overflowed:
            return
        size = sum(it.size for it in items)
        if len(self.items) + len(items) > self.max_items or self.queued_bytes + size > self.max_bytes:
            self.overflowed = True
            self.items.clear()
            self.queued_bytes = 0
        else:
            self.items.extend(items)
            self.queued_bytes += size
        self._wake.set()

    def popleft(self) -> Item:
        item = self.items.popleft()
        self.queued_bytes -= item.size
        return item

    def put_back(self, held: list[Item]) -> None:
        """Queue `held` (taken with `popleft`) again, in front, in its order."""
        self.items.extendleft(reversed(held))
        self.queued_bytes += sum(it.size for it in held)

    def _fail(self, error: ThreadLogError) -> None:
        self.failure = error
        self._wake.set()

    async def wait(self, timeout: float | None) -> bool:
        """Wait until something is queued (or the feed broke); False on timeout."""
        while not self.items and not self.overflowed and self.failure is None:
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except TimeoutError:
                return False
        return True


class Subscribers:
    """Live readers by run, and the lock a feed hands records over under.

    The hand-off has no gap only if a reader's `live_from` is read, and the
    reader registered, under the same lock the feed holds while it hands a
    batch out and moves its dispatched position: callers of `add` and `of`
    hold `lock` (it also guards their positions)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._by_run: dict[str, set[Subscription]] = {}

    def add(self, sub: Subscription) -> None:
        self._by_run.setdefault(sub.run_id, set()).add(sub)

    def of(self, run_id: str) -> set[Subscription] | tuple[()]:
        return self._by_run.get(run_id, ())

    def __bool__(self) -> bool:
        return bool(self._by_run)

    def remove(self, sub: Subscription) -> None:
        with self.lock:
            subs = self._by_run.get(sub.run_id)
            if subs is not None:
                subs.discard(sub)
                if not subs:
                    del self._by_run[sub.run_id]

    def fail_all(self, error: ThreadLogError) -> None:
        with self.lock:
            subs = [s for group in self._by_run.values() for s in group]
            self._by_run.clear()
        for sub in subs:
            sub.fail(error)


class DeliveryIndex(Follower):
    def __init__(
        self,
        bootstrap: str,
        topic: str,
        partitions: int,
        store: Store,
        codec: Codec,
        client_id: str,
        max_queued: int = 20_000,
        *,
        kafka: Props | None = None,
        owned: set[int] | None = None,
    ) -> None:
        # A worker folds only the delivery partitions of the events partitions the
        # group gave it (`set_owned`); every other role folds them all.
        self._initial = set(range(partitions)) if owned is None else set(owned)
        self._want: set[int] | None = None
        self._want_lock = threading.Lock()
        super().__init__(bootstrap, topic, partitions, store, codec, f"{client_id}.deliveries", kafka=kafka)
        self.max_queued = max_queued
        self._folded: list[Item] = []
        # Answers pushed to the writers of the records folded (a worker's thin
        # clients, processors/verdict_push.py): (token, d, x, run, kind, epoch).
        self.push: VerdictPush | None = None
        self._replies: list[tuple[bytes, int, int, str, str, int]] = []
        self._pushing = False
        self._subs = Subscribers()
        # Every record below this was handed to the subscribers of its run.
        self._dispatched = {p: self.applied(p) for p in range(partitions)}
        self._stopped = False

    # -- ownership -----------------------------------------------------------------
    def _begin(self) -> None:
        self.owned = set(self._initial)
        self._assign()

    def set_owned(self, partitions: set[int]) -> None:
        """Fold these partitions from now on (applied on the follower's thread)."""
        with self._want_lock:
            self._want = set(partitions)

    def _between_batches(self) -> None:
        with self._want_lock:
            want, self._want = self._want, None
        if want is None or want == self.owned:
            return
        with self._cond:
            gone = self.owned - want
            for p in want - self.owned:
                # Resume where this store stopped folding it: the state there is
                # exactly the fold of everything before that position.
                self._applied[p] = self.store.offset(self.topic, p)
            self.owned = want
            self._drop_waiters(gone)
        with self._subs.lock:
            for p in want:
                self._dispatched[p] = self._applied[p]
        self._assign()

    # -- live feed ---------------------------------------------------------------
    def subscribe(self, run_id: str, partition: int) -> Subscription:
        sub = Subscription(asyncio.get_running_loop(), run_id, partition, self.max_queued)
        with self._subs.lock:
            if self._stopped:
                raise unavailable("the delivery index is stopped")
            sub.live_from = self._dispatched[partition]
            self._subs.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        self._subs.remove(sub)

    def halt(self, reason: str = "the delivery index was halted") -> None:
        """Fold nothing more, and end every live reader with UNAVAILABLE: no record
        will wake them again. Why: halted when the topics were replaced under the
        process, this stopped folding only, and a live reader (an SSE stream) waited
        for a next record for good, its slot held (a review)."""
        super().halt()
        self._refuse(unavailable(reason))

    def stop(self) -> None:
        super().stop()
        self._refuse(unavailable("the client was closed"))

    def _refuse(self, error: ThreadLogError) -> None:
        """No subscription from now on; every one there is fails with `error`."""
        with self._subs.lock:
            self._stopped = True
        self._subs.fail_all(error)

    # -- folding -------------------------------------------------------------------
    def _fold(self, view: View, partition: int, msg: Consumed) -> None:
        try:
            _, rec = self.codec.decode(msg.value(), expect="threadlog.Delivery")
        except CodecError as exc:
            self.skipped += 1
            log.error("undecodable delivery record at %s[%d]@%d skipped: %s",
                      self.topic, partition, msg.offset(), exc.message)
            return
        if msg.key() != rec["runId"].encode("utf-8") or partition != partition_for(rec["runId"], self.partitions):
            # Every reader finds a run's records by their key on the run's partition
            # (the catch-up filter, the thin client's tail): one keyed otherwise, or on
            # another partition, is judged by none of them, so it is poison here too,
            # not a record of the run. (The index keys a run's records by offset
            # alone: one on another partition overwrote the verdict of the run's own
            # record at that offset, and moved its fence, for this index only.)
            self.skipped += 1
            log.error("delivery record at %s[%d]@%d keyed other than its run, or not on its run's partition; "
                      "skipped", self.topic, partition, msg.offset())
            return
        child = view.child()
        try:
            dropped = fold_record(child, msg.offset(), rec)
        except Exception:
            self.skipped += 1
            log.exception("run index fold failed at %s[%d]@%d; skipped", self.topic, partition, msg.offset())
            return
        child.merge()
        self._folded.append(Item(partition, msg.offset(), rec, dropped, len(msg.value() or b"")))
        if self._pushing:
            token = reply_of(msg.headers())
            if token is not None:
                self._replies.append((token, partition, msg.offset(), rec["runId"], rec["kind"], rec["epoch"]))

    def _handle(self, msgs: list[Consumed]) -> None:
        self._folded = []
        self._replies = []
        # Once per batch: does anyone take pushed answers (record headers are read only then)?
        self._pushing = self.push is not None and self.push.active
        super()._handle(msgs)  # folds (via _fold), stores, advances positions
        if self._stop.is_set():
            # Halted in that batch (`Follower._foreign`: records of another
            # incarnation, dropped unfolded): nothing of it is dispatched, and no
            # reader's position moves past records never folded.
            return
        reached: dict[int, int] = {}
        for msg in msgs:
            err = msg.error()
            if err is None:
                nxt = msg.offset() + 1
            elif err.code() == KafkaError._PARTITION_EOF:
                nxt = msg.offset()
            else:
                continue
            reached[msg.partition()] = max(reached.get(msg.partition(), 0), nxt)
        per_sub: dict[Subscription, list[Item]] = {}
        with self._subs.lock:
            for item in self._folded:
                for sub in self._subs.of(item.record["runId"]):
                    if item.offset >= sub.live_from:
                        per_sub.setdefault(sub, []).append(item)
            for p, nxt in reached.items():
                if nxt > self._dispatched[p]:
                    self._dispatched[p] = nxt
        self._folded = []
        for sub, items in per_sub.items():
            sub.deliver(items)
        self._push_answers()

    def _push_answers(self) -> None:
        """The batch is stored: each writer gets what `dlv_verdict` would answer now."""
        replies, self._replies = self._replies, []
        push = self.push  # read once: the query server unsets it when it closes
        if not replies or push is None:
            return
        try:
            answers = []
            for token, d, x, run, kind, epoch in replies:
                verdict, fence = decided(self.store, run, x, kind, epoch)
                answers.append((token, [d, x, verdict, fence, run_state(self.store, run)]))
            push.push_deliveries(answers)
        except Exception:  # pragma: no cover - a push is an optimization; its writers ask
            log.exception("pushing delivery answers failed")
