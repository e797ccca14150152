"""Record shapes of the run-like stores: what a valid input is, what a valid stored record is.

One place for both sides of every check. The store facades call these before
sending (bad input is refused with INVALID_ARGUMENT and nothing is sent), the
handlers call them again on what arrives in a command (a command can be
forged), and the readers call the `decode_*` functions on what comes back from
storage: a stored status outside its set is an error (CORRUPT_RECORD), never
guessed, because callers act destructively on it (a "terminal" run gets its
journal swept, its attach refused).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from .errors import CORRUPT_RECORD, ThreadLogError, invalid_argument
from .validation import is_int, is_valid_id, json_problem, loads_json_value, require_id, require_timestamp

RUN_STATUSES = ("running", "interrupted", "completed", "failed", "aborted")
TERMINAL_STATUSES = frozenset({"completed", "failed", "aborted"})

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_SAFE_INT = 2**53 - 1


# -- scalar fields ---------------------------------------------------------------
def require_epoch(value: Any, label: str) -> int:
    if not is_int(value) or not 0 <= value <= MAX_SAFE_INT:
        raise invalid_argument(f"{label} must be an int in 0..2**53-1, got {value!r}")
    return value


def require_text(value: Any, label: str, *, nonempty: bool = False) -> str:
    """A well-formed str (encodes to UTF-8: no lone surrogates)."""
    if not isinstance(value, str):
        raise invalid_argument(f"{label} must be a str, got {type(value).__name__}")
    if nonempty and not value:
        raise invalid_argument(f"{label} must not be empty")
    if value and not is_valid_id(value):
        raise invalid_argument(f"{label} is not well-formed Unicode (lone surrogate)")
    return value


def require_bool(value: Any, label: str) -> bool:
    if not isinstance(value, bool):
        raise invalid_argument(f"{label} must be a bool, got {value!r}")
    return value


def require_json_value(value: Any, label: str) -> Any:
    problem = json_problem(value, label)
    if problem:
        raise invalid_argument(problem)
    return value


def require_json_object(value: Any, label: str) -> dict:
    if not isinstance(value, Mapping):
        raise invalid_argument(f"{label} must be a dict, got {type(value).__name__}")
    require_json_value(dict(value), label)
    return dict(value)


def require_error(value: Any, label: str) -> dict:
    """`{message: str, code?: str}` and nothing else (a RunError)."""
    if not isinstance(value, Mapping):
        raise invalid_argument(f"{label} must be a dict {{message, code?}}, got {type(value).__name__}")
    extra = set(value) - {"message", "code"}
    if extra:
        raise invalid_argument(f"{label} has unexpected keys {sorted(map(str, extra))}; allowed: message, code")
    out = {"message": require_text(value.get("message"), f"{label}.message")}
    if value.get("code") is not None:
        out["code"] = require_text(value["code"], f"{label}.code")
    return out


def require_json_objects(value: Any, label: str) -> list:
    """A list of dicts of JSON values (generation run artifacts: PersistedArtifactRef)."""
    if not isinstance(value, (list, tuple)):
        raise invalid_argument(f"{label} must be a list, got {type(value).__name__}")
    return [require_json_object(item, f"{label}[{i}]") for i, item in enumerate(value)]


def require_size(value: Any, label: str) -> int:
    if not is_int(value) or not 0 <= value <= MAX_SAFE_INT:
        raise invalid_argument(f"{label} must be an int in 0..2**53-1, got {value!r}")
    return value


def require_status(value: Any, label: str, statuses: tuple[str, ...] = RUN_STATUSES) -> str:
    if not isinstance(value, str) or value not in statuses:
        raise invalid_argument(f"{label} must be one of {', '.join(statuses)}; got {value!r}")
    return value


def _status_field(value: Any, label: str) -> str:
    return require_status(value, label)


# -- patches -----------------------------------------------------------------------
FieldCheck = Callable[[Any, str], Any]

RUN_PATCH: dict[str, FieldCheck] = {
    "status": _status_field,
    "finishedAt": require_timestamp,
    "error": require_error,
    "usage": require_json_object,
    "sandboxKey": require_text,
    "detachedSince": require_timestamp,
    "cancelRequested": require_bool,
    "driverEpoch": require_epoch,
}

GENERATION_RUN_PATCH: dict[str, FieldCheck] = {
    "status": _status_field,
    "finishedAt": require_timestamp,
    "error": require_error,
    "result": require_json_value,
    "artifacts": require_json_objects,
    "usage": require_json_object,
}

# Fields a patch may set but never clear.
UNCLEARABLE = frozenset({"status"})


def check_patch(patch: Any, fields: Mapping[str, FieldCheck], what: str) -> dict[str, Any]:
    """Validate a patch; return it normalized: key -> value, or None to clear.

    Refused as a whole (INVALID_ARGUMENT) on the first bad key, before anything
    is looked up, so a bad patch is refused even for an unknown record."""
    if not isinstance(patch, Mapping):
        raise invalid_argument(f"{what} patch must be a dict, got {type(patch).__name__}")
    out: dict[str, Any] = {}
    for k, v in patch.items():
        if k not in fields:
            raise invalid_argument(
                f"{what} patch key {k!r} is not one of {', '.join(fields)}")
        if v is None:
            if k in UNCLEARABLE:
                raise invalid_argument(f"{what} patch cannot clear {k!r} (None)")
            out[k] = None
        else:
            out[k] = fields[k](v, f"patch[{k!r}]")
    return out



def patch_from_command(text: str, fields: Mapping[str, FieldCheck], what: str) -> dict[str, Any]:
    """A patch as it travels in a command (JSON text), checked again by the decider:
    a command on the topic may come from anyone."""
    try:
        raw = loads_json_value(text, f"{what} patch")
    except ValueError as exc:
        raise invalid_argument(str(exc)) from None
    return check_patch(raw, fields, what)

def apply_patch(record: dict, patch: Mapping[str, Any]) -> dict:
    """The record after `patch`: a None value removes the field (absent, never None)."""
    out = dict(record)
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = v
    return out


# -- runs ----------------------------------------------------------------------------
def new_run(run_id: Any, thread_id: Any, started_at: Any, status: Any) -> dict:
    """Validate create_or_resume's arguments (always, even for an existing run)."""
    record = {
        "runId": require_id(run_id, "run_id"),
        "threadId": require_id(thread_id, "thread_id"),
        "status": "running" if status is None else require_status(status, "status"),
        "startedAt": require_timestamp(started_at, "started_at"),
    }
    return record


