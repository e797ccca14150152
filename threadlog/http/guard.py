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
import collections
import contextlib
import hmac
import inspect
import threading
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse

# Stable codes of the HTTP layer (README "HTTP", docs/reference.md).
UNAUTHENTICATED = "UNAUTHENTICATED"      # 401: no or unknown credentials
PERMISSION_DENIED = "PERMISSION_DENIED"  # 403: known caller, not this thread/run
TOO_MANY_STREAMS = "TOO_MANY_STREAMS"    # 503: max_streams SSE streams already open
PAYLOAD_TOO_LARGE = "PAYLOAD_TOO_LARGE"  # 413: a body over max_body_bytes

Authorize = Callable[..., "bool | Awaitable[bool]"]
SHOWN = 64  # characters of a rejected id quoted back in a message
# Longest the rest of a body over the limit is read (and dropped) before its 413:
# a server that answers and closes while the client still sends makes the kernel
# reset the connection, and the client reads a reset, never the 413.
LINGER_S = 1.0
# Longest a stream route waits for a body that stays within the limit before it
# streams all the same: a client announcing a body and sending none must not
# hold the request (it takes no stream slot) for as long as it likes (a review).
BODY_WAIT_S = 10.0


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


class _SlotWaiter:
    """One join waiting for a stream slot, on its own loop (see StreamSlots)."""

    __slots__ = ("event", "loop", "state")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.event = asyncio.Event()
        # QUEUED: in the queue; GRANTED: handed a slot, not yet taken up; DONE:
        # out of the queue (took its slot, left, or passed its slot on).
        # Changed only under the StreamSlots lock.
        self.state = _QUEUED


_QUEUED, _GRANTED, _DONE = "queued", "granted", "done"


