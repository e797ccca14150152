"""`tl.runs`: run lifecycle records and driver claims (SPEC section 6).

A run lives on its thread's partition; the run index (run id -> thread) lets
calls that name only a run id find it after a global read barrier, and the
thread's partition decides. Records read back are validated (`decode_run`).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, cast

from ..delivery import DeliveryLog
from ..kernel.delivery_records import CLAIM_FLOOR_MAX
from ..kernel.errors import RUN_NOT_FOUND, RUN_TERMINAL, ThreadLogError, invalid_argument
from ..kernel.records import (
    RUN_PATCH,
    FieldCheck,
    check_patch,
    decode_run,
    is_terminal,
    new_run,
    quiet_since,
    require_timestamp,
)
from ..kernel.validation import dumps, is_finite, require_id
from ..projections.folds import runs as state
from ..types import Run, RunPatch, RunStatus, Timestamp
from .base import Home, StoreFacade
from .run_driver import RunDriver

if TYPE_CHECKING:
    from ..session import Session

# A driver's heartbeat period: a few per reclaim TTL (a TTL of 30 s misses no live driver).
DEFAULT_HEARTBEAT_MS = 5_000
MIN_HEARTBEAT_MS = 10


def _by_time(record: Mapping[str, Any], time_field: str, id_field: str) -> tuple[Any, bytes]:
    # SPEC 1: ties in a time order are broken by id bytes, ascending.
    return (record[time_field], record[id_field].encode("utf-8"))


def _run(raw: bytes | None) -> Run | None:
    # decode_run checked the stored record (status in its set, required keys): a Run.
    return cast("Run | None", decode_run(raw))


def _stored_run(raw: bytes) -> Run:
    # A stored value (never None) decodes to a record.
    return cast(Run, decode_run(raw))


class RunFacade(Protocol):
    """What `send_run_patch` needs of the runs and generation runs stores."""

    async def _thread_of(self, run_id: str) -> Home | None: ...

    async def _send(self, type_name: str, key: str, payload: dict) -> Any: ...


async def send_run_patch(store: RunFacade, command: str, run_id: str, patch: Mapping[str, Any],
                         fields: Mapping[str, FieldCheck], what: str) -> None:
    """`update` of runs and generation runs: the patch is validated first (even
    for an unknown run); a valid patch on an unknown run is a no-op. `store`
    resolves the run's thread with its `_thread_of`."""
    require_id(run_id, "run_id")
    normalized = check_patch(patch, fields, what)
    if not normalized:
        return
    home = await store._thread_of(run_id)
    if home is None:
        return
    thread_id = home.thread_id
    await store._send(command, thread_id, {"runId": run_id, "threadId": thread_id, "patch": dumps(normalized)})


