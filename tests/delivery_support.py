"""Helpers for delivery-log tests: bounded reads, and raw claim markers.

`ClaimWriter` writes a claim marker exactly as `tl.runs.claim` does -- a
`threadlog.Delivery {runId, kind: "claim", epoch}` keyed by run id to the run's
partition of `<ns>.deliveries`, inside a Kafka transaction -- but lets a test
hold the transaction open, commit or abort it when it chooses. That is how the
tests put a claim *before* an append in the log while its fate is undecided.
"""

from __future__ import annotations

import asyncio
import uuid

from confluent_kafka import Producer
from threadlog.schemas import default_codec

from threadlog import ThreadLog
from threadlog.kernel import delivery_records as records
from threadlog.kernel.partitioning import partition_for


async def collect(aiter, seconds: float = 30.0) -> list:
    """Every item of an async iterator that ends, within `seconds`."""

    async def run():
        return [item async for item in aiter]

    return await asyncio.wait_for(run(), seconds)


async def take(aiter, n: int, seconds: float = 30.0) -> list:
    """The next n items of a live async iterator, within `seconds`."""
    out = []

    async def run():
        while len(out) < n:
            out.append(await aiter.__anext__())

    await asyncio.wait_for(run(), seconds)
    return out


def chunk(i: int, **extra) -> dict:
    return {"type": "TEXT_MESSAGE_CONTENT", "messageId": "m1", "delta": f"w{i} ", "i": i, **extra}


class ClaimWriter:
    def __init__(self, bootstrap: str, tl: ThreadLog) -> None:
        self.topic = tl.runtime.topics.deliveries
        self.partitions = tl.runtime.layout.deliveries
        self.codec = default_codec()
        self.producer = Producer({
            "bootstrap.servers": bootstrap,
            "transactional.id": f"test-claims-{uuid.uuid4().hex[:8]}",
            "transaction.timeout.ms": 20000,
            "linger.ms": 0,
        })
        self.producer.init_transactions(30)

    def begin(self, run_id: str, epoch: int) -> None:
        """Open a transaction holding a claim that the fold grants as `epoch` (a claim
        proposes a floor; the grant is max(fence, floor) + 1, so floor = epoch - 1 for a
        run whose fence is below it). Flushed: it has its offset."""
        self.producer.begin_transaction()
        value = self.codec.encode("threadlog.Delivery", records.encodable(records.claim(run_id, epoch - 1)))
        self.producer.produce(self.topic, value, run_id.encode(), partition=partition_for(run_id, self.partitions))
        self.producer.flush(30)

    def commit(self) -> None:
        self.producer.commit_transaction(30)

    def abort(self) -> None:
        self.producer.abort_transaction(30)

    def claim(self, run_id: str, epoch: int) -> None:
        self.begin(run_id, epoch)
        self.commit()

