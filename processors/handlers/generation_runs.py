"""Generation runs (SPEC section 8): decided on the run's thread partition, like runs."""

from __future__ import annotations

from threadlog.projections import global_ids as gid
from threadlog.projections.folds import generation_runs as state

from threadlog.kernel.records import GENERATION_RUN_PATCH, decode_generation_run, new_generation_run, patch_from_command
from threadlog.kernel.validation import dumps, require_id

from . import Context, Decision, handles
from .global_ids import elsewhere, locate, own_thread


@handles("threadlog.cmd.CreateOrResumeGenerationRun", global_ids=True)
def create_or_resume(ctx: Context, cmd: dict) -> Decision:
    record = new_generation_run(cmd["runId"], cmd["threadId"], cmd["activity"], cmd["provider"], cmd["model"],
                                cmd["startedAt"], cmd.get("status"))
    own_thread(ctx, cmd["threadId"])
    run_id = record["runId"]
    # Idempotent like runs: an existing id (any thread) is returned unchanged.
    owner = locate(ctx, gid.GENERATION_RUN, run_id)
    if owner is not None and owner != ctx.key:
        return Decision(result=elsewhere(owner))
    if owner is not None:
        existing = decode_generation_run(ctx.view.get(state.record_key(owner, run_id)))
        if existing is not None:
            return Decision(result=existing)
    return Decision(events=[("threadlog.evt.GenerationRunCreated", record)], result=record)


@handles("threadlog.cmd.UpdateGenerationRun")
def update(ctx: Context, cmd: dict) -> Decision:
    run_id = require_id(cmd["runId"], "runId")
    thread_id = own_thread(ctx, cmd["threadId"])
    patch = patch_from_command(cmd["patch"], GENERATION_RUN_PATCH, "generation run")
    if not patch or decode_generation_run(ctx.view.get(state.record_key(thread_id, run_id))) is None:
        return Decision()  # an unknown run: a no-op, nothing created
    return Decision(events=[("threadlog.evt.GenerationRunUpdated",
                             {"runId": run_id, "threadId": thread_id, "patch": dumps(patch)})])
