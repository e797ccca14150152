"""Typed shapes of every record on the public API (SPEC sections 4-11).

Records cross the API as plain dicts keyed by the seeds' JSON field names
(camelCase); these `TypedDict`s describe them for type checkers and change
nothing at run time: a value of any of these types is an ordinary `dict`.

Conventions the types encode:

- An optional field that is absent or cleared is absent from a returned dict,
  never `None`: returned records mark it `NotRequired[...]` without `None`.
- On input an optional field set to `None` counts as absent, so the `...Input`
  types (what a store accepts) allow `None` where the returned type does not.
- Timestamps are epoch milliseconds, int or float: annotated `float`, which a
  type checker accepts an `int` for (PEP 484's numeric tower).
"""

# No `from __future__ import annotations` here: TypedDict reads Required /
# NotRequired from evaluated annotations, and tools that introspect these types
# at run time (`__required_keys__`, pydantic) need them right.
from typing import Any, Literal, NotRequired, Protocol, TypeAlias, TypedDict

__all__ = [
    "Artifact",
    "ArtifactInput",
    "Blob",
    "BlobInfo",
    "BlobListPage",
    "BlobRange",
    "BlobRangeServed",
    "BlobReference",
    "Checkpoint",
    "CheckpointArtifact",
    "CheckpointDirEntry",
    "CheckpointFileEntry",
    "CheckpointInput",
    "CheckpointReason",
    "DeliveryChunk",
    "DeliveryEntry",
    "DeliveryOffset",
    "DeliveryPosition",
    "FileEntry",
    "GenerationRun",
    "GenerationRunPatch",
    "Interrupt",
    "InterruptInput",
    "InterruptStatus",
    "Run",
    "RunError",
    "RunPatch",
    "RunStatus",
    "TextPart",
    "Timestamp",
    "UIMessage",
    "UIMessagePart",
    "WriterLike",
]

Timestamp: TypeAlias = float
"""Epoch milliseconds; an int or a finite float (never a bool)."""

JSONValue: TypeAlias = Any
"""Any value `json.dumps` accepts without a custom encoder (finite floats only)."""


# -- transcripts (SPEC 5): what TanStack's `@tanstack/ai-client` hydrate() expects ---------
class TextPart(TypedDict):
    """A text part of a UIMessage."""

    type: Literal["text"]
    content: str


UIMessagePart: TypeAlias = TextPart | dict[str, Any]
"""Text parts are typed; other TanStack part types (tool calls, ...) pass as JSON dicts."""


class UIMessage(TypedDict):
    """One transcript message in the shape `@tanstack/ai-client`'s `hydrate()` takes.

    `tl.messages` stores any JSON values; storing this shape is what lets a
    browser client hydrate the transcript it loads without converting it.
    """

    id: str
    role: Literal["user", "assistant", "system"]
    parts: list[UIMessagePart]


# -- checkpoints (SPEC 4) -------------------------------------------------------------------
CheckpointReason: TypeAlias = Literal["automatic", "named", "fork-root"]


class CheckpointFileEntry(TypedDict):
    """A file of a checkpoint's workspace; its bytes are the blob `blobKey`."""

    path: str
    kind: Literal["file"]
    blobKey: str  # ^sandbox-files/sha256/[0-9a-f]{64}$
    size: int  # 0..2**53-1


class CheckpointDirEntry(TypedDict):
    """A directory of a checkpoint's workspace (no blobKey, no size)."""

    path: str
    kind: Literal["dir"]


FileEntry: TypeAlias = CheckpointFileEntry | CheckpointDirEntry


class CheckpointArtifact(TypedDict):
    """An artifact carried inside a checkpoint (not a `tl.artifacts` record)."""

    artifactId: str
    name: str
    mimeType: str
    size: int  # 0..2**53-1
    blobKey: str  # ^sandbox-artifacts/sha256/[0-9a-f]{64}$
    createdAt: Timestamp


class Checkpoint(TypedDict):
    """A stored checkpoint, as `get`, `list` and `fork_from_checkpoint` return it."""

    id: str
    threadId: str
    parentCheckpointId: str | None  # always present; None for a thread's first checkpoint
    createdAt: Timestamp
    reason: CheckpointReason
    label: NotRequired[str]
    sourceRunId: NotRequired[str]
    files: list[FileEntry]
    conversation: list[JSONValue]
    artifacts: list[CheckpointArtifact]


class CheckpointInput(TypedDict):
    """What `append` takes (besides a `Checkpoint` read back): a parent, label or
    sourceRunId of None counts as absent."""

    id: str
    threadId: str
    parentCheckpointId: NotRequired[str | None]
    createdAt: Timestamp
    reason: CheckpointReason
    label: NotRequired[str | None]
    sourceRunId: NotRequired[str | None]
    files: list[FileEntry]
    conversation: list[JSONValue]
    artifacts: list[CheckpointArtifact]


class BlobReference(TypedDict):
    """An entry of `checkpoints.list_blob_references()`."""

    key: str
    references: int


class WriterLike(Protocol):
    """What a store accepts as a writer: `threadlog.Writer`, a `WriterLease`, or any
    object with these three attributes."""

    @property
    def thread_id(self) -> str: ...

    @property
    def owner_token(self) -> str: ...

    @property
    def fence(self) -> int: ...


