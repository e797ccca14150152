"""Folding events into state: the registry of fold functions and the one entry point.

A fold is a pure function of (state, event): it reads and writes a `View` and
never reads a clock or anything outside the event. The decider uses the same
`apply_event` on the events it has just decided, so the state it decides the
next command against is exactly the state a rebuild from offset 0 produces.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable
from dataclasses import dataclass

from .keys import key
from .view import View

log = logging.getLogger("threadlog.fold")

SEQ_TAG = b"\x01seq"


@dataclass(frozen=True)
class EventMeta:
    key: str
    seq: int
    decidedAt: float
    commandId: str  # the proposal's id
    type: str
    # Where the proposal was judged: folds that keep history by position
    # (projections/global_ids.py) need it. -1 only outside a judge (tests).
    partition: int = -1
    offset: int = -1


Fold = Callable[[View, EventMeta, dict], None]
FOLDS: dict[str, Fold] = {}


def folds(type_name: str) -> Callable[[Fold], Fold]:
    """Register the fold of one event payload type."""

    def register(fn: Fold) -> Fold:
        if type_name in FOLDS:
            raise RuntimeError(f"two folds for {type_name}")
        FOLDS[type_name] = fn
        return fn

    return register


def seq_key(partition_key: str) -> bytes:
    return key(SEQ_TAG, partition_key)


def current_seq(view: View, partition_key: str) -> int:
    raw = view.get(seq_key(partition_key))
    return 0 if raw is None else struct.unpack(">q", raw)[0]


def apply_event(view: View, meta: EventMeta, payload: dict) -> None:
    """Fold one event. Unknown types are logged and skipped (a newer writer's fact)."""
    # Every event advances its key's sequence, even one this version cannot fold,
    # so `seq` stays the proof that nothing was lost or folded twice.
    view.put(seq_key(meta.key), struct.pack(">q", meta.seq))
    fn = FOLDS.get(meta.type)
    if fn is None:
        log.error("no fold for event type %s (key %r seq %d); skipped", meta.type, meta.key, meta.seq)
        return
    fn(view, meta, payload)


def load_all() -> None:
    """Import every fold module so the registry is complete."""
    from .folds import load_all as load_fold_modules

    load_fold_modules()
