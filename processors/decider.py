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

Latency: a transaction costs a few broker round trips (~10 ms here), so the
loop is pipelined two deep. While batch N's commit is in flight (on a
committer thread), batch N+1 is decided -- against N's state, buffered -- and
its records are produced and acknowledged, and its consumer offsets added,
on another transactional producer. N+1 is committed only after N committed; if N fails, N+1 is aborted
too and the consumer rewinds to N. Records of N+1 are produced only after N's
were acknowledged, so the events log is in decision order. Back-to-back
transactions on one producer also wait for the previous commit's markers
(CONCURRENT_TRANSACTIONS retries), hence a pool of producers used in turn.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from threadlog.projections.barrier import ReadBarrier
from threadlog.projections.fold import EventMeta, apply_event, current_seq
from threadlog.projections.follower import Follower
from threadlog.projections.store import Store
from threadlog.projections.view import View, overlay_scan
from threadlog.schemas import Codec, CodecError

from threadlog import kafka_config
from threadlog.errors import INVALID_ARGUMENT, INVALID_MESSAGE, ThreadLogError
from threadlog.partitioning import partition_for
from threadlog.topics import TopicLayout, Topics
from threadlog.validation import dumps

from .handlers import HANDLERS, Context, Decision, Settings

log = logging.getLogger("threadlog.decider")

PRODUCER_POOL = 3


# Errors Kafka gives for one record, whatever the retry: refuse the command.
_RECORD_ERRORS = {
    KafkaError.MSG_SIZE_TOO_LARGE,
    KafkaError.INVALID_MSG_SIZE,
    KafkaError.INVALID_RECORD,
    KafkaError.INVALID_MSG,
}


class DeciderFenced(RuntimeError):
    """Another instance took over: this decider must stop writing."""


class _Postpone(Exception):
    """The batch cannot be decided now (the cluster did not answer a barrier)."""


class _BatchView(View):
    """A partition's buffer of this batch. Reads see, in order: this buffer,
    this batch's other partitions, the in-flight (not yet committed) batch,
    then the store."""

    def __init__(self, store: Store, buffers: dict[int, dict], partition: int, below: list[dict]) -> None:
        super().__init__(store, buffers.setdefault(partition, {}))
        self._others = [b for p, b in buffers.items() if p != partition] + below

    def get(self, k: bytes) -> bytes | None:
        if k in self.buffer:
            return self.buffer[k]
        for other in self._others:
            if k in other:
                return other[k]
        return self.store.get(k)

    def scan(self, prefix: bytes):
        return overlay_scan(self.store.scan(prefix), [*reversed(self._others), self.buffer], prefix)


