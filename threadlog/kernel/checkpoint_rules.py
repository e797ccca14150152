"""Checkpoint validation (SPEC section 4): pure functions, used twice.

The client facade runs them so bad input is refused before anything is sent;
the handlers run them again on what arrived, because a command on the topic
may come from anyone. The rules live only here, so the two can never drift.

Codes: an identifier that is not a valid id (SPEC section 1) is
`SANDBOX_SNAPSHOT_INVALID_ID`; anything else malformed in a checkpoint, a file
entry or a checkpoint artifact is `SANDBOX_SNAPSHOT_INVALID_ENTRY`. Within one
call the first failure wins, in the order the SPEC lists the rules.

Beyond the SPEC's wording, two things are refused because they could not be
stored exactly: a string (path, name, label...) that does not encode to UTF-8
(a lone surrogate), and an int timestamp outside the signed 64-bit range (it is
carried as an Avro long; converting it to a double would silently change it).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from . import validation
from .errors import INVALID_ENTRY, INVALID_ID, WRITER_LOST, ThreadLogError
from .validation import (
    dumps,
    is_int,
    is_safe_size,
    is_text,
    is_timestamp,
    is_valid_id,
    json_depth_problem,
    json_problem,
    loads,
)

REASONS = ("automatic", "named", "fork-root")
CHECKPOINT_KEYS = frozenset({"id", "threadId", "parentCheckpointId", "createdAt", "reason", "label",
                             "sourceRunId", "files", "conversation", "artifacts"})
FILE_KEYS = frozenset({"path", "kind", "blobKey", "size"})
ARTIFACT_KEYS = frozenset({"artifactId", "name", "mimeType", "size", "blobKey", "createdAt"})

# \Z, not $: Python's $ also matches before a trailing newline (JavaScript's does not).
FILE_BLOB_KEY = re.compile(r"^sandbox-files/sha256/[0-9a-f]{64}\Z")
ARTIFACT_BLOB_KEY = re.compile(r"^sandbox-artifacts/sha256/[0-9a-f]{64}\Z")
DRIVE_PREFIX = re.compile(r"^[A-Za-z]:(?:[\\/]|\Z)")

_LONG_MIN, _LONG_MAX = -(2**63), 2**63 - 1


# The longest writer lease a judge grants (a proposal names its length). `open`
# refuses longer settings itself: accepted there, every acquire was refused.
MAX_LEASE_MS = 30 * 24 * 3600 * 1000


def invalid_id(message: str) -> ThreadLogError:
    return ThreadLogError(INVALID_ID, message)


def invalid_entry(message: str) -> ThreadLogError:
    return ThreadLogError(INVALID_ENTRY, message)


def writer_lost(message: str) -> ThreadLogError:
    return ThreadLogError(WRITER_LOST, message)


def require_id(value: Any, label: str) -> str:
    """An id of the checkpoint contract: refused with `INVALID_ID` (SPEC 4)."""
    return validation.require_id(value, label, INVALID_ID)


def require_optional_id(value: Any, label: str) -> str | None:
    return None if value is None else require_id(value, label)


def require_timestamp(value: Any, label: str) -> float | int:
    """A timestamp of the checkpoint contract: refused with `INVALID_ENTRY` (SPEC 4)."""
    return validation.require_timestamp(value, label, INVALID_ENTRY)


# -- writers --------------------------------------------------------------------
def writer_parts(writer: Any, label: str = "writer") -> tuple[str, str | None, int | None]:
    """(thread_id, owner_token, fence) of any object with those attributes.

    The thread id must be a valid id (`INVALID_ID`, checked with the other ids).
    An owner token or fence of the wrong type can never name a lease: it comes
    back as None, which the decider refuses with `WRITER_LOST` at the step where
    the SPEC checks that the writer is current -- not earlier.
    """
    # Unchecked attributes of any object until validated here.
    thread_id: Any = getattr(writer, "thread_id", None)
    if not is_valid_id(thread_id):
        raise invalid_id(f"{label}.thread_id must be a non-empty well-formed Unicode string "
                         f"(a writer has thread_id, owner_token and fence), got {thread_id!r}")
    token = getattr(writer, "owner_token", None)
    fence = getattr(writer, "fence", None)
    token = token if is_text(token) else None
    fence = fence if is_int(fence) and _LONG_MIN <= fence <= _LONG_MAX else None
    return thread_id, token, fence


def writer_record(writer: Any, label: str = "writer") -> dict:
    thread_id, token, fence = writer_parts(writer, label)
    return {"threadId": thread_id, "ownerToken": token, "fence": fence}


# -- checkpoints ----------------------------------------------------------------
def check_checkpoint_ids(checkpoint: Any) -> None:
    """Step 1 of append: the checkpoint's own identifiers (`INVALID_ID`)."""
    if not isinstance(checkpoint, dict):
        raise invalid_entry(f"checkpoint must be a dict, got {type(checkpoint).__name__}")
    require_id(checkpoint.get("id"), "checkpoint id")
    require_id(checkpoint.get("threadId"), "checkpoint threadId")
    require_optional_id(checkpoint.get("parentCheckpointId"), "checkpoint parentCheckpointId")


