"""Takeover, on a real broker (issue 12, item 5): writer leases that renew
themselves, loss reported by `lease.lost` and by `WRITER_LOST` on the next
write, stealing a held writer (the fence moves on), renewal through a
transient outage, and `threadlog reclaim`.

Leases here are short (3 s, renewed every 1 s): the tests wait out wall-clock
lease time, which is what they are about, but every wait polls observable
state with a deadline.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time

import pytest
from checkpoint_helpers import LaggingFollower, checkpoint, refused
from support import until, within
from threadlog.projections.folds import checkpoints as cp_state

import threadlog
from threadlog import ThreadLogError

WRITER_CONFLICT = "SANDBOX_SNAPSHOT_WRITER_CONFLICT"
WRITER_LOST = "SANDBOX_SNAPSHOT_WRITER_LOST"
FORK_SOURCE_NOT_FOUND = "SANDBOX_SNAPSHOT_FORK_SOURCE_NOT_FOUND"
SHORT = {"lease_duration_ms": 3_000, "renew_after_ms": 1_000}


def now_ms() -> float:
    return time.time() * 1000.0


async def append(tl, cp: dict, expected, writer) -> str:
    return await within(tl.checkpoints.append(checkpoint=cp, expected_head_id=expected, writer=writer))


# -- self-renewing leases ------------------------------------------------------------------
async def test_a_short_lease_renews_itself_and_still_appends_after_5_s(open_client):
    tl = await open_client(**SHORT)
    lease = await within(tl.checkpoints.acquire_writer("t"))
    assert lease.auto_renew and not lease.lost and lease.lost_reason is None
    first = lease.expires_at
    await append(tl, checkpoint("c1", "t", created_at=1), None, lease)
    # Renewals move expires_at on (each one by about renew_after_ms)...
    await until(lambda: lease.expires_at >= first + 2_000, 10, "two renewals")
    # ...and the lease outlives its first expiry by far.
    await until(lambda: now_ms() >= first + 2_000, 10, "5 s after the grant")
    assert await append(tl, checkpoint("c2", "t", "c1", created_at=2), "c1", lease) == "c2"
    assert not lease.lost and lease.expires_at > now_ms()
    # Released: renewing stops, the thread is free for the next writer at once.
    await within(lease.release())
    assert not lease.auto_renew and not lease.lost
    successor = await within(tl.checkpoints.acquire_writer("t", auto_renew=False))
    assert successor.fence == lease.fence + 1 and not successor.auto_renew


async def test_auto_renew_false_leaves_the_lease_to_expire(open_client):
    tl = await open_client(**SHORT)
    lease = await within(tl.checkpoints.acquire_writer("t", auto_renew=False))
    assert not lease.auto_renew
    first = lease.expires_at
    await until(lambda: now_ms() >= first + 100, 10, "the lease's expiry")
    assert lease.expires_at == first and not lease.lost  # nobody told it
    await refused(tl.checkpoints.append(checkpoint=checkpoint("c1", "t"), expected_head_id=None, writer=lease),
                  WRITER_LOST)
    await refused(tl.checkpoints.acquire_writer("t", auto_renew="yes"), "INVALID_ARGUMENT")


async def test_a_stolen_lease_flips_lost_and_its_next_append_raises_without_being_sent(open_client):
    a = await open_client(**SHORT)
    b = await open_client(**SHORT)
    old = await within(a.checkpoints.acquire_writer("t"))
    await append(a, checkpoint("c1", "t", created_at=1), None, old)
    new = await within(b.checkpoints.acquire_writer("t", steal=True))
    assert new.fence == old.fence + 1
    # A's next background renewal is refused: the lease knows it is lost.
    await until(lambda: old.lost, 30, "the old lease noticing the steal")
    assert "renewal was refused" in old.lost_reason and not old.auto_renew
    err = await refused(a.checkpoints.append(checkpoint=checkpoint("c2", "t", "c1", created_at=2),
                                             expected_head_id="c1", writer=old), WRITER_LOST)
    assert "was lost" in err.message  # refused locally, with the reason
    await refused(a.checkpoints.delete_head(thread_id="t", checkpoint_id="c1", writer=old), WRITER_LOST)
    await refused(old.renew(), WRITER_LOST)
    await within(old.release())  # silent, and it ends nothing of the thief's
    assert await append(b, checkpoint("c2", "t", "c1", created_at=2), "c1", new) == "c2"
    assert await within(a.checkpoints.get_head("t")) == "c2"


# -- steal -------------------------------------------------------------------------------------
async def test_steal_while_held_fences_the_old_holder_and_the_new_holder_appends(open_client):
    a = await open_client()
    b = await open_client()
    old = await within(a.checkpoints.acquire_writer("t", auto_renew=False))
    await append(a, checkpoint("c1", "t", created_at=1), None, old)
    # Without steal the holder keeps it; with steal the fence moves on.
    await refused(b.checkpoints.acquire_writer("t"), WRITER_CONFLICT)
    new = await within(b.checkpoints.acquire_writer("t", steal=True, auto_renew=False))
    assert new.fence == old.fence + 1 and new.owner_token != old.owner_token
    # The old holder does not know yet: its writes are refused by the judge.
    assert not old.lost
    await refused(a.checkpoints.append(checkpoint=checkpoint("x", "t", "c1", created_at=2), expected_head_id="c1",
                                       writer=old), WRITER_LOST)
    await refused(old.renew(), WRITER_LOST)
    assert old.lost  # a refused renewal tells it
    assert await append(b, checkpoint("c2", "t", "c1", created_at=2), "c1", new) == "c2"
    # A steal is a grant: a plain acquire still conflicts with it, another steal takes it again.
    await refused(a.checkpoints.acquire_writer("t"), WRITER_CONFLICT)
    third = await within(a.checkpoints.acquire_writer("t", steal=True, auto_renew=False))
    assert third.fence == new.fence + 1
    await refused(b.checkpoints.append(checkpoint=checkpoint("c3", "t", "c2", created_at=3), expected_head_id="c2",
                                       writer=new), WRITER_LOST)
    # Stealing a free thread is an ordinary grant.
    free = await within(b.checkpoints.acquire_writer("u", steal=True, auto_renew=False))
    assert free.fence == 1
    assert [c["id"] for c in await within(a.checkpoints.list("t"))] == ["c1", "c2"]


async def test_a_steal_is_judged_alike_on_every_host(open_client):
    a = await open_client()
    b = await open_client()
    await within(a.checkpoints.acquire_writer("t", auto_renew=False))
    stolen = await within(a.checkpoints.acquire_writer("t", steal=True, auto_renew=False))
    await append(b, checkpoint("c1", "t"), None, stolen)  # judged by B's own judge too
    assert await within(b.checkpoints.get_head("t")) == "c1"


# -- transient outages ---------------------------------------------------------------------------
async def warmed(tl) -> None:
    """Make a client's first writes fast before a test leans on a 1 s request timeout.

    The first proposal of a fresh client also waits for its producer's id and
    the topic's metadata, which on a loaded 2-core machine took more than 1 s
    (a CI run failed this test's setup with OUTCOME_UNKNOWN). Throwaway leases on
    threads of their own absorb that; the test's own calls are unchanged.
    """
    for attempt in range(10):
        try:
            await within(tl.checkpoints.acquire_writer(f"warm-{attempt}", auto_renew=False))
            return
        except threadlog.ThreadLogError as exc:
            if exc.code != "OUTCOME_UNKNOWN":
                raise
    raise AssertionError("the client never got a write through within its 1 s request timeout")


async def test_a_renewal_through_a_transient_outage_retries_and_keeps_the_lease(open_client, caplog):
    # The client's judge is held (a lagging follower) for 4 s: a renewal sent
    # meanwhile is not judged within the 1 s request timeout (UNAVAILABLE) and is
    # retried; once the judge catches up, the lease is renewed, never lost.
    # (4 s, not less: the check that nothing was renewed yet runs after the first
    # UNAVAILABLE is logged, and must still fall inside the lag on a loaded machine.)
    tl = await open_client(lease_duration_ms=8_000, renew_after_ms=1_000, request_timeout_ms=1_000)
    await warmed(tl)
    lease = await within(tl.checkpoints.acquire_writer("t"))
    first = lease.expires_at
    caplog.set_level(logging.INFO, logger="threadlog.checkpoints")
    async with LaggingFollower(tl, 4.0):
        await until(lambda: "unavailable, retrying" in caplog.text, 5, "a renewal answered UNAVAILABLE")
        assert lease.expires_at == first and not lease.lost
    await until(lambda: lease.expires_at > first, 10, "a renewal after the outage")
    assert not lease.lost
    await until(lambda: now_ms() >= first + 500, 10, "the first expiry")
    assert await append(tl, checkpoint("c1", "t"), None, lease) == "c1"


async def test_an_outage_longer_than_the_lease_makes_it_lost(open_client):
    tl = await open_client(**SHORT, request_timeout_ms=1_000)
    await warmed(tl)
    lease = await within(tl.checkpoints.acquire_writer("t"))
    first = lease.expires_at
    async with LaggingFollower(tl, 4.5):
        await until(lambda: lease.lost, 6, "the lease expiring unrenewed")
    assert "expired before a renewal got through" in lease.lost_reason
    assert now_ms() >= first
    await refused(tl.checkpoints.append(checkpoint=checkpoint("c1", "t"), expected_head_id=None, writer=lease),
                  WRITER_LOST)
    # Lost by this client's clock, but the renewals it sent meanwhile were judged
    # after the lag at their own times: the judge may still hold the lease. A
    # release ends it all the same (before, a lost lease's release sent nothing,
    # and the thread stayed held up to a lease length).
    try:
        await lease.release()
    except ThreadLogError as exc:  # this client's 1 s request timeout on a busy machine: the state tells
        assert exc.code == "OUTCOME_UNKNOWN", exc
    await until(lambda: cp_state.get_lease(tl.runtime.store, "t") is None, 10, "the release judged")


# -- the blocking client -----------------------------------------------------------------------
async def test_sync_leases_renew_on_the_clients_loop_thread(bootstrap, namespace, tmp_path):
    def scenario() -> None:
        with threadlog.connect(bootstrap, namespace, state_dir=str(tmp_path / "sync"), **SHORT) as tl:
            lease = tl.checkpoints.acquire_writer("t")
            assert lease.auto_renew and not lease.lost
            first = lease.expires_at
            deadline = time.monotonic() + 10
            while now_ms() < first + 2_000 or lease.expires_at < first + 2_000:
                assert time.monotonic() < deadline, "the sync lease was not renewed"
                time.sleep(0.05)
            tl.checkpoints.append(checkpoint=checkpoint("c1", "t"), expected_head_id=None, writer=lease)
            thief = tl.checkpoints.acquire_writer("t", steal=True, auto_renew=False)
            assert thief.fence == lease.fence + 1
            deadline = time.monotonic() + 5
            while not lease.lost:
                assert time.monotonic() < deadline, "the sync lease did not notice the steal"
                time.sleep(0.05)
            try:
                tl.checkpoints.append(checkpoint=checkpoint("c2", "t", "c1"), expected_head_id="c1", writer=lease)
            except threadlog.ThreadLogError as exc:
                assert exc.code == WRITER_LOST
            else:
                raise AssertionError("a lost sync lease appended")

    await within(asyncio.to_thread(scenario), 60)


# -- threadlog reclaim ---------------------------------------------------------------------------
def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "THREADLOG_KAFKA_CONFIG"}
    return subprocess.run([sys.executable, "-m", "threadlog", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


async def test_reclaim_lists_then_claims_reclaimable_runs(bootstrap, namespace, tl, tmp_path):
    runs = tl.runs
    now = now_ms()
    for run_id, thread, patch in [
        ("old", "t1", {"detachedSince": now - 60_000}),
        ("older", "t2", {"detachedSince": now - 120_000}),
        ("recent", "t3", {"detachedSince": now}),
        ("attached", "t4", {}),
        ("done", "t5", {"detachedSince": now - 60_000, "status": "completed"}),
    ]:
        await within(runs.create_or_resume(run_id=run_id, thread_id=thread, started_at=now))
        if patch:
            await within(runs.update(run_id, patch))
    common = ["--bootstrap", bootstrap, "--namespace", namespace, "--ttl-ms", "30000"]

    listed = await within(asyncio.to_thread(cli, "reclaim", *common, "--state-dir", str(tmp_path / "r1")), 90)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines() == [f"older\tt2\t{now - 120_000}", f"old\tt1\t{now - 60_000}"]
    # Read-only: nothing was claimed.
    assert "driverEpoch" not in await within(runs.get("old"))

    claimed = await within(asyncio.to_thread(cli, "reclaim", *common, "--claim", "--state-dir",
                                             str(tmp_path / "r2")), 90)
    assert claimed.returncode == 0, claimed.stderr
    assert claimed.stdout.splitlines() == [f"older\tt2\t{now - 120_000}\tepoch=1",
                                           f"old\tt1\t{now - 60_000}\tepoch=1"]
    assert (await within(runs.get("old")))["driverEpoch"] == 1
    assert (await within(runs.get("older")))["driverEpoch"] == 1
    assert "driverEpoch" not in await within(runs.get("recent"))
    # Still detached (nothing re-attached them): a second claim hands out the next epoch.
    again = await within(asyncio.to_thread(cli, "reclaim", *common, "--claim", "--state-dir",
                                           str(tmp_path / "r3")), 90)
    assert again.returncode == 0, again.stderr
    assert [line.rsplit("\t", 1)[1] for line in again.stdout.splitlines()] == ["epoch=2", "epoch=2"]


async def test_a_fork_with_a_lost_lease_is_judged_in_the_specs_order(open_client):
    """SPEC: a fork checks the source (exists, on the source thread) before the
    writer (current, else WRITER_LOST). Tried: a lease that knows it was lost
    (stolen, its renewal refused) forking from a checkpoint that does not exist:
    FORK_SOURCE_NOT_FOUND, not the lease's loss."""
    a = await open_client()
    b = await open_client()
    old = await within(a.checkpoints.acquire_writer("dst", auto_renew=False))
    await within(b.checkpoints.acquire_writer("dst", steal=True, auto_renew=False))
    with pytest.raises(ThreadLogError) as err:
        await within(old.renew())
    assert err.value.code == WRITER_LOST and old.lost
    with pytest.raises(ThreadLogError) as err:
        await within(a.checkpoints.fork_from_checkpoint(
            source_thread_id="src", source_checkpoint_id="missing", destination_thread_id="dst",
            destination_checkpoint_id="d1", created_at=1, writer=old))
    assert err.value.code == FORK_SOURCE_NOT_FOUND
