"""tl.checkpoints behaviours of the seeds' memory checkpoint store (seeds/001), on a real
broker: head compare-and-set, parent mismatch, duplicate ids, delete-head, writer
leases (conflict, lost, stale, wrong thread, expiry by the decider's clock,
release and re-acquire), blob references, check order, ids."""

from __future__ import annotations

import asyncio
import types

import pytest
from checkpoint_helpers import (
    LaggingFollower,
    MutableClock,
    artifact,
    artifact_key,
    checkpoint,
    file_key,
    refused,
    thread_state,
    threads_on_distinct_partitions,
    threads_owned_by,
)
from support import within

import threadlog
from threadlog.kernel.partitioning import partition_for

STALE_HEAD = "SANDBOX_SNAPSHOT_STALE_HEAD"
PARENT_MISMATCH = "SANDBOX_SNAPSHOT_PARENT_MISMATCH"
DUPLICATE_ID = "SANDBOX_SNAPSHOT_DUPLICATE_ID"
NOT_HEAD = "SANDBOX_SNAPSHOT_NOT_HEAD"
WRITER_CONFLICT = "SANDBOX_SNAPSHOT_WRITER_CONFLICT"
WRITER_LOST = "SANDBOX_SNAPSHOT_WRITER_LOST"
INVALID_ID = "SANDBOX_SNAPSHOT_INVALID_ID"
INVALID_ENTRY = "SANDBOX_SNAPSHOT_INVALID_ENTRY"


async def append(tl, cp: dict, expected, writer) -> str:
    return await within(tl.checkpoints.append(checkpoint=cp, expected_head_id=expected, writer=writer))


# -- append, get, list, head ---------------------------------------------------------------
async def test_appends_build_a_chain_and_move_the_head(tl):
    cps = tl.checkpoints
    w = await within(cps.acquire_writer("t"))
    assert await within(cps.get_head("t")) is None
    assert await within(cps.list("t")) == []
    assert await append(tl, checkpoint("c1", "t", created_at=1), None, w) == "c1"
    assert await append(tl, checkpoint("c2", "t", "c1", created_at=2, reason="named", label="v2",
                                       sourceRunId="run-9"), "c1", w) == "c2"
    assert await within(cps.get_head("t")) == "c2"
    listed = await within(cps.list("t"))
    assert [c["id"] for c in listed] == ["c1", "c2"]
    assert listed[1] == checkpoint("c2", "t", "c1", created_at=2, reason="named", label="v2", sourceRunId="run-9")
    assert await within(cps.get("c2")) == listed[1]
    assert await within(cps.get("nope")) is None
    assert await within(cps.get_head("other-thread")) is None


async def test_records_are_fresh_copies_with_optional_fields_absent(tl):
    cps = tl.checkpoints
    w = await within(cps.acquire_writer("t"))
    cp = checkpoint("c1", "t", label=None, sourceRunId=None, createdAt=1.25,
                    conversation=[{"n": 1.5, "s": "é🌍", "deep": [[None, True, 2**60]]}])
    del cp["parentCheckpointId"]  # absent: stored as None
    await append(tl, cp, None, w)
    got = await within(cps.get("c1"))
    assert got["parentCheckpointId"] is None
    assert "label" not in got and "sourceRunId" not in got
    assert got["createdAt"] == 1.25 and isinstance(got["createdAt"], float)
    assert got["conversation"] == [{"n": 1.5, "s": "é🌍", "deep": [[None, True, 2**60]]}]
    got["files"].append("mutated")
    got["conversation"][0]["n"] = 0
    assert await within(cps.get("c1")) != got
    assert (await within(cps.list("t")))[0]["files"] == cp["files"]
    # The caller's dict is not kept either.
    cp["files"].clear()
    assert (await within(cps.get("c1")))["files"] != []


async def test_list_orders_by_created_at_then_id_bytes(tl):
    w = await within(tl.checkpoints.acquire_writer("t"))
    chain = [("m", 5), ("b", 1.5), ("é", 5), ("Z", 5), ("a", -3), ("a\x00", 5), ("zz", 5.0000001),
             ("big-b", 2**53), ("big-a", 2**53 + 1), ("big-c", float(2**53)), ("neg-zero", -0.0), ("zero", 0)]
    head = None
    for cid, at in chain:
        head = await append(tl, checkpoint(cid, "t", head, created_at=at), head, w)
    listed = await within(tl.checkpoints.list("t"))
    expected = sorted(chain, key=lambda c: (c[1], c[0].encode()))
    assert [(c["id"], c["createdAt"]) for c in listed] == expected
    assert [c["id"] for c in listed] == ["a", "neg-zero", "zero", "b", "Z", "a\x00", "m", "é", "zz",
                                         "big-b", "big-c", "big-a"]
    assert isinstance(listed[0]["createdAt"], int)


