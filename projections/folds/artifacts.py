"""Artifacts: records on their thread's partition, plus global indexes every host folds.

- `artR` (thread, artifact) -> the artifact record (JSON, what `get` returns);
- `artI` (artifact) -> thread: get/delete by id, and the "one thread per id" check of save;
- `artB` (run, thread, artifact) -> b"": a run's artifacts (list, delete_for_run);
- `artH` (thread, artifact) -> the blob key the artifact holds, and `artC` (blob
  key, thread) -> how many of the thread's artifacts hold it: blob garbage
  collection keeps a blob an artifact names (global_ids.ARTIFACT_BLOB). Saves
  of judging rules 4 on hold their blob; an older save holds none (its log was
  judged without it, and a rebuild must reach the same GC verdicts).
- `artO` (thread, artifact) -> the offset of the copy's last save, 8 bytes big-endian:
  a copy removal of judging rules 8 spares a copy saved at or after the position
  its save saw (processors/handlers/artifacts.py). Written only by saves judged by
  rules 8 on (the event's `tracksOffset`), so state folded by older code -- a
  store or snapshot an upgraded judge starts from -- holds exactly what a
  rebuild of the same log by this code holds.
"""

from __future__ import annotations

import struct

from .. import global_ids
from ..fold import EventMeta, folds
from ..keys import key, split
from ..reader import StateReader
from ..view import View
from . import presence

ARTIFACT_RECORD = b"artR"
ARTIFACT_INDEX = b"artI"
ARTIFACT_BY_RUN = b"artB"

ARTIFACT_HOLD = b"artH"
BLOB_HOLDS = b"artC"
SAVED_AT = b"artO"

OPTIONAL = ("blobKey", "sourceUrl")


def record_key(thread_id: str, artifact_id: str) -> bytes:
    return key(ARTIFACT_RECORD, thread_id, artifact_id)


def thread_prefix(thread_id: str) -> bytes:
    return key(ARTIFACT_RECORD, thread_id)


def index_key(artifact_id: str) -> bytes:
    return key(ARTIFACT_INDEX, artifact_id)


def by_run_key(run_id: str, thread_id: str, artifact_id: str) -> bytes:
    return key(ARTIFACT_BY_RUN, run_id, thread_id, artifact_id)


def run_prefix(run_id: str, thread_id: str | None = None) -> bytes:
    return key(ARTIFACT_BY_RUN, run_id) if thread_id is None else key(ARTIFACT_BY_RUN, run_id, thread_id)


def split_by_run(k: bytes) -> tuple[str, str, str]:
    run_id, thread_id, artifact_id = split(ARTIFACT_BY_RUN, k, "sss")
    return run_id, thread_id, artifact_id


def hold_key(thread_id: str, artifact_id: str) -> bytes:
    return key(ARTIFACT_HOLD, thread_id, artifact_id)


def holds_key(blob_key: str, thread_id: str) -> bytes:
    return key(BLOB_HOLDS, blob_key, thread_id)


def saved_at_key(thread_id: str, artifact_id: str) -> bytes:
    return key(SAVED_AT, thread_id, artifact_id)


def saved_at(view: StateReader, thread_id: str, artifact_id: str) -> int | None:
    """Where the thread's copy was last saved, if by judging rules 8 on."""
    raw = view.get(saved_at_key(thread_id, artifact_id))
    return None if raw is None else struct.unpack(">Q", raw)[0]


def split_holds(k: bytes) -> tuple[str, str]:
    blob_key, thread_id = split(BLOB_HOLDS, k, "ss")
    return blob_key, thread_id


def _hold(view: View, meta: EventMeta, thread_id: str, artifact_id: str, blob: str | None) -> None:
    """Make the artifact hold `blob` (None: no blob), releasing what it held."""
    k = hold_key(thread_id, artifact_id)
    raw = view.get(k)
    old = None if raw is None else raw.decode("utf-8")
    if old == blob:
        return
    if old is not None:
        global_ids.count(view, meta, holds_key(old, thread_id), global_ids.ARTIFACT_BLOB, old, thread_id, -1)
    if blob is None:
        view.delete(k)
        return
    view.put(k, blob.encode("utf-8"))
    global_ids.count(view, meta, holds_key(blob, thread_id), global_ids.ARTIFACT_BLOB, blob, thread_id, 1)


def thread_of(view: StateReader, artifact_id: str) -> str | None:
    raw = view.get(index_key(artifact_id))
    return None if raw is None else raw.decode("utf-8")


@folds("threadlog.evt.ArtifactSaved")
def artifact_saved(view: View, meta: EventMeta, ev: dict) -> None:
    record = {k: v for k, v in ev["artifact"].items() if not (k in OPTIONAL and v is None)}
    thread_id, artifact_id = record["threadId"], record["artifactId"]
    old = view.get_json(record_key(thread_id, artifact_id))
    if old is None:
        presence.add(view, thread_id, presence.ARTIFACT)
    elif old["runId"] != record["runId"]:
        view.delete(by_run_key(old["runId"], thread_id, artifact_id))
    view.put_json(record_key(thread_id, artifact_id), record)
    view.put(index_key(artifact_id), thread_id.encode("utf-8"))
    view.put(by_run_key(record["runId"], thread_id, artifact_id), b"")
    if old is None:
        global_ids.mark(view, meta, global_ids.ARTIFACT, artifact_id, thread_id, True)
    _hold(view, meta, thread_id, artifact_id, record.get("blobKey") if ev.get("holdsBlob") else None)
    # No save of older rules follows one that tracked (a partition's rules only go
    # up), so an untracked save has no offset to clear.
    if ev.get("tracksOffset"):
        view.put(saved_at_key(thread_id, artifact_id), struct.pack(">Q", meta.offset))


@folds("threadlog.evt.ArtifactDeleted")
def artifact_deleted(view: View, meta: EventMeta, ev: dict) -> None:
    thread_id, artifact_id = ev["threadId"], ev["artifactId"]
    old = view.get_json(record_key(thread_id, artifact_id))
    if old is None:
        return
    view.delete(record_key(thread_id, artifact_id))
    view.delete(by_run_key(old["runId"], thread_id, artifact_id))
    if thread_of(view, artifact_id) == thread_id:
        view.delete(index_key(artifact_id))
    global_ids.mark(view, meta, global_ids.ARTIFACT, artifact_id, thread_id, False)
    _hold(view, meta, thread_id, artifact_id, None)
    view.delete(saved_at_key(thread_id, artifact_id))
    presence.add(view, thread_id, presence.ARTIFACT, -1)
