"""`tl.checkpoints`: workspace checkpoints with writer leases and forks (SPEC section 4).

Writes are commands decided on the thread's partition (head compare-and-set,
lease fence, validation); see processors/handlers/checkpoints.py. Input is
validated here first with the same rules the handlers re-run
(threadlog/checkpoint_rules.py), in the SPEC's order, so bad input is refused
before anything is sent. Reads go through a read barrier: the thread's
partition for per-thread reads, every partition for lookups by checkpoint id
and for blob references (both span threads).
"""

from __future__ import annotations

import builtins
import json
import secrets
from dataclasses import dataclass

from ..checkpoint_rules import (
    check_checkpoint_body,
    check_checkpoint_ids,
    require_id,
    require_optional_id,
    require_timestamp,
    to_wire,
    writer_lost,
    writer_record,
)
from ..errors import FORK_SOURCE_THREAD_MISMATCH, ThreadLogError
from ..projections.folds import checkpoints as state
from ..types import BlobReference, Checkpoint, CheckpointInput, Timestamp, WriterLike
from .base import StoreFacade


@dataclass(frozen=True)
class Writer:
    """A writer value: any object with these three attributes is accepted as a writer."""

    thread_id: str
    owner_token: str
    fence: int


class WriterLease:
    """A granted writer lease. `expires_at` follows `renew()`; expired once now >= expires_at."""

    def __init__(self, store: CheckpointStore, grant: dict) -> None:
        self._store = store
        self.thread_id: str = grant["threadId"]
        self.owner_token: str = grant["ownerToken"]
        self.fence: int = grant["fence"]
        self.expires_at: float = grant["expiresAt"]
        self.renew_after_ms: int = grant["renewAfterMs"]

    async def renew(self) -> float:
        """Extend the lease by this client's lease length; `WRITER_LOST` unless
        it is still the current, unexpired lease of its thread. Returns the new `expires_at`."""
        result = await self._store._send("threadlog.cmd.RenewCheckpointWriter", self.thread_id,
                                         {"writer": writer_record(self),
                                          "leaseDurationMs": self._store._tl.opts.lease_duration_ms})
        self.expires_at = result["expiresAt"]
        return self.expires_at

    async def release(self) -> None:
        """End the lease if it is still current; a stale lease is left alone, silently."""
        await self._store._send("threadlog.cmd.ReleaseCheckpointWriter", self.thread_id,
                                {"writer": writer_record(self)})

    def __repr__(self) -> str:
        return (f"WriterLease(thread_id={self.thread_id!r}, fence={self.fence}, "
                f"expires_at={self.expires_at!r}, renew_after_ms={self.renew_after_ms})")


def _require_writable(writer: dict) -> None:
    # An owner token or fence of the wrong type names no lease: WRITER_LOST, at
    # the step where the SPEC checks the writer is current (every earlier step
    # was checked locally, so nothing needs to be sent to know the answer).
    if writer["ownerToken"] is None or writer["fence"] is None:
        raise writer_lost(f"the writer of thread {writer['threadId']!r} has no valid owner_token (str) "
                          "and fence (int): it is not a current lease")


