"""The thin client's side of the query service (processors/query_server.py).

A thin client (`threadlog.open(..., processors="external")`) keeps no judge:
proposals still go straight to Kafka, but verdicts, read barriers and reads
come from the workers that own the partitions concerned.

Finding the owner: every worker announces the events partitions it owns in
the compacted topic `<ns>.members` (threadlog/members.py) at every heartbeat
and at once when its assignment changes; `MembersView` follows that topic,
so routing is a local lookup. A call names its partitions; the client sends
one request per owner and merges (a `get` asks every owner: a key lives in
one partition's state; a `scan` merges each partition's ordered pages).

During a rebalance: a worker asked about a partition it does not own (any
more) answers NOT_OWNER, a dead one drops the connection, and a request to
one gone silent (a frozen host: no FIN, no RST) is abandoned once another
worker announces its partitions (or none live does); the client then
waits for the next announcement and asks again, until the request's deadline,
then fails with `UNAVAILABLE`. Every operation is a read, so resending is
harmless, and every judge reaches the same state for the same log prefix. What
could differ is *how far* an owner has judged (a new owner may still be
catching up): the client keeps a floor (per partition, the furthest position
any barrier, verdict or read answered it: an owner says how far it had judged
what it read) and every read carries it, so an owner
that lags behind waits before answering instead of serving older state than
this client already saw. Answers never come from a worker that does not own
the partition: a worker closes a partition's store when it gives it up.

`QueryClient` runs its connections on a thread of its own with its own event
loop, awaited from any caller's loop: single-key reads (`read`, the barrier in
the same request), several keys (`read_many`: `gets`), scans (`scan`) and
named queries run by the owner over its state (`query`: a LangGraph tuple,
`checkpoints.get`, interrupts by run, reclaimable runs; projections/queries.py).
Why a thread of its own: `RemoteStore` keeps the synchronous surface of the
local RocksDB stores (`get`, a lazily paged `scan`) for the few reads that
still use it (`blobs.list`, and queries read key by key when a worker will not
run them) -- each blocks its thread for a round trip, so they run on the
client's read pool (`off_loop`), and were the connections served by the
caller's loop, that blocked loop could never receive the answer.
"""


from __future__ import annotations

import asyncio
import base64
import functools
import heapq
import itertools
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator, Mapping
from concurrent.futures import Future as CFuture
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from .kernel import addresses, wire
from .kernel.errors import (
    BEHIND,
    INVALID_ARGUMENT,
    NOT_OWNER,
    OUTCOME_UNKNOWN,
    UNAVAILABLE,
    ThreadLogError,
    unavailable,
)
from .kernel.topics import ANSWER_TOO_LARGE, REPLY_HEADER
from .members import Member, MembersView
from .processors.verdict_push import BEAT_S, reply_token
from .producers.pump import inbox, within
from .projections.queries import from_wire

log = logging.getLogger("threadlog.remote")
_T = TypeVar("_T")

# Offsets per `verdicts` request (a worker takes up to 10 000).
VERDICTS_PER_REQUEST = 1000

LINE_LIMIT = 64 * 1024 * 1024
CONNECT_TIMEOUT = 2.0
RETRY_PAUSE = 0.1  # longest wait for a new announcement before asking again
SHUN_S = 1.0  # a worker that refused or dropped a call is skipped this long
MOVED_CHECK_S = 0.5  # how often a request awaiting an answer looks whether its partitions moved
GETS_PER_REQUEST = 64  # keys per `gets` request (a worker takes up to 1 024; values may be chunks)
SCAN_LIMIT = 512  # keys per `scan` page asked (the worker caps it too)
READ_THREADS = 16  # blocking reads of a thin client at once (off_loop); more wait for a thread
# A verdict not pushed this long after its ack is asked for (ownership moved to
# a worker this client did not hold a push connection to yet); asking is
# harmless, so this only bounds how late such a verdict can be.
PUSH_GRACE_S = 1.0
EARLY_KEEP_S = 30.0  # a pushed verdict whose ack never came is dropped after this
# Unclaimed pushed verdicts (and delivery answers) kept at most, each. Why:
# anyone who may write `events` can copy a client's reply token (a header on
# its proposals) onto forged ones, and every verdict pushed for those is above
# the client's last ack: uncapped, a flood of them grew its memory for 30 s
# at a time. Over the cap they are dropped: asking is always right.
MAX_EARLY = 10_000
# Value bytes asked per `slice` (the server's bound too), and whole reads of a
# value that keeps changing between its slices before UNAVAILABLE.
SLICE_BYTES = 16 * 1024 * 1024
SLICE_ATTEMPTS = 4
REFUSED_PAUSE_S = 60.0  # a worker that does not push (an earlier version) is asked again after this


class _ConnectionLost(Exception):
    pass


class _Moved(Exception):
    """The partitions a request asked about are announced elsewhere now (or by no live worker)."""


class _ConnectAbandoned(Exception):
    """The caller that opened a shared connect was cancelled: the others try again."""


async def _send(conn: _Conn, line: bytes) -> None:
    async with conn.lock:
        conn.writer.write(line)
        await conn.writer.drain()


