"""Where a global id (run, interrupt, artifact, generation run) lives, seen from a handler.

Ids are indexed id -> thread by folds on the thread's partition; every host
folds every partition. A handler's view of its OWN partition is current, but
another partition's facts are current only after `ctx.sync_global()` (a
ListOffsets round trip, then waiting for the follower). So the lookup syncs
whenever the answer could depend on another partition: the id is not found
here, or it lives on another thread (whose record must be read fresh).

`own_thread` is the other half: the thread a command names must be its
partition key, or it is forged.
"""

from __future__ import annotations

from collections.abc import Callable

from threadlog.errors import invalid_argument

from . import Context


def locate(ctx: Context, thread_of: Callable[[], str | None]) -> str | None:
    """The thread owning the id, as of every write acknowledged before this command."""
    thread = thread_of()
    if thread == ctx.key:
        return thread
    ctx.sync_global()
    return thread_of()


def own_thread(ctx: Context, thread_id: str) -> str:
    """The command's thread, which must be its partition key: the partition key
    decides where a command is decided, so a command naming another thread is forged."""
    if thread_id != ctx.key:
        raise invalid_argument(f"command for thread {thread_id!r} sent with key {ctx.key!r}")
    return thread_id
