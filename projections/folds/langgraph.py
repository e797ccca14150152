"""LangGraph checkpointer state (threadlog.integrations.langgraph): checkpoints, channel values, pending writes.

Every key below but the run lookup starts with its tag and the thread id, so
the folds of ONE thread's partition are the only writers of a thread's state
and "everything of a thread" is a handful of prefix scans (delete_thread).
The run lookup `RUN (run id, thread, ns, checkpoint id)` holds the thread id
too and is written only by that thread's folds; the client reads it after a
barrier on every partition to find which threads `delete_for_runs` must visit
(handlers never read it: they use the thread-scoped copy `RUNT`).

Values (a checkpoint body, its metadata, a channel value, a pending write) are
bytes from the saver's serde. Small ones are stored inline (base64 in the JSON
record); a large one arrives as chunks staged on the thread's partition
beforehand (`STAGE`, invisible) and the event committing it MOVES the chunks
under the owning record's key (`CHUNK`), so a staged upload is consumed once,
each stored value owns its chunks, and deleting or replacing a value reclaims
them. Nothing here reads a clock or anything outside the view and the event.
"""

from __future__ import annotations

import base64
import json
import logging
import struct
from typing import Any

from threadlog.kernel.errors import unavailable

from ..fold import EventMeta, folds
from ..keys import key, split
from ..reader import StateReader
from ..view import View

log = logging.getLogger("threadlog.fold.langgraph")

# The NUL after "lg" keeps these tags from prefixing (or being prefixed by) any
# other domain's tag.
CKPT = b"lg\x00c"  # (thread, ns, checkpoint id) -> record JSON
HEAD = b"lg\x00h"  # (thread, ns) -> newest checkpoint id (UTF-8)
BLOB = b"lg\x00b"  # (thread, ns, channel, version key) -> value ref JSON
WRITE = b"lg\x00w"  # (thread, ns, checkpoint id, task id, idx) -> {"channel", "taskPath", "value"}
STAGE = b"lg\x00s"  # (thread, upload id, index) -> raw chunk, not yet committed
CHUNK = b"lg\x00k"  # (thread) + owner key + slot + index -> raw chunk of a committed value
RUNT = b"lg\x00r"  # (thread, run id, ns, checkpoint id) -> b"": what handlers read
RUN = b"lg\x00R"  # (run id, thread, ns, checkpoint id) -> b"": the client's lookup of threads by run

# Small records first: an emptiness check stops at the first key it finds.
THREAD_TAGS = (CKPT, HEAD, RUNT, WRITE, BLOB, STAGE, CHUNK)

# Slots of the values a record owns (a checkpoint owns two).
SLOT_BODY = b"c"
SLOT_METADATA = b"m"
SLOT_VALUE = b"v"


# -- keys ----------------------------------------------------------------------------------
def ckpt_key(thread: str, ns: str, checkpoint_id: str) -> bytes:
    return key(CKPT, thread, ns, checkpoint_id)


def ckpt_prefix(thread: str, ns: str | None = None) -> bytes:
    return key(CKPT, thread) if ns is None else key(CKPT, thread, ns)


def split_ckpt_key(k: bytes) -> tuple[str, str, str]:
    thread, ns, checkpoint_id = split(CKPT, k, "sss")
    return thread, ns, checkpoint_id


def head_key(thread: str, ns: str) -> bytes:
    return key(HEAD, thread, ns)


def blob_key(thread: str, ns: str, channel: str, version: str) -> bytes:
    return key(BLOB, thread, ns, channel, version)


def blob_prefix(thread: str, ns: str | None = None) -> bytes:
    return key(BLOB, thread) if ns is None else key(BLOB, thread, ns)


def split_blob_key(k: bytes) -> tuple[str, str, str, str]:
    thread, ns, channel, version = split(BLOB, k, "ssss")
    return thread, ns, channel, version


def write_key(thread: str, ns: str, checkpoint_id: str, task_id: str, idx: int) -> bytes:
    return key(WRITE, thread, ns, checkpoint_id, task_id, float(idx))


def write_prefix(thread: str, ns: str | None = None, checkpoint_id: str | None = None) -> bytes:
    if ns is None:
        return key(WRITE, thread)
    return key(WRITE, thread, ns) if checkpoint_id is None else key(WRITE, thread, ns, checkpoint_id)


