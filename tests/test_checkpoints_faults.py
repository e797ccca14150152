"""Faults with real decider processes (`threadlog worker`) on a real broker.

- SIGKILL of the decider while a stream of appends is in flight, then a restart
  with the same state dir and instance id: every acknowledged append is there
  exactly once, per-thread `seq` in the events topic has no gap and no
  duplicate, and nothing unacknowledged is half-applied.
- Zombie deciders: a decider that lost its partitions while holding an open
  transaction cannot make it visible. With the same instance id the successor's
  `init_transactions` fences it at once; with another instance id, after the
  zombie was frozen (SIGSTOP) past its session timeout, the group generation
  and the transaction timeout do. The zombie is held just before its commit by
  tests/pausable_worker.py (a launcher; the decider has no test hook).
"""

from __future__ import annotations

import asyncio
import signal

from checkpoint_helpers import checkpoint, file_key
from support import read_topic, within
from threadlog.schemas import default_codec
from worker_support import WorkerProcess

from threadlog import ThreadLogError
from threadlog.checkpoint_rules import blob_keys, normalized


def read_events(bootstrap: str, topic: str, partitions: int, committed: bool = True) -> list[dict]:
    """Every record of the events topic, decoded: committed only, or everything written."""
    codec = default_codec()
    out = []
    for msg in read_topic(bootstrap, topic, partitions, committed=committed):
        _, env = codec.decode(msg.value(), expect="threadlog.Event")
        _, payload = codec.decode(env["payload"], expect=env["type"])
        out.append({**env, "payload": payload, "partition": msg.partition(), "offset": msg.offset()})
    return out


def assert_seq_gap_free(events: list[dict]) -> dict[str, list[int]]:
    by_key: dict[str, list[int]] = {}
    for ev in events:
        by_key.setdefault(ev["key"], []).append(ev["seq"])
    for key, seqs in by_key.items():
        assert seqs == list(range(1, len(seqs) + 1)), f"seq of {key!r} has a gap or duplicate: {seqs}"
    return by_key


def grants(events: list[dict], thread: str) -> list[str]:
    return [e["payload"]["ownerToken"] for e in events
            if e["type"] == "threadlog.evt.CheckpointWriterAcquired" and e["key"] == thread]


async def events_of(tl, bootstrap: str, committed: bool = True) -> list[dict]:
    return await asyncio.to_thread(read_events, bootstrap, tl.runtime.topics.events, tl.runtime.layout.events,
                                   committed)


# -- SIGKILL mid-stream ------------------------------------------------------------------------------
async def test_decider_killed_mid_stream_loses_nothing_acknowledged_and_half_applies_nothing(
        bootstrap, namespace, tmp_path, open_client):
    worker = WorkerProcess(bootstrap, namespace, tmp_path / "worker", "node-1")
    restarted = WorkerProcess(bootstrap, namespace, tmp_path / "worker", "node-1")
    try:
        await worker.start()
        tl = await open_client(processors="external", request_timeout_ms=90_000)
        threads = [f"stream-{n}" for n in range(8)]
        sent: dict[str, dict] = {}  # checkpoint id -> what was sent
        acked: list[str] = []
        failed: list[tuple[str, str]] = []
        stop = asyncio.Event()
        acked_after_restart = 0
        in_flight = 0
        restarted_flag = asyncio.Event()

        async def stream(t: str) -> None:
            nonlocal acked_after_restart, in_flight
            lease = await tl.checkpoints.acquire_writer(t)
            head = None
            n = 0
            while not stop.is_set():
                cid = f"{t}/{n}"
                cp = checkpoint(cid, t, head, created_at=n, conversation=[{"n": n, "t": t}],
                                files=[{"path": f"f{n % 3}", "kind": "file", "blobKey": file_key("abc"[n % 3]),
                                        "size": n}])
                sent[cid] = normalized(cp)
                n += 1
                in_flight += 1
                try:
                    head = await tl.checkpoints.append(checkpoint=cp, expected_head_id=head, writer=lease)
                    acked.append(cid)
                    if restarted_flag.is_set():
                        acked_after_restart += 1
                except ThreadLogError as exc:
                    # Not acknowledged (e.g. no reply in time): it may or may not
                    # have been decided. Continue from whatever the head is now.
                    failed.append((cid, exc.code))
                    head = await tl.checkpoints.get_head(t)
                finally:
                    in_flight -= 1

        tasks = [asyncio.create_task(stream(t)) for t in threads]

        async def until(predicate, seconds: float) -> None:
            async def poll():
                while not predicate():
                    await asyncio.sleep(0.02)
            await within(poll(), seconds)

        await until(lambda: len(acked) >= 40, 60)
        worker.signal(signal.SIGKILL)
        assert await worker.wait_exit(10) == -signal.SIGKILL
        killed_at, in_flight_at_kill = len(acked), in_flight
        assert in_flight_at_kill > 0  # appends were awaiting their decision when the decider died
        await restarted.start()
        restarted_flag.set()
        await until(lambda: acked_after_restart >= 40, 120)
        stop.set()
        await within(asyncio.gather(*tasks), 120)
        assert len(acked) > killed_at

        # Every acknowledged append is present, equal to what was sent; anything
        # present was sent and is whole; chains and heads are consistent.
        present: dict[str, dict] = {}
        for t in threads:
            listed = await within(tl.checkpoints.list(t))
            ids = [c["id"] for c in listed]
            assert len(ids) == len(set(ids))
            for c in listed:
                assert c == sent[c["id"]], f"{c['id']} differs from what was sent"
                present[c["id"]] = c
            assert [c["parentCheckpointId"] for c in listed] == [None, *ids[:-1]]
            assert await within(tl.checkpoints.get_head(t)) == (ids[-1] if ids else None)
        assert set(acked) <= set(present)
        assert set(present) <= set(acked) | {cid for cid, _ in failed}
        # Blob references agree with the checkpoints that exist, nothing more.
        expected_refs: dict[str, int] = {}
        for c in present.values():
            for key in blob_keys(c):
                expected_refs[key] = expected_refs.get(key, 0) + 1
        assert await within(tl.checkpoints.list_blob_references()) == [
            {"key": k, "references": v} for k, v in sorted(expected_refs.items())]

        # The log itself: gap-free, duplicate-free seq per thread, one event per checkpoint.
        events = await events_of(tl, bootstrap)
        assert_seq_gap_free(events)
        appended = [e["payload"]["checkpoint"]["id"] for e in events
                    if e["type"] == "threadlog.evt.CheckpointAppended"]
        assert sorted(appended) == sorted(present)
        for t in threads:
            assert len(grants(events, t)) == 1
    finally:
        await worker.stop()
        await restarted.stop()


