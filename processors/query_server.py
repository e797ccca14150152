"""The query service of `threadlog worker`: its judge's state, served to thin clients.

Wire format: JSON lines over one persistent TCP connection per client,
requests multiplexed by id and answered in completion order:

    -> {"id": 7, "op": "get", "args": {"key": "<base64>", "floor": {"0": 12}}}
    <- {"id": 7, "ok": true, "result": {"value": "<base64>" | null}}
    <- {"id": 8, "ok": false, "code": "UNAVAILABLE", "message": "..."}

Operations (bytes travel as base64; partitions as JSON object keys):
- `verdict {p, o, timeout}`: the verdict at (p, o), answered once the judge has
  judged it (bounded by `timeout`, at most the server's);
- `barrier {partitions | null}`: the end offsets of those partitions, asked of
  the broker *after the request arrived*, once the judge has passed them -- so
  every write acknowledged before the client sent it is folded (SPEC 2,
  read-your-writes); returns those targets;
- `get {key, floor}` / `scan {prefix, start, limit, floor}`: reads of the store,
  first waiting until the judge reached `floor` (what the client's earlier
  barriers and verdicts saw: after a failover to a worker that lags behind,
  a read waits for it instead of answering older state). Scans are paged:
  `next` is the key to resume at, null at the end; pages are not one snapshot;
- `end_offsets {}`: the events partitions' end offsets (for a proposal's `seen`).

Every judge reaches the same verdicts and state for the same log prefix
(processors/judge.py), so a client may ask any worker, and switch workers
mid-stream, without answers changing meaning.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import time
from typing import Any

import orjson
from threadlog.processors.judge import Judge
from threadlog.projections.barrier import ReadBarrier
from threadlog.projections.store import Store

from threadlog.errors import INVALID_ARGUMENT, UNAVAILABLE, ThreadLogError, unavailable

log = logging.getLogger("threadlog.query")

# A JSON line may hold a whole stored value (a transcript up to the 16 MiB
# record limit, base64-inflated).
LINE_LIMIT = 64 * 1024 * 1024
SCAN_PAGE = 512
SCAN_PAGE_BYTES = 4 * 1024 * 1024


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


def floor_of(raw: Any) -> dict[int, int]:
    return {int(p): int(o) for p, o in (raw or {}).items()}


class QueryServer:
    def __init__(self, store: Store, judge: Judge, barrier: ReadBarrier, timeout: float = 30.0) -> None:
        self.store = store
        self.judge = judge
        self.barrier = barrier
        self.timeout = timeout
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.StreamWriter] = set()
        self.address = ""

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen; return the address clients reach ("host:port", the real port for 0)."""
        self._server = await asyncio.start_server(self._serve, host, port, limit=LINE_LIMIT)
        bound_host, bound_port = self._server.sockets[0].getsockname()[:2]
        self.address = f"{bound_host}:{bound_port}"
        return self.address

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for w in list(self._conns):
                w.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._conns.add(writer)
        lock = asyncio.Lock()
        tasks: set[asyncio.Task] = set()
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                task = asyncio.create_task(self._answer(line, writer, lock))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            return  # a client that went away (or sent a line over the limit)
        finally:
            self._conns.discard(writer)
            for t in tasks:
                t.cancel()
            writer.close()

    async def _answer(self, line: bytes, writer: asyncio.StreamWriter, lock: asyncio.Lock) -> None:
        rid = None
        try:
            req = orjson.loads(line)
            rid = req["id"]
            result = await self.dispatch(req["op"], req.get("args") or {})
            out = {"id": rid, "ok": True, "result": result}
        except ThreadLogError as exc:
            out = {"id": rid, "ok": False, "code": exc.code, "message": exc.message}
        except Exception as exc:
            log.exception("query failed")
            out = {"id": rid, "ok": False, "code": INVALID_ARGUMENT, "message": f"bad request: {exc!r}"}
        async with lock:
            try:
                writer.write(orjson.dumps(out) + b"\n")
                await writer.drain()
            except ConnectionError:
                pass

    # -- operations -------------------------------------------------------------------
    async def dispatch(self, op: str, args: dict) -> Any:
        if op == "get":
            await self._floor(args.get("floor"))
            raw = self.store.get(unb64(args["key"]))
            return {"value": None if raw is None else b64(raw)}
        if op == "scan":
            await self._floor(args.get("floor"))
            return self._scan(unb64(args["prefix"]), None if args.get("start") is None else unb64(args["start"]),
                              min(int(args.get("limit") or SCAN_PAGE), SCAN_PAGE))
        if op == "verdict":
            return await self._verdict(int(args["p"]), int(args["o"]), self._bounded(args.get("timeout")))
        if op == "barrier":
            return {"targets": await self._barrier(args.get("partitions"))}
        if op == "end_offsets":
            return {str(p): o for p, o in (await self.barrier.end_offsets()).items()}
        raise ThreadLogError(INVALID_ARGUMENT, f"unknown operation {op!r}")

    def _bounded(self, asked: Any) -> float:
        try:
            return max(0.01, min(float(asked), self.timeout))
        except (TypeError, ValueError):
            return self.timeout

    async def _floor(self, raw: Any) -> None:
        floor = floor_of(raw)
        if floor:
            await self.judge.wait(floor, self.timeout)

    def _scan(self, prefix: bytes, start: bytes | None, limit: int) -> dict:
        items: list[list[str]] = []
        size = 0
        for k, v in self.store.scan(prefix, start):
            if len(items) >= limit or size >= SCAN_PAGE_BYTES:
                return {"items": items, "next": b64(k)}
            items.append([b64(k), b64(v)])
            size += len(k) + len(v)
        return {"items": items, "next": None}

    async def _verdict(self, p: int, o: int, timeout: float) -> dict:
        if not 0 <= p < self.judge.partitions or o < 0:
            raise ThreadLogError(INVALID_ARGUMENT, f"no events partition/offset ({p}, {o})")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def judged(verdict: dict) -> None:  # on the judge's thread, or here at once
            loop.call_soon_threadsafe(_settle, fut, verdict)

        self.judge.on_verdict(p, o, judged)
        try:
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            self.judge.forget(p, o, judged)
            raise ThreadLogError(UNAVAILABLE, f"offset {o} of partition {p} not judged within {timeout}s") from None

    async def _barrier(self, partitions: list[int] | None) -> dict[str, int]:
        start = time.monotonic()
        ends = await self.barrier.end_offsets()  # asked after the request arrived
        targets = ends if partitions is None else {int(p): ends[int(p)] for p in partitions}
        left = max(0.1, self.timeout - (time.monotonic() - start))
        try:
            await self.judge.wait(targets, left)
        except ThreadLogError as exc:
            raise unavailable(f"worker behind: {exc.message}") from None
        return {str(p): o for p, o in targets.items()}


def _settle(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)
