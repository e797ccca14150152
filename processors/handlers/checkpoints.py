"""Checkpoints: writer leases, head compare-and-set appends, delete-head, fork (SPEC section 4).

Every check is re-done here on what arrived (the client validated it too, but
a command on the topic may come from anyone), in the SPEC's order, so the
first failing rule names the code. Time is `ctx.now`, the judged time of the
proposal; randomness (owner tokens) is drawn by the proposer and carried in
the proposal. So every judge -- and a rebuild -- reaches the same verdict.

Fork is a two-step saga (DESIGN "Cross-thread operations"): `ForkCheckpoint`
is judged on the source thread's partition, which checks the source; once it
is accepted the proposer sends the copy it answers with to the destination
thread's partition as `ForkCheckpointInto`; that step checks the writer and
emptiness and its one effect creates root, transcript and references
together. Only the last step changes state, so a refusal at either step
changes nothing anywhere. Step 2 stands on its own rules (a current writer of
the destination, an empty destination), so a forged step 2 can do no more
than an append by that writer could.
"""

from __future__ import annotations

from threadlog.projections import global_ids as gid
from threadlog.projections.folds import checkpoints as state
from threadlog.projections.folds import presence

from threadlog.kernel.checkpoint_rules import (
    MAX_LEASE_MS,
    blob_keys,
    check_checkpoint_body,
    check_checkpoint_ids,
    from_wire,
    invalid_entry,
    is_timestamp,
    require_id,
    require_optional_id,
    to_wire,
    writer_lost,
)
from threadlog.kernel.errors import (
    DUPLICATE_ID,
    FORK_DESTINATION_NOT_EMPTY,
    FORK_SOURCE_NOT_FOUND,
    FORK_SOURCE_THREAD_MISMATCH,
    NOT_HEAD,
    PARENT_MISMATCH,
    STALE_HEAD,
    WRITER_CONFLICT,
    ThreadLogError,
    invalid_argument,
)

from . import Context, Decision, FollowUp, handles
from .blob_gc import require_unfenced
from .global_ids import own_thread


# -- leases ----------------------------------------------------------------------------
def _is_current(ctx: Context, thread_id: str, writer: dict) -> bool:
    """The writer names the thread's latest grant, and it has not expired at the judged time."""
    lease = state.get_lease(ctx.view, thread_id)
    return (
        lease is not None
        and writer["ownerToken"] is not None
        and writer["fence"] is not None
        and lease["ownerToken"] == writer["ownerToken"]
        and lease["fence"] == writer["fence"]
        and ctx.now < lease["expiresAt"]
    )


def _require_writer_thread(writer: dict, thread_id: str, what: str) -> None:
    require_id(writer["threadId"], "writer thread_id")
    if writer["threadId"] != thread_id:
        raise writer_lost(f"the writer is for thread {writer['threadId']!r}, not the {what} {thread_id!r}")


def _require_current(ctx: Context, thread_id: str, writer: dict) -> None:
    if not _is_current(ctx, thread_id, writer):
        raise writer_lost(f"the writer (fence {writer['fence']}) is not the current, unexpired lease "
                          f"of thread {thread_id!r}")


DEFAULT_LEASE_MS = 120_000
DEFAULT_RENEW_AFTER_MS = 45_000


def _lease_length(cmd: dict) -> tuple[int, int]:
    """The lease length is the proposer's setting (`open(lease_duration_ms=)`),
    carried in the proposal: a judge has no settings of its own to disagree on."""
    duration = cmd.get("leaseDurationMs")
    duration = DEFAULT_LEASE_MS if duration is None else duration
    renew_after = cmd.get("renewAfterMs")
    renew_after = min(DEFAULT_RENEW_AFTER_MS, duration - 1) if renew_after is None else renew_after
    if not 1 <= duration <= MAX_LEASE_MS or not 0 <= renew_after < duration:
        raise invalid_argument(f"lease length {duration} ms / renew after {renew_after} ms out of range")
    return duration, renew_after


