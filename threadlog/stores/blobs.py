"""`tl.blobs`: keyed binary objects of any size on Kafka (SPEC section 10).

put: the body is streamed into chunk records on `<ns>.blobs` (never held
whole), then one PutBlob command commits the version on the blob key's
partition (processors/handlers/blobs.py). get: read barrier on that
partition, the manifest from the projection, then the chunks fetched at their
offsets (producers/blob_chunks.py), verified to be the manifest's version.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, cast

from ..blob_gc import DEFAULT_GRACE_MS, GcReport, collect_garbage
from ..kernel.errors import OUTCOME_UNKNOWN, UNAVAILABLE, ThreadLogError, invalid_argument, unavailable
from ..kernel.validation import is_int, is_valid_id, require_id
from ..producers.blob_chunks import ChunkGone, ChunkReader, ChunkRef, ChunkSink, ChunkWriter, new_version
from ..projections.folds import blobs as state
from ..types import Blob, BlobInfo, BlobListPage, BlobRange
from .base import StoreFacade

if TYPE_CHECKING:
    from ..session import Session
    from ..types import BlobReference

log = logging.getLogger("threadlog.blobs")

BlobBody = bytes | bytearray | memoryview | str | Iterable[bytes] | AsyncIterable[bytes]

# Blob keys are paths (sandbox-files/sha256/<64 hex>, artifacts/<run>/<id>): 64 KiB
# leaves every chunk record far under the blobs topic's record limit.
MAX_KEY_BYTES = 64 * 1024

_CURSOR_PREFIX = "b1."
# A get whose chunks were compacted away re-reads the manifest; each retry
# means a newer version committed meanwhile, so a few attempts suffice.
_READ_ATTEMPTS = 5
# How long a put that got no answer waits for its abandon command.
_ABANDON_TIMEOUT = 5.0


class BlobStore(StoreFacade):
    def __init__(self, session: Session, references: Callable[[], Awaitable[list[BlobReference]]]) -> None:
        super().__init__(session)
        self._references = references  # the checkpoint store's reference counts (the sweep's input)
        self._sink: ChunkSink | None = None
        self._reader: ChunkReader | None = None

    # -- plumbing ------------------------------------------------------------------
    def _chunk_sink(self) -> ChunkSink:
        if self._sink is None:
            rt = self._session.runtime
            assert rt.layout is not None
            self._sink = ChunkSink(self._session.opts.bootstrap_servers, rt.topics.blobs, rt.layout.blobs, rt.codec,
                                   rt.client_id, self._session.opts.request_timeout, kafka=self._session.opts.kafka)
        return self._sink

    def _chunk_reader(self) -> ChunkReader:
        if self._reader is None:
            rt = self._session.runtime
            assert rt.layout is not None
            self._reader = ChunkReader(self._session.opts.bootstrap_servers, rt.topics.blobs, rt.layout.blobs, rt.codec,
                                       rt.client_id, self._session.opts.request_timeout, kafka=self._session.opts.kafka)
        return self._reader

    def close(self) -> None:
        """Flush pending chunk writes and tombstones; close the readers (called by ThreadLog)."""
        if self._sink is not None:
            self._sink.close()
            self._sink = None
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    # -- writes --------------------------------------------------------------------
    async def put(
        self,
        key: str,
        body: BlobBody,
        *,
        content_type: str | None = None,
        custom_metadata: Mapping[str, str] | None = None,
        expected_length: int | None = None,
    ) -> BlobInfo:
        require_id(key, "blob key")
        key_bytes = len(key.encode("utf-8"))
        if key_bytes > MAX_KEY_BYTES:
            # Every chunk record carries the key twice (its Kafka key and its blobKey):
            # a key near the record limit failed in the producer, without a code.
            raise invalid_argument(f"a blob key may be at most {MAX_KEY_BYTES} bytes of UTF-8, got {key_bytes}")
        if content_type is not None:
            _require_text(content_type, "content_type")
        metadata = None if custom_metadata is None else _metadata(custom_metadata)
        if expected_length is not None and (not is_int(expected_length) or expected_length < 0):
            raise invalid_argument(f"expected_length must be an int >= 0 or None, got {expected_length!r}")
        pieces = _pieces(body)  # refuses an unsupported body before anything is written
        self._session.check_open()

        version = new_version()
        writer = ChunkWriter(self._chunk_sink(), key, version)
        try:
            async for piece in pieces:
                await writer.write(piece)
            refs = await writer.finish()
        except BaseException:
            # Nothing will name these chunks: tombstone them now.
            writer.discard()
            raise
        if expected_length is not None and expected_length != writer.size:
            # Only a hint (SPEC): the body's real length is what is stored.
            log.debug("blob %r: expected_length %d, body had %d bytes", key, expected_length, writer.size)
        payload = {
            "key": key,
            "version": version,
            "size": writer.size,
            "contentType": content_type,
            "customMetadata": metadata,
            "chunks": [r.as_avro() for r in refs],
        }
        try:
            return await self._send("threadlog.cmd.PutBlob", state.partition_key(key), payload)
        except ThreadLogError as exc:
            if exc.code in (UNAVAILABLE, OUTCOME_UNKNOWN):
                # The PutBlob may have been written and may still be accepted:
                # tombstoning its chunks now would leave a committed version
                # without content. The abandon is judged after it on the same
                # partition and keeps the chunks if it committed.
                await self._abandon(key, version, len(refs))
            else:
                writer.discard()  # refused: nothing was committed
            raise
        except BaseException:
            await asyncio.shield(self._abandon(key, version, len(refs)))
            raise

    async def _abandon(self, key: str, version: str, count: int) -> None:
        """The commit's outcome is unknown: let the decider tombstone the chunks unless it committed.

        If this gets no answer either, the chunks stay as orphans: never named
        by a manifest, so never served, but not reclaimed (README, Blobs).
        """
        try:
            assert self._session.bus is not None
            await self._session.bus.send("threadlog.cmd.AbandonBlobVersion", state.partition_key(key),
                                    {"key": key, "version": version, "chunkCount": count},
                                    timeout=_ABANDON_TIMEOUT)
        except Exception as exc:
            log.warning("blob %r version %s: commit and abandon both unanswered; %d chunk(s) may be orphaned: %s",
                        key, version, count, exc)

    async def delete(self, key: str) -> None:
        require_id(key, "blob key")
        await self._send("threadlog.cmd.DeleteBlob", state.partition_key(key), {"key": key})

    async def gc(self, *, grace_ms: int = DEFAULT_GRACE_MS, dry_run: bool = False) -> GcReport:
        """One garbage-collection sweep (threadlog/blob_gc.py): delete every blob no
        stored checkpoint references whose last put is at least `grace_ms` old, and
        reclaim the chunks of puts that never committed (as old). Every deletion is
        judged against the reference counts in log order: a blob a checkpoint
        references is never deleted. `dry_run`: only count, write nothing."""
        return await collect_garbage(self._session, self._references, grace_ms=grace_ms, dry_run=dry_run)

    # -- reads ---------------------------------------------------------------------
    async def head(self, key: str) -> BlobInfo | None:
        require_id(key, "blob key")
        raw = await self._read(state.record_key(key), state.partition_key(key))
        return None if raw is None else json.loads(raw)

    async def get(self, key: str, *, range: BlobRange | None = None) -> Blob | None:
        require_id(key, "blob key")
        wanted_range = _range(range)  # a malformed range is refused before the key is looked up
        # The stored BlobInfo plus body (and range): a Blob.
        return cast("Blob | None", await self._get(key, wanted_range))

    async def _get(self, key: str, wanted_range: tuple[int, int | None] | None) -> dict[str, Any] | None:
        gone_version = None
        for _ in range(_READ_ATTEMPTS):
            layout = await self._layout(key)
            if layout is None:
                return None
            if layout["version"] == gone_version:
                raise unavailable(f"blob {key!r} version {gone_version}: a chunk is missing from "
                                  f"{self._session.runtime.topics.blobs} (the log lost data)", retryable=False)
            record = layout["record"]
            size = record["size"]
            if wanted_range is None:
                start, length = 0, size
            else:
                start, length = _clamp(wanted_range, size)
            try:
                body = await self._read_body(key, layout, start, length)
            except ChunkGone as exc:
                log.info("blob %r: %s; re-reading the manifest", key, exc)
                gone_version = layout["version"]
                continue
            out = dict(record)
            if wanted_range is not None:
                out["range"] = {"offset": start, "length": length}
            out["body"] = body
            return out
        raise unavailable(f"blob {key!r} was replaced {_READ_ATTEMPTS} times while being read")

    async def _layout(self, key: str) -> dict | None:
        """The current manifest of `key`, reflecting every write acknowledged before this call."""
        raw = await self._read(state.layout_key(key), state.partition_key(key))
        return None if raw is None else json.loads(raw)

    async def _read_body(self, key: str, layout: dict, start: int, length: int) -> bytes:
        """Bytes [start, start+length) of the version `layout` names, fetching only the chunks needed."""
        if length == 0:
            return b""
        end = start + length
        wanted: list[tuple[int, ChunkRef]] = []
        first_start = None
        pos = 0
        for index, (partition, offset, size) in enumerate(layout["chunks"]):
            if pos < end and pos + size > start:
                if first_start is None:
                    first_start = pos
                wanted.append((index, ChunkRef(partition, offset, size)))
            pos += size
            if pos >= end:
                break
        assert first_start is not None
        got = await asyncio.to_thread(self._chunk_reader().fetch, key, layout["version"], wanted)
        data = b"".join(got[index] for index, _ in wanted)
        lo = start - first_start
        return data[lo: lo + length] if (lo or len(data) != length) else data

    async def list(
        self,
        *,
        prefix: str | None = None,
        cursor: str | None = None,
        limit: int | None = None,
    ) -> BlobListPage:
        if prefix is not None:
            _require_text(prefix, "prefix")
        after = None if cursor is None else _decode_cursor(cursor)
        if limit is not None and (not is_int(limit) or limit < 0):
            raise invalid_argument(f"limit must be an int >= 0 or None, got {limit!r}")
        if limit == 0:
            return {"objects": []}
        await self._read_barrier()  # keys live on every partition
        scan_prefix = state.record_scan_prefix(prefix or "")
        start = None if after is None else state.record_key(after)

        def page() -> tuple[list[BlobInfo], bool]:
            objects: list[BlobInfo] = []
            for k, raw in self._store.scan(scan_prefix, start):
                if k == start:
                    continue  # strictly after the cursor
                if limit is not None and len(objects) == limit:
                    return objects, True
                objects.append(json.loads(raw))
            return objects, False

        # A lazy merge of every partition's pages: through a thin client each
        # page is a blocking request, so it runs on the read pool, not this loop.
        objects, truncated = await self._off_loop(page)
        out: BlobListPage = {"objects": objects}
        if truncated:
            out["cursor"] = _encode_cursor(objects[-1]["key"])
            out["truncated"] = True
        return out


# -- input -------------------------------------------------------------------------
def _require_text(value: Any, label: str) -> None:
    if not isinstance(value, str):
        raise invalid_argument(f"{label} must be a str, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid_argument(f"{label} is not well-formed Unicode (lone surrogate): {value!r}") from None


def _metadata(value: Any) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise invalid_argument(f"custom_metadata must be a dict of str to str, got {type(value).__name__}")
    out: dict[str, str] = {}
    for k, v in value.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise invalid_argument(f"custom_metadata must map str to str; {k!r}: {v!r} is not")
        _require_text(k, "a custom_metadata key")
        _require_text(v, f"custom_metadata[{k!r}]")
        out[k] = v
    return out


def _bytes_like(piece: Any) -> memoryview | None:
    if isinstance(piece, (bytes, bytearray)):
        return memoryview(piece)
    if isinstance(piece, memoryview):
        if not piece.c_contiguous:
            # A strided view (m[::2]): its bytes in order, copied -- casts and
            # writes need contiguous memory (bytearray += it raised TypeError).
            return memoryview(piece.tobytes())
        try:
            return piece.cast("B") if (piece.format != "B" or piece.ndim != 1) else piece
        except TypeError:
            raise invalid_argument("a memoryview body must be C-contiguous") from None
    return None


def _pieces(body: Any) -> AsyncIterable[memoryview]:
    """The body as an async stream of byte pieces; unsupported bodies are refused here, eagerly."""
    if isinstance(body, str):
        try:
            data = body.encode("utf-8")
        except UnicodeEncodeError:
            raise invalid_argument("a str body must be well-formed Unicode (lone surrogate)") from None
        return _one(memoryview(data))
    view = _bytes_like(body)
    if view is not None:
        return _one(view)
    if isinstance(body, AsyncIterable):
        return _from_async(body)
    if isinstance(body, Iterable) and not isinstance(body, Mapping):
        return _from_sync(body)
    raise invalid_argument(
        f"blob body must be bytes, bytearray, memoryview, str, or a (async) iterable of byte chunks, "
        f"got {type(body).__name__}"
    )


async def _one(view: memoryview) -> AsyncIterator[memoryview]:
    yield view


def _chunk(piece: Any, n: int) -> memoryview:
    view = _bytes_like(piece)
    if view is None:
        kind = "a str" if isinstance(piece, str) else f"a {type(piece).__name__}"
        raise invalid_argument(f"chunk {n} of the blob body is {kind}; chunks must be bytes, bytearray or memoryview")
    return view


async def _from_sync(body: Iterable[Any]) -> AsyncIterator[memoryview]:
    for n, piece in enumerate(body):
        yield _chunk(piece, n)


async def _from_async(body: AsyncIterable[Any]) -> AsyncIterator[memoryview]:
    n = 0
    async for piece in body:
        yield _chunk(piece, n)
        n += 1


def _range(value: Any) -> tuple[int, int | None] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise invalid_argument(f"range must be a dict {{'offset': int, 'length'?: int}}, got {type(value).__name__}")
    unknown = sorted(str(k) for k in value if k not in ("offset", "length"))
    if unknown:
        raise invalid_argument(f"range has unexpected keys {unknown}")
    offset = value.get("offset")
    if not is_int(offset) or offset < 0:
        raise invalid_argument(f"range offset must be an int >= 0, got {offset!r}")
    length = value.get("length")
    if length is not None and (not is_int(length) or length < 0):
        raise invalid_argument(f"range length must be an int >= 0, got {length!r}")
    return offset, length


def _clamp(wanted: tuple[int, int | None], size: int) -> tuple[int, int]:
    offset, length = wanted
    if offset >= size:
        raise invalid_argument(f"range offset {offset} is outside the blob (size {size})")
    remaining = size - offset
    return offset, remaining if length is None else min(length, remaining)


def _encode_cursor(last_key: str) -> str:
    return _CURSOR_PREFIX + base64.urlsafe_b64encode(last_key.encode("utf-8")).decode("ascii").rstrip("=")


def _decode_cursor(cursor: Any) -> str:
    if not isinstance(cursor, str) or not cursor.startswith(_CURSOR_PREFIX):
        raise invalid_argument(f"cursor {cursor!r} was not returned by list")
    text = cursor[len(_CURSOR_PREFIX):]
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
        key = raw.decode("utf-8")
    except (binascii.Error, ValueError):
        raise invalid_argument(f"cursor {cursor!r} was not returned by list") from None
    if not is_valid_id(key) or _encode_cursor(key) != cursor:
        raise invalid_argument(f"cursor {cursor!r} was not returned by list")
    return key
