"""Errors with stable codes: the codes are a public contract (SPEC section 3)."""

from __future__ import annotations

from typing import Any

STALE_HEAD = "SANDBOX_SNAPSHOT_STALE_HEAD"
PARENT_MISMATCH = "SANDBOX_SNAPSHOT_PARENT_MISMATCH"
DUPLICATE_ID = "SANDBOX_SNAPSHOT_DUPLICATE_ID"
NOT_HEAD = "SANDBOX_SNAPSHOT_NOT_HEAD"
WRITER_CONFLICT = "SANDBOX_SNAPSHOT_WRITER_CONFLICT"
WRITER_LOST = "SANDBOX_SNAPSHOT_WRITER_LOST"
INVALID_ID = "SANDBOX_SNAPSHOT_INVALID_ID"
INVALID_ENTRY = "SANDBOX_SNAPSHOT_INVALID_ENTRY"
FORK_SOURCE_NOT_FOUND = "SANDBOX_SNAPSHOT_FORK_SOURCE_NOT_FOUND"
FORK_SOURCE_THREAD_MISMATCH = "SANDBOX_SNAPSHOT_FORK_SOURCE_THREAD_MISMATCH"
FORK_DESTINATION_NOT_EMPTY = "SANDBOX_SNAPSHOT_FORK_DESTINATION_NOT_EMPTY"
INVALID_ARGUMENT = "INVALID_ARGUMENT"
RUN_NOT_FOUND = "RUN_NOT_FOUND"
RUN_TERMINAL = "RUN_TERMINAL"
RUN_CLAIM_LOST = "RUN_CLAIM_LOST"
RUN_LOG_CLOSED = "RUN_LOG_CLOSED"
INVALID_OFFSET = "INVALID_OFFSET"
# A checkpoint named a blob a garbage-collection sweep is deciding about right
# now, or one a sweep deleted that was not put again before the append began
# (processors/handlers/blob_gc.py): refused so a stored checkpoint never names
# a blob the sweep deleted. Put the blob again and retry.
BLOB_BEING_COLLECTED = "BLOB_BEING_COLLECTED"
UNAVAILABLE = "UNAVAILABLE"
# A write reached (or may have reached) the log, but its verdict could not be
# learned in time: it may still apply. Distinct from a refusal (which changed
# nothing) and from UNAVAILABLE (nothing was written): read the state, or
# re-send -- a re-sent proposal with the same id is answered with the first
# verdict, never applied twice.
OUTCOME_UNKNOWN = "OUTCOME_UNKNOWN"
# A command that only reads named a namespace whose topics do not exist.
NAMESPACE_NOT_FOUND = "NAMESPACE_NOT_FOUND"
# The CLI's code for an exception threadlog did not raise on purpose (a bug).
INTERNAL = "INTERNAL"

# Internal: a message on a topic could not be decoded. Never raised to API
# callers; used in logs and in refusals of undecodable commands.
INVALID_MESSAGE = "INVALID_MESSAGE"

# A record read back from storage is malformed (e.g. a run status outside the
# five): raised instead of guessing, because readers act destructively on what
# a record says (a "terminal" run gets its journal swept).
CORRUPT_RECORD = "CORRUPT_RECORD"

# A local store is held by another live process (its slot lock): `threadlog
# rebuild` refuses instead of dropping state under a running judge.
STORE_IN_USE = "STORE_IN_USE"

CODES = frozenset(
    {
        STALE_HEAD,
        PARENT_MISMATCH,
        DUPLICATE_ID,
        NOT_HEAD,
        WRITER_CONFLICT,
        WRITER_LOST,
        INVALID_ID,
        INVALID_ENTRY,
        FORK_SOURCE_NOT_FOUND,
        FORK_SOURCE_THREAD_MISMATCH,
        FORK_DESTINATION_NOT_EMPTY,
        INVALID_ARGUMENT,
        RUN_NOT_FOUND,
        RUN_TERMINAL,
        RUN_CLAIM_LOST,
        RUN_LOG_CLOSED,
        INVALID_OFFSET,
        BLOB_BEING_COLLECTED,
        UNAVAILABLE,
        OUTCOME_UNKNOWN,
        NAMESPACE_NOT_FOUND,
        INTERNAL,
        INVALID_MESSAGE,
        CORRUPT_RECORD,
        STORE_IN_USE,
    }
)


class ThreadLogError(Exception):
    """Every error threadlog raises on purpose. `.code` is stable; `.message` explains.

    `.retryable`: the same call, made again later and unchanged, may succeed.
    True for UNAVAILABLE (a broker or worker away, a rebalance), unless what is
    missing cannot come back (records deleted by retention): a retry loop, or
    an SSE stream deciding between "reconnect" and "give up", must tell the
    two apart without parsing messages. False for everything else: a refusal
    changed nothing and says what to change first; OUTCOME_UNKNOWN says to
    read the state first (a blind re-send of a CAS append is refused stale).
    """

    def __init__(self, code: str, message: str, *, retryable: bool | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.retryable = code in _RETRYABLE if retryable is None else retryable

    def __reduce__(self) -> tuple[Any, ...]:  # picklable across processes, retryable included
        return (_rebuild, (type(self), self.code, self.message, self.retryable))


def _rebuild(cls: type[ThreadLogError], code: str, message: str, retryable: bool) -> ThreadLogError:
    err = cls.__new__(cls)  # subclasses (CodecError) take other __init__ arguments
    ThreadLogError.__init__(err, code, message, retryable=retryable)
    return err


def invalid_argument(message: str) -> ThreadLogError:
    return ThreadLogError(INVALID_ARGUMENT, message)


def unavailable(message: str, *, retryable: bool = True) -> ThreadLogError:
    return ThreadLogError(UNAVAILABLE, message, retryable=retryable)


def namespace_not_found(message: str) -> ThreadLogError:
    return ThreadLogError(NAMESPACE_NOT_FOUND, message)


# Between a thin client and the workers only: "this worker does not own that
# partition (any more)". A client never surfaces it -- it looks the owner up
# again and retries until its deadline, then fails with UNAVAILABLE.
NOT_OWNER = "NOT_OWNER"


# Also internal: "I own it, but my judge has not reached the position you need
# yet" (a new owner catching up). The client asks again until its own deadline.
BEHIND = "BEHIND"


# Codes whose call may succeed if made again unchanged (ThreadLogError.retryable).
_RETRYABLE = frozenset({UNAVAILABLE, NOT_OWNER, BEHIND})


def not_owner(message: str) -> ThreadLogError:
    return ThreadLogError(NOT_OWNER, message)