@handles("threadlog.cmd.AcquireCheckpointWriter")
def acquire_writer(ctx: Context, cmd: dict) -> Decision:
    thread = own_thread(ctx, require_id(cmd["threadId"], "thread_id"))
    steal = cmd.get("steal")
    if steal is not None and not isinstance(steal, bool):
        raise invalid_argument(f"steal must be a boolean, got {steal!r}")
    lease = state.get_lease(ctx.view, thread)
    held = lease is not None and ctx.now < lease["expiresAt"]
    if lease is not None and held and not steal:
        raise ThreadLogError(WRITER_CONFLICT, f"thread {thread!r} already has an unexpired writer lease "
                                              f"(fence {lease['fence']})")
    token = cmd.get("ownerToken")
    if not isinstance(token, str) or len(token) < 16:
        raise invalid_argument("a writer grant needs an ownerToken drawn by the proposer (>= 16 chars)")
    duration, renew_after = _lease_length(cmd)
    # Fences only grow: the counter outlives releases and expiries.
    fence = state.get_fence(ctx.view, thread) + 1
    expires_at = ctx.now + duration
    # A steal replaces the unexpired lease: the new grant's fence is above the
    # old holder's, so its writes and renewals stop being current.
    ev = {"threadId": thread, "ownerToken": token, "fence": fence, "expiresAt": expires_at,
          "leaseDurationMs": duration, "renewAfterMs": renew_after,
          "stolenFence": lease["fence"] if held and lease is not None else None}
    result = {"threadId": thread, "ownerToken": token, "fence": fence, "expiresAt": expires_at,
              "renewAfterMs": renew_after}
    return Decision(events=[("threadlog.evt.CheckpointWriterAcquired", ev)], result=result)


@handles("threadlog.cmd.RenewCheckpointWriter")
def renew_writer(ctx: Context, cmd: dict) -> Decision:
    writer = cmd["writer"]
    thread = own_thread(ctx, require_id(writer["threadId"], "writer thread_id"))
    _require_current(ctx, thread, writer)
    duration, _ = _lease_length({"leaseDurationMs": cmd.get("leaseDurationMs"), "renewAfterMs": 0})
    expires_at = ctx.now + duration
    ev = {"threadId": thread, "ownerToken": writer["ownerToken"], "fence": writer["fence"],
          "expiresAt": expires_at, "leaseDurationMs": duration}
    return Decision(events=[("threadlog.evt.CheckpointWriterRenewed", ev)], result={"expiresAt": expires_at})


@handles("threadlog.cmd.ReleaseCheckpointWriter")
def release_writer(ctx: Context, cmd: dict) -> Decision:
    writer = cmd["writer"]
    thread = own_thread(ctx, require_id(writer["threadId"], "writer thread_id"))
    if not _is_current(ctx, thread, writer):
        return Decision(result={"released": False})  # a stale lease: nothing to end, not an error
    ev = {"threadId": thread, "ownerToken": writer["ownerToken"], "fence": writer["fence"]}
    return Decision(events=[("threadlog.evt.CheckpointWriterReleased", ev)], result={"released": True})


# -- append / delete-head --------------------------------------------------------------
def _id_taken(ctx: Context, checkpoint_id: str) -> bool:
    """Is there a checkpoint with this id on any thread (as of the positions the
    proposal names, for threads of other partitions)?"""
    return bool(ctx.holders(gid.CHECKPOINT, checkpoint_id))


@handles("threadlog.cmd.AppendCheckpoint", global_ids=True)
def append(ctx: Context, cmd: dict) -> Decision:
    writer = cmd["writer"]
    expected = cmd["expectedHeadId"]
    cp = from_wire(cmd["checkpoint"])
    # 1. ids
    check_checkpoint_ids(cp)
    require_id(writer["threadId"], "writer thread_id")
    require_optional_id(expected, "expected_head_id")
    thread = own_thread(ctx, cp["threadId"])
    # 2. writer thread
    _require_writer_thread(writer, thread, "checkpoint's thread")
    # 3. the checkpoint itself
    check_checkpoint_body(cp)
    # 4. writer current
    _require_current(ctx, thread, writer)
    # 5. id unused on any thread
    if _id_taken(ctx, cp["id"]):
        raise ThreadLogError(DUPLICATE_ID, f"a checkpoint with id {cp['id']!r} already exists")
    # 6. head compare-and-set
    head = state.get_head(ctx.view, thread)
    if head != expected:
        raise ThreadLogError(STALE_HEAD, f"expected head {expected!r}, but thread {thread!r} is at {head!r}")
    # 7. parent
    if cp["parentCheckpointId"] != expected:
        raise ThreadLogError(PARENT_MISMATCH, f"checkpoint {cp['id']!r} has parent {cp['parentCheckpointId']!r}, "
                                              f"not the expected head {expected!r}")
    # 8. no blob it names is being garbage-collected here (blob_gc.py)
    require_unfenced(ctx, blob_keys(cp), thread)
    # The record as it arrived is what was validated; it travels on unchanged.
    ev = {"checkpoint": cmd["checkpoint"], "fence": writer["fence"]}
    return Decision(events=[("threadlog.evt.CheckpointAppended", ev)], result=cp["id"])


