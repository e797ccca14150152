"""Checkpoints: records, heads, writer leases and fences, the id index, blob references.

Every key but the id index and the reference counts belongs to one thread, so
only the folds of that thread's partition ever write it. The two cross-thread
read models are keyed so that this stays true:

- the id index is `(checkpoint id, thread id)`, not `id -> thread`: a lookup by
  id is a prefix scan, and a delete removes only its own thread's entry (if two
  threads ever hold one id -- the documented cross-partition race -- deleting
  one does not orphan the other);
- blob references are counted per `(blob key, thread id)` and summed on read. A
  single counter per blob key would be written by the folds of many partitions,
  and the decider's buffered read-modify-write of it could lose another
  partition's concurrent increment.

Lease expiry is never decided here: the decider compares `expiresAt` with its
own clock, and the events carry every time they need.
"""

from __future__ import annotations

import json

from threadlog.kernel.checkpoint_rules import blob_keys, record_json

from .. import global_ids
from ..fold import EventMeta, folds
from ..keys import key, split
from ..reader import StateReader
from ..view import View
from . import presence
from .messages import transcript_key

RECORD = b"cpr"  # (thread, createdAt, id) -> checkpoint JSON: a scan lists a thread in order
INDEX = b"cpi"  # (id, thread) -> the record's key
HEAD = b"cph"  # (thread) -> head id
FENCE = b"cpf"  # (thread) -> last fence granted (never reused)
LEASE = b"cpw"  # (thread) -> {"ownerToken", "fence", "expiresAt"} of the latest grant, until released
REFS = b"cpb"  # (blob key, thread) -> how many of the thread's checkpoints reference the blob


def record_key(thread_id: str, created_at: float, checkpoint_id: str) -> bytes:
    # The double orders every float and every int up to 2**53 exactly; an int
    # beyond that shares its double with neighbours, so its exact distance from
    # that double (a small int) breaks the tie before the id does. (+ 0.0 makes
    # -0.0 equal to 0.)
    approx = float(created_at) + 0.0
    exact = created_at - int(approx) if isinstance(created_at, int) else 0
    return key(RECORD, thread_id, approx, float(exact), checkpoint_id)


def thread_prefix(thread_id: str) -> bytes:
    return key(RECORD, thread_id)


def index_key(checkpoint_id: str, thread_id: str) -> bytes:
    return key(INDEX, checkpoint_id, thread_id)


def index_prefix(checkpoint_id: str) -> bytes:
    return key(INDEX, checkpoint_id)


def head_key(thread_id: str) -> bytes:
    return key(HEAD, thread_id)


def fence_key(thread_id: str) -> bytes:
    return key(FENCE, thread_id)


def lease_key(thread_id: str) -> bytes:
    return key(LEASE, thread_id)


def refs_key(blob_key: str, thread_id: str) -> bytes:
    return key(REFS, blob_key, thread_id)


def split_refs_key(k: bytes) -> tuple[str, str]:
    blob, thread = split(REFS, k, "ss")
    return blob, thread


# -- reads shared by handlers and the store facade ---------------------------------
def threads_holding(view: StateReader, checkpoint_id: str) -> list[str]:
    """Threads with a checkpoint of this id (normally zero or one)."""
    prefix = index_prefix(checkpoint_id)
    return [split(INDEX, k, "ss")[1] for k, _ in view.scan(prefix)]


def find_record(view: StateReader, checkpoint_id: str) -> list[bytes]:
    """The stored records of checkpoint `checkpoint_id` in `view`, by thread id
    (ids are unique: at most one). A query (projections/queries.py): a thin
    client's `checkpoints.get` is one request per owner instead of a scan,
    then a get. Raw bytes: the record holds the user's JSON, which only the
    client decodes."""
    found = (record_bytes(view, thread, checkpoint_id) for thread in threads_holding(view, checkpoint_id))
    return [raw for raw in found if raw is not None]


def get_record(view: StateReader, thread_id: str, checkpoint_id: str) -> dict | None:
    raw = record_bytes(view, thread_id, checkpoint_id)
    return None if raw is None else json.loads(raw)


def record_bytes(view: StateReader, thread_id: str, checkpoint_id: str) -> bytes | None:
    rk = view.get(index_key(checkpoint_id, thread_id))
    return None if rk is None else view.get(rk)


def get_head(view: StateReader, thread_id: str) -> str | None:
    return decode_head(view.get(head_key(thread_id)))