async def test_stale_expected_head_is_refused_and_changes_nothing(tl):
    w = await within(tl.checkpoints.acquire_writer("t"))
    await append(tl, checkpoint("c1", "t"), None, w)
    before = await thread_state(tl, "t")
    await refused(tl.checkpoints.append(checkpoint=checkpoint("c2", "t"), expected_head_id=None, writer=w), STALE_HEAD)
    await refused(tl.checkpoints.append(checkpoint=checkpoint("c2", "t", "zz"), expected_head_id="zz", writer=w),
                  STALE_HEAD)
    assert await thread_state(tl, "t") == before
    assert await within(tl.checkpoints.get("c2")) is None


async def test_parent_other_than_expected_head_is_refused(tl):
    w = await within(tl.checkpoints.acquire_writer("t"))
    await append(tl, checkpoint("c1", "t"), None, w)
    before = await thread_state(tl, "t")
    err = await refused(tl.checkpoints.append(checkpoint=checkpoint("c2", "t", None), expected_head_id="c1",
                                              writer=w), PARENT_MISMATCH)
    assert "c2" in err.message
    await refused(tl.checkpoints.append(checkpoint=checkpoint("c2", "t", "other"), expected_head_id="c1", writer=w),
                  PARENT_MISMATCH)
    assert await thread_state(tl, "t") == before


async def test_duplicate_ids_are_refused_on_any_thread_and_freed_by_delete(open_client):
    # Two embedded clients split the partitions: the second thread's decider
    # must see an id that another process's decider stored.
    a = await open_client()
    b = await open_client()
    t1, t2 = await threads_owned_by([a, b])
    w1 = await within(a.checkpoints.acquire_writer(t1))
    w2 = await within(b.checkpoints.acquire_writer(t2))
    # b's follower is held back: b's decider learns of a's checkpoint only by
    # waiting for the other partitions (sync_global), not from its store as is.
    async with LaggingFollower(b, 1.5):
        await append(a, checkpoint("shared", t1), None, w1)
        await refused(b.checkpoints.append(checkpoint=checkpoint("shared", t2), expected_head_id=None, writer=w2),
                      DUPLICATE_ID)
    await refused(a.checkpoints.append(checkpoint=checkpoint("shared", t1, "shared"), expected_head_id="shared",
                                       writer=w1), DUPLICATE_ID)
    assert await within(b.checkpoints.get_head(t2)) is None
    # Deleting the checkpoint frees its id, on any thread.
    await within(a.checkpoints.delete_head(thread_id=t1, checkpoint_id="shared", writer=w1))
    assert await append(b, checkpoint("shared", t2), None, w2) == "shared"
    assert (await within(a.checkpoints.get("shared")))["threadId"] == t2


# -- delete_head -----------------------------------------------------------------------------
async def test_delete_head_moves_the_head_to_the_parent_then_to_none(tl):
    cps = tl.checkpoints
    w = await within(cps.acquire_writer("t"))
    await append(tl, checkpoint("c1", "t"), None, w)
    await append(tl, checkpoint("c2", "t", "c1", created_at=11), "c1", w)
    assert await within(cps.delete_head(thread_id="t", checkpoint_id="c2", writer=w)) is None
    assert await within(cps.get_head("t")) == "c1"
    assert await within(cps.get("c2")) is None
    assert [c["id"] for c in await within(cps.list("t"))] == ["c1"]
    await within(cps.delete_head(thread_id="t", checkpoint_id="c1", writer=w))
    assert await within(cps.get_head("t")) is None
    assert await within(cps.list("t")) == []
    # The thread starts over from no head.
    assert await append(tl, checkpoint("c3", "t"), None, w) == "c3"


