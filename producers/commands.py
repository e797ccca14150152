"""Send a command, await its reply.

Commands go to `<ns>.commands` keyed (and partitioned) by their partition key,
through an idempotent producer, so a retried send never duplicates a command.
Each client reads one partition of `<ns>.replies`, named in every command it
sends, and completes the waiting call whose command id a reply carries. A
reply is written in the same transaction as the command's events, so when it
arrives the decision is durable; when none arrives in time the call fails with
`UNAVAILABLE`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from typing import Any

from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition
from threadlog.schemas import Codec, CodecError

from threadlog import kafka_config
from threadlog.errors import ThreadLogError, unavailable
from threadlog.partitioning import partition_for
from threadlog.topics import TopicLayout, Topics
from threadlog.validation import loads

log = logging.getLogger("threadlog.commands")

# A command's events are about as large as the command: keep 1 MiB of headroom
# under the topics' 16 MiB record limit so an accepted command can be recorded.
MAX_COMMAND_BYTES = 15 * 1024 * 1024


class ProducerPump:
    """Serves delivery callbacks of a producer from a background thread."""

    def __init__(self, producer: Producer, name: str) -> None:
        self.producer = producer
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.producer.poll(0.05)

    def stop(self, flush_timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.producer.flush(flush_timeout)


class CommandBus:
    def __init__(
        self,
        *,
        bootstrap: str,
        topics: Topics,
        layout: TopicLayout,
        codec: Codec,
        client_id: str,
        timeout: float = 30.0,
    ) -> None:
        self.topics = topics
        self.layout = layout
        self.codec = codec
        self.client_id = client_id
        self.timeout = timeout
        self.reply_partition = partition_for(client_id, layout.replies)
        self._pending: dict[str, tuple[asyncio.Future, asyncio.AbstractEventLoop]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.producer = Producer(kafka_config.producer(bootstrap, f"{client_id}.commands"))
        self._pump = ProducerPump(self.producer, f"commands-pump:{client_id}")
        self._consumer = Consumer(kafka_config.consumer(bootstrap, f"{client_id}.replies",
                                                        **{"fetch.wait.max.ms": kafka_config.TXN_READER_WAIT_MS}))
        # Start reading replies at the current end: every reply to a command we
        # send later lies after it, and nothing before it is ours.
        tp = TopicPartition(topics.replies, self.reply_partition)
        deadline = time.monotonic() + timeout
        while True:
            try:
                _, high = self._consumer.get_watermark_offsets(tp, timeout=timeout, cached=False)
                break
            except Exception as exc:  # a just-created topic may have no leader yet
                if time.monotonic() > deadline:
                    raise unavailable(f"cannot read {topics.replies}: {exc}") from None
                time.sleep(0.05)
        tp.offset = high
        self._consumer.assign([tp])
        self._thread = threading.Thread(target=self._listen, name=f"replies:{client_id}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            self._consumer.close()
        except Exception:  # pragma: no cover
            pass
        self._pump.stop()
        with self._lock:
            pending, self._pending = self._pending, {}
        for fut, loop in pending.values():
            loop.call_soon_threadsafe(_fail, fut, unavailable("client closed before the reply arrived"))

    def _listen(self) -> None:
        while not self._stop.is_set():
            try:
                msgs = kafka_config.drain(self._consumer, 500, 0.1)
            except Exception:  # pragma: no cover
                log.exception("reply consumer failed")
                time.sleep(0.1)
                continue
            for msg in msgs:
                if msg.error() is not None:
                    if msg.error().code() != KafkaError._PARTITION_EOF:
                        log.warning("replies consumer error: %s", msg.error())
                    continue
                try:
                    _, rep = self.codec.decode(msg.value(), expect="threadlog.Reply")
                except CodecError as exc:
                    log.warning("undecodable reply skipped: %s", exc.message)
                    continue
                if rep["clientId"] != self.client_id:
                    continue
                with self._lock:
                    waiting = self._pending.pop(rep["commandId"], None)
                if waiting is not None:
                    fut, loop = waiting
                    loop.call_soon_threadsafe(_complete, fut, rep)

    async def send(self, type_name: str, key: str, payload: dict, timeout: float | None = None) -> Any:
        """Send one command; return the decided result or raise its refusal."""
        return await self.send_encoded(type_name, key, self.codec.encode(type_name, payload), timeout)

    async def send_encoded(self, type_name: str, key: str, payload: bytes,
                           timeout: float | None = None) -> Any:
        """Send a command whose payload is already encoded (tests send broken ones)."""
        timeout = self.timeout if timeout is None else timeout
        loop = asyncio.get_running_loop()
        command_id = uuid.uuid4().hex
        env = {
            "commandId": command_id,
            "clientId": self.client_id,
            "replyPartition": self.reply_partition,
            "key": key,
            "type": type_name,
            "sentAt": time.time() * 1000.0,
            "payload": payload,
        }
        value = self.codec.encode("threadlog.Command", env)
        if len(value) > MAX_COMMAND_BYTES:
            raise ThreadLogError("INVALID_ARGUMENT", f"{type_name} is {len(value)} bytes; the limit is "
                                 f"{MAX_COMMAND_BYTES} (store large content in tl.blobs)")
        fut = loop.create_future()
        with self._lock:
            self._pending[command_id] = (fut, loop)

        def delivered(err, _msg) -> None:
            if err is not None:
                with self._lock:
                    self._pending.pop(command_id, None)
                loop.call_soon_threadsafe(_fail, fut, unavailable(f"command not written: {err}"))

        try:
            self.producer.produce(
                self.topics.commands,
                value,
                key.encode("utf-8"),
                partition=partition_for(key, self.layout.commands),
                on_delivery=delivered,
            )
        except BufferError:
            with self._lock:
                self._pending.pop(command_id, None)
            raise unavailable("producer queue is full") from None
        except Exception as exc:
            with self._lock:
                self._pending.pop(command_id, None)
            raise ThreadLogError("INVALID_ARGUMENT", f"command not sent: {exc}") from None
        try:
            rep = await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            with self._lock:
                self._pending.pop(command_id, None)
            raise unavailable(f"no reply to {type_name} within {timeout}s") from None
        if not rep["ok"]:
            raise ThreadLogError(rep["code"] or "INVALID_ARGUMENT", rep["message"] or "refused")
        return None if rep["result"] is None else loads(rep["result"])


def _complete(fut: asyncio.Future, rep: dict) -> None:
    if not fut.done():
        fut.set_result(rep)


def _fail(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