def split_write_key(k: bytes) -> tuple[str, str, str, str, int]:
    thread, ns, checkpoint_id, task_id, idx = split(WRITE, k, "ssssn")
    return thread, ns, checkpoint_id, task_id, int(idx)


# The largest copy command that may be staged whole (rules 10): its judge joins
# and decodes it in memory, once (processors/handlers/langgraph.py `copy_staged`).
# ~20 000 checkpoints of 60 channels; a larger source is refused before staging.
MAX_STAGED_COPY_BYTES = 64 * 1024 * 1024


def stage_key(thread: str, upload_id: str, index: int) -> bytes:
    return key(STAGE, thread, upload_id, float(index))


def chunk_key(thread: str, owner: bytes, slot: bytes, index: int) -> bytes:
    # The owner key is itself a complete key (tag + terminated parts), so
    # (owner, slot, index) never collides with another owner's chunks.
    return key(CHUNK, thread) + owner + slot + struct.pack(">I", index)


def runt_prefix(thread: str, run_id: str) -> bytes:
    return key(RUNT, thread, run_id)


def run_prefix(run_id: str) -> bytes:
    return key(RUN, run_id)


def split_run_key(k: bytes) -> tuple[str, str, str, str]:
    run_id, thread, ns, checkpoint_id = split(RUN, k, "ssss")
    return run_id, thread, ns, checkpoint_id


def split_runt_key(k: bytes) -> tuple[str, str, str, str]:
    thread, run_id, ns, checkpoint_id = split(RUNT, k, "ssss")
    return thread, run_id, ns, checkpoint_id


# -- values ----------------------------------------------------------------------------------
def _store_value(view: View, thread: str, owner: bytes, slot: bytes, wire: dict) -> dict[str, Any]:
    """The stored ref of a wire value; a staged one's chunks move under `owner`."""
    staged = wire.get("staged")
    if staged is None:
        return {"type": wire["type"], "data": base64.b64encode(wire["data"] or b"").decode("ascii")}
    for i in range(staged["chunks"]):
        sk = stage_key(thread, staged["uploadId"], i)
        raw = view.get(sk)
        if raw is None:  # the handler checked every chunk: only a corrupt log gets here
            log.error("thread %r: staged chunk %d of upload %s missing at commit", thread, i, staged["uploadId"])
            continue
        view.put(chunk_key(thread, owner, slot, i), raw)
        view.delete(sk)
    # The upload id says which value the chunks under `owner` are: they keep their
    # keys when the value is replaced, so a reader that read this ref, then its
    # chunks, reads the ref again and compares (AsyncThreadLogSaver._datas).
    return {"type": wire["type"], "chunks": staged["chunks"], "size": staged["size"], "upload": staged["uploadId"]}


def _drop_value(view: View, thread: str, owner: bytes, slot: bytes, ref: dict | None) -> None:
    if ref is None:
        return
    for i in range(ref.get("chunks", 0)):
        view.delete(chunk_key(thread, owner, slot, i))


def chunk_keys(thread: str, owner: bytes, slot: bytes, ref: dict) -> list[bytes]:
    """The keys of a stored ref's chunks ([] for a value stored inline)."""
    return [] if "data" in ref else [chunk_key(thread, owner, slot, i) for i in range(ref["chunks"])]


def stored_ref(record: dict, slot: bytes) -> dict:
    """The value ref in `slot` of the record stored at its owner key: a checkpoint's
    body or metadata, a pending write's value, or a channel value (the record is the ref)."""
    if slot == SLOT_BODY:
        return record["body"]
    if slot == SLOT_METADATA:
        return record["metadata"]
    return record["value"] if "channel" in record else record


def joined(ref: dict, chunks: list[bytes | None]) -> bytes | None:
    """The bytes a stored ref names, given what its `chunk_keys` read; None if a
    chunk is missing or the sizes disagree (deleted or replaced since the ref was read)."""
    if "data" in ref:
        return base64.b64decode(ref["data"])
    if any(c is None for c in chunks):
        return None
    data = b"".join(c for c in chunks if c is not None)
    return data if len(data) == ref["size"] else None


