"""Who may read what, and how much one server takes: the HTTP routes' gatekeeping.

Authorization. `authorize(request, thread_id=..., run_id=...)` (sync or async;
one of the ids is None) is asked before every hydration, SSE join and REST
read, after the ids were checked:
- `True` allows;
- `False` denies: 403 `PERMISSION_DENIED`;
- `raise Denied(...)` denies with its status and code (`unauthenticated()`:
  401 `UNAUTHENTICATED`, with `WWW-Authenticate: Bearer`);
- anything else it raises is a 500 `INTERNAL` (fail closed, never allowed).
A denied hydration is a JSON error; a denied SSE join is an event stream with
one `RUN_ERROR` event carrying the code, under the same 401/403 status.

`bearer_tokens(path)` is the ready-made hook of `threadlog serve --token-file`.

Limits (`Limits`): ids at most `max_id_bytes` UTF-8 bytes, request bodies at
most `max_body_bytes`, at most `max_streams` SSE streams open server-wide (a
join beyond waits up to `max_stream_wait_ms` for one to end), and a stream
whose client reads nothing for `max_write_stall_ms` is ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import inspect
import threading
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.requests import Request

# Stable codes of the HTTP layer (README "HTTP", docs/reference.md).
UNAUTHENTICATED = "UNAUTHENTICATED"      # 401: no or unknown credentials
PERMISSION_DENIED = "PERMISSION_DENIED"  # 403: known caller, not this thread/run
TOO_MANY_STREAMS = "TOO_MANY_STREAMS"    # 503: max_streams SSE streams already open
PAYLOAD_TOO_LARGE = "PAYLOAD_TOO_LARGE"  # 413: a body over max_body_bytes

Authorize = Callable[..., "bool | Awaitable[bool]"]
SHOWN = 64  # characters of a rejected id quoted back in a message


class Denied(Exception):
    """Raised by an authorize hook to deny with a given status and code."""

    def __init__(self, message: str = "forbidden", *, status: int = 403,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code or (UNAUTHENTICATED if status == 401 else PERMISSION_DENIED)
        self.headers = headers or {}


def unauthenticated(message: str = "missing or invalid bearer token") -> Denied:
    return Denied(message, status=401, headers={"WWW-Authenticate": "Bearer"})


async def check(authorize: Authorize | None, request: Request, *, thread_id: str | None = None,
                run_id: str | None = None) -> Denied | None:
    """None if allowed, else why not. A hook's own bug propagates (500)."""
    if authorize is None:
        return None
    try:
        verdict = authorize(request, thread_id=thread_id, run_id=run_id)
        if inspect.isawaitable(verdict):
            verdict = await verdict
    except Denied as exc:
        return exc
    if verdict is True:
        return None
    if verdict is False:
        return Denied("not allowed to read this " + ("thread" if thread_id is not None else "run"))
    raise TypeError(f"authorize must return True or False, got {type(verdict).__name__}")


def read_tokens(path: str | Path) -> list[bytes]:
    """Tokens of a token file: one per line; blank lines and `#` comments skipped."""
    tokens = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            tokens.append(line.encode("utf-8"))
    if not tokens:
        raise ValueError(f"token file {path} holds no token")
    return tokens


def bearer_tokens(path: str | Path) -> Authorize:
    """An authorize hook: `Authorization: Bearer <token>` must be one of the file's
    tokens (read once, here). Any valid token reads every thread and run.
    Compared in constant time against every token; a token is never logged."""
    tokens = read_tokens(path)

    def authorize(request: Request, *, thread_id: str | None = None, run_id: str | None = None) -> bool:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip(" \t"):
            raise unauthenticated("an Authorization: Bearer <token> header is required")
        # The header's own bytes: the server decoded them as latin-1, so this
        # gives back the UTF-8 a client sent for a non-ASCII token.
        candidate = given.strip(" \t").encode("latin-1")  # str.strip would take \xa0 and \x85: UTF-8 bytes
        ok = False
        for token in tokens:  # no early exit: the time does not say which token was close
            ok |= hmac.compare_digest(candidate, token)
        if not ok:
            raise unauthenticated("invalid bearer token")
        return True

    return authorize


@dataclass(frozen=True)
class Limits:
    max_id_bytes: int = 1024
    max_body_bytes: int = 64 * 1024
    max_streams: int = 1000
    # A join beyond max_streams waits this long for a stream to end before its
    # 503: @tanstack/ai-client never retries a non-OK answer, so a burst just over
    # the cap failed for good. Under the client's 2 s rejoin deadline (0: no wait).
    max_stream_wait_ms: int = 1000
    # Longest an event may wait to be written (the client's receive window full):
    # then the stream ends and its slot is free. Keepalives come every 15 s.
    max_write_stall_ms: int = 30_000

    def __post_init__(self) -> None:
        for name in ("max_id_bytes", "max_body_bytes", "max_streams", "max_stream_wait_ms", "max_write_stall_ms"):
            value = getattr(self, name)
            least = 0 if name == "max_stream_wait_ms" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")


def shown(value: str) -> str:
    """An id as quoted in an error message: never more than SHOWN characters."""
    return repr(value if len(value) <= SHOWN else value[:SHOWN] + "...")


