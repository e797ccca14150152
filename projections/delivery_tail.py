"""A thin client's live feed of `<ns>.deliveries`: records, not folded.

A thin client keeps no run index: the owner of a run's partition judges its
records (processors/query_server.py). Live readers still need the run's new
records as they land, and one consumer per waiting reader does not scale (a
thousand browsers tailing runs). So one consumer per process tails only the
partitions that have live readers, from their end when the first reader
arrives, and hands each record to the readers of its run. Each reader judges
its run's records itself with the run index fold (`run_index.RunFold`), from
the run's state the owner gave it.

Hand-off without gap: `subscribe` returns `live_from`; every record of the
partition at or after it reaches the subscription, in offset order.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from concurrent.futures import Future as CFuture

from confluent_kafka import Consumer, KafkaError, TopicPartition
from threadlog.schemas import Codec, CodecError

from threadlog.kernel import kafka_config
from threadlog.kernel.errors import unavailable
from threadlog.kernel.stuck import Liveness

from .delivery_follower import Item, Subscribers, Subscription

log = logging.getLogger("threadlog.deliveries.tail")


class DeliveryTail:
    def __init__(self, bootstrap: str, topic: str, codec: Codec, client_id: str, timeout: float,
                 max_queued: int = 20_000, *, kafka: kafka_config.Props | None = None) -> None:
        self.topic = topic
        self.codec = codec
        self.timeout = timeout
        self.max_queued = max_queued
        self._settings = kafka_config.consumer(
            bootstrap, f"{client_id}.dlvtail", kafka,
            **{"enable.partition.eof": True, "fetch.wait.max.ms": kafka_config.READER_WAIT_MS},
        )
        self._consumer = Consumer(self._settings)
        self._liveness = Liveness()
        self._subs = Subscribers()
        self._lock = self._subs.lock  # also guards _dispatched and _joining (the hand-off)
        self._joining: list[tuple[int, CFuture]] = []  # partitions readers wait to have tailed
        self._wake = threading.Event()
        self._dispatched: dict[int, int] = {}  # partitions tailed -> every record below went out
        self._stop = threading.Event()
        self._why = "this ThreadLog is closed"  # a subscription's refusal once stopped or halted
        self._thread = threading.Thread(target=self._run, name=f"dlvtail:{topic}", daemon=True)
        self._thread.start()

    def _join(self, partition: int) -> None:
        """Start tailing `partition` at its end. On the tail's thread: librdkafka
        serialises calls on one consumer, so a watermark query from another
        thread waits behind its poll (measured: it never returned)."""
        with self._lock:
            if partition in self._dispatched:
                return
        _, high = self._consumer.get_watermark_offsets(TopicPartition(self.topic, partition),
                                                       timeout=self.timeout)
        self._consumer.incremental_assign([TopicPartition(self.topic, partition, high)])
        with self._lock:
            self._dispatched[partition] = high

    def _joins(self) -> None:
        while True:
            with self._lock:
                if not self._joining:
                    return
                partition, fut = self._joining.pop(0)
            # A reader that stopped waiting (a closed browser tab cancels its SSE
            # request) cancelled the future: settling it then raises, and this
            # thread -- every live reader's feed -- must not die of that.
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                self._join(partition)
            except Exception as exc:
                fut.set_exception(unavailable(f"cannot read the end of {self.topic}[{partition}]: {exc}"))
            else:
                fut.set_result(None)

    async def subscribe(self, run_id: str, partition: int) -> Subscription:
        if self._stop.is_set():
            raise unavailable(self._why)
        if partition not in self._dispatched:
            fut: CFuture = CFuture()
            with self._lock:
                if self._stop.is_set():
                    raise unavailable(self._why)
                self._joining.append((partition, fut))
            self._wake.set()
            try:
                await asyncio.wait_for(asyncio.wrap_future(fut), self.timeout + 1)
            except TimeoutError:
                raise unavailable(f"{self.topic}[{partition}] not tailed within {self.timeout}s") from None
        sub = Subscription(asyncio.get_running_loop(), run_id, partition, self.max_queued)
        with self._lock:
            # Checked with the registration, under the lock `_refuse` takes: a
            # subscription whose join finished after a halt was registered after
            # every one was failed, fed and failed by nothing, for good (a review).
            if self._stop.is_set():
                raise unavailable(self._why)
            sub.live_from = self._dispatched[partition]
            self._subs.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        self._subs.remove(sub)

    def halt(self, reason: str) -> None:
        """Tail nothing more and end every live reader with UNAVAILABLE (from any
        thread, at once): the topics were replaced under the process, and what the
        tail would read next is another log's (`stop` still closes the consumer)."""
        self._refuse(reason)

    def stop(self) -> None:
        self._refuse("the client was closed")
        self._thread.join(timeout=10)
        try:
            self._consumer.close()
        except Exception:  # pragma: no cover
            pass

    def _refuse(self, reason: str) -> None:
        """Tail nothing more: no subscription from now on (checked under the lock),
        and every one there is, or waiting for its partition's join, fails now."""
        with self._lock:
            if not self._stop.is_set():
                self._why = reason
                self._stop.set()
            joining, self._joining = self._joining, []
        self._wake.set()
        error = unavailable(self._why)
        for _, fut in joining:
            if fut.set_running_or_notify_cancel():  # not cancelled by a reader that stopped waiting
                fut.set_exception(error)
        self._subs.fail_all(error)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._joins()
            except Exception:  # pragma: no cover - a bug must not stop every live reader's feed
                log.exception("delivery tail join failed")
            with self._lock:
                idle = not self._dispatched
            if idle:
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                msgs = kafka_config.drain(self._consumer, 1000, 0.1)
            except Exception:  # pragma: no cover - librdkafka hiccup
                log.exception("delivery tail consume failed")
                self._stop.wait(0.1)
                continue
            self._liveness.saw(msgs, full=len(msgs) >= 1000)
            self._dispatch(msgs)
            # A consumer that stopped reading is replaced (threadlog/kernel/stuck.py): every
            # live reader of this process waits for its records. It reads on from where every
            # record below went out: none is lost or handed out twice.
            with self._lock:
                tailed = dict(self._dispatched)
            self._consumer = self._liveness.check(self._consumer, self.topic, tailed, tailed, self._settings,
                                                  functools.partial(self._assignment, tailed))

    def _assignment(self, tailed: dict[int, int]) -> list[TopicPartition]:
        return [TopicPartition(self.topic, p, at) for p, at in sorted(tailed.items())]

    @property
    def restarts(self) -> int:
        """Consumers replaced because they stopped reading (operators, tests)."""
        return self._liveness.restarts

    def _dispatch(self, msgs: list) -> None:
        per_sub: dict[Subscription, list[Item]] = {}
        with self._lock:
            for msg in msgs:
                err = msg.error()
                p = msg.partition()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        self._dispatched[p] = max(self._dispatched.get(p, 0), msg.offset())
                    else:
                        log.warning("delivery tail: %s", err)
                    continue
                self._dispatched[p] = max(self._dispatched.get(p, 0), msg.offset() + 1)
                subs = self._subs.of(msg.key().decode("utf-8", "replace")) if msg.key() else None
                if not subs:
                    continue
                try:
                    _, rec = self.codec.decode(msg.value(), expect="threadlog.Delivery")
                except CodecError:
                    continue  # the owner's fold skips it too: it changes nothing
                for sub in subs:
                    # Keyed other than its run: poison, skipped by the owner's fold too.
                    if msg.offset() >= sub.live_from and sub.partition == p and rec["runId"] == sub.run_id:
                        per_sub.setdefault(sub, []).append(Item(p, msg.offset(), rec, None, len(msg.value() or b"")))
        for sub, items in per_sub.items():
            sub.deliver(items)
