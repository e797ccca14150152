"""Checkpoints: writer leases, head compare-and-set appends, delete-head, fork (SPEC section 4).

Every check is re-done here on what arrived (the client validated it too, but
a command on the topic may come from anyone), in the SPEC's order, so the
first failing rule names the code. Time is `ctx.now`, the decider's clock at
decision time; randomness (owner tokens) is drawn here. Both are carried in
the events, so the folds -- and a rebuild -- never read a clock.

Fork is a two-step saga (DESIGN "Cross-thread operations"): `ForkCheckpoint`
is decided on the source thread's partition, which checks the source and
forwards a copy of it to the destination thread's partition as
`ForkCheckpointInto`; that step checks the writer and emptiness and writes the
one event that creates root, transcript and references together. Only the
last step writes, so a refusal at either step changes nothing anywhere.
"""

from __future__ import annotations

import uuid

from threadlog.projections.folds import checkpoints as state
from threadlog.projections.folds import presence

from threadlog.checkpoint_rules import (
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
from threadlog.errors import (
    DUPLICATE_ID,
    FORK_DESTINATION_NOT_EMPTY,
    FORK_SOURCE_NOT_FOUND,
    FORK_SOURCE_THREAD_MISMATCH,
    NOT_HEAD,
    PARENT_MISMATCH,
    STALE_HEAD,
    WRITER_CONFLICT,
    ThreadLogError,
)

from . import Context, Decision, FollowUp, handles


# -- leases ----------------------------------------------------------------------------
def _is_current(ctx: Context, thread_id: str, writer: dict) -> bool:
    """The writer names the thread's latest grant, and it has not expired by the decider's clock."""
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


@handles("threadlog.cmd.AcquireCheckpointWriter")
def acquire_writer(ctx: Context, cmd: dict) -> Decision:
    thread = require_id(cmd["threadId"], "thread_id")
    lease = state.get_lease(ctx.view, thread)
    if lease is not None and ctx.now < lease["expiresAt"]:
        raise ThreadLogError(WRITER_CONFLICT, f"thread {thread!r} already has an unexpired writer lease "
                                              f"(fence {lease['fence']})")
    # Fences only grow: the counter outlives releases and expiries.
    fence = state.get_fence(ctx.view, thread) + 1
    token = str(uuid.uuid4())
    expires_at = ctx.now + ctx.settings.lease_duration_ms
    ev = {"threadId": thread, "ownerToken": token, "fence": fence, "expiresAt": expires_at,
          "leaseDurationMs": ctx.settings.lease_duration_ms, "renewAfterMs": ctx.settings.renew_after_ms}
    result = {"threadId": thread, "ownerToken": token, "fence": fence, "expiresAt": expires_at,
              "renewAfterMs": ctx.settings.renew_after_ms}
    return Decision(events=[("threadlog.evt.CheckpointWriterAcquired", ev)], result=result)


@handles("threadlog.cmd.RenewCheckpointWriter")
def renew_writer(ctx: Context, cmd: dict) -> Decision:
    writer = cmd["writer"]
    thread = require_id(writer["threadId"], "writer thread_id")
    _require_current(ctx, thread, writer)
    expires_at = ctx.now + ctx.settings.lease_duration_ms
    ev = {"threadId": thread, "ownerToken": writer["ownerToken"], "fence": writer["fence"],
          "expiresAt": expires_at, "leaseDurationMs": ctx.settings.lease_duration_ms}
    return Decision(events=[("threadlog.evt.CheckpointWriterRenewed", ev)], result={"expiresAt": expires_at})


@handles("threadlog.cmd.ReleaseCheckpointWriter")
def release_writer(ctx: Context, cmd: dict) -> Decision:
    writer = cmd["writer"]
    thread = require_id(writer["threadId"], "writer thread_id")
    if not _is_current(ctx, thread, writer):
        return Decision(result={"released": False})  # a stale lease: nothing to end, not an error
    ev = {"threadId": thread, "ownerToken": writer["ownerToken"], "fence": writer["fence"]}
    return Decision(events=[("threadlog.evt.CheckpointWriterReleased", ev)], result={"released": True})


# -- append / delete-head --------------------------------------------------------------
def _id_taken(ctx: Context, checkpoint_id: str) -> bool:
    """Is there a checkpoint with this id on any thread?

    The index is written by the folds of each thread's partition; an id held
    on another partition is only visible here after `sync_global`, which waits
    until everything acknowledged before this command is folded. Asked only
    when the id is not already known locally (the common case for a new id is
    one wait per batch)."""
    if state.threads_holding(ctx.view, checkpoint_id):
        return True
    ctx.sync_global()
    return bool(state.threads_holding(ctx.view, checkpoint_id))


@handles("threadlog.cmd.AppendCheckpoint")
def append(ctx: Context, cmd: dict) -> Decision:
    writer = cmd["writer"]
    expected = cmd["expectedHeadId"]
    cp = from_wire(cmd["checkpoint"])
    # 1. ids
    check_checkpoint_ids(cp)
    require_id(writer["threadId"], "writer thread_id")
    require_optional_id(expected, "expected_head_id")
    thread = cp["threadId"]
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
    # The record as it arrived is what was validated; it travels on unchanged.
    ev = {"checkpoint": cmd["checkpoint"], "fence": writer["fence"]}
    return Decision(events=[("threadlog.evt.CheckpointAppended", ev)], result=cp["id"])


@handles("threadlog.cmd.DeleteCheckpointHead")
def delete_head(ctx: Context, cmd: dict) -> Decision:
    writer = cmd["writer"]
    thread = require_id(cmd["threadId"], "thread_id")
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


@handles("threadlog.cmd.ForkCheckpoint")
def fork_source_step(ctx: Context, cmd: dict) -> Decision:
    """Step 1, on the source thread's partition: the source checkpoint exists there."""
    _fork_ids(cmd)
    source_thread, source_id = cmd["sourceThreadId"], cmd["sourceCheckpointId"]
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
    # No reply here: the destination step answers the client (same command id).
    return Decision(reply=False, follow_ups=[FollowUp(destination, "threadlog.cmd.ForkCheckpointInto", follow)])


@handles("threadlog.cmd.ForkCheckpointInto")
def fork_destination_step(ctx: Context, cmd: dict) -> Decision:
    """Step 2, on the destination thread's partition: writer, emptiness, then the fork root."""
    source = from_wire(cmd["source"])
    check_checkpoint_ids(source)
    require_id(cmd["destinationCheckpointId"], "destination_checkpoint_id")
    destination = require_id(cmd["destinationThreadId"], "destination_thread_id")
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
    ev = {"checkpoint": to_wire(root), "sourceThreadId": source["threadId"],
          "sourceCheckpointId": source["id"], "fence": writer["fence"]}
    return Decision(events=[("threadlog.evt.CheckpointForked", ev)], result=root)
