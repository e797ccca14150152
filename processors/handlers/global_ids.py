"""Where a global id (checkpoint, run, interrupt, artifact, generation run) lives, seen from a handler.

Ids are indexed per thread with history (projections/global_ids.py). A
handler asks `ctx.holders(kind, id)`: its own partition as of now, every other
partition as of the positions the proposal was made at. So the answer -- and
the verdict -- is the same for every judge and every rebuild.

`own_thread` is the other half: the thread a proposal names must be its
partition key, or it is forged.
"""

from __future__ import annotations

from threadlog.kernel.errors import invalid_argument

from . import Context


def locate(ctx: Context, kind: str, ident: str) -> str | None:
    """The thread holding the id (its own thread first), or None."""
    threads = ctx.holders(kind, ident)
    if not threads:
        return None
    return ctx.key if ctx.key in threads else threads[0]


def elsewhere(thread_id: str) -> dict:
    """The result of a create-or-resume whose id lives on another thread's
    partition: the record is not this partition's to read, so the client reads
    it (after a read barrier) instead of the judge copying another partition's
    state into a verdict."""
    return {"$elsewhere": thread_id}


def own_thread(ctx: Context, thread_id: str) -> str:
    """The proposal's thread, which must be its partition key: the partition key
    decides where a proposal is judged, so one naming another thread is forged."""
    if thread_id != ctx.key:
        raise invalid_argument(f"proposal for thread {thread_id!r} sent with key {ctx.key!r}")
    return thread_id