@dataclass
class _Batch:
    """A decided batch whose records are written; its commit may be in flight."""

    producer: Producer
    positions: dict[int, int]  # command partition -> next offset to consume
    first_offsets: dict[int, int]  # command partition -> first offset of the batch
    buffers: dict[int, dict]  # state changes per partition, applied after the commit
    # The consumer's group metadata when the batch was polled: a rebalance since
    # makes the offsets commit fail (KIP-447 generation fencing), never succeed late.
    group_metadata: object = None
    event_offsets: dict[int, list[int]] = field(default_factory=dict)
    commit: Future | None = None


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
        self._inflight: _Batch | None = None
        self._metadata = None  # group metadata of the current generation
        self._committer = ThreadPoolExecutor(1, thread_name_prefix=f"committer:{topics.namespace}")
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
        self._committer.shutdown(wait=True)
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
        self._metadata = None  # a new generation
        self.assigned = {tp.partition for tp in partitions}
        self._ready &= self.assigned
        self.first_assignment.set()
        log.info("decider %s assigned %s", self.instance_id, sorted(self.assigned))

    def _on_revoke(self, consumer, partitions) -> None:
        # Still the current generation: let the in-flight batch commit its offsets now.
        try:
            self._finish_inflight()
        except DeciderFenced as exc:  # reported by the loop on its next turn
            self.failure = exc
        self.assigned -= {tp.partition for tp in partitions}
        self._ready -= {tp.partition for tp in partitions}

    # -- the loop ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set() and self.failure is None:
                wait = 0.002 if self._inflight is not None else 0.05
                msgs = kafka_config.drain(self._consumer, self.max_batch, wait)
                msgs = [m for m in msgs if self._keep(m)]
                if msgs:
                    self._batch(msgs)
                elif self._inflight is not None and self._inflight.commit.done():
                    self._finish_inflight()
            self._finish_inflight()
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
        targets = self.barrier.end_offsets_sync()
        self.follower.wait_sync({p: targets[p] for p in todo}, timeout=60)
        self._ready |= todo

    def _sync_global(self) -> None:
        mine = self.assigned
        if len(mine) == self.layout.events:
            return  # every partition is ours: the batch view is already the whole state
        targets = self.barrier.end_offsets_sync()
        self.follower.wait_sync({p: o for p, o in targets.items() if p not in mine}, timeout=30)

    def _batch(self, msgs) -> None:
        first_offsets: dict[int, int] = {}
        positions: dict[int, int] = {}
        for m in msgs:
            first_offsets.setdefault(m.partition(), m.offset())
            positions[m.partition()] = m.offset() + 1
        below = list(self._inflight.buffers.values()) if self._inflight is not None else []
        try:
            buffers, out = self._decide_batch(msgs, below)
        except (ThreadLogError, _Postpone) as exc:
            # The cluster did not answer a barrier in time: nothing was written,
            # so decide the same commands again once it does.
            log.warning("batch postponed: %s", exc)
            self._rewind(first_offsets)
            time.sleep(0.2)
            return
        batch = _Batch(self._take_producer(), positions, first_offsets, buffers, self._group_metadata())
        written = self._write(batch, out)
        if written == "ok":
            # Overlaps the previous batch's commit: these offsets stay pending
            # until this transaction commits, and are discarded if it aborts.
            written = self._send_offsets(batch)
        # Commits happen strictly in batch order: this one waits for the previous.
        failed = self._finish_inflight()
        if failed is not None or written != "ok":
            if written == "ok":  # the previous batch failed: ours was built on its state
                self._abort(batch.producer)
            if failed is None and written == "record":
                # Kafka refused a record of this batch for good (e.g. too large):
                # retrying would loop forever. Find the command and refuse it.
                self._isolate(msgs)
                return
            # Rewind to the earliest command not committed (the failed batch's, if any).
            self._rewind({p: min(o, (failed or {}).get(p, o)) for p, o in first_offsets.items()}
                         | {p: o for p, o in (failed or {}).items() if p not in first_offsets})
            return
        batch.commit = self._committer.submit(self._commit, batch)
        self._inflight = batch

    def _isolate(self, msgs) -> None:
        """Decide a batch whose records Kafka refused one command per transaction;
        a single command whose decision cannot be recorded is refused instead."""
        if len(msgs) > 1:
            for m in msgs:
                self._batch([m])
            return
        msg = msgs[0]
        _, cmd = self.codec.decode(msg.value(), expect="threadlog.Command")
        out: list = []
        self._reply(out, cmd, False, INVALID_ARGUMENT,
                    "the decision of this command cannot be recorded in Kafka (e.g. too large)")
        batch = _Batch(self._take_producer(), {msg.partition(): msg.offset() + 1},
                       {msg.partition(): msg.offset()}, {}, self._group_metadata())
        if self._write(batch, out) != "ok" or self._send_offsets(batch) != "ok":
            self._rewind(batch.first_offsets)
            return
        batch.commit = self._committer.submit(self._commit, batch)
        self._inflight = batch

    def _group_metadata(self):
        """The consumer's group metadata, cached until the next rebalance.

        Read on this thread: the consumer is not used from the committer thread
        (a call into it there blocked while this thread was inside poll()), and
        cached because the call is costly (it was 8% of the CPU under load) while
        its value only changes with the group generation.
        """
        if self._metadata is None:
            self._metadata = self._consumer.consumer_group_metadata()
        return self._metadata

    def _take_producer(self) -> Producer:
        producer = self._producers[self._next_producer]
        self._next_producer = (self._next_producer + 1) % len(self._producers)
        return producer

    def _decide_batch(self, msgs, below: list[dict]) -> tuple[dict[int, dict], list]:
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
            self._decide_one(msg, buffers, below, out, sync_global)
        self.stats["batches"] += 1
        self.stats["commands"] += len(msgs)
        return buffers, out

    def _decide_one(self, msg, buffers, below, out, sync_global) -> None:
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
        view = _BatchView(self.store, buffers, partition, below).child()
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
    def _write(self, batch: _Batch, out: list) -> str:
        """Begin the batch's transaction and get its records acknowledged (in the
        log, after every earlier batch's). Returns "ok"; "retry" when it was
        aborted for a transient reason; "record" when Kafka refused a record."""
        producer = batch.producer
        errors: list = []

        def delivered(err, msg, is_event):
            if err is not None:
                errors.append(err)
            elif is_event:
                batch.event_offsets.setdefault(msg.partition(), []).append(msg.offset())

        try:
            producer.begin_transaction()
            try:
                for topic, partition, key, value, is_event in out:
                    producer.produce(topic, value, key, partition=partition,
                                     on_delivery=lambda e, m, ev=is_event: delivered(e, m, ev))
            except (KafkaException, BufferError) as exc:  # refused locally (size, queue)
                errors.append(exc.args[0] if exc.args else KafkaError(KafkaError.MSG_SIZE_TOO_LARGE))
            producer.flush(30)
            if errors:
                raise KafkaException(errors[0])
            return "ok"
        except KafkaException as exc:
            self._failed(producer, exc)
            err = exc.args[0] if exc.args else None
            permanent = isinstance(err, KafkaError) and err.code() in _RECORD_ERRORS
            return "record" if permanent else "retry"

    def _send_offsets(self, batch: _Batch) -> str:
        """Add the batch's consumer offsets to its transaction ("ok" / "retry")."""
        try:
            offsets = [TopicPartition(self.topics.commands, p, o) for p, o in batch.positions.items()]
            batch.producer.send_offsets_to_transaction(offsets, batch.group_metadata, 30)
            return "ok"
        except KafkaException as exc:
            self._failed(batch.producer, exc)
            return "retry"

    def _commit(self, batch: _Batch) -> KafkaException | None:
        """On the committer thread: the commit, then the batch's state reaches the
        store at once (before the follower reads the commit back and folds it a
        second time for nothing). Returns the failure, if any."""
        try:
            self._commit_txn(batch.producer)
        except KafkaException as exc:
            return exc
        self._publish(batch.buffers, batch.event_offsets)
        return None

    def _commit_txn(self, producer: Producer) -> None:
        """The commit itself (the zombie tests hold a transaction open here)."""
        while True:
            try:
                producer.commit_transaction(30)
                return
            except KafkaException as exc:
                err = exc.args[0] if exc.args else None
                if isinstance(err, KafkaError) and err.retriable():
                    continue
                raise

    def _finish_inflight(self) -> dict[int, int] | None:
        """Wait for the in-flight commit; publish its state, or abort and rewind.
        Returns None when it committed (or nothing was in flight), else the
        failed batch's first offsets (the consumer was rewound there)."""
        batch, self._inflight = self._inflight, None
        if batch is None:
            return None
        failure = batch.commit.result()
        if failure is None:
            return None  # committed and published by the committer
        self._failed(batch.producer, failure)
        self._rewind(batch.first_offsets)
        return batch.first_offsets

    def _failed(self, producer: Producer, exc: KafkaException) -> None:
        err = exc.args[0] if exc.args else None
        if isinstance(err, KafkaError) and (err.fatal() or err.code() in (
                KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH)):
            raise DeciderFenced(str(exc)) from None
        log.warning("transaction aborted, batch will be decided again: %s", exc)
        self.stats["aborts"] += 1
        self._abort(producer)

    def _abort(self, producer: Producer) -> None:
        try:
            producer.abort_transaction(30)
        except KafkaException as abort_exc:
            aerr = abort_exc.args[0] if abort_exc.args else None
            if isinstance(aerr, KafkaError) and aerr.fatal():
                raise DeciderFenced(str(abort_exc)) from None

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