async def test_delete_of_a_non_head_or_unknown_checkpoint_is_not_head(tl):
    cps = tl.checkpoints
    w = await within(cps.acquire_writer("t"))
    other = await within(cps.acquire_writer("u"))
    await append(tl, checkpoint("c1", "t"), None, w)
    await append(tl, checkpoint("c2", "t", "c1"), "c1", w)
    await append(tl, checkpoint("u1", "u"), None, other)
    before = await thread_state(tl, "t")
    await refused(cps.delete_head(thread_id="t", checkpoint_id="c1", writer=w), NOT_HEAD)
    await refused(cps.delete_head(thread_id="t", checkpoint_id="missing", writer=w), NOT_HEAD)
    await refused(cps.delete_head(thread_id="t", checkpoint_id="u1", writer=w), NOT_HEAD)  # another thread's head
    empty = await within(cps.acquire_writer("empty"))
    await refused(cps.delete_head(thread_id="empty", checkpoint_id="c2", writer=empty), NOT_HEAD)
    assert await thread_state(tl, "t") == before
    assert await within(cps.get_head("u")) == "u1"


async def test_delete_head_checks_ids_then_writer_thread_then_lease_then_head(tl):
    cps = tl.checkpoints
    w = await within(cps.acquire_writer("t"))
    other = await within(cps.acquire_writer("u"))
    await append(tl, checkpoint("c1", "t"), None, w)
    before = await thread_state(tl, "t")
    await refused(cps.delete_head(thread_id="t", checkpoint_id="", writer=other), INVALID_ID)
    await refused(cps.delete_head(thread_id="\ud800", checkpoint_id="c1", writer=w), INVALID_ID)
    await refused(cps.delete_head(thread_id="t", checkpoint_id="missing", writer=other), WRITER_LOST)
    stale = threadlog.Writer("t", w.owner_token, w.fence + 1)
    await refused(cps.delete_head(thread_id="t", checkpoint_id="missing", writer=stale), WRITER_LOST)
    assert await thread_state(tl, "t") == before


# -- leases --------------------------------------------------------------------------------------
async def test_a_second_acquire_conflicts_while_the_lease_is_unexpired(tl):
    cps = tl.checkpoints
    first = await within(cps.acquire_writer("t"))
    assert first.fence == 1 and isinstance(first.owner_token, str) and first.owner_token
    err = await refused(cps.acquire_writer("t"), WRITER_CONFLICT)
    assert "t" in err.message
    other = await within(cps.acquire_writer("u"))  # fences are per thread
    assert other.fence == 1 and other.owner_token != first.owner_token


async def test_release_then_reacquire_gets_the_next_fence_and_the_old_lease_is_lost(tl):
    cps = tl.checkpoints
    old = await within(cps.acquire_writer("t"))
    await append(tl, checkpoint("c1", "t"), None, old)
    await within(old.release())
    await refused(cps.append(checkpoint=checkpoint("c2", "t", "c1"), expected_head_id="c1", writer=old), WRITER_LOST)
    await refused(old.renew(), WRITER_LOST)
    new = await within(cps.acquire_writer("t"))
    assert new.fence == old.fence + 1 and new.owner_token != old.owner_token
    # Releasing a stale lease is silent and does not end the current one.
    await within(old.release())
    await refused(cps.acquire_writer("t"), WRITER_CONFLICT)
    assert await append(tl, checkpoint("c2", "t", "c1"), "c1", new) == "c2"
    await within(new.release())
    third = await within(cps.acquire_writer("t"))
    assert third.fence == 3


async def test_writer_of_another_thread_is_lost_and_checked_before_the_checkpoint(tl):
    cps = tl.checkpoints
    wt = await within(cps.acquire_writer("t"))
    wu = await within(cps.acquire_writer("u"))
    await append(tl, checkpoint("c1", "t"), None, wt)
    before = await thread_state(tl, "t")
    await refused(cps.append(checkpoint=checkpoint("c2", "t", "c1"), expected_head_id="c1", writer=wu), WRITER_LOST)
    # Writer thread is checked before the checkpoint's own validity...
    bad = checkpoint("c2", "t", "c1", reason="nonsense")
    await refused(cps.append(checkpoint=bad, expected_head_id="c1", writer=wu), WRITER_LOST)
    # ...and the ids before the writer thread.
    await refused(cps.append(checkpoint=checkpoint("", "t"), expected_head_id="c1", writer=wu), INVALID_ID)
    assert await thread_state(tl, "t") == before


