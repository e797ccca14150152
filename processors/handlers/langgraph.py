"""LangGraph checkpointer commands (threadlog.integrations.langgraph), decided on the thread's partition.

Every command names one thread and is keyed by it; a handler reads only that
thread's keys (projections/folds/langgraph.py) and is a pure function of
(state, command): no clock, no randomness (upload ids are drawn by the
client), no other partition. Operations LangGraph defines across threads are
driven by the client: `copy_thread` reads the source after a read barrier and
sends everything in one LangGraphCopyThread to the target's partition;
`prune` and `delete_for_runs` send one command per thread.

A value too large to travel inline is staged first (LangGraphStageChunk on
the same partition, so the commands are decided in order) and named by the
command that commits it; the handler checks that every chunk is there and
that no upload is named twice, so the fold can move the chunks under the
value that owns them.
"""

from __future__ import annotations

import json
from collections import defaultdict

from threadlog.projections.folds import langgraph as state
from threadlog.projections.keys import key
from threadlog.schemas import CodecError, default_codec
from threadlog.schemas.codec import HEADER_LEN

from threadlog.kernel.errors import ThreadLogError, invalid_argument
from threadlog.kernel.validation import is_int, is_text, require_id

from . import Context, Decision, handles, introduces_schema, newer_schemas

MAX_CHUNK = 4 * 1024 * 1024  # a sanity bound: the client stages 1 MiB chunks
MAX_CHUNKS = 1 << 16  # 64 Ki chunks of 4 MiB: 256 GiB, far beyond any channel value
STRATEGIES = ("keep_latest", "delete")
# The rules under which keep_latest removes finished subgraph calls whole, and
# the schema of LangGraphPrune that names them (`calls`).
PRUNES_CALLS = 9
introduces_schema("threadlog.cmd.LangGraphPrune", version=2, rules=PRUNES_CALLS)
# The rules under which keep_latest also keeps the checkpoints its proposer names
# (`keep`: a DeltaChannel's ancestors), and the schema that names them.
PRUNE_KEEPS = 11
introduces_schema("threadlog.cmd.LangGraphPrune", version=3, rules=PRUNE_KEEPS)


# -- input -----------------------------------------------------------------------------------
def _thread(ctx: Context, cmd: dict) -> str:
    thread = require_id(cmd["threadId"], "thread_id")
    # State of a thread is decided on the partition its key maps to, or two
    # deciders could change one thread concurrently.
    if ctx.key != thread:
        raise invalid_argument(f"a LangGraph command for thread {thread!r} must be keyed by it, not {ctx.key!r}")
    return thread


def _text(value: object, label: str) -> str:
    if not is_text(value):
        raise invalid_argument(f"{label} must be a well-formed Unicode string, got {value!r}")
    return value


class _Values:
    """Checks the values of one command; an upload may be named once."""

    def __init__(self, ctx: Context, thread: str) -> None:
        self.ctx = ctx
        self.thread = thread
        self.uploads: set[str] = set()

    def check(self, wire: dict, label: str) -> None:
        if not _text(wire["type"], f"{label} serde type"):
            raise invalid_argument(f"{label} has an empty serde type")
        staged = wire["staged"]
        if (wire["data"] is None) == (staged is None):
            raise invalid_argument(f"{label} must be either inline data or a staged upload")
        if staged is not None:
            self.check_staged(staged, label)

    def check_staged(self, staged: dict, label: str, *, keep: bool = False) -> list[bytes]:
        """Check that every chunk of the upload is there and that they hold its size;
        with `keep`, return them (else none is held: a value's may be gigabytes)."""
        upload = require_id(staged["uploadId"], f"{label} upload id")
        if upload in self.uploads:
            raise invalid_argument(f"upload {upload!r} is named twice")
        self.uploads.add(upload)
        count, size = staged["chunks"], staged["size"]
        if not 1 <= count <= MAX_CHUNKS or size < 0:
            raise invalid_argument(f"{label}: impossible staged upload of {count} chunks, {size} bytes")
        chunks = []
        total = 0
        for i in range(count):
            raw = self.ctx.view.get(state.stage_key(self.thread, upload, i))
            if raw is None:
                raise invalid_argument(f"{label}: chunk {i} of upload {upload!r} was not staged "
                                       f"on thread {self.thread!r} (or is already committed)")
            total += len(raw)
            if keep:
                chunks.append(raw)
        if total != size:
            raise invalid_argument(f"{label}: upload {upload!r} holds {total} bytes, not {size}")
        return chunks


