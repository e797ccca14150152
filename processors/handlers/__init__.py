"""Command handlers: `decide(ctx, payload) -> Decision`, one per command type.

A handler reads state through `ctx.view` and either returns a `Decision`
(events to append, the reply's result, follow-up commands for another
partition, records for the deliveries topic) or raises `ThreadLogError`, which
becomes a refusal reply. A handler never writes state itself: the engine folds
the events it returns, so decided state and rebuilt state are the same thing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from threadlog.projections.view import View


@dataclass
class FollowUp:
    """A command for another partition, sent in the same transaction (saga step)."""

    key: str
    type: str
    payload: dict


@dataclass
class OutRecord:
    """A record for another topic of the namespace, written in the same transaction.

    `topic` is a role: "deliveries" (claim markers, keyed by run id) or "blobs"
    (keyed by blob/chunk key). The partition is the key's murmur2 partition of
    that topic. `payload=None` writes a tombstone (compaction reclaims the key).
    """

    topic: str
    key: str
    type: str | None = None
    payload: dict | None = None


@dataclass
class Decision:
    events: list[tuple[str, dict]] = field(default_factory=list)
    result: Any = None
    follow_ups: list[FollowUp] = field(default_factory=list)
    records: list[OutRecord] = field(default_factory=list)
    # False when a follow-up step will reply to the client instead.
    reply: bool = True


@dataclass
class Settings:
    lease_duration_ms: int
    renew_after_ms: int


@dataclass
class Context:
    now: float  # decider clock at decision time, epoch ms
    key: str  # the command's partition key
    command_id: str
    partition: int
    view: View
    settings: Settings
    # Waits until facts of *other* partitions acknowledged before this command
    # are folded; call before reading state another partition owns.
    sync_global: Callable[[], None]


Handler = Callable[[Context, dict], Decision]
HANDLERS: dict[str, Handler] = {}


def handles(type_name: str) -> Callable[[Handler], Handler]:
    def register(fn: Handler) -> Handler:
        if type_name in HANDLERS:
            raise RuntimeError(f"two handlers for {type_name}")
        HANDLERS[type_name] = fn
        return fn

    return register


def load_all() -> None:
    """Import every handler module of this package so the registry is complete."""
    import importlib
    import pkgutil

    for mod in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{mod.name}")