# -- zombies -----------------------------------------------------------------------------------------
async def _start_zombie_scenario(bootstrap, namespace, tmp_path, open_client, instance_id: str):
    control = tmp_path / "control"
    control.mkdir()
    zombie = WorkerProcess(bootstrap, namespace, tmp_path / "zombie", instance_id, pausable=True,
                           control_dir=control)
    await zombie.start()
    tl = await open_client(processors="external", request_timeout_ms=120_000)
    await within(tl.checkpoints.acquire_writer("warm-up"), 60)  # the zombie-to-be owns the partitions
    (control / "arm").touch()
    pending = asyncio.create_task(tl.checkpoints.acquire_writer("t"))
    await zombie.wait_for("PAUSED", 60)  # its grant is in the log, in an open transaction
    return zombie, control, tl, pending


async def _assert_only_the_successor_grant_is_visible(tl, bootstrap, lease) -> None:
    committed = await events_of(tl, bootstrap)
    assert grants(committed, "t") == [lease.owner_token]
    assert_seq_gap_free(committed)
    # The zombie did write its own grant (another token) -- it just never became visible.
    written = await events_of(tl, bootstrap, committed=False)
    zombie_grants = [tok for tok in grants(written, "t") if tok != lease.owner_token]
    assert zombie_grants, "the zombie's uncommitted grant should be in the log"
    # The successor serves the thread normally.
    assert lease.fence == 1
    await within(tl.checkpoints.append(checkpoint=checkpoint("after", "t"), expected_head_id=None, writer=lease))
    assert await within(tl.checkpoints.get_head("t")) == "after"


async def test_zombie_with_the_same_instance_id_is_fenced_by_init_transactions(
        bootstrap, namespace, tmp_path, open_client):
    successor = WorkerProcess(bootstrap, namespace, tmp_path / "successor", "node-1")
    zombie = None
    try:
        zombie, control, tl, pending = await _start_zombie_scenario(bootstrap, namespace, tmp_path, open_client,
                                                                    "node-1")
        # Same transactional ids: init_transactions bumps the epoch and aborts the
        # zombie's open transaction before the successor even joins the group.
        await successor.start()
        (control / "release").touch()
        failure = await zombie.wait_for("COMMIT-FAILED", 60)
        assert "fenced" in failure.lower()
        assert await zombie.wait_exit(60) == 2  # a fenced decider stops; its worker exits
        assert "fenced" in zombie.stderr().lower()
        lease = await within(pending, 120)  # decided again, by the successor
        await _assert_only_the_successor_grant_is_visible(tl, bootstrap, lease)
    finally:
        if zombie is not None:
            await zombie.stop()
        await successor.stop()


async def test_frozen_zombie_with_another_instance_id_cannot_commit_after_takeover(
        bootstrap, namespace, tmp_path, open_client):
    successor = WorkerProcess(bootstrap, namespace, tmp_path / "successor", "node-2")
    zombie = None
    try:
        zombie, control, tl, pending = await _start_zombie_scenario(bootstrap, namespace, tmp_path, open_client,
                                                                    "node-1")
        zombie.signal(signal.SIGSTOP)  # no heartbeats: the group drops it after its session timeout
        await successor.start()
        # The successor owns the partitions once the zombie's session expired, and
        # reads the committed offsets once the zombie's open transaction (which
        # holds a pending offset commit) is aborted by the transaction timeout.
        lease = await within(pending, 120)
        (control / "release").touch()
        zombie.signal(signal.SIGCONT)
        failure = await zombie.wait_for("COMMIT-FAILED", 60)
        # The transaction timeout's abort bumped the producer epoch: the late
        # commit is refused as fenced (Kafka 4.x), and the zombie stops.
        assert "fenced" in failure.lower()
        assert "COMMITTED" not in zombie.lines
        assert await zombie.wait_exit(60) == 2
        await _assert_only_the_successor_grant_is_visible(tl, bootstrap, lease)
    finally:
        if zombie is not None:
            await zombie.stop()
        await successor.stop()
