"""Runs (SPEC section 6): decided on the run's thread partition.

Every command is re-validated here (a command can be forged or come from an
older client); the facade's own checks only spare a round trip.
"""

from __future__ import annotations

from threadlog.projections.folds import runs as state

from threadlog.errors import RUN_NOT_FOUND, RUN_TERMINAL, ThreadLogError
from threadlog.records import RUN_PATCH, decode_run, is_terminal, new_run, patch_from_command
from threadlog.validation import dumps, require_id

from . import Context, Decision, OutRecord, handles
from .global_ids import locate, own_thread


def _load(ctx: Context, thread_id: str, run_id: str) -> dict | None:
    return decode_run(ctx.view.get(state.record_key(thread_id, run_id)))


@handles("threadlog.cmd.CreateOrResumeRun")
def create_or_resume(ctx: Context, cmd: dict) -> Decision:
    record = new_run(cmd["runId"], cmd["threadId"], cmd["startedAt"], cmd.get("status"))
    own_thread(ctx, cmd["threadId"])
    run_id = record["runId"]
    # A run id is global: if it exists on any thread, return it unchanged and
    # ignore every argument -- resuming must never revive a finished run.
    owner = locate(ctx, lambda: state.thread_of(ctx.view, run_id))
    if owner is not None:
        existing = _load(ctx, owner, run_id)
        if existing is not None:
            return Decision(result=existing)
    return Decision(events=[("threadlog.evt.RunCreated", record)], result=record)


@handles("threadlog.cmd.UpdateRun")
def update(ctx: Context, cmd: dict) -> Decision:
    run_id = require_id(cmd["runId"], "runId")
    thread_id = own_thread(ctx, cmd["threadId"])
    patch = patch_from_command(cmd["patch"], RUN_PATCH, "run")
    if not patch or _load(ctx, thread_id, run_id) is None:
        return Decision()  # an unknown run: a no-op, nothing created
    return Decision(events=[("threadlog.evt.RunUpdated", {"runId": run_id, "threadId": thread_id,
                                                         "patch": dumps(patch)})])


@handles("threadlog.cmd.ClaimRun")
def claim(ctx: Context, cmd: dict) -> Decision:
    run_id = require_id(cmd["runId"], "runId")
    thread_id = own_thread(ctx, cmd["threadId"])
    record = _load(ctx, thread_id, run_id)
    if record is None:
        raise ThreadLogError(RUN_NOT_FOUND, f"run {run_id!r} does not exist")
    if is_terminal(record):
        raise ThreadLogError(RUN_TERMINAL, f"run {run_id!r} is {record['status']}; a finished run cannot be claimed")
    # One more than the greatest epoch the run EVER had: `update` may have
    # cleared or lowered driverEpoch, and an epoch handed out twice would let
    # two drivers both believe they hold the run.
    current = record.get("driverEpoch", 0)
    epoch = max(state.max_epoch(ctx.view, thread_id, run_id), current if isinstance(current, int) else 0) + 1
    marker = {"runId": run_id, "kind": "claim", "epoch": epoch, "chunks": [], "writtenAt": ctx.now,
              "batch": b"", "count": 0}
    return Decision(
        events=[("threadlog.evt.RunClaimed", {"runId": run_id, "threadId": thread_id, "epoch": epoch})],
        # Same transaction as the event: a reader of the delivery log sees the
        # claim marker exactly when the claim is decided, and fences older drivers.
        records=[OutRecord("deliveries", run_id, "threadlog.Delivery", marker)],
        result=epoch,
    )
