"""Artifacts (SPEC section 9): decided on the artifact's thread partition.

An artifact id names one artifact on one thread. A save that names another
thread than the one the id already lives on is refused (INVALID_ARGUMENT)
rather than moving it: a move spans two partitions, so it could not be one
atomic decision, and an upsert on the new thread alone would leave a stale
twin on the old one. Delete it first, then save it on the new thread.
"""

from __future__ import annotations

from threadlog.projections import global_ids as gid
from threadlog.projections.folds import artifacts as state

from threadlog.kernel.errors import invalid_argument
from threadlog.kernel.records import decode_artifact, new_artifact
from threadlog.kernel.validation import require_id

from . import Context, Decision, handles
from .blob_gc import require_unfenced
from .global_ids import locate, own_thread


def _deleted(thread_id: str, artifact_id: str) -> tuple[str, dict]:
    return ("threadlog.evt.ArtifactDeleted", {"artifactId": artifact_id, "threadId": thread_id})


@handles("threadlog.cmd.SaveArtifact", global_ids=True, rules=4)
def save(ctx: Context, cmd: dict) -> Decision:
    given = {k: v for k, v in cmd["artifact"].items() if v is not None}
    record = new_artifact(given)
    thread_id = own_thread(ctx, record["threadId"])
    owner = locate(ctx, gid.ARTIFACT, record["artifactId"])
    if owner is not None and owner != thread_id:
        raise invalid_argument(f"artifact {record['artifactId']!r} belongs to thread {owner!r}; "
                               f"delete it before saving it on thread {thread_id!r}")
    # Rules 4: the artifact's blob is a reference garbage collection keeps (before,
    # a sweep deleted it: only checkpoints counted). So a save naming a blob a
    # sweep is collecting is refused as a checkpoint naming it is.
    holds = ctx.rules >= 4
    if holds and "blobKey" in record:
        require_unfenced(ctx, [record["blobKey"]])
    event = {**{k: None for k in state.OPTIONAL}, **record}
    return Decision(events=[("threadlog.evt.ArtifactSaved", {"artifact": event, "holdsBlob": holds})])


@handles("threadlog.cmd.DeleteArtifact")
def delete(ctx: Context, cmd: dict) -> Decision:
    artifact_id = require_id(cmd["artifactId"], "artifactId")
    thread_id = own_thread(ctx, cmd["threadId"])
    if decode_artifact(ctx.view.get(state.record_key(thread_id, artifact_id))) is None:
        return Decision()  # already gone: silent
    return Decision(events=[_deleted(thread_id, artifact_id)])


@handles("threadlog.cmd.DeleteArtifactsForRun")
def delete_for_run(ctx: Context, cmd: dict) -> Decision:
    run_id = require_id(cmd["runId"], "runId")
    thread_id = own_thread(ctx, cmd["threadId"])
    events = []
    for k, _ in ctx.view.scan(state.run_prefix(run_id, thread_id)):
        _, _, artifact_id = state.split_by_run(k)
        record = decode_artifact(ctx.view.get(state.record_key(thread_id, artifact_id)))
        if record is not None and record["runId"] == run_id:
            events.append(_deleted(thread_id, artifact_id))
    # All of this thread's artifacts of the run go in one transaction.
    return Decision(events=events)