class _Conn:
    def __init__(self, address: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.address = address
        self.reader = reader
        self.writer = writer
        self.pending: dict[int, asyncio.Future] = {}
        self.lock = asyncio.Lock()
        self.alive = True
        self.task: asyncio.Task | None = None

    async def run(self) -> None:
        try:
            while True:
                line = await self.reader.readline()
                if not line:
                    break
                msg = wire.loads(line)
                fut = self.pending.pop(msg.get("id"), None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
        except (ConnectionError, ValueError, asyncio.IncompleteReadError) as exc:
            log.info("connection to worker %s lost: %r", self.address, exc)
        finally:
            self.fail()

    def fail(self) -> None:
        self.alive = False
        pending, self.pending = self.pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(_ConnectionLost(self.address))
        # abort, not close: what is still buffered for a worker that stopped reading
        # would keep the connection (and its memory) until it read again.
        self.writer.transport.abort()


class NoQueries(Exception):
    """The worker will not run this query (QueryClient.query): an earlier
    version, or an answer too large for one line."""


class _Retry(Exception):
    """This worker could not answer for these partitions (gone, or not their owner now)."""


class _Behind(_Retry):
    """The owner is still catching up with the position asked for."""


def _settle(fut: CFuture, task: asyncio.Task) -> None:
    """A handed-over call's future from its task, unless settled already (by close)."""
    exc = None if task.cancelled() else task.exception()  # read even if unused: no "never retrieved"
    if fut.done():
        return
    try:
        if task.cancelled():
            fut.cancel()
        elif exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(task.result())
    except Exception:  # settled meanwhile by another thread (InvalidStateError)
        pass


def _endpoint(address: str) -> tuple[str, int]:
    """(host, port) of a worker's announced address; one that is none (a garbled
    members record) is a worker that cannot be reached, as a refused connect."""
    try:
        return addresses.split(address)
    except ValueError:
        raise OSError(f"worker address {address!r} is not HOST:PORT") from None


class QueryClient:
    """Calls to the workers, routed by partition to their owners.

    Every worker announces the events partitions it owns in `<ns>.members`
    (followed by a `MembersView`). A call names the partitions it is about; the
    client sends one request per owner and merges. A worker that does not own
    a partition (any more) answers NOT_OWNER; a dead one drops the connection:
    either way the client waits for the next announcement and sends again, to
    the deadline -- so a call during a rebalance waits, bounded, and never
    gets an answer from a worker that does not own the state.
    """

    def __init__(self, bootstrap: str, members_topic: str, client_id: str, timeout: float,
                 kafka: Mapping[str, Any] | None = None, partitions: int = 1) -> None:
        self.bootstrap = bootstrap
        self.kafka = kafka
        self.members_topic = members_topic
        self.client_id = client_id
        self.timeout = timeout
        self.partitions = partitions
        self._ids = itertools.count(1)
        self._floor: dict[int, int] = {}
        self._floor_lock = threading.Lock()
        self._conns: dict[str, _Conn] = {}
        self._connecting: dict[str, asyncio.Future] = {}
        self._shun: dict[str, float] = {}  # address -> until (monotonic): refused or unreachable
        self.members = MembersView(bootstrap, members_topic, client_id, kafka)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"query:{client_id}", daemon=True)
        self.failovers = 0
        self.closed = False
        self.closers: list[Callable[[], None]] = []  # run on the loop when closing (push connections)
        self._running: set[CFuture] = set()  # calls handed to the loop, not finished
        self._stopping = False
        # Handing a call to the loop and stopping it exclude each other: a call
        # handed over is either failed by `close` or refused, never left waiting.
        self._handover = threading.Lock()
        self._owners: tuple[int, dict[int, Member]] = (-1, {})  # (members version, partition -> owner)
        # Blocking multi-key reads run here (off_loop): a pool of our own, not the
        # caller loop's default one, which the application and LangGraph share.
        self.readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix=f"thin-read:{client_id}")
        self._barrier_gets = True  # False once a worker ignored `barrier` on a get (an earlier version)
        # Operations a worker did not know (an earlier version) -> monotonic time to try them again.
        self._unknown_ops: dict[str, float] = {}

    # -- lifecycle ------------------------------------------------------------------------
    def start(self, warn_alone: bool = True) -> None:
        """`warn_alone`: warn when no worker is registered yet -- news to a thin
        client, not to a worker asking its peers (every first worker said it)."""
        self._thread.start()
        # No live worker yet is not fatal (workers may start after their
        # clients): calls wait for one until their deadline.
        self.members.start(self.timeout)
        if warn_alone and not self.members.live():
            log.warning("no query worker registered in %s yet", self.members_topic)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True

        async def shut() -> None:
            for conn in list(self._conns.values()):
                conn.fail()
            for close in self.closers:
                close()

        running_loop = self._thread.is_alive()
        if running_loop:
            try:
                self._run(shut()).result(5)
            except Exception:  # pragma: no cover
                pass
        with self._handover:
            self._stopping = True
            running = list(self._running)
        # Every call handed over is failed for its caller first: the loop ends
        # their tasks next, and a task cancelled while its future was pending
        # would give the caller CancelledError instead of UNAVAILABLE.
        for fut in running:
            try:
                fut.set_exception(unavailable("this ThreadLog was closed during the call"))
            except Exception:  # finished meanwhile (InvalidStateError)
                pass
        if running_loop:
            # On the loop, after every `_start` queued before it (first in, first
            # out): end the tasks, then stop.
            self._loop.call_soon_threadsafe(self._begin_end)
            self._thread.join(5)
        else:
            self._drain(shut())  # the loop never ran (or died): end what it left from here
        self.members.close()
        self.readers.shutdown(wait=False, cancel_futures=True)
        # Closed, not left to the garbage collector: a loop holds an epoll fd and a
        # wake-up pipe, and the client's cycles kept them until a full collection
        # (tried, a review: ~18 fds more per open/close cycle of a thin client).
        if not self._thread.is_alive() and not self._loop.is_running() and not self._loop.is_closed():
            self._loop.close()
        self.closers.clear()

    def _begin_end(self) -> None:
        self._loop.create_task(self._end())

    async def _end(self, timeout: float = 2.0, stop: bool = True) -> None:
        """The loop's last step: cancel every other task, wait for them (bounded), stop.

        Why: a task dropped with the loop never runs its `finally`s, and one
        created in the loop's last iteration never ran a step at all -- its
        coroutine warned "was never awaited" at exit."""
        me = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not me]
        for task in tasks:
            task.cancel()
        try:
            if tasks:
                await asyncio.wait(tasks, timeout=timeout)
        finally:
            if stop:
                self._loop.stop()

    def _drain(self, shut: Coroutine[Any, Any, None]) -> None:
        """`shut` and `_end`, for a loop no thread runs: run here, unless this
        thread runs a loop of its own (a loop cannot run inside another) --
        then `shut` is closed unrun and the tasks are left."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            shut.close()
            return
        # Cancelled before the loop runs again: a task that never ran a step
        # gets the cancellation at its first, so none of its code runs after
        # close; the `_start`s still queued find their futures failed and close
        # their coroutines.
        for task in asyncio.all_tasks(self._loop):
            task.cancel()

        async def finish() -> None:
            try:
                await asyncio.wait_for(shut, 2.0)
            except Exception:  # pragma: no cover - best effort at close
                log.exception("closing the query client's connections")
            await self._end(stop=False)  # run_until_complete stops the loop itself

        try:
            self._loop.run_until_complete(finish())
        except Exception:  # pragma: no cover - best effort at close
            log.exception("ending the query client's tasks at close")

    @property
    def address(self) -> str | None:
        """A worker this client is connected to (tests)."""
        for addr, conn in list(self._conns.items()):  # changed on the loop meanwhile
            if conn.alive:
                return addr
        return None

    # -- the floor ----------------------------------------------------------------------
    def raise_floor(self, positions: dict[int, int]) -> None:
        with self._floor_lock:
            for p, o in positions.items():
                if o > self._floor.get(p, 0):
                    self._floor[p] = o

    def floor(self, partitions: list[int] | None = None) -> dict[str, int]:
        with self._floor_lock:
            return {str(p): o for p, o in self._floor.items() if partitions is None or p in partitions}

    # -- calls --------------------------------------------------------------------------
    def _run(self, coro: Coroutine[Any, Any, Any]) -> CFuture:
        # Under the lock: handing over wakes the loop with a syscall, which lets a
        # closing thread run; checked and added apart, a call handed over while
        # `close` stopped the loop and failed the running calls waited forever
        # (a CI run of tests/test_delivery_thin.py).
        with self._handover:
            if self._stopping:  # the loop would never run it
                coro.close()
                raise unavailable("this ThreadLog is closed")
            fut: CFuture = CFuture()
            self._loop.call_soon_threadsafe(self._start, coro, fut)
            self._running.add(fut)
        fut.add_done_callback(self._running.discard)
        return fut

    def _start(self, coro: Coroutine[Any, Any, Any], fut: CFuture) -> None:
        """On the loop: run a handed-over call as a task settling `fut`.

        Not `asyncio.run_coroutine_threadsafe`: `close` fails the calls a
        stopped loop will not finish, then ends their tasks (`_drain`), and a
        task chained to a future already failed would report a RuntimeError
        as it ended. Here whichever settles `fut` first wins, quietly."""
        if fut.done():  # failed by close, or cancelled by its caller, before it started
            coro.close()
            return
        try:
            task = self._loop.create_task(coro)
        except BaseException as exc:  # not a coroutine: the caller hears it, as from run_coroutine_threadsafe
            if not fut.done():
                fut.set_exception(exc)
            return
        task.add_done_callback(functools.partial(_settle, fut))
        # The caller gave up (its own cancellation): so does the call.
        fut.add_done_callback(lambda f: f.cancelled() and self._loop.call_soon_threadsafe(task.cancel))

    def call_sync(self, op: str, args: dict, partitions: list[int] | None = None) -> dict[tuple[int, ...], Any]:
        """Blocking `call` (from any thread but the client's own loop thread)."""
        return self.run_sync(self.call(op, args, partitions), self.timeout + 5)

    def run_sync(self, coro: Coroutine[Any, Any, _T], timeout: float) -> _T:
        """Blocking: `coro` run on the client's loop (from any thread but its own),
        waited for at most `timeout`."""
        if threading.current_thread() is self._thread:  # pragma: no cover - a bug, not a state
            coro.close()
            raise RuntimeError("QueryClient.run_sync on its own loop")
        fut = self._run(coro)
        try:
            return fut.result(timeout)
        except TimeoutError:
            # Reads only (RemoteStore, time travel's lookups): nothing was written.
            # The call is stopped, not left running on the loop, and the caller
            # gets a code SPEC lists, not a bare TimeoutError.
            fut.cancel()
            raise unavailable(f"the workers did not answer within {timeout:.0f}s") from None

    async def on_loop(self, coro: Coroutine[Any, Any, _T]) -> _T:
        """Await `coro` run on the client's loop, from any other loop."""
        if self.closed:
            coro.close()
            raise unavailable("this ThreadLog is closed")
        return await asyncio.wrap_future(self._run(coro))

    async def acall(self, op: str, args: dict, partitions: list[int] | None = None,
                    timeout: float | None = None) -> dict[tuple[int, ...], Any]:
        """Awaitable `call` from any event loop."""
        return await asyncio.wrap_future(self._run(self.call(op, args, partitions, timeout)))

    async def call(self, op: str, args: dict, partitions: list[int] | None = None,
                   timeout: float | None = None) -> dict[tuple[int, ...], Any]:
        """On the client's loop: ask the owners of `partitions` (None: any one
        worker), each request carrying its `partitions` and their floor.
        Returns {partitions asked of one worker: its result}."""
        if self.closed:
            raise unavailable("this ThreadLog is closed")
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        todo = None if partitions is None else sorted(set(partitions))
        results: dict[tuple[int, ...], Any] = {}
        if todo == []:
            return results  # nothing to ask (was: waited for an owner of nothing until the deadline)
        while True:
            if self.closed:  # closed during the call: its connections were failed, none is opened again
                raise unavailable("this ThreadLog was closed during the call")
            version = self.members.version
            plan, missing = self._plan(todo)
            if plan:
                sent = [self._ask(addr, op, args, ps, deadline) for addr, ps in plan.items()]
                outcomes = await asyncio.gather(*sent, return_exceptions=True)
                retry: list[int] = []
                for (_addr, ps), out in zip(plan.items(), outcomes, strict=True):
                    if isinstance(out, _Retry):
                        retry.extend(ps or [])
                        if ps is None:
                            retry = []
                            missing = True
                    elif isinstance(out, BaseException):
                        raise out
                    else:
                        results[tuple(ps or ())] = out
                if todo is None:
                    if not missing:
                        return results
                else:
                    todo = sorted(set(retry) | set(missing or []))
                    if not todo:
                        return results
            left = deadline - time.monotonic()
            if left <= 0:
                what = "any partition" if todo is None else f"partitions {todo}"
                raise unavailable(f"{op}: no live worker of {self.members_topic} answered for {what} "
                                  "within the request timeout")
            # Wait for the next announcement (a new owner), briefly: a dead
            # owner is replaced only after the group notices it. Slept on this
            # loop, not blocked in a thread: waiting calls of a rebalance queued for
            # the default executor's few threads and overshot their deadlines.
            if self.members.version == version:
                await asyncio.sleep(min(RETRY_PAUSE, left))

    def owner_of(self, partition: int) -> str | None:
        """The address of the live worker that announced `partition` last (None: none now)."""
        owner = self.owner(partition)
        return None if owner is None else owner.address

    async def announced_owner(self, partition: int) -> Member:
        """The live worker that announced `partition` last, waited for (on the
        caller's loop) while none has: a worker that just started, or a
        rebalance. `UNAVAILABLE` after the request timeout, as a call to it."""
        deadline = time.monotonic() + self.timeout
        while (owner := self.owner(partition)) is None:
            left = deadline - time.monotonic()
            if left <= 0 or self.closed:
                raise unavailable(f"no live worker of {self.members_topic} announced partition {partition} "
                                  "within the request timeout")
            await asyncio.sleep(min(RETRY_PAUSE, left))
        return owner

    def owner(self, partition: int) -> Member | None:
        """The live worker that announced `partition` last (None: none now).
        Cached per announcement: asked for every acknowledged proposal."""
        version, owners = self._owners
        now = self.members.version  # read before the members: a newer record then rebuilds again
        if version != now:
            owners = {}
            for m in sorted(self.members.live(), key=lambda m: -m.heartbeat_at):  # the newest first
                for p in range(self.partitions):
                    if p not in owners and m.serves(p):
                        owners[p] = m
            self._owners = (now, owners)
        return owners.get(partition)

    def _plan(self, todo: list[int] | None) -> tuple[dict[str, list[int] | None], Any]:
        """{worker address: the partitions to ask it}, and what has no owner now."""
        now = time.monotonic()
        live = [m for m in self.members.live() if self._shun.get(m.address, 0) <= now]
        live.sort(key=lambda m: -m.heartbeat_at)  # the newest announcement first
        if todo is None:
            if not live:
                return {}, True
            pick = random.choice(live[: max(1, len(live))])
            return {pick.address: None}, False
        plan: dict[str, list[int] | None] = {}
        missing: list[int] = []
        for p in todo:
            owner = next((m for m in live if m.serves(p)), None)
            if owner is None:
                missing.append(p)
            else:
                group = plan.setdefault(owner.address, [])
                assert group is not None
                group.append(p)
        return plan, missing

    async def _ask(self, address: str, op: str, args: dict, partitions: list[int] | None, deadline: float) -> Any:
        try:
            conn = await self._conn(address, deadline)
        except (OSError, TimeoutError):
            self._shun[address] = time.monotonic() + SHUN_S
            raise _Retry(address) from None
        if not conn.alive or conn.writer.transport.is_closing():
            # Lost between its connect and now (a shared connect hands over a _Conn that
            # may have died meanwhile): a write to it would vanish without an error.
            self.failovers += 1
            raise _Retry(address)
        rid = next(self._ids)
        fut = self._loop.create_future()
        conn.pending[rid] = fut
        body = dict(args)
        if partitions is not None:
            body["partitions"] = partitions
            body["floor"] = self.floor(partitions)
        body["wait"] = max(0.01, deadline - time.monotonic())  # waits at the worker end before our deadline
        line = wire.dumps({"id": rid, "op": op, "args": body}) + b"\n"
        try:
            if conn.lock.locked() or conn.writer.transport.get_write_buffer_size():
                # Something is queued for this worker: wait our turn, bounded by our own
                # deadline (a worker that stopped reading held every call to it, past
                # their timeouts).
                try:
                    await asyncio.wait_for(_send(conn, line), max(0.01, deadline - time.monotonic()))
                except TimeoutError:
                    conn.pending.pop(rid, None)
                    conn.fail()  # a line may be half written: the stream is no use any more
                    self._shun[address] = time.monotonic() + SHUN_S
                    raise unavailable(f"{op}: worker {address} took no request within the request timeout"
                                      ) from None
            else:
                conn.writer.write(line)  # nothing queued: buffered at once, no wait
            msg = await self._answer(fut, address, partitions, deadline)
        except _Moved:
            conn.pending.pop(rid, None)
            self.failovers += 1
            raise _Retry(address) from None
        except (_ConnectionLost, ConnectionError):
            conn.fail()
            self.failovers += 1
            self._shun[address] = time.monotonic() + SHUN_S
            raise _Retry(address) from None
        except TimeoutError:
            conn.pending.pop(rid, None)
            raise unavailable(f"{op}: no answer from worker {address} within the request timeout") from None
        if msg.get("ok"):
            result = msg.get("result")
            if isinstance(result, dict) and isinstance(result.get("at"), dict):
                # How far the owner had judged what it read: the floor of every later read.
                self.raise_floor({int(p): int(o) for p, o in result["at"].items()})
            return result
        code = msg.get("code") or UNAVAILABLE
        if code == NOT_OWNER:
            self.failovers += 1
            raise _Retry(address)
        if code == BEHIND:
            if deadline - time.monotonic() > 0.05:
                raise _Behind(address)  # the owner is catching up: ask it again
            # Internal, like NOT_OWNER: a caller gets a SPEC code. BEHIND reached
            # callers whose timeout ended just after the worker's own (a review).
            raise unavailable(f"{op}: worker {address} had not judged as far as this read needs by the "
                              f"request deadline: {msg.get('message') or 'behind'}")
        retryable = msg.get("retryable")  # absent from an older worker's answer: the code's default
        raise ThreadLogError(code, msg.get("message") or "refused by the worker",
                             retryable=retryable if isinstance(retryable, bool) else None)

    def _answer(self, fut: asyncio.Future, address: str, partitions: list[int] | None,
                deadline: float) -> asyncio.Future:
        """`fut`, failed with TimeoutError at `deadline`, or with `_Moved` once the
        partitions asked are announced by another worker, or by none live.

        Why: a worker whose host froze or dropped off the network keeps its
        connection open -- no FIN, no RST -- so an answer from it was awaited for
        the whole request timeout, although another worker took its partitions
        over within seconds. One timer per request, looking every MOVED_CHECK_S.
        """
        loop = self._loop

        def look() -> None:
            if fut.done():
                return
            left = deadline - time.monotonic()
            if left <= 0:
                fut.set_exception(TimeoutError())
            elif partitions and any(self.owner_of(p) != address for p in partitions):
                fut.set_exception(_Moved())
            else:
                loop.call_later(min(MOVED_CHECK_S, left), look)

        loop.call_later(max(0.0, min(MOVED_CHECK_S, deadline - time.monotonic())), look)
        return fut

    async def _conn(self, address: str, deadline: float) -> _Conn:
        conn = self._conns.get(address)
        if conn is not None and conn.alive:
            return conn
        waiting = self._connecting.get(address)
        if waiting is not None:  # one connect per address; the others share it
            try:
                return await asyncio.shield(waiting)
            except _ConnectAbandoned:
                return await self._conn(address, deadline)
        self._forget_gone()
        fut = self._loop.create_future()
        self._connecting[address] = fut
        try:
            host, port = _endpoint(address)
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port, limit=LINE_LIMIT),
                max(0.01, min(CONNECT_TIMEOUT, deadline - time.monotonic())))
            conn = _Conn(address, reader, writer)
            conn.task = self._loop.create_task(conn.run())
            self._conns[address] = conn
            fut.set_result(conn)
            return conn
        except BaseException as exc:
            # A cancelled opener is its own business: the callers sharing this
            # connect got its CancelledError (a task of theirs died of a cancel
            # it never had); they connect again instead.
            fut.set_exception(_ConnectAbandoned() if isinstance(exc, asyncio.CancelledError) else exc)
            fut.exception()  # retrieved: no "never retrieved" warning when nobody shared it
            raise
        finally:
            del self._connecting[address]

    def _forget_gone(self) -> None:
        """Drop the dead connections to workers no longer announced, and shuns that ended.

        Why: a worker restarted (or moved) announces another address, often a new
        port; a long-lived client kept a dead connection and a shun per address it
        ever used (~8 KB each, a soak found). Done as a connection is opened (on the
        loop, which alone changes these), so it runs when a new address appears."""
        live = {m.address for m in self.members.live()}
        now = time.monotonic()
        for address in [a for a, conn in self._conns.items() if not conn.alive and a not in live]:
            del self._conns[address]
        for address in [a for a, until in self._shun.items() if until <= now]:
            del self._shun[address]

    # -- operations ---------------------------------------------------------------------
    def all_partitions(self) -> list[int]:
        return list(range(self.partitions))

    def _asked(self, partitions: list[int] | None) -> list[int]:
        """The partitions a read of `partitions` asks about (None: every one)."""
        return self.all_partitions() if partitions is None else partitions

    async def barrier(self, partitions: list[int] | None) -> dict[int, int]:
        asked = self._asked(partitions)
        results = await self.acall("barrier", {}, asked)
        targets = {int(p): int(o) for result in results.values() for p, o in result["targets"].items()}
        self.raise_floor(targets)
        return targets

    async def read(self, k: bytes, partitions: list[int] | None, barrier: bool) -> bytes | None:
        """The value at `k` in the state of `partitions` (all when None; a key
        lives in one partition's state), from any event loop without blocking it.

        With `barrier`, each owner first passes a read barrier on the
        partitions asked of it, in the same request: one round trip where a
        barrier and then a `get` took two (and the `get`, a blocking call,
        held the caller's loop meanwhile)."""
        if barrier and not self._barrier_gets:  # a worker of an earlier version was met: two requests
            await self.barrier(partitions)
            return await self.read(k, partitions, False)
        args: dict[str, Any] = {"key": _b64(k)}
        if barrier:
            args["barrier"] = True
        try:
            results = await self.acall("get", args, self._asked(partitions))
        except ThreadLogError as exc:
            if exc.code != ANSWER_TOO_LARGE:
                raise
            if barrier:  # the refused answer raised no floor
                await self.barrier(partitions)
            return await self.read_sliced(k, partitions)
        if barrier and any("targets" not in result for result in results.values()):
            self._barrier_gets = False  # that worker ignored `barrier`: from now on, the two requests
            return await self.read(k, partitions, True)
        if barrier:
            self._floor_from(results)
        holders = [parts for parts, result in results.items() if result["value"] is not None]
        if len(holders) > 1:
            return await self.read_lowest(k, holders)
        return base64.b64decode(results[holders[0]]["value"]) if holders else None

    async def read_sliced(self, k: bytes, partitions: list[int] | None) -> bytes | None:
        """`read` (no barrier) of a value too large for one answer, in `slice`s.

        Why: a stored record can outgrow one answer though every write that
        built it passed the proposal limit (a run record of three 14 MiB
        patches: 42 MiB). The slices are not one snapshot: each carries the
        digest of the whole value, and a value that changed between two of
        them is read again from its start."""
        key64 = _b64(k)
        no_slices = ("a value too large for one answer cannot be read through a worker of an earlier "
                     "version (it has no `slice`): upgrade the workers")
        if not self._supports("slice"):
            raise unavailable(no_slices)

        async def ask(start: int, parts: list[int]) -> dict[tuple[int, ...], Any]:
            try:
                return await self.acall("slice", {"key": key64, "start": start, "length": SLICE_BYTES}, parts)
            except ThreadLogError as exc:
                # Not INVALID_ARGUMENT (the caller's input is fine): what it asked
                # exists, this worker cannot serve it yet.
                if self._unsupported(exc, "slice"):
                    raise unavailable(no_slices) from None
                raise

        for _ in range(SLICE_ATTEMPTS):
            holders = sorted((parts, got) for parts, got in (await ask(0, self._asked(partitions))).items()
                             if got["size"] is not None)
            if not holders:
                return None
            parts, got = holders[0]
            # An answer for several partitions does not say which one holds the
            # value, and twins of one id (several owners hold it) are read at the
            # lowest partition, as `read` does: so the holders' partitions are
            # asked one by one, lowest first, and the first holding it is read.
            # (Taking the lowest partition asked read partition 0 for a value held
            # elsewhere: "absent", four times, then UNAVAILABLE.)
            if len(holders) > 1 or len(parts) > 1:
                for p in sorted(p for held, _ in holders for p in held):
                    (got,) = (await ask(0, [p])).values()
                    if got["size"] is not None:
                        parts = (p,)
                        break
                else:
                    continue  # deleted meanwhile (or moved): asked again from the start
            data = bytearray(base64.b64decode(got["data"]))
            while len(data) < got["size"]:
                (more,) = (await ask(len(data), list(parts))).values()
                if more["size"] != got["size"] or more["digest"] != got["digest"] or not more["data"]:
                    break  # replaced or deleted meanwhile: from the start
                data += base64.b64decode(more["data"])
            else:
                return bytes(data)
        raise unavailable(f"a value of {len(k)}-byte key kept changing while it was read in slices")

    async def read_lowest(self, k: bytes, holders: list[tuple[int, ...]]) -> bytes | None:
        """`k`'s value in the lowest partition holding it, when owners of several do.

        A key lives in one partition's state, except an id that two partitions
        accepted concurrently (README, "concurrent first writes"). An embedded
        client reads the lowest partition's copy (`PartitionStores.get`); a thin
        client must follow the same one -- it took the last owner's answer, and
        so resolved or deleted the other copy than an embedded client did. Each
        owner answers the lowest of its own partitions, so the partitions of the
        owners that hold one are asked one by one, lowest first (rare: only such
        twins take this path). The floor the first request raised still holds."""
        for p in sorted(p for parts in holders for p in parts):
            value = await self.read(k, [p], False)
            if value is not None:
                return value
        return None

    async def read_many(self, ks: list[bytes], partitions: list[int] | None, barrier: bool) -> list[bytes | None]:
        """The values at `ks`, in that order, as `read` reads one: one request
        per owner for up to GETS_PER_REQUEST keys (the groups asked at once).
        One `get` per key where a worker has no `gets` (an earlier version) or
        the values are too large for one answer."""
        if ks and self._supports("gets"):
            groups = [ks[i:i + GETS_PER_REQUEST] for i in range(0, len(ks), GETS_PER_REQUEST)]
            try:
                answers = await asyncio.gather(*(self._gets(group, partitions, barrier) for group in groups))
                return [value for answer in answers for value in answer]
            except ThreadLogError as exc:
                if not self._unsupported(exc, "gets") and exc.code != ANSWER_TOO_LARGE:
                    raise
        if barrier:
            await self.barrier(partitions)
        return list(await asyncio.gather(*(self.read(k, partitions, False) for k in ks)))

    async def _gets(self, ks: list[bytes], partitions: list[int] | None, barrier: bool) -> list[bytes | None]:
        args: dict[str, Any] = {"keys": [_b64(k) for k in ks]}
        if barrier:
            args["barrier"] = True
        results = await self.acall("gets", args, self._asked(partitions))
        if barrier:
            self._floor_from(results)
        values: list[bytes | None] = [None] * len(ks)
        holders: list[list[tuple[int, ...]]] = [[] for _ in ks]
        for parts, result in results.items():
            for i, got in enumerate(result["values"]):
                if got is not None:
                    values[i] = base64.b64decode(got)
                    holders[i].append(parts)
        for i, held in enumerate(holders):
            if len(held) > 1:  # twins of one id: the lowest partition's copy, as `read`
                values[i] = await self.read_lowest(ks[i], held)
        return values

    async def query(self, name: str, args: dict, partitions: list[int] | None, barrier: bool) -> list[Any]:
        """The answers of the named query (projections/queries.py), one per
        owner of `partitions` (all when None), each run over the state of the
        partitions asked of it, after a read barrier there if `barrier` (in the
        same request). NoQueries if a worker will not run it (an earlier
        version without `query`, or an answer too large for one line): the
        caller reads the keys itself."""
        if not self._supports("query") or not self._supports(f"query {name}"):
            raise NoQueries
        body: dict[str, Any] = {"name": name, "args": args}
        if barrier:
            body["barrier"] = True
        try:
            results = await self.acall("query", body, self._asked(partitions))
        except ThreadLogError as exc:
            if exc.code == INVALID_ARGUMENT and exc.message.startswith("unknown query "):
                # A worker of an earlier version, without this query (added later):
                # not asked again for a while (workers may be upgraded).
                self._unknown_ops[f"query {name}"] = time.monotonic() + REFUSED_PAUSE_S
                raise NoQueries from None
            if self._unsupported(exc, "query") or exc.code == ANSWER_TOO_LARGE:
                raise NoQueries from None
            raise
        if barrier:
            self._floor_from(results)
        return [from_wire(result["value"]) for result in results.values()]

    def _floor_from(self, results: dict[tuple[int, ...], Any]) -> None:
        """Raise the floor to the `targets` a barrier carried by a read answered."""
        for result in results.values():
            self.raise_floor({int(p): int(o) for p, o in result["targets"].items()})

    def _supports(self, op: str) -> bool:
        return self._unknown_ops.get(op, 0.0) <= time.monotonic()

    def _unsupported(self, exc: ThreadLogError, op: str) -> bool:
        """Is `exc` a worker's answer that it has no `op` (an earlier version:
        query_server's "unknown operation 'op'", its only message that starts
        so)? If so, `op` is not asked for a while (workers may be upgraded)."""
        if exc.code != INVALID_ARGUMENT or not exc.message.startswith("unknown operation "):
            return False
        self._unknown_ops[op] = time.monotonic() + REFUSED_PAUSE_S
        return True

    async def first_pages(self, prefix: bytes, start64: str | None, limit: int, asked: list[int]) -> dict[int, dict]:
        """The first scan page of each partition in `asked`: one request per owner,
        or, when an owner's pages together pass one answer (each page can be
        ~11 MiB as base64: several partitions' pass 48 MiB), one per partition."""
        try:
            first = await self.acall("scan", _scan_args(prefix, start64, limit), asked)
        except ThreadLogError as exc:
            if exc.code != ANSWER_TOO_LARGE or len(asked) == 1:
                raise
            each = await asyncio.gather(*(self.acall("scan", _scan_args(prefix, start64, limit), [p])
                                          for p in asked))
            first = {parts: result for one in each for parts, result in one.items()}
        return {int(p): page for result in first.values() for p, page in result["pages"].items()}

    async def scan(self, prefix: bytes, partitions: list[int] | None) -> list[tuple[bytes, bytes]]:
        """Every (key, value) under `prefix` in the state of `partitions` (all when
        None), ascending, from any event loop without blocking it: every owner's
        first pages in one round, then each partition paged on its own. Pages are
        not one snapshot."""
        pages = await self.first_pages(prefix, None, SCAN_LIMIT, self._asked(partitions))

        async def rest(p: int) -> list[tuple[bytes, bytes]]:
            page = pages[p]
            got: list[tuple[bytes, bytes]] = []
            while True:
                for k64, v64 in page["items"]:
                    k = base64.b64decode(k64)
                    # A value too large for a page comes by its key (gone meanwhile: skipped).
                    v = base64.b64decode(v64) if v64 is not None else await self.read_sliced(k, [p])
                    if v is not None:
                        got.append((k, v))
                if page["next"] is None:
                    return got
                (result,) = (await self.acall("scan", _scan_args(prefix, page["next"], SCAN_LIMIT), [p])).values()
                page = result["pages"][str(p)]

        found = await asyncio.gather(*(rest(p) for p in sorted(pages)))
        return list(heapq.merge(*found, key=lambda kv: kv[0]))