# Chunk bytes a tuple query carries at most (the reader asks the rest in reads
# of as many bytes); well under the query service's 48 MiB answer with base64.
TUPLE_CHUNK_BYTES = 8 * 1024 * 1024


def read_tuple(store: StateReader, thread: str, ns: str, checkpoint_id: str | None) -> dict | None:
    """Everything `get_tuple` needs of one checkpoint (the newest of (thread, ns)
    when `checkpoint_id` is None), raw: {"id", "rec", "blobs": [[channel, ref
    JSON | None]], "writes": [[key, JSON]], "chunks": [[key, bytes | None]]}
    with the chunks of its values up to TUPLE_CHUNK_BYTES; None if there is no
    such checkpoint. `store` reads the thread's state (`get`, `scan`): a
    worker answers it as one query (projections/queries.py) where a reader of
    the keys would make a round trip per dependent step. Not one snapshot: the
    record is read again last (changed: all is read again), and the reader
    checks that chunks and sizes agree (`joined`) and reads again."""
    for _ in range(3):
        cid = checkpoint_id
        if cid is None:
            head = store.get(head_key(thread, ns))
            if head is None:
                return None
            cid = head.decode("utf-8")
        ck = ckpt_key(thread, ns, cid)
        rec_raw = store.get(ck)
        if rec_raw is None:
            if checkpoint_id is not None:
                return None
            continue  # deleted since the head was read: read the new head
        rec = json.loads(rec_raw)
        blob_keys = {ch: blob_key(thread, ns, ch, v) for ch, v in rec["versions"].items()}
        blobs = [[ch, store.get(bk)] for ch, bk in blob_keys.items()]
        writes = list(store.scan(write_prefix(thread, ns, cid)))
        owned = [(ck, SLOT_BODY, rec["body"]), (ck, SLOT_METADATA, rec["metadata"])]
        owned += [(blob_keys[ch], SLOT_VALUE, json.loads(raw)) for ch, raw in blobs if raw is not None]
        owned += [(k, SLOT_VALUE, json.loads(raw)["value"]) for k, raw in writes]
        chunks: list[list] = []
        budget = TUPLE_CHUNK_BYTES
        for k in (k for owner, slot, ref in owned for k in chunk_keys(thread, owner, slot, ref)):
            if budget <= 0:
                break  # the reader asks for the rest
            raw = store.get(k)
            chunks.append([k, raw])
            budget -= len(raw or b"")
        # The record once more: a delete or prune folded since it was read took its
        # values away too (one batch), and a value read missing would have been
        # taken for an empty channel -- LangGraph resuming from empty state.
        # Unchanged, nothing that record references was deleted in between.
        if store.get(ck) != rec_raw:
            if checkpoint_id is not None and store.get(ck) is None:
                return None
            continue
        # And the refs: a value replaced in place (a special write such as ERROR,
        # or a blob a copy replaced) keeps its chunks' keys, so chunks read after
        # the replacement joined with earlier ones into bytes never written, of
        # the right size (a review suspected it; tests/test_langgraph_store.py
        # makes it happen). Unchanged refs name the chunks that were read (a
        # write added meanwhile is not in this answer, as if read just before).
        if [[ch, store.get(bk)] for ch, bk in blob_keys.items()] != blobs:
            continue
        now = dict(store.scan(write_prefix(thread, ns, cid)))
        if any(now.get(k) != v for k, v in writes):
            continue
        # Whether its parent is still stored: a keep_latest prune keeps a checkpoint
        # whose parent it deletes, and LangGraph's Postgres saver then says it has
        # no parent (PRUNE_PARENTS_SQL) -- not a parent_config naming a checkpoint
        # that reads back as empty state (a review). Read here, not folded: the
        # judged state of older logs stays what it was.
        parent = rec["parent"]
        gone = parent is not None and store.get(ckpt_key(thread, ns, parent)) is None
        return {"id": cid, "rec": rec_raw, "blobs": blobs, "writes": [[k, v] for k, v in writes], "chunks": chunks,
                "parentGone": gone}
    raise unavailable(f"the latest checkpoint of thread {thread!r} kept changing while being read")