def id_problem(value: str | None, label: str, limits: Limits) -> str | None:
    """Why `value` is not an acceptable id here (None if it is)."""
    if value is None:
        return None
    if not value:
        return f"{label} must be a non-empty id"
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        return f"{label} must be well-formed Unicode, got {shown(value)}"
    if size > limits.max_id_bytes:
        return f"{label} is {size} bytes, more than the {limits.max_id_bytes} allowed: {shown(value)}"
    return None


# Names the routes read: given twice, they are refused rather than one picked
# (Starlette's request.query_params keeps the last; a hook or middleware reading
# that would judge another id than the route reads).
SINGLE = frozenset({"threadId", "runId", "offset"})


def strict_query(request: Request) -> dict[str, str] | str:
    """The query parameters decoded strictly as UTF-8, or why not: Starlette
    turns invalid percent-encodings into U+FFFD, so two different ids could read
    the same state. A repeated name the routes read is refused; of any other,
    the first wins."""
    try:
        pairs = urllib.parse.parse_qsl(request.scope.get("query_string", b"").decode("latin-1"),
                                       keep_blank_values=True, encoding="utf-8", errors="strict")
    except UnicodeDecodeError:
        return "the query string has a percent-encoding that is not UTF-8"
    out: dict[str, str] = {}
    for name, value in pairs:
        if name in out and name in SINGLE:
            return f"the query gives {name} more than once"
        out.setdefault(name, value)
    return out


def path_problem(request: Request) -> str | None:
    """Why the raw path is not strict UTF-8 once percent-decoded (None if it is)."""
    raw = request.scope.get("raw_path")
    if raw is None:
        return None
    try:
        urllib.parse.unquote_to_bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        return "the path has a percent-encoding that is not UTF-8"
    return None


class StreamSlots:
    """At most `limit` SSE streams open at once (server-wide; thread-safe), and
    the server's word that they end (`close_streams`, on the server's loop)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open = 0
        self._lock = threading.Lock()
        self._closing = False
        # One event per waiting stream, made on its own loop: one asyncio.Event
        # for all bound itself to the first loop that waited, and a stream on
        # another loop (a second TestClient of one app) then failed.
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()
        self._slot_waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()  # joins over the cap

    def close_streams(self) -> None:
        """End every open stream, and any opened from now on, cleanly (a server
        shutting down: streams never end by themselves, and uvicorn cancelled
        them after its drain timeout, a traceback each and a cut response).
        Callable from any thread."""
        with self._lock:
            self._closing = True
            waiters = list(self._waiters) + list(self._slot_waiters)
        _wake(waiters)

    async def wait_closing(self) -> None:
        """Return once `close_streams` was called."""
        waiter = (asyncio.get_running_loop(), asyncio.Event())
        with self._lock:
            if self._closing:
                return
            self._waiters.add(waiter)
        try:
            await waiter[1].wait()
        finally:
            with self._lock:
                self._waiters.discard(waiter)

    async def take_within(self, wait_s: float) -> bool:
        """Take a slot, waiting up to `wait_s` for one to be given back (not
        once the server closes its streams)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            waiter = (loop, asyncio.Event())
            with self._lock:
                if self.open < self.limit:
                    self.open += 1
                    return True
                left = deadline - loop.time()
                if self._closing or left <= 0:
                    return False
                self._slot_waiters.add(waiter)
            try:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(waiter[1].wait(), left)
            finally:
                with self._lock:
                    self._slot_waiters.discard(waiter)

    def give(self) -> None:
        with self._lock:
            self.open -= 1
            # Every waiter tries again (one takes the slot, the rest wait on): a
            # wakeup handed to one waiter could be lost to its timing out meanwhile.
            waiters = list(self._slot_waiters)
        _wake(waiters)


def _wake(waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]]) -> None:
    for loop, event in waiters:
        try:
            loop.call_soon_threadsafe(event.set)
        except RuntimeError:
            pass  # that loop is closed: its stream is gone


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` is a 413 JSON, by its
    Content-Length before anything runs, or (chunked) once it grows past it."""

    def __init__(self, app: Callable, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await _too_large(send, self.max_bytes)
            return
        seen = 0
        started = completed = False

        async def counting() -> Any:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge
            return message

        async def sending(message: dict) -> None:
            nonlocal started, completed
            if message["type"] == "http.response.start":
                started = True
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                completed = True
            await send(message)

        try:
            await self.app(scope, counting, sending)
        except* _TooLarge:
            # except*: an event stream's disconnect watcher reads the body in a task
            # group, which raises it wrapped in an ExceptionGroup (a traceback and a
            # cut 200 stream instead of this answer).
            if not started:
                await _too_large(send, self.max_bytes)
            elif not completed:
                # The response had begun (an event stream reads the body only while it
                # streams): end it there, not as "returned without completing response".
                with contextlib.suppress(OSError):
                    await send({"type": "http.response.body", "body": b"", "more_body": False})


class _TooLarge(Exception):
    pass


async def _too_large(send: Callable, max_bytes: int) -> None:
    from starlette.responses import JSONResponse

    response = JSONResponse({"error": {"code": PAYLOAD_TOO_LARGE,
                                       "message": f"request body over {max_bytes} bytes"}},
                            status_code=413, headers={"Cache-Control": "no-store", "Connection": "close"})
    await response({"type": "http"}, _no_receive, send)


async def _no_receive() -> dict:
    return {"type": "http.disconnect"}