def check_checkpoint_body(checkpoint: Mapping[str, Any]) -> None:
    """Everything but the ids (`INVALID_ENTRY`); call after `check_checkpoint_ids`."""
    extra = sorted(map(repr, set(checkpoint) - CHECKPOINT_KEYS))
    if extra:
        raise invalid_entry(f"checkpoint has unexpected key(s) {', '.join(extra)}; "
                            f"allowed: {', '.join(sorted(CHECKPOINT_KEYS))}")
    require_timestamp(checkpoint.get("createdAt"), "checkpoint createdAt")
    reason = checkpoint.get("reason")
    if reason not in REASONS:
        raise invalid_entry(f"checkpoint reason must be one of {', '.join(REASONS)}, got {reason!r}")
    for name in ("label", "sourceRunId"):
        value = checkpoint.get(name)
        if value is not None and not is_text(value):
            raise invalid_entry(f"checkpoint {name} must be a well-formed string when present, got {value!r}")
    conversation = checkpoint.get("conversation")
    if isinstance(conversation, UnparsedJson):
        raise invalid_entry(f"checkpoint conversation is not JSON text: {conversation.error}")
    if not isinstance(conversation, list):
        raise invalid_entry(f"checkpoint conversation must be a list, got {type(conversation).__name__}")
    problem = json_problem(conversation, "checkpoint conversation")
    if problem:
        raise invalid_entry(problem)
    check_files(checkpoint.get("files"))
    check_artifacts(checkpoint.get("artifacts"))


def check_checkpoint(checkpoint: Any) -> None:
    check_checkpoint_ids(checkpoint)
    check_checkpoint_body(checkpoint)


def _path_problem(path: Any) -> tuple[str | None, list[str]]:
    """(why `path` is not a normalized workspace-relative path or None, its segments)."""
    if not isinstance(path, str) or not path:
        return "must be a non-empty string", []
    if not is_text(path):
        return "is not well-formed Unicode", []
    if "\0" in path:
        return "contains NUL", []
    if path[0] in "/\\":
        return "is absolute", []
    if path[1:2] == ":" and DRIVE_PREFIX.match(path):
        return "has a drive prefix", []
    if "\\" in path:
        return "contains a backslash", []
    parts = path.split("/")
    if "" in parts or "." in parts or ".." in parts:
        return "has an empty, '.' or '..' segment", []
    return None, parts