def decode_run(raw: bytes | str | None) -> dict | None:
    return _decode(raw, "run", RUN_STATUSES, ("runId", "threadId", "startedAt"))


def is_terminal(record: Mapping[str, Any]) -> bool:
    return record["status"] in TERMINAL_STATUSES


def quiet_since(record: Mapping[str, Any]) -> tuple[str, float] | None:
    """Since when a run has had no live driver: a candidate of `list_reclaimable`
    (the TTL is checked at read), as (field, time), or None.

    A `running` run is quiet since `detachedSince` when that is set (its driver
    detached, or the application said so), else since `heartbeatAt` (its
    driver's last judged heartbeat: a dead host stops heartbeating; only a
    `drive` heartbeats); a run with neither has no driver known to have died
    and is not a candidate.
    The fold's indexes and the reader's exact check both ask this, so they agree."""
    if record.get("status") != "running":
        return None
    for field in ("detachedSince", "heartbeatAt"):
        value = record.get(field)
        if value is not None:
            return field, value
    return None


# -- generation runs ---------------------------------------------------------------------
def new_generation_run(run_id: Any, thread_id: Any, activity: Any, provider: Any, model: Any,
                       started_at: Any, status: Any) -> dict:
    return {
        "runId": require_id(run_id, "run_id"),
        "threadId": require_id(thread_id, "thread_id"),
        "activity": require_text(activity, "activity"),
        "provider": require_text(provider, "provider"),
        "model": require_text(model, "model"),
        "status": "running" if status is None else require_status(status, "status"),
        "startedAt": require_timestamp(started_at, "started_at"),
    }


def decode_generation_run(raw: bytes | str | None) -> dict | None:
    return _decode(raw, "generation run", RUN_STATUSES,
                   ("runId", "threadId", "activity", "provider", "model", "startedAt"))


