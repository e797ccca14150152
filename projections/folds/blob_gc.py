"""Blob garbage collection: claims, fences and abandoned versions (threadlog/blob_gc.py drives them).

- CLAIM (blob partition): `blob key -> {"sweepId", "version"}` of the latest
  sweep that claimed the key. A CollectBlob is accepted only for the claim
  standing when it is judged, so a later sweep's claim seals every earlier
  sweep's pending collect of that key (recovery after a sweep died).
- FENCE (each events partition): `fence key -> {"sweepId", "keys"}` while a
  sweep's fence stands there; the history of which blob keys are fenced, by
  offset, is in the global id index (kind BLOB_GC_FENCE, "thread" = the fence
  key), so a collect decided on another partition reads it as of fixed
  positions.
- COLLECTED (blob partition): `blob key -> offset` of the last collect that
  deleted it; MARKER (each events partition): `(blob key, partition) ->` that
  offset, left when the sweep lowers its fence. A checkpoint naming a marked
  key is accepted only if it names positions past the collect and the key
  exists again as of them (a put after the collect): the fence comes down,
  but a slow proposer holding positions from before the delete never gets
  a reference to a deleted blob through.
- ABANDONED (blob partition): `(blob key, version)` of versions whose chunks
  were tombstoned without a commit; a late PutBlob naming one is refused.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable

from threadlog.kernel.partitioning import partition_for

from .. import global_ids
from ..fold import EventMeta, folds
from ..keys import key, split
from ..reader import StateReader
from ..view import View

CLAIM = b"bgc\x00c"
FENCE = b"bgc\x00f"
ABANDONED = b"bgc\x00a"
COLLECTED = b"bgc\x00d"
MARKER = b"bgc\x00m"


def fence_key(sweep_id: str, partition: int, partitions: int) -> str:
    """The partition key of sweep `sweep_id`'s fence on events partition `partition`.

    Deterministic (the first `blob-gc:<sweep>:<n>` that lands there), so the
    judge of a collect recomputes every fence key from the sweep id alone and
    a forged payload cannot name fewer partitions than exist.
    """
    n = 0
    while True:
        candidate = f"blob-gc:{sweep_id}:{n}"
        if partition_for(candidate, partitions) == partition:
            return candidate
        n += 1


def claim_key(blob_key: str) -> bytes:
    return key(CLAIM, blob_key)


def fence_record_key(fence: str) -> bytes:
    return key(FENCE, fence)


def collected_key(blob_key: str) -> bytes:
    return key(COLLECTED, blob_key)


def marker_key(blob_key: str, partition: int) -> bytes:
    return key(MARKER, blob_key, float(partition))


def collected_at(view: StateReader, blob_key: str) -> int | None:
    """The offset (on the blob's partition) of the last collect that deleted `blob_key`."""
    raw = view.get(collected_key(blob_key))
    return None if raw is None else decode_collected(raw)


def decode_collected(raw: bytes) -> int:
    return int(raw)


def marker(view: StateReader, blob_key: str, partition: int) -> int | None:
    """The collect offset left on events partition `partition` for `blob_key`, if any."""
    raw = view.get(marker_key(blob_key, partition))
    return None if raw is None else int(raw)


def abandoned_key(blob_key: str, version: str) -> bytes:
    return key(ABANDONED, blob_key, version)


def get_claim(view: StateReader, blob_key: str) -> dict | None:
    return view.get_json(claim_key(blob_key))


def is_abandoned(view: StateReader, blob_key: str, version: str) -> bool:
    return view.get(abandoned_key(blob_key, version)) is not None


def any_marker(view: View) -> bool:
    """Is any collect marker (of any partition) left in `view`? Most partitions
    never had a blob collected, and then no key needs asking. Stops at the first
    marker: they are kept for good, and a partition may hold many."""
    return view.has_prefix(MARKER)


def any_standing_fence(view: StateReader, belongs: Callable[[str], bool]) -> bool:
    """Does a fence whose fence key `belongs` stand in `view`? Reads keys only."""
    return any(belongs(split(FENCE, k, "s")[0]) for k, _raw in view.scan(FENCE))


def standing_fences(view: StateReader) -> list[dict]:
    """Every fence standing in `view`: `{"fenceKey", "sweepId", "keys"}`."""
    return fences_of(view.scan(FENCE))


def fences_of(scanned: Iterable[tuple[bytes, bytes]]) -> list[dict]:
    """The fences of a scan of FENCE."""
    return [json.loads(raw) for _k, raw in scanned]


@folds("threadlog.evt.BlobGcClaimed")
def claimed(view: View, meta: EventMeta, ev: dict) -> None:
    view.put_json(claim_key(ev["key"]), {"sweepId": ev["sweepId"], "version": ev.get("version")})


@folds("threadlog.evt.BlobGcFenced")
def fenced(view: View, meta: EventMeta, ev: dict) -> None:
    fence = ev["fenceKey"]
    for blob in ev["keys"]:
        global_ids.mark(view, meta, global_ids.BLOB_GC_FENCE, blob, fence, ev["held"])
    if ev["held"]:
        view.put_json(fence_record_key(fence), {"fenceKey": fence, "sweepId": ev["sweepId"], "keys": ev["keys"]})
    else:
        view.delete(fence_record_key(fence))
        for blob, offset in (ev.get("collected") or {}).items():
            k = marker_key(blob, meta.partition)
            old = view.get(k)
            view.put(k, str(max(offset, 0 if old is None else int(old))).encode())


@folds("threadlog.evt.BlobGcCollected")
def collected(view: View, meta: EventMeta, ev: dict) -> None:
    view.put(collected_key(ev["key"]), str(meta.offset).encode())


@folds("threadlog.evt.BlobVersionAbandoned")
def abandoned(view: View, meta: EventMeta, ev: dict) -> None:
    view.put(abandoned_key(ev["key"], ev["version"]), b"\x01")
