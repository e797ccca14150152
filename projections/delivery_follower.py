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

from confluent_kafka import KafkaError
from threadlog.schemas import Codec, CodecError

from threadlog.errors import ThreadLogError, unavailable
from threadlog.kafka_config import Consumed, Props

from .follower import Follower
from .run_index import fold_record
from .store import Store
from .view import View

log = logging.getLogger("threadlog.deliveries")


@dataclass(frozen=True)
class Item:
    """One folded record of a run, as a live reader receives it."""

    partition: int
    offset: int
    record: dict  # the decoded threadlog.Delivery
    dropped: str | None  # None: the record stands; else why the fold dropped it


class Subscription:
    """A reader's queue of a run's records at or after `live_from`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, run_id: str, partition: int, max_items: int) -> None:
        self.loop = loop
        self.run_id = run_id
        self.partition = partition
        self.live_from = 0
        self.max_items = max_items
        self.items: collections.deque[Item] = collections.deque()
        # A reader that falls this far behind is dropped from the live feed and
        # catches up from Kafka again (memory stays bounded per slow client).
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
        if len(self.items) + len(items) > self.max_items:
            self.overflowed = True
            self.items.clear()
        else:
            self.items.extend(items)
        self._wake.set()

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
    ) -> None:
        super().__init__(bootstrap, topic, partitions, store, codec, f"{client_id}.deliveries", kafka=kafka)
        self.max_queued = max_queued
        self._folded: list[Item] = []
        self._subs_lock = threading.Lock()
        self._subs: dict[str, set[Subscription]] = {}
        # Every record below this was handed to the subscribers of its run.
        self._dispatched = {p: self.applied(p) for p in range(partitions)}
        self._stopped = False

    # -- live feed ---------------------------------------------------------------
    def subscribe(self, run_id: str, partition: int) -> Subscription:
        sub = Subscription(asyncio.get_running_loop(), run_id, partition, self.max_queued)
        with self._subs_lock:
            if self._stopped:
                raise unavailable("the delivery index is stopped")
            sub.live_from = self._dispatched[partition]
            self._subs.setdefault(run_id, set()).add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        with self._subs_lock:
            subs = self._subs.get(sub.run_id)
            if subs is not None:
                subs.discard(sub)
                if not subs:
                    del self._subs[sub.run_id]

    def stop(self) -> None:
        super().stop()
        with self._subs_lock:
            self._stopped = True
            subs = [s for group in self._subs.values() for s in group]
            self._subs.clear()
        for sub in subs:
            sub.fail(unavailable("the client was closed"))

    # -- folding -------------------------------------------------------------------
    def _fold(self, view: View, partition: int, msg: Consumed) -> None:
        try:
            _, rec = self.codec.decode(msg.value(), expect="threadlog.Delivery")
        except CodecError as exc:
            self.skipped += 1
            log.error("undecodable delivery record at %s[%d]@%d skipped: %s",
                      self.topic, partition, msg.offset(), exc.message)
            return
        child = view.child()
        try:
            dropped = fold_record(child, msg.offset(), rec)
        except Exception:
            self.skipped += 1
            log.exception("run index fold failed at %s[%d]@%d; skipped", self.topic, partition, msg.offset())
            return
        child.merge()
        self._folded.append(Item(partition, msg.offset(), rec, dropped))

    def _handle(self, msgs: list[Consumed]) -> None:
        self._folded = []
        super()._handle(msgs)  # folds (via _fold), stores, advances positions
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
        with self._subs_lock:
            for item in self._folded:
                for sub in self._subs.get(item.record["runId"], ()):
                    if item.offset >= sub.live_from:
                        per_sub.setdefault(sub, []).append(item)
            for p, nxt in reached.items():
                if nxt > self._dispatched[p]:
                    self._dispatched[p] = nxt
        self._folded = []
        for sub, items in per_sub.items():
            sub.deliver(items)