async def test_append_checks_run_in_the_spec_order(tl):
    cps = tl.checkpoints
    w = await within(cps.acquire_writer("t"))
    await append(tl, checkpoint("c1", "t"), None, w)
    lost = threadlog.Writer("t", "not-the-token", w.fence)
    cases = [
        # (checkpoint, expected head, writer, code): each input also fails every later check.
        (checkpoint("c2", "t", "\ud800"), "c1", lost, INVALID_ID),
        (checkpoint("c2", "t", "c1"), "", lost, INVALID_ID),
        (checkpoint("c2", "t", "nope", reason="bad"), "zz", lost, INVALID_ENTRY),
        (checkpoint("c1", "t", "nope"), "zz", lost, WRITER_LOST),
        (checkpoint("c1", "t", "nope"), "zz", w, DUPLICATE_ID),
        (checkpoint("c2", "t", "nope"), "zz", w, STALE_HEAD),
        (checkpoint("c2", "t", "nope"), "c1", w, PARENT_MISMATCH),
    ]
    before = await thread_state(tl, "t")
    for cp, expected, writer, code in cases:
        await refused(cps.append(checkpoint=cp, expected_head_id=expected, writer=writer), code)
    assert await thread_state(tl, "t") == before


async def test_the_judge_rechecks_in_the_same_order_when_the_client_is_bypassed(tl):
    """A command on the topic may come from anyone: forged appends that skip the
    client's validation are refused by the handler with the same codes."""
    from threadlog.kernel.checkpoint_rules import to_wire
    from threadlog.kernel.validation import dumps

    w = await within(tl.checkpoints.acquire_writer("t"))
    other = await within(tl.checkpoints.acquire_writer("u"))
    await append(tl, checkpoint("c1", "t"), None, w)
    before = await thread_state(tl, "t")

    def writer(lease, **over):
        return {"threadId": lease.thread_id, "ownerToken": lease.owner_token, "fence": lease.fence, **over}

    def wire(cp):
        rec = to_wire({**cp, "conversation": []})
        text = cp["conversation"]
        rec["conversation"] = text if isinstance(text, str) else dumps(text)
        return rec

    cases = [
        (checkpoint("", "t", "c1"), "c1", writer(w), INVALID_ID),
        (checkpoint("", "t", "c1", conversation="{not json"), "c1", writer(w), INVALID_ID),
        (checkpoint("c2", "t", "c1"), "c1", writer(other), WRITER_LOST),
        (checkpoint("c2", "t", "c1", reason="bad"), "c1", writer(other), WRITER_LOST),
        (checkpoint("c2", "t", "c1", reason="bad"), "c1", writer(w, ownerToken="x"), INVALID_ENTRY),
        (checkpoint("c2", "t", "c1", files=[{"path": "../x", "kind": "dir"}]), "c1", writer(w), INVALID_ENTRY),
        (checkpoint("c2", "t", "c1", createdAt=float("nan")), "c1", writer(w), INVALID_ENTRY),
        (checkpoint("c2", "t", "c1", conversation="{not json"), "c1", writer(w), INVALID_ENTRY),
        (checkpoint("c2", "t", "c1", conversation='{"an": "object"}'), "c1", writer(w), INVALID_ENTRY),
        (checkpoint("c2", "t", "c1"), "c1", writer(w, ownerToken=None), WRITER_LOST),
        (checkpoint("c2", "t", "c1"), "c1", writer(w, fence=None), WRITER_LOST),
        (checkpoint("c1", "t", "c1"), "zz", writer(w), DUPLICATE_ID),
        (checkpoint("c2", "t", "c1"), "zz", writer(w), STALE_HEAD),
        (checkpoint("c2", "t", "zz"), "c1", writer(w), PARENT_MISMATCH),
    ]
    for cp, expected, wr, code in cases:
        payload = {"checkpoint": wire(cp), "expectedHeadId": expected, "writer": wr}
        await refused(tl.bus.send("threadlog.cmd.AppendCheckpoint", "t", payload), code)
    assert await thread_state(tl, "t") == before
    assert tl.runtime.judge.alive
    await within(tl.messages.save_thread("after", [1]))  # the judge keeps judging


