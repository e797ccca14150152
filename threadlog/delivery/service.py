"""What one client needs for delivery logs: the run index access, the writer, readers' consumers."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from ..kernel import delivery_records as records
from ..kernel.errors import OUTCOME_UNKNOWN, UNAVAILABLE, ThreadLogError, unavailable
from ..producers.deliveries import DeliveryWriter
from ..producers.proposals import unsettled_write
from ..projections.barrier import EndOffsets
from ..remote import RemoteVerdicts
from ..run_access import runs_for
from .reader import ConsumerPool

if TYPE_CHECKING:
    from ..session import Session


class DeliveryService:
    """What one client needs for delivery logs: run index, writer, readers' consumers."""

    metrics = None  # threadlog.metrics.Metrics, when attached

    def __init__(self, session: Session) -> None:
        rt = session.runtime
        assert rt.layout is not None
        self.session = session
        self.topic = rt.topics.deliveries
        self.partitions = rt.layout.deliveries
        self.codec = rt.codec
        # The ends of `deliveries` for reads from "now": a client folding the run
        # index already has them (its delivery barrier, whose rounds they share).
        assert rt.ends is not None
        self.ends: EndOffsets = rt.delivery_barrier or EndOffsets(rt.ends, self.topic, self.partitions,
                                                                  session.opts.request_timeout)
        self.timeout = session.opts.request_timeout
        self.first_chunk_wait = session.opts.first_chunk_wait_ms / 1000.0
        assert session.bus is not None  # the client starts its proposal bus first
        verdicts = session.bus.verdicts
        # The run index: folded here, or asked of its owners (whose answers are pushed, if it can).
        self.runs = runs_for(rt, rt.codec, verdicts if isinstance(verdicts, RemoteVerdicts) else None)
        # Topics replaced under us: live readers end now instead of waiting for good.
        rt.failure_listeners.append(self.runs.halt)
        self.writer = DeliveryWriter(bootstrap=session.opts.bootstrap_servers, topic=self.topic,
                                     partitions=self.partitions, codec=rt.codec, client_id=rt.client_id,
                                     timeout=self.timeout, kafka=session.opts.kafka,
                                     headers=rt.record_headers(self.topic, verdicts.reply_header))
        self.pool = ConsumerPool(session.opts.bootstrap_servers, rt.client_id, kafka=session.opts.kafka)
        self.executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix="delivery-read")
        self.closing = threading.Event()

    def stop(self) -> None:
        self.closing.set()
        self.runs.stop()
        self.writer.close()
        self.executor.shutdown(wait=True, cancel_futures=True)
        self.pool.close()

    async def claim(self, run_id: str, floor: int) -> int:
        """Propose a claim of `run_id` on its delivery partition; return the epoch
        the run index granted (max(fence, floor) + 1, see projections/run_index.py).

        The grant happens where fencing happens: from the claim's offset on,
        every record of an older epoch is dropped by every reader, and no
        record of an epoch never granted ever stands."""
        x, folded, _ = await self.write_decided(run_id, records.claim(run_id, floor), floor)
        if not folded or "claim" not in folded:
            raise unavailable(f"claim of run {run_id!r} at offset {x} was not folded")
        return int(folded["claim"])

    async def write_decided(self, run_id: str, record: dict, epoch: int) -> tuple[int, dict | None, int]:
        """Write a delivery record and await the run index's verdict on it: (offset, verdict, fence).

        One request timeout for both: the verdict gets what the write left (a
        write can itself take the whole timeout, see producers/deliveries.py)."""
        began = time.monotonic()
        with unsettled_write():  # from the send until the verdict, the record may stand
            x = await self.writer.write(run_id, record)
            left = max(0.1, self.timeout - (time.monotonic() - began))
            p = self.writer.partition_of(run_id)
            try:
                verdict, fence = await self.runs.decide(run_id, p, x, record["kind"], epoch, left)
            except ThreadLogError as exc:
                if exc.code != UNAVAILABLE:
                    raise
                # The record is durable: whether it stands is decided by the fold, not
                # by our failing to learn it. UNAVAILABLE would say nothing was written.
                raise ThreadLogError(OUTCOME_UNKNOWN, f"delivery record {p}@{x} of run {run_id!r} was written but "
                                     f"its verdict not learned ({exc.message}): it may stand; read the log") from None
        return x, verdict, fence

    async def high_watermark(self, partition: int) -> int:
        """Next offset of the partition: everything below it is stored (committed or not).

        Asked like every read barrier (`EndOffsets`, which also asks who leads
        again after a broker restart or failover), in rounds shared with
        other readers joining "now"."""
        return (await self.ends.end_offsets())[partition]
