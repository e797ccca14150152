"""The read barrier against transactional writes: trailing commit and abort
markers occupy offsets no consumer yields, and must never make a read hang.

threadlog's own proposals use no transactions any more, but anyone may write
proposals inside a Kafka transaction (an outside service, a bridge); the judge
reads read_committed, so the barrier must handle markers all the same."""

from __future__ import annotations

import asyncio
import uuid

from confluent_kafka import Producer
from support import within

from threadlog.kernel.partitioning import partition_for


def _proposal(tl, messages: str) -> bytes:
    codec = tl.runtime.codec
    payload = codec.encode("threadlog.cmd.SaveTranscript", {"threadId": "t", "messages": messages})
    return codec.encode("threadlog.Proposal", {"proposalId": uuid.uuid4().hex, "key": "t",
                                               "type": "threadlog.cmd.SaveTranscript", "at": 0.0, "rules": 2,
                                               "seen": [], "payload": payload})


async def test_barrier_passes_trailing_commit_markers(tl, bootstrap, open_client):
    part = partition_for("t", tl.runtime.layout.events)
    p = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"test-commit-{uuid.uuid4().hex[:6]}"})
    p.init_transactions(30)
    for n in range(5):
        p.begin_transaction()
        p.produce(tl.runtime.topics.events, _proposal(tl, f"[{n}]"), b"t", partition=part)
        p.commit_transaction(30)
    # A commit returns once decided; its marker reaches the partition just after.
    # Wait (bounded) until all 5 markers are there: 5 records + 5 markers.
    async def markers_written() -> int:
        while (end := tl.runtime.barrier.end_offsets_sync()[part]) < 10:
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
