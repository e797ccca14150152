"""Prometheus metrics, health and readiness of one process (`threadlog serve`, `threadlog worker --http`).

Every instrument lives in a per-client `CollectorRegistry` (never the global
one), so several clients or apps in one process keep apart. Instrumented code
holds a `metrics` attribute that is None until `attach(tl_or_runtime)` sets it:
the hot path pays one attribute test when nothing is attached.

Hooks (each a line or two where the thing happens):
- `Judge._judge` (processors/judge.py): `decided(verdict)`, accepted/refused by code;
- `ProposalBus.propose` (producers/proposals.py): proposal -> verdict latency by type;
- `DeliveryLog.append` (threadlog/delivery/): appends and chunks; `DeliveryLog.read`: live readers;
- `EventStreamResponse` (threadlog/http/sse.py): live SSE connections.
Everything else is read from the runtime when scraped (partitions owned, fold
lag against the read barrier's end offsets, records judged, snapshots
written, restores).

Readiness (`Readiness`): embedded -- the judge caught up with the end offsets
read at startup; worker -- a member of the group, and every owned partition
caught up with the end offsets read when it was assigned, once the group has
given it its share (`Readiness._unsettled`; owning none is then ready: with
more workers than partitions some own none); thin -- a read barrier
through the workers passes. A worker is not ready while an owned partition
stalls -- it has records to judge and its judged position has not moved for
`stall_after` seconds (`Readiness._stalled` says why); embedded, a stall is
reported in the answer but does not make the process unready (see `check`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import re
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger("threadlog.metrics")

# Proposal -> verdict: a local judge answers in a few ms, a worker over TCP in
# tens, a loaded partition in seconds.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    """The instruments of one client (one runtime), in their own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.proposal_seconds = Histogram(
            "threadlog_proposal_verdict_seconds",
            "Seconds from producing a proposal to learning its verdict, by proposal type",
            ["type"], buckets=LATENCY_BUCKETS, registry=r)
        self.decisions = Counter(
            "threadlog_decisions", "Proposals judged by this process's judge, by outcome and code",
            ["outcome", "code"], registry=r)
        self.delivery_appends = Counter(
            "threadlog_delivery_appends", "Delivery log appends acknowledged (one record each)", registry=r)
        self.delivery_chunks = Counter(
            "threadlog_delivery_chunks_appended", "Chunks in the acknowledged delivery log appends", registry=r)
        self.readers = Gauge("threadlog_delivery_readers", "Delivery log readers open now", registry=r)
        self.sse = Gauge("threadlog_http_sse_connections", "Server-sent event streams open now", registry=r)
        self.http_requests = Counter(
            "threadlog_http_requests", "HTTP requests answered, by method and status", ["method", "status"],
            registry=r)
        self._decided: dict[tuple[bool, str], Any] = {}
        self._latency: dict[str, Any] = {}
        self.runtime: Any = None
        self.end_offsets: dict[int, int] = {}  # the last end offsets read for a scrape

    # -- hooks (hot paths) ------------------------------------------------------------
    def decided(self, verdict: dict) -> None:
        ok = bool(verdict.get("ok"))
        code = "OK" if ok else str(verdict.get("code") or "UNKNOWN")
        child = self._decided.get((ok, code))
        if child is None:
            child = self._decided[(ok, code)] = self.decisions.labels("accepted" if ok else "refused", code)
        child.inc()

    def verdict_latency(self, type_name: str, seconds: float) -> None:
        child = self._latency.get(type_name)
        if child is None:
            child = self._latency[type_name] = self.proposal_seconds.labels(type_name)
        child.observe(seconds)

    def appended(self, chunks: int) -> None:
        self.delivery_appends.inc()
        self.delivery_chunks.inc(chunks)

    async def reading(self, items: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """Wrap a delivery reader: counted while it is open."""
        self.readers.inc()
        try:
            async for item in items:
                yield item
        finally:
            self.readers.dec()
            aclose = getattr(items, "aclose", None)
            if aclose is not None:
                await aclose()

    @contextlib.contextmanager
    def sse_stream(self) -> Iterator[None]:
        self.sse.inc()
        try:
            yield
        finally:
            self.sse.dec()

    # -- scraping ---------------------------------------------------------------------
    async def refresh(self) -> None:
        """Read what a scrape needs from the broker (the end offsets, for fold lag)."""
        rt = self.runtime
        if rt is None or getattr(rt, "barrier", None) is None or rt.judge is None:
            return
        try:
            self.end_offsets = dict(await asyncio.wait_for(rt.barrier.end_offsets(), 5))
        except Exception as exc:  # a scrape still answers, with the last end offsets known
            log.warning("metrics: end offsets unavailable: %s", exc)

    async def exposition(self) -> bytes:
        await self.refresh()
        return generate_latest(self.registry)


CONTENT_TYPE = CONTENT_TYPE_LATEST


class _RuntimeCollector(Collector):
    """What is read from the runtime at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def describe(self) -> Iterable[Any]:
        return []

    def collect(self) -> Iterable[Any]:
        rt = self.metrics.runtime
        judge = getattr(rt, "judge", None)
        owned = GaugeMetricFamily("threadlog_partitions_owned", "Events partitions judged by this process")
        lag = GaugeMetricFamily("threadlog_fold_lag_records",
                                "Records of an owned events partition not judged yet (end offset - applied)",
                                labels=["partition"])
        applied = GaugeMetricFamily("threadlog_fold_applied_offset",
                                    "Next offset to judge of an owned events partition", labels=["partition"])
        judged = CounterMetricFamily("threadlog_records_judged", "Records judged by this process's judge")
        restores = CounterMetricFamily("threadlog_restores", "Partitions restored from a snapshot on takeover")
        snaps = CounterMetricFamily("threadlog_snapshots_written", "Partition snapshots written by this worker")
        if judge is not None:
            parts = sorted(judge.owned)
            owned.add_metric([], len(parts))
            ends = self.metrics.end_offsets
            for p in parts:
                a = judge.applied(p)
                applied.add_metric([str(p)], a)
                if p in ends:
                    lag.add_metric([str(p)], max(0, ends[p] - a))
            judged.add_metric([], judge.stats.get("judged", 0))
            restores.add_metric([], judge.stats.get("restored", 0))
        else:
            owned.add_metric([], 0)
            judged.add_metric([], 0)
            restores.add_metric([], 0)
        snapshotter = getattr(rt, "snapshotter", None)
        snaps.add_metric([], snapshotter.written_total if snapshotter is not None else 0)
        return [owned, lag, applied, judged, restores, snaps]


def _runtime_of(target: Any) -> Any:
    return getattr(target, "runtime", target)


def attached(target: Any) -> Metrics | None:
    """The Metrics attached to a ThreadLog or Runtime, if any."""
    return getattr(_runtime_of(target), "metrics", None)


def attach(target: Any, metrics: Metrics | None = None) -> Metrics:
    """Instrument a started ThreadLog (or a worker's Runtime); idempotent: returns
    what is attached already."""
    rt = _runtime_of(target)
    found = getattr(rt, "metrics", None)
    if found is not None:
        return found
    m = metrics if metrics is not None else Metrics()
    m.runtime = rt
    m.registry.register(_RuntimeCollector(m))
    rt.metrics = m
    if getattr(rt, "judge", None) is not None:
        rt.judge.metrics = m
    for part in ("bus", "_delivery"):  # a ThreadLog's proposal bus and delivery service
        obj = getattr(target, part, None)
        if obj is not None:
            obj.metrics = m
    return m


# -- readiness ---------------------------------------------------------------------

# How long an owned partition may have records to judge without its judged
# position moving before the process says it is not ready (Readiness.stall_after).
# Judging moves in milliseconds; a partition held this long waits for something
# that may never come (a judge of newer rules, a store that keeps failing, a
# far-future `seen` position).
STALL_AFTER_S = 30.0


def stall_after_ok(seconds: float) -> bool:
    """The one rule for a stall bound (`Readiness`, `--stall-after`): finite and
    > 0. NaN compares false with everything (never stalled); inf never stalls."""
    return math.isfinite(seconds) and seconds > 0


class Readiness:
    """Is this process ready for traffic? See the module docstring for the rules."""

    def __init__(self, target: Any, timeout: float = 5.0, stall_after: float = STALL_AFTER_S) -> None:
        """Create it before the runtime starts (a worker's first assignment, even an
        empty one, is how it knows it joined the group); `start()` it on the loop.
        `stall_after`: seconds an owned partition may have records to judge without
        moving before it makes the process not ready."""
        if not stall_after_ok(stall_after):
            raise ValueError(f"stall_after must be a finite number of seconds > 0, got {stall_after}")
        self.target = target
        self.rt = _runtime_of(target)
        self.timeout = timeout
        self.stall_after = stall_after
        # Owned partition -> (its judged position, when a check first saw records to
        # judge there at that position): how long it has had work without moving.
        self._held: dict[int, tuple[int, float]] = {}
        self.targets: dict[int, int] = {}  # owned partition -> end offset read when it was assigned
        self.draining = False  # set on SIGTERM: not ready while the process drains and exits
        # In the group: the judge's assignment callback ran (librdkafka calls it with
        # an empty list too, when the group gives this member nothing).
        self.joined = False
        self._last_owned: set[int] = set()  # as the judge's last assignment callback gave it (its thread only)
        self._changes = 0  # ownership changes seen on the loop: a target read across one is dropped
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task] = set()
        # The group's last description (`_unsettled`): when, and what.
        self._described: tuple[float, Any] | None = None  # (when it was asked for, the description)
        self._asked_at = 0.0
        self._describing: asyncio.Future | None = None
        self._describer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="readiness-describe")
        self.rt.ownership_listeners.append(self._owned_changed)

    def start(self) -> None:
        """Read the targets of what is owned now; follow ownership changes (call on the loop)."""
        self._loop = asyncio.get_running_loop()
        if self.rt.judge is not None:
            self._spawn()

    def _owned_changed(self, owned: list[int]) -> None:  # on the judge's thread
        self.joined = True
        changed = self._last_owned.symmetric_difference(owned)
        self._last_owned = set(owned)
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._forget, changed)
            loop.call_soon_threadsafe(self._spawn)

    def _forget(self, partitions: set[int]) -> None:
        """Drop what was learnt about partitions given up or given (on the loop).

        Why: a partition revoked and assigned again between two checks looked
        continuously owned. Its stall clock ran on from before the revoke, so a
        worker restoring it (its judged position not moving yet) answered 503
        "stalled" at once; and its target stayed the end offset read at its
        first assignment, not at this one."""
        self._changes += 1
        for p in partitions:
            self._held.pop(p, None)
            self.targets.pop(p, None)

    def _spawn(self) -> None:
        task = asyncio.get_running_loop().create_task(self._read_targets())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _read_targets(self) -> None:
        judge = self.rt.judge
        owned = set(judge.owned)
        for p in list(self.targets):
            if p not in owned:
                del self.targets[p]
        missing = owned - self.targets.keys()
        if not missing:
            return
        changes = self._changes
        try:
            ends = await asyncio.wait_for(self.rt.barrier.end_offsets(), self.timeout)
        except Exception as exc:
            log.warning("readiness: end offsets unavailable: %s", exc)
            return
        if self._changes != changes:
            # Ownership changed while this round waited: its ends may have been read
            # before a partition was given again, an earlier target than this
            # assignment's (ready too soon). The change spawned a round of its own.
            return
        for p in missing:
            if p in judge.owned and p not in self.targets:
                self.targets[p] = ends[p]

    async def _stalled(self, owned: list[int]) -> dict[str, dict]:
        """Owned partitions with records to judge whose judged position has not
        moved for `stall_after` seconds, as seen by the checks so far.

        Why: a partition caught up once stays "caught up" for the targets above
        while its judge waits for good (a record naming newer judging rules, a
        store write that keeps failing, a far-future `seen` position); only the
        fold lag gauge showed it, and traffic kept coming to a process that
        could not answer for that partition. An idle partition (nothing past its
        judged position) is never stalled, and the clock starts when a check
        first sees work there, so a record that just arrived at a long idle
        partition is not one. Lag is the end offset minus the judged position:
        the judge moves its position past records it never yields (transaction
        markers, aborted records) when it reaches the end of the partition, so
        an idle partition's lag is 0. One end offsets round (shared with the
        reads' barriers) per check; unknown ends flag nothing."""
        judge = self.rt.judge
        applied = {p: judge.applied(p) for p in owned}  # before the ends: a lag seen is >= the real one
        try:
            ends = await asyncio.wait_for(self.rt.barrier.end_offsets(), self.timeout)
        except Exception as exc:
            log.warning("readiness: end offsets unavailable, partitions not checked for stalls: %s", exc)
            return {}
        now = time.monotonic()
        stalled: dict[str, dict] = {}
        for p in list(self._held):
            if p not in applied:
                del self._held[p]
        for p, at in applied.items():
            end = ends.get(p, 0)
            if end <= at:
                self._held.pop(p, None)  # idle: nothing to judge
                continue
            held = self._held.get(p)
            if held is None or held[0] != at:
                self._held[p] = (at, now)  # work seen at a new position: the clock starts
                continue
            if now - held[1] >= self.stall_after:
                stalled[str(p)] = {"applied": at, "end": end, "stalled_s": round(now - held[1], 1)}
        return stalled

    async def _unsettled(self) -> str | None:
        """Why the group has not given this worker its share yet, or None (it has,
        or it is not known: an unanswered question gates nothing, as an unknown
        end flags nothing).

        Why: cooperative-sticky gives a joining member nothing at first (the
        partitions it will get are revoked from their owners first, then
        assigned in a second rebalance a second or two later). Owning nothing
        is ready, so a restarted worker answered 200 before it had anything to
        restore or catch up with, and a rolling restart gated on /readyz
        stopped the next worker meanwhile (a review). Its share: as the assignor
        leaves a group, this member owns at least the most any member owns,
        less one (with more workers than partitions some own none: still their
        share). A member the group's description does not list (joining, or
        expelled) has none. Only the member short of its share waits: the
        others stay ready through the rebalance. One DescribeConsumerGroups
        request a second at most, on a thread of its own (a describe outliving
        its timeout must not take the loop's default threads)."""
        judge = self.rt.judge
        group, admin = getattr(judge, "group", None), getattr(self.rt, "shared_admin", None)
        member = getattr(judge, "member_id", None)
        if group is None or admin is None or not member:
            return None
        now = time.monotonic()
        if self._described is None or now - self._described[0] >= DESCRIBE_EVERY_S:
            if self._describing is None or self._describing.done():
                self._describing = asyncio.get_running_loop().run_in_executor(
                    self._describer, _describe_group, admin, group, self.timeout)
                self._asked_at = now
            try:
                desc = await asyncio.wait_for(asyncio.shield(self._describing), self.timeout + 1)
            except Exception as exc:
                log.warning("readiness: group %s not described, this worker's share not checked: %s", group, exc)
                return None
            self._described = (self._asked_at, desc)
        asked_at, desc = self._described
        counts = {m.member_id: sum(tp.topic == judge.topic for tp in m.assignment.topic_partitions)
                  for m in desc.members}
        if member not in counts:
            return f"group {group} does not list this worker yet ({desc.state.name.lower()})"
        if counts[member] < max(counts.values()) - 1:
            return (f"group {group} has not given this worker its share yet (it owns {counts[member]}, "
                    f"another {max(counts.values())})")
        # Given its share by the group, but the judge's assignment callback has not
        # run yet (it runs in the judge's next poll): owning nothing and restoring
        # nothing, it answered ready with `owned: []` (seen under load). Only from a
        # description of a settled group asked for after the judge's last assignment,
        # so a worker whose partitions were just taken is not held up by an older one.
        taken = len(judge.owned) + len(getattr(judge, "restoring", ()))
        if (desc.state.name == "STABLE" and asked_at > getattr(judge, "rebalanced_at", now)
                and counts[member] > taken):
            return (f"group {group} gave this worker {counts[member]} partitions; it has taken {taken} over "
                    f"so far")
        return None

    def in_group(self) -> bool:
        # Not Consumer.memberid(): it blocks while the judge's thread polls.
        judge = self.rt.judge
        return getattr(judge, "group", None) is None or self.joined or bool(judge.owned)

    async def check(self) -> tuple[bool, dict]:
        rt = self.rt
        if self.draining:
            return False, {"reason": "draining: shutting down"}
        if rt.failed is not None:
            return False, {"reason": rt.failed}
        if rt.judge is None:  # thin: ready when the workers answer a read barrier
            try:
                await asyncio.wait_for(self.target.read_barrier(None), self.timeout)
                return True, {"role": "thin"}
            except TimeoutError:
                # str() of the timeout is empty: the answer said nothing (a review).
                return False, {"role": "thin", "reason": f"no read barrier through the workers passed within "
                                                         f"{self.timeout:g}s (are workers running?)"}
            except Exception as exc:
                return False, {"role": "thin", "reason": str(exc) or type(exc).__name__}
        judge = rt.judge
        owned = sorted(judge.owned)
        if any(p not in self.targets for p in owned):
            await self._read_targets()
        behind = {str(p): {"applied": judge.applied(p), "target": self.targets.get(p)} for p in owned
                  if p not in self.targets or judge.applied(p) < self.targets[p]}
        stalled = await self._stalled(owned) if owned else {}
        # Only a worker's stall makes it not ready. Every embedded replica judges
        # every partition, so a stall there (one record naming newer rules, which
        # any writer can produce) is on every replica at once: all of them
        # answering 503 would take every healthy thread down with the stalled
        # one behind a load balancer (a review). Embedded, it is reported only.
        gating = stalled if rt.worker else {}
        member = self.in_group()
        # Assigned, not owned yet: restored beside the judge (processors/restores.py).
        # A new assignment is not caught up while its snapshot is still being read.
        restoring = list(getattr(judge, "restoring", ()))
        unserved = dict(getattr(judge, "unserved", {}))  # restored, failing to be served: retried
        unsettled = await self._unsettled() if member and rt.worker else None
        ready = member and not unsettled and not behind and not gating and not restoring
        detail: dict[str, Any] = {"role": "worker" if rt.worker else "embedded", "owned": owned}
        if restoring:
            detail["restoring"] = restoring
        if unserved:
            detail["unserved"] = {str(p): why for p, why in sorted(unserved.items())}
        said = (f"partitions {sorted(int(p) for p in stalled)} stalled: records to judge and no "
                f"progress for {self.stall_after:g}s or more")
        if not member:
            detail["reason"] = "not a member of the group yet"
        elif unsettled:
            detail["reason"] = unsettled
        elif gating:
            detail["reason"] = said
            if behind:
                detail["behind"] = behind
        elif behind:
            detail["reason"] = "partitions not caught up"
            detail["behind"] = behind
        elif unserved:
            detail["reason"] = (f"partitions {sorted(unserved)} restored but failing to be served (tried again "
                                f"each second): {unserved[min(unserved)]}")
        elif restoring:
            detail["reason"] = f"partitions {restoring} restoring from their snapshots"
        if stalled:
            detail["stalled"] = stalled
            if not gating:
                detail["warning"] = said
        return ready, detail


DESCRIBE_EVERY_S = 1.0  # a readiness check reuses a group description this recent


def _describe_group(shared: Any, group: str, timeout: float) -> Any:
    """The group's description (blocking: call off the loop)."""
    with shared.use() as admin:
        return admin.describe_consumer_groups([group], request_timeout=timeout)[group].result(timeout=timeout)


# -- HTTP ------------------------------------------------------------------------------


def ops_routes(get_metrics: Callable[[], Metrics | None], get_readiness: Callable[[], Readiness | None]) -> list:
    """`/metrics`, `/healthz`, `/readyz` as Starlette routes (the getters: None while starting)."""
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    def starting() -> Response:
        return JSONResponse({"ready": False, "reason": "starting"}, status_code=503,
                            headers={"Cache-Control": "no-store"})

    async def metrics_endpoint(request: Request) -> Response:
        metrics = get_metrics()
        if metrics is None:
            return starting()
        return Response(await metrics.exposition(), media_type=CONTENT_TYPE,
                        headers={"Cache-Control": "no-store"})

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"}, headers={"Cache-Control": "no-store"})

    async def readyz(request: Request) -> Response:
        readiness = get_readiness()
        if readiness is None:
            return starting()
        ready, detail = await readiness.check()
        return JSONResponse({"ready": ready, **detail}, status_code=200 if ready else 503,
                            headers={"Cache-Control": "no-store"})

    return [Route("/metrics", metrics_endpoint, methods=["GET"]),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/readyz", readyz, methods=["GET"])]


access_log = logging.getLogger("threadlog.access")
MAX_LOGGED_PATH = 200
# Characters a text log line must not carry raw: a line break or carriage return
# in a request's (percent-decoded) path started a forged line of the access log,
# or rewrote one on a terminal, and escape sequences reached the operator's
# terminal -- from any client, a refused request included (a review). Written
# escaped (`\n`, `\x1b`) in the message; the record's `path` field keeps the
# path as it came (JSON logs escape it themselves).
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def printable(text: str) -> str:
    """`text` with control characters and line separators written as escapes."""
    return _UNPRINTABLE.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


# The methods a request counter names; any other is "other". Why: the HTTP parser
# accepts any token as a method, and each label value is a series kept for good,
# so arbitrary methods (tried, a review: 3 000 of them, 1.6 MB of exposition)
# grew every scrape on a port that asks no credentials. Statuses are bounded
# by the app (three digits), so they stay.
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def method_label(method: str) -> str:
    return method if method in HTTP_METHODS else "other"


class AccessLog:
    """ASGI middleware: one log line per HTTP request -- method, path (never the
    query string, never a body), status, duration -- and a request counter."""

    def __init__(self, app: Callable, metrics_of: Callable[[], Metrics | None] = lambda: None) -> None:
        self.app = app
        self.metrics_of = metrics_of

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = [500]

        async def sending(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            ms = (time.perf_counter() - start) * 1000.0
            path = scope.get("path", "")
            if len(path) > MAX_LOGGED_PATH:
                path = path[:MAX_LOGGED_PATH] + "..."
            method = scope.get("method", "")
            metrics = self.metrics_of()
            if metrics is not None:
                metrics.http_requests.labels(method_label(method), str(status[0])).inc()
            if access_log.isEnabledFor(logging.INFO):
                access_log.info("%s %s %d %.1fms", method, printable(path), status[0], ms,
                                extra={"method": method, "path": path, "status": status[0],
                                       "duration_ms": round(ms, 1)})
