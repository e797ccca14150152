"""Takeover with the real `tl.runs.claim`: a new host claims a run mid-stream and continues it.

`claim` is decided by the decider, which writes the claim marker into the
run's delivery partition in the same transaction as the RunClaimed event.
"""

from __future__ import annotations

import asyncio
import random

import pytest
from delivery_support import chunk, collect
from support import within

from threadlog import ThreadLogError


async def test_takeover_old_driver_is_fenced_and_a_replay_sees_each_chunk_once_in_order(open_client):
    host_a = await open_client()
    host_b = await open_client()
    await within(host_a.runs.create_or_resume(run_id="run-t", thread_id="thread-t", started_at=1000))
    epoch_a = await within(host_a.runs.claim("run-t"))
    assert epoch_a == 1
    a = host_a.delivery("run-t", epoch=epoch_a)
    a_offs = await within(a.append([chunk(0), chunk(1)]))
    a_offs += await within(a.append([chunk(2)]))

    # Host B takes over: claims, catches up from what is stored, continues.
    epoch_b = await within(host_b.runs.claim("run-t"))
    assert epoch_b == 2
    b = host_b.delivery("run-t", epoch=epoch_b)
    seen = await within(b.snapshot())
    assert seen == [(o, chunk(i)) for i, o in enumerate(a_offs)]
    b_offs = await within(b.append([chunk(3), chunk(4)]))

    # A does not know yet; its next append is refused, its close ignored.
    with pytest.raises(ThreadLogError) as e:
        await within(a.append([chunk(99)]))
    assert e.value.code == "RUN_CLAIM_LOST"
    await within(a.close())
    b_offs += await within(b.append([chunk(5)]))
    await within(b.close())
    with pytest.raises(ThreadLogError) as e:  # claim lost is reported before closed
        await within(a.append([chunk(98)]))
    assert e.value.code == "RUN_CLAIM_LOST"
    assert (await within(host_a.runs.get("run-t")))["driverEpoch"] == 2

    reader = await open_client(processors="external")
    got = await collect(reader.delivery("run-t").read("-1"))
    assert got == [(o, chunk(i)) for i, o in enumerate(a_offs + b_offs)]


async def test_a_run_claimed_again_and_again_replays_exactly_once(open_client):
    hosts = [await open_client(), await open_client()]
    await within(hosts[0].runs.create_or_resume(run_id="run-many", thread_id="t", started_at=1))
    expected = []
    for turn in range(6):
        host = hosts[turn % 2]
        epoch = await within(host.runs.claim("run-many"))
        log = host.delivery("run-many", epoch=epoch)
        for k in range(3):
            expected += zip(await within(log.append([chunk(turn * 3 + k)])), [chunk(turn * 3 + k)], strict=True)
    await within(log.close())
    reader = await open_client(processors="external")
    assert await collect(reader.delivery("run-many").read("-1")) == expected
    assert await within(reader.delivery("run-many").snapshot()) == expected


async def test_appends_racing_real_claims_are_never_acknowledged_but_dropped(open_client):
    driver = await open_client()
    claimer = await open_client()
    reader = await open_client(processors="external")
    rng = random.Random(11)
    outcomes = {"returned": 0, "raised": 0}
    claim_took = 0.02  # how long a claim takes to land, re-measured each trial: the append aims into it
    loop = asyncio.get_running_loop()
    for trial in range(25):
        run = f"race-{trial}"
        await within(driver.runs.create_or_resume(run_id=run, thread_id=f"thread-{trial}", started_at=1))
        epoch = await within(driver.runs.claim(run))
        a = driver.delivery(run, epoch=epoch)
        [first] = await within(a.append([chunk(0)]))
        delays = rng.random() * 1.5 * claim_took, rng.random() * 0.005

        async def do_append(a=a, delay=delays[0]):
            await asyncio.sleep(delay)
            try:
                return await a.append([chunk(1), chunk(2), chunk(3)])
            except ThreadLogError as exc:
                assert exc.code == "RUN_CLAIM_LOST"
                return None

        async def do_claim(run=run, delay=delays[1]):
            await asyncio.sleep(delay)
            t0 = loop.time()
            epoch = await claimer.runs.claim(run)
            return epoch, loop.time() - t0

        acked, (new_epoch, claim_took) = await within(asyncio.gather(do_append(), do_claim()))
        b = claimer.delivery(run, epoch=new_epoch)
        [last] = await within(b.append([chunk(4)]))
        await within(b.close())
        expected = [(first, chunk(0))]
        if acked is not None:
            outcomes["returned"] += 1
            expected += zip(acked, [chunk(1), chunk(2), chunk(3)], strict=True)
        else:
            outcomes["raised"] += 1
        expected.append((last, chunk(4)))
        got = await collect(reader.delivery(run).read("-1"))
        assert got == expected, f"trial {trial}: append {'returned' if acked else 'raised'}"
    assert outcomes["returned"] > 0 and outcomes["raised"] > 0, outcomes


async def test_claim_of_a_run_that_never_produced_does_not_make_it_readable(open_client):
    tl = await open_client(first_chunk_wait_ms=300)
    await within(tl.runs.create_or_resume(run_id="run-idle", thread_id="t", started_at=1))
    await within(tl.runs.claim("run-idle"))
    # A claim marker is not a chunk: "-1" still finds nothing within the wait.
    with pytest.raises(ThreadLogError) as e:
        await within(tl.delivery("run-idle").read("-1").__anext__(), 10)
    assert e.value.code == "RUN_NOT_FOUND"
    assert await within(tl.delivery("run-idle").snapshot()) == []
    # The old epoch (0: no claim) is fenced; the claimed one writes.
    with pytest.raises(ThreadLogError) as e:
        await within(tl.delivery("run-idle").append([chunk(0)]))
    assert e.value.code == "RUN_CLAIM_LOST"
    [o] = await within(tl.delivery("run-idle", epoch=1).append([chunk(0)]))
    assert await within(tl.delivery("run-idle").snapshot()) == [(o, chunk(0))]