def _check_checkpoint(values: _Values, cp: dict) -> None:
    _text(cp["checkpointNs"], "checkpoint_ns")
    cid = require_id(cp["checkpointId"], "checkpoint id")
    if cp["parentCheckpointId"] is not None:
        require_id(cp["parentCheckpointId"], "parent checkpoint id")
    if cp["runId"] is not None:
        _text(cp["runId"], "run_id")
    for channel, version in cp["channelVersions"].items():
        _text(channel, "channel name")
        require_id(version, f"version of channel {channel!r}")
    values.check(cp["body"], f"checkpoint {cid!r}")
    values.check(cp["metadata"], f"metadata of checkpoint {cid!r}")


def _check_blob(values: _Values, blob: dict) -> None:
    _text(blob["checkpointNs"], "checkpoint_ns")
    _text(blob["channel"], "channel name")
    require_id(blob["version"], "channel version")
    values.check(blob["value"], f"value of channel {blob['channel']!r}")


def _check_write(values: _Values, w: dict) -> None:
    _text(w["checkpointNs"], "checkpoint_ns")
    require_id(w["checkpointId"], "checkpoint id")
    require_id(w["taskId"], "task id")
    if not is_int(w["idx"]):
        raise invalid_argument(f"write idx must be an int, got {w['idx']!r}")
    _text(w["channel"], "channel name")
    _text(w["taskPath"], "task path")
    values.check(w["value"], f"write {w['channel']!r} of task {w['taskId']!r}")


# -- staging -----------------------------------------------------------------------------------
@handles("threadlog.cmd.LangGraphStageChunk")
def stage_chunk(ctx: Context, cmd: dict) -> Decision:
    thread = _thread(ctx, cmd)
    upload = require_id(cmd["uploadId"], "upload id")
    index = cmd["index"]
    if not 0 <= index < MAX_CHUNKS:
        raise invalid_argument(f"chunk index must be within 0..{MAX_CHUNKS - 1}, got {index}")
    if not 0 < len(cmd["data"]) <= MAX_CHUNK:
        raise invalid_argument(f"a chunk holds 1..{MAX_CHUNK} bytes, got {len(cmd['data'])}")
    if ctx.view.get(state.stage_key(thread, upload, index)) == cmd["data"]:
        return Decision()  # a resent chunk: already staged
    return Decision(events=[("threadlog.evt.LangGraphChunkStaged", {
        "threadId": thread, "uploadId": upload, "index": index, "data": cmd["data"]})])


# -- put, put_writes -----------------------------------------------------------------------------
@handles("threadlog.cmd.LangGraphPut")
def put(ctx: Context, cmd: dict) -> Decision:
    thread = _thread(ctx, cmd)
    values = _Values(ctx, thread)
    cp = cmd["checkpoint"]
    _check_checkpoint(values, cp)
    for blob in cmd["blobs"]:
        _check_blob(values, blob)
        if blob["checkpointNs"] != cp["checkpointNs"]:
            raise invalid_argument("a put's channel values belong to the checkpoint's namespace")
    # No parent check: LangGraph forks from any checkpoint (time travel) and a
    # parent may have been pruned; the parent id is kept as given.
    return Decision(events=[("threadlog.evt.LangGraphCheckpointPut",
                             {"threadId": thread, "checkpoint": cp, "blobs": cmd["blobs"]})])


@handles("threadlog.cmd.LangGraphPutWrites")
def put_writes(ctx: Context, cmd: dict) -> Decision:
    thread = _thread(ctx, cmd)
    values = _Values(ctx, thread)
    accepted: list[dict] = []
    discarded: list[dict] = []
    seen: set[tuple] = set()
    for w in cmd["writes"]:
        _check_write(values, w)
        k = (w["checkpointNs"], w["checkpointId"], w["taskId"], w["idx"])
        # A regular write (idx >= 0) is written once: a task that is retried
        # re-sends its writes, and the first ones stand. The special negative
        # indices (WRITES_IDX_MAP: error, interrupt, resume, ...) replace.
        if w["idx"] >= 0 and (k in seen or ctx.view.get(state.write_key(thread, *k)) is not None):
            if w["value"]["staged"] is not None:
                discarded.append(w["value"]["staged"])
            continue
        seen.add(k)
        accepted.append(w)
    if not accepted and not discarded:
        return Decision()
    return Decision(events=[("threadlog.evt.LangGraphWritesPut",
                             {"threadId": thread, "writes": accepted, "discarded": discarded})])


