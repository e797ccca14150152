"""Blobs: the current version of each blob key -- its public record and where its chunks are.

Two values per blob key, written together by one fold:
- RECORD: the public record (`key, size, etag, contentType?, customMetadata?,
  createdAt, updatedAt`), what `head` and `list` return; ordered by blob key
  bytes, so `list` is one prefix scan;
- LAYOUT: the record plus the version id and the chunk locations
  `[partition, offset, length]`, what `get` fetches by and the decider
  tombstones when the version is replaced or deleted.
"""

from __future__ import annotations

from typing import Any

from .. import global_ids
from ..fold import EventMeta, folds
from ..keys import enc_str, key
from ..view import View
from . import blob_gc

# The NUL after "blob" keeps these tags from prefixing any other domain's keys
# (key(b"blob", s) escapes a NUL in s), and a prefix scan of RECORD from
# touching anything else.
RECORD = b"blob\x00r"
LAYOUT = b"blob\x00l"


def partition_key(blob_key: str) -> str:
    """The synthetic partition key of a blob's commands and events (not a thread id)."""
    return f"blob:{blob_key}"


def record_key(blob_key: str) -> bytes:
    return key(RECORD, blob_key)


def layout_key(blob_key: str) -> bytes:
    return key(LAYOUT, blob_key)


def record_scan_prefix(prefix: str) -> bytes:
    """RocksDB prefix of every record whose blob key starts with `prefix` (literally).

    The escaped UTF-8 of `prefix` without its terminator: escaping maps bytes
    one to one and never yields a bare NUL, so `enc(k)` starts with it exactly
    when the UTF-8 of `k` starts with the UTF-8 of `prefix`.
    """
    return RECORD + enc_str(prefix)[:-2]


def record_of(ev: dict) -> dict[str, Any]:
    """The public record of a BlobPut event (optional fields absent, never None)."""
    rec: dict[str, Any] = {"key": ev["key"], "size": ev["size"], "etag": ev["etag"]}
    if ev.get("contentType") is not None:
        rec["contentType"] = ev["contentType"]
    if ev.get("customMetadata") is not None:
        rec["customMetadata"] = dict(ev["customMetadata"])
    rec["createdAt"] = ev["createdAt"]
    rec["updatedAt"] = ev["updatedAt"]
    return rec


def current_layout(view: View, blob_key: str) -> dict | None:
    """{"record", "version", "chunks": [[partition, offset, length], ...]} or None."""
    return view.get_json(layout_key(blob_key))


@folds("threadlog.evt.BlobPut")
def blob_put(view: View, meta: EventMeta, ev: dict) -> None:
    if view.get(layout_key(ev["key"])) is None:
        # Existence history: a checkpoint naming a garbage-collected key asks it
        # as of its own positions (processors/handlers/blob_gc.py).
        global_ids.mark(view, meta, global_ids.BLOB_EXISTS, ev["key"], partition_key(ev["key"]), True)
    rec = record_of(ev)
    view.put_json(record_key(ev["key"]), rec)
    view.put_json(layout_key(ev["key"]), {
        "record": rec,
        "version": ev["version"],
        "chunks": [[c["partition"], c["offset"], c["length"]] for c in ev["chunks"]],
    })


@folds("threadlog.evt.BlobDeleted")
def blob_deleted(view: View, meta: EventMeta, ev: dict) -> None:
    view.delete(record_key(ev["key"]))
    view.delete(layout_key(ev["key"]))
    # A GC claim only matters while its blob exists (folds/blob_gc.py).
    view.delete(blob_gc.claim_key(ev["key"]))
    global_ids.mark(view, meta, global_ids.BLOB_EXISTS, ev["key"], partition_key(ev["key"]), False)
