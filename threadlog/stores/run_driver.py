"""`tl.runs.drive`: a claimed run whose driver keeps it alive with a heartbeat.

A driver claims the run (a fresh epoch, which fences every earlier driver),
then proposes a heartbeat at once and every `heartbeat_ms` after, in a task on
the event loop that drove it. Each heartbeat is judged on the run's thread partition at the
record's time (processors/handlers/runs.py `heartbeat`): it sets the run's
`heartbeatAt` and keeps it attached (clears `detachedSince`). A host that dies
stops heartbeating, so after a TTL `list_reclaimable` finds its runs with no
application code; `detach()` says so at once (`detachedSince` := the judged time).

A heartbeat from a superseded epoch is refused (`RUN_CLAIM_LOST`): the driver
learns it lost the run (`lost`, `lost_reason`), stops heartbeating, and every
later heartbeat raises `RUN_CLAIM_LOST` without being sent. Its delivery log
was fenced by the same claim (its appends raise `RUN_CLAIM_LOST`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from ..delivery import DeliveryLog
from ..kernel.errors import OUTCOME_UNKNOWN, RUN_CLAIM_LOST, RUN_TERMINAL, UNAVAILABLE, ThreadLogError

if TYPE_CHECKING:
    from .runs import RunStore

log = logging.getLogger("threadlog.runs")

HEARTBEAT = "threadlog.cmd.HeartbeatRun"


class RunDriver:
    """The driver of one run, as returned by `await tl.runs.drive(run_id)`.

    `epoch` is the claimed driver epoch, `log` the run's delivery log written as
    that epoch, `heartbeat_at` the last judged heartbeat.
    Usable as `async with`: leaving the block closes it.
    """

    def __init__(self, store: RunStore, run_id: str, thread_id: str, epoch: int, heartbeat_ms: float,
                 heartbeat_at: float | None) -> None:
        self._store = store
        self.run_id = run_id
        self.thread_id = thread_id
        self.epoch = epoch
        self.heartbeat_ms = heartbeat_ms
        self.heartbeat_at = heartbeat_at
        self.log: DeliveryLog = DeliveryLog(store._session, run_id, epoch=epoch)
        self._lost_reason: str | None = None
        self._task: asyncio.Task[None] | None = None

    async def _start(self) -> None:
        """Attach at once (the first heartbeat clears a `detachedSince` the run
        had), then heartbeat in the background."""
        await self.heartbeat()
        self._task = asyncio.get_running_loop().create_task(
            self._beat_in_background(), name=f"threadlog-run-heartbeat-{self.run_id}-{self.epoch}")
        self._store._heartbeats.add(self._task)
        self._task.add_done_callback(self._store._heartbeats.discard)

    @property
    def lost(self) -> bool:
        """True once this driver knows another claim superseded it."""
        return self._lost_reason is not None

    @property
    def lost_reason(self) -> str | None:
        return self._lost_reason

    @property
    def heartbeating(self) -> bool:
        """True while the background heartbeat runs (until detach, close, loss or a finished run)."""
        return self._task is not None and not self._task.done()

    async def heartbeat(self) -> float:
        """Propose one heartbeat now; returns the judged `heartbeatAt`.
        `RUN_CLAIM_LOST` once superseded (then `lost` is True), `RUN_TERMINAL` for a finished run."""
        return (await self._propose(detach=False))["heartbeatAt"]

    async def detach(self) -> float | None:
        """Stop heartbeating and mark the run detached: `detachedSince` := the
        judged time, so `list_reclaimable` finds it after the TTL without waiting
        for heartbeats to age. Returns that time; None (and nothing changes) when
        this driver was superseded or the run is finished."""
        self._stop()
        if self._lost_reason is not None:
            return None
        try:
            return (await self._propose(detach=True))["heartbeatAt"]
        except ThreadLogError as exc:
            if exc.code in (RUN_CLAIM_LOST, RUN_TERMINAL):
                return None
            raise

    async def close(self) -> None:
        """Stop heartbeating (nothing is proposed). The run stays as it is: a
        finished run is not reclaimable; an unfinished one becomes reclaimable
        once its last heartbeat is older than the TTL."""
        self._stop()

    async def __aenter__(self) -> RunDriver:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # -- internals -----------------------------------------------------------------
    async def _propose(self, *, detach: bool) -> dict:
        if self._lost_reason is not None:
            raise ThreadLogError(RUN_CLAIM_LOST, f"driver epoch {self.epoch} of run {self.run_id!r} was lost: "
                                                 f"{self._lost_reason}")
        try:
            result = await self._store._send(HEARTBEAT, self.thread_id, {
                "runId": self.run_id, "threadId": self.thread_id, "epoch": self.epoch, "detach": detach})
        except ThreadLogError as exc:
            if exc.code == RUN_CLAIM_LOST:
                self._lose(f"a heartbeat was refused: {exc.message}")
            raise
        # Heartbeats may answer out of order (manual and background): the later time wins.
        self.heartbeat_at = max(self.heartbeat_at or result["heartbeatAt"], result["heartbeatAt"])
        return dict(result)

    def _lose(self, reason: str) -> None:
        if self._lost_reason is None:
            self._lost_reason = reason
            log.warning("driver of run %r (epoch %d) lost: %s", self.run_id, self.epoch, reason)
        self._stop()

    def _stop(self) -> None:
        task, self._task = self._task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    async def _beat_in_background(self) -> None:
        try:
            while True:
                await asyncio.sleep(self.heartbeat_ms / 1000.0)
                try:
                    await self.heartbeat()
                except ThreadLogError as exc:
                    if exc.code == RUN_CLAIM_LOST:
                        return  # _propose marked it lost
                    if exc.code == RUN_TERMINAL:
                        log.info("run %r finished: its heartbeat stops", self.run_id)
                        return
                    if exc.code not in (UNAVAILABLE, OUTCOME_UNKNOWN):
                        raise
                    if self._store._session.closed:
                        return
                    # A missed heartbeat only ages the run toward the TTL; the next one catches up.
                    log.info("heartbeat of run %r (epoch %d) unavailable, retrying: %s",
                             self.run_id, self.epoch, exc.message)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # never stop heartbeating silently
            self._lose(f"the background heartbeat failed: {type(exc).__name__}: {exc}")

    def __repr__(self) -> str:
        return (f"RunDriver(run_id={self.run_id!r}, epoch={self.epoch}, heartbeat_ms={self.heartbeat_ms}, "
                f"heartbeat_at={self.heartbeat_at!r}, lost={self.lost})")
