"""Fencing of the delivery log by claims (SPEC 11, "Fencing").

These tests write claims with `ClaimWriter` (the same record `tl.runs.claim`
proposes on the run's delivery partition) inside a Kafka transaction of their
own, so they can hold a claim open while an append lands after it, then commit
or abort it: the fold must wait for the outcome. A driver writes with an
epoch a claim granted (1 first, then 2): an epoch never granted stands nowhere.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from confluent_kafka import Producer
from delivery_support import ClaimWriter, chunk, collect
from support import within

from threadlog import ThreadLogError
from threadlog.kernel import delivery_records as records


async def test_superseded_driver_is_refused_its_close_ignored_and_readers_see_each_chunk_once(
        bootstrap, open_client):
    a_host = await open_client()
    b_host = await open_client(processors="external")
    claims = ClaimWriter(bootstrap, a_host)
    run = "run-takeover"
    claims.claim(run, 1)
    a = a_host.delivery(run, epoch=1)
    a_offs = await within(a.append([chunk(0), chunk(1)]))
    claims.claim(run, 2)
    b = b_host.delivery(run, epoch=2)
    b_offs = await within(b.append([chunk(2)]))
    with pytest.raises(ThreadLogError) as e:
        await within(a.append([chunk(99)]))
    assert e.value.code == "RUN_CLAIM_LOST"
    with pytest.raises(ThreadLogError) as e:
        await within(a.upsert([(a_offs[0], chunk(98))]))
    assert e.value.code == "RUN_CLAIM_LOST"
    await within(a.close())  # ignored: the log stays open for B
    b_offs += await within(b.append([chunk(3)]))
    await within(b.close())
    # Claim lost is reported before closed.
    with pytest.raises(ThreadLogError) as e:
        await within(a.append([chunk(97)]))
    assert e.value.code == "RUN_CLAIM_LOST"
    reader = await open_client(processors="external")
    got = await collect(reader.delivery(run).read("-1"))
    assert got == [(o, chunk(i)) for i, o in enumerate(a_offs + b_offs)]
    # The new driver may re-persist the old driver's positions (idempotent replay).
    with pytest.raises(ThreadLogError) as e:
        await within(b.upsert([(a_offs[0], chunk(0))]))
    assert e.value.code == "RUN_LOG_CLOSED"


async def test_a_write_that_reached_kafka_after_a_claim_is_dropped_and_the_append_raises(bootstrap, tl):
    """The driver's own pre-check cannot see the claim yet: only the verdict
    after the write decides, and readers agree with it."""
    claims = ClaimWriter(bootstrap, tl)
    run = "run-late-write"
    claims.claim(run, 1)
    a = tl.delivery(run, epoch=1)
    await within(a.append([chunk(0)]))
    claims.claim(run, 2)
    a._precheck = lambda: None  # as if A had checked just before the claim
    with pytest.raises(ThreadLogError) as e:
        await within(a.append([chunk(1), chunk(2)]))
    assert e.value.code == "RUN_CLAIM_LOST"
    a._state = lambda: {"fence": 1, "reps": 0}  # A's close too passes its own check
    await within(a.close())  # written, and dropped: the log is not closed
    b = tl.delivery(run, epoch=2)
    [_o] = await within(b.append([chunk(3)]))
    await within(b.close())
    assert [c["i"] for _, c in await collect(tl.delivery(run).read("-1"))] == [0, 3]
    rows = await within(a.records())
    assert [(r["kind"], r["epoch"], r.get("dropped")) for r in rows] == [
        ("claim", 1, None), ("chunks", 1, None), ("claim", 2, None), ("chunks", 1, "RUN_CLAIM_LOST"),
        ("close", 1, "RUN_CLAIM_LOST"), ("chunks", 2, None), ("close", 2, None)]


@pytest.mark.parametrize("outcome", ["commit", "abort"])
async def test_an_append_behind_an_open_claim_transaction_waits_for_its_outcome(bootstrap, tl, outcome):
    claims = ClaimWriter(bootstrap, tl)
    run = f"run-open-claim-{outcome}"
    claims.claim(run, 1)
    a = tl.delivery(run, epoch=1)
    [o0] = await within(a.append([chunk(0)]))
    claims.begin(run, 2)  # the claim marker is in the log, its transaction undecided
    pending = asyncio.ensure_future(a.append([chunk(1), chunk(2)]))
    await asyncio.sleep(1.0)  # not synchronization: proves the append does not return meanwhile
    assert not pending.done()
    await asyncio.to_thread(claims.commit if outcome == "commit" else claims.abort)
    if outcome == "commit":
        with pytest.raises(ThreadLogError) as e:
            await within(pending)
        assert e.value.code == "RUN_CLAIM_LOST"
        expected = [(o0, chunk(0))]
    else:
        offs = await within(pending)
        expected = [(o0, chunk(0)), (offs[0], chunk(1)), (offs[1], chunk(2))]
    assert await within(tl.delivery(run).snapshot()) == expected


async def test_appends_racing_claims_are_never_acknowledged_but_dropped(bootstrap, open_client):
    driver_host = await open_client()
    reader_host = await open_client(processors="external")
    claims = ClaimWriter(bootstrap, driver_host)
    rng = random.Random(5)
    outcomes = {"returned": 0, "raised": 0, "dropped_after_write": 0}
    # The append's head start is drawn against how long a claim took in the last
    # trial, so both orders stay likely on a loaded machine (a fixed 0-20 ms let
    # every append win once broker round trips grew past it); trials go on past
    # 40 until both sides of the race were seen, for at most 60 s (the test's own
    # timeout is 120 s: the assertion below, not a timeout, must say what happened).
    claim_took, trial, began = 0.01, 0, time.monotonic()
    while trial < 40 or (not (outcomes["returned"] and outcomes["raised"]) and time.monotonic() - began < 60):
        trial += 1
        run = f"race-{trial}"
        await asyncio.to_thread(claims.claim, run, 1)
        a = driver_host.delivery(run, epoch=1)
        [first] = await within(a.append([chunk(0)]))
        delay_append, delay_claim = rng.random() * max(0.02, 2 * claim_took), rng.random() * 0.004

        async def do_append(a=a, delay_append=delay_append):
            await asyncio.sleep(delay_append)
            try:
                return await a.append([chunk(1), chunk(2), chunk(3)])
            except ThreadLogError as exc:
                assert exc.code == "RUN_CLAIM_LOST"
                return None

        async def do_claim(run=run, delay_claim=delay_claim):
            nonlocal claim_took
            await asyncio.sleep(delay_claim)
            began = time.monotonic()
            await asyncio.to_thread(claims.claim, run, 2)
            claim_took = time.monotonic() - began

        acked, _ = await within(asyncio.gather(do_append(), do_claim()))
        b = driver_host.delivery(run, epoch=2)
        [last] = await within(b.append([chunk(4)]))
        await within(b.close())
        got = await collect(reader_host.delivery(run).read("-1"))
        if acked is not None:
            outcomes["returned"] += 1
            expected = [(first, chunk(0)), *list(zip(acked, [chunk(1), chunk(2), chunk(3)], strict=True))]
        else:
            outcomes["raised"] += 1
            expected = [(first, chunk(0))]
            rows = await within(a.records())
            outcomes["dropped_after_write"] += sum(1 for r in rows if r.get("dropped") == "RUN_CLAIM_LOST")
        expected.append((last, chunk(4)))
        assert got == expected, f"trial {trial}: acked={acked is not None}"
    print("race outcomes", outcomes)
    # Both sides of the race happened (else the test proved nothing).
    assert outcomes["returned"] > 0 and outcomes["raised"] > 0, outcomes


async def test_a_claim_naming_a_floor_no_client_names_is_dropped_and_claims_go_on(bootstrap, tl):
    """Tried (a review): a claim record produced straight to the run's deliveries
    partition with floor 2**63-1. It was granted 2**63, which no Avro long holds:
    every later `claim` of the run failed INVALID_MESSAGE (and raised the fence,
    fencing the driver out too). A floor above CLAIM_FLOOR_MAX is dropped now;
    claims and the driver carry on."""
    await within(tl.runs.create_or_resume(run_id="r", thread_id="t", started_at=1))
    first = await within(tl.runs.claim("r"))
    driver = tl.delivery("r", epoch=first)
    await within(driver.append([chunk(0)]))
    forged = tl.runtime.codec.encode("threadlog.Delivery", records.encodable(records.claim("r", 2**63 - 1)))
    p = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": 0})
    p.produce(tl.runtime.topics.deliveries, forged, b"r", partition=driver.partition)
    assert p.flush(30) == 0
    await within(driver.append([chunk(1)]))  # the forged claim fenced nobody
    second = await within(tl.runs.claim("r"))
    assert second == first + 1
    await within(tl.delivery("r", epoch=second).append([chunk(2)]))
    assert [c for _, c in await collect(tl.delivery("r").read("-1", follow=False))] == [chunk(0), chunk(1), chunk(2)]