async def test_writer_values_are_any_object_with_the_three_attributes(tl):
    cps = tl.checkpoints
    lease = await within(cps.acquire_writer("t"))
    value = threadlog.Writer(lease.thread_id, lease.owner_token, lease.fence)
    assert await append(tl, checkpoint("c1", "t"), None, value) == "c1"
    duck = types.SimpleNamespace(thread_id="t", owner_token=lease.owner_token, fence=lease.fence)
    assert await append(tl, checkpoint("c2", "t", "c1"), "c1", duck) == "c2"
    before = await thread_state(tl, "t")
    nxt = checkpoint("c3", "t", "c2")
    for bad, code in [
        (types.SimpleNamespace(thread_id="", owner_token=lease.owner_token, fence=lease.fence), INVALID_ID),
        (types.SimpleNamespace(thread_id=7, owner_token=lease.owner_token, fence=lease.fence), INVALID_ID),
        (types.SimpleNamespace(owner_token=lease.owner_token, fence=lease.fence), INVALID_ID),
        (None, INVALID_ID),
        ({"thread_id": "t", "owner_token": lease.owner_token, "fence": lease.fence}, INVALID_ID),
        (threadlog.Writer("t", 12345, lease.fence), WRITER_LOST),
        (threadlog.Writer("t", "\ud800", lease.fence), WRITER_LOST),
        (threadlog.Writer("t", lease.owner_token, str(lease.fence)), WRITER_LOST),
        (threadlog.Writer("t", lease.owner_token, True), WRITER_LOST),
        (threadlog.Writer("t", lease.owner_token, float(lease.fence)), WRITER_LOST),
        (threadlog.Writer("t", lease.owner_token, 2**70), WRITER_LOST),
        (threadlog.Writer("t", lease.owner_token, lease.fence - 1), WRITER_LOST),
    ]:
        await refused(cps.append(checkpoint=nxt, expected_head_id="c2", writer=bad), code)
    assert await thread_state(tl, "t") == before


async def test_expiry_is_decided_by_the_injected_clock(open_client):
    clock = MutableClock()
    tl = await open_client(clock=clock, lease_duration_ms=10_000, renew_after_ms=4_000)
    cps = tl.checkpoints
    lease = await within(cps.acquire_writer("t", auto_renew=False))  # renewed by hand below
    assert lease.expires_at == clock.now + 10_000
    assert lease.renew_after_ms == 4_000
    clock.advance(9_999)  # one ms before expiry: still current
    await append(tl, checkpoint("c1", "t"), None, lease)
    await refused(cps.acquire_writer("t"), WRITER_CONFLICT)
    renewed_at = clock.now
    assert await within(lease.renew()) == renewed_at + 10_000
    assert lease.expires_at == renewed_at + 10_000
    clock.advance(10_000)  # now == expires_at: expired
    await refused(cps.append(checkpoint=checkpoint("c2", "t", "c1"), expected_head_id="c1", writer=lease),
                  WRITER_LOST)
    await refused(lease.renew(), WRITER_LOST)
    await refused(cps.delete_head(thread_id="t", checkpoint_id="c1", writer=lease), WRITER_LOST)
    successor = await within(cps.acquire_writer("t"))
    assert successor.fence == 2 and successor.expires_at == clock.now + 10_000
    # The expired holder's writes stay lost, and its release is silent and harmless.
    await within(lease.release())
    await refused(cps.append(checkpoint=checkpoint("c2", "t", "c1"), expected_head_id="c1", writer=lease),
                  WRITER_LOST)
    assert await append(tl, checkpoint("c2", "t", "c1"), "c1", successor) == "c2"
    # Expired again without release: the fence still only grows.
    clock.advance(10_000)
    assert (await within(cps.acquire_writer("t"))).fence == 3


async def test_leases_and_fences_survive_a_new_host(open_client, tmp_path):
    first = await open_client(state_dir=str(tmp_path / "host-1"))
    lease = await within(first.checkpoints.acquire_writer("t"))
    await append(first, checkpoint("c1", "t"), None, lease)
    await first.close()
    # A host with an empty store folds the log before deciding: the lease is
    # still held (a writer is a value, not a connection) and still writes.
    second = await open_client(state_dir=str(tmp_path / "host-2"))
    await refused(second.checkpoints.acquire_writer("t"), WRITER_CONFLICT)
    value = threadlog.Writer("t", lease.owner_token, lease.fence)
    assert await append(second, checkpoint("c2", "t", "c1"), "c1", value) == "c2"
    await second.close()
    # A third host whose clock is past the lease's end decides it expired, from
    # the expiry recorded in the log; the fence continues from the log too.
    third = await open_client(state_dir=str(tmp_path / "host-3"),
                              clock=MutableClock(lease.expires_at))
    successor = await within(third.checkpoints.acquire_writer("t"))
    assert successor.fence == lease.fence + 1
    await refused(third.checkpoints.append(checkpoint=checkpoint("c3", "t", "c2"), expected_head_id="c2",
                                           writer=value), WRITER_LOST)
    assert [c["id"] for c in await within(third.checkpoints.list("t"))] == ["c1", "c2"]


