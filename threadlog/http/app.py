"""HTTP for browsers (`@tanstack/ai-client`'s `fetchServerSentEvents(url)`) and REST clients.

The durability route (default `/api/chat`), GET only:
- `?threadId=T` -> JSON `{messages, activeRun: {runId} | null,
  interrupts: {runId, pending: [payload, ...]} | null}` with
  `Cache-Control: no-store`: what a reloaded page rebuilds itself from
  (the client's `hydrate(threadId)`);
- `?runId=R&offset=O` -> `text/event-stream` of the run's chunks strictly after
  O (`-1` = from the start; the client's `joinRun(runId)`). On reconnect the
  `Last-Event-ID` header wins over `offset`; the run may also come in the
  `X-Run-Id` header.
REST: `GET /runs/{run_id}/stream` (the same event stream) and
`GET /threads/{thread_id}` (the same JSON).

`create_app(...)` is a complete ASGI app (what `threadlog serve` runs);
`routes(get_tl, path)` are the same routes to mount inside your own app.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.convertors import Convertor, register_url_convertor
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Match, Route

from ..client import ThreadLog
from ..client import open as open_threadlog
from ..delivery.joins import is_known, is_running
from ..kernel.errors import INTERNAL, INVALID_ARGUMENT, ThreadLogError
from ..metrics import STALL_AFTER_S, AccessLog, Readiness, attach, attached, ops_routes
from .guard import (
    Authorize,
    BodyLimit,
    Denied,
    Limits,
    StreamSlots,
    bearer_tokens,
    body_refusal,
    check,
    id_problem,
    path_problem,
    strict_query,
)
from .sse import HEADERS, EventStreamResponse, StreamCursor, run_error, stream_run

NO_STORE = {"Cache-Control": "no-store"}


class _IdConvertor(Convertor[str]):
    """An id as a path segment of the REST routes: any characters, "/" (sent as
    %2F, decoded before routing) and newlines included -- SPEC 1: an id is any
    non-empty UTF-8 string. Starlette's `path` is `.*`, whose `.` stops at a
    newline: `/threads/a%0Ab` was a 404 while `?threadId=a%0Ab` answered, and
    `/threads/a%0A` read thread "a" (the route's closing `$` also matches just
    before a last newline)."""

    regex = r"[\s\S]*"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return str(value)


# Registered under a name of our own: Starlette's table is process-wide, and
# `path` stays what other routes (an app mounting ours) expect.
ID_CONVERTOR = "threadlog_id"
register_url_convertor(ID_CONVERTOR, _IdConvertor())


def whole_path(routes: list[Route]) -> list[Route]:
    """`routes`, each matching the whole path and nothing more.

    Why: Starlette closes a route's pattern with `$`, which also matches just
    before a last newline, so `/api/chat%0A` answered as `/api/chat`,
    `/healthz%0A` as `/healthz` and `/runs/x/stream%0A` as run "x"'s stream (a
    review). `\\Z` matches only at the very end. Done here, once, for every
    route this package serves, rather than by a check in each endpoint.
    """
    for route in routes:
        pattern = route.path_regex.pattern
        if pattern.endswith("$"):
            route.path_regex = re.compile(pattern[:-1] + r"\Z")
    return routes


def _bad_request(message: str) -> JSONResponse:
    return JSONResponse({"error": {"code": INVALID_ARGUMENT, "message": message}}, status_code=400,
                        headers=NO_STORE)


async def thread_state(tl: ThreadLog, thread_id: str) -> dict:
    """`{messages, activeRun, interrupts}` of a thread, as `hydrate(threadId)` reads it."""
    messages = await tl.messages.load_thread(thread_id)
    active = None
    runs = getattr(tl, "runs", None)
    if runs is not None:
        run = await runs.find_active_run(thread_id)
        if run is not None:
            active = {"runId": run["runId"]}
    interrupts = None
    store = getattr(tl, "interrupts", None)
    if store is not None:
        pending = await store.list_pending(thread_id)
        if pending:
            # One run's pending interrupts: the active run's if it has any, else
            # the run of the most recent request (the list is ascending by time).
            run_id = active["runId"] if active and any(i["runId"] == active["runId"] for i in pending) \
                else pending[-1]["runId"]
            interrupts = {"runId": run_id, "pending": [i["payload"] for i in pending if i["runId"] == run_id]}
    return {"messages": messages, "activeRun": active, "interrupts": interrupts}


def _resume_offset(request: Request, query: dict[str, str]) -> str:
    # An empty Last-Event-ID is the SSE way of saying "no id": fall back to the query.
    last = request.headers.get("last-event-id")
    if last:
        return last
    return query.get("offset") or "-1"


def shadowing(path: str) -> str | None:
    """Why the durability route cannot be at `path`, or None: another route of
    `create_app`'s answers there too. Tried (a review): `serve --path /metrics`
    printed that it served the chat route at /metrics, where every join and
    hydration got Prometheus text. Asked of the routes themselves, so a route
    added later is covered too."""
    def no_client() -> ThreadLog:
        raise AssertionError("never called: the routes are only matched")

    scope = {"type": "http", "path": path, "method": "GET"}
    others = [*whole_path(ops_routes(lambda: None, lambda: None)), *routes(no_client, path)[1:]]
    for route in others:
        if route.matches(scope)[0] == Match.FULL:
            return (f"path {path!r} is taken by the server's own route {route.path!r}; "
                    "pick another for the durability route")
    return None


def routes(get_tl: Callable[[], ThreadLog], path: str = "/api/chat", *,
           authorize: Authorize | None = None, limits: Limits | None = None,
           streams: StreamSlots | None = None) -> list[Route]:
    """The durability route at `path` plus the REST routes, reading through `get_tl()`.

    `authorize(request, thread_id=..., run_id=...)` is asked before every read
    (threadlog/http/guard.py); `limits` bound ids and (with `streams`, shared
    by every route set of one server) open SSE streams.

    Add them to the application's own route list: under a Starlette `Mount`,
    whose pattern is `.*`, an id holding a newline never reaches them (404)."""
    limits = limits or Limits()
    streams = streams or StreamSlots(limits.max_streams)

    async def durability(request: Request) -> Response:
        q = strict_query(request)
        if isinstance(q, str):
            return _bad_request(q)
        thread_id = q.get("threadId")
        # The X-Run-Id header first, then ?runId: TanStack's one precedence
        # (`resolveResumeRunId`, @tanstack/ai). Read only when the query names
        # none, a join of the header's run from a connection whose URL carries
        # `?threadId=T` was answered with T's hydration JSON (a review).
        header = request.headers.get("x-run-id") or None  # an empty one names no run
        run_id = header or q.get("runId")
        if run_id is not None and thread_id is not None:
            # @tanstack/ai-client joins with the connection's own URL plus
            # `runId` and `offset`: an app connected to `/api/chat?threadId=T`
            # sends both. A resume position says it is a join (as TanStack's own
            # handlers decide); without one, which was meant is unknown.
            if "offset" in q or request.headers.get("last-event-id"):
                thread_id = None
            elif "runId" in q:
                return _bad_request("give either threadId (hydrate) or runId (join a run), not both")
            else:
                # A header on a hydration (an app's default headers on every request):
                # nothing says it is a join, so the hydration the URL asks for.
                run_id = None
        if thread_id is not None:
            return await _thread(get_tl(), thread_id, request)
        if run_id is not None and run_id is header and not header.isascii():
            # Header values arrive as latin-1 bytes: a UTF-8 client's "run-é" read
            # as "run-Ã©" and waited for a run that never comes. Which bytes a
            # client meant cannot be told, so only ASCII ids come this way.
            return _bad_request("a non-ASCII run id goes in the query (?runId=, percent-encoded UTF-8), "
                                "not in the X-Run-Id header")
        if run_id is not None:
            return await _stream(get_tl(), run_id, request, q)
        return _bad_request("query must name a threadId (hydrate) or a runId (join a run's stream)")

    async def run_stream(request: Request) -> Response:
        q = strict_query(request)
        if isinstance(q, str):
            return _bad_request(q)
        problem = path_problem(request)
        if problem:
            return _bad_request(problem)
        return await _stream(get_tl(), request.path_params["run_id"], request, q)

    async def thread(request: Request) -> Response:
        problem = path_problem(request)
        if problem:
            return _bad_request(problem)
        return await _thread(get_tl(), request.path_params["thread_id"], request)

    async def _thread(tl: ThreadLog, thread_id: str, request: Request) -> Response:
        problem = id_problem(thread_id, "threadId", limits)
        if problem:
            return _bad_request(problem)
        denied = await check(authorize, request, thread_id=thread_id)
        if denied is not None:
            return _denied_json(denied)
        try:
            body = await thread_state(tl, thread_id)
        except ThreadLogError as exc:
            status = 400 if exc.code == INVALID_ARGUMENT else 500 if exc.code == INTERNAL else 503
            return JSONResponse({"error": {"code": exc.code, "message": exc.message}}, status_code=status,
                                headers=NO_STORE)
        return JSONResponse(body, headers=NO_STORE)

    async def _stream(tl: ThreadLog, run_id: str, request: Request, query: dict[str, str]) -> Response:
        problem = id_problem(run_id, "runId", limits)
        if problem:
            return _bad_request(problem)
        denied = await check(authorize, request, run_id=run_id)
        if denied is not None:
            # An event stream all the same: SSE clients read the RUN_ERROR's code.
            return Response(run_error(run_id, denied.code, denied.message), status_code=denied.status,
                            media_type="text/event-stream; charset=utf-8", headers={**HEADERS, **denied.headers})
        # The body, whole, before the stream starts (and only once authorized: a
        # client without a token was held while it announced a body and sent
        # none, a review): read later, by the stream's disconnect watcher, a body
        # over the limit could only end a started 200 early, an empty stream a
        # client took for a clean end.
        refused = await body_refusal(request, limits)
        if refused is not None:
            return refused
        if request.method == "HEAD":
            # The headers a GET would get, and no stream: a HEAD has no body to
            # notice a gone client by, so a stream for it held its slot and its
            # reader until the run's log closed (never, for an abandoned run).
            return Response(b"", media_type="text/event-stream; charset=utf-8", headers=HEADERS)
        # From here on every outcome is an event stream: errors are RUN_ERROR events.
        after = _resume_offset(request, query)
        cursor = StreamCursor(run_id, after)
        return EventStreamResponse(stream_run(tl.delivery(run_id), after, cursor, lambda: is_running(tl, run_id),
                                              lambda: is_known(tl, run_id)),
                                   attached(tl), streams, cursor=cursor, limits=limits)

    return whole_path([
        Route(path, durability, methods=["GET"]),
        # Not `str`: an id may hold "/" (SPEC 1: any non-empty UTF-8 string),
        # sent as %2F, which the server decodes before routing; nor `path`, which
        # stops at a newline (_IdConvertor).
        Route(f"/runs/{{run_id:{ID_CONVERTOR}}}/stream", run_stream, methods=["GET"]),
        Route(f"/threads/{{thread_id:{ID_CONVERTOR}}}", thread, methods=["GET"]),
    ])


def _denied_json(denied: Denied) -> JSONResponse:
    return JSONResponse({"error": {"code": denied.code, "message": denied.message}}, status_code=denied.status,
                        headers={**NO_STORE, **denied.headers})


async def _json_error(request: Request, exc: Exception) -> Response:
    status = getattr(exc, "status_code", 500)
    detail = getattr(exc, "detail", "internal error")
    code = {404: "NOT_FOUND", 405: "METHOD_NOT_ALLOWED"}.get(status, "INTERNAL")
    # Starlette's own headers kept (a 405's `Allow`, which RFC 9110 requires);
    # never those of any other exception (an upstream response's Set-Cookie,
    # Content-Length...): this handler also answers every unexpected error.
    headers = {**((exc.headers or {}) if isinstance(exc, HTTPException) else {}), **NO_STORE}
    return JSONResponse({"error": {"code": code, "message": str(detail)}}, status_code=status, headers=headers)


def create_app(
    tl: ThreadLog | None = None,
    *,
    bootstrap_servers: str | None = None,
    namespace: str = "threadlog",
    path: str = "/api/chat",
    authorize: Authorize | None = None,
    token_file: str | None = None,
    limits: Limits | None = None,
    stall_after: float = STALL_AFTER_S,
    **open_options: Any,
) -> Starlette:
    """An ASGI app serving the routes. Pass an open `tl`, or connection options
    to have the app open (and close) its own client in its lifespan.

    Also `/metrics` (Prometheus text, the client's own registry: threadlog/metrics.py),
    `/healthz` and `/readyz`, and one access log line per request
    (logger `threadlog.access`, INFO).

    `authorize`: the hook asked before every read (threadlog/http/guard.py);
    `token_file`: bearer-token mode instead (one token per line). `limits`:
    id length, body size and open SSE streams (`Limits()` defaults).
    `stall_after`: seconds an owned partition may have records to judge without
    its judged position moving before `/readyz` says not ready (30)."""
    if tl is None and bootstrap_servers is None:
        raise ValueError("create_app needs an open ThreadLog or bootstrap_servers")
    if authorize is not None and token_file is not None:
        raise ValueError("give authorize or token_file, not both")
    if token_file is not None:
        authorize = bearer_tokens(token_file)
    limits = limits or Limits()
    holder: dict[str, Any] = {}

    def instrument(client: ThreadLog) -> None:
        holder["tl"] = client
        holder["metrics"] = attach(client)
        holder["ready"] = Readiness(client, timeout=min(5.0, client.opts.request_timeout), stall_after=stall_after)

    if tl is not None:
        instrument(tl)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if tl is not None:
            holder["ready"].start()
            yield
            return
        assert bootstrap_servers is not None  # checked above: no tl means options to open one
        async with open_threadlog(bootstrap_servers, namespace=namespace, **open_options) as client:
            instrument(client)
            holder["ready"].start()
            app.state.threadlog = client
            yield

    def get_tl() -> ThreadLog:
        return holder["tl"]

    ops = whole_path(ops_routes(lambda: holder.get("metrics"), lambda: holder.get("ready")))
    streams = StreamSlots(limits.max_streams)
    taken = shadowing(path)
    if taken is not None:
        raise ValueError(taken)
    app = Starlette(routes=[*ops, *routes(get_tl, path, authorize=authorize, limits=limits, streams=streams)],
                    lifespan=lifespan,
                    exception_handlers={HTTPException: _json_error, Exception: _json_error})
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes)
    app.add_middleware(AccessLog, metrics_of=lambda: holder.get("metrics"))
    app.state.streams = streams  # .open: SSE streams open now
    app.state.ops = holder  # "metrics", "ready": threadlog serve marks readiness draining on SIGTERM
    if tl is not None:
        app.state.threadlog = tl
    return app
