"""The query service of `threadlog worker`: its judge's state, served to thin clients.

Wire format: JSON lines over one persistent TCP connection per client,
requests multiplexed by id and answered in completion order:

    -> {"id": 7, "op": "get", "args": {"key": "<base64>", "floor": {"0": 12}}}
    <- {"id": 7, "ok": true, "result": {"value": "<base64>" | null}}
    <- {"id": 8, "ok": false, "code": "UNAVAILABLE", "message": "..."}

Operations (bytes travel as base64; partitions as JSON object keys):
- `verdict {p, o, timeout}`: the verdict at (p, o), answered once the judge has
  judged it (bounded by `timeout`, at most the server's);
- `verdicts {p, os, timeout}`: the verdicts at offsets `os` of partition p, in
  that order, answered once the judge has judged the lowest of them, null for
  any not judged by then (asked again): what a client asks when several of
  its proposals to p were acknowledged together (one request instead of one
  each);
- `barrier {partitions | null}`: the end offsets of those partitions, asked of
  the broker *after the request arrived*, once the judge has passed them -- so
  every write acknowledged before the client sent it is folded (SPEC 2,
  read-your-writes); returns those targets;
- `get {key, floor, barrier}` / `scan {prefix, start, limit, big, floor}`: reads of the store,
  first waiting until the judge reached `floor` (what the client's earlier
  barriers and verdicts saw: after a failover to a worker that lags behind,
  a read waits for it instead of answering older state). A `get` with
  `barrier: true` first passes a barrier on its partitions, as `barrier`
  does, and returns its `targets` with the value: a read after a barrier in
  one request. `gets {keys, floor, barrier}` reads several keys in one
  request (at most 1024), as `get` does one: `{values: [...]}` in the order
  asked, not one snapshot (the OpenAI Agents session's items). Scans are paged:
  `next` is the key to resume at, null at the end; pages are not one snapshot;
  a page ends before an item that would take it past SCAN_PAGE_BYTES (unless
  it is the page's first), and with `big` a value past BIG_VALUE_BYTES comes
  as [key, null] (read by `slice`);
- `query {name, args, floor, barrier}`: one of the named read-only queries of
  projections/queries.py run over the state of the partitions asked (a
  LangGraph tuple: one request where reading its keys takes three dependent
  rounds), with a barrier first as `get`'s; `{value}` with bytes as
  `{"$b": base64}`;
- `holders {q, kind, id, asof}`: threads holding a global id on partition q as
  of offset `asof` of q (another worker's judge asks, processors/lookups.py),
  answered once q is judged as far as the answer needs (processors/ahead.py);
  `holders_many {asked: [[q, kind, id, asof], ...], partitions}`: several, on
  the partitions routed to this worker, `{threads: [...]}` in the order asked;
- `push {secret}`: the last request of a connection (none other may be in
  flight when it arrives): from then on the judge writes the verdict of every
  proposal whose `threadlog.reply` header is `reply_token(secret)` to this
  connection, unasked, as lines
  `{"push": [[p, offset, verdict], ...]}` (processors/verdict_push.py), and
  `{"push": []}` every 2 s when idle; the first line back is the usual
  answer, `{"id": .., "ok": true, ...}`;
- any answer longer than 48 MiB is refused `ANSWER_TOO_LARGE` (a `gets` of
  large values, a query of a huge thread): the client asks for less, a key
  at a time, and a value too large for one answer in slices;
- `slice {key, start, length, partitions}`: bytes [start, start + length) of
  the value at `key` (at most SLICE_BYTES), `{size, digest, data}` (size and
  digest of the whole value: the client reads slices until it has `size`
  bytes, and again from the start if the digest moved), `{size: null}` when
  there is no value. Why: a stored record can pass what one answer carries
  though every write passed the proposal limit (a run record built by three
  patches of 14 MiB: 42 MiB, 56 MiB as base64; found by a review);
- `stats {}`: partitions owned, records judged, decisions that waited for
  another owner's answer, restores (operators, tests);
- `end_offsets {}`: the events partitions' end offsets (kept for thin clients of
  earlier versions, which asked it for a proposal's `seen`; current ones read Kafka).

Reads name their `partitions` (the client routes by partition, see
threadlog/remote.py); a worker that does not own one of them answers
`NOT_OWNER` and the client asks the new owner.

A request whose `args` do not have the shape its operation takes (`_ARGS`:
a field missing, of another type, past a bound; a query's own `args`,
`_QUERY_ARGS`) is refused `INVALID_ARGUMENT` naming the operation and the
field, before anything is read or waited for. Past that check, anything but
a ThreadLogError out of the operation is the worker failing (a stored record
it cannot read, a bug): `INTERNAL`, with the traceback in the worker's log.

Every judge reaches the same verdicts and state for the same log prefix
(processors/judge.py), so when ownership moves a client may switch workers
mid-stream without answers changing meaning; the floor keeps it from ever
reading a state older than one it already saw.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import hashlib
import inspect
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from threadlog.processors.judge import Judge
from threadlog.processors.lookups import MAX_HOLDERS
from threadlog.processors.snapshotter import Snapshotter
from threadlog.processors.verdict_push import VerdictPush, reply_token
from threadlog.producers.pump import settle_threadsafe
from threadlog.projections import run_index
from threadlog.projections.barrier import ReadBarrier
from threadlog.projections.delivery_follower import DeliveryIndex
from threadlog.projections.global_ids import holders_as_of
from threadlog.projections.partition_stores import PartitionStores
from threadlog.projections.queries import QUERIES, to_wire

from threadlog.kernel import addresses, wire
from threadlog.kernel.errors import (
    BEHIND,
    INTERNAL,
    INVALID_ARGUMENT,
    NOT_OWNER,
    UNAVAILABLE,
    ThreadLogError,
    not_owner,
)
from threadlog.kernel.topics import ANSWER_TOO_LARGE, MAX_REPLY_SECRET_BYTES

log = logging.getLogger("threadlog.query")
_T = TypeVar("_T")

# A JSON line may hold a whole stored value (a transcript up to the 16 MiB
# record limit, base64-inflated).
LINE_LIMIT = 64 * 1024 * 1024
# Longest answer line (clients read lines of up to 64 MiB; a value is at most 16 MiB).
MAX_ANSWER_BYTES = 48 * 1024 * 1024
SCAN_PAGE = 512
MAX_GETS = 1024  # keys per `gets` request

SCAN_PAGE_BYTES = 4 * 1024 * 1024
# Bytes of a value per `slice` answer (base64: 21 MiB of the 48 MiB line).
SLICE_BYTES = 16 * 1024 * 1024
# A scan asked with `big` answers values longer than this as [key, null]: the
# client reads each by its key (`slice`), where one item would pass a line.
BIG_VALUE_BYTES = 8 * 1024 * 1024
MAX_VERDICTS = 10_000  # offsets per `verdicts` request
# Answer bytes of replaced texts per paged `dlv_verdicts` answer (run_index.answered_size:
# base64 and frames). The page's last text, up to a record's 16 MiB (21.4 MiB as
# base64), may pass it: a page is under 30 MiB, with the verdicts well under 48.
REPS_PAGE_BYTES = 8 * 1024 * 1024
# Answer bytes of one connection built and not sent yet. Past it the server reads
# no more of that client's requests (TCP pushes back on it): a client that
# pipelined requests and never read its answers held all of them in memory (9.6
# GB measured). Answers, not requests in flight, are capped: a request waiting
# (a barrier, a verdict, another worker's question) holds little, and a cap on
# those left a read that could be answered at once unread behind them.
MAX_CONN_UNSENT = 64 * 1024 * 1024
# How often a `holders` question is settled again while the position it asks
# about lies beyond what the judge has fetched (processors/ahead.py): once
# fetched, the records in between may be seen not to mark the id, and the
# answer is final long before the partition is *judged* that far.
RESETTLE_S = 0.02


class _Unsent:
    """One connection's answers built and not sent yet (see MAX_CONN_UNSENT)."""

    def __init__(self) -> None:
        self.bytes = 0
        self.room = asyncio.Event()
        self.room.set()

    def add(self, n: int) -> None:
        self.bytes += n
        if self.bytes > MAX_CONN_UNSENT:
            self.room.clear()
        else:
            self.room.set()


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


