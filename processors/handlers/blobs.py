"""Blobs: commit a version, delete, abandon -- decided on the blob key's partition.

A put writes its chunks to `<ns>.blobs` first, then sends ONE PutBlob naming
them. Deciding it makes that version current: etag, createdAt (kept from the
version it replaces) and updatedAt are decided here, the manifest is the
event, and -- in the same transaction -- every chunk of the replaced version
gets a tombstone, so compaction reclaims it. Concurrent puts of one key are
ordered by the key's partition: the last committed wins, and each commit
tombstones the one before, so a version that lost leaves no live chunk.
"""

from __future__ import annotations

import math

from threadlog.producers.blob_chunks import MAX_CHUNK, is_version
from threadlog.projections.folds import blob_gc as gc
from threadlog.projections.folds import blobs as state

from threadlog.kernel.errors import invalid_argument
from threadlog.kernel.validation import is_valid_id

from . import ChunkTombstones, Context, Decision, handles

# A sanity bound on chunk counts named by a command (2**20 chunks of 512 KiB = 512 GiB).
MAX_CHUNKS = 1 << 20


def _blob_key(ctx: Context, cmd: dict) -> str:
    k = cmd["key"]
    if not is_valid_id(k):
        raise invalid_argument(f"blob key must be a non-empty well-formed Unicode string, got {k!r}")
    # Every command about a blob must be decided on the partition that owns its
    # state, or two deciders could commit versions of one key concurrently.
    if ctx.key != state.partition_key(k):
        raise invalid_argument(f"a command for blob {k!r} must be keyed {state.partition_key(k)!r}, not {ctx.key!r}")
    return k


def _version(cmd: dict) -> str:
    v = cmd["version"]
    if not is_version(v):
        raise invalid_argument(f"blob version must be 32 lowercase hex digits, got {v!r}")
    return v


def tombstones(blob_key: str, layout: dict | None) -> list[ChunkTombstones]:
    """Tombstones for every chunk of the version `layout` describes."""
    if layout is None or not layout["chunks"]:
        return []
    return [ChunkTombstones(blob_key, layout["version"], len(layout["chunks"]))]


@handles("threadlog.cmd.PutBlob", thread_keyed=False)
def put_blob(ctx: Context, cmd: dict) -> Decision:
    key = _blob_key(ctx, cmd)
    version = _version(cmd)
    chunks = cmd["chunks"]
    if len(chunks) > MAX_CHUNKS:
        raise invalid_argument(f"a blob version may name at most {MAX_CHUNKS} chunks, got {len(chunks)}")
    for i, c in enumerate(chunks):
        if c["partition"] < 0 or c["offset"] < 0 or not 1 <= c["length"] <= MAX_CHUNK:
            raise invalid_argument(f"chunk {i} of blob {key!r} has an impossible location {c}")
    size = cmd["size"]
    if size != sum(c["length"] for c in chunks):
        raise invalid_argument(f"blob {key!r}: size {size} is not the sum of its chunk lengths")
    current = state.current_layout(ctx.view, key)
    if current is not None and current["version"] == version:
        # Already the committed version (a replayed command): deciding it again
        # would tombstone its own chunks.
        return Decision(result=current["record"])
    if gc.is_abandoned(ctx.view, key, version):
        # Its chunks were tombstoned (a GC sweep or the put's own abandon, both
        # judged before this on this partition): a manifest would name nothing.
        raise invalid_argument(f"blob {key!r} version {version} was abandoned and its chunks reclaimed; put it again")
    # Integer epoch ms, like Date.now(); updatedAt never precedes createdAt even
    # if another host's decider clock ran ahead.
    now = math.floor(ctx.now)
    created = current["record"]["createdAt"] if current is not None else now
    ev = {
        "key": key,
        "version": version,
        "etag": version,  # unique per put: an overwrite always changes it
        "size": size,
        "contentType": cmd.get("contentType"),
        "customMetadata": cmd.get("customMetadata"),
        "createdAt": created,
        "updatedAt": max(now, created),
        "chunks": chunks,
    }
    return Decision(
        events=[("threadlog.evt.BlobPut", ev)],
        result=state.record_of(ev),
        records=tombstones(key, current),
    )


@handles("threadlog.cmd.DeleteBlob", thread_keyed=False)
def delete_blob(ctx: Context, cmd: dict) -> Decision:
    key = _blob_key(ctx, cmd)
    current = state.current_layout(ctx.view, key)
    if current is None:
        return Decision()  # deleting an absent blob is silent
    return Decision(
        events=[("threadlog.evt.BlobDeleted", {"key": key, "version": current["version"]})],
        records=tombstones(key, current),
    )


@handles("threadlog.cmd.AbandonBlobVersion", thread_keyed=False)
def abandon_blob_version(ctx: Context, cmd: dict) -> Decision:
    """A put that got no answer to its commit: reclaim its chunks unless it did commit.

    The client sends this after its PutBlob, through the same producer to the
    same partition, so the put was decided (committed or refused) before this.
    """
    key = _blob_key(ctx, cmd)
    version = _version(cmd)
    count = cmd["chunkCount"]
    if not 0 <= count <= MAX_CHUNKS:
        raise invalid_argument(f"chunkCount must be within 0..{MAX_CHUNKS}, got {count}")
    current = state.current_layout(ctx.view, key)
    if current is not None and current["version"] == version:
        return Decision(result=False)  # it is the committed version: keep it
    records = [ChunkTombstones(key, version, count)] if count else []
    # Remembered, so a PutBlob of this version judged later (a put slower than
    # a GC sweep's grace window) is refused instead of naming reclaimed chunks.
    events = [] if gc.is_abandoned(ctx.view, key, version) else [
        ("threadlog.evt.BlobVersionAbandoned", {"key": key, "version": version})]
    return Decision(result=True, events=events, records=records)