# -- blob references -------------------------------------------------------------------------------
async def test_blob_references_follow_append_fork_and_delete(tl):
    cps = tl.checkpoints
    w = await within(cps.acquire_writer("t"))
    files = [
        {"path": "a", "kind": "file", "blobKey": file_key("a"), "size": 1},
        {"path": "b", "kind": "file", "blobKey": file_key("a"), "size": 1},  # same blob twice: counts once
        {"path": "c", "kind": "file", "blobKey": file_key("c"), "size": 2},
    ]
    arts = [artifact("x", "b"), artifact("y", "b")]
    await append(tl, checkpoint("c1", "t", files=files, artifacts=arts), None, w)
    await append(tl, checkpoint("c2", "t", "c1", files=files[:1], artifacts=[]), "c1", w)
    assert await within(cps.list_blob_references()) == [
        {"key": artifact_key("b"), "references": 1},
        {"key": file_key("a"), "references": 2},
        {"key": file_key("c"), "references": 1},
    ]
    dw = await within(cps.acquire_writer("d"))
    await within(cps.fork_from_checkpoint(source_thread_id="t", source_checkpoint_id="c1", destination_thread_id="d",
                                          destination_checkpoint_id="f1", created_at=30, writer=dw))
    assert await within(cps.list_blob_references()) == [
        {"key": artifact_key("b"), "references": 2},
        {"key": file_key("a"), "references": 3},
        {"key": file_key("c"), "references": 2},
    ]
    await within(cps.delete_head(thread_id="t", checkpoint_id="c2", writer=w))
    await within(cps.delete_head(thread_id="t", checkpoint_id="c1", writer=w))
    assert await within(cps.list_blob_references()) == [
        {"key": artifact_key("b"), "references": 1},
        {"key": file_key("a"), "references": 1},
        {"key": file_key("c"), "references": 1},
    ]
    await within(cps.delete_head(thread_id="d", checkpoint_id="f1", writer=dw))
    assert await within(cps.list_blob_references()) == []  # zero counts are absent


# -- fork across deciders -------------------------------------------------------------------------
async def test_fork_between_partitions_of_two_processes(open_client):
    a = await open_client()
    b = await open_client()
    src, dst = await threads_owned_by([a, b])
    third = next(t for t in threads_on_distinct_partitions(a, 4) if partition_for(t, a.runtime.layout.events) not in
                 {partition_for(src, a.runtime.layout.events), partition_for(dst, a.runtime.layout.events)})
    ws = await within(a.checkpoints.acquire_writer(src))
    await append(a, checkpoint("s1", src, files=[], conversation=["hello"]), None, ws)
    w3 = await within(a.checkpoints.acquire_writer(third))
    await append(a, checkpoint("taken", third), None, w3)
    wd = await within(b.checkpoints.acquire_writer(dst))
    # The destination id exists on another partition: refused at the destination
    # step, also while the destination's process has not folded it yet.
    async with LaggingFollower(b, 1.5):
        await append(a, checkpoint("taken-late", src, "s1"), "s1", ws)
        await refused(b.checkpoints.fork_from_checkpoint(
            source_thread_id=src, source_checkpoint_id="s1", destination_thread_id=dst,
            destination_checkpoint_id="taken-late", created_at=1, writer=wd),
            "SANDBOX_SNAPSHOT_FORK_DESTINATION_NOT_EMPTY")
    before = await thread_state(b, dst)
    assert before["head"] is None and before["transcript"] == []
    await refused(b.checkpoints.fork_from_checkpoint(
        source_thread_id=src, source_checkpoint_id="s1", destination_thread_id=dst,
        destination_checkpoint_id="taken", created_at=1, writer=wd), "SANDBOX_SNAPSHOT_FORK_DESTINATION_NOT_EMPTY")
    # The source checkpoint lives on another partition's thread: a mismatch, not "not found".
    await refused(b.checkpoints.fork_from_checkpoint(
        source_thread_id=src, source_checkpoint_id="taken", destination_thread_id=dst,
        destination_checkpoint_id="root", created_at=1, writer=wd), "SANDBOX_SNAPSHOT_FORK_SOURCE_THREAD_MISMATCH")
    assert await thread_state(b, dst) == before
    root = await within(b.checkpoints.fork_from_checkpoint(
        source_thread_id=src, source_checkpoint_id="s1", destination_thread_id=dst,
        destination_checkpoint_id="root", created_at=2.5, writer=wd))
    assert root["threadId"] == dst and root["createdAt"] == 2.5 and root["conversation"] == ["hello"]
    for client in (a, b):
        assert await within(client.checkpoints.get_head(dst)) == "root"
        assert await within(client.messages.load_thread(dst)) == ["hello"]
        assert await within(client.checkpoints.get("root")) == root
    # A second fork into the now non-empty destination is refused.
    await refused(b.checkpoints.fork_from_checkpoint(
        source_thread_id=src, source_checkpoint_id="s1", destination_thread_id=dst,
        destination_checkpoint_id="root-2", created_at=3, writer=wd), "SANDBOX_SNAPSHOT_FORK_DESTINATION_NOT_EMPTY")