# -- deletes ---------------------------------------------------------------------------------------
def _thread_is_empty(ctx: Context, thread: str) -> bool:
    for tag in state.THREAD_TAGS:
        for _ in ctx.view.scan(key(tag, thread)):
            return False
    return True


@handles("threadlog.cmd.LangGraphDeleteThread")
def delete_thread(ctx: Context, cmd: dict) -> Decision:
    thread = _thread(ctx, cmd)
    if _thread_is_empty(ctx, thread):
        return Decision()  # deleting an unknown thread is silent and writes nothing
    return Decision(events=[("threadlog.evt.LangGraphThreadDeleted", {"threadId": thread})])


def _checkpoints(ctx: Context, thread: str) -> dict[str, dict[str, dict]]:
    """ns -> checkpoint id -> channel versions, for every checkpoint of the thread."""
    out: dict[str, dict[str, dict]] = defaultdict(dict)
    for k, raw in ctx.view.scan(state.ckpt_prefix(thread)):
        _, ns, cid = state.split_ckpt_key(k)
        out[ns][cid] = _versions(raw)
    return out


def _versions(raw: bytes) -> dict:
    return json.loads(raw)["versions"]


ALL_ORPHANS, OLDER_ORPHANS, NO_ORPHANS = "all", "older", "none"


def _deletion(ctx: Context, thread: str, doomed: set[tuple[str, str]], *, orphan_writes: str,
              whole: frozenset[str] | set[str] = frozenset()) -> Decision:
    """Delete `doomed` (ns, id) checkpoints with their writes, the channel values no
    survivor of their namespaces references, and say which checkpoint is each
    touched namespace's newest afterwards. `orphan_writes`: which writes of
    checkpoints that do not exist go too -- all, those older than their
    namespace's latest checkpoint (a newer one's put may be on its way), none;
    in a namespace of `whole` (every checkpoint doomed), all of them."""
    by_ns = _checkpoints(ctx, thread)
    doomed = {(ns, cid) for ns, cid in doomed if cid in by_ns.get(ns, {})}
    touched = {ns for ns, _ in doomed}
    if orphan_writes != NO_ORPHANS or whole:
        latest = {ns: max(ids) for ns, ids in by_ns.items() if ids}
        for k, _ in ctx.view.scan(state.write_prefix(thread)):
            _, ns, cid, _, _ = state.split_write_key(k)
            if (ns, cid) in doomed or cid in by_ns.get(ns, {}):
                continue
            if ns in whole and ns in touched:
                doomed.add((ns, cid))
            elif orphan_writes == NO_ORPHANS:
                continue
            elif orphan_writes == ALL_ORPHANS or (ns in latest and cid < latest[ns]):
                # Never readable: their checkpoint does not exist (and, older than
                # the latest, is no put still on its way: ids grow with time).
                doomed.add((ns, cid))
    blobs: list[dict] = []
    heads: list[dict] = []
    for ns in sorted(touched):
        survivors = {cid: v for cid, v in by_ns[ns].items() if (ns, cid) not in doomed}
        referenced = {(ch, ver) for versions in survivors.values() for ch, ver in versions.items()}
        for k, _ in ctx.view.scan(state.blob_prefix(thread, ns)):
            _, _, channel, version = state.split_blob_key(k)
            if (channel, version) not in referenced:
                blobs.append({"checkpointNs": ns, "channel": channel, "version": version})
        heads.append({"checkpointNs": ns, "checkpointId": max(survivors) if survivors else None})
    if not doomed:
        return Decision()
    refs = [{"checkpointNs": ns, "checkpointId": cid} for ns, cid in sorted(doomed)]
    return Decision(events=[("threadlog.evt.LangGraphCheckpointsDeleted",
                             {"threadId": thread, "checkpoints": refs, "blobs": blobs, "heads": heads})])


