"""OpenAI Agents SDK sessions on threadlog: `ThreadLogSession`.

Implements the SDK's `Session` protocol (`agents.memory.session`):
`session_id`, `get_items(limit)`, `add_items(items)`, `pop_item()`,
`clear_session()`, with the semantics of the SDK's `SQLiteSession`.

```python
async with threadlog.open(bootstrap, namespace="app") as tl:
    session = ThreadLogSession("user-42", tl)
    await Runner.run(agent, "hello", session=session)
# or, owning its client: async with ThreadLogSession.open("user-42", bootstrap, namespace="app") as s: ...
```

How it maps onto threadlog
--------------------------
- A session is an ordered list of items, one RocksDB key per position
  (projections/folds/agent_sessions.py), each item stored as its JSON text, so
  it round-trips exactly.
- Every write is ONE proposal keyed `agents:<session_id>` (the prefix keeps
  sessions apart from threadlog thread ids: a session named like a thread is
  not that thread), judged on that key's partition
  (processors/handlers/agent_sessions.py): `add_items` stores all its items or
  none; `pop_item` removes the newest item and the verdict's result IS that
  item, so concurrent pops from any number of clients never return the same
  item and lose none; `clear_session` removes every item.
- Every read first passes a read barrier on the session's partition, so it
  sees every write acknowledged before it began, from any process.

Differences from `SQLiteSession`: items must be JSON values (the SQLite
session would raise `TypeError` from `json.dumps`; here it is
`ThreadLogError(INVALID_ARGUMENT)` before anything is sent), and one
`add_items` call is bounded by a proposal's size (~15 MiB of JSON).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Generator
from typing import TYPE_CHECKING, Any, TypeVar

try:
    from agents.memory.session import SessionABC
    from agents.memory.session_settings import SessionSettings, coerce_session_settings, resolve_session_limit
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "threadlog.integrations.openai_agents needs openai-agents: pip install 'threadlog[openai-agents]'"
    ) from exc

from .. import client as _client
from ..kernel.errors import CORRUPT_RECORD, INVALID_ARGUMENT, ThreadLogError, invalid_argument, unavailable
from ..kernel.validation import is_int, loads, require_id, require_json
from ..processors.handlers.agent_sessions import partition_key
from ..projections.folds import agent_sessions as state
from ..remote import NoQueries

if TYPE_CHECKING:
    from agents.items import TResponseInputItem

__all__ = ["ThreadLogSession"]

T = TypeVar("T")

# A read of several keys is not one snapshot (the judge applies batches from
# another thread): it is retried when the session changed under it. Each retry
# is a few point lookups; a session changing this often between two lookups
# means something is wrong.
READ_ATTEMPTS = 16


class ThreadLogSession(SessionABC):
    """An OpenAI Agents SDK session on a connected `threadlog.ThreadLog` (not closed by the session,
    unless the session came from `ThreadLogSession.open`).

    `session_id`: a non-empty, well-formed Unicode string (else `ThreadLogError(INVALID_ARGUMENT)`).
    `session_settings`: as in `SQLiteSession`; its `limit` is `get_items`' default.
    """

    session_settings: SessionSettings | None = None

    def __init__(self, session_id: str, tl: _client.ThreadLog, *,
                 session_settings: SessionSettings | dict[str, Any] | None = None) -> None:
        self.session_id = require_id(session_id, "session_id")
        _client.require_connected(tl, "ThreadLogSession", "From an address: `ThreadLogSession.open(session_id, "
                                  "bootstrap, namespace=...)`.")
        self.tl = tl
        self.session_settings = (coerce_session_settings(session_settings) if session_settings is not None
                                 else SessionSettings())
        self._key = partition_key(session_id)
        self._owned = False

    @classmethod
    def open(
        cls,
        session_id: str,
        bootstrap_servers: str = "127.0.0.1:9092",
        namespace: str = "threadlog",
        *,
        session_settings: SessionSettings | dict[str, Any] | None = None,
        **open_kwargs: Any,
    ) -> _SessionOpener:
        """A session with its own client (`open_kwargs` go to `threadlog.open`).

        `async with ThreadLogSession.open(...) as s:` closes the client on exit;
        `s = await ThreadLogSession.open(...)` leaves that to `await s.close()`.
        """
        require_id(session_id, "session_id")  # fail before connecting
        return _SessionOpener(cls, session_id, bootstrap_servers, namespace,
                              {"session_settings": session_settings}, open_kwargs)

    async def close(self) -> None:
        """Close the client if this session opened it (`ThreadLogSession.open`); else nothing."""
        if self._owned:
            await self.tl.close()

    # -- reads ----------------------------------------------------------------------------
    async def get_items(self, limit: int | None = None) -> list[TResponseInputItem]:
        """The latest `limit` items, oldest first; every item if `limit` (or, when it is None,
        `session_settings.limit`) is None or negative, like SQLite's `LIMIT -1`."""
        if limit is not None and not is_int(limit):
            raise invalid_argument(f"limit must be None or an int, got {limit!r}")
        limit = resolve_session_limit(limit, self.session_settings)
        if limit is not None and not is_int(limit):
            raise invalid_argument(f"session_settings.limit must be None or an int, got {limit!r}")
        session = self.tl.session
        on = (self._key,)
        # One query at the session's owner, its read barrier included (projections/
        # folds/agent_sessions.py: read_items); the keys in batches only when
        # it answers None (a session too large for one answer, or changing
        # under every try there) or the worker is of an earlier version.
        barrier = False
        try:
            [texts] = await session.query("agents.items", on, {
                "session": self.session_id, "limit": None if limit is None or limit < 0 else limit},
                fallback=False)
        except NoQueries:
            texts, barrier = None, True
        if texts is not None:
            return [loads(t) for t in texts]
        meta = state.decode_meta(await session.read(state.meta_key(self.session_id), on, barrier=barrier))
        for _ in range(READ_ATTEMPTS):
            first = meta["first"] if limit is None or limit < 0 else max(meta["first"], meta["next"] - limit)
            # The items (one request per owner and 64 items through a thin client),
            # then the positions again, read after every item was.
            texts = await session.read_many(
                [state.item_key(self.session_id, pos) for pos in range(first, meta["next"])], on, barrier=False)
            again = state.decode_meta(await session.read(state.meta_key(self.session_id), on, barrier=False))
            # Nothing removed meanwhile: the items read belong to one state of the session.
            if state.same_items(meta, again) and None not in texts:
                return [loads(t) for t in texts if t is not None]
            meta = again
        raise unavailable(f"session {self.session_id!r} kept changing during {READ_ATTEMPTS} reads")

    # -- writes ---------------------------------------------------------------------------
    async def add_items(self, items: list[TResponseInputItem]) -> None:
        """Append `items` (oldest first) in one atomic step; an empty list writes nothing."""
        if not isinstance(items, (list, tuple)):
            raise invalid_argument(f"items must be a list, got {type(items).__name__}")
        if not items:
            # Nothing to write, but a closed client says so as every other call does
            # (as SQLiteSession raises for a closed session before its own shortcut).
            self.tl.session.check_open()
            return
        # Every item is checked before anything is sent: a bad item refuses the whole call.
        texts = [require_json(item, f"items[{i}]", INVALID_ARGUMENT) for i, item in enumerate(items)]
        await _outcome(self.tl.send("threadlog.cmd.AgentSessionAddItems", self._key,
                                    {"sessionId": self.session_id, "items": texts}))

    async def pop_item(self) -> TResponseInputItem | None:
        """Remove and return the newest item; None if the session is empty."""
        result = await _outcome(self.tl.send("threadlog.cmd.AgentSessionPopItem", self._key,
                                             {"sessionId": self.session_id}))
        if result is None:
            return None
        if not isinstance(result, dict) or not isinstance(result.get("item"), str):  # pragma: no cover
            raise ThreadLogError(CORRUPT_RECORD, f"unexpected pop verdict {result!r}")
        popped: TResponseInputItem = loads(result["item"])
        return popped

    async def clear_session(self) -> None:
        """Remove every item of the session (one atomic step)."""
        await _outcome(self.tl.send("threadlog.cmd.AgentSessionClear", self._key, {"sessionId": self.session_id}))