async def test_fork_destination_with_an_empty_transcript_or_a_checkpoint_is_not_empty(tl):
    cps = tl.checkpoints
    ws = await within(cps.acquire_writer("src"))
    await append(tl, checkpoint("s1", "src"), None, ws)
    await within(tl.messages.save_thread("d-empty-transcript", []))
    wd = await within(cps.acquire_writer("d-empty-transcript"))
    await refused(cps.fork_from_checkpoint(source_thread_id="src", source_checkpoint_id="s1",
                                           destination_thread_id="d-empty-transcript",
                                           destination_checkpoint_id="r", created_at=1, writer=wd),
                  "SANDBOX_SNAPSHOT_FORK_DESTINATION_NOT_EMPTY")
    wc = await within(cps.acquire_writer("d-with-checkpoint"))
    await append(tl, checkpoint("d1", "d-with-checkpoint"), None, wc)
    await refused(cps.fork_from_checkpoint(source_thread_id="src", source_checkpoint_id="s1",
                                           destination_thread_id="d-with-checkpoint",
                                           destination_checkpoint_id="r", created_at=1, writer=wc),
                  "SANDBOX_SNAPSHOT_FORK_DESTINATION_NOT_EMPTY")
    # Deleting its only checkpoint empties the thread again: the fork goes through.
    await within(cps.delete_head(thread_id="d-with-checkpoint", checkpoint_id="d1", writer=wc))
    root = await within(cps.fork_from_checkpoint(source_thread_id="src", source_checkpoint_id="s1",
                                                 destination_thread_id="d-with-checkpoint",
                                                 destination_checkpoint_id="r", created_at=1, writer=wc))
    assert root["id"] == "r"


async def test_fork_checks_ids_then_created_at_then_threads(tl):
    cps = tl.checkpoints
    w = await within(cps.acquire_writer("d"))
    base = {"source_thread_id": "s", "source_checkpoint_id": "x", "destination_thread_id": "d",
            "destination_checkpoint_id": "r", "created_at": 1, "writer": w}
    for over, code in [
        ({"source_thread_id": "", "created_at": float("inf")}, INVALID_ID),
        ({"source_checkpoint_id": None}, INVALID_ID),
        ({"destination_thread_id": 3}, INVALID_ID),
        ({"destination_checkpoint_id": "\udfff", "destination_thread_id": "s"}, INVALID_ID),
        ({"writer": threadlog.Writer("", "t", 1)}, INVALID_ID),
        ({"created_at": float("nan"), "destination_thread_id": "s"}, INVALID_ENTRY),
        ({"created_at": True}, INVALID_ENTRY),
        ({"created_at": "1"}, INVALID_ENTRY),
        ({"destination_thread_id": "s"}, "SANDBOX_SNAPSHOT_FORK_SOURCE_THREAD_MISMATCH"),
        ({}, "SANDBOX_SNAPSHOT_FORK_SOURCE_NOT_FOUND"),
        ({"writer": threadlog.Writer("d", 5, "x")}, "SANDBOX_SNAPSHOT_FORK_SOURCE_NOT_FOUND"),
    ]:
        await refused(cps.fork_from_checkpoint(**{**base, **over}), code)
    ws = await within(cps.acquire_writer("s"))
    await append(tl, checkpoint("x", "s"), None, ws)
    # Source found: now the writer is checked, thread first, then currency (ill-typed fields included).
    await refused(cps.fork_from_checkpoint(**{**base, "writer": ws}), WRITER_LOST)
    await refused(cps.fork_from_checkpoint(**{**base, "writer": threadlog.Writer("d", 5, "x")}), WRITER_LOST)
    assert await thread_state(tl, "d") == {"head": None, "checkpoints": [], "transcript": [],
                                           "references": [{"key": file_key("a"), "references": 1}]}