@handles("threadlog.cmd.LangGraphPrune", rules=PRUNE_KEEPS)
def prune(ctx: Context, cmd: dict) -> Decision:
    thread = _thread(ctx, cmd)
    strategy = cmd["strategy"]
    if strategy not in STRATEGIES:
        raise invalid_argument(f"prune strategy must be one of {STRATEGIES}, got {strategy!r}")
    # Rules 9: keep_latest removes whole the namespaces of finished subgraph calls
    # the proposer names (`_calls`); before, the latest checkpoint of every call
    # stayed for good, listed with the thread's. `delete` removes everything anyway.
    calls = _calls(cmd) if strategy == "keep_latest" and ctx.rules >= PRUNES_CALLS else set()
    kept = _kept(cmd, strategy, calls)
    doomed: set[tuple[str, str]] = set()
    for ns, ids in _checkpoints(ctx, thread).items():
        keep = {max(ids)} if strategy == "keep_latest" and ns not in calls else set()
        named = kept.get(ns)
        if keep and named:
            # The newest named is the proposer's latest: it and every checkpoint put
            # since (ids grow with time) stay, their walks going through it.
            keep |= named | {cid for cid in ids if cid >= max(named)}
        doomed |= {(ns, cid) for cid in ids if cid not in keep}
    # Rules 4: keep_latest keeps the writes of a checkpoint newer than the latest:
    # with durability="async" a run's writes can be judged before its put, and a
    # prune in between must not take them (as LangGraph's Postgres saver: "a run
    # appending to the thread meanwhile is safe"). Rules 3 took every orphan.
    orphans = ALL_ORPHANS if strategy == "delete" or ctx.rules < 4 else OLDER_ORPHANS
    return _deletion(ctx, thread, doomed, orphan_writes=orphans, whole=calls)


def _calls(cmd: dict) -> set[str]:
    """The subgraph-call namespaces a keep_latest prune names to remove whole.

    Which calls are finished is read from checkpoint metadata (`parents['']`, the
    root checkpoint a call started from: saved, and no longer the root
    namespace's latest), which only the proposer decodes (the serde's format is
    LangGraph's); the judge takes the list as given. That trusts the proposer no
    more than a `delete` prune does, which removes every namespace. A name must
    be a call's (`node:task`), never the root namespace or a `checkpointer=True`
    subgraph's, whose state outlives each call.
    """
    calls = cmd.get("calls") or []
    for ns in calls:
        if not is_text(ns) or ":" not in ns:
            raise invalid_argument(f"a subgraph call's namespace is 'node:task', got {ns!r}")
    return set(calls)


def _kept(cmd: dict, strategy: str, calls: set[str]) -> dict[str, set[str]]:
    """The checkpoints a keep_latest prune keeps beside each namespace's latest (rules 11).

    A DeltaChannel stores its value only every so many steps (a snapshot); in
    between, LangGraph rebuilds it from the writes of every ancestor back to
    the nearest one storing it (`get_delta_channel_history`). Keeping only the
    latest checkpoint would leave such a channel empty, silently. Which
    channels are delta channels and where their snapshots are is read from
    metadata and values only the proposer decodes, so it names that chain;
    the judge keeps it as named (an id no longer there keeps nothing), with
    every checkpoint at or after the newest it names: the proposer names its
    latest, and a checkpoint put between its listing and this judging walks
    back through that one (a review: keeping only the newest at judging time
    took the listed latest, and the channel read back empty). That
    trusts the proposer no more than keeping fewer checkpoints would: a
    `delete` prune removes them all. Before rules 11 the client refused to
    prune such a thread (the schema then had no `keep`: always empty).
    """
    refs = cmd.get("keep") or []
    if refs and strategy != "keep_latest":
        raise invalid_argument(f"a {strategy!r} prune keeps no checkpoint; got keep={refs!r}")
    kept: dict[str, set[str]] = defaultdict(set)
    for ref in refs:
        ns = _text(ref["checkpointNs"], "checkpoint_ns")
        if ns in calls:
            raise invalid_argument(f"namespace {ns!r} is removed whole by this prune: none of it is kept")
        kept[ns].add(require_id(ref["checkpointId"], "checkpoint id"))
    return kept


@handles("threadlog.cmd.LangGraphDeleteRuns")
def delete_runs(ctx: Context, cmd: dict) -> Decision:
    thread = _thread(ctx, cmd)
    doomed: set[tuple[str, str]] = set()
    for run_id in cmd["runIds"]:
        _text(run_id, "run_id")
        for k, _ in ctx.view.scan(state.runt_prefix(thread, run_id)):
            _, _, ns, cid = state.split_runt_key(k)
            doomed.add((ns, cid))
    return _deletion(ctx, thread, doomed, orphan_writes=NO_ORPHANS)