def _slice_of(raw: bytes, at: int, length: int) -> tuple[str, str]:
    """(digest of the whole value, base64 of bytes [at, at + length)): a `slice` answer."""
    return hashlib.blake2b(raw, digest_size=16).hexdigest(), b64(raw[at:at + length])


def floor_of(raw: Any) -> dict[int, int]:
    return {int(p): int(o) for p, o in (raw or {}).items()}


class QueryServer:
    def __init__(self, stores: PartitionStores, judge: Judge, barrier: ReadBarrier, timeout: float = 30.0,
                 snapshotter: Snapshotter | None = None, deliveries: DeliveryIndex | None = None,
                 delivery_barrier: ReadBarrier | None = None) -> None:
        self.stores = stores
        self.deliveries = deliveries  # the run index of the delivery partitions owned here
        self.delivery_barrier = delivery_barrier
        self.snapshotter = snapshotter
        self.judge = judge
        self.push = VerdictPush()
        judge.push = self.push
        if deliveries is not None:
            deliveries.push = self.push  # delivery writers' answers ride the same connections
        self.barrier = barrier
        self.timeout = timeout
        self.holders_asked = 0  # other workers' id questions (stats)
        self.holders_ahead = 0  # ... answered before the partition was judged that far
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.StreamWriter] = set()
        self._inflight: set[asyncio.Task] = set()  # requests being answered
        self.draining = False
        self.address = ""

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen; return the address clients reach ("host:port", the real port for 0)."""
        self._server = await asyncio.start_server(self._serve, host, port, limit=LINE_LIMIT)
        bound_host, bound_port = self._server.sockets[0].getsockname()[:2]
        self.address = addresses.join(bound_host, bound_port)
        return self.address

    async def drain(self, timeout: float) -> int:
        """Stop listening and taking requests (new ones: NOT_OWNER, the client asks
        another worker); wait up to `timeout` for those in flight to be answered.
        Returns how many were still unanswered."""
        self.draining = True
        if self._server is not None:
            self._server.close()
        pending = set(self._inflight)
        if pending:
            log.info("draining: %d request(s) in flight", len(pending))
            _, pending = await asyncio.wait(pending, timeout=timeout)
        return len(pending)

    async def close(self) -> None:
        self.judge.push = None
        if self.deliveries is not None:
            self.deliveries.push = None
        self.push.close()
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
        unsent = _Unsent()
        try:
            while True:
                await unsent.room.wait()  # the client reads its answers, or we read no more from it
                if writer.transport.is_closing():
                    return  # cut off (an answer unread for a request timeout): its buffered lines go too
                line = await reader.readline()
                if not line:
                    return
                if not tasks and b'"push"' in line and await self._pushed_to(line, reader, writer):
                    return
                task = asyncio.create_task(self._answer(line, writer, lock, unsent))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                self._inflight.add(task)
                task.add_done_callback(self._inflight.discard)
                # Let it run up to its first wait: a read answered at once has counted
                # its answer before the next line is read (readline does not yield
                # while lines are buffered).
                await asyncio.sleep(0)
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            return  # a client that went away (or sent a line over the limit)
        finally:
            self._conns.discard(writer)
            for t in tasks:
                t.cancel()
            writer.close()

    async def _pushed_to(self, line: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """A `push` request: hand this connection to the judge's pushes until
        the client goes away. False if the line is not one (answered as usual)."""
        try:
            req = wire.loads(line)
            secret = str(req["args"]["secret"])
        except (ValueError, KeyError, TypeError):
            return False
        if req.get("op") != "push" or not 0 < len(secret.encode("utf-8")) <= MAX_REPLY_SECRET_BYTES or self.draining:
            return False
        raw = writer.get_extra_info("socket")
        sock = socket.socket(fileno=os.dup(raw.fileno()))
        token = reply_token(secret)
        # The answer goes out through the pushes' own socket, under their lock:
        # no verdict can reach the client before it.
        self.push.subscribe(token, sock, wire.dumps({"id": req.get("id"), "ok": True,
                                                 "result": {"pushing": True, "dlv": self.deliveries is not None}})
                            + b"\n")
        try:
            while await reader.read(4096):
                pass  # nothing more is expected from the client; EOF ends the subscription
        except ConnectionError:
            pass
        finally:
            self.push.unsubscribe(token, sock)
        return True

    async def _answer(self, line: bytes, writer: asyncio.StreamWriter, lock: asyncio.Lock, unsent: _Unsent) -> None:
        rid = op = None
        try:
            req = _request(line)
            rid, op = req.get("id"), req.get("op")
            if self.draining:
                raise not_owner("this worker is shutting down")
            result = await self.dispatch(op, req.get("args"))
            out = {"id": rid, "ok": True, "result": result}
        except ThreadLogError as exc:
            out = {"id": rid, "ok": False, "code": exc.code, "message": exc.message, "retryable": exc.retryable}
        except Exception as exc:
            # The request was checked before the operation ran (`_checked`): whatever
            # it raised now -- a ValueError or KeyError too (a stored record it cannot
            # decode, a bug) -- is this worker failing, not the caller's request.
            log.exception("query %r failed", op)
            out = {"id": rid, "ok": False, "code": INTERNAL, "message": f"the worker failed: {exc!r}"}
        try:
            line = wire.dumps(out)
        except (TypeError, ValueError) as exc:  # a bug: still answered, never left to time out
            log.exception("an answer could not be written as JSON")
            line = wire.dumps({"id": rid, "ok": False, "code": INTERNAL,
                               "message": f"the answer could not be written: {exc!r}"})
        if len(line) > MAX_ANSWER_BYTES:
            # A client drops a connection whose line passes its limit (every call
            # on it would fail): refuse instead; it asks for less (one key at a time).
            line = wire.dumps({"id": rid, "ok": False, "code": ANSWER_TOO_LARGE,
                                 "message": f"the answer is {len(line)} bytes; at most {MAX_ANSWER_BYTES}"})
        unsent.add(len(line))
        try:
            async with lock:
                writer.write(line + b"\n")
                # Bounded: a client that stops reading is cut off after a request
                # timeout, not waited for while its answers pile up behind this one.
                await asyncio.wait_for(writer.drain(), self.timeout)
        except ConnectionError:
            pass
        except TimeoutError:
            log.warning("a query client read no answer for %ss: disconnected", self.timeout)
            # abort, not close: close waits to send what is buffered, which this
            # client does not read; abort drops it and ends every waiting answer.
            writer.transport.abort()
        finally:
            unsent.add(-len(line))

    # -- operations -------------------------------------------------------------------
    async def dispatch(self, op: Any, raw_args: Any) -> Any:
        args = _checked(op, raw_args)  # INVALID_ARGUMENT unless it is what `op` takes
        if op in ("get", "gets"):
            many = op == "gets"
            asked = [unb64(k) for k in args["keys"]] if many else [unb64(args["key"])]
            parts, targets = await self._passed(args)
            # Not one snapshot (the judge thread may write between two keys), as
            # separate gets were not: readers of several keys check what they read.
            raws = self._read(lambda: [self.stores.get(k, parts) for k in asked], parts)
            values = [None if raw is None else b64(raw) for raw in raws]
            got: dict[str, Any] = {"values": values} if many else {"value": values[0]}
            if targets is not None:
                got["targets"] = targets
            got["at"] = self._at(parts)
            return got
        if op == "query":
            query = QUERIES[args["name"]]  # a known one (`_checked`), with the args it takes
            parts, targets = await self._passed(args)
            found = self._read(lambda: query(_Owned(self.stores, parts), **(args.get("args") or {})), parts)
            got = {"value": to_wire(found), "at": self._at(parts)}
            if targets is not None:
                got["targets"] = targets
            return got
        if op == "slice":
            parts = await self._owned(args)
            k, at = unb64(args["key"]), int(args["start"])
            length = min(int(args["length"]), SLICE_BYTES)
            raw = self._read(lambda: self.stores.get(k, parts), parts)
            if raw is None:
                return {"size": None, "at": self._at(parts)}
            at_judged = self._at(parts)
            # Off the loop: hashing a 42 MiB value and encoding 16 MiB of it took
            # ~150 ms, during which every other client's barrier and verdict waited.
            digest, data = await asyncio.to_thread(_slice_of, raw, at, length)
            return {"size": len(raw), "digest": digest, "data": data, "at": at_judged}
        if op == "scan":
            parts = await self._owned(args)
            prefix = unb64(args["prefix"])
            start = None if args.get("start") is None else unb64(args["start"])
            limit = min(int(args.get("limit") or SCAN_PAGE), SCAN_PAGE)
            big = BIG_VALUE_BYTES if args.get("big") else None
            pages = {str(p): self._read(functools.partial(self._scan, prefix, start, limit, p, big), parts)
                     for p in parts}
            return {"pages": pages, "at": self._at(parts)}
        if op == "verdict":
            (verdict,) = await self._verdicts(int(args["p"]), [int(args["o"])], self._bounded(args.get("timeout")))
            return verdict  # one offset: the lowest, never null
        if op == "verdicts":
            offsets = [int(o) for o in args["os"]]
            return {"verdicts": await self._verdicts(int(args["p"]), offsets, self._bounded(args.get("timeout")))}
        if op == "barrier":
            return {"targets": await self._barrier(await self._owned(args, floor=False),
                                                   self._bounded(args.get("wait")))}
        if op == "holders":
            return await self._holders(args)
        if op == "holders_many":
            return await self._holders_many(args)
        if op in _DELIVERY_OPS:
            return await self._delivery_op(op, args)
        if op == "stats":
            return self.stats()
        if op == "push":
            raise ThreadLogError(INVALID_ARGUMENT, "push takes a non-empty `secret` of at most "
                                                   f"{MAX_REPLY_SECRET_BYTES} bytes, as a connection's first request")
        if op == "end_offsets":
            return {str(p): o for p, o in (await self.barrier.end_offsets()).items()}
        raise RuntimeError(f"operation {op!r} is checked but not served")  # a bug: INTERNAL

    def stats(self) -> dict:
        """What this worker owns and has judged (operators, tests, benchmarks)."""
        judge = self.judge
        return {"owned": sorted(judge.owned), "judged": judge.stats["judged"], "blocked": judge.stats["blocked"],
                "restored": {str(p): info for p, info in judge.restores.items()},
                "restoring": judge.restoring,
                "applied": {str(p): judge.applied(p) for p in sorted(judge.owned)},
                "lookups": judge.lookups.asked if judge.lookups is not None else 0,
                "lookup_requests": judge.lookups.requests if judge.lookups is not None else 0,
                "holders": {"asked": self.holders_asked, "ahead": self.holders_ahead},
                "pushed": self.push.pushed,
                "deliveries": sorted(self.deliveries.owned) if self.deliveries is not None else [],
                "snapshots": self.snapshots() if self.snapshotter is not None else []}

    def snapshots(self) -> list[dict]:
        assert self.snapshotter is not None
        return list(self.snapshotter.written)

    async def _owned(self, args: dict, floor: bool = True) -> list[int]:
        """The partitions asked about, all owned here (else NOT_OWNER: the client
        asks their new owner), once the judge reached the client's floor."""
        parts = sorted({int(p) for p in args.get("partitions") or ()})
        gone = [p for p in parts if p not in self.judge.owned]
        if gone:
            raise not_owner(f"partitions {gone} are not owned by this worker")
        if floor:
            wanted = {p: o for p, o in floor_of(args.get("floor")).items() if p in parts}
            if wanted:
                await self._caught_up(wanted, self._bounded(args.get("wait")))
        return parts

    async def _passed(self, args: dict) -> tuple[list[int], dict[str, int] | None]:
        """`_owned`, then with `barrier` a read barrier on those partitions: the
        read carries its own barrier (one request, not two; a client of an
        earlier version never sends it, and one of this version falls back to
        two when `targets` is missing from the answer). One budget for both
        waits: the answer must come before the client's deadline."""
        began = time.monotonic()
        parts = await self._owned(args)
        if not args.get("barrier"):
            return parts, None
        return parts, await self._barrier(parts, self._bounded(args.get("wait")) - (time.monotonic() - began))

    async def _caught_up(self, targets: dict[int, int], timeout: float) -> None:
        """Wait for the judge to pass `targets`; BEHIND when it did not in time
        (the client asks again while its own deadline allows: a worker that
        just took partitions over may need longer than one request)."""
        try:
            await self.judge.wait(targets, timeout)
        except ThreadLogError as exc:
            if exc.code == NOT_OWNER:
                raise
            raise ThreadLogError(BEHIND, f"worker behind: {exc.message}") from None

    def _read(self, read: Callable[[], _T], parts: list[int]) -> _T:
        """A read of stores that may close under it when ownership moves. Checked
        after it too: a partition given up meanwhile is skipped by the stores
        (closed), which would answer "absent" for what it holds."""
        try:
            got = read()
        except Exception:
            if any(p not in self.judge.owned for p in parts):
                raise not_owner(f"partitions {parts} moved during the read") from None
            raise
        if any(p not in self.judge.owned for p in parts):
            raise not_owner(f"partitions {parts} moved during the read")
        return got

    def _at(self, parts: list[int]) -> dict[str, int]:
        """How far the judge is on `parts`, read after a read of them: at least the
        state that read saw (positions only move forward). The client raises its
        floor to it, so a later read -- after ownership moved to a worker still
        catching up -- never answers older state than this one did.

        The store's own position counts: it is written in one batch with the
        state it covers, while the judge publishes its position only after
        finishing the batch. Read between the two, the judge's alone was below
        the state the read had just returned (a review)."""
        topic = self.judge.topic
        # Through `_read`'s guard: a store closed by a revoke meanwhile is NOT_OWNER.
        stored = self._read(lambda: {p: self.stores.offset(topic, p) for p in parts}, parts)
        return {str(p): max(self.judge.applied(p), stored[p]) for p in parts}

    def _bounded(self, asked: Any) -> float:
        try:
            return max(0.01, min(float(asked), self.timeout))
        except (TypeError, ValueError):
            return self.timeout

    def _scan(self, prefix: bytes, start: bytes | None, limit: int, partition: int, big: int | None = None) -> dict:
        """A page of `partition` under `prefix`; with `big`, values longer than it
        as [key, null] (a client of an earlier version does not ask: it gets them)."""
        items: list[list[str | None]] = []
        size = 0
        for k, v in self.stores.scan(prefix, start, [partition]):
            inline = big is None or len(v) <= big
            grown = size + len(k) + (len(v) if inline else 0)
            # An item that would take the page past SCAN_PAGE_BYTES starts the next
            # page (unless it is the first): a page is at most max(4 MiB, one value
            # of up to 8 MiB). Checked after adding, a page could carry 4 + 8 MiB.
            if len(items) >= limit or (items and grown > SCAN_PAGE_BYTES):
                return {"items": items, "next": b64(k)}
            items.append([b64(k), b64(v) if inline else None])
            size = grown
        return {"items": items, "next": None}

    async def _verdicts(self, p: int, offsets: list[int], timeout: float) -> list[dict | None]:
        """The verdicts at `offsets` of p, once the first of them (the lowest) is
        judged; null for those not judged by then (the asker asks them again).

        Why not wait for all: one of a burst may wait for another owner's
        answer (or a rebalance), and the proposals judged before it would wait
        with it; the lowest is the one a request per offset would wait for."""
        # The offsets' count and bounds are `_checked`; the partitions' count is this worker's.
        if not 0 <= p < self.judge.partitions:
            raise ThreadLogError(INVALID_ARGUMENT, f"no events partition {p} (there are {self.judge.partitions})")
        loop = asyncio.get_running_loop()
        futs: list[asyncio.Future] = []
        callbacks: list[tuple[int, Callable[[dict], None]]] = []
        for o in offsets:
            fut: asyncio.Future = loop.create_future()
            judged = functools.partial(settle_threadsafe, loop, fut, None)  # on the judge's thread, or here
            futs.append(fut)
            callbacks.append((o, judged))
            self.judge.on_verdict(p, o, judged)
        first = futs[offsets.index(min(offsets))]
        try:
            await asyncio.wait_for(asyncio.shield(first), timeout)
        except TimeoutError:
            raise ThreadLogError(UNAVAILABLE, f"offset {min(offsets)} of partition {p} not judged "
                                              f"within {timeout}s") from None
        finally:
            # Whatever ends the wait (a timeout, a dropped connection cancelling the
            # request): no callback stays registered for an answer nobody reads.
            for (o, cb), fut in zip(callbacks, futs, strict=True):
                if not fut.done():
                    self.judge.forget(p, o, cb)
        verdicts = [fut.result() if fut.done() else None for fut in futs]
        for verdict in verdicts:
            if verdict is not None and verdict.get("code") == NOT_OWNER:  # not a verdict: ask the new owner
                raise not_owner(verdict.get("message") or f"partition {p} is not owned here")
        return verdicts

    async def _barrier(self, parts: list[int], wait: float) -> dict[str, int]:
        start = time.monotonic()
        ends = await self.barrier.end_offsets()  # asked after the request arrived
        targets = {p: ends[p] for p in parts}
        await self._caught_up(targets, max(0.1, wait - (time.monotonic() - start)))
        return {str(p): o for p, o in targets.items()}

    async def _holders(self, args: dict) -> dict:
        """Who holds a global id on partition q as of offset `asof` of q (for
        another worker's judge; see processors/judge.py). Waits until q is
        judged that far here, or only as far as the records in between can
        change the answer (processors/ahead.py): the answer is then final."""
        (threads,) = await self._holders_of([(int(args["q"]), str(args["kind"]), str(args["id"]), int(args["asof"]))],
                                            args.get("wait"))
        return {"threads": threads}

    async def _holders_many(self, args: dict) -> dict:
        """`holders` of several ids: of those asked about the partitions routed
        here (`partitions`), {"threads": [...]} in the order asked."""
        parts = {int(p) for p in args.get("partitions") or ()}
        asked = [(int(q), str(kind), str(ident), int(asof)) for q, kind, ident, asof in args["asked"]
                 if int(q) in parts]
        return {"threads": await self._holders_of(asked, args.get("wait"))}

    async def _holders_of(self, asked: list[tuple[int, str, str, int]], wait: Any) -> list[list[str]]:
        """Answered once each partition asked about is judged as far as its
        questions need (all of one proposal: see processors/lookups.py), within
        the asker's `wait`."""
        ahead = self.judge.ahead
        budget = self._bounded(wait)
        began = time.monotonic()
        self.holders_asked += len(asked)
        while True:
            need: dict[int, int] = {}
            early = 0  # questions settled before q is judged up to what they ask
            unfetched = False
            for q, kind, ident, asof in asked:
                settles = ahead.settles_at(q, kind, ident, asof)
                need[q] = max(need.get(q, 0), settles)
                if settles < asof and q in self.judge.owned and self.judge.applied(q) < asof:
                    early += 1
                # Settled before asof, q is fetched past it already: no need to ask.
                unfetched = unfetched or (settles == asof and ahead.may_settle_earlier(q, kind, asof))
            left = budget - (time.monotonic() - began)
            # Why slices: the wait's target is fixed when it starts. Asked of a
            # worker that has not fetched that far yet (it just took the
            # partition over, or its judge waits for answers from the asker),
            # the target is the position itself, and the asker waited for
            # every record before it to be judged -- while two catching-up
            # workers' judges waited on each other's answers (a fault probe).
            # Settled again every RESETTLE_S, the answer comes once the
            # records are fetched and seen not to mark the id.
            slice_ = min(left, RESETTLE_S) if unfetched else left
            floor = {str(q): n for q, n in need.items()}
            sliced = time.monotonic()
            try:
                await self._owned({"partitions": sorted(need), "floor": floor, "wait": slice_})
                break
            except ThreadLogError as exc:
                # Only a slice that ran out is settled again (a judge failing at
                # once is not looped on), and only while the budget lasts.
                if exc.code != BEHIND or slice_ >= left or time.monotonic() - sliced < slice_ / 2:
                    raise
        self.holders_ahead += early  # answered before q was judged up to asof
        return self._read(lambda: [holders_as_of(self.stores.store_of(q), kind, ident, asof)
                                   for q, kind, ident, asof in asked], sorted(need))

    # -- the delivery log's run index (threadlog/run_access.py, RemoteRuns) -------------------
    async def _delivery_op(self, op: str, args: dict) -> dict:
        index = self.deliveries
        if index is None or self.delivery_barrier is None:
            raise ThreadLogError(INVALID_ARGUMENT, "this worker keeps no delivery run index")
        d, run = int(args["d"]), str(args["run"])
        if d not in index.owned:
            raise not_owner(f"delivery partition {d} is not owned by this worker")
        wait = self._bounded(args.get("wait"))
        if op == "dlv_verdict":
            x, kind = int(args["x"]), str(args["kind"])
            await self._delivery_caught_up(index, {d: x if kind == run_index.CHUNKS else x + 1}, wait)
            verdict, fence = run_index.decided(index.store, run, x, kind, int(args["epoch"]))
            return {"verdict": verdict, "fence": fence, "state": run_index.run_state(index.store, run)}
        if op == "dlv_state":
            # The read barrier, at the owner: the end of the partition asked now,
            # after the read began, so every acknowledged write is below it.
            start = time.monotonic()
            ends = await self.delivery_barrier.end_offsets()
            await self._delivery_caught_up(index, {d: ends[d]}, max(0.1, wait - (time.monotonic() - start)))
            with index.store.lock:  # state and position of one instant (a fold batch is atomic)
                at = index.store.offset(index.topic, d)
                state = run_index.run_state(index.store, run)
            counts = {str(x): run_index.chunk_count(index.store, run, int(x)) for x in args.get("xs") or ()}
            return {"state": state, "at": at, "counts": counts}
        # dlv_verdicts: final below the position the reader got from dlv_state.
        lo, hi = int(args["lo"]), int(args["hi"])
        after = args.get("after")
        if after is not None and not (lo <= after[0] < hi and after[1] < 1 << 32):
            raise ThreadLogError(INVALID_ARGUMENT, f"dlv_verdicts: `after` {after} is not a position of [{lo}, {hi})")
        await self._delivery_caught_up(index, {d: hi}, wait)
        if not args.get("paged"):  # a client before pages: everything in one answer
            verdicts = [[x, v] for x, v in run_index.verdicts_between(index.store, run, lo, hi)]
            reps = [[x, i, text] for x, i, text in run_index.replacements_between(index.store, run, lo, hi)]
            return {"v": verdicts, "r": reps}
        # Paged: the verdicts with the first page (a few bytes per record), then
        # the replaced texts a page at a time, as base64 -- JSON escapes a
        # control character in six bytes, base64 any byte in 4/3, so a page
        # holding one whole text (up to a record's size) always fits an answer.
        page, more = run_index.replacements_page(index.store, run, lo, hi, None if after is None else
                                                 (after[0], after[1]), REPS_PAGE_BYTES)
        answer: dict[str, Any] = {"r64": [[x, i, base64.b64encode(text).decode("ascii")] for x, i, text in page],
                                  "more": None if more is None else list(more)}
        if after is None:
            answer["v"] = [[x, v] for x, v in run_index.verdicts_between(index.store, run, lo, hi)]
        return answer

    async def _delivery_caught_up(self, index: DeliveryIndex, targets: dict[int, int], timeout: float) -> None:
        try:
            await index.wait(targets, timeout)
        except ThreadLogError as exc:
            if exc.code == NOT_OWNER:
                raise
            raise ThreadLogError(BEHIND, f"worker behind on deliveries: {exc.message}") from None