def check_files(files: Any) -> None:
    # Judged for every checkpoint by the client and again by the judge: the
    # common case (a valid entry) allocates nothing it does not keep.
    if not isinstance(files, list):
        raise invalid_entry(f"checkpoint files must be a list, got {type(files).__name__}")
    seen: set[str] = set()
    file_paths: set[str] = set()
    ancestors: set[str] = set()  # every proper ancestor of every entry so far
    for n, entry in enumerate(files):
        if not isinstance(entry, dict):
            raise invalid_entry(f"files[{n}] must be a dict, got {type(entry).__name__}")
        if not FILE_KEYS.issuperset(entry):
            extra = sorted(map(repr, set(entry) - FILE_KEYS))
            raise invalid_entry(f"files[{n}] has unexpected key(s) {', '.join(extra)}")
        path: Any = entry.get("path")  # user input: _path_problem checks it is a str
        problem, parts = _path_problem(path)
        if problem:
            raise invalid_entry(f"files[{n}] path {path!r} {problem}: it must be a normalized workspace-relative "
                                "path")
        if path in seen:
            raise invalid_entry(f"files[{n}]: duplicate entry path {path!r}")
        parents = ["/".join(parts[:i]) for i in range(1, len(parts))]
        if file_paths and not file_paths.isdisjoint(parents):
            under = next(p for p in parents if p in file_paths)
            raise invalid_entry(f"files[{n}]: entry {path!r} is beneath file {under!r}")
        kind = entry.get("kind")
        if kind == "file":
            if path in ancestors:
                raise invalid_entry(f"files[{n}]: file {path!r} is an ancestor of another entry")
            blob_key = entry.get("blobKey")
            if not isinstance(blob_key, str) or not FILE_BLOB_KEY.match(blob_key):
                raise invalid_entry(f"files[{n}]: file blobKey must match sandbox-files/sha256/<64 hex>, "
                                    f"got {blob_key!r}")
            if "size" not in entry or not is_safe_size(entry["size"]):
                raise invalid_entry(f"files[{n}]: file size must be an int in 0..2**53-1, got "
                                    f"{entry.get('size')!r}")
            file_paths.add(path)
        elif kind == "dir":
            if "blobKey" in entry or "size" in entry:
                raise invalid_entry(f"files[{n}]: a dir entry has no blobKey or size")
        else:
            raise invalid_entry(f"files[{n}]: kind must be 'file' or 'dir', got {kind!r}")
        seen.add(path)
        ancestors.update(parents)


def check_artifacts(artifacts: Any) -> None:
    if not isinstance(artifacts, list):
        raise invalid_entry(f"checkpoint artifacts must be a list, got {type(artifacts).__name__}")
    for n, art in enumerate(artifacts):
        where = f"artifacts[{n}]"
        if not isinstance(art, dict):
            raise invalid_entry(f"{where} must be a dict, got {type(art).__name__}")
        extra = sorted(map(repr, set(art) - ARTIFACT_KEYS))
        if extra:
            raise invalid_entry(f"{where} has unexpected key(s) {', '.join(extra)}")
        if not is_valid_id(art.get("artifactId")):
            raise invalid_entry(f"{where}: artifactId must be a valid id, got {art.get('artifactId')!r}")
        for name in ("name", "mimeType"):
            value = art.get(name)
            if not is_text(value) or not value:
                raise invalid_entry(f"{where}: {name} must be a non-empty string, got {value!r}")
        blob_key = art.get("blobKey")
        if not isinstance(blob_key, str) or not ARTIFACT_BLOB_KEY.match(blob_key):
            raise invalid_entry(f"{where}: blobKey must match sandbox-artifacts/sha256/<64 hex>, got {blob_key!r}")
        if not is_safe_size(art.get("size")):
            raise invalid_entry(f"{where}: size must be an int in 0..2**53-1, got {art.get('size')!r}")
        if not is_timestamp(art.get("createdAt")):
            raise invalid_entry(f"{where}: createdAt must be a finite number, got {art.get('createdAt')!r}")


