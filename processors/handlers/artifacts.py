"""Artifacts (SPEC section 9): decided on the artifact's thread partition.

An artifact id names one artifact on one thread. `save` upserts (SPEC 9), also
with another thread than the one the id lives on: the artifact then moves. A
move spans two partitions, so it cannot be one decision; it is a saga of two:

1. `MoveArtifact`, on the new thread's partition: the record is saved there
   (the id lives on the old thread, as of the positions the proposal names,
   or on this one, or nowhere -- not on a third, which a concurrent move won);
2. `ReleaseMovedArtifact`, on the old thread's partition: the old copy is
   removed -- only if it is still the record the client read before step 1.
   Why that condition: a save of the id on the old thread between the steps
   must not be deleted by a move that never saw it (a lost update); it stays
   as a twin instead, the outcome of two concurrent writes of one id.

Saved first, removed second: a crash in between leaves a twin (calls naming
the id follow the lowest partition's copy), never no artifact. A plain
`SaveArtifact` naming another thread is still refused (INVALID_ARGUMENT): the
client then reads the old copy and proposes the move (threadlog/stores/artifacts.py).
"""

from __future__ import annotations

from threadlog.projections import global_ids as gid
from threadlog.projections.folds import artifacts as state

from threadlog.kernel.errors import invalid_argument
from threadlog.kernel.records import decode_artifact, new_artifact
from threadlog.kernel.validation import loads_json_value, require_id

from . import Context, Decision, FollowUp, handles
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


@handles("threadlog.cmd.MoveArtifact", global_ids=True, rules=5)
def move(ctx: Context, cmd: dict) -> Decision:
    """Step 1 of a move, on the new thread's partition (module doc)."""
    given = {k: v for k, v in cmd["artifact"].items() if v is not None}
    record = new_artifact(given)
    thread_id = own_thread(ctx, record["threadId"])
    source = require_id(cmd["fromThreadId"], "fromThreadId")
    if source == thread_id:
        raise invalid_argument(f"a move of artifact {record['artifactId']!r} names thread {thread_id!r} twice")
    replaces = _record_text(cmd["replaces"])
    if replaces.get("artifactId") != record["artifactId"] or replaces.get("threadId") != source:
        raise invalid_argument("`replaces` is not the artifact's record on the thread it moves from")
    holders = ctx.holders(gid.ARTIFACT, record["artifactId"])
    others = [t for t in holders if t not in (thread_id, source)]
    if others:
        raise invalid_argument(f"artifact {record['artifactId']!r} belongs to thread {others[0]!r}; "
                               f"it was not moved to thread {thread_id!r}")
    if "blobKey" in record:
        require_unfenced(ctx, [record["blobKey"]])
    event = {**{k: None for k in state.OPTIONAL}, **record}
    release = {"artifactId": record["artifactId"], "threadId": source, "movedTo": thread_id,
               "replaces": cmd["replaces"]}
    return Decision(events=[("threadlog.evt.ArtifactSaved", {"artifact": event, "holdsBlob": True})],
                    follow_ups=[FollowUp(source, "threadlog.cmd.ReleaseMovedArtifact", release)])


@handles("threadlog.cmd.ReleaseMovedArtifact", rules=5)
def release_moved(ctx: Context, cmd: dict) -> Decision:
    """Step 2 of a move, on the old thread's partition: remove the copy if it is
    still the record step 1 replaced, else leave it (module doc)."""
    artifact_id = require_id(cmd["artifactId"], "artifactId")
    thread_id = own_thread(ctx, cmd["threadId"])
    require_id(cmd["movedTo"], "movedTo")
    stored = decode_artifact(ctx.view.get(state.record_key(thread_id, artifact_id)))
    if stored is None or stored != _record_text(cmd["replaces"]):
        return Decision()  # gone, or saved again since it was read: not this move's to remove
    return Decision(events=[_deleted(thread_id, artifact_id)])


def _record_text(text: str) -> dict:
    """The artifact record a move replaces, from its JSON text (exact: big ints stay ints)."""
    try:
        value = loads_json_value(text, "replaces")
    except ValueError as exc:
        raise invalid_argument(str(exc)) from None
    if not isinstance(value, dict):
        raise invalid_argument("`replaces` is not a JSON object")
    return value


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
