"""`tl.interrupts`: human-in-the-loop pauses (SPEC section 7).

An interrupt lives on its thread's partition; the interrupt index (id ->
thread) lets resolve/cancel/get find it after a global read barrier. Lists are
ascending by requestedAt, then interrupt id bytes.
"""

from __future__ import annotations

import builtins
from typing import Any, cast

from ..kernel.records import decode_interrupt, new_interrupt, require_json_value
from ..kernel.validation import dumps, require_id
from ..projections.folds import interrupts as state
from ..types import Interrupt, InterruptInput
from .base import Home, StoreFacade


def _interrupt(raw: bytes | None) -> Interrupt | None:
    # decode_interrupt checked the stored record (status in its set, required keys): an Interrupt.
    return cast("Interrupt | None", decode_interrupt(raw))


def _ordered(records: list[Interrupt]) -> list[Interrupt]:
    return sorted(records, key=lambda r: (r["requestedAt"], r["interruptId"].encode("utf-8")))


class InterruptStore(StoreFacade):
    async def create(self, record: InterruptInput) -> None:
        """Store a pending interrupt; an existing id (on any thread) is left as it is."""
        checked = new_interrupt(record)
        await self._send("threadlog.cmd.CreateInterrupt", checked["threadId"], {
            "interruptId": checked["interruptId"], "runId": checked["runId"], "threadId": checked["threadId"],
            "requestedAt": checked["requestedAt"], "payload": dumps(checked["payload"]),
        })

    async def resolve(self, interrupt_id: str, response: Any = None) -> Interrupt | None:
        """Resolve a pending interrupt (response None: no response key). Returns the
        stored record after the call; None for an unknown id."""
        require_id(interrupt_id, "interrupt_id")
        text = None if response is None else dumps(require_json_value(response, "response"))
        return await self._decide(interrupt_id, "resolved", text)

    async def cancel(self, interrupt_id: str) -> Interrupt | None:
        require_id(interrupt_id, "interrupt_id")
        return await self._decide(interrupt_id, "cancelled", None)

    async def get(self, interrupt_id: str) -> Interrupt | None:
        require_id(interrupt_id, "interrupt_id")
        home = await self._thread_of(interrupt_id)
        if home is None:
            return None
        return _interrupt(await self._read_at(state.record_key(home.thread_id, interrupt_id), home))

    async def list(self, thread_id: str) -> list[Interrupt]:
        require_id(thread_id, "thread_id")
        await self._read_barrier(thread_id)
        return await self._thread_interrupts(thread_id)

    async def list_pending(self, thread_id: str) -> builtins.list[Interrupt]:
        require_id(thread_id, "thread_id")
        await self._read_barrier(thread_id)
        return [r for r in await self._thread_interrupts(thread_id) if r["status"] == "pending"]

    async def list_by_run(self, run_id: str) -> builtins.list[Interrupt]:
        require_id(run_id, "run_id")
        return await self._run_interrupts(run_id)

    async def list_pending_by_run(self, run_id: str) -> builtins.list[Interrupt]:
        require_id(run_id, "run_id")
        return [r for r in await self._run_interrupts(run_id) if r["status"] == "pending"]

    # -- helpers ---------------------------------------------------------------
    async def _decide(self, interrupt_id: str, status: str, response: str | None) -> Interrupt | None:
        home = await self._thread_of(interrupt_id)
        if home is None:
            return None
        thread_id = home.thread_id
        return await self._send("threadlog.cmd.DecideInterrupt", thread_id, {
            "interruptId": interrupt_id, "threadId": thread_id, "status": status, "response": response,
        })

    async def _thread_of(self, interrupt_id: str) -> Home | None:
        return await self._home(state.index_key(interrupt_id))

    async def _thread_interrupts(self, thread_id: str) -> builtins.list[Interrupt]:
        # Stored values, never None: each decodes to a record.
        return _ordered([cast(Interrupt, decode_interrupt(v))
                         for _, v in await self._scan(state.thread_prefix(thread_id), thread_id)])

    async def _run_interrupts(self, run_id: str) -> builtins.list[Interrupt]:
        """After a read barrier on every partition: the run's interrupts may live on any thread."""
        answers = await self._session.query("interrupts.of_run", None, {"run_id": run_id})
        records = [_interrupt(raw) for found in answers for raw in found]
        return _ordered([r for r in records if r is not None and r["runId"] == run_id])