def blob_keys(checkpoint: dict) -> list[str]:
    """The blob keys a checkpoint references, each once, sorted."""
    keys = {f["blobKey"] for f in checkpoint["files"] if f["kind"] == "file"}
    keys.update(a["blobKey"] for a in checkpoint["artifacts"])
    return sorted(keys)


# -- the record as stored and returned, and as it travels in Avro ---------------------
def _scalars(record: dict) -> dict[str, Any]:
    """A checkpoint's scalar fields as stored: parent present (None when absent),
    `label` / `sourceRunId` only when set. Shared by the input, wire and stored forms."""
    out: dict[str, Any] = {
        "id": record["id"],
        "threadId": record["threadId"],
        "parentCheckpointId": record.get("parentCheckpointId"),
        "createdAt": record["createdAt"],
        "reason": record["reason"],
    }
    for name in ("label", "sourceRunId"):
        if record.get(name) is not None:
            out[name] = record[name]
    return out


def normalized(checkpoint: dict) -> dict:
    """The stored record of a valid checkpoint: parent present (None when absent),
    optional fields absent rather than None, fresh containers."""
    out = _scalars(checkpoint)
    out["files"] = [dict(f) for f in checkpoint["files"]]
    out["conversation"] = loads(dumps(checkpoint["conversation"]))
    out["artifacts"] = [dict(a) for a in checkpoint["artifacts"]]
    return out


def to_wire(checkpoint: Mapping[str, Any]) -> dict:
    """A valid checkpoint as a `threadlog.Checkpoint` Avro record."""
    return {
        "id": checkpoint["id"],
        "threadId": checkpoint["threadId"],
        "parentCheckpointId": checkpoint.get("parentCheckpointId"),
        "createdAt": checkpoint["createdAt"],
        "reason": checkpoint["reason"],
        "label": checkpoint.get("label"),
        "sourceRunId": checkpoint.get("sourceRunId"),
        "files": [{"path": f["path"], "kind": f["kind"], "blobKey": f.get("blobKey"), "size": f.get("size")}
                  for f in checkpoint["files"]],
        "conversation": dumps(checkpoint["conversation"]),
        "artifacts": [dict(a) for a in checkpoint["artifacts"]],
    }


class UnparsedJson:
    """A conversation that arrived as text that is not JSON (only a forged command
    can carry one). Refused by `check_checkpoint_body`, at the step where the
    SPEC checks the conversation -- not earlier, so the ids are checked first."""

    def __init__(self, error: str) -> None:
        self.error = error


def _head(record: dict) -> dict[str, Any]:
    """The API dict of a `threadlog.Checkpoint` record, without its conversation."""
    head = _scalars(record)
    # A file entry has every field set (a copy at C speed); a dir entry drops its None blobKey/size.
    head["files"] = [{k: v for k, v in f.items() if v is not None} if None in f.values() else dict(f)
                     for f in record["files"]]
    head["artifacts"] = [dict(a) for a in record["artifacts"]]
    return head


def from_wire(record: dict) -> dict:
    """A `threadlog.Checkpoint` Avro record as the API dict (absent fields dropped)."""
    text = record["conversation"]
    deep = json_depth_problem(text, "conversation")  # a judge parses this: see MAX_JSON_DEPTH
    try:
        conversation: Any = UnparsedJson(deep) if deep else loads(text)
    except ValueError as exc:
        conversation = UnparsedJson(str(exc))
    out = _head(record)
    artifacts = out.pop("artifacts")
    out["conversation"] = conversation
    out["artifacts"] = artifacts
    return out


def record_json(record: dict) -> bytes:
    """The stored form of a `threadlog.Checkpoint` Avro record: the API dict as JSON.

    The conversation is spliced in as the JSON text it travelled as (the decider
    checked it is a JSON array before the event existed), so folding a
    checkpoint never parses and re-serializes a possibly large transcript.
    """
    head = _head(record)
    text = dumps(head)
    return (text[:-1] + ',"conversation":' + record["conversation"] + "}").encode("utf-8")