@handles("threadlog.cmd.DeleteCheckpointHead")
def delete_head(ctx: Context, cmd: dict) -> Decision:
    writer = cmd["writer"]
    thread = own_thread(ctx, require_id(cmd["threadId"], "thread_id"))
    cid = require_id(cmd["checkpointId"], "checkpoint_id")
    require_id(writer["threadId"], "writer thread_id")
    _require_writer_thread(writer, thread, "thread")
    _require_current(ctx, thread, writer)
    head = state.get_head(ctx.view, thread)
    if head != cid or state.get_record(ctx.view, thread, cid) is None:
        raise ThreadLogError(NOT_HEAD, f"checkpoint {cid!r} is not the head of thread {thread!r} "
                                       f"(head: {head!r})")
    ev = {"threadId": thread, "checkpointId": cid, "fence": writer["fence"]}
    return Decision(events=[("threadlog.evt.CheckpointHeadDeleted", ev)])


# -- fork ----------------------------------------------------------------------------------
def _fork_ids(cmd: dict) -> None:
    require_id(cmd["sourceThreadId"], "source_thread_id")
    require_id(cmd["sourceCheckpointId"], "source_checkpoint_id")
    require_id(cmd["destinationThreadId"], "destination_thread_id")
    require_id(cmd["destinationCheckpointId"], "destination_checkpoint_id")
    require_id(cmd["writer"]["threadId"], "writer thread_id")
    if not is_timestamp(cmd["createdAt"]):
        raise invalid_entry(f"created_at must be a finite number, got {cmd['createdAt']!r}")


@handles("threadlog.cmd.ForkCheckpoint", global_ids=True)
def fork_source_step(ctx: Context, cmd: dict) -> Decision:
    """Step 1, on the source thread's partition: the source checkpoint exists there."""
    _fork_ids(cmd)
    source_thread, source_id = own_thread(ctx, cmd["sourceThreadId"]), cmd["sourceCheckpointId"]
    destination = cmd["destinationThreadId"]
    if source_thread == destination:
        raise ThreadLogError(FORK_SOURCE_THREAD_MISMATCH,
                             f"source and destination are the same thread {source_thread!r}")
    source = state.get_record(ctx.view, source_thread, source_id)
    if source is None:
        # Not on the source thread. Elsewhere (another partition: sync first)?
        if not _id_taken(ctx, source_id):
            raise ThreadLogError(FORK_SOURCE_NOT_FOUND, f"no checkpoint {source_id!r} exists")
        raise ThreadLogError(FORK_SOURCE_THREAD_MISMATCH,
                             f"checkpoint {source_id!r} is not on the source thread {source_thread!r}")
    _require_writer_thread(cmd["writer"], destination, "destination thread")
    follow = {
        "source": to_wire(source),
        "destinationThreadId": destination,
        "destinationCheckpointId": cmd["destinationCheckpointId"],
        "createdAt": cmd["createdAt"],
        "writer": cmd["writer"],
    }
    # No answer here: the destination step answers the client.
    return Decision(reply=False, follow_ups=[FollowUp(destination, "threadlog.cmd.ForkCheckpointInto", follow)])


@handles("threadlog.cmd.ForkCheckpointInto", global_ids=True)
def fork_destination_step(ctx: Context, cmd: dict) -> Decision:
    """Step 2, on the destination thread's partition: writer, emptiness, then the fork root."""
    source = from_wire(cmd["source"])
    check_checkpoint_ids(source)
    require_id(cmd["destinationCheckpointId"], "destination_checkpoint_id")
    destination = own_thread(ctx, require_id(cmd["destinationThreadId"], "destination_thread_id"))
    writer = cmd["writer"]
    _require_writer_thread(writer, destination, "destination thread")
    if not is_timestamp(cmd["createdAt"]):
        raise invalid_entry(f"created_at must be a finite number, got {cmd['createdAt']!r}")
    _require_current(ctx, destination, writer)
    present = presence.kinds_present(ctx.view, destination)
    if present or state.get_head(ctx.view, destination) is not None:
        raise ThreadLogError(FORK_DESTINATION_NOT_EMPTY,
                             f"destination thread {destination!r} is not empty (has: {', '.join(present) or 'a head'})")
    if _id_taken(ctx, cmd["destinationCheckpointId"]):
        raise ThreadLogError(FORK_DESTINATION_NOT_EMPTY,
                             f"a checkpoint with the destination id {cmd['destinationCheckpointId']!r} already exists")
    root = {
        "id": cmd["destinationCheckpointId"],
        "threadId": destination,
        "parentCheckpointId": None,
        "createdAt": cmd["createdAt"],
        "reason": "fork-root",
        "files": source["files"],
        "conversation": source["conversation"],
        "artifacts": source["artifacts"],
    }
    check_checkpoint_body(root)  # the copy is re-validated: step 2 may be forged
    require_unfenced(ctx, blob_keys(root), destination)
    ev = {"checkpoint": to_wire(root), "sourceThreadId": source["threadId"],
          "sourceCheckpointId": source["id"], "fence": writer["fence"]}
    return Decision(events=[("threadlog.evt.CheckpointForked", ev)], result=root)