class _Owned:
    """The read surface a query gets: the state of the partitions asked, only."""

    def __init__(self, stores: PartitionStores, parts: list[int]) -> None:
        self._stores = stores
        self._parts = parts

    def get(self, k: bytes) -> bytes | None:
        return self._stores.get(k, self._parts)

    def get_json(self, k: bytes) -> Any:
        raw = self.get(k)
        return None if raw is None else wire.loads_exact(raw)

    def scan(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        return self._stores.scan(prefix, None, self._parts)


_DELIVERY_OPS = frozenset({"dlv_verdict", "dlv_state", "dlv_verdicts"})


# -- what each operation takes ------------------------------------------------------------
# Every field an operation reads, its type, whether it is required, and the
# bounds the operation holds it to: checked here, in one place, before the
# operation runs (before any store is read or any wait begins).
#
# Why: INVALID_ARGUMENT tells the caller to change its request, so it must be
# said only of a request that is wrong. Once a request passed this check,
# whatever the operation raises but a ThreadLogError is the worker failing
# (INTERNAL). Guessing by the exception's type instead ("a KeyError or
# ValueError is a bad request") also answered INVALID_ARGUMENT to a request
# that was fine when the worker's own code raised one (a stored record it
# could not decode, a bug in a query).
#
# Optional fields may be absent or null (the operations read them with
# `args.get`). Fields not named are ignored, not refused: a client of a later
# version may send more, as `barrier` and `big` were added -- a worker of an
# earlier version ignored them and the client noticed by the answer
# (threadlog/remote.py). What real clients send: threadlog/remote.py (reads,
# `verdicts`, `push`), processors/lookups.py and time_travel.py (`holders`,
# `holders_many`), threadlog/run_access.py (`dlv_*`); every routed request
# carries `partitions`, `floor` and `wait` (QueryClient._ask).

_Check = Callable[[Any, str], str | None]  # (value, its name) -> what is wrong with it, or None


def _shown(v: Any) -> str:
    """A value in a refusal, briefly (a request may carry megabytes)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, dict)):
        return f"{'a list' if isinstance(v, list) else 'an object'} of {len(v)}"
    text = repr(v)
    return f"{type(v).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"


class _Kind:
    """A check of one value's kind; `ok` alone when no message is needed (a list's items)."""

    def __init__(self, what: str, ok: Callable[[Any], bool]) -> None:
        self.what, self.ok = what, ok

    def __call__(self, v: Any, name: str) -> str | None:
        return None if self.ok(v) else f"`{name}` must be {self.what}, got {_shown(v)}"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # JSON true is not 1


def _is_b64(v: Any) -> bool:
    if not isinstance(v, str):
        return False
    try:
        unb64(v)
    except ValueError:  # binascii.Error (padding) is one; so is non-ASCII text
        return False
    return True


def _or_null(check: _Check) -> _Check:
    return lambda v, name: None if v is None else check(v, name)


def _list(item: _Check, least: int = 0, most: int | None = None) -> _Check:
    def check(v: Any, name: str) -> str | None:
        if not isinstance(v, list):
            return f"`{name}` must be a list, got {_shown(v)}"
        if len(v) < least or (most is not None and len(v) > most):
            bound = f"at least {least}" if len(v) < least else f"at most {most}"
            return f"`{name}` takes {bound} items, got {len(v)}"
        # Items of one kind are asked `ok` first, naming none: a `verdicts` request
        # carries up to 10 000 offsets, and a message per item cost 10% of it.
        if isinstance(item, _Kind) and all(map(item.ok, v)):
            return None
        return next((wrong for i, x in enumerate(v) if (wrong := item(x, f"{name}[{i}]"))), None)
    return check


def _row(*items: _Check) -> _Check:
    """A list of exactly these items, in this order (a `holders_many` question)."""
    def check(v: Any, name: str) -> str | None:
        if not isinstance(v, list) or len(v) != len(items):
            return f"`{name}` must be a list of {len(items)}, got {_shown(v)}"
        return next((wrong for i, (c, x) in enumerate(zip(items, v, strict=True)) if (wrong := c(x, f"{name}[{i}]"))),
                    None)
    return check


STR = _Kind("a string", lambda v: isinstance(v, str))
INT = _Kind("an integer", _is_int)
NAT = _Kind("an integer >= 0", lambda v: type(v) is int and v >= 0)  # offsets, partitions, counts (not bool)
POSITIVE = _Kind("an integer > 0", lambda v: _is_int(v) and v > 0)
NUMBER = _Kind("a number", lambda v: _is_int(v) or isinstance(v, float))
BOOL = _Kind("true or false", lambda v: isinstance(v, bool))
B64 = _Kind("base64 text", _is_b64)
OBJECT = _Kind("an object", lambda v: isinstance(v, dict))
# {"<partition>": offset}: the positions the client already saw (`floor_of`).
FLOOR = _Kind("an object of partition number -> offset", lambda v: isinstance(v, dict) and all(
    p.isascii() and p.isdigit() and _is_int(o) and o >= 0 for p, o in v.items()))

_Spec = dict[str, tuple[_Check, bool]]  # field -> (its check, required)


def _need(check: _Check) -> tuple[_Check, bool]:
    return check, True


def _may(check: _Check) -> tuple[_Check, bool]:
    return check, False  # absent or null: the operation's default


_WAIT: _Spec = {"wait": _may(NUMBER)}  # seconds the client waits; bounded by the server's timeout
_READ: _Spec = {"partitions": _may(_list(NAT)), "floor": _may(FLOOR), **_WAIT}  # `_owned`
_ASKED: _Spec = {"run": _need(STR), "d": _need(NAT), **_WAIT}  # the delivery partition's run index

_ARGS: dict[str, _Spec] = {
    "get": {**_READ, "key": _need(B64), "barrier": _may(BOOL)},
    "gets": {**_READ, "keys": _need(_list(B64, most=MAX_GETS)), "barrier": _may(BOOL)},
    "query": {**_READ, "name": _need(STR), "args": _may(OBJECT), "barrier": _may(BOOL)},  # + `_QUERY_ARGS`
    "slice": {**_READ, "key": _need(B64), "start": _need(NAT), "length": _need(POSITIVE)},
    "scan": {**_READ, "prefix": _need(B64), "start": _may(B64), "limit": _may(NAT), "big": _may(BOOL)},
    # `p` below the worker's partition count is checked by `_verdicts`.
    "verdict": {"p": _need(NAT), "o": _need(NAT), "timeout": _may(NUMBER)},
    "verdicts": {"p": _need(NAT), "os": _need(_list(NAT, least=1, most=MAX_VERDICTS)), "timeout": _may(NUMBER)},
    "barrier": {"partitions": _may(_list(NAT)), **_WAIT},
    # `asof` is any integer: a proposal's `seen` (Avro longs) names it, and the
    # judge asking does not check it (a negative one is answered as of nothing).
    "holders": {"q": _need(NAT), "kind": _need(STR), "id": _need(STR), "asof": _need(INT), **_WAIT},
    "holders_many": {"asked": _need(_list(_row(NAT, STR, STR, INT), most=MAX_HOLDERS)),
                     "partitions": _may(_list(NAT)), **_WAIT},
    "dlv_verdict": {**_ASKED, "x": _need(NAT), "kind": _need(STR), "epoch": _need(INT)},
    "dlv_state": {**_ASKED, "xs": _may(_list(NAT))},
    # `paged`: replaced texts a page at a time, from after position `after` (run_index.replacements_page).
    "dlv_verdicts": {**_ASKED, "lo": _need(NAT), "hi": _need(NAT), "paged": _may(BOOL),
                     "after": _may(_row(NAT, NAT))},
    "push": {"secret": _need(STR)},  # only as a connection's first request (`_pushed_to`)
    "stats": {},
    "end_offsets": {},
}

# A named query's own `args`, passed to it as keyword arguments
# (projections/queries.py; what threadlog/session.py's callers send): each
# parameter it takes after the store, and nothing else (an unknown one would
# be a TypeError of the call). Checked here so that a wrong one is the
# caller's INVALID_ARGUMENT and anything the query raises later is INTERNAL.
# tests/unit/test_query_args.py holds this table to the functions' signatures.
_QUERY_ARGS: dict[str, _Spec] = {
    "agents.items": {"session": _need(STR), "limit": _need(_or_null(NAT))},
    "checkpoints.get": {"checkpoint_id": _need(STR)},
    "interrupts.of_run": {"run_id": _need(STR)},
    "langgraph.history": {"thread": _need(STR), "ns": _need(STR), "checkpoint_id": _need(_or_null(STR)),
                          "channels": _need(_list(STR)), "inclusive": _need(BOOL)},
    "langgraph.tuple": {"thread": _need(STR), "ns": _need(STR), "checkpoint_id": _need(_or_null(STR))},
    "runs.quiet": {"cutoff": _need(NUMBER)},
}


def _request(line: bytes) -> dict:
    """A request line as the object it must be: {"id", "op", "args"}."""
    try:
        req = wire.loads(line)
    except ValueError:  # not JSON (or not UTF-8)
        raise ThreadLogError(INVALID_ARGUMENT, "a request must be one JSON object per line") from None
    if not isinstance(req, dict):
        raise ThreadLogError(INVALID_ARGUMENT, f"a request must be a JSON object, got {_shown(req)}")
    if "id" not in req:
        raise ThreadLogError(INVALID_ARGUMENT, "a request must have an `id` (its answer carries it)")
    return req


def _wrong(spec: _Spec, args: dict, strict: bool = False) -> str | None:
    """What is wrong with `args` by `spec` (None: nothing); with `strict`, a
    field `spec` does not name is wrong too."""
    for name, (check, required) in spec.items():
        if name not in args or (args[name] is None and not required):
            if required:
                return f"`{name}` is required"
            continue
        if wrong := check(args[name], name):
            return wrong
    if strict and (extra := sorted(set(args) - set(spec))):
        return f"no argument `{extra[0]}`; it takes {', '.join(f'`{n}`' for n in spec) or 'none'}"
    return None


def _checked(op: Any, args: Any) -> dict:
    """`args` of a request of `op`, if they are what `op` takes (`_ARGS`);
    otherwise INVALID_ARGUMENT naming the operation and the field."""
    if not isinstance(op, str):
        raise ThreadLogError(INVALID_ARGUMENT, f"a request's `op` must be a string, got {_shown(op)}")
    spec = _ARGS.get(op)
    if spec is None:
        # Exactly so: a client takes "unknown operation ..." for a worker of an
        # earlier version (threadlog/remote.py, `_unsupported`).
        raise ThreadLogError(INVALID_ARGUMENT, f"unknown operation {op!r}")
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise ThreadLogError(INVALID_ARGUMENT, f"{op}: args must be an object, got {_shown(args)}")
    wrong = _wrong(spec, args)
    if wrong is None and op == "query":
        wrong = _query_wrong(args["name"], args.get("args") or {})
    if wrong is not None:
        raise ThreadLogError(INVALID_ARGUMENT, f"{op}: {wrong}")
    return args


def _query_wrong(name: str, qargs: dict) -> str | None:
    if name not in QUERIES:
        # Exactly so: a client takes "unknown query ..." for a worker of an earlier
        # version, without that query (threadlog/remote.py, `query`).
        raise ThreadLogError(INVALID_ARGUMENT, f"unknown query {name!r}")
    spec = _QUERY_ARGS.get(name)
    if spec is not None:
        wrong = _wrong(spec, qargs, strict=True)
        return None if wrong is None else f"query {name!r}: args: {wrong}"
    # A query added without a row above (its test says so): at least its
    # parameters' names, as the call would bind them.
    try:
        inspect.signature(QUERIES[name]).bind(None, **qargs)
    except TypeError as exc:
        return f"query {name!r}: args: {exc}"
    return None
