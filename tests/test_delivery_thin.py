"""The delivery log through thin clients: no process folds the whole `deliveries` topic.

A thin client asks the owner of a run's partition for its writes' verdicts and
for a reader's starting state, reads the records from Kafka by offset, and
judges a live run's new records itself with the run index fold -- so it must
drop exactly what the owner drops. Workers fold only the delivery partitions
of the events partitions they own.
"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
from delivery_support import ClaimWriter, chunk, collect
from support import within
from worker_support import WorkerProcess

from threadlog import remote
from threadlog.kernel.errors import OUTCOME_UNKNOWN, RUN_CLAIM_LOST, ThreadLogError
from threadlog.kernel.partitioning import partition_for


async def test_a_thin_client_folds_no_delivery_partition_and_tails_only_what_it_reads(bootstrap, namespace,
                                                                                      tmp_path, open_client):
    worker = await WorkerProcess(bootstrap, namespace, tmp_path / "w", "w").start()
    try:
        embedded = await open_client()
        thin = await open_client(processors="external", own_worker=True)
        assert thin.runtime.deliveries is None and thin._delivery.runs.remote
        runs = [f"run-{n}" for n in range(12)]
        for run in runs:  # runs on every partition
            await within(embedded.delivery(run).append([chunk(0)]))
        watched = runs[0]
        p = partition_for(watched, thin.runtime.layout.deliveries)
        reader = thin.delivery(watched).read("-1")
        first = await within(reader.__anext__())
        assert first[1] == chunk(0)
        # The thin client wrote through the owner's verdict, and its live reader got it.
        [mine] = await within(thin.delivery(watched).append([chunk(1)]))
        assert await within(reader.__anext__()) == (mine, chunk(1))
        # One tailed partition: the one read live. Nothing else was folded or tailed.
        assert set(thin._delivery.runs.tail._dispatched) == {p}
        assert thin.runtime.slot is None  # no state of its own at all
        await within(embedded.delivery(watched).close())
        with pytest.raises(StopAsyncIteration):
            await within(reader.__anext__())
        # Snapshots, replays from an offset and `records` agree with the embedded client.
        assert await within(thin.delivery(watched).snapshot()) == await within(embedded.delivery(watched).snapshot())
        assert await within(collect(thin.delivery(watched).read(first[0]))) == [(mine, chunk(1))]
        assert await within(thin.delivery(watched).records()) == await within(embedded.delivery(watched).records())
    finally:
        await worker.stop()


async def test_a_thin_live_reader_drops_exactly_what_the_owner_drops(bootstrap, namespace, tmp_path,
                                                                    open_client):
    """Live: the old driver keeps appending while a new epoch is claimed (a transactional
    claim record, like another host's) and the new driver writes and closes. The thin
    reader judged the records after its start itself; it must yield exactly the
    acknowledged chunks, each once -- what the owner's fold and an embedded reader say."""
    worker = await WorkerProcess(bootstrap, namespace, tmp_path / "w", "w").start()
    try:
        embedded = await open_client()
        thin = await open_client(processors="external", own_worker=True)
        claims = ClaimWriter(bootstrap, embedded)
        for trial in range(6):
            run = f"live-{trial}"
            await asyncio.to_thread(claims.claim, run, 1)
            old = thin.delivery(run, epoch=1)
            acked = list(await within(old.append([chunk(0)])))
            live = asyncio.ensure_future(collect(thin.delivery(run).read("-1"), 60))

            async def keep_appending(old=old, acked=acked) -> int:
                refused = 0
                for i in range(1, 40):
                    try:
                        acked.extend(await within(old.append([chunk(i)])))
                    except ThreadLogError as exc:
                        assert exc.code == RUN_CLAIM_LOST
                        refused += 1
                    await asyncio.sleep(0)
                return refused

            async def claim_later(run=run, trial=trial) -> None:
                await asyncio.sleep(0.01 * trial)
                await asyncio.to_thread(claims.claim, run, 2)

            refused, _ = await within(asyncio.gather(keep_appending(), claim_later()))
            new = thin.delivery(run, epoch=2)
            acked.extend(await within(new.append([chunk(100)])))
            await within(new.close())
            got = await within(live, 60)
            assert [offset for offset, _ in got] == acked, f"trial {trial}: refused {refused}"
            assert got == await within(embedded.delivery(run).snapshot())
    finally:
        await worker.stop()


async def test_two_workers_split_the_delivery_partitions(bootstrap, namespace, tmp_path, open_client):
    a = await WorkerProcess(bootstrap, namespace, tmp_path / "a", "a").start()
    b = await WorkerProcess(bootstrap, namespace, tmp_path / "b", "b").start()
    try:
        thin = await open_client(processors="external", own_worker=True)
        layout = thin.runtime.layout

        async def split() -> dict:
            stats = await thin.runtime.query.acall("stats", {}, list(range(layout.events)))
            return {tuple(parts): s for parts, s in stats.items()}

        async def settled() -> dict:
            while True:
                stats = await split()
                if len(stats) == 2 and all(s["deliveries"] == s["owned"] for s in stats.values()):
                    return stats
                await asyncio.sleep(0.2)

        stats = await within(settled(), 60)
        owned = [set(s["deliveries"]) for s in stats.values()]
        assert owned[0].isdisjoint(owned[1]) and owned[0] | owned[1] == set(range(layout.deliveries))
        # Writes and reads on runs of both owners.
        for n in range(8):
            run = f"split-{n}"
            offsets = await within(thin.delivery(run).append([chunk(n)]))
            assert await within(thin.delivery(run).snapshot()) == [(offsets[0], chunk(n))]
    finally:
        await a.stop()
        await b.stop()


async def test_a_thin_writer_learns_its_delivery_verdicts_from_the_owners_pushes(bootstrap, namespace, tmp_path,
                                                                                open_client, monkeypatch):
    """The owner's run index pushes each delivery record's verdict to its thin
    writer (processors/verdict_push.py), as it does for proposals: appends are
    acknowledged by what is pushed, a superseded epoch is refused the same way,
    and what was acknowledged is exactly what a reader on another host gets."""
    # A verdict later than the grace is asked for instead (a loaded machine): not counted below.
    monkeypatch.setattr(remote, "PUSH_GRACE_S", 10.0)
    worker = await WorkerProcess(bootstrap, namespace, tmp_path / "w", "w").start()
    try:
        thin = await open_client(processors="external", own_worker=True)
        embedded = await open_client()
        verdicts = thin.session.bus.verdicts
        run = "pushed-run"
        await within(thin.runs.create_or_resume(run_id=run, thread_id="t", started_at=0))
        first = await within(thin.runs.claim(run))
        log = thin.delivery(run, epoch=first)
        acked = [await within(log.append([chunk(n)])) for n in range(12)]
        # The first appends may be asked (the push connection opens with the first call).
        assert verdicts.dlv_used >= 6, (verdicts.dlv_used, verdicts.dlv_pushed)
        await within(embedded.runs.claim(run))  # another host takes the run over
        with pytest.raises(ThreadLogError) as err:
            await within(log.append([chunk(99)]))
        assert err.value.code == RUN_CLAIM_LOST
        seen = await within(embedded.delivery(run).snapshot())
        assert seen == [(offset, chunk(n)) for n, [offset] in enumerate(acked)]
    finally:
        await worker.stop()


async def test_closing_a_thin_client_ends_a_delivery_write_waiting_for_its_answer(bootstrap, namespace, tmp_path,
                                                                                  open_client):
    """A write whose answer is awaited (its worker frozen: written, never folded)
    when the client closes fails at once instead of waiting on a stopped loop
    forever -- with OUTCOME_UNKNOWN: the record is durable, and whether it
    stands is the fold's to say (UNAVAILABLE would say nothing was written)."""
    worker = await WorkerProcess(bootstrap, namespace, tmp_path / "w", "w").start()
    try:
        thin = await open_client(processors="external", own_worker=True)
        run = "closing-run"
        await within(thin.runs.create_or_resume(run_id=run, thread_id="t", started_at=0))
        log = thin.delivery(run, epoch=await within(thin.runs.claim(run)))
        await within(log.append([chunk(0)]))
        verdicts = thin.session.bus.verdicts
        worker.signal(signal.SIGSTOP)
        try:
            pending = asyncio.ensure_future(log.append([chunk(1)]))
            deadline = time.monotonic() + 30
            while not verdicts._dlv_waiting:  # acked, waiting for its push (no event says so)
                assert time.monotonic() < deadline and not pending.done(), "the write never waited"
                await asyncio.sleep(0.02)
            await within(thin.close(), 20)
            with pytest.raises(ThreadLogError) as err:
                await within(pending, 10)
            assert err.value.code == OUTCOME_UNKNOWN
        finally:
            worker.signal(signal.SIGCONT)
    finally:
        await worker.stop()


async def test_a_live_reader_cancelled_while_its_partition_is_joined_leaves_the_feed_running(
        bootstrap, namespace, tmp_path, open_client):
    """A browser closing its tab cancels its SSE request, which may be waiting
    for the thin client's tail to join the run's partition. Tried: the first
    reader of a partition cancelled right after it asked; the tail goes on, and
    a later live reader of that partition gets the next chunk and the close."""
    worker = await WorkerProcess(bootstrap, namespace, tmp_path / "w", "w").start()
    try:
        embedded = await open_client()
        thin = await open_client(processors="external", own_worker=True)
        run = "cancelled-join"
        await within(embedded.delivery(run).append([chunk(0)]))
        p = partition_for(run, thin.runtime.layout.deliveries)
        tail = thin._delivery.runs.tail
        asked = asyncio.ensure_future(tail.subscribe(run, p))
        await asyncio.sleep(0)  # queued its join
        asked.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asked
        reader = thin.delivery(run).read("-1")
        assert (await within(reader.__anext__()))[1] == chunk(0)
        [offset] = await within(embedded.delivery(run).append([chunk(1)]))
        assert await within(reader.__anext__()) == (offset, chunk(1))
        await within(embedded.delivery(run).close())
        with pytest.raises(StopAsyncIteration):
            await within(reader.__anext__())
        assert tail._thread.is_alive()
    finally:
        await worker.stop()


async def test_a_thin_reader_joining_after_upserts_reads_the_replaced_texts_from_the_owner(open_client):
    """Below the owner's position a thin reader takes the owner's verdicts and
    replaced texts (paged: tests/unit/test_dlv_pages.py), base64 on the wire:
    what it yields equals an embedded reader's, texts with NUL, control
    characters and astral characters included."""
    embedded = await open_client()
    thin = await open_client(processors="external")
    log = embedded.delivery("run-upserted")
    offs = await within(log.append([chunk(i) for i in range(4)]))
    odd = "\x00\x01 ctl \U0001f600 \u2028"
    await within(log.upsert([(offs[2], chunk(2, text=odd)), (offs[0], chunk(0, fixed=True))]))
    await within(log.close())
    expected = [(offs[0], chunk(0, fixed=True)), (offs[1], chunk(1)), (offs[2], chunk(2, text=odd)),
                (offs[3], chunk(3))]
    assert await within(log.snapshot()) == expected
    assert await collect(thin.delivery("run-upserted").read("-1")) == expected
    assert await collect(thin.delivery("run-upserted").read(offs[1])) == expected[2:]
    assert await within(thin.delivery("run-upserted").snapshot()) == expected
