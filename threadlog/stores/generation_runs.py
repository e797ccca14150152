"""`tl.generation_runs`: one-shot generation jobs (SPEC section 8).

Same rules as runs: idempotent create_or_resume that never revives a finished
run, validated patches with explicit clears, unknown run = no-op; the index
(run id -> thread) resolves the thread after a global read barrier.
"""

from __future__ import annotations

from typing import cast

from ..kernel.records import GENERATION_RUN_PATCH, decode_generation_run, new_generation_run
from ..kernel.validation import require_id
from ..projections.folds import generation_runs as state
from ..types import GenerationRun, GenerationRunPatch, RunStatus, Timestamp
from .base import Home, StoreFacade
from .runs import send_run_patch


class GenerationRunStore(StoreFacade):
    async def create_or_resume(self, *, run_id: str, thread_id: str, activity: str, provider: str, model: str,
                               started_at: Timestamp, status: RunStatus | None = None) -> GenerationRun:
        record = new_generation_run(run_id, thread_id, activity, provider, model, started_at, status)
        result = await self._send("threadlog.cmd.CreateOrResumeGenerationRun", thread_id, {
            **{k: record[k] for k in ("runId", "threadId", "activity", "provider", "model", "startedAt")},
            "status": status,
        })
        return await self._resolve_elsewhere(result, self.get, run_id)

    async def update(self, run_id: str, patch: GenerationRunPatch) -> None:
        await send_run_patch(self, "threadlog.cmd.UpdateGenerationRun", run_id, patch, GENERATION_RUN_PATCH,
                             "generation run")

    async def get(self, run_id: str) -> GenerationRun | None:
        require_id(run_id, "run_id")
        home = await self._thread_of(run_id)
        if home is None:
            return None
        # decode_generation_run checked the stored record: a GenerationRun.
        return cast("GenerationRun | None", decode_generation_run(
            await self._read_at(state.record_key(home.thread_id, run_id), home)))

    async def find_latest_for_thread(self, thread_id: str) -> GenerationRun | None:
        """The generation run with the greatest startedAt (ties: the last by run id bytes)."""
        require_id(thread_id, "thread_id")
        await self._read_barrier(thread_id)
        records = [cast(GenerationRun, decode_generation_run(v))  # a stored value: never None
                   for _, v in await self._scan(state.thread_prefix(thread_id), thread_id)]
        if not records:
            return None
        return max(records, key=lambda r: (r["startedAt"], r["runId"].encode("utf-8")))

    async def _thread_of(self, run_id: str) -> Home | None:
        return await self._home(state.index_key(run_id))
