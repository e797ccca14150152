"""Answering "who holds this checkpoint id on q as of offset s" before q is judged that far.

A checkpoint append on partition p asks every other partition q who holds its
id as of `seen[q]` (projections/global_ids.py). The plain answer waits until
q's judge has passed seen[q]. With two workers that wait chained: q's records
before seen[q] may themselves wait for answers about p, so one append's
latency became the sum of the other worker's, and two workers judged fewer
appends than one.

But the holders of an id change only when a proposal that marks it is
accepted, and whether a proposal *can* mark a checkpoint id is visible in the
proposal itself, before judging it (`marked_checkpoint`): an append marks its
own checkpoint's id, a head deletion or a fork's second step is taken as
marking any id, and no other proposal type marks checkpoint ids. So if
q's owner has *fetched* q up to s and no fetched record in [t, s) can mark the
id, the holders as of s are the holders as of t: the answer is the same fixed
value, known once q is judged up to t instead of s (`Ahead.settles_at`). For
a fresh id (the usual case), once the owner has fetched up to s and no head
deletion or fork is pending in between, that is no wait at all.

The answer itself is still read from the judge's versioned id index, as of s;
only *when* it may be read moves. Verdicts stay a function of fixed log
positions: a judge that answers ahead and one that waits for every position
asked (the judging step alone, `judge_record`, replaying partitions in order,
as tests/unit/test_ahead.py and tests/test_ownership.py do) give the same
answer. Every judge uses this rule: workers, embedded clients, rebuilds.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections import deque
from typing import Any

from threadlog.projections import global_ids as gid
from threadlog.schemas import Codec, CodecError
from threadlog.schemas.codec import HEADER_LEN, MARKER

from .handlers import HANDLERS


class _Any:
    def __repr__(self) -> str:
        return "ANY"


ANY = _Any()  # the record may mark any checkpoint id (or we cannot tell)
Mark = str | _Any | None  # what a record can mark: that id, ANY, or none

APPEND = "threadlog.cmd.AppendCheckpoint"
# THE invariant this module rests on (tests/unit/test_ahead.py checks it against
# the source): checkpoint ids are marked only by the folds of CheckpointAppended
# (the appended checkpoint's own id), CheckpointForked and CheckpointHeadDeleted,
# and only the handlers of APPEND and MARKS_ANY emit those events. A proposal type added later is taken
# as "any" until it is listed in NO_CHECKPOINT_MARKS.
MARKS_ANY = frozenset({
    "threadlog.cmd.DeleteCheckpointHead",  # releases the head's id (not read ahead: rare)
    "threadlog.cmd.ForkCheckpointInto",  # the fork's root (step 2; step 1 marks nothing)
})
NO_CHECKPOINT_MARKS = frozenset("threadlog.cmd." + name for name in (
    "CreateInterrupt", "DecideInterrupt", "SaveTranscript", "SaveArtifact", "ReleaseArtifactCopy", "DeleteArtifact",
    "DeleteArtifactsForRun", "CreateOrResumeRun", "UpdateRun", "ClaimRun", "HeartbeatRun", "SetMetadata",
    "DeleteMetadata", "CreateOrResumeGenerationRun", "UpdateGenerationRun", "AgentSessionAddItems",
    "AgentSessionPopItem", "AgentSessionClear", "ClaimBlobForGc", "FenceBlobsForGc", "CollectBlob", "PutBlob",
    "DeleteBlob", "AbandonBlobVersion", "ForkCheckpoint", "AcquireCheckpointWriter", "RenewCheckpointWriter",
    "RaiseRulesFloor",
    "ReleaseCheckpointWriter", "LangGraphStageChunk", "LangGraphPut", "LangGraphPutWrites",
    "LangGraphDeleteThread", "LangGraphPrune", "LangGraphDeleteRuns", "LangGraphCopyThread", "LangGraphCopyStaged",
))


def marked_checkpoint(value: bytes | None, codec: Codec, rules: int) -> Mark:
    """Which checkpoint id the record at hand can mark if accepted: None (none),
    an id (an append's own), or ANY. A record that does not decode marks none
    (it is judged refused); one of newer rules than `rules` is ANY (never
    guessed at)."""
    return _marks(value, codec, rules)[0]


def _marks(value: bytes | None, codec: Codec, rules: int) -> tuple[Mark, list[int]]:
    """`marked_checkpoint`, and for an append the positions (`seen`) its id is asked as of."""
    try:
        _, env = codec.decode(value, expect="threadlog.Proposal")
    except CodecError:
        return None, []
    if env["rules"] > rules:
        return ANY, []
    ptype = env["type"]
    if ptype == APPEND:
        return _append_id(env["payload"], codec), env["seen"]
    if ptype in NO_CHECKPOINT_MARKS:
        return None, []
    # No handler: judged refused ("unknown proposal type"), so it marks nothing.
    return (ANY if ptype in HANDLERS else None), []


_ID_FIRST: dict[bytes, bool] = {}  # writer fingerprint -> its body starts with checkpoint.id


def _starts_with_checkpoint_id(schema: Any) -> bool:
    try:
        first = schema["fields"][0]
        cp = first["type"]
        return (first["name"] == "checkpoint" and isinstance(cp, dict) and cp["fields"][0]["name"] == "id"
                and cp["fields"][0]["type"] == "string")
    except (KeyError, IndexError, TypeError):
        return False


def _append_id(payload: bytes, codec: Codec) -> str | _Any:
    """The checkpoint id an AppendCheckpoint payload carries: its first Avro
    string (a zigzag varint length, then UTF-8), read without decoding the rest
    (a whole checkpoint costs ~80 us to decode; this ~2). ANY when the writer
    schema is not one that starts with it, or the bytes do not parse; a payload
    that does not decode at all is refused by the judge, so reading an id out
    of it marks nothing the judge would not refuse."""
    if len(payload) < HEADER_LEN or payload[:2] != MARKER:
        return ANY
    fp = payload[2:HEADER_LEN]
    ok = _ID_FIRST.get(fp)
    if ok is None:
        writer = codec.writer(fp)
        if writer is None:
            return ANY  # not a schema we know (not cached: anyone may write such bytes)
        ok = _ID_FIRST[fp] = writer.name == APPEND and _starts_with_checkpoint_id(writer.schema)
    if not ok:
        return ANY
    n = shift = 0
    i = HEADER_LEN
    while True:
        if i >= len(payload) or shift > 63:
            return ANY
        b = payload[i]
        i += 1
        n |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            break
    length = (n >> 1) ^ -(n & 1)
    if length < 0 or i + length > len(payload):
        return ANY
    try:
        return payload[i:i + length].decode("utf-8")
    except UnicodeDecodeError:
        return ANY


class _Partition:
    __slots__ = ("anys", "fetched_to", "last", "marks")

    def __init__(self, position: int) -> None:
        self.fetched_to = position  # every record below this is judged or in `marks`
        self.marks: deque[tuple[int, Mark]] = deque()  # (offset, mark), not judged yet, ascending
        self.last: dict[str, int] = {}  # checkpoint id -> the last offset in `marks` that marks it
        self.anys: list[int] = []  # offsets in `marks` that may mark any id, ascending (rare: a list)


class Ahead:
    """What the fetched but not yet judged records of each owned partition can
    mark. Written by the judge's thread, read by the query server's: one lock,
    held for dict and deque updates only."""

    def __init__(self, codec: Codec, rules: int) -> None:
        self.codec = codec
        self.rules = rules
        self._lock = threading.Lock()
        self._parts: dict[int, _Partition] = {}

    def reset(self, p: int, position: int) -> None:
        """Partition p (taken over, or rewound) is judged up to `position`; nothing fetched."""
        with self._lock:
            self._parts[p] = _Partition(position)

    def drop(self, p: int) -> None:
        with self._lock:
            self._parts.pop(p, None)

    def fetched(self, p: int, msgs: list[Any]) -> list[tuple[int, str, list[int]]]:
        """Records of p fetched for judging, in offset order (decoded out of the
        lock). Returns each append's (offset, checkpoint id, seen): the id
        questions its judging will ask, which the judge asks the other owners at once."""
        part = self._parts.get(p)
        if part is None:
            return []
        marks: list[tuple[int, Mark]] = []
        asks: list[tuple[int, str, list[int]]] = []
        for m in msgs:
            if m.offset() >= part.fetched_to:
                mark, seen = _marks(m.value(), self.codec, self.rules)
                marks.append((m.offset(), mark))
                if seen and isinstance(mark, str):
                    asks.append((m.offset(), mark, seen))
        if not marks:
            return []
        with self._lock:
            if self._parts.get(p) is not part:
                return []  # reset meanwhile: the records come again
            for offset, mark in marks:
                if offset < part.fetched_to:
                    continue
                part.marks.append((offset, mark))
                if isinstance(mark, str):
                    part.last[mark] = offset
                elif mark is ANY:
                    part.anys.append(offset)
                part.fetched_to = offset + 1
        return asks

    def judged(self, p: int, position: int) -> None:
        """Partition p is judged (and applied) up to `position`."""
        with self._lock:
            part = self._parts.get(p)
            if part is None:
                return
            marks = part.marks
            while marks and marks[0][0] < position:
                offset, mark = marks.popleft()
                if isinstance(mark, str):
                    if part.last.get(mark) == offset:
                        del part.last[mark]
                elif mark is ANY:
                    part.anys.pop(0)

    def may_settle_earlier(self, q: int, kind: str, asof: int) -> bool:
        """Could `settles_at(q, kind, _, asof)` fall once more of q is fetched?
        Only while asof lies beyond what is fetched of an owned partition, and
        only for the kind looked at ahead."""
        if kind != gid.CHECKPOINT:
            return False
        with self._lock:
            part = self._parts.get(q)
            return part is not None and asof > part.fetched_to

    def settles_at(self, q: int, kind: str, ident: str, asof: int) -> int:
        """How far q must be judged before "holders of (kind, ident) as of asof"
        can be read: `asof`, or less when the records in between cannot change
        the answer (module docstring). Only checkpoint ids are looked at ahead."""
        if kind != gid.CHECKPOINT:
            return asof
        with self._lock:
            part = self._parts.get(q)
            if part is None or asof > part.fetched_to:
                return asof  # not all fetched: what lies in between is unknown
            last = part.last.get(ident, -1)
            if last >= asof:
                return asof  # it may be marked before asof too: wait (rare: a re-sent id)
            i = bisect_left(part.anys, asof)
            any_before = part.anys[i - 1] if i > 0 else -1
            return max(last, any_before) + 1