class RemoteStore:
    """The read surface of `projections.store.Store` the facades use, served by
    the owners of the partitions: a `get` asks every owner (a key lives in one
    partition's state), a `scan` merges each partition's ordered pages."""

    def __init__(self, client: QueryClient, page: int = SCAN_LIMIT) -> None:
        self._client = client
        self.page = page  # keys per scan request (the server caps it too)
        # A value read in slices: a few requests per attempt.
        self._sliced_timeout = client.timeout * SLICE_ATTEMPTS + 5

    def get(self, k: bytes) -> bytes | None:
        try:
            results = self._client.call_sync("get", {"key": _b64(k)}, self._client.all_partitions())
        except ThreadLogError as exc:
            if exc.code != ANSWER_TOO_LARGE:
                raise
            return self._client.run_sync(self._client.read_sliced(k, None), self._sliced_timeout)
        holders = [parts for parts, result in results.items() if result["value"] is not None]
        if len(holders) > 1:  # twins of one id: the lowest partition's, as every reader takes (`read_lowest`)
            return self._client.run_sync(self._client.read_lowest(k, holders), self._client.timeout + 5)
        return None if not holders else base64.b64decode(results[holders[0]]["value"])

    def get_json(self, k: bytes) -> Any:
        raw = self.get(k)
        return None if raw is None else wire.loads_exact(raw)

    def scan(self, prefix: bytes, start: bytes | None = None) -> Iterator[tuple[bytes, bytes]]:
        """Keys with `prefix` ascending from `start`: every partition's first
        page in one round, then each partition paged on its own, merged."""
        start_b64 = None if start is None else _b64(start)
        client = self._client
        # Two rounds at most (all at once, then one partition each), each bounded.
        pages = client.run_sync(client.first_pages(prefix, start_b64, self.page, client.all_partitions()),
                                2 * client.timeout + 5)
        return heapq.merge(*(self._pages(prefix, p, pages[p]) for p in sorted(pages)), key=lambda kv: kv[0])

    def _pages(self, prefix: bytes, p: int, page: dict) -> Iterator[tuple[bytes, bytes]]:
        while True:
            for k64, v64 in page["items"]:
                k = base64.b64decode(k64)
                v = base64.b64decode(v64) if v64 is not None else \
                    self._client.run_sync(self._client.read_sliced(k, [p]), self._sliced_timeout)
                if v is not None:
                    yield k, v
            if page["next"] is None:
                return
            (result,) = self._client.call_sync("scan", _scan_args(prefix, page["next"], self.page), [p]).values()
            page = result["pages"][str(p)]


