"""The decider: commands in, events + replies out, exactly once.

One consumer in the group `<ns>.decider` owns some partitions of
`<ns>.commands`; for each poll batch it decides every command against the
state of its partitions and writes, in **one Kafka transaction**, the accepted
events (to the same partition of `<ns>.events`), one reply per command, any
follow-up commands and delivery markers, and the consumer offsets. Then --
only then -- the batch's state changes reach the store, together with the
event offsets they reflect. An aborted transaction leaves nothing: its
buffered state is dropped and the consumer rewinds.

Why a plain confluent-kafka loop and not faust-streaming (KAFKA-NOTES 2-3):
KIP-447 fencing with one producer per process and the group metadata, a
commit per poll batch instead of a 2.8 s timer, and no known duplicate bugs on
kill/restart.

Latency: a transaction costs a few broker round trips. Back-to-back
transactions on one producer also wait for the previous commit's markers
(CONCURRENT_TRANSACTIONS retries), so the engine alternates between a small
pool of transactional producers; each still commits strictly after the
previous batch, so order and exactly-once are unchanged.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from threadlog.projections.barrier import ReadBarrier
from threadlog.projections.fold import EventMeta, apply_event, current_seq
from threadlog.projections.follower import Follower
from threadlog.projections.store import Store
from threadlog.projections.view import View
from threadlog.schemas import Codec, CodecError

from threadlog import kafka_config
from threadlog.errors import INVALID_ARGUMENT, INVALID_MESSAGE, ThreadLogError
from threadlog.partitioning import partition_for
from threadlog.topics import TopicLayout, Topics
from threadlog.validation import dumps

from .handlers import HANDLERS, Context, Decision, Settings

log = logging.getLogger("threadlog.decider")

PRODUCER_POOL = 2


class DeciderFenced(RuntimeError):
    """Another instance took over: this decider must stop writing."""


class _Postpone(Exception):
    """The batch cannot be decided now (the cluster did not answer a barrier)."""


class _BatchView(View):
    """A partition's buffer; reads also see this batch's other partitions."""

    def __init__(self, store: Store, buffers: dict[int, dict], partition: int) -> None:
        super().__init__(store, buffers.setdefault(partition, {}))
        self._others = [b for p, b in buffers.items() if p != partition]

    def get(self, k: bytes) -> bytes | None:
        if k in self.buffer:
            return self.buffer[k]
        for other in self._others:
            if k in other:
                return other[k]
        return self.store.get(k)


class Decider:
    def __init__(
        self,
        *,
        bootstrap: str,
        topics: Topics,
        layout: TopicLayout,
        store: Store,
        follower: Follower,
        barrier: ReadBarrier,
        codec: Codec,
        instance_id: str,
        settings: Settings,
        clock: Callable[[], float] | None = None,
        max_batch: int = 500,
    ) -> None:
        self.topics = topics
        self.layout = layout
        self.store = store
        self.follower = follower
        self.barrier = barrier
        self.codec = codec
        self.settings = settings
        self.clock = clock or (lambda: time.time() * 1000.0)
        self.max_batch = max_batch
        self.instance_id = instance_id
        self._stop = threading.Event()
        self.assigned: set[int] = set()
        self._ready: set[int] = set()
        self.first_assignment = threading.Event()
        self.failure: BaseException | None = None
        self.stats = {"batches": 0, "commands": 0, "refused": 0, "poison": 0, "aborts": 0}
        client_id = f"{topics.namespace}.decider.{instance_id}"
        self._consumer = Consumer(
            kafka_config.consumer(
                bootstrap,
                client_id,
                **{
                    "group.id": topics.decider_group,
                    # Notice rebalances quickly: a new member waits for everyone's heartbeat.
                    "heartbeat.interval.ms": 250,
                    "session.timeout.ms": 6000,
                    "fetch.wait.max.ms": 20,
                },
            )
        )
        self._producers = [
            Producer(
                kafka_config.transactional_producer(
                    bootstrap, f"{client_id}.{n}", f"{topics.namespace}.decider.{instance_id}.{n}"
                )
            )
            for n in range(PRODUCER_POOL)
        ]
        self._next_producer = 0
        self._out_topics = {
            "deliveries": (topics.deliveries, layout.deliveries),
            "blobs": (topics.blobs, layout.blobs),
        }
        self._thread = threading.Thread(target=self._run, name=f"decider:{topics.namespace}", daemon=True)

    # -- lifecycle -------------------------------------------------------------
    def start(self) -> None:
        # init_transactions fences any earlier instance with the same ids and
        # aborts its open transaction, so its writes never become visible.
        threads = [threading.Thread(target=p.init_transactions, args=(30,)) for p in self._producers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self._consumer.subscribe([self.topics.commands], on_assign=self._on_assign, on_revoke=self._on_revoke)
        self._thread.start()

    def stop(self, timeout: float = 15.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout)
        try:
            self._consumer.close()  # leave the group now: others take over at once
        except Exception:  # pragma: no cover
            pass
        for p in self._producers:
            try:
                p.flush(1)
            except Exception:  # pragma: no cover
                pass

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _on_assign(self, consumer, partitions) -> None:
        self.assigned = {tp.partition for tp in partitions}
        self._ready &= self.assigned
        self.first_assignment.set()
        log.info("decider %s assigned %s", self.instance_id, sorted(self.assigned))

    def _on_revoke(self, consumer, partitions) -> None:
        self.assigned -= {tp.partition for tp in partitions}
        self._ready -= {tp.partition for tp in partitions}

    # -- the loop ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                msgs = kafka_config.drain(self._consumer, self.max_batch, 0.05)
                msgs = [m for m in msgs if self._keep(m)]
                if msgs:
                    self._batch(msgs)
        except DeciderFenced as exc:
            self.failure = exc
            log.error("decider %s fenced; stopping: %s", self.instance_id, exc)
        except BaseException as exc:  # pragma: no cover - reported to the owner
            self.failure = exc
            log.exception("decider %s stopped", self.instance_id)

    def _keep(self, msg) -> bool:
        err = msg.error()
        if err is None:
            return True
        if err.code() != KafkaError._PARTITION_EOF:
            log.warning("commands consumer error: %s", err)
        return False

    def _ensure_ready(self, partitions: set[int]) -> None:
        """Before deciding on a newly assigned partition, fold everything its
        previous owner committed: the state must be the whole log's."""
        todo = partitions - self._ready
        if not todo:
            return
        targets = self.barrier.stable_offsets_sync()
        self.follower.wait_sync({p: targets[p] for p in todo}, timeout=60)
        self._ready |= todo

    def _sync_global(self) -> None:
        targets = self.barrier.stable_offsets_sync()
        mine = self.assigned
        self.follower.wait_sync({p: o for p, o in targets.items() if p not in mine}, timeout=30)

    def _batch(self, msgs) -> None:
        first_offsets: dict[int, int] = {}
        for m in msgs:
            first_offsets.setdefault(m.partition(), m.offset())
        try:
            self._decide_batch(msgs, first_offsets)
        except (ThreadLogError, _Postpone) as exc:
            # The cluster did not answer a barrier in time: nothing was written,
            # so decide the same commands again once it does.
            log.warning("batch postponed: %s", exc)
            self._rewind(first_offsets)
            time.sleep(0.2)

    def _decide_batch(self, msgs, first_offsets: dict[int, int]) -> None:
        self._ensure_ready({m.partition() for m in msgs})
        buffers: dict[int, dict] = {}
        out: list[tuple[str, int, bytes, bytes | None, bool]] = []  # topic, partition, key, value, is_event
        synced = {"done": False}

        def sync_global() -> None:
            if not synced["done"]:
                try:
                    self._sync_global()
                except ThreadLogError as exc:
                    raise _Postpone(exc.message) from None
                synced["done"] = True

        for msg in msgs:
            self._decide_one(msg, buffers, out, sync_global)
        self.stats["batches"] += 1
        self.stats["commands"] += len(msgs)

        event_offsets: dict[int, list[int]] = {}
        if not self._commit(msgs, out, event_offsets, first_offsets):
            return
        self._publish(buffers, event_offsets)

    def _decide_one(self, msg, buffers, out, sync_global) -> None:
        partition = msg.partition()
        try:
            _, cmd = self.codec.decode(msg.value(), expect="threadlog.Command")
        except CodecError as exc:
            # Nobody to answer: log it, count it, and move past it (the offset
            # is committed with the batch, so it is never decided again).
            self.stats["poison"] += 1
            log.warning("undecodable command at %s[%d]@%d skipped: %s",
                        self.topics.commands, partition, msg.offset(), exc.message)
            return
        try:
            ptype, payload = self.codec.decode(cmd["payload"], expect=cmd["type"])
        except CodecError as exc:
            self._reply(out, cmd, False, INVALID_MESSAGE, f"command payload undecodable: {exc.message}")
            return
        handler = HANDLERS.get(ptype)
        if handler is None:
            self._reply(out, cmd, False, INVALID_ARGUMENT, f"unknown command type {ptype}")
            return
        view = _BatchView(self.store, buffers, partition).child()
        ctx = Context(
            now=float(self.clock()),
            key=cmd["key"],
            command_id=cmd["commandId"],
            partition=partition,
            view=view,
            settings=self.settings,
            sync_global=sync_global,
        )
        try:
            decision = handler(ctx, payload)
        except _Postpone:
            raise
        except ThreadLogError as exc:
            self.stats["refused"] += 1
            self._reply(out, cmd, False, exc.code, exc.message)
            return
        except Exception as exc:
            self.stats["refused"] += 1
            log.exception("handler for %s failed", ptype)
            self._reply(out, cmd, False, INVALID_ARGUMENT, f"could not decide {ptype}: {exc!r}")
            return
        try:
            staged = self._stage(ctx, cmd, decision)
        except ThreadLogError as exc:
            self._reply(out, cmd, False, exc.code, exc.message)
            return
        except Exception as exc:  # a handler produced something unencodable: a bug, not a crash
            log.exception("staging the decision of %s failed", ptype)
            self._reply(out, cmd, False, INVALID_ARGUMENT, f"could not record {ptype}: {exc!r}")
            return
        view.merge()
        out.extend(staged)
        if decision.reply:
            self._reply(out, cmd, True, None, None, decision.result)

    def _stage(self, ctx: Context, cmd: dict, decision: Decision) -> list:
        staged = []
        seq = current_seq(ctx.view, ctx.key)
        for etype, payload in decision.events:
            seq += 1
            meta = EventMeta(ctx.key, seq, ctx.now, ctx.command_id, etype)
            body = self.codec.encode(etype, payload)
            env = {
                "key": ctx.key,
                "seq": seq,
                "decidedAt": ctx.now,
                "commandId": ctx.command_id,
                "type": etype,
                "payload": body,
            }
            apply_event(ctx.view, meta, payload)
            staged.append((self.topics.events, ctx.partition, ctx.key.encode(),
                           self.codec.encode("threadlog.Event", env), True))
        for follow in decision.follow_ups:
            env = {
                "commandId": cmd["commandId"],
                "clientId": cmd["clientId"],
                "replyPartition": cmd["replyPartition"],
                "key": follow.key,
                "type": follow.type,
                "sentAt": ctx.now,
                "payload": self.codec.encode(follow.type, follow.payload),
            }
            staged.append((self.topics.commands, partition_for(follow.key, self.layout.commands),
                           follow.key.encode(), self.codec.encode("threadlog.Command", env), False))
        for rec in decision.records:
            topic, partitions = self._out_topics[rec.topic]
            value = None if rec.payload is None else self.codec.encode(rec.type, rec.payload)
            staged.append((topic, partition_for(rec.key, partitions), rec.key.encode(), value, False))
        return staged

    def _reply(self, out, cmd, ok, code, message, result=None) -> None:
        part = cmd.get("replyPartition", -1)
        if not isinstance(part, int) or not 0 <= part < self.layout.replies:
            log.warning("command %s names reply partition %r; reply dropped", cmd.get("commandId"), part)
            return
        rep = {
            "commandId": cmd["commandId"],
            "clientId": cmd["clientId"],
            "ok": ok,
            "code": code,
            "message": message,
            "result": None if result is None else dumps(result),
        }
        out.append((self.topics.replies, part, cmd["clientId"].encode(),
                    self.codec.encode("threadlog.Reply", rep), False))

    # -- the transaction -----------------------------------------------------------
    def _commit(self, msgs, out, event_offsets, first_offsets) -> bool:
        producer = self._producers[self._next_producer]
        self._next_producer = (self._next_producer + 1) % len(self._producers)
        errors: list = []

        def delivered(err, msg, is_event):
            if err is not None:
                errors.append(err)
            elif is_event:
                event_offsets.setdefault(msg.partition(), []).append(msg.offset())

        positions: dict[int, int] = {}
        for m in msgs:
            positions[m.partition()] = m.offset() + 1
        try:
            producer.begin_transaction()
            for topic, partition, key, value, is_event in out:
                producer.produce(topic, value, key, partition=partition,
                                 on_delivery=lambda e, m, ev=is_event: delivered(e, m, ev))
            offsets = [TopicPartition(self.topics.commands, p, o) for p, o in positions.items()]
            producer.send_offsets_to_transaction(offsets, self._consumer.consumer_group_metadata(), 30)
            # Commit flushes the records first; a failed record makes it abortable.
            self._commit_txn(producer)
            producer.flush(30)  # serve delivery reports: they carry the event offsets
            if errors:  # pragma: no cover - commit would have failed first
                raise KafkaException(errors[0])
            return True
        except KafkaException as exc:
            err = exc.args[0] if exc.args else None
            if isinstance(err, KafkaError) and (err.fatal() or err.code() in (
                    KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH)):
                raise DeciderFenced(str(exc)) from None
            log.warning("transaction aborted, batch will be retried: %s", exc)
            self.stats["aborts"] += 1
            try:
                producer.abort_transaction(30)
            except KafkaException as abort_exc:
                aerr = abort_exc.args[0] if abort_exc.args else None
                if isinstance(aerr, KafkaError) and aerr.fatal():
                    raise DeciderFenced(str(abort_exc)) from None
            event_offsets.clear()
            self._rewind(first_offsets)
            return False

    def _commit_txn(self, producer: Producer) -> None:
        while True:
            try:
                producer.commit_transaction(30)
                return
            except KafkaException as exc:
                err = exc.args[0] if exc.args else None
                if isinstance(err, KafkaError) and err.retriable():
                    continue
                raise

    def _rewind(self, first_offsets: dict[int, int]) -> None:
        for p, off in first_offsets.items():
            if p in self.assigned:
                try:
                    self._consumer.seek(TopicPartition(self.topics.commands, p, off))
                except KafkaException as exc:  # pragma: no cover
                    log.warning("seek after abort failed: %s", exc)

    def _publish(self, buffers: dict[int, dict], event_offsets: dict[int, list[int]]) -> None:
        """Committed: fold the batch's state into the store, unless the follower
        already did (it may read our commit first). Never both."""
        lagging: dict[int, int] = {}
        applied: dict[int, int] = {}
        with self.store.lock:
            for p, buffer in buffers.items():
                offsets = event_offsets.get(p)
                if not offsets:
                    continue  # refusals only: no state changed
                first, end = min(offsets), max(offsets) + 1
                if self.store.offset(self.topics.events, p) > first:
                    lagging[p] = end  # the follower is folding this batch itself
                    continue
                self.store.apply(buffer, {(self.topics.events, p): end})
                applied[p] = end
        if applied:
            self.follower.advance(applied)
        if lagging:
            self.follower.wait_sync(lagging, timeout=60)