async def _outcome(aw: Awaitable[T]) -> T:
    """Wait for a write's verdict even if the caller is cancelled meanwhile, then re-raise the
    cancellation (as the SDK's sessions do): a pop whose proposal is already in the log is
    applied whether or not anyone waits, and its item must not vanish with a cancelled caller
    while the write itself completes."""
    task = asyncio.ensure_future(aw)
    cancelled: asyncio.CancelledError | None = None
    while not task.done():
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError as exc:
            cancelled = cancelled or exc
    # The cancellation wins, also over a failed write (as the SDK's `_await_mutation`):
    # a caller that cancelled gets CancelledError, so `task.cancel()` and
    # `asyncio.timeout` mean what they say. A refusal here raised the
    # ThreadLogError instead, and `asyncio.timeout` never became TimeoutError (a review).
    try:
        result = task.result()
    except BaseException:
        if cancelled is not None:
            raise cancelled from None
        raise
    if cancelled is not None:
        raise cancelled from None
    return result


class _SessionOpener:
    """Both `async with ThreadLogSession.open(...)` and `await ThreadLogSession.open(...)` work."""

    def __init__(self, cls: type[ThreadLogSession], session_id: str, bootstrap: str, namespace: str,
                 session_kwargs: dict[str, Any], open_kwargs: dict[str, Any]) -> None:
        self._args = (cls, session_id, bootstrap, namespace, session_kwargs, open_kwargs)
        self._session: ThreadLogSession | None = None

    async def _open(self) -> ThreadLogSession:
        cls, session_id, bootstrap, namespace, session_kwargs, open_kwargs = self._args
        tl = await _client.open(bootstrap, namespace, **open_kwargs)
        session = cls(session_id, tl, **session_kwargs)
        session._owned = True
        return session

    def __await__(self) -> Generator[Any, None, ThreadLogSession]:
        return self._open().__await__()

    async def __aenter__(self) -> ThreadLogSession:
        self._session = await self._open()
        return self._session

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()