# -- runs (SPEC 6) and generation runs (SPEC 8) ---------------------------------------------
RunStatus: TypeAlias = Literal["running", "interrupted", "completed", "failed", "aborted"]


class RunError(TypedDict):
    message: str
    code: NotRequired[str]


class Run(TypedDict):
    runId: str
    threadId: str
    status: RunStatus
    startedAt: Timestamp
    finishedAt: NotRequired[Timestamp]
    error: NotRequired[RunError]
    usage: NotRequired[dict[str, JSONValue]]
    sandboxKey: NotRequired[str]
    detachedSince: NotRequired[Timestamp]
    cancelRequested: NotRequired[bool]
    driverEpoch: NotRequired[int]
    heartbeatAt: NotRequired[Timestamp]  # last judged heartbeat of a `drive` driver (not patchable)


class RunPatch(TypedDict, total=False):
    """`runs.update`'s patch: an absent key leaves a field, None clears it
    (`status` cannot be cleared)."""

    status: RunStatus
    finishedAt: Timestamp | None
    error: RunError | None
    usage: dict[str, JSONValue] | None
    sandboxKey: str | None
    detachedSince: Timestamp | None
    cancelRequested: bool | None
    driverEpoch: int | None


class GenerationRun(TypedDict):
    runId: str
    threadId: str
    activity: str
    provider: str
    model: str
    status: RunStatus
    startedAt: Timestamp
    finishedAt: NotRequired[Timestamp]
    error: NotRequired[RunError]
    result: NotRequired[JSONValue]
    artifacts: NotRequired[list[dict[str, JSONValue]]]
    usage: NotRequired[dict[str, JSONValue]]


class GenerationRunPatch(TypedDict, total=False):
    """`generation_runs.update`'s patch (same rules as `RunPatch`)."""

    status: RunStatus
    finishedAt: Timestamp | None
    error: RunError | None
    result: JSONValue
    artifacts: list[dict[str, JSONValue]] | None
    usage: dict[str, JSONValue] | None


# -- interrupts (SPEC 7) ------------------------------------------------------------------------
InterruptStatus: TypeAlias = Literal["pending", "resolved", "cancelled"]


class InterruptInput(TypedDict):
    """What `interrupts.create` takes: exactly these five keys."""

    interruptId: str
    runId: str
    threadId: str
    requestedAt: Timestamp
    payload: dict[str, JSONValue]


class Interrupt(TypedDict):
    interruptId: str
    runId: str
    threadId: str
    status: InterruptStatus
    requestedAt: Timestamp
    payload: dict[str, JSONValue]
    resolvedAt: NotRequired[Timestamp]
    response: NotRequired[JSONValue]


# -- artifacts (SPEC 9) --------------------------------------------------------------------------
class Artifact(TypedDict):
    artifactId: str
    runId: str
    threadId: str
    name: str
    mimeType: str
    size: int
    createdAt: Timestamp
    blobKey: NotRequired[str]
    sourceUrl: NotRequired[str]


class ArtifactInput(TypedDict):
    """What `artifacts.save` takes (besides an `Artifact` read back): a blobKey or
    sourceUrl of None counts as absent."""

    artifactId: str
    runId: str
    threadId: str
    name: str
    mimeType: str
    size: int
    createdAt: Timestamp
    blobKey: NotRequired[str | None]
    sourceUrl: NotRequired[str | None]


# -- blobs (SPEC 10) -------------------------------------------------------------------------------
class BlobInfo(TypedDict):
    """A blob's record without its bytes: what `put`, `head` and `list` return."""

    key: str
    size: int
    etag: str
    contentType: NotRequired[str]
    customMetadata: NotRequired[dict[str, str]]
    createdAt: Timestamp
    updatedAt: Timestamp


class BlobRange(TypedDict):
    """`blobs.get(key, range=...)`: from `offset` (0 <= offset < size), `length`
    bytes (to the end when absent or None)."""

    offset: int
    length: NotRequired[int | None]


class BlobRangeServed(TypedDict):
    """The slice a ranged `get` served (clamped at the end of the blob)."""

    offset: int
    length: int


class Blob(BlobInfo):
    """`blobs.get`'s answer: the record plus the bytes (`range` only for a ranged get)."""

    body: bytes
    range: NotRequired[BlobRangeServed]


class BlobListPage(TypedDict):
    """A page of `blobs.list`: pass `cursor` back for the next page."""

    objects: list[BlobInfo]
    cursor: NotRequired[str]
    truncated: NotRequired[bool]  # only ever present as True


# -- delivery log (SPEC 11) ------------------------------------------------------------------------
DeliveryOffset: TypeAlias = str
"""An opaque offset minted by one run's log: compare only for equality, hand back to read/upsert."""

DeliveryPosition: TypeAlias = DeliveryOffset | Literal["-1", "now"]
"""Where `read(after)` starts: after an offset of this run, from the start ("-1"), or only new ("now")."""

DeliveryChunk: TypeAlias = dict[str, JSONValue]
"""One output chunk of a run: a JSON object."""

DeliveryEntry: TypeAlias = tuple[DeliveryOffset, DeliveryChunk]
"""What `read` yields and `snapshot` lists, and what `upsert` takes."""
