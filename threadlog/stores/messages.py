"""`tl.messages`: whole-transcript save and load (SPEC section 5)."""

from __future__ import annotations

from typing import Any

from ..kernel.errors import INVALID_ARGUMENT, invalid_argument
from ..kernel.validation import loads, require_id, require_json
from ..projections.folds.messages import transcript_key
from .base import StoreFacade


class MessageStore(StoreFacade):
    async def load_thread(self, thread_id: str) -> list[Any]:
        require_id(thread_id, "thread_id")
        raw = await self._read(transcript_key(thread_id), thread_id)
        return [] if raw is None else loads(raw)

    async def save_thread(self, thread_id: str, messages: list[Any]) -> None:
        require_id(thread_id, "thread_id")
        if not isinstance(messages, (list, tuple)):
            raise invalid_argument(f"messages must be a list, got {type(messages).__name__}")
        text = require_json(list(messages), "messages", INVALID_ARGUMENT)
        await self._send("threadlog.cmd.SaveTranscript", thread_id,
                         {"threadId": thread_id, "messages": text})
