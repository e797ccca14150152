"""Artifacts (SPEC section 9): decided on the artifact's thread partition.

An artifact id names one artifact on one thread. `save` upserts (SPEC 9), also
with another thread than the one the id lives on: the artifact then moves
there. A move spans two partitions, so it cannot be one decision; from judging
rules 5 a save is a saga of two steps:

1. `SaveArtifact`, on the saved thread's partition: the record is saved there,
   and every other thread holding the id (as of the positions the proposal
   names; on this partition, as of now) gets step 2;
2. `ReleaseArtifactCopy`, on each such thread's partition: its copy is removed.

Saved first, removed second: a client that dies in between leaves a twin, and
the next save of the id (anywhere) removes the twin.

Judging rules 8: step 2 names the position of its partition step 1 saw
(`before`: `seen` there, or step 1's own offset on its own partition) and
spares a copy saved at or after it -- a save step 1 did not see. Why: before,
the removal had no condition, and two saves of one id racing on two threads
could leave none (a review, reproduced): X saves it on B while Y saves it
again on A, having seen X's copy; X's step 1 saw A's old copy, so X's
removal took Y's new one, and Y's took X's.

THE guarantee, for any number of racing saves: an acknowledged save is never
lost to another save's removal. A removal takes only a copy its own save saw,
so the copy of a save no other save saw (one exists: "saw" follows the log's
order, which has no cycles) is never taken. The price is twins: saves that
did not see each other can both keep their copies (a move racing an
in-place save, two moves of one copy), and the id's next save removes the
twin. Two other rules were tried and reviewed: sparing only a copy whose
save saw the asking one, and a case analysis naming which of two saves came
later; both made one copy of two racing saves, and both lost every copy in
cases of three saves (or two saves and a delete) a model of the interleavings
found. A twin can be repaired; a loss cannot.

Copies saved by older rules carry no position (projections/folds/artifacts.py
`artO`) and are removed as they were; so is the copy a step 2 without
`before` asks for (a client of rules 5-7 re-encodes the follow-up with its
schema, which drops it): a client of an earlier version keeps the old race.

Before rules 5 a save naming another thread was refused (INVALID_ARGUMENT),
and such logs are judged so.
"""

from __future__ import annotations

from threadlog.projections import global_ids as gid
from threadlog.projections.folds import artifacts as state

from threadlog.kernel.errors import invalid_argument
from threadlog.kernel.partitioning import partition_for
from threadlog.kernel.records import decode_artifact, new_artifact
from threadlog.kernel.validation import require_id

from . import Context, Decision, FollowUp, handles, introduces_schema
from .blob_gc import require_unfenced
from .global_ids import locate, own_thread


def _deleted(thread_id: str, artifact_id: str) -> tuple[str, dict]:
    return ("threadlog.evt.ArtifactDeleted", {"artifactId": artifact_id, "threadId": thread_id})


# The rules that spare copies a save did not see (module doc), and the schema
# version of ReleaseArtifactCopy that names the position (`before`).
SPARES_UNSEEN = 8
introduces_schema("threadlog.cmd.ReleaseArtifactCopy", version=2, rules=SPARES_UNSEEN)


def _seen_on(ctx: Context, thread_id: str) -> int:
    """The position of `thread_id`'s partition as of which step 1 found its copy
    (`ctx.holders`: its own partition as of now, every other as of `seen`)."""
    q = partition_for(thread_id, ctx.partitions)
    return ctx.offset if q == ctx.partition else ctx.seen[q]


def _remove(ctx: Context, thread_id: str, artifact_id: str) -> Decision:
    """The thread's copy of the artifact deleted; silent when there is none."""
    if decode_artifact(ctx.view.get(state.record_key(thread_id, artifact_id))) is None:
        return Decision()
    return Decision(events=[_deleted(thread_id, artifact_id)])


@handles("threadlog.cmd.SaveArtifact", global_ids=True, rules=SPARES_UNSEEN)
def save(ctx: Context, cmd: dict) -> Decision:
    given = {k: v for k, v in cmd["artifact"].items() if v is not None}
    record = new_artifact(given)
    thread_id = own_thread(ctx, record["threadId"])
    elsewhere: list[str] = []
    if ctx.rules >= 5:
        elsewhere = [t for t in ctx.holders(gid.ARTIFACT, record["artifactId"]) if t != thread_id]
    else:
        owner = locate(ctx, gid.ARTIFACT, record["artifactId"])
        if owner is not None and owner != thread_id:
            raise invalid_argument(f"artifact {record['artifactId']!r} belongs to thread {owner!r}; "
                                   f"delete it before saving it on thread {thread_id!r}")
    # Rules 4: the artifact's blob is a reference garbage collection keeps (before,
    # a sweep deleted it: only checkpoints counted). So a save naming a blob a
    # sweep is collecting is refused as a checkpoint naming it is.
    holds = ctx.rules >= 4
    if holds and "blobKey" in record:
        require_unfenced(ctx, [record["blobKey"]], thread_id)
    event = {**{k: None for k in state.OPTIONAL}, **record}
    spares = ctx.rules >= SPARES_UNSEEN
    releases = [FollowUp(t, "threadlog.cmd.ReleaseArtifactCopy",
                         {"artifactId": record["artifactId"], "threadId": t, "savedOn": thread_id,
                          "before": _seen_on(ctx, t) if spares else None})
                for t in elsewhere]
    saved = {"artifact": event, "holdsBlob": holds, "tracksOffset": spares}
    return Decision(events=[("threadlog.evt.ArtifactSaved", saved)], follow_ups=releases)


@handles("threadlog.cmd.ReleaseArtifactCopy", rules=SPARES_UNSEEN, introduced=5)
def release_copy(ctx: Context, cmd: dict) -> Decision:
    """Step 2 of a save (module doc): remove this thread's copy of the id, unless
    (rules 8) it was saved at or after the position the save saw."""
    artifact_id = require_id(cmd["artifactId"], "artifactId")
    thread_id = own_thread(ctx, cmd["threadId"])
    saved_on = require_id(cmd["savedOn"], "savedOn")
    if saved_on == thread_id:
        raise invalid_argument(f"a copy of artifact {artifact_id!r} on thread {thread_id!r} is the saved one")
    before = cmd.get("before")
    if before is not None:  # rules >= 8: the judge refuses a schema naming it under older rules
        if before < 0:
            raise invalid_argument(f"before must be an offset (>= 0), not {before}")
        saved = state.saved_at(ctx.view, thread_id, artifact_id)
        if saved is not None and saved >= before:
            return Decision()  # saved after the save that asks this looked: the newer save stands
    return _remove(ctx, thread_id, artifact_id)


@handles("threadlog.cmd.DeleteArtifact")
def delete(ctx: Context, cmd: dict) -> Decision:
    artifact_id = require_id(cmd["artifactId"], "artifactId")
    return _remove(ctx, own_thread(ctx, cmd["threadId"]), artifact_id)


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
