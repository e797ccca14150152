"""The judging rules: `decide(ctx, payload) -> Decision`, one per proposal type.

A handler reads state through `ctx.view` and either returns a `Decision`
(the effects to fold, the answer's result, a follow-up proposal for another
partition, records for other topics) or raises `ThreadLogError`, which is the
verdict "refused". A handler never writes state itself: the judge folds the
effects it returns, so judged state and rebuilt state are the same thing.

Handlers are PURE: no clock (use `ctx.now`), no randomness (the proposer
draws tokens and ids and puts them in the payload), nothing from another
partition except through `ctx.holders`. Every judge of a partition, and every
rebuild, must reach the same verdict for the same record.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from threadlog.projections.view import View
from threadlog.schemas import Codec


@dataclass
class FollowUp:
    """A proposal for another partition (saga step). The proposer sends it once
    this step is accepted; it references nothing this step did not decide."""

    key: str
    type: str
    payload: dict


@dataclass
class ChunkTombstones:
    """Tombstones for chunks 0..count-1 of one blob version on `<ns>.blobs`,
    derived from an accepted proposal.

    No transaction spans topics any more: the proposer writes these after the
    verdict. Each is idempotent, so writing one twice is harmless and a lost
    one only delays reclamation (a GC sweep finds the chunk).

    Why a range and not a record per chunk: the verdict names them and is
    stored with the partition's state. One forged `AbandonBlobVersion` of
    ~100 bytes naming 2**20 chunks was judged into a 71 MB verdict in 1.8 s
    of judge CPU, every time it was sent (a review).
    """

    blob_key: str
    version: str
    count: int

    def effect(self) -> dict:
        """As a verdict names it (`producers/proposals.py` expands it)."""
        return {"topic": "blob-chunks", "key": self.blob_key, "version": self.version, "count": self.count}


@dataclass
class Decision:
    events: list[tuple[str, dict]] = field(default_factory=list)
    result: Any = None
    follow_ups: list[FollowUp] = field(default_factory=list)
    records: list[ChunkTombstones] = field(default_factory=list)
    # False when a follow-up step will reply to the client instead.
    reply: bool = True


@dataclass
class Context:
    # Decision time, epoch ms: from the proposal record, monotonic per partition
    # (processors/judge.py). Never a judge's clock: every judge must agree.
    now: float
    key: str  # the proposal's partition key
    command_id: str  # the proposal's id
    partition: int
    view: View
    # (kind, id) -> threads holding that global id, as of the fixed positions
    # the proposal names (projections/global_ids.py). The only way a handler
    # may learn anything about another partition.
    holders: Callable[[str, str], list[str]]
    # How many partitions `<ns>.events` has: rules about "this partition's own
    # share" of an index (blob GC fences) filter by it.
    partitions: int = 0
    # Where the proposal is judged (its offset on `partition`), and the end
    # offsets of every events partition it names (`seen`; [] if it names none).
    offset: int = -1
    seen: list[int] = field(default_factory=list)
    # The judging rules the proposal was written for (Proposal.rules). A rule
    # that changed how a legitimate proposal is judged applies its new form
    # only from the version that introduced it, so a rebuild of an older log
    # reaches the verdicts its clients were told.
    rules: int = 2


Handler = Callable[[Context, dict], Decision]
HANDLERS: dict[str, Handler] = {}
# Proposal types whose rules ask `ctx.holders` (ids held on other partitions):
# their proposers attach the positions those answers are judged at.
GLOBAL_READS: set[str] = set()
NOT_THREAD_KEYED: set[str] = set()  # see `handles`
# Proposal types judged differently since a later version of the rules
# (Proposal.rules, processors/judge.py RULES): their proposers name that
# version, so a judge that does not know it waits for an upgrade instead of
# reaching another verdict than its upgraded peers. Every other type: 2.
BASE_RULES = 2
NEWER_RULES: dict[str, int] = {}


# Types whose proposers name positions (`seen`) though their rules need them
# only since a later rules version (an older log's proposals of the type named
# none, and are judged as they were): GLOBAL_READS makes them mandatory.
NAMES_POSITIONS: set[str] = set()


# Types added by their `rules` version (`handles(..., new=True)`), not only judged
# otherwise since: a proposal of one naming older rules is refused as judges of
# those rules refused it (processors/judge.py). Only types added from rules 5 on
# are listed: older additions were judged by their handler whatever rules they
# named, and logs holding such proposals are rebuilt as they were judged.
INTRODUCED: dict[str, int] = {}

# Schema versions of a type added by a later rules version than the type
# (`introduces_schema`): (full schema name, history version) -> rules. A judge
# of older rules did not know that schema and refused the proposal as
# undecodable, so a proposal written with it and naming older rules is refused
# alike (processors/judge.py), whatever the new fields hold.
SCHEMA_INTRODUCED: dict[tuple[str, int], int] = {}


def introduces_schema(type_name: str, *, version: int, rules: int) -> None:
    """Register that `schemas/avro/history/<type_name>.v<version>.avsc` came with `rules`."""
    SCHEMA_INTRODUCED[(type_name, version)] = rules


@functools.lru_cache(maxsize=8)
def newer_schemas(codec: Codec) -> dict[bytes, int]:
    """Writer fingerprint -> the rules that introduced that schema (version), for
    the types added after rules 2 (INTRODUCED) and later versions (SCHEMA_INTRODUCED).
    A payload of one, judged by older rules, is refused as a judge of those rules
    refused it: its codec did not know the schema (processors/judge.py; a staged
    copy's inner command likewise, handlers/langgraph.py)."""
    out: dict[bytes, int] = {}
    for name, rules in INTRODUCED.items():
        for fp in codec.fingerprints(name):
            out[fp] = rules
    for (name, version), rules in SCHEMA_INTRODUCED.items():
        frozen = codec.history_fingerprint(name, version)
        if frozen is None:  # a registration without its frozen file: a bug, not a verdict
            raise RuntimeError(f"{name} v{version} is registered for rules {rules} but not frozen")
        out[frozen] = rules
    return out


def handles(type_name: str, *, global_ids: bool = False, names_positions: bool = False,
            rules: int = BASE_RULES, new: bool = False, introduced: int | None = None,
            thread_keyed: bool = True) -> Callable[[Handler], Handler]:
    """`new`: the type was added by `rules`; `introduced`: by that earlier version
    (judged otherwise since `rules`). `thread_keyed` False: the proposal's key
    is not a thread id (a blob's, a session's, a fence's key) -- which can still
    equal one, so what lists a thread's proposals by key leaves these out."""
    def register(fn: Handler) -> Handler:
        if type_name in HANDLERS:
            raise RuntimeError(f"two handlers for {type_name}")
        HANDLERS[type_name] = fn
        if not thread_keyed:
            NOT_THREAD_KEYED.add(type_name)
        if global_ids:
            GLOBAL_READS.add(type_name)
        if names_positions:
            NAMES_POSITIONS.add(type_name)
        if new or introduced is not None:
            INTRODUCED[type_name] = rules if introduced is None else introduced
        if rules != BASE_RULES:
            NEWER_RULES[type_name] = rules
        return fn

    return register


def reads_other_partitions(type_name: str) -> bool:
    """Do proposals of this type name positions of the other partitions (`seen`)?"""
    return type_name in GLOBAL_READS or type_name in NAMES_POSITIONS


def rules_for(type_name: str) -> int:
    """The judging rules a proposal of this type needs (its Proposal.rules)."""
    return NEWER_RULES.get(type_name, BASE_RULES)


def load_all() -> None:
    """Import every handler module of this package so the registry is complete."""
    import importlib
    import pkgutil

    for mod in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{mod.name}")