def read_history(store: StateReader, thread: str, ns: str, checkpoint_id: str | None, channels: list[str],
                 inclusive: bool) -> dict:
    """What `get_delta_channel_history` needs, in one query: the raw tuples
    (`read_tuple`'s) of the ancestors of checkpoint `checkpoint_id` (the newest
    of (thread, ns) when None; from the checkpoint itself when `inclusive`),
    nearest first, up to the first where each of `channels` has a stored value
    (its seed): {"tuples": [...], "next": the id to go on from (inclusive), or
    None}. LangGraph's own walk asks `get_tuple` once per ancestor -- through a
    thin client a request each, hundreds per step of a long DeltaChannel thread
    (a review). An answer stops once it carries TUPLE_CHUNK_BYTES (records,
    refs, writes and chunks; one tuple at least); `next` says where the rest
    starts. An ancestor deleted meanwhile ends the walk, as the
    parent chain ends there for LangGraph's walk too."""
    cid = checkpoint_id
    if cid is None:
        head = store.get(head_key(thread, ns))
        if head is None:
            return {"tuples": [], "next": None}
        cid = head.decode("utf-8")
    if not inclusive:
        rec_raw = store.get(ckpt_key(thread, ns, cid))
        cid = json.loads(rec_raw)["parent"] if rec_raw is not None else None
    remaining = set(channels)
    tuples: list[dict] = []
    budget = TUPLE_CHUNK_BYTES
    while cid and remaining:
        if budget <= 0:
            return {"tuples": tuples, "next": cid}
        got = read_tuple(store, thread, ns, cid)
        if got is None:
            break
        tuples.append(got)
        # Every byte it carries: values up to 512 KiB live in the record and refs
        # themselves, not in chunks (counting chunks only, a review's answer
        # carried 84 MB of ancestors and was refused ANSWER_TOO_LARGE).
        budget -= (len(got["rec"]) + sum(len(raw or b"") for _, raw in got["blobs"])
                   + sum(len(raw) for _, raw in got["writes"]) + sum(len(raw or b"") for _, raw in got["chunks"]))
        # Seeded as the reader decides it (a stored value that is not "empty").
        remaining -= {ch for ch, raw in got["blobs"] if raw is not None and json.loads(raw)["type"] != "empty"}
        cid = json.loads(got["rec"])["parent"]
    return {"tuples": tuples, "next": None}


def discard_upload(view: View, thread: str, staged: dict) -> None:
    for i in range(staged["chunks"]):
        view.delete(stage_key(thread, staged["uploadId"], i))


# -- records ---------------------------------------------------------------------------------
def _drop_checkpoint(view: View, thread: str, ns: str, checkpoint_id: str) -> None:
    """Remove a checkpoint record, its value chunks and its run index entries (not its writes)."""
    k = ckpt_key(thread, ns, checkpoint_id)
    old = view.get_json(k)
    if old is None:
        return
    _drop_value(view, thread, k, SLOT_BODY, old["body"])
    _drop_value(view, thread, k, SLOT_METADATA, old["metadata"])
    if old.get("runId") is not None:
        view.delete(key(RUNT, thread, old["runId"], ns, checkpoint_id))
        view.delete(key(RUN, old["runId"], thread, ns, checkpoint_id))
    view.delete(k)


def _put_checkpoint(view: View, thread: str, cp: dict) -> None:
    ns, cid = cp["checkpointNs"], cp["checkpointId"]
    _drop_checkpoint(view, thread, ns, cid)  # a put of an existing id replaces it
    k = ckpt_key(thread, ns, cid)
    view.put_json(k, {
        "parent": cp["parentCheckpointId"],
        "runId": cp["runId"],
        "versions": dict(cp["channelVersions"]),
        "body": _store_value(view, thread, k, SLOT_BODY, cp["body"]),
        "metadata": _store_value(view, thread, k, SLOT_METADATA, cp["metadata"]),
    })
    if cp["runId"] is not None:
        view.put(key(RUNT, thread, cp["runId"], ns, cid), b"")
        view.put(key(RUN, cp["runId"], thread, ns, cid), b"")
    # "Latest" is the greatest id (LangGraph ids sort by time), not the last put.
    hk = head_key(thread, ns)
    head = view.get(hk)
    if head is None or cid > head.decode("utf-8"):
        view.put(hk, cid.encode("utf-8"))