class CheckpointStore(StoreFacade):
    async def acquire_writer(self, thread_id: str) -> WriterLease:
        require_id(thread_id, "thread_id")
        opts = self._tl.opts
        # The proposer draws the owner token (a capability: 128 random bits);
        # the judge only checks it, so every judge grants the same lease.
        grant = await self._send("threadlog.cmd.AcquireCheckpointWriter", thread_id, {
            "threadId": thread_id, "ownerToken": secrets.token_hex(16),
            "leaseDurationMs": opts.lease_duration_ms, "renewAfterMs": opts.renew_after_ms,
        })
        return WriterLease(self, grant)

    async def append(self, *, checkpoint: CheckpointInput | Checkpoint, expected_head_id: str | None,
                     writer: WriterLike) -> str:
        check_checkpoint_ids(checkpoint)
        w = writer_record(writer)
        require_optional_id(expected_head_id, "expected_head_id")
        if w["threadId"] != checkpoint["threadId"]:
            raise writer_lost(f"the writer is for thread {w['threadId']!r}, not the checkpoint's thread "
                              f"{checkpoint['threadId']!r}")
        check_checkpoint_body(checkpoint)
        _require_writable(w)
        payload = {"checkpoint": to_wire(checkpoint), "expectedHeadId": expected_head_id, "writer": w}
        return await self._send("threadlog.cmd.AppendCheckpoint", checkpoint["threadId"], payload)

    async def delete_head(self, *, thread_id: str, checkpoint_id: str, writer: WriterLike) -> None:
        require_id(thread_id, "thread_id")
        require_id(checkpoint_id, "checkpoint_id")
        w = writer_record(writer)
        if w["threadId"] != thread_id:
            raise writer_lost(f"the writer is for thread {w['threadId']!r}, not {thread_id!r}")
        _require_writable(w)
        await self._send("threadlog.cmd.DeleteCheckpointHead", thread_id,
                         {"threadId": thread_id, "checkpointId": checkpoint_id, "writer": w})

    async def fork_from_checkpoint(
        self,
        *,
        source_thread_id: str,
        source_checkpoint_id: str,
        destination_thread_id: str,
        destination_checkpoint_id: str,
        created_at: Timestamp,
        writer: WriterLike,
    ) -> Checkpoint:
        require_id(source_thread_id, "source_thread_id")
        require_id(source_checkpoint_id, "source_checkpoint_id")
        require_id(destination_thread_id, "destination_thread_id")
        require_id(destination_checkpoint_id, "destination_checkpoint_id")
        w = writer_record(writer)
        require_timestamp(created_at, "created_at")
        if source_thread_id == destination_thread_id:
            raise ThreadLogError(FORK_SOURCE_THREAD_MISMATCH,
                                 f"source and destination are the same thread {source_thread_id!r}")
        # The source step decides existence and the writer's thread; the
        # destination step whether the writer is current (a None token or fence
        # travels as such and is refused there, in the SPEC's order).
        payload = {
            "sourceThreadId": source_thread_id,
            "sourceCheckpointId": source_checkpoint_id,
            "destinationThreadId": destination_thread_id,
            "destinationCheckpointId": destination_checkpoint_id,
            "createdAt": created_at,
            "writer": w,
        }
        return await self._send("threadlog.cmd.ForkCheckpoint", source_thread_id, payload)

    # -- reads -----------------------------------------------------------------------
    async def get(self, checkpoint_id: str) -> Checkpoint | None:
        require_id(checkpoint_id, "checkpoint_id")
        await self._read_barrier()  # the id may live on any thread
        for thread in state.threads_holding(self._store, checkpoint_id):
            record = state.get_record(self._store, thread, checkpoint_id)
            if record is not None:
                return record
        return None

    async def list(self, thread_id: str) -> list[Checkpoint]:
        """The thread's checkpoints by createdAt, then id bytes (the key order)."""
        require_id(thread_id, "thread_id")
        await self._read_barrier(thread_id)
        return [json.loads(v) for _, v in self._store.scan(state.thread_prefix(thread_id))]

    async def get_head(self, thread_id: str) -> str | None:
        require_id(thread_id, "thread_id")
        await self._read_barrier(thread_id)
        return state.get_head(self._store, thread_id)

    async def list_blob_references(self) -> builtins.list[BlobReference]:
        """Every referenced blob key with its count of referencing checkpoints, by key bytes."""
        await self._read_barrier()
        out: list[dict] = []
        for k, v in self._store.scan(state.REFS):
            blob, _thread = state.split_refs_key(k)
            if out and out[-1]["key"] == blob:
                out[-1]["references"] += int(v)
            else:
                out.append({"key": blob, "references": int(v)})
        return [r for r in out if r["references"] > 0]


__all__ = ["CheckpointStore", "Writer", "WriterLease"]