# -- interrupts ------------------------------------------------------------------------------
INTERRUPT_STATUSES = ("pending", "resolved", "cancelled")
INTERRUPT_KEYS = ("interruptId", "runId", "threadId", "requestedAt", "payload")


def new_interrupt(record: Any) -> dict:
    """create's record: exactly the five keys (no status, resolvedAt or response)."""
    if not isinstance(record, Mapping):
        raise invalid_argument(f"interrupt must be a dict, got {type(record).__name__}")
    _exact_keys(record, INTERRUPT_KEYS, (), "interrupt")
    return {
        "interruptId": require_id(record["interruptId"], "interruptId"),
        "runId": require_id(record["runId"], "runId"),
        "threadId": require_id(record["threadId"], "threadId"),
        "status": "pending",
        "requestedAt": require_timestamp(record["requestedAt"], "requestedAt"),
        "payload": require_json_object(record["payload"], "payload"),
    }


def decode_interrupt(raw: bytes | str | None) -> dict | None:
    return _decode(raw, "interrupt", INTERRUPT_STATUSES,
                   ("interruptId", "runId", "threadId", "requestedAt", "payload"))


# -- artifacts --------------------------------------------------------------------------------
ARTIFACT_REQUIRED = ("artifactId", "runId", "threadId", "name", "mimeType", "size", "createdAt")
ARTIFACT_OPTIONAL = ("blobKey", "sourceUrl")


def new_artifact(record: Any) -> dict:
    """save's record: the SPEC 9 fields and no others; optional None = absent."""
    if not isinstance(record, Mapping):
        raise invalid_argument(f"artifact must be a dict, got {type(record).__name__}")
    _exact_keys(record, ARTIFACT_REQUIRED, ARTIFACT_OPTIONAL, "artifact")
    out = {
        "artifactId": require_id(record["artifactId"], "artifactId"),
        "runId": require_id(record["runId"], "runId"),
        "threadId": require_id(record["threadId"], "threadId"),
        "name": require_text(record["name"], "name", nonempty=True),
        "mimeType": require_text(record["mimeType"], "mimeType", nonempty=True),
        "size": require_size(record["size"], "size"),
        "createdAt": require_timestamp(record["createdAt"], "createdAt"),
    }
    for k in ARTIFACT_OPTIONAL:
        if record.get(k) is not None:
            out[k] = require_text(record[k], k, nonempty=True)
    return out


def decode_artifact(raw: bytes | str | None) -> dict | None:
    record = _load(raw, "artifact")
    if record is None:
        return None
    missing = [k for k in ARTIFACT_REQUIRED if k not in record]
    if missing:
        raise corrupt(f"stored artifact record lacks {missing}")
    return record


def _exact_keys(record: Mapping, required: tuple[str, ...], optional: tuple[str, ...], what: str) -> None:
    extra = [k for k in record if k not in required and k not in optional]
    if extra:
        raise invalid_argument(f"{what} has unexpected keys {sorted(map(str, extra))}; "
                               f"allowed: {', '.join(required + optional)}")
    missing = [k for k in required if k not in record]
    if missing:
        raise invalid_argument(f"{what} lacks {missing}")


# -- decoding stored records -----------------------------------------------------------
def corrupt(message: str) -> ThreadLogError:
    return ThreadLogError(CORRUPT_RECORD, message)


def _load(raw: bytes | str | None, what: str) -> dict | None:
    if raw is None:
        return None
    try:
        record = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise corrupt(f"stored {what} record is not JSON: {exc}") from None
    if not isinstance(record, dict):
        raise corrupt(f"stored {what} record is not an object: {record!r}")
    return record


def _decode(raw: bytes | str | None, what: str, statuses: tuple[str, ...], required: tuple[str, ...]) -> dict | None:
    record = _load(raw, what)
    if record is None:
        return None
    status = record.get("status")
    # A row's status is only a claim about a storage column: check it against
    # the exact set (never `in` on something with a prototype-like fallback).
    if not isinstance(status, str) or status not in statuses:
        raise corrupt(f"stored {what} {record.get(required[0])!r} has status {status!r}, "
                      f"not one of {', '.join(statuses)}")
    missing = [k for k in required if k not in record]
    if missing:
        raise corrupt(f"stored {what} record lacks {missing}")
    return record

