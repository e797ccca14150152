"""`DeliveryLog`: one run's delivery log -- appends, upserts, close, readers (SPEC 11)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from ..kernel import delivery_records as records
from ..kernel.errors import (
    INVALID_OFFSET,
    RUN_CLAIM_LOST,
    RUN_LOG_CLOSED,
    RUN_NOT_FOUND,
    ThreadLogError,
    invalid_argument,
    unavailable,
)
from ..kernel.validation import is_int, require_id
from ..projections.delivery_follower import Item, Subscription
from ..run_access import Reading
from .offsets import LAST, Offset, encode_offset, parse_offset, run_tag
from .reader import Fetcher
from .service import DeliveryService

if TYPE_CHECKING:
    from ..session import Session

log = logging.getLogger("threadlog.delivery")

EPOCH_MAX = 2**63 - 1


class DeliveryLog:
    """One run's delivery log, written as driver `epoch` (SPEC 11)."""

    def __init__(self, session: Session, run_id: str, epoch: int | None = None) -> None:
        require_id(run_id, "run_id")
        if epoch is None:
            epoch = 0
        if not is_int(epoch) or not 0 <= epoch <= EPOCH_MAX:
            # An epoch travels as an Avro long: a larger one could not even be encoded.
            raise invalid_argument(f"epoch must be an int in 0..2**63-1 or None, got {epoch!r}")
        self._session = session
        self.run_id = run_id
        self.epoch = epoch
        self._partition: int | None = None
        self._sfx: list[str] = []

    # -- plumbing -------------------------------------------------------------------
    @property
    def client_closing(self) -> bool:
        """The client this log belongs to is closing (or closed): reads end under it."""
        svc = self._session.delivery
        return self._session.closed or (svc is not None and svc.closing.is_set())

    @property
    def first_chunk_wait(self) -> float:
        """Seconds a from-start read waits for a run's first chunk or close (`first_chunk_wait_ms`)."""
        return self._session.opts.first_chunk_wait_ms / 1000.0

    @property
    def _svc(self) -> DeliveryService:
        self._session.check_open()
        svc = self._session.delivery
        assert svc is not None
        return svc

    @property
    def partition(self) -> int:
        if self._partition is None:
            self._partition = self._svc.writer.partition_of(self.run_id)
        return self._partition

    def _offset(self, kafka_offset: int, index: int) -> Offset:
        return encode_offset(self.run_id, self.partition, kafka_offset, index)

    def _state(self) -> dict:
        return self._svc.runs.known(self.run_id)

    def _precheck(self) -> None:
        """Refuse without writing when the index already knows the outcome
        (the verdict after writing is the one that counts)."""
        state = self._state()
        if state["fence"] > self.epoch:
            raise self._lost(state["fence"])
        if "closedAt" in state:
            raise ThreadLogError(RUN_LOG_CLOSED, f"the delivery log of run {self.run_id!r} is closed")

    def _lost(self, fence: int | None = None) -> ThreadLogError:
        if fence is not None and fence < self.epoch:  # higher than any claim: never granted
            return ThreadLogError(RUN_CLAIM_LOST, f"driver epoch {self.epoch} of run {self.run_id!r} was never "
                                                  f"granted by a claim (the latest claim is epoch {fence})")
        newer = f" (epoch {fence} was claimed)" if fence is not None else ""
        return ThreadLogError(RUN_CLAIM_LOST, f"driver epoch {self.epoch} of run {self.run_id!r} "
                                              f"was superseded{newer}")

    async def _write_and_verify(self, kind: str, **fields: Any) -> int:
        svc = self._svc
        record = records.written(self.run_id, self.epoch, kind, **fields)
        # THE fencing rule: acknowledge only what stands by the run index's verdict.
        kafka_offset, verdict, fence = await svc.write_decided(self.run_id, record, self.epoch)
        if verdict is None:
            raise unavailable(f"delivery record {self.partition}@{kafka_offset} of run {self.run_id!r} "
                              "was not folded (undecodable?)")
        code = verdict.get("drop")
        if code == RUN_CLAIM_LOST:
            raise self._lost(fence)
        if code == RUN_LOG_CLOSED:
            raise ThreadLogError(RUN_LOG_CLOSED, f"the delivery log of run {self.run_id!r} was closed "
                                                 "before this write")
        if code is not None:
            raise ThreadLogError(code, f"delivery record of run {self.run_id!r} refused by the run index")
        return kafka_offset

    # -- writes -----------------------------------------------------------------------
    async def append(self, chunks: list[dict]) -> list[Offset]:
        fields, n = records.chunks_record(chunks, "chunks")
        if not n:
            return []
        self._precheck()
        x = await self._write_and_verify(records.CHUNKS, **fields)
        if self._svc.metrics is not None:
            self._svc.metrics.appended(n)
        return list(self._offsets(x, 0, n))

    async def upsert(self, entries: Iterable[tuple[Offset, dict]]) -> list[Offset]:
        if not isinstance(entries, (list, tuple)):
            raise invalid_argument(f"upsert takes a list of (offset, chunk) pairs, got {type(entries).__name__}")
        positions: list[tuple[int, int]] = []
        seen: set[tuple[int, int]] = set()
        for n, entry in enumerate(entries):
            if not isinstance(entry, (list, tuple)) or len(entry) != 2:
                raise invalid_argument(f"upsert entry [{n}] must be an (offset, chunk) pair")
            pos = parse_offset(self.run_id, self.partition, entry[0])
            if pos in seen:
                raise ThreadLogError(INVALID_OFFSET, f"offset {entry[0]!r} appears twice in one upsert")
            seen.add(pos)
            positions.append(pos)
        texts = [records.chunk_text(entry[1], f"upsert entry [{n}] chunk") for n, entry in enumerate(entries)]
        if not texts:
            return []
        await self._require_positions(positions, [entry[0] for entry in entries])
        self._precheck()
        await self._write_and_verify(records.UPSERT, chunks=texts,
                                     targets=[{"offset": x, "index": i} for x, i in positions])
        return [self._offset(x, i) for x, i in positions]

    async def _require_positions(self, positions: list[tuple[int, int]], texts: list[str]) -> dict[int, int | None]:
        """INVALID_OFFSET unless each position is a standing chunk of the run (after a
        read barrier); the chunk count of each record named."""
        counts = await self._svc.runs.counts(self.run_id, self.partition, sorted({x for x, _ in positions}))
        for (x, i), text in zip(positions, texts, strict=True):
            count = counts.get(x)
            if count is None or i >= count:
                raise ThreadLogError(INVALID_OFFSET,
                                     f"offset {text!r} is not a chunk of the log of run {self.run_id!r}")
        return counts

    async def close(self) -> None:
        svc = self._svc
        state = self._state()
        if state["fence"] > self.epoch or "closedAt" in state:
            return  # a superseded driver's close is ignored; closing twice is harmless
        # Folded before returning: from here on this client's appends and reads see it
        # (a superseded driver's or a second close is dropped there, harmlessly).
        _, verdict, fence = await svc.write_decided(self.run_id, records.written(self.run_id, self.epoch,
                                                                                 records.CLOSE), self.epoch)
        if verdict is not None and verdict.get("drop") == RUN_CLAIM_LOST and fence is not None and fence < self.epoch:
            # An epoch no claim granted (SPEC: only a *superseded* driver's close is
            # ignored). Tried (a review): it returned as if closed, while `append`
            # with the same epoch raised and the log stayed open for every reader.
            raise self._lost(fence)

    # -- reads --------------------------------------------------------------------------
    def read(self, after: Offset, *, follow: bool = True) -> AsyncIterator[tuple[Offset, dict]]:
        """(offset, chunk) strictly after `after` ("-1", "now" or an offset); waits; ends on close.

        `follow=False` (an extension, for tools) ends at what is stored when the
        iteration starts instead of waiting, and an unknown run yields nothing.
        """
        items = self._iterate(after, follow=follow)
        svc = self._session.delivery  # not _svc: a closed client fails when iterated, as before
        metrics = svc.metrics if svc is not None else None
        return items if metrics is None else metrics.reading(items)

    async def snapshot(self) -> list[tuple[Offset, dict]]:
        """What is stored now, in order; never waits for new chunks; [] for an unknown run."""
        return [item async for item in self._iterate("-1", follow=False)]

    async def _start(self, after: Offset, follow: bool) -> tuple[int, tuple[int, int], Subscription | None, Reading]:
        """Where to start reading: (Kafka offset, floor position, live subscription if any,
        the run index's reading). The start is never after `reading.at`: a reader
        judging records itself (a thin client) must meet every record from there."""
        svc = self._svc
        runs = svc.runs
        p = self.partition
        if after == "now":
            hw_task = asyncio.ensure_future(svc.high_watermark(p))
            try:
                reading = await runs.reading(self.run_id, p)
            except BaseException:
                # Not awaited: the reading's error is the one to raise (an end-offsets
                # round failing too replaced it), and a cancelled reader must not first
                # wait out that round (up to the request timeout; a review).
                hw_task.cancel()
                hw_task.add_done_callback(_retrieved)
                raise
            hw = await hw_task
            return min(hw, reading.at), (hw - 1, LAST), None, reading
        if after != "-1":
            x, i = parse_offset(self.run_id, p, after)
            reading = await runs.reading(self.run_id, p)
            counts = await self._require_positions([(x, i)], [after])
            # After its last chunk nothing of record x is read: start past it. Tried (a
            # review): resuming from a record retention had deleted failed "gone"
            # though every chunk after it was stored.
            first = x + 1 if i + 1 == counts[x] else x
            return min(first, reading.at), (x, i), None, reading
        reading = await runs.reading(self.run_id, p)
        if reading.state and "first" in reading.state:
            return reading.state["first"], (-1, -1), None, reading
        if not follow:
            return -1, (-1, -1), None, reading  # nothing stored: an empty snapshot
        # Nothing yet: wait (bounded) for the first chunk or a close -- one wait,
        # however often it looks again. Tried (a review): each look after an
        # overflow began a fresh wait, by recursion, so a flood of records that
        # stand for nothing (claims, a fenced driver's) kept a reader of a run that
        # never produced waiting for as long as it lasted, or until RecursionError.
        deadline = time.monotonic() + svc.first_chunk_wait
        while True:
            found = await self._first(deadline)
            if found is not None:
                return found

    async def _first(self, deadline: float) -> tuple[int, tuple[int, int], Subscription, Reading] | None:
        """Subscribed, the start at the run's first chunk or close, once one stands;
        None if the live queue overflowed first (a flood of this run's records: look
        again); RUN_NOT_FOUND at `deadline`."""
        svc = self._svc
        runs = svc.runs
        p = self.partition
        sub = await runs.subscribe(self.run_id, p)
        try:
            # Again, now that the feed is on: what landed before live_from is in here.
            reading = await runs.reading(self.run_id, p)
            if reading.state and "first" in reading.state:
                return reading.state["first"], (-1, -1), sub, reading
            held: list[Item] = []
            started = False
            while True:
                new = len(held)
                while sub.items:
                    held.append(sub.popleft())
                # Each held record is judged once, in order: judging them all again on
                # every pass was quadratic, and a fold's cache of verdicts is bounded
                # (run_index.RunFold), so a long wait would fold a claim twice.
                started = started or any(
                    reading.judge_item(it) is None and it.record["kind"] in (records.CHUNKS, records.CLOSE)
                    for it in held[new:])
                if started:
                    break
                if sub.failure is not None:
                    raise sub.failure
                left = deadline - time.monotonic()
                if sub.overflowed:
                    runs.unsubscribe(sub)
                    return None
                if left <= 0:
                    raise ThreadLogError(RUN_NOT_FOUND, f"run {self.run_id!r} has no delivery log: nothing "
                                                        f"was appended or closed within {svc.first_chunk_wait}s")
                await sub.wait(left)
            sub.put_back(held)
            # Nothing of this run stood before live_from: start at the live feed.
            return min(sub.live_from, reading.at), (-1, -1), sub, reading
        except BaseException:
            runs.unsubscribe(sub)
            raise

    def _decode(self, msg: Any) -> dict:
        return self._svc.codec.decode(msg.value(), expect="threadlog.Delivery")[1]

    async def _iterate(self, after: Offset, follow: bool) -> AsyncIterator[tuple[Offset, dict]]:
        svc = self._svc
        runs = svc.runs
        p = self.partition
        if not isinstance(after, str):
            raise ThreadLogError(INVALID_OFFSET, f"after must be an offset str, '-1' or 'now', got {after!r}")
        start, floor, sub, reading = await self._start(after, follow)
        if start < 0:
            return
        closed_at = (reading.state or {}).get("closedAt")
        if closed_at is not None and closed_at < start:
            if sub is not None:
                runs.unsubscribe(sub)
            return
        last = floor
        position = start
        try:
            while True:
                if follow and sub is None:
                    sub = await runs.subscribe(self.run_id, p)
                # Live: hand over to the feed at live_from. Not following: stop at what
                # the reading covers (every acknowledged write). Never before reading.at:
                # the records up to there are judged by the index, the rest in order here.
                end = max(sub.live_from if sub is not None else 0, reading.at)
                # 1. Catch up from Kafka.
                fetcher = Fetcher(svc, self.run_id, p, position)
                try:
                    while True:
                        msgs = await fetcher.next_batch(end)
                        if not msgs:
                            break
                        judged = await reading.judge(msgs, self._decode)
                        reps = reading.has_reps()
                        for msg, verdict in judged:
                            if verdict is None or "n" not in verdict:
                                if verdict is not None and "close" in verdict:
                                    return
                                continue  # claim, dropped record, upsert (applied by position)
                            batch, last = self._chunks(msg.offset(), self._decode(msg), last, reading, reps)
                            for out in batch:
                                yield out
                finally:
                    fetcher.release()
                position = max(position, end)
                if not follow or (closed_at is not None and closed_at < end):
                    # The close lies before where the live feed starts, yet the catch-up
                    # did not meet it: retention removed it (the index outlives the
                    # records). The log is closed all the same: following would wait
                    # for a record that cannot come, forever.
                    return
                assert sub is not None
                # 2. Live: records at or after live_from, from the feed.
                while True:
                    if not sub.items:
                        await sub.wait(None)
                    if sub.failure is not None:
                        raise sub.failure
                    if sub.overflowed:
                        # Fell too far behind: catch up from Kafka again.
                        runs.unsubscribe(sub)
                        sub = None
                        break
                    item = sub.popleft()
                    if item.offset < position:
                        continue
                    position = item.offset + 1
                    if reading.judge_item(item) is not None:
                        continue  # dropped (or covered by the reading's state)
                    kind = item.record["kind"]
                    if kind == records.CLOSE:
                        return
                    if kind != records.CHUNKS:
                        continue
                    batch, last = self._chunks(item.offset, item.record, last, reading, reading.has_reps())
                    for out in batch:
                        yield out
        finally:
            if sub is not None:
                runs.unsubscribe(sub)

    def _chunks(self, x: int, rec: dict, last: tuple[int, int], reading: Reading,
                reps: bool) -> tuple[list, tuple[int, int]]:
        """The (offset, chunk) pairs of a standing chunks record after position `last`,
        with upserted replacements (`reps`: the run has some) at their original
        positions; and the new last position. A list, not a generator: one
        generator level less per chunk on the replay path."""
        n = records.record_size(rec)
        if last[0] > x:
            return [], last
        start = last[1] + 1 if last[0] == x else 0
        if start >= n:
            return [], last
        svc = self._svc
        values = records.decode_chunks(rec)
        if values is None:
            log.error("chunks record %s@%d of run %r is corrupt; skipped", svc.topic, x, self.run_id)
            return [], (x, n - 1)
        if start:
            values = values[start:]
        if reps:
            for i in range(start, n):
                text = reading.replacement(x, i)
                if text is not None:
                    values[i - start] = records.parse_or_none(text)
        offsets = self._offsets(x, start, n)
        if set(map(type, values)) <= {dict}:  # the usual case, checked in C
            return list(zip(offsets, values, strict=True)), (x, n - 1)
        out = [(o, chunk) for o, chunk in zip(offsets, values, strict=True) if isinstance(chunk, dict)]
        log.error("%d chunks of %s@%d of run %r are not JSON objects; skipped",
                  len(values) - len(out), svc.topic, x, self.run_id)
        return out, (x, n - 1)

    def _offsets(self, x: int, start: int, n: int) -> Iterator[Offset]:
        """`encode_offset` of chunks start..n-1 of the record at `x`, without a format per
        chunk (hot on replay): "<partition>.<x>." + a cached "<i>.<tag>"."""
        sfx = self._sfx
        if len(sfx) < n:
            tag = run_tag(self.run_id)
            sfx.extend(f"{i}.{tag}" for i in range(len(sfx), n))
        return map(f"{self.partition}.{x}.".__add__, sfx[start:n])

    # -- introspection (replay tool, HTTP route) ------------------------------------------
    async def records(self, after: Offset = "-1") -> list[dict]:
        """Every record of the run now stored from the cursor on, with the index's
        verdict: claims, dropped chunks and why, upserts, the close. For debugging."""
        svc = self._svc
        p = self.partition
        reading = await svc.runs.reading(self.run_id, p)
        if after == "-1":
            if reading.state is None:
                # The index holds state for every run it folded a record of (a claim
                # too), up to `reading.at`: none, so no record. Not a scan of the
                # partition from 0 -- which raised UNAVAILABLE once retention had
                # moved its start, and a "now" join of a mistyped run id waited for
                # good instead of RUN_NOT_FOUND (a review).
                return []
            start = reading.state.get("seen", 0)
        else:
            start, _ = parse_offset(self.run_id, p, after)
        out: list[dict] = []
        fetcher = Fetcher(svc, self.run_id, p, start)
        try:
            while True:
                msgs = await fetcher.next_batch(reading.at)
                if not msgs:
                    break
                for msg, verdict in await reading.judge(msgs, self._decode):
                    rec = self._decode(msg)
                    verdict = verdict or {}
                    row: dict[str, Any] = {"partition": p, "kafkaOffset": msg.offset(), "kind": rec["kind"],
                                           "epoch": rec["epoch"], "writtenAt": rec["writtenAt"]}
                    if rec["kind"] in (records.CHUNKS, records.UPSERT):
                        row["chunks"] = records.record_size(rec)
                    if rec["kind"] == records.UPSERT:
                        row["targets"] = [self._offset(t["offset"], t["index"]) for t in rec["targets"]]
                    if rec["kind"] == records.CLAIM:
                        # A claim proposes a floor; the epoch is what the fold granted.
                        row["floor"], row["epoch"] = rec["epoch"], verdict.get("claim", rec["epoch"])
                    else:
                        row["stands"] = "drop" not in verdict
                        if "drop" in verdict:
                            row["dropped"] = verdict["drop"]
                    out.append(row)
        finally:
            fetcher.release()
        return out

    async def chunk_at(self, offset: Offset) -> dict:
        """The chunk stored at `offset` (as a reader would yield it there)."""
        svc = self._svc
        x, i = parse_offset(self.run_id, self.partition, offset)
        reading = await svc.runs.reading(self.run_id, self.partition)
        await self._require_positions([(x, i)], [offset])
        fetcher = Fetcher(svc, self.run_id, self.partition, x)
        try:
            msgs = await fetcher.next_batch(x + 1)
            await reading.judge(msgs, self._decode)  # the run's replacements there, if any
            for msg in msgs:
                batch, _ = self._chunks(x, self._decode(msg), (x, i - 1), reading, reading.has_reps())
                if batch:
                    return batch[0][1]
        finally:
            fetcher.release()
        raise unavailable(f"chunk {offset!r} could not be read back")


def _retrieved(task: asyncio.Future) -> None:
    """Take a finished task's outcome, so an error nobody awaits is not logged as lost."""
    if not task.cancelled():
        task.exception()