def decode_head(raw: bytes | None) -> str | None:
    """A thread's head checkpoint id, from its `head_key` value (None: no head)."""
    return None if raw is None else raw.decode("utf-8")


def get_fence(view: StateReader, thread_id: str) -> int:
    raw = view.get(fence_key(thread_id))
    return 0 if raw is None else int(raw)


def get_lease(view: StateReader, thread_id: str) -> dict | None:
    raw = view.get(lease_key(thread_id))
    return None if raw is None else json.loads(raw)


# -- folds ---------------------------------------------------------------------------
def _store(view: View, meta: EventMeta, wire: dict) -> None:
    """Store a checkpoint (as its Avro record) and make it the head of its thread."""
    thread, cid = wire["threadId"], wire["id"]
    rk = record_key(thread, wire["createdAt"], cid)
    view.put(rk, record_json(wire))
    view.put(index_key(cid, thread), rk)
    global_ids.mark(view, meta, global_ids.CHECKPOINT, cid, thread, True)
    view.put(head_key(thread), cid.encode("utf-8"))
    for blob in blob_keys(wire):
        _add_ref(view, meta, blob, thread, 1)
    presence.add(view, thread, presence.CHECKPOINT, 1)


def _add_ref(view: View, meta: EventMeta, blob: str, thread: str, delta: int) -> None:
    # The count is what reads sum; the history (referenced / not, by offset)
    # is what a blob GC decision on another partition reads as of fixed
    # positions (processors/handlers/blob_gc.py).
    global_ids.count(view, meta, refs_key(blob, thread), global_ids.BLOB_REF, blob, thread, delta)


@folds("threadlog.evt.CheckpointWriterAcquired")
def writer_acquired(view: View, meta: EventMeta, ev: dict) -> None:
    thread = ev["threadId"]
    view.put(fence_key(thread), str(max(ev["fence"], get_fence(view, thread))).encode())
    view.put_json(lease_key(thread), {"ownerToken": ev["ownerToken"], "fence": ev["fence"],
                                      "expiresAt": ev["expiresAt"]})


@folds("threadlog.evt.CheckpointWriterRenewed")
def writer_renewed(view: View, meta: EventMeta, ev: dict) -> None:
    lease = get_lease(view, ev["threadId"])
    if lease and lease["ownerToken"] == ev["ownerToken"] and lease["fence"] == ev["fence"]:
        lease["expiresAt"] = ev["expiresAt"]
        view.put_json(lease_key(ev["threadId"]), lease)


@folds("threadlog.evt.CheckpointWriterReleased")
def writer_released(view: View, meta: EventMeta, ev: dict) -> None:
    lease = get_lease(view, ev["threadId"])
    if lease and lease["ownerToken"] == ev["ownerToken"] and lease["fence"] == ev["fence"]:
        view.delete(lease_key(ev["threadId"]))


@folds("threadlog.evt.CheckpointAppended")
def checkpoint_appended(view: View, meta: EventMeta, ev: dict) -> None:
    _store(view, meta, ev["checkpoint"])


@folds("threadlog.evt.CheckpointHeadDeleted")
def checkpoint_head_deleted(view: View, meta: EventMeta, ev: dict) -> None:
    thread, cid = ev["threadId"], ev["checkpointId"]
    cp = get_record(view, thread, cid)
    if cp is None:  # pragma: no cover - the decider only deletes an existing head
        return
    view.delete(record_key(thread, cp["createdAt"], cid))
    view.delete(index_key(cid, thread))
    global_ids.mark(view, meta, global_ids.CHECKPOINT, cid, thread, False)
    parent = cp.get("parentCheckpointId")
    if parent is not None:
        view.put(head_key(thread), parent.encode("utf-8"))
    else:
        view.delete(head_key(thread))
    for blob in blob_keys(cp):
        _add_ref(view, meta, blob, thread, -1)
    presence.add(view, thread, presence.CHECKPOINT, -1)


@folds("threadlog.evt.CheckpointForked")
def checkpoint_forked(view: View, meta: EventMeta, ev: dict) -> None:
    root = ev["checkpoint"]
    _store(view, meta, root)
    # The destination transcript becomes the copied conversation, in the same
    # event as the root: a fork is never visible half-done.
    view.put(transcript_key(root["threadId"]), root["conversation"].encode("utf-8"))
    presence.mark(view, root["threadId"], presence.TRANSCRIPT)
