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

Judging rules 8: two saves of one id racing on two threads end as some serial
order of them does -- one copy, the later save's. Before, the removal had no
condition and they could leave none (a review, reproduced): X saves it on B
while Y saves it again on A, having seen X's copy; X's step 1 saw A's old
copy, so X's removal took Y's new one, and Y's took X's. So each save records
what it saw (projections/folds/artifacts.py `artV`: per partition, the
position it was judged as of; and the threads whose copies it found, which
it removes), and step 2 names where step 1 saved (`savedAt`) and what it saw
of this partition (`seenThere`). Step 2, about the copy here (saved by T)
and the asking save S:

- T found no copy on S's thread: T will not remove S's copy, so this one goes
  (serial order T, S) -- sparing it left a twin no order makes, a second
  review found (T an in-place save that never saw S);
- else T saw S: T is the later, and removes S's copy: this one stays;
- else S saw T: S is the later: this one goes;
- else neither saw the other, and each removes the other's copy: the later
  by (offset, partition) wins, the same answer on both partitions -- a
  copy-by-position rule alone (spare what S did not see) left twins, and
  "spare what saw S" alone lost both (a third reading of the cases).

So at most one of two racing removals takes its copy, and one always does.
Copies saved by older rules carry no record of what they saw and are
removed as they were; so is a copy a step 2 without `savedAt` asks for (a
client of rules 5-7 re-encodes the follow-up with its schema, which drops
the fields): a client of an earlier version keeps the old race.

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


# The rules that spare a copy saved after the save that would remove it (module
# doc), and the schema version of ReleaseArtifactCopy that names it (`savedAt`).
SPARES_LATER = 8
introduces_schema("threadlog.cmd.ReleaseArtifactCopy", version=2, rules=SPARES_LATER)


def _view(ctx: Context) -> list[int]:
    """Per events partition, the position this proposal is judged as of: `ctx.holders`
    reads its own partition as of now (this offset), every other as of `seen`."""
    return [ctx.offset if q == ctx.partition else ctx.seen[q] for q in range(ctx.partitions)]


def _spared(ctx: Context, copy: dict | None, saved_on: str, saved_at: int, seen_there: int) -> bool:
    """Does the copy here (its save's record `copy`) outlive the save on `saved_on`
    at `saved_at` that asks for its removal (module doc: which came later)?"""
    if copy is None or len(copy["v"]) != ctx.partitions:
        return False  # saved by older rules: removed, as they did
    if saved_on not in copy["r"]:
        return False  # its save will not remove the asking one's copy: this one goes
    asking = partition_for(saved_on, ctx.partitions)
    own = copy["v"][ctx.partition]  # where the copy here was saved
    if copy["v"][asking] > saved_at:
        return True  # it saw the asking save: it is the later
    if seen_there > own:
        return False  # the asking save saw it: the asking one is the later
    return (own, ctx.partition) > (saved_at, asking)  # neither saw the other


def _remove(ctx: Context, thread_id: str, artifact_id: str) -> Decision:
    """The thread's copy of the artifact deleted; silent when there is none."""
    if decode_artifact(ctx.view.get(state.record_key(thread_id, artifact_id))) is None:
        return Decision()
    return Decision(events=[_deleted(thread_id, artifact_id)])


@handles("threadlog.cmd.SaveArtifact", global_ids=True, rules=SPARES_LATER)
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
        require_unfenced(ctx, [record["blobKey"]])
    event = {**{k: None for k in state.OPTIONAL}, **record}
    view = _view(ctx) if ctx.rules >= SPARES_LATER else None
    releases = [FollowUp(t, "threadlog.cmd.ReleaseArtifactCopy",
                         {"artifactId": record["artifactId"], "threadId": t, "savedOn": thread_id,
                          "savedAt": None if view is None else ctx.offset,
                          "seenThere": None if view is None else view[partition_for(t, ctx.partitions)]})
                for t in elsewhere]
    saved = {"artifact": event, "holdsBlob": holds, "view": None if view is None else {"v": view, "r": elsewhere}}
    return Decision(events=[("threadlog.evt.ArtifactSaved", saved)], follow_ups=releases)


@handles("threadlog.cmd.ReleaseArtifactCopy", rules=SPARES_LATER, introduced=5)
def release_copy(ctx: Context, cmd: dict) -> Decision:
    """Step 2 of a save (module doc): remove this thread's copy of the id, unless
    (rules 8) that copy's save is the later of the two."""
    artifact_id = require_id(cmd["artifactId"], "artifactId")
    thread_id = own_thread(ctx, cmd["threadId"])
    saved_on = require_id(cmd["savedOn"], "savedOn")
    if saved_on == thread_id:
        raise invalid_argument(f"a copy of artifact {artifact_id!r} on thread {thread_id!r} is the saved one")
    saved_at, seen_there = cmd.get("savedAt"), cmd.get("seenThere")
    if saved_at is not None or seen_there is not None:  # rules >= 8: the judge refuses this schema before
        if saved_at is None or seen_there is None or saved_at < 0 or seen_there < 0:
            raise invalid_argument(f"savedAt and seenThere must both be offsets (>= 0), not {saved_at!r} "
                                   f"and {seen_there!r}")
        if _spared(ctx, state.saved_view(ctx.view, thread_id, artifact_id), saved_on, saved_at, seen_there):
            return Decision()
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