# -- ids ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["", "\ud800", "a\udc00", None, 5, b"bytes", ["x"]])
async def test_invalid_ids_are_refused_by_every_method(tl, bad):
    cps = tl.checkpoints
    w = await within(cps.acquire_writer("t"))
    await append(tl, checkpoint("c1", "t"), None, w)
    before = await thread_state(tl, "t")
    await refused(cps.acquire_writer(bad), INVALID_ID)
    await refused(cps.get(bad), INVALID_ID)
    await refused(cps.list(bad), INVALID_ID)
    await refused(cps.get_head(bad), INVALID_ID)
    await refused(cps.delete_head(thread_id=bad, checkpoint_id="c1", writer=w), INVALID_ID)
    await refused(cps.delete_head(thread_id="t", checkpoint_id=bad, writer=w), INVALID_ID)
    for field in ("id", "threadId", "parentCheckpointId"):
        if field == "parentCheckpointId" and bad is None:
            continue  # None is "no parent"
        cp = checkpoint("c2", "t", "c1", **{field: bad})
        await refused(cps.append(checkpoint=cp, expected_head_id="c1", writer=w), INVALID_ID)
    if bad is not None:
        await refused(cps.append(checkpoint=checkpoint("c2", "t", "c1"), expected_head_id=bad, writer=w), INVALID_ID)
    for name in ("source_thread_id", "source_checkpoint_id", "destination_thread_id", "destination_checkpoint_id"):
        args = {"source_thread_id": "t", "source_checkpoint_id": "c1", "destination_thread_id": "d",
                "destination_checkpoint_id": "r", "created_at": 1, "writer": w, name: bad}
        await refused(cps.fork_from_checkpoint(**args), INVALID_ID)
    assert await thread_state(tl, "t") == before


# -- rebuild --------------------------------------------------------------------------------------
async def test_rebuild_from_offset_zero_gives_the_same_checkpoint_reads(open_client, tmp_path, bootstrap, namespace):
    from threadlog.processors.rebuild import rebuild

    state = tmp_path / "host"
    tl = await open_client(state_dir=str(state))
    cps = tl.checkpoints
    w = await within(cps.acquire_writer("t"))
    head = None
    for n in range(6):
        head = await append(tl, checkpoint(f"c{n}", "t", head, created_at=n % 3,
                                           artifacts=[artifact(f"a{n}", "bcd"[n % 3])]), head, w)
    await within(cps.delete_head(thread_id="t", checkpoint_id="c5", writer=w))
    dw = await within(cps.acquire_writer("d"))
    await within(cps.fork_from_checkpoint(source_thread_id="t", source_checkpoint_id="c2", destination_thread_id="d",
                                          destination_checkpoint_id="root", created_at=9, writer=dw))
    await within(w.release())

    async def reads(client) -> dict:
        return {"t": await thread_state(client, "t"), "d": await thread_state(client, "d"),
                "root": await within(client.checkpoints.get("root")),
                "c5": await within(client.checkpoints.get("c5"))}

    before = await reads(tl)
    assert before["c5"] is None and before["d"]["head"] == "root" and before["t"]["head"] == "c4"
    store_path = tl.runtime.store.path
    await tl.close()
    stats = await asyncio.to_thread(rebuild, bootstrap, namespace, store_path, lambda _line: None)
    assert stats["skipped"] == 0
    reopened = await open_client(state_dir=str(state))
    assert await reads(reopened) == before
    # Decider state was rebuilt too: the released lease is free, fences continue.
    assert (await within(reopened.checkpoints.acquire_writer("t"))).fence == 2
    await refused(reopened.checkpoints.acquire_writer("d"), WRITER_CONFLICT)
