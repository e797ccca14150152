"""What exists on a thread: one counter per kind, kept by every domain's folds.

A fork's destination must be empty -- no transcript (even an empty one), run,
generation run, interrupt, artifact, checkpoint or head (SPEC section 4). The
fork is decided on the destination thread's partition, where all of these
live, so each fold that creates or removes such a record on a thread moves
its counter here, and the emptiness check is one prefix scan of one thread.
"""

from __future__ import annotations

from ..keys import key
from ..view import View

PRESENCE = b"tp"

TRANSCRIPT = "transcript"
RUN = "run"
GENERATION_RUN = "generation-run"
INTERRUPT = "interrupt"
ARTIFACT = "artifact"
CHECKPOINT = "checkpoint"


def presence_key(thread_id: str, kind: str) -> bytes:
    return key(PRESENCE, thread_id, kind)


def count(view: View, thread_id: str, kind: str) -> int:
    raw = view.get(presence_key(thread_id, kind))
    return 0 if raw is None else int(raw)


def add(view: View, thread_id: str, kind: str, delta: int = 1) -> None:
    n = count(view, thread_id, kind) + delta
    if n < 0:
        raise ValueError(f"presence of {kind} on {thread_id!r} would go negative")
    if n == 0:
        view.delete(presence_key(thread_id, kind))
    else:
        view.put(presence_key(thread_id, kind), str(n).encode())


def mark(view: View, thread_id: str, kind: str) -> None:
    """For kinds that exist once per thread (a transcript): set, not count."""
    view.put(presence_key(thread_id, kind), b"1")


def kinds_present(view: View, thread_id: str) -> list[str]:
    """Kinds with a non-zero count on the thread (empty list: the thread is empty)."""
    prefix = key(PRESENCE, thread_id)
    out = []
    for k, v in view.scan(prefix):
        if int(v) > 0:
            (_, kind) = _split(k)
            out.append(kind)
    return out


def _split(k: bytes) -> tuple[str, str]:
    from ..keys import split

    thread, kind = split(PRESENCE, k, "ss")
    return thread, kind