def _put_blob(view: View, thread: str, blob: dict) -> None:
    k = blob_key(thread, blob["checkpointNs"], blob["channel"], blob["version"])
    _drop_value(view, thread, k, SLOT_VALUE, view.get_json(k))
    view.put_json(k, _store_value(view, thread, k, SLOT_VALUE, blob["value"]))


def _drop_blob(view: View, thread: str, ns: str, channel: str, version: str) -> None:
    k = blob_key(thread, ns, channel, version)
    _drop_value(view, thread, k, SLOT_VALUE, view.get_json(k))
    view.delete(k)


def _put_write(view: View, thread: str, w: dict) -> None:
    k = write_key(thread, w["checkpointNs"], w["checkpointId"], w["taskId"], w["idx"])
    old = view.get_json(k)
    if old is not None:
        _drop_value(view, thread, k, SLOT_VALUE, old["value"])
    view.put_json(k, {"channel": w["channel"], "taskPath": w["taskPath"],
                      "value": _store_value(view, thread, k, SLOT_VALUE, w["value"])})


def _drop_writes(view: View, thread: str, ns: str, checkpoint_id: str) -> None:
    for k, raw in list(view.scan(write_prefix(thread, ns, checkpoint_id))):
        _drop_value(view, thread, k, SLOT_VALUE, json.loads(raw)["value"])
        view.delete(k)


# -- folds -----------------------------------------------------------------------------------
@folds("threadlog.evt.LangGraphChunkStaged")
def chunk_staged(view: View, meta: EventMeta, ev: dict) -> None:
    view.put(stage_key(ev["threadId"], ev["uploadId"], ev["index"]), ev["data"])


@folds("threadlog.evt.LangGraphCheckpointPut")
def checkpoint_put(view: View, meta: EventMeta, ev: dict) -> None:
    thread = ev["threadId"]
    _put_checkpoint(view, thread, ev["checkpoint"])
    for blob in ev["blobs"]:
        _put_blob(view, thread, blob)


@folds("threadlog.evt.LangGraphWritesPut")
def writes_put(view: View, meta: EventMeta, ev: dict) -> None:
    thread = ev["threadId"]
    for w in ev["writes"]:
        _put_write(view, thread, w)
    for staged in ev["discarded"]:
        discard_upload(view, thread, staged)


@folds("threadlog.evt.LangGraphThreadDeleted")
def thread_deleted(view: View, meta: EventMeta, ev: dict) -> None:
    thread = ev["threadId"]
    # The run lookup is the one key family not under the thread's prefixes:
    # its entries are found through the thread-scoped copy.
    for k, _ in list(view.scan(key(RUNT, thread))):
        _, run_id, ns, cid = split_runt_key(k)
        view.delete(key(RUN, run_id, thread, ns, cid))
    for tag in THREAD_TAGS:
        for k, _ in list(view.scan(key(tag, thread))):
            view.delete(k)


@folds("threadlog.evt.LangGraphCheckpointsDeleted")
def checkpoints_deleted(view: View, meta: EventMeta, ev: dict) -> None:
    thread = ev["threadId"]
    for ref in ev["checkpoints"]:
        _drop_checkpoint(view, thread, ref["checkpointNs"], ref["checkpointId"])
        _drop_writes(view, thread, ref["checkpointNs"], ref["checkpointId"])
    for ref in ev["blobs"]:
        _drop_blob(view, thread, ref["checkpointNs"], ref["channel"], ref["version"])
    for head in ev["heads"]:
        hk = head_key(thread, head["checkpointNs"])
        if head["checkpointId"] is None:
            view.delete(hk)
        else:
            view.put(hk, head["checkpointId"].encode("utf-8"))


@folds("threadlog.evt.LangGraphThreadCopied")
def thread_copied(view: View, meta: EventMeta, ev: dict) -> None:
    thread = ev["threadId"]
    for cp in ev["checkpoints"]:
        _put_checkpoint(view, thread, cp)
    for blob in ev["blobs"]:
        _put_blob(view, thread, blob)
    for w in ev["writes"]:
        _put_write(view, thread, w)


@folds("threadlog.evt.LangGraphUploadsDiscarded")
def uploads_discarded(view: View, meta: EventMeta, ev: dict) -> None:
    for staged in ev["uploads"]:
        discard_upload(view, ev["threadId"], staged)