class StreamSlots:
    """At most `limit` SSE streams open at once (server-wide; thread-safe), and
    the server's word that they end (`close_streams`, on the server's loop).

    Joins over the cap wait in arrival order, and a slot given back goes straight
    to the oldest (`open` unchanged: the slot passes from the giver to it), which
    alone is woken. Tried before: every waiter woken to try again, one took the
    slot -- a thundering herd, and unfair: a join that had waited longest could
    lose to any other, again and again, until its wait ran out and it got a 503
    while later ones got streams."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open = 0  # slots held, a slot handed to a waiter not yet awake included
        self._lock = threading.Lock()
        self._closing = False
        # One event per waiting stream, made on its own loop: one asyncio.Event
        # for all bound itself to the first loop that waited, and a stream on
        # another loop (a second TestClient of one app) then failed.
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()
        self._slot_waiters: collections.deque[_SlotWaiter] = collections.deque()  # joins over the cap, oldest first

    def close_streams(self) -> None:
        """End every open stream, and any opened from now on, cleanly (a server
        shutting down: streams never end by themselves, and uvicorn cancelled
        them after its drain timeout, a traceback each and a cut response).
        Callable from any thread."""
        with self._lock:
            self._closing = True
            waiters = list(self._waiters) + [(w.loop, w.event) for w in self._slot_waiters]
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
        with self._lock:
            # Only if nobody waits: a new join queues behind those that do. (While
            # joins wait no slot is free anyway -- a handed slot stays counted --
            # except once the server closes its streams.)
            if self.open < self.limit and not self._slot_waiters:
                self.open += 1
                return True
            if self._closing or wait_s <= 0:
                return False
            waiter = _SlotWaiter(asyncio.get_running_loop())
            self._slot_waiters.append(waiter)
        try:
            # asyncio.timeout, not wait_for: 3.11's wait_for returned a result that
            # came as it was cancelled, the cancellation lost.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s):
                    await waiter.event.wait()
        except BaseException:
            # Cancelled (the client went away, the server stops): a slot handed
            # to it meanwhile is nobody's unless passed on.
            if self._leave(waiter):
                self.give()
            raise
        # Woken by a hand-off, by close_streams, or out of time: what counts is
        # whether a slot was handed to it, under the lock. A slot handed as its
        # time ran out is taken all the same (it is this join's; dropping it here
        # would lose it, or count it twice).
        return self._leave(waiter)

    def _leave(self, waiter: _SlotWaiter) -> bool:
        """`waiter` stops waiting: True if it was handed a slot (now its own)."""
        with self._lock:
            state, waiter.state = waiter.state, _DONE
            if state == _QUEUED:
                self._slot_waiters.remove(waiter)
            return state == _GRANTED

    def give(self) -> None:
        """Give a slot back (any thread): to the oldest waiting join, if any."""
        while True:
            with self._lock:
                # Closing: the waiters were told to go; the slot is just freed.
                if self._closing or not self._slot_waiters:
                    self.open -= 1
                    return
                waiter = self._slot_waiters.popleft()
                waiter.state = _GRANTED
            try:
                waiter.loop.call_soon_threadsafe(waiter.event.set)
                return
            except RuntimeError:
                # Its loop is closed: it never wakes to take the slot. Unless it
                # left meanwhile (and took it: a coroutine closed by the garbage
                # collector runs its finally), pass the slot on to the next one.
                with self._lock:
                    if waiter.state != _GRANTED:
                        return
                    waiter.state = _DONE


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
        started = completed = ended = False

        async def counting() -> Any:
            nonlocal seen, ended
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                ended = not message.get("more_body")
                if seen > self.max_bytes:
                    raise _TooLarge
            else:
                ended = True  # gone: nothing more comes
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
            # except*: a body read in a task group (a streaming response's disconnect
            # watcher) raises it wrapped in an ExceptionGroup (a traceback and a cut
            # 200 stream instead of this answer).
            if not started:
                if not ended:
                    await _linger(receive)
                await _too_large(send, self.max_bytes)
            elif not completed:
                # The response had begun before its body was read (an app's own
                # route: ours read theirs before they answer, body_refusal): it
                # can only be ended there, not as "returned without completing response".
                with contextlib.suppress(OSError):
                    await send({"type": "http.response.body", "body": b"", "more_body": False})


class _TooLarge(Exception):
    pass


def too_large(max_bytes: int) -> JSONResponse:
    """The 413 of a request body over `max_bytes`."""
    return JSONResponse({"error": {"code": PAYLOAD_TOO_LARGE, "message": f"request body over {max_bytes} bytes"}},
                        status_code=413, headers={"Cache-Control": "no-store", "Connection": "close"})


async def _linger(receive: Callable) -> None:
    """Read the rest of a body over the limit, dropping it, for up to LINGER_S."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(LINGER_S):
            while True:
                message = await receive()
                if message["type"] != "http.request" or not message.get("more_body"):
                    return


async def _too_large(send: Callable, max_bytes: int) -> None:
    await too_large(max_bytes)({"type": "http"}, _no_receive, send)


async def body_refusal(request: Request, limits: Limits) -> JSONResponse | None:
    """Read a request's body to its end, dropping it: the 413 if it is over
    `limits.max_body_bytes`, else None.

    For a route whose answer is an event stream: no route uses a body, but one
    left unread is read by the stream's disconnect watcher once the 200 has
    started, where a body over the limit can no longer be a 413 -- the stream
    ended empty, which an SSE client takes for a clean end (a review). Counted
    here too, not only by BodyLimit (which raises first under `create_app`):
    `routes()` may be mounted in an app without it. Bounded: BODY_WAIT_S for
    the body, then the stream goes ahead (its watcher reads what comes later);
    call it after the request is authorized, so only a client allowed the
    stream can make the server wait on its body."""
    seen, over = 0, False
    try:
        async with asyncio.timeout(BODY_WAIT_S) as linger:
            async for part in request.stream():
                seen += len(part)
                if seen > limits.max_body_bytes and not over:
                    over = True
                    linger.reschedule(asyncio.get_running_loop().time() + LINGER_S)  # the rest read, dropped
    except ClientDisconnect:
        # Gone mid-body: the stream goes ahead and its disconnect watcher, told
        # at once, ends it, as for a client gone before its first event.
        pass
    except TimeoutError:
        pass  # still sending after LINGER_S (over) or BODY_WAIT_S: answered all the same
    return too_large(limits.max_body_bytes) if seen > limits.max_body_bytes else None


async def _no_receive() -> dict:
    return {"type": "http.disconnect"}