class _PushStream:
    """A worker's push connection, as this client sees it (on the client's loop)."""

    def __init__(self) -> None:
        self.ready = threading.Event()  # set while subscribed (tests await it from other threads)
        self.heard = 0.0  # loop time of the last line from the worker
        self.deliveries = False  # the worker pushes delivery records' answers too (`dlv` frames)
        self.retry_at = 0.0  # loop time before which no new connection is tried
        self.writer: asyncio.StreamWriter | None = None
        self.task: asyncio.Task | None = None

    @property
    def live(self) -> bool:
        """Subscribed: the worker pushes our verdicts here."""
        return self.ready.is_set()

    @live.setter
    def live(self, value: bool) -> None:
        if value:
            self.ready.set()
        else:
            self.ready.clear()


class RemoteVerdicts:
    """`producers.proposals.Verdicts` answered by a worker's judge.

    Pushed, mostly: every proposal carries this client's reply token in a
    header (`reply_header`), and the client holds one `push` connection to
    each owner it writes to; the owner's judge writes each verdict there
    as soon as it is stored (processors/verdict_push.py). No request per
    proposal, and no hop through either event loop of the worker.

    Asked, otherwise: a verdict goes to the `verdicts` request path when the
    owner has no live push connection (connecting, an older worker, a
    connection lost), or when it was not pushed within `PUSH_GRACE_S` of its
    ack (ownership moved to a worker this client was not subscribed to yet).
    Acks arrive in bursts on the producer's pump thread (one `poll` reports
    every record of a produce response); each burst becomes one `verdicts`
    request per partition. The worker answers once the lowest offset asked
    is judged, with every verdict reached by then; the others are asked
    again, so no proposal waits for a later one (which may wait for another
    owner's answer).

    A pushed verdict may arrive before its ack reaches this client's loop
    (they travel different paths): it is kept (`_early`) until the ack comes.
    """

    def __init__(self, client: QueryClient) -> None:
        self._client = client
        client.closers.append(self.close)
        # Only this client knows the secret; its proposals carry the secret's hash
        # (readers of `events` see that, and cannot subscribe with it).
        self._secret = uuid.uuid4().hex
        self.reply_header: list[tuple[str, str | bytes | None]] = [(REPLY_HEADER, reply_token(self._secret))]
        self._lock = threading.Lock()  # guards _pending (forget runs on the caller's thread)
        self._pending: set[tuple[int, int, Callable[[dict], None]]] = set()  # asked, not answered, not forgotten
        # On the client's loop only:
        self._queued: dict[int, list[tuple[int, Callable[[dict], None]]]] = {}
        self._tasks: set[asyncio.Task] = set()
        self._streams: dict[str, _PushStream] = {}  # worker address -> its push connection
        self._waiting: dict[tuple[int, int], tuple[Callable[[dict], None], float]] = {}  # for a push, since
        self._early: dict[tuple[int, int], tuple[dict, float]] = {}  # pushed before its ack came
        self._acked: dict[int, int] = {}  # partition -> highest offset acked (acks come in offset order)
        # Queued for or in a `verdicts` request -> its callback (a push answers it at once).
        self._asking: dict[tuple[int, int], Callable[[dict], None]] = {}
        # The same for delivery records (answers to `dlv_verdict`, pushed by the owner's run index):
        self._dlv_waiting: dict[tuple[int, int], asyncio.Future] = {}
        self._dlv_early: dict[tuple[int, int], tuple[dict, float]] = {}
        self._sweeping = False
        self.pushed = 0  # verdicts learned by push (tests, benchmarks)
        self.dlv_pushed = 0  # delivery records' answers pushed to this client
        self.dlv_used = 0  # ... and answered a delivery write with
        self.asked = 0  # verdicts learned by asking

    def on_verdict(self, partition: int, offset: int, callback: Callable[[dict], None]) -> None:
        if self._client.closed:  # its loop no longer runs: nobody would ask
            callback(_unknown(partition, offset, "this client is closed"))
            return
        with self._lock:
            self._pending.add((partition, offset, callback))
        # The acks of one burst reach the loop in one wake-up (producers/pump.py).
        inbox(self._client._loop).post(self._queue, partition, offset, callback)

    def forget(self, partition: int, offset: int, callback: Callable[[dict], None]) -> None:
        """The caller gave up (timeout): its callback is not called."""
        with self._lock:
            self._pending.discard((partition, offset, callback))

    def close(self) -> None:
        """Drop the push connections and answer every caller still waiting (on the
        client's loop, before it stops).

        Why answer here: a verdict being asked for (not pushed within the grace)
        waits on a request the closing client cancels; its caller heard
        OUTCOME_UNKNOWN only at its own deadline, up to a request timeout after
        `close` (a review)."""
        for stream in self._streams.values():
            if stream.writer is not None:
                stream.writer.close()
            if stream.task is not None:
                stream.task.cancel()
        left = {**self._asking, **{pos: cb for pos, (cb, _) in self._waiting.items()}}
        for p, items in self._queued.items():
            left.update({(p, o): cb for o, cb in items})
        self._asking, self._waiting, self._queued = {}, {}, {}
        for (p, o), callback in left.items():
            self._answer(p, o, callback, _unknown(p, o, "this client is closed"))

    # -- on the client's loop --------------------------------------------------------------
    def _queue(self, partition: int, offset: int, callback: Callable[[dict], None]) -> None:
        """An acknowledged proposal: wait for its push, or ask."""
        if offset > self._acked.get(partition, -1):
            self._acked[partition] = offset
        early = self._early.pop((partition, offset), None)
        if early is not None:
            self._answer(partition, offset, callback, early[0])
        elif self._pushing(partition):
            self._waiting[(partition, offset)] = (callback, self._client._loop.time())
            self._arm_sweep()
        else:
            self._ask_later(partition, offset, callback)

    def _pushing(self, partition: int) -> bool:
        """Does the owner of `partition` push our verdicts? Connects to it if not yet."""
        return self._stream(partition) is not None

    def _stream(self, partition: int) -> _PushStream | None:
        """The live push connection to the owner of `partition`; None (and a connection
        started, if none is) when there is none."""
        client = self._client
        if client.closed:
            return None
        address = client.owner_of(partition)
        if address is None:
            return None
        stream = self._streams.get(address)
        if stream is None:
            self._forget_gone()
            stream = self._streams[address] = _PushStream()
        if stream.live:
            return stream
        if stream.task is None and client._loop.time() >= stream.retry_at:
            stream.task = client._loop.create_task(self._subscribe(address, stream))
        return None

    def _forget_gone(self) -> None:
        """Drop the ended push connections to workers no longer announced (as
        `QueryClient._forget_gone`, when a push connection to a new address starts)."""
        live = {m.address for m in self._client.members.live()}
        for address in [a for a, st in self._streams.items()
                        if not st.live and st.task is None and a not in live]:
            del self._streams[address]

    async def _subscribe(self, address: str, stream: _PushStream) -> None:
        """Hold a push connection to `address` until it ends; then ask for what waited on it."""
        loop = self._client._loop
        pause = SHUN_S
        watchdog: asyncio.TimerHandle | None = None

        def watch() -> None:
            # A crashed host or a partition ends nothing: silence for a few of the
            # worker's idle beats means the connection is dead.
            nonlocal watchdog
            if stream.writer is None:
                return
            if loop.time() - stream.heard > 3 * BEAT_S:
                log.info("push connection to worker %s silent for %.1fs: closing it", address,
                         loop.time() - stream.heard)
                stream.writer.close()
                return
            watchdog = loop.call_later(BEAT_S, watch)

        try:
            host, port = _endpoint(address)
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, limit=LINE_LIMIT),
                                                    CONNECT_TIMEOUT)
            stream.writer = writer
            writer.write(wire.dumps({"id": 0, "op": "push", "args": {"secret": self._secret}}) + b"\n")
            await writer.drain()
            answer = wire.loads(await asyncio.wait_for(reader.readline(), CONNECT_TIMEOUT) or b"null")
            if not (isinstance(answer, dict) and answer.get("ok")):
                if isinstance(answer, dict) and answer.get("code") == INVALID_ARGUMENT:
                    pause = REFUSED_PAUSE_S  # a worker of an earlier version: ask it
                return  # (draining, or gone: try again soon)
            stream.deliveries = bool((answer.get("result") or {}).get("dlv"))
            stream.live = True
            stream.heard = loop.time()
            watchdog = loop.call_later(BEAT_S, watch)
            while line := await reader.readline():
                stream.heard = loop.time()
                frame = wire.loads(line)
                if "dlv" in frame:
                    self._dlv_pushed(frame["dlv"])
                else:
                    self._pushed(frame["push"])
        except (OSError, ValueError, TypeError, KeyError, TimeoutError, asyncio.IncompleteReadError) as exc:
            log.info("push connection to worker %s ended: %r", address, exc)
        finally:
            if watchdog is not None:
                watchdog.cancel()
            stream.live = False
            stream.task = None
            stream.retry_at = loop.time() + pause
            if stream.writer is not None:
                stream.writer.close()
                stream.writer = None
            # What waited for a push that may now never come is asked for
            # (or, the client closing, answered at once: nobody would ask).
            dlv, self._dlv_waiting = self._dlv_waiting, {}
            for fut in dlv.values():
                if not fut.done():
                    fut.set_result(None)
            waited, self._waiting = self._waiting, {}
            for (p, o), (callback, _) in waited.items():
                if self._client.closed:
                    self._answer(p, o, callback, _unknown(p, o, "this client is closed"))
                else:
                    self._ask_later(p, o, callback)

    def _pushed(self, items: list[list]) -> None:
        if not items:
            return  # the worker's idle beat
        floor: dict[int, int] = {}
        for p, o, _ in items:
            floor[p] = max(floor.get(p, 0), o + 1)
        # Our own writes are judged: later reads must not see a state before them.
        self._client.raise_floor(floor)
        now = self._client._loop.time()
        for p, o, verdict in items:
            self.pushed += 1
            waiting = self._waiting.pop((p, o), None)
            asked = self._asking.get((p, o)) if waiting is None else None
            if waiting is not None:
                self._answer(p, o, waiting[0], verdict)
            elif asked is not None:
                # Being asked for (no live push connection to the announced owner when
                # its ack came, or not pushed within the grace): the push is its answer,
                # now. The request's answer, when it comes, finds the caller answered
                # (`_answer` tells each caller once). Kept aside for the request
                # instead, an accepted write's verdict waited behind a request that
                # could not be answered: a worker draining in a rolling restart judges
                # and pushes on while no one announces its partitions, and the
                # request waits for the new owner (catching up, seconds) -- the caller
                # got OUTCOME_UNKNOWN at its deadline with its verdict in hand.
                self._answer(p, o, asked, verdict)
            elif o > self._acked.get(p, -1):
                # Its ack is on its way. Anything else at or below the last ack of its
                # partition (acks of a partition come in offset order) was answered
                # already, e.g. verdicts a new owner pushes again while catching up:
                # not kept.
                if len(self._early) >= MAX_EARLY:
                    self._early.clear()  # a flood (MAX_EARLY): the acks still to come ask
                self._early[(p, o)] = (verdict, now)
                self._arm_sweep()

    async def delivery_answer(self, d: int, x: int, owner: int, limit: float | None = None) -> dict | None:
        """On the client's loop: what the owner's run index pushed about the delivery
        record at (d, x) -- `dlv_verdict`'s answer -- or None: ask it (no live
        push connection to `owner`'s worker, or nothing pushed within the grace,
        or within `limit` s when that is shorter: what the caller has left)."""
        early = self._dlv_early.pop((d, x), None)
        if early is not None:
            self.dlv_used += 1
            return early[0]
        stream = self._stream(owner)
        if stream is None or not stream.deliveries:
            return None  # (a worker that pushes proposals' verdicts only: ask it)
        fut: asyncio.Future = self._client._loop.create_future()
        self._dlv_waiting[(d, x)] = fut
        try:
            answer = await within(fut, PUSH_GRACE_S if limit is None else min(PUSH_GRACE_S, limit))
        except TimeoutError:
            return None
        finally:
            if self._dlv_waiting.get((d, x)) is fut:
                del self._dlv_waiting[(d, x)]
        if answer is not None:
            self.dlv_used += 1
        return answer

    def _dlv_pushed(self, items: list[list]) -> None:
        now = self._client._loop.time()
        for d, x, verdict, fence, state in items:
            self.dlv_pushed += 1
            answer = {"verdict": verdict, "fence": fence, "state": state}
            fut = self._dlv_waiting.pop((d, x), None)
            if fut is not None and not fut.done():
                fut.set_result(answer)
                continue
            # Its writer's ack is on its way (delivery acks reach this loop through
            # each writer's own loop, in no order across writers: nothing tells an
            # early push from a late one, so unclaimed ones stay until the sweep).
            if len(self._dlv_early) >= MAX_EARLY:
                self._dlv_early.clear()  # a flood (a new owner replaying): asking is always right
            self._dlv_early[(d, x)] = (answer, now)
            self._arm_sweep()

    def _arm_sweep(self) -> None:
        if not self._sweeping:
            self._sweeping = True
            self._client._loop.call_later(PUSH_GRACE_S / 2, self._sweep)

    def _sweep(self) -> None:
        """Ask for verdicts not pushed within the grace; forget unclaimed early ones."""
        self._sweeping = False
        now = self._client._loop.time()
        late = [(pos, cb) for pos, (cb, since) in self._waiting.items() if now - since >= PUSH_GRACE_S]
        for (p, o), callback in late:
            del self._waiting[(p, o)]
            self._ask_later(p, o, callback)
        for early in (self._early, self._dlv_early):
            for pos in [pos for pos, (_, at) in early.items() if now - at >= EARLY_KEEP_S]:
                del early[pos]  # no ack came (written by a caller that gave up, or forged)
        if self._waiting or self._early or self._dlv_early:
            self._arm_sweep()

    def _answer(self, partition: int, offset: int, callback: Callable[[dict], None], verdict: dict) -> None:
        with self._lock:
            token = (partition, offset, callback)
            if token not in self._pending:
                return  # forgotten: its caller gave up
            self._pending.discard(token)
        try:
            callback(verdict)
        except Exception:  # pragma: no cover - one caller's bug must not keep the others waiting
            log.exception("verdict callback failed")

    def _ask_later(self, partition: int, offset: int, callback: Callable[[dict], None]) -> None:
        """Ask at the next flush, with the rest of the burst."""
        if not self._queued:
            self._client._loop.call_soon(self._flush)  # after the whole burst is queued
        self._queued.setdefault(partition, []).append((offset, callback))
        self._asking[(partition, offset)] = callback

    def _flush(self) -> None:
        """One request per partition for what queued since the last flush."""
        queued, self._queued = self._queued, {}
        for partition, items in queued.items():
            for start in range(0, len(items), VERDICTS_PER_REQUEST):
                task = self._client._loop.create_task(self._ask(partition, items[start:start + VERDICTS_PER_REQUEST]))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _ask(self, partition: int, items: list[tuple[int, Callable[[dict], None]]]) -> None:
        client = self._client
        offsets = [o for o, _ in items]
        verdicts: list[dict | None]
        try:
            verdicts = await self._verdicts(partition, offsets)
        except ThreadLogError as exc:
            verdicts = [_unknown(partition, o, f"{exc.code}: {exc.message}") for o in offsets]
        else:
            # Our own writes are judged: later reads must not see a state before them.
            judged = [o for o, v in zip(offsets, verdicts, strict=True) if v is not None]
            if judged:
                client.raise_floor({partition: max(judged) + 1})
        for (o, callback), verdict in zip(items, verdicts, strict=True):
            self._asking.pop((partition, o), None)
            if verdict is None:  # not judged yet when the worker answered: wait for it again
                with self._lock:
                    still = (partition, o, callback) in self._pending
                if still:  # (not under the lock: _queue may answer it at once, which takes it)
                    self._queue(partition, o, callback)
                continue
            self.asked += 1
            self._early.pop((partition, o), None)  # pushed meanwhile: answered here
            self._answer(partition, o, callback, verdict)

    async def _verdicts(self, partition: int, offsets: list[int]) -> list[dict | None]:
        # Workers answer `verdicts` from this version on: upgrade workers before thin clients.
        client = self._client
        (result,) = (await client.call("verdicts", {"p": partition, "os": offsets, "timeout": client.timeout},
                                       [partition])).values()
        return list(result["verdicts"])


