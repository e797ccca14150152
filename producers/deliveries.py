"""Delivery appends: one record per call, straight to `<ns>.deliveries`.

No decider hop: a chunks batch is one Kafka record (so it is all or nothing),
produced keyed by run id to the run's partition through an idempotent
producer with acks=all, so a retried send is never duplicated or reordered.
Whether the record *stands* (fencing, close) is decided afterwards by the run
index fold, which the caller awaits (`threadlog.delivery`).
"""

from __future__ import annotations

import asyncio
import time

from confluent_kafka import KafkaError, KafkaException, Message, Producer
from threadlog.schemas import Codec

from threadlog.kernel import delivery_records as records
from threadlog.kernel import kafka_config
from threadlog.kernel.errors import OUTCOME_UNKNOWN, ThreadLogError, invalid_argument, unavailable
from threadlog.kernel.partitioning import partition_for
from threadlog.kernel.topics import MAX_MESSAGE_BYTES

from .pump import ProducerPump, delivery_failure, produce_refused, settle_threadsafe, within

# Room in one record for its key (a run id), headers (a thin client's reply
# token) and the batch framing, under the topic's max.message.bytes.
RECORD_HEADROOM = 64 * 1024
MAX_VALUE_BYTES = MAX_MESSAGE_BYTES - RECORD_HEADROOM


class DeliveryWriter:
    def __init__(self, *, bootstrap: str, topic: str, partitions: int, codec: Codec, client_id: str,
                 timeout: float = 30.0, kafka: kafka_config.Props | None = None,
                 headers: list[tuple[str, str | bytes | None]] | None = None) -> None:
        self.topic = topic
        # A thin client's reply token: the owner pushes each record's verdict back
        # (processors/verdict_push.py). None: the verdict is folded here.
        self._headers = headers
        self.partitions = partitions
        self.codec = codec
        self.timeout = timeout
        settings = kafka_config.producer(
            bootstrap, f"{client_id}.deliveries", kafka,
            # librdkafka gives up on a record after this and reports it failed;
            # the caller waits for that verdict instead of guessing on a timer.
            **{"message.timeout.ms": int(timeout * 1000),
               # An awaited append is latency-bound: send at once (batches still
               # form from whatever queues while a request is in flight).
               "linger.ms": 0},
        )
        self._pump = ProducerPump(Producer(settings), f"deliveries-pump:{client_id}", settings)

    def partition_of(self, run_id: str) -> int:
        return partition_for(run_id, self.partitions)

    def encode(self, record: dict) -> bytes:
        value = self.codec.encode("threadlog.Delivery", records.encodable(record))
        # The topic's limit counts the whole record batch (key, headers, framing),
        # not the value alone: a value just under it was refused by the broker.
        if len(value) > MAX_VALUE_BYTES:
            raise invalid_argument(
                f"the batch encodes to {len(value)} bytes; one append is one Kafka record, whose value holds "
                f"at most {MAX_VALUE_BYTES} bytes: split it into several appends"
            )
        return value

    async def write(self, run_id: str, record: dict) -> int:
        """Produce one record to the run's partition; return its Kafka offset once durable."""
        value = self.encode(record)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        partition = self.partition_of(run_id)

        def delivered(err: KafkaError | None, msg: Message) -> None:
            if err is not None:
                settle_threadsafe(loop, fut, delivery_failure(err, "delivery record", msg), None)
            else:
                settle_threadsafe(loop, fut, None, msg.offset())

        deadline = time.monotonic() + self.timeout
        while True:
            try:
                self._pump.produce(self.topic, value, run_id.encode("utf-8"), partition=partition,
                                      on_delivery=delivered, headers=self._headers)
                break
            except BufferError:  # local queue full: the pump drains it
                if time.monotonic() > deadline:
                    raise unavailable("the delivery producer queue stayed full") from None
                await asyncio.sleep(0.005)
            except KafkaException as exc:
                # librdkafka's own checks, before anything is sent: a record (a long
                # run id as its key) over its message.max.bytes is bad input.
                raise produce_refused(exc, "delivery record") from None
        # librdkafka reports every record within message.timeout.ms (= the request
        # timeout) -- but checks for expired records about once a second, so a
        # report can come a second late on a busy machine (a 5 s append during a
        # broker's failover took 6.9 s). The call keeps its own deadline; past
        # it the outcome is as unknown as librdkafka's timeout would have said.
        try:
            return await within(fut, max(0.05, deadline - time.monotonic()))
        except TimeoutError:
            raise ThreadLogError(OUTCOME_UNKNOWN, f"delivery record not acknowledged within {self.timeout}s: it "
                                 "may or may not have been written (read the log to know)") from None

    @property
    def producer(self) -> Producer:
        """The producer records go to now (ProducerPump replaces one that stopped delivering)."""
        return self._pump.producer

    def close(self) -> None:
        self._pump.stop()