# -- copy ------------------------------------------------------------------------------------------
# Rules 10: a copy whose one command does not fit in a record is staged, encoded,
# as chunks on the target and committed by a LangGraphCopyStaged.
COPY_STAGED = 10
COPY = "threadlog.cmd.LangGraphCopyThread"


@handles("threadlog.cmd.LangGraphCopyThread")
def copy_thread(ctx: Context, cmd: dict) -> Decision:
    thread = _thread(ctx, cmd)
    return _copy(ctx, thread, cmd, _Values(ctx, thread))


@handles("threadlog.cmd.LangGraphCopyStaged", rules=COPY_STAGED, new=True)
def copy_staged(ctx: Context, cmd: dict) -> Decision:
    """Commit a copy whose LangGraphCopyThread was staged: judged as that command
    would be, in this one record, so the copy stays atomic whatever its size.

    Why staged: staging bounds the value bytes a command carries, not the rest --
    ids, channel versions, one ref per value -- which grows with the thread (4 000
    checkpoints of 60 channels made a 12-25 MB command).

    Why a staged command is consumed whatever it holds: this is the one handler
    that joins and decodes a whole upload (~1 s and ~4x its size in memory for
    12 MB). Were a bad command refused, leaving its chunks, one small forged
    commit could make every judge and every rebuild decode it again, as often as
    it was sent (a review). So once the upload itself checks out (its declared
    size within MAX_STAGED_COPY_BYTES, checked before anything is read; every
    chunk there), the commit is accepted and drops the upload; what the command
    holds decides only `copied` (False: the code and message it was refused with,
    which the client raises; nothing of it is applied)."""
    thread = _thread(ctx, cmd)
    ref = cmd["command"]
    if not 0 < ref["size"] <= state.MAX_STAGED_COPY_BYTES:
        raise invalid_argument(f"a staged copy command holds 1..{state.MAX_STAGED_COPY_BYTES} bytes, "
                               f"not {ref['size']}")
    values = _Values(ctx, thread)
    # Read once, here (also: no value of the command may name its upload).
    data = b"".join(values.check_staged(ref, "the staged copy command", keep=True))
    discard = ("threadlog.evt.LangGraphUploadsDiscarded", {"threadId": thread, "uploads": [ref]})
    try:
        decision = _copy(ctx, thread, _staged_copy(ctx, thread, cmd["sourceThreadId"], data), values)
    except ThreadLogError as exc:
        return Decision(events=[discard], result={"copied": False, "code": exc.code, "message": exc.message})
    decision.events.append(discard)
    decision.result = {"copied": True}
    return decision


def _staged_copy(ctx: Context, thread: str, source: str, data: bytes) -> dict:
    """The LangGraphCopyThread a staged upload holds (`data`), for `source` -> `thread`."""
    codec = default_codec()
    # As the judge does for a proposal's own payload: a schema newer than the rules
    # judging it is what a judge of those rules could not decode, so it is refused
    # alike, or a rebuild by newer code would disagree.
    rules = newer_schemas(codec).get(data[2:HEADER_LEN], 0)
    if rules > ctx.rules:
        raise invalid_argument(f"the staged copy command is of a schema of rules {rules}")
    try:
        _, inner = codec.decode(data, expect=COPY)
    except CodecError as exc:
        raise invalid_argument(f"the staged copy command is not a {COPY}: {exc.message}") from None
    if inner["threadId"] != thread or inner["sourceThreadId"] != source:
        raise invalid_argument("the staged copy command names other threads than its commit: "
                               f"{inner['sourceThreadId']!r} -> {inner['threadId']!r}")
    return inner


def _copy(ctx: Context, thread: str, cmd: dict, values: _Values) -> Decision:
    source = require_id(cmd["sourceThreadId"], "source thread_id")
    if source == thread:
        raise invalid_argument(f"cannot copy thread {thread!r} onto itself")
    for cp in cmd["checkpoints"]:
        _check_checkpoint(values, cp)
    for blob in cmd["blobs"]:
        _check_blob(values, blob)
    for w in cmd["writes"]:
        _check_write(values, w)
    if not (cmd["checkpoints"] or cmd["blobs"] or cmd["writes"]):
        return Decision()
    # Merged into the target: ids are kept, an id the target already holds is replaced.
    return Decision(events=[("threadlog.evt.LangGraphThreadCopied", {
        "threadId": thread, "sourceThreadId": source, "checkpoints": cmd["checkpoints"],
        "blobs": cmd["blobs"], "writes": cmd["writes"]})])