def _unknown(partition: int, offset: int, why: str) -> dict:
    """The verdict of a written proposal that could not be learned."""
    return {"ok": False, "code": OUTCOME_UNKNOWN,
            "message": f"written at events[{partition}]@{offset}, but its verdict could not be learned ({why}): "
                       "it may still apply"}


async def off_loop(store: object, read: Callable[..., _T], *args: Any) -> _T:
    """Run `read(*args)`, a synchronous read of `store`. Through a thin client
    (`RemoteStore`) every key read is a request to a worker that blocks its
    thread for a round trip: it runs on a pool thread, so the caller's loop
    serves its other calls meanwhile. Local RocksDB reads run in place."""
    if isinstance(store, RemoteStore):
        client = store._client
        job = client.readers.submit(functools.partial(read, *args))
        done = asyncio.wrap_future(job)
        # A read that has started is bounded by its own requests' timeouts; one still
        # queued for a thread (READ_THREADS reads of slow workers ahead of it) was
        # not: a caller waited some multiple of its request timeout (a review). Not
        # started within the timeout, it is dropped from the queue: never run.
        try:
            finished, _ = await asyncio.wait({done}, timeout=client.timeout)
        except asyncio.CancelledError:
            done.cancel()  # a caller gone: its read, if still queued, never runs
            raise
        if not finished and job.cancel():
            raise unavailable(f"no read thread of this client was free within the request timeout "
                              f"({client.timeout:g}s): {READ_THREADS} slower reads ahead")
        return await done
    return read(*args)


def _scan_args(prefix: bytes, start: str | None, limit: int) -> dict:
    """A `scan` request's arguments: `start` is a page's `next` (base64) or None;
    `big`: values too large for a page come as [key, null] (read by `slice`)."""
    return {"prefix": _b64(prefix), "start": start, "limit": limit, "big": True}


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")
