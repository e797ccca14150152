"""The read barrier against transactional writes: trailing commit and abort
markers occupy offsets no consumer yields, and must never make a read hang.

threadlog's own proposals use no transactions any more, but anyone may write
proposals inside a Kafka transaction (an outside service, a bridge); the judge
reads read_committed, so the barrier must handle markers all the same."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from confluent_kafka import Producer
from support import raw_proposal, until, within

from threadlog import ThreadLogError
from threadlog.kernel.partitioning import partition_for


def _proposal(tl, messages: str) -> bytes:
    return raw_proposal(tl.runtime.codec, "threadlog.cmd.SaveTranscript", "t", {"threadId": "t", "messages": messages},
                        at=0.0)


async def test_barrier_passes_trailing_commit_markers(tl, bootstrap, open_client):
    part = partition_for("t", tl.runtime.layout.events)
    # What the partition holds first (its rules floor marker, in a namespace threadlog
    # created). A CI run counted from 0 and met the last commit marker not there yet.
    base = tl.runtime.barrier.end_offsets_sync()[part]
    p = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"test-commit-{uuid.uuid4().hex[:6]}"})
    p.init_transactions(30)
    for n in range(5):
        p.begin_transaction()
        p.produce(tl.runtime.topics.events, _proposal(tl, f"[{n}]"), b"t", partition=part)
        p.commit_transaction(30)
    # A commit returns once decided; its marker reaches the partition just after.
    # Wait (bounded) until all 5 markers are there: 5 records + 5 markers.
    async def markers_written() -> int:
        while (end := tl.runtime.barrier.end_offsets_sync()[part]) < base + 10:
            await asyncio.sleep(0.02)
        return end
    stable = await within(markers_written(), 20)
    # 5 events, each followed by its transaction's commit marker: the end of
    # the log lies past a marker, beyond the last record any consumer yields.
    # A fresh full replica folds from zero past the markers; a thin client's worker does too.
    fresh = await open_client()
    assert await within(fresh.messages.load_thread("t"), 20) == [4]
    thin = await open_client(processors="external")
    assert await within(thin.messages.load_thread("t"), 20) == [4]
    assert fresh.runtime.judge.applied(part) >= stable
    assert fresh.runtime.store.offset(tl.runtime.topics.events, part) < stable


async def test_barrier_passes_an_aborted_transaction_at_the_tail(tl, bootstrap, open_client):
    await within(tl.messages.save_thread("t", ["committed"]))
    part = partition_for("t", tl.runtime.layout.events)
    p = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"test-abort-{uuid.uuid4().hex[:6]}"})
    p.init_transactions(30)
    p.begin_transaction()
    p.produce(tl.runtime.topics.events, b"never visible", b"t", partition=part)
    p.flush(30)
    p.abort_transaction(30)
    # The aborted record and its abort marker sit at the end of the partition.
    before = tl.runtime.barrier.end_offsets_sync()[part]
    fresh = await open_client()
    assert await within(fresh.messages.load_thread("t"), 20) == ["committed"]
    thin = await open_client(processors="external")
    assert await within(thin.messages.load_thread("t"), 20) == ["committed"]
    assert await within(tl.messages.load_thread("t"), 20) == ["committed"]
    assert fresh.runtime.judge.applied(part) >= before
    assert fresh.runtime.judge.stats["poison"] == 0  # the aborted record was never delivered


def _open_transaction(tl, bootstrap, messages: str, **conf):
    part = partition_for("t", tl.runtime.layout.events)
    p = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"test-open-{uuid.uuid4().hex[:6]}", **conf})
    p.init_transactions(30)
    p.begin_transaction()
    p.produce(tl.runtime.topics.events, _proposal(tl, messages), b"t", partition=part)
    p.flush(30)
    return p


async def test_a_read_waits_for_a_transaction_in_flight_and_sees_it_committed(tl, bootstrap):
    # A commit is acknowledged before its markers reach every partition, so a
    # read must not trust the last stable offset: it waits for the transaction
    # in flight to end, then reflects it.
    p = _open_transaction(tl, bootstrap, '["in flight"]')
    read = asyncio.ensure_future(tl.messages.load_thread("t"))
    done, _ = await asyncio.wait({read}, timeout=0.5)
    assert not done  # still waiting on the open transaction
    p.commit_transaction(30)
    assert await within(read, 20) == ["in flight"]


async def test_a_transaction_left_open_by_a_dead_writer_delays_reads_only_until_it_times_out(tl, bootstrap):
    # The writer stalls forever (kept alive, never commits): the broker aborts
    # its transaction after transaction.timeout.ms, and the read completes.
    stalled = _open_transaction(tl, bootstrap, '["never committed"]', **{"transaction.timeout.ms": 2000})
    assert await within(tl.messages.load_thread("t"), 30) == []
    assert len(stalled) == 0  # never flushed again, never committed
    await within(tl.messages.save_thread("t", ["after"]))
    assert await within(tl.messages.load_thread("t")) == ["after"]


async def test_end_offsets_are_every_partitions_high_watermark(tl, bootstrap):
    """`seen` and every barrier read the ends through `LatestOffsets` (a consumer's
    ListOffsets at "latest", read_uncommitted): the high watermark of each
    partition, counting records of a transaction still open."""
    from confluent_kafka import Consumer, TopicPartition

    topic, parts = tl.runtime.topics.events, tl.runtime.layout.events
    plain = Producer({"bootstrap.servers": bootstrap})
    for n in range(7):
        plain.produce(topic, _proposal(tl, f"[{n}]"), b"t", partition=n % parts)
    assert plain.flush(30) == 0
    open_tx = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"test-ends-{uuid.uuid4().hex[:6]}"})
    open_tx.init_transactions(30)
    open_tx.begin_transaction()
    try:
        open_tx.produce(topic, _proposal(tl, "[99]"), b"t", partition=0)
        assert open_tx.flush(30) == 0  # written, not committed
        probe = Consumer({"bootstrap.servers": bootstrap, "group.id": f"probe-{uuid.uuid4().hex[:6]}",
                          "isolation.level": "read_uncommitted"})
        try:
            marks = {p: probe.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in range(parts)}
        finally:
            probe.close()
        assert marks[0] >= 3  # the open transaction's record counts
        assert await within(tl.runtime.barrier.end_offsets(), 30) == marks
        assert tl.runtime.barrier.end_offsets_sync() == marks
    finally:
        open_tx.abort_transaction(30)


async def test_rounds_of_a_closed_source_fail_unavailable(tl, bootstrap):
    """A client closing while calls wait for end offsets: each of them gets its
    offsets or UNAVAILABLE -- never a cancellation or a RuntimeError of the
    closed consumer -- and so does every later call, async or blocking."""
    from threadlog.projections.barrier import EndOffsets, LatestOffsets

    from threadlog import ThreadLogError

    source = LatestOffsets(bootstrap, f"test-close-{uuid.uuid4().hex[:6]}")
    ends = EndOffsets(source, tl.runtime.topics.events, tl.runtime.layout.events, timeout=5)
    assert len(await within(ends.end_offsets(), 10)) == tl.runtime.layout.events
    calls = [asyncio.ensure_future(ends.end_offsets()) for _ in range(8)]
    await asyncio.sleep(0)  # a round in flight, the others queued behind it
    await asyncio.to_thread(source.close)
    for result in await within(asyncio.gather(*calls, return_exceptions=True), 15):
        assert isinstance(result, dict) or (isinstance(result, ThreadLogError) and result.code == "UNAVAILABLE"), \
            repr(result)
    for attempt in (lambda: within(ends.end_offsets(), 10), lambda: asyncio.to_thread(ends.end_offsets_sync)):
        try:
            await attempt()
        except ThreadLogError as exc:
            assert exc.code == "UNAVAILABLE"
        else:
            raise AssertionError("end offsets read through a closed source")


async def test_a_cancelled_wait_leaves_no_waiter_behind(tl):
    # Tried (a review): a worker request waiting for a far-off position whose caller
    # hung up (the request cancelled). Only a timed-out wait unregistered itself; a
    # cancelled one stayed with the judge for good, walked on every judged batch.
    judge = tl.runtime.judge
    far = {0: 10**12}

    def waiting() -> int:
        return sum(1 for targets, *_ in judge._async_waiters if targets == far)

    task = asyncio.ensure_future(judge.wait(far, 60))
    await until(lambda: waiting() == 1, 10, "the wait registered")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await within(task)
    assert waiting() == 0
    with pytest.raises(ThreadLogError):  # and a timed-out one, as before
        await within(judge.wait(far, 0.2))
    assert waiting() == 0