class RunStore(StoreFacade):
    def __init__(self, session: Session) -> None:
        super().__init__(session)
        self._heartbeats: set[asyncio.Task[None]] = set()
        self._granting: set[asyncio.Task[int]] = set()  # claims past their grant (`_claim`)

    async def create_or_resume(self, *, run_id: str, thread_id: str, started_at: Timestamp,
                               status: RunStatus | None = None) -> Run:
        """Create the run (status `running` unless given), or return the existing
        record unchanged: every argument is still validated, then ignored."""
        record = new_run(run_id, thread_id, started_at, status)
        result = await self._send("threadlog.cmd.CreateOrResumeRun", thread_id, {
            "runId": record["runId"], "threadId": record["threadId"],
            "startedAt": record["startedAt"], "status": status,
        })
        return await self._resolve_elsewhere(result, self.get, run_id)

    async def update(self, run_id: str, patch: RunPatch) -> None:
        """Patch a run; None clears a field. The patch is validated first (even
        for an unknown run); a valid patch on an unknown run is a no-op."""
        await send_run_patch(self, "threadlog.cmd.UpdateRun", run_id, patch, RUN_PATCH, "run")

    async def get(self, run_id: str) -> Run | None:
        require_id(run_id, "run_id")
        home = await self._thread_of(run_id)
        if home is None:
            return None
        return _run(await self._read_at(state.record_key(home.thread_id, run_id), home))

    async def list_by_thread(self, thread_id: str) -> list[Run]:
        """Every run of the thread, ascending by startedAt, then run id bytes."""
        require_id(thread_id, "thread_id")
        await self._read_barrier(thread_id)
        return await self._thread_runs(thread_id)

    async def find_active_run(self, thread_id: str) -> Run | None:
        """The `running` run with the greatest startedAt (ties: the last by id bytes)."""
        require_id(thread_id, "thread_id")
        await self._read_barrier(thread_id)
        running = [r for r in await self._thread_runs(thread_id) if r["status"] == "running"]
        return running[-1] if running else None

    async def list_reclaimable(self, *, now: Timestamp, ttl_ms: float) -> list[Run]:
        """Runs with status `running` whose driver has been gone for `ttl_ms`:
        `detachedSince <= now - ttl_ms`, or, not detached, `heartbeatAt <= now - ttl_ms`
        (only a `drive` driver heartbeats) (inclusive; `records.quiet_since`).
        Ordered by that time, then run id bytes."""
        require_timestamp(now, "now")
        if not is_finite(ttl_ms) or ttl_ms < 0:
            raise invalid_argument(f"ttl_ms must be a finite number >= 0, got {ttl_ms!r}")
        cutoff = now - ttl_ms
        if cutoff == -math.inf:
            # Two finite floats whose difference overflows: no quiet time (finite,
            # SPEC 1) is at or before it, and JSON has no -inf to ask a worker with
            # (a thin client's query was refused INVALID_ARGUMENT; a review).
            return []
        # After a read barrier on every partition, each owner lists its quiet
        # runs; a run is in one index at a time, but is listed once even if it
        # moved between the two scans. The record decides (exact comparison).
        answers = await self._session.query("runs.quiet", None, {"cutoff": float(cutoff)})
        found: dict[tuple[str, str], tuple[float, Run]] = {}
        for record in (_stored_run(raw) for answer in answers for raw in answer):
            quiet = quiet_since(record)
            if quiet is not None and quiet[1] <= cutoff:
                found[(record["threadId"], record["runId"])] = (quiet[1], record)
        ordered = sorted(found.values(), key=lambda pair: (pair[0], pair[1]["runId"].encode("utf-8")))
        return [record for _, record in ordered]

    async def claim(self, run_id: str) -> int:
        """Become the run's driver: driverEpoch := one more than any epoch it ever
        had. RUN_NOT_FOUND for an unknown run, RUN_TERMINAL for a finished one."""
        _, epoch = await self._claim(run_id)
        return epoch

    async def drive(self, run_id: str, *, heartbeat_ms: float = DEFAULT_HEARTBEAT_MS) -> RunDriver:
        """Claim the run and keep it alive: a `RunDriver` (its `epoch`, its delivery
        `log`), attached at once (a first heartbeat clears `detachedSince`), that
        proposes a heartbeat every `heartbeat_ms` until `detach()`,
        `close()`, loss (`lost`: a later claim superseded it) or the run finishing.
        Errors as `claim`; `INVALID_ARGUMENT` for a bad `heartbeat_ms`."""
        require_id(run_id, "run_id")
        if not is_finite(heartbeat_ms) or heartbeat_ms < MIN_HEARTBEAT_MS:
            raise invalid_argument(f"heartbeat_ms must be a number >= {MIN_HEARTBEAT_MS}, got {heartbeat_ms!r}")
        thread_id, epoch = await self._claim(run_id)
        driver = RunDriver(self, run_id, thread_id, epoch, heartbeat_ms, None)
        try:
            await driver._start()  # attached (detachedSince cleared) before it is returned
        except ThreadLogError as exc:
            if exc.code == RUN_TERMINAL:
                # Finished between the grant and this first heartbeat (a review,
                # reproduced: the old driver, not yet aware of the claim, completed
                # the run; its close was dropped, fenced by our grant). Nobody else
                # holds this epoch -- the caller never gets it -- so end the log
                # here, as `_grant` does, or readers wait for its end forever.
                await self._end_log(run_id, epoch, exc)
            raise
        return driver

    async def _claim(self, run_id: str) -> tuple[str, int]:
        require_id(run_id, "run_id")
        home = await self._thread_of(run_id)
        if home is None:
            raise ThreadLogError(RUN_NOT_FOUND, f"run {run_id!r} does not exist")
        thread_id = home.thread_id
        # Both in one read (a thin client: one request), after a barrier on the
        # thread's partition unless finding the run just passed one everywhere.
        raw_record, raw_epoch = await self._session.read_many(
            [state.record_key(thread_id, run_id), state.epoch_key(thread_id, run_id)], (thread_id,),
            barrier=not home.fresh)
        record = _run(raw_record)
        if record is None:
            raise ThreadLogError(RUN_NOT_FOUND, f"run {run_id!r} does not exist")
        if is_terminal(record):
            raise ThreadLogError(RUN_TERMINAL, f"run {run_id!r} is {record['status']}; "
                                               "a finished run cannot be claimed")
        # The epoch is granted on the run's delivery partition, where drivers are
        # fenced: one more than the greatest epoch the log granted or the record
        # had (`update` may have raised or cleared driverEpoch: the floor).
        current = record.get("driverEpoch", 0)
        granted = state.decode_epoch(raw_epoch)
        # Capped: the run index grants no claim naming more (run_index.CLAIM_FLOOR_MAX);
        # a record showing more was mirrored from a forged proposal, not a grant.
        floor = min(max(granted, current if isinstance(current, int) else 0), CLAIM_FLOOR_MAX)
        # From the grant on, the run's driver is fenced: the steps after it run to
        # their end even if this call is cancelled (a caller's timeout) -- else a run
        # that finished meanwhile kept a log nobody closes. Shielded, and held here
        # until done (closing the client cancels it, as it does heartbeats).
        task = asyncio.ensure_future(self._grant(run_id, thread_id, floor))
        self._granting.add(task)
        task.add_done_callback(self._granted)
        return thread_id, await asyncio.shield(task)

    async def _grant(self, run_id: str, thread_id: str, floor: int) -> int:
        """`claim`'s steps from the grant on: the grant, its mirror on the run
        record, and the log's close if the run finished meanwhile."""
        delivery = self._session.delivery
        assert delivery is not None
        epoch = await delivery.claim(run_id, floor)
        # Then the run record shows it (a mirror: a claim that loses a race to a
        # newer one leaves the newer epoch in place).
        try:
            await self._send("threadlog.cmd.ClaimRun", thread_id, {"runId": run_id, "threadId": thread_id,
                                                                   "epoch": epoch})
        except ThreadLogError as exc:
            refused = exc
            if exc.code != RUN_TERMINAL and await self._finished(thread_id, run_id, exc):
                # The mirror's answer was lost (a timeout), and the run is finished
                # now: the same case as a RUN_TERMINAL answer, told by the record.
                refused = ThreadLogError(RUN_TERMINAL, f"run {run_id!r} finished while it was being claimed "
                                                       f"(the claim's last step: {exc.code}: {exc.message})")
            if refused.code == RUN_TERMINAL:
                # The run finished between our read and the grant, and the grant has
                # fenced its driver: the close that driver writes now is dropped.
                await self._end_log(run_id, epoch, refused)
            if refused is exc:
                raise
            raise refused from exc
        return epoch

    async def _end_log(self, run_id: str, epoch: int, refused: ThreadLogError) -> None:
        """Close the log of a run that finished while `epoch` was granted: its old
        driver's close is dropped (fenced by the grant), and readers would wait
        for the log's end forever. A log its driver closed first is left as it is;
        a failure to close is a note on `refused`."""
        try:
            await DeliveryLog(self._session, run_id, epoch=epoch).close()
        except ThreadLogError as closing:
            refused.add_note(f"and closing its delivery log failed: {closing.code}: {closing.message}")

    def _granted(self, task: asyncio.Task[int]) -> None:
        self._granting.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a cancelled caller no longer awaits it

    async def _finished(self, thread_id: str, run_id: str, failure: ThreadLogError) -> bool:
        """Is the run finished, read after a barrier (False if that cannot be told:
        said in a note on `failure`)?"""
        try:
            record = _run(await self._read_on(state.record_key(thread_id, run_id), thread_id, barrier=True))
        except ThreadLogError as reading:
            failure.add_note(f"and whether the run finished meanwhile could not be read: {reading.code}: "
                             f"{reading.message}")
            return False
        return record is not None and is_terminal(record)

    def _stop_background(self) -> None:
        """Cancel every background driver heartbeat and unfinished claim (the client is closing)."""
        for task in [*self._heartbeats, *self._granting]:
            task.cancel()

    # -- helpers ---------------------------------------------------------------
    async def _thread_of(self, run_id: str) -> Home | None:
        return await self._home(state.index_key(run_id))

    async def _thread_runs(self, thread_id: str) -> list[Run]:
        records = [_stored_run(v) for _, v in await self._scan(state.thread_prefix(thread_id), thread_id)]
        return sorted(records, key=lambda r: _by_time(r, "startedAt", "runId"))

