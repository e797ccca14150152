"""The `threadlog` command: broker, worker, serve, replay, reclaim, gc, inspect, demo, rebuild, namespaces, schemas."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import shutil
import signal
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from threadlog.kernel import addresses
from threadlog.logs import say

if TYPE_CHECKING:
    from threadlog.broker import NodeStatus


def _bootstrap_default() -> str:
    return os.environ.get("THREADLOG_BOOTSTRAP", "127.0.0.1:9092")


def _kafka_props(args: argparse.Namespace) -> dict[str, Any]:
    """librdkafka properties from --kafka-config, else THREADLOG_KAFKA_CONFIG (a path), else none."""
    from threadlog.kernel import kafka_config
    from threadlog.kernel.errors import invalid_argument

    if getattr(args, "bootstrap", None) == "":
        # As Options refuses it. Why here: `namespaces` builds its admin client
        # without Options, and waited out its whole timeout (a review).
        raise invalid_argument("bootstrap_servers must be a non-empty string (--bootstrap, THREADLOG_BOOTSTRAP)")
    path = getattr(args, "kafka_config", None) or os.environ.get("THREADLOG_KAFKA_CONFIG")
    props = kafka_config.load_properties(path) if path else {}
    args.kafka_props = props  # main() scrubs these values out of any error it prints
    # Checked here too (Options checks again) for the commands that build
    # clients without Options, like `namespaces`.
    kafka_config.check(props)
    kafka_config.validate(getattr(args, "bootstrap", None) or "127.0.0.1:9092", props)
    return props


def _started() -> None:
    """A long-running command is up: broker trouble from now on is worth a log line.

    Until then librdkafka's per-retry errors are held back (main()); a failed
    start is reported once, with its cause, as the command's error line.
    """
    logging.getLogger("threadlog.rdkafka").setLevel(logging.NOTSET)


def cmd_broker(args: argparse.Namespace) -> int:
    from threadlog import broker

    data_dir = Path(args.data_dir) if args.data_dir else None
    if args.action == "start":
        from threadlog.kernel.errors import invalid_argument

        if args.port is not None:
            # Every port the broker will take must exist: node i listens on
            # port+2(i-1) and the next one (its controller), --sasl adds port+2.
            # Unchecked, one past 65535 was bind()'s OverflowError, an INTERNAL.
            nodes = max(args.nodes or broker.node_count(data_dir) or 1, 1)
            _require_port(args.port, "--port", above=2 if args.sasl else 2 * nodes - 1, zero_ok=False)
        try:
            st = broker.start(port=args.port, data_dir=data_dir, nodes=args.nodes, sasl=args.sasl, acls=args.acls,
                              log=lambda m: print(m, file=sys.stderr))
        except broker.BrokerFlagsError as exc:
            # The caller's flags: a user error (exit 2, one coded line), checked by
            # start() before anything starts; `broker start failed` (exit 1, with the
            # broker's last log lines) is kept for a broker that did not come up.
            raise invalid_argument(str(exc)) from None
        except broker.BrokerError as exc:
            print(f"threadlog broker start failed: {exc}", file=sys.stderr)
            return 1
        if isinstance(st, broker.ClusterState):
            for i, node in enumerate(st.nodes, 1):
                print(f"node {i} pid {node.pid} at {node.bootstrap}, log {node.data_dir}/server.log", file=sys.stderr)
            print(f"{len(st.nodes)}-node cluster {st.cluster_id}, data in {st.data_dir}", file=sys.stderr)
        else:
            print(f"broker pid {st.pid}, data in {st.data_dir}, log {st.data_dir}/server.log", file=sys.stderr)
            if st.sasl_bootstrap:
                print(f"sasl bootstrap {st.sasl_bootstrap} (SASL_PLAINTEXT, {', '.join(broker.SCRAM_MECHANISMS)};"
                      " create users with threadlog.broker.create_scram_user)", file=sys.stderr)
        # Last line: the bootstrap list, for `$(threadlog broker start | tail -n 1)`.
        print(st.bootstrap)
        return 0
    if args.action == "stop":
        stopped = broker.stop(data_dir)
        print("stopped" if stopped else "not running")
        return 0
    if broker.node_count(data_dir) > 1:
        return _cluster_status(broker.nodes_status(data_dir), data_dir or broker.default_data_dir())
    single = broker.status(data_dir)
    if single is None or isinstance(single, broker.ClusterState):
        # A process that runs but does not answer (a long GC pause, a wedged or
        # SIGSTOPped JVM) is not "not running": `broker start` refuses to start
        # another over it, so status must say what start will find.
        silent = [n for n in broker.nodes_status(data_dir) if n.alive and not n.answers]
        if silent:
            print(f"alive (pid {silent[0].pid}), not answering (data {silent[0].data_dir})")
            return 1
        print("not running")
        return 1
    sasl = f", SASL_PLAINTEXT (SCRAM) at {single.sasl_bootstrap}" if single.sasl_bootstrap else ""
    print(f"running pid {single.pid} at {single.bootstrap}{sasl} (data {single.data_dir})")
    return 0


def _cluster_status(nodes: list[NodeStatus], data_dir: Path) -> int:
    """One line per node, then a summary; exit 0 only if every node runs and answers."""
    for n in nodes:
        state = "alive, answers" if n.answers else "alive, not answering" if n.alive else "down"
        pid = n.pid if n.pid is not None else "-"
        print(f"node {n.node_id}: pid {pid} port {n.port} (controller {n.controller_port}) {state}")
    up = sum(n.answers for n in nodes)
    if up == 0:
        print(f"not running ({len(nodes)}-node cluster, data {data_dir})")
        return 1
    bootstrap = ",".join(n.bootstrap for n in nodes)
    print(f"{'running' if up == len(nodes) else 'degraded'}: {up}/{len(nodes)} nodes at {bootstrap}"
          f" (data {data_dir})")
    return 0 if up == len(nodes) else 1


def cmd_worker(args: argparse.Namespace) -> int:
    from threadlog.config import Options
    from threadlog.kernel.errors import invalid_argument
    from threadlog.runtime import Runtime

    opts = Options(
        bootstrap_servers=args.bootstrap,
        namespace=args.namespace,
        lease_duration_ms=args.lease_duration_ms,
        renew_after_ms=args.renew_after_ms,
        state_dir=args.state_dir,
        partitions=args.partitions,
        delivery_retention_ms=args.delivery_retention_ms,
        replication_factor=args.replication_factor,
        min_insync_replicas=args.min_insync_replicas,
        request_timeout_ms=args.request_timeout_ms,
        kafka=_kafka_props(args),
    )
    # Bad flags are INVALID_ARGUMENT through main(): `threadlog: CODE: message`,
    # exit 2, JSON under --log-format json, as every other user error (these
    # printed lines of their own, without a code: a review).
    listen = _host_port(args.listen, "--listen")
    http = _host_port(args.http, "--http") if args.http else None
    # isfinite: NaN passed `<= 0` and made every comparison with it false, so a
    # partition that moved was snapshotted every second; inf never snapshotted by time.
    if args.resume_gap < 1:
        raise invalid_argument(f"--resume-gap must be a number of records >= 1, got {args.resume_gap}")
    if args.snapshot_every < 1 or not (math.isfinite(args.snapshot_interval) and args.snapshot_interval > 0):
        raise invalid_argument("--snapshot-every and --snapshot-interval must be positive (the interval a finite "
                               f"number of seconds), got {args.snapshot_every} and {args.snapshot_interval}")
    if not _drain_timeout_ok(args.drain_timeout):
        raise invalid_argument(f"--drain-timeout must be >= 0, got {args.drain_timeout}")
    if not _drain_timeout_ok(args.stop_snapshot_timeout):
        raise invalid_argument(f"--stop-snapshot-timeout must be a number of seconds >= 0, got "
                               f"{args.stop_snapshot_timeout}")
    _require_stall_after(args.stall_after)
    if args.advertise is not None and not addresses.is_host(args.advertise):
        raise invalid_argument(f"--advertise must be a host name or address, got {args.advertise!r}")
    _require_bindable(*listen, "--listen")
    if http is not None:
        _require_bindable(*http, "--http")
    rt = Runtime(opts, worker=True, snapshot_every=args.snapshot_every, snapshot_interval_s=args.snapshot_interval,
                 resume_gap=args.resume_gap)
    return asyncio.run(_worker(rt, listen, http, args.drain_timeout, args.verbose, args.advertise,
                               args.stall_after, args.stop_snapshot_timeout))


def _require_stall_after(seconds: float) -> None:
    from threadlog.kernel.errors import invalid_argument
    from threadlog.metrics import stall_after_ok

    if not stall_after_ok(seconds):  # checked before connecting, by Readiness's rule
        raise invalid_argument(f"--stall-after must be a finite number of seconds > 0, got {seconds}")


def _host_port(text: str, flag: str) -> tuple[str, int]:
    from threadlog.kernel.errors import invalid_argument

    try:
        host, port = addresses.split(text)
    except ValueError:
        raise invalid_argument(f"{flag} must be HOST:PORT, got {text!r}") from None
    return host or "127.0.0.1", port


def _drain_timeout_ok(seconds: float) -> bool:
    return math.isfinite(seconds) and seconds >= 0  # NaN and inf reached asyncio.timeout


def _require_port(port: int, flag: str, above: int = 0, zero_ok: bool = True) -> None:
    """INVALID_ARGUMENT unless `port` .. `port + above` are all TCP ports (0 picks
    a free one where `zero_ok`). Checked before anything binds: bind() raised
    OverflowError past 65535, which reached the user as INTERNAL."""
    from threadlog.kernel.errors import invalid_argument

    low = 0 if zero_ok else 1
    if not low <= port <= 65535 - above:
        takes = f" (it also takes the next {above})" if above else ""
        raise invalid_argument(f"{flag} must be a port in {low}..{65535 - above}{takes}, got {port}")


def _require_bindable(host: str, port: int, flag: str) -> None:
    """UNAVAILABLE, in one line, if `host:port` cannot be listened on. Checked before
    connecting: a busy port made uvicorn exit 3 with a traceback, and a worker
    joined the consumer group (and took partitions from the others) first. Port
    0 too (any free port): its host may still be no address of this machine or
    no name at all -- uvicorn's traceback and exit 3, or a worker failing
    `INTERNAL` after it had created the namespace's topics (a review)."""
    import socket

    from threadlog.kernel.errors import unavailable

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, address = infos[0]
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn and asyncio do
            sock.bind(address)
    except OSError as exc:
        raise unavailable(f"cannot listen on {host}:{port} ({flag}): {exc.strerror or exc}") from None


def _uvicorn_server(app: Any, host: str, port: int, verbose: bool, graceful_s: float = 2.0) -> Any:
    """A uvicorn server that logs through our handlers (text or JSON) and leaves
    the signals to us (uvicorn re-raises SIGTERM after its shutdown: exit -15, not 0)."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

        def install_signal_handlers(self) -> None:  # uvicorn < 0.29
            pass

    config = uvicorn.Config(app, host=host, port=port, log_config=None, access_log=False,
                            log_level="info" if verbose else "warning", lifespan="on",
                            timeout_graceful_shutdown=graceful_s)  # type: ignore[arg-type]  # a float works (asyncio.timeout)
    return Server(config)


async def _start_server(server: Any) -> tuple[asyncio.Future, str, int]:
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        if task.done():
            await task  # startup failed: raise its error
            raise SystemExit("threadlog: the HTTP server stopped during startup")
        await asyncio.sleep(0.02)
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    return task, host, port


class OwnedLine:
    """A worker's `worker owns partitions [...]` line on stdout, printed when what
    it owns changes: a rebalance that gives back the same partitions (revoked,
    then assigned again) printed the same line again, read as a move (a review)."""

    def __init__(self) -> None:
        self._said: list[int] | None = None

    def __call__(self, owned: list[int]) -> None:
        if owned != self._said:
            self._said = list(owned)
            print(f"worker owns partitions {owned}", flush=True)


async def _worker(rt: Any, listen: tuple[str, int], http: tuple[str, int] | None = None, drain_s: float = 10.0,
                  verbose: bool = False, advertise: str | None = None, stall_after: float = 30.0,
                  stop_snapshot_s: float = 10.0) -> int:
    """Judge the namespace, serve its state to thin clients, announce it in `<ns>.members`.

    SIGTERM/SIGINT: not ready any more, snapshot what was judged since the last
    snapshots (up to `stop_snapshot_s`, still serving), leave `<ns>.members`,
    answer the requests in flight (up to `drain_s`), then leave the group and exit 0."""
    from threadlog.members import Announcer
    from threadlog.metrics import Readiness, attach
    from threadlog.processors.query_server import QueryServer

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signalled: list[int] = []

    def on_signal(sig: int) -> None:
        signalled.append(int(sig))
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    # Before the first assignment.
    readiness = Readiness(rt, timeout=min(5.0, rt.opts.request_timeout), stall_after=stall_after)
    announcer: Announcer | None = None

    say_owned = OwnedLine()

    def owned_now(owned: list[int]) -> None:  # on the judge's thread
        # Registered before the judge starts: the first assignment can come
        # before `rt.start` returns, and stdout must say what this worker owns.
        # Until the announcer exists, its start() announces what is owned then.
        if announcer is not None:
            announcer.announce_now()
        say_owned(owned)

    rt.ownership_listeners.append(owned_now)
    failed: list[str] = []

    def state_invalid(reason: str) -> None:  # on the incarnation watch's thread
        # Its namespace was deleted and created again: exit 1, and the restart
        # empties the slot and folds the new topics (a supervisor restarts it).
        failed.append(reason)
        loop.call_soon_threadsafe(stop.set)

    rt.failure_listeners.append(state_invalid)
    # After the handlers: a signal from the moment this line is out is heard.
    # A log line (-v), not stdout: the first stdout line has been a started worker's.
    logging.getLogger("threadlog.worker").info("worker starting: namespace %s at %s", rt.opts.namespace,
                                               rt.opts.bootstrap_servers)
    if not await _start_or_stop(rt, stop):
        if failed:
            say("threadlog.worker", logging.ERROR, f"threadlog worker: {failed[0]}")
            return 1
        # 130 for Ctrl-C, 143 for SIGTERM (128 + the signal, as the shell has it): stopped before it ran.
        return 128 + (signalled[0] if signalled else int(signal.SIGTERM))
    _started()
    assert rt.stores is not None and rt.judge is not None and rt.barrier is not None
    server = QueryServer(rt.stores, rt.judge, rt.barrier, timeout=rt.opts.request_timeout,
                         snapshotter=rt.snapshotter, deliveries=rt.deliveries,
                         delivery_barrier=rt.delivery_barrier)
    web = web_task = None
    try:
        if http is not None:
            from starlette.applications import Starlette

            from threadlog.metrics import AccessLog, ops_routes

            metrics = attach(rt)
            readiness.start()
            app = Starlette(routes=ops_routes(lambda: metrics, lambda: readiness))
            app.add_middleware(AccessLog, metrics_of=lambda: metrics)
            web = _uvicorn_server(app, http[0], http[1], verbose)
            web_task, whost, wport = await _start_server(web)
            print(f"worker metrics and health at http://{addresses.join(whost, wport)}/metrics", flush=True)
        address = await server.start(*listen)
        if advertise is not None:
            # Bound to every interface (0.0.0.0), the socket's own address is no
            # address another host can reach: announce the one the operator gave.
            address = addresses.join(addresses.bare(advertise), addresses.split(address)[1])
        elif addresses.bare(addresses.split(address)[0]) in ("0.0.0.0", "::"):
            # Announced as is, a client on another host reads it as its own
            # loopback and never reaches this worker (NOT_OWNER, then UNAVAILABLE).
            say("threadlog.worker", logging.WARNING,
                f"threadlog worker: warning: listening on every interface without --advertise: announcing "
                f"{address}, which only clients on this host can reach; say --advertise HOST")
        judge = rt.judge
        announcer = Announcer(rt.opts.bootstrap_servers, rt.topics.members, rt.client_id, address,
                              kafka=rt.opts.kafka, partitions=lambda: sorted(judge.owned),
                              lease=(rt.opts.lease_duration_ms, rt.opts.renew_after_ms),
                              gone=None if rt.query is None else rt.query.members.long_dead)
        await asyncio.to_thread(announcer.start, rt.opts.request_timeout)
        print(f"worker judging {rt.topics.events} (state {rt.stores.path}), serving queries at {address} "
              f"as {rt.client_id}", flush=True)
        await stop.wait()
        readiness.draining = True
        if stop_snapshot_s > 0 and rt.snapshotter is not None:
            # Still announced and serving: the next owners restore these instead of
            # judging again what was judged since the last snapshots (Snapshotter.final).
            print(f"worker stopping: snapshotting its partitions (up to {stop_snapshot_s:g}s)", flush=True)
            done = await asyncio.to_thread(rt.snapshotter.final, stop_snapshot_s)
            print(f"worker stopping: snapshotted partitions {done}", flush=True)
        print(f"worker stopping: draining requests in flight (up to {drain_s:g}s)", flush=True)
    finally:
        readiness.draining = True
        if announcer is not None:
            await asyncio.to_thread(announcer.stop)
        left = await server.drain(drain_s)
        if left:
            logging.getLogger("threadlog.worker").warning("%d request(s) unanswered after %ss", left, drain_s)
        await server.close()
        try:
            await asyncio.to_thread(rt.stop)  # closes the judge's consumer: leaves the group
            print("worker stopped: left the group", flush=True)
        finally:
            # Last: /readyz answers 503 "draining" for as long as the process runs.
            # Closed before rt.stop (seconds: leaving the group, closing stores), a
            # balancer saw refused connections there, not the 503 (a review).
            if web is not None and web_task is not None:
                web.should_exit = True
                await asyncio.wait_for(web_task, 10)
    if failed:
        say("threadlog.worker", logging.ERROR, f"threadlog worker: {failed[0]}")
        return 1
    return 0


# How long a signal during a worker's start waits for `rt.start` to return (to
# stop what it started) before the worker exits without it.
START_ABANDON_S = 3.0


async def _start_or_stop(rt: Any, stop: asyncio.Event) -> bool:
    """Start `rt`, or give up when `stop` is set first: False, promptly.

    `rt.start` blocks (it connects, creates topics, joins the group: up to a
    request timeout against a broker that does not answer) and cannot be
    interrupted, so it runs on a daemon thread: asyncio.to_thread's executor
    thread would hold the exit until it returned, and a Ctrl-C during startup
    was ignored for the whole request timeout. Stopped, it gets START_ABANDON_S
    to return so that what it started is stopped (the group left, the slot
    released); else the process exits without it, which releases the slot's
    lock too, and the group expires the member."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def settle(exc: BaseException | None) -> None:  # on the loop
        if done.done():
            return
        if exc is not None:
            done.set_exception(exc)
        else:
            done.set_result(None)

    def run() -> None:
        try:
            rt.start()
        except BaseException as exc:
            loop.call_soon_threadsafe(settle, exc)
        else:
            loop.call_soon_threadsafe(settle, None)

    threading.Thread(target=run, name="threadlog-worker-start", daemon=True).start()
    stopping = asyncio.ensure_future(stop.wait())
    either: set[asyncio.Future[Any]] = {done, stopping}
    try:
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    if done.done() and not stop.is_set():
        try:
            done.result()
        except BaseException:
            await asyncio.to_thread(rt.stop)
            raise
        return True
    print("worker stopping: signalled while starting", flush=True)
    await asyncio.wait({done}, timeout=START_ABANDON_S)
    if done.done():
        if not done.cancelled():
            done.exception()  # retrieved: a failed start is moot once stopped
        await asyncio.to_thread(rt.stop)
    return False


async def _demo(bootstrap: str, namespace: str, state_dir: str | None, kafka: dict[str, Any],
                request_timeout_ms: int = 30_000, opened: list[bool] | None = None) -> None:
    """The demo; `opened` gets True once its first open succeeded (what it then has to clean up)."""
    import threadlog

    transcript = [
        {"role": "user", "content": "Plan a trip to Kyōto 🗾", "meta": {"n": 1, "score": 0.25}},
        {"role": "assistant", "content": "Day 1: Fushimi Inari.", "toolCalls": None},
    ]
    t0 = time.perf_counter()
    async with threadlog.open(bootstrap, namespace=namespace, state_dir=state_dir, kafka=kafka,
                              request_timeout_ms=request_timeout_ms) as writer:
        if opened is not None:
            opened.append(True)
        print(f"[client A] opened namespace {namespace!r} in {time.perf_counter() - t0:.2f}s")
        t1 = time.perf_counter()
        await writer.messages.save_thread("thread-1", transcript)
        print(f"[client A] saved 2 messages to thread-1 in {(time.perf_counter() - t1) * 1e3:.1f} ms "
              "(a proposal on the thread's partition, judged in log order)")
        async with threadlog.open(bootstrap, namespace=namespace, state_dir=state_dir,
                                  processors="embedded", kafka=kafka, request_timeout_ms=request_timeout_ms) as reader:
            print("[client B] opened the same namespace (its own projection store)")
            t2 = time.perf_counter()
            loaded = await reader.messages.load_thread("thread-1")
            print(f"[client B] loaded thread-1 in {(time.perf_counter() - t2) * 1e3:.1f} ms: "
                  f"{len(loaded)} messages, deep-equal: {loaded == transcript}")
            if loaded != transcript:
                raise SystemExit("demo failed: transcript differs")
            print(f"[client B] unknown thread -> {await reader.messages.load_thread('nope')!r}")
            await reader.messages.save_thread("thread-1", transcript[:1])
            print("[client B] overwrote thread-1 with 1 message (judged by every host's fold alike)")
        again = await writer.messages.load_thread("thread-1")
        print(f"[client A] reads {len(again)} message(s) back: read-your-writes across clients")


def cmd_demo(args: argparse.Namespace) -> int:
    from threadlog import broker
    from threadlog.config import NAMESPACE, default_state_root
    from threadlog.kernel.errors import ThreadLogError, invalid_argument

    if args.namespace is not None and not NAMESPACE.match(args.namespace):
        # Before anything: the demo removes <state root>/<namespace> when done,
        # and `..` or `.` there is the state root's parent or the root itself.
        raise invalid_argument(f"namespace must match [A-Za-z0-9._-]+ and not be only dots, got {args.namespace!r}")
    # As every command that connects: --bootstrap, else THREADLOG_BOOTSTRAP; only
    # without either does the demo start (or reuse) the local broker.
    bootstrap = args.bootstrap or os.environ.get("THREADLOG_BOOTSTRAP")
    if not bootstrap:
        if args.port is not None:
            _require_port(args.port, "--port", above=1, zero_ok=False)
        # start() reuses a broker already running in the default data dir, on its
        # own port (printed below) -- unless --port names another, which it
        # refuses as for `broker start --port` (a review).
        try:
            st = broker.start(port=args.port, log=lambda m: print(m, file=sys.stderr))
        except broker.BrokerError as exc:  # as `broker start` says it: exit 1, its own line
            say("threadlog.cli", logging.ERROR, f"threadlog demo: broker start failed: {exc}")
            return 1
        bootstrap = st.bootstrap
        print(f"local Kafka {broker.KAFKA_VERSION} (KRaft) at {bootstrap}")
    namespace = args.namespace or f"demo-{uuid.uuid4().hex[:8]}"
    kafka = _kafka_props(args)
    timeout = _request_timeout_s(args)
    if args.namespace and args.namespace in _namespaces(bootstrap, kafka, timeout):
        # The demo deletes its namespace when done: never one it did not create
        # (THREADLOG_BOOTSTRAP may well name a real cluster). Any of its topic
        # names counts, a lone `x.events` of another application too.
        raise invalid_argument(f"namespace {args.namespace!r} already exists on {bootstrap}; the demo deletes "
                               "its namespace when done: name a new one (or none)")
    # State dirs are keyed by namespace alone: one there already may be another
    # cluster's namespace of this name, never the demo's to remove unasked.
    state_was_there = args.state_dir is None and (default_state_root() / namespace).exists()
    opened: list[bool] = []
    interrupted = False
    try:
        asyncio.run(_demo(bootstrap, namespace, args.state_dir, kafka, args.request_timeout_ms, opened))
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        # A demo leaves nothing behind unless asked to: its topics, and its
        # local state when that was in the default place (a given --state-dir
        # is the caller's). Once its open succeeded, or when it was interrupted
        # during that open (Ctrl-C there left the topics and the state: a review):
        # the name was checked absent above, or is a fresh random one, so what
        # exists under it is the demo's. Not after a failed open: the cluster
        # that failed it would fail the cleanup too, hiding the first error.
        if (opened or interrupted) and not args.keep:
            try:
                _delete_namespace(bootstrap, namespace, kafka, timeout)
                if args.state_dir is None and not state_was_there:
                    _remove_state(default_state_root(), namespace)
                print(f"removed namespace {namespace!r} (--keep keeps it)")
            except ThreadLogError as exc:
                if not interrupted:
                    raise
                print(f"threadlog demo: could not remove namespace {namespace!r}: {exc}", file=sys.stderr)
    print("demo ok")
    return 0


def _remove_state(root: Path, namespace: str) -> bool:
    """Delete `root/namespace`, the demo's local state, if it is a directory
    directly under `root` (not a link, not `..`, not the root itself). False:
    refused or not there. A second guard behind the namespace check: this
    deletes a tree."""
    target = root / namespace
    try:
        if target.is_symlink() or not target.is_dir() or target.resolve().parent != root.resolve():
            return False
    except OSError:
        return False
    shutil.rmtree(target, ignore_errors=True)
    return True


def _admin(bootstrap: str, kafka: dict[str, Any], client_id: str) -> Any:
    from confluent_kafka.admin import AdminClient

    from threadlog.kernel import kafka_config

    trap = kafka_config.ErrorTrap(kafka.get("error_cb"))
    return AdminClient(kafka_config.base(bootstrap, client_id, kafka, trap)), trap


# What makes a prefix a threadlog namespace: all three of these topics (members
# and snapshots come and go with workers). `namespaces list` and `delete` share
# the rule, so delete never takes an application's `orders.events` for one.
NAMESPACE_KINDS = ("events", "deliveries", "blobs")
TOPIC_KINDS = ("events", "deliveries", "blobs", "members", "snapshots")  # Topics.all()


def _is_namespace(kinds: set[str]) -> bool:
    return set(NAMESPACE_KINDS) <= kinds


def _namespaces(bootstrap: str, kafka: dict[str, Any], timeout: float) -> dict[str, set[str]]:
    """Prefix -> which of a namespace's topic names (events, deliveries, blobs, members,
    snapshots) exist under it on the cluster; `_is_namespace` says if it is one."""
    from confluent_kafka import KafkaException

    from threadlog.kernel import kafka_config
    from threadlog.kernel.errors import unavailable

    admin, trap = _admin(bootstrap, kafka, "threadlog.cli.admin")
    try:
        kafka_config.reach(admin, trap, timeout, kafka)  # wrong credentials: fails at once, naming them
        md = admin.list_topics(timeout=timeout)
    except KafkaException as exc:
        raise trap.explain(unavailable(f"cluster metadata unavailable: {kafka_config.error_text(exc)}"),
                           admin, kafka) from None
    finally:
        kafka_config.dispose(admin)
    found: dict[str, set[str]] = {}
    for name in md.topics:
        ns, _, kind = name.rpartition(".")
        if ns and kind in TOPIC_KINDS:
            found.setdefault(ns, set()).add(kind)
    return found


def _delete_namespace(bootstrap: str, namespace: str, kafka: dict[str, Any], timeout: float,
                      kinds: set[str] | None = None) -> list[str]:
    """Delete the namespace's topics (only those of `kinds`, if given); returns the ones deleted."""
    from threadlog.kernel import kafka_config
    from threadlog.kernel.topics import Topics

    names = [t for t in Topics(namespace).all() if kinds is None or t.rpartition(".")[2] in kinds]
    admin, trap = _admin(bootstrap, kafka, "threadlog.cli.admin")
    try:
        return _delete_topics(admin, trap, names, kafka, timeout)
    finally:
        kafka_config.dispose(admin)


def _delete_topics(admin: Any, trap: Any, names: list[str], kafka: dict[str, Any], timeout: float) -> list[str]:
    from confluent_kafka import KafkaError, KafkaException

    from threadlog.kernel.errors import unavailable

    futures = admin.delete_topics(names, operation_timeout=timeout, request_timeout=timeout)
    deleted = []
    for name, fut in futures.items():
        try:
            fut.result(timeout=timeout + 1)
            deleted.append(name)
        except KafkaException as exc:
            err = exc.args[0] if exc.args else None
            if isinstance(err, KafkaError) and err.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
                continue  # already gone (a partial namespace): what delete wants
            raise trap.explain(unavailable(f"cannot delete topic {name}: {err.str() if err else exc}"),
                               admin, kafka) from None
        except Exception as exc:
            raise trap.explain(unavailable(f"cannot delete topic {name}: {exc or 'no answer'}"),
                               admin, kafka) from None
    return sorted(deleted)


def _request_timeout_s(args: argparse.Namespace) -> float:
    """--request-timeout-ms in seconds, for commands that use it without opening a
    client (whose Options refuse a bad one): the same rule and message."""
    from threadlog.kernel.errors import invalid_argument

    if args.request_timeout_ms <= 0:
        raise invalid_argument(f"request_timeout_ms must be a positive int, got {args.request_timeout_ms}")
    return args.request_timeout_ms / 1000.0


def cmd_namespaces(args: argparse.Namespace) -> int:
    from threadlog.config import NAMESPACE
    from threadlog.kernel.errors import invalid_argument, namespace_not_found

    if args.action == "list" and (args.namespace is not None or args.yes or args.partial):
        # Refused, not ignored: `namespaces list ns1` printed every namespace, read
        # as "ns1 exists" whether it did or not (a review).
        given = f"a namespace ({args.namespace!r})" if args.namespace is not None else \
            " and ".join(f for f, on in (("--yes", args.yes), ("--partial", args.partial)) if on)
        raise invalid_argument(f"namespaces list takes no namespace, --yes or --partial; got {given}")
    kafka = _kafka_props(args)
    timeout = _request_timeout_s(args)
    found = _namespaces(args.bootstrap, kafka, timeout)
    if args.action == "list":
        # Only full topic sets: any topic named `x.events` would otherwise list `x`.
        for ns in sorted(n for n, kinds in found.items() if _is_namespace(kinds)):
            print(ns)
        return 0
    ns = args.namespace
    if not ns or not NAMESPACE.match(ns):
        raise invalid_argument(f"namespaces delete needs a namespace matching [A-Za-z0-9._-]+ (not only dots), "
                               f"got {ns!r}")
    kinds = found.get(ns, set())
    if not kinds:
        raise namespace_not_found(f"namespace {ns!r} does not exist")
    if not _is_namespace(kinds) and not args.partial:
        # The rule `list` uses: a lone `orders.events` is as likely an
        # application's topic as what is left of a namespace, and a delete
        # cannot be undone. --partial says the operator checked.
        have = ", ".join(f"{ns}.{k}" for k in TOPIC_KINDS if k in kinds)
        raise namespace_not_found(
            f"{ns!r} is not a threadlog namespace: only {have} exist(s), a namespace has all of "
            f"{', '.join(f'{ns}.{k}' for k in NAMESPACE_KINDS)}; if those are what is left of one, "
            "--partial deletes them")
    if not args.yes:
        raise invalid_argument(
            f"deleting namespace {ns!r} destroys its events, deliveries, blobs and snapshots for good; add --yes")
    # Partial: only the topics seen above, never one created since under a threadlog name.
    deleted = _delete_namespace(args.bootstrap, ns, kafka, timeout, None if _is_namespace(kinds) else kinds)
    print(f"deleted namespace {ns!r} ({', '.join(t.rpartition('.')[2] for t in deleted) or 'nothing left'})")
    return 0


def cmd_rebuild(args: argparse.Namespace) -> int:
    from threadlog.config import Options
    from threadlog.processors.rebuild import rebuild

    opts = Options(bootstrap_servers=args.bootstrap, namespace=args.namespace, state_dir=args.state_dir,
                   request_timeout_ms=args.request_timeout_ms, kafka=_kafka_props(args))
    path = Path(args.store) if args.store else opts.namespace_state / "slot-0"
    stats = rebuild(args.bootstrap, args.namespace, path, kafka=opts.kafka, request_timeout=opts.request_timeout,
                    timeout=args.stall_timeout)
    print(f"rebuilt {stats['store']}: {stats['offsets']} offsets in {stats['seconds']:.2f}s, "
          f"{stats['skipped']} undecodable events skipped")
    return 0


def cmd_schemas(args: argparse.Namespace) -> int:
    from threadlog.schemas import check_compatibility, freeze

    if args.action == "freeze":
        for name in freeze():
            print(f"froze {name}")
        return 0
    problems = check_compatibility()
    for p in problems:
        print(p)
    print("schemas compatible" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


async def _serve(args: argparse.Namespace) -> None:
    import threadlog

    guard = _http_guard(args)  # a bad flag or token file fails before connecting
    _require_stall_after(args.stall_after)
    if not _drain_timeout_ok(args.drain_timeout):
        from threadlog.kernel.errors import invalid_argument

        raise invalid_argument(f"--drain-timeout must be a number of seconds >= 0, got {args.drain_timeout}")
    _require_port(args.port, "--port")
    if not args.path.startswith("/"):
        from threadlog.kernel.errors import invalid_argument

        # Starlette asserts it when routing (an INTERNAL after connecting): said here, up front.
        raise invalid_argument(f"--path must start with '/', got {args.path!r}")
    from threadlog.http.app import shadowing

    taken = shadowing(args.path)
    if taken is not None:
        from threadlog.kernel.errors import invalid_argument

        raise invalid_argument(f"--path: {taken}")
    _require_bindable(args.host, args.port, "--host/--port")
    # Opened here rather than in the app's lifespan: a failed open is then the
    # command's one error line (uvicorn would log a traceback), and serving a
    # namespace never creates it.
    async with threadlog.open(args.bootstrap, namespace=args.namespace, processors=args.processors,
                              state_dir=args.state_dir, first_chunk_wait_ms=args.first_chunk_wait_ms,
                              request_timeout_ms=args.request_timeout_ms, kafka=_kafka_props(args),
                              create_topics=False) as tl:
        _started()
        await _serve_app(args, tl, guard)


def _http_guard(args: argparse.Namespace) -> tuple[Any, Any]:
    """(authorize hook or None, Limits) of `serve`'s flags; INVALID_ARGUMENT if wrong."""
    from threadlog.http import Limits, bearer_tokens
    from threadlog.kernel.errors import invalid_argument

    try:
        limits = Limits(max_id_bytes=args.max_id_bytes, max_body_bytes=args.max_body_bytes,
                        max_streams=args.max_streams, max_stream_wait_ms=args.max_stream_wait_ms,
                        max_write_stall_ms=args.max_write_stall_ms)
    except ValueError as exc:
        raise invalid_argument(str(exc).replace("max_", "--max-").replace("_", "-")) from None
    if args.token_file is None:
        return None, limits
    try:
        return bearer_tokens(args.token_file), limits
    except (OSError, ValueError) as exc:
        raise invalid_argument(f"--token-file: {exc}") from None


async def _serve_app(args: argparse.Namespace, tl: Any, guard: tuple[Any, Any] | None = None) -> None:
    from threadlog.http import create_app

    # Its own level either way: with -v the root logger is at INFO, and an unset
    # level would inherit it (--no-access-log still wrote access lines).
    logging.getLogger("threadlog.access").setLevel(logging.WARNING if args.no_access_log else logging.INFO)
    authorize, limits = guard or _http_guard(args)
    app = create_app(tl, namespace=args.namespace, path=args.path, authorize=authorize, limits=limits,
                     stall_after=args.stall_after)
    server = _uvicorn_server(app, args.host, args.port, args.verbose, graceful_s=args.drain_timeout)
    loop = asyncio.get_running_loop()

    def stop() -> None:
        # Not ready any more; uvicorn stops listening, answers the requests in
        # flight (up to --drain-timeout), then the client closes: exit 0.
        ready = app.state.ops.get("ready")
        if ready is not None:
            ready.draining = True
        app.state.streams.close_streams()  # SSE streams end now, cleanly; the rest drains
        server.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)
    task, host, port = await _start_server(server)
    print(f"threadlog serving namespace {args.namespace!r} at http://{host}:{port}{args.path}", flush=True)
    await task


def cmd_serve(args: argparse.Namespace) -> int:
    asyncio.run(_serve(args))
    return 0


async def _replay(args: argparse.Namespace) -> int:
    import json

    import threadlog
    from threadlog.kernel.errors import RUN_NOT_FOUND, ThreadLogError, invalid_argument

    if args.records and args.follow:
        # `records` is what is stored now; following it is not built: refused, not ignored.
        raise invalid_argument("--records prints the records stored now and cannot --follow; "
                               "--follow waits for chunks")
    # Embedded: replay must work with no worker running (it is a debugging tool).
    async with threadlog.open(args.bootstrap, namespace=args.namespace, processors="embedded",
                              state_dir=args.state_dir, request_timeout_ms=args.request_timeout_ms,
                              first_chunk_wait_ms=args.first_chunk_wait_ms, kafka=_kafka_props(args),
                              create_topics=False) as tl:
        log = tl.delivery(args.run_id)
        printed = False
        if args.records:
            for row in await log.records(args.after):
                print(json.dumps(row, ensure_ascii=False), flush=True)
                printed = True
        else:
            try:
                async for offset, chunk in _chunks(tl, log, args.after, args.follow):
                    print(json.dumps({"offset": offset, "chunk": chunk}, ensure_ascii=False), flush=True)
                    printed = True
            except ThreadLogError as exc:
                if exc.code == RUN_NOT_FOUND:
                    await _require_run(tl, log)  # the unknown run's own words, if it is unknown
                raise
        if not printed:
            await _require_run(tl, log)
    return 0


def _chunks(tl: Any, log: Any, after: str, follow: bool) -> Any:
    """What `replay` prints. Following, as an SSE join does (threadlog/delivery/joins.py):
    from the start it waits on while the run runs (a first chunk later than
    first_chunk_wait_ms ended it RUN_NOT_FOUND, a review), and at "now" an
    unknown run is RUN_NOT_FOUND once that wait is over (it waited for good)."""
    from threadlog.delivery import joins

    if follow and after == "-1":
        return joins.from_start(log, lambda: joins.is_running(tl, log.run_id))
    if follow and after == "now":
        return joins.from_now(log, lambda: joins.is_known(tl, log.run_id))
    return log.read(after, follow=follow)


async def _require_run(tl: Any, log: Any) -> None:
    """Nothing printed: say so when the run is unknown, rather than exit 0 silently.

    A mistyped run id and a run that has produced nothing yet both print nothing;
    only the first is an error. Unknown means no run record and no delivery record
    at all (a delivery log can be written without a run record, so both are asked).
    """
    from threadlog.delivery.joins import is_known
    from threadlog.kernel.errors import RUN_NOT_FOUND, ThreadLogError

    if not await is_known(tl, log.run_id):
        raise ThreadLogError(RUN_NOT_FOUND, f"run {log.run_id!r} is unknown in this namespace: "
                                            "no run record and no delivery record")


def cmd_replay(args: argparse.Namespace) -> int:
    return asyncio.run(_replay(args))


async def _reclaim(args: argparse.Namespace) -> int:
    import threadlog

    if args.ttl_ms < 0:
        from threadlog.kernel.errors import invalid_argument

        raise invalid_argument(f"--ttl-ms must be >= 0, got {args.ttl_ms}")
    # Embedded, like replay: it needs no worker; it never creates the namespace.
    async with threadlog.open(args.bootstrap, namespace=args.namespace, processors="embedded",
                              state_dir=args.state_dir, request_timeout_ms=args.request_timeout_ms,
                              kafka=_kafka_props(args), create_topics=False) as tl:
        from threadlog.kernel.records import quiet_since

        runs = await tl.runs.list_reclaimable(now=time.time() * 1000.0, ttl_ms=args.ttl_ms)
        failed = 0
        for run in runs:
            # Since when its driver is gone: detachedSince, else its last heartbeat.
            quiet = quiet_since(run)
            line = f"{run['runId']}\t{run['threadId']}\t{quiet[1] if quiet else ''}"
            if not args.claim:
                print(line, flush=True)
                continue
            try:
                epoch = await tl.runs.claim(run["runId"])
            except threadlog.ThreadLogError as exc:
                # Finished or claimed away meanwhile: say so, go on with the others.
                failed += 1
                print(f"{line}\tnot claimed: {exc.code}: {exc.message}", flush=True)
                continue
            print(f"{line}\tepoch={epoch}", flush=True)
    return 1 if failed else 0


def cmd_reclaim(args: argparse.Namespace) -> int:
    return asyncio.run(_reclaim(args))


async def _gc(args: argparse.Namespace) -> int:
    import threadlog

    # Embedded, like reclaim: it needs no worker; it never creates the namespace.
    async with threadlog.open(args.bootstrap, namespace=args.namespace, processors="embedded",
                              state_dir=args.state_dir, request_timeout_ms=args.request_timeout_ms,
                              kafka=_kafka_props(args), create_topics=False) as tl:
        report = await tl.blobs.gc(grace_ms=args.grace_ms, dry_run=args.dry_run)
    # A sweep that did not do all it was asked exits 1 (as `reclaim --claim`
    # with a run not claimed), so a cron job or script notices; the summary
    # says why. Two ways: its abandoned-chunk step failed (it still reports
    # what it deleted), or it stopped at a batch whose collects it could not
    # settle -- their fences stand and refuse appends naming those blobs
    # until a later sweep lowers them, so whoever runs `gc` must know to run
    # it again.
    status = 1 if report.abandoned_error is not None or report.unsettled else 0
    if args.json:
        print(json.dumps(report.as_dict(), sort_keys=True), flush=True)
        return status
    verb = "would be examined" if report.dry_run else "examined"
    print(f"blob gc{' (dry run: nothing written)' if report.dry_run else ''}, grace {report.grace_ms} ms")
    print(f"  blobs scanned:              {report.scanned} ({verb})")
    print(f"  unreferenced:               {report.unreferenced}")
    print(f"  older than grace:           {report.candidates}")
    print(f"  deleted:                    {report.deleted}")
    print(f"  bytes reclaimed:            {report.bytes_reclaimed}")
    for reason, n in sorted(report.kept.items()):
        print(f"  kept ({reason}): {n}")
    print(f"  abandoned puts found:       {report.abandoned_found}")
    print(f"  abandoned puts reclaimed:   {report.abandoned_reclaimed} ({report.abandoned_bytes} bytes)")
    if report.abandoned_error is not None:
        print(f"  abandoned puts: NOT reclaimed ({report.abandoned_error})")
    if report.fences_recovered:
        print(f"  fences of earlier sweeps lowered: {report.fences_recovered}")
    if report.unsettled:
        print(f"  collects left unsettled: {report.unsettled} (their fences stand and refuse appends naming "
              "those blobs until the next sweep recovers them: run gc again)")
    return status


def cmd_gc(args: argparse.Namespace) -> int:
    return asyncio.run(_gc(args))


def _at_time(text: str) -> Any:
    from datetime import UTC, datetime

    from threadlog.kernel.errors import invalid_argument

    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00") if text.endswith("Z") else text)
    except ValueError:
        raise invalid_argument(f"--at-time must be an ISO 8601 date and time, got {text!r}") from None
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


def _iso(ms: float | None) -> str:
    """A decision time to the millisecond, rounded down: fed back to --at-time
    it names the millisecond the decision fell in, which that time covers whole
    (processors/time_travel.py). From integer ms: float seconds could land a
    microsecond before the decision and print the millisecond before it."""
    if ms is None:
        return "-"
    from datetime import UTC, datetime, timedelta

    when = datetime(1970, 1, 1, tzinfo=UTC) + timedelta(milliseconds=math.floor(ms))
    return when.isoformat(timespec="milliseconds").replace("+00:00", "Z")


async def _inspect(args: argparse.Namespace) -> int:
    import json

    import threadlog
    from threadlog.kernel.errors import invalid_argument

    thread = args.thread_id or args.thread
    if not thread:
        raise invalid_argument(f"inspect {args.what} needs a thread id (inspect thread T, inspect events --thread T)")
    if args.thread_id and args.thread and args.thread_id != args.thread:
        raise invalid_argument(f"two thread ids given: {args.thread_id!r} and {args.thread!r}")
    if args.what == "events" and (args.at is not None or args.at_time is not None):
        raise invalid_argument("inspect events lists the whole history; --at / --at-time are for inspect thread")
    at = args.at if args.at is not None else _at_time(args.at_time) if args.at_time is not None else None
    # Read-only: never creates the namespace.
    async with threadlog.open(args.bootstrap, namespace=args.namespace, processors=args.processors,
                              state_dir=args.state_dir, request_timeout_ms=args.request_timeout_ms,
                              kafka=_kafka_props(args), create_topics=False) as tl:
        if args.what == "events":
            for row in await tl.history(thread):
                if args.json:
                    print(json.dumps(row, ensure_ascii=False), flush=True)
                    continue
                v = row["verdict"]
                outcome = "ok" if v["ok"] else f"refused {v['code']}: {v['message']}"
                if "duplicateOf" in v:
                    outcome += f" (re-sent; first judged at offset {v['duplicateOf']})"
                print(f"{row['offset']}\t{_iso(row['decidedAt'])}\t{row['type']}\t{row['proposalId']}\t{outcome}",
                      flush=True)
            return 0
        state = await tl.state_at(thread, at)
    if args.json:
        print(json.dumps(state, ensure_ascii=False, indent=2))
        return 0
    where = "before its first record" if state["offset"] is None else \
        f"after offset {state['offset']} (decided {_iso(state['decidedAt'])})"
    print(f"thread {thread!r}: {args.namespace}.events[{state['partition']}] {where}")
    print(f"head: {state['head'] if state['head'] is not None else '-'}")
    for section in ("checkpoints", "runs", "interrupts", "transcript"):
        items = state[section]
        print(f"{section}: {len(items)}")
        for item in items:
            print("  " + json.dumps(item, ensure_ascii=False))
    graph = state["langgraph"]  # the LangGraph saver's records, not tl.checkpoints
    print(f"langgraph checkpoints: {sum(len(ids) for ids in graph['checkpoints'].values())}, "
          f"pending writes: {graph['pendingWrites']}")
    for ns, ids in graph["checkpoints"].items():
        print(f"  {ns or '(root)'}: {', '.join(ids)}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    return asyncio.run(_inspect(args))


def _namespace_state(p: argparse.ArgumentParser) -> None:
    """The namespace a command reads and where its local state goes."""
    p.add_argument("--namespace", default="threadlog", help="the namespace (its topics are <ns>.events ...)")
    p.add_argument("--state-dir", default=None, help=STATE_DIR_HELP)


def _connects(p: argparse.ArgumentParser, bootstrap: str | None = "default") -> None:
    """The options of every command that talks to the cluster."""
    p.add_argument("--bootstrap", default=_bootstrap_default() if bootstrap == "default" else bootstrap,
                   help="Kafka bootstrap servers (env THREADLOG_BOOTSTRAP)")
    p.add_argument("--kafka-config", default=None, metavar="FILE",
                   help="librdkafka properties, client.properties format (env THREADLOG_KAFKA_CONFIG)")
    p.add_argument("--request-timeout-ms", type=int, default=30_000,
                   help="how long to wait for the cluster before failing with UNAVAILABLE")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("threadlog")
    except PackageNotFoundError:  # a source tree that was not installed
        from threadlog import __version__

        return __version__


STATE_DIR_HELP = ("root of the local RocksDB state; stores go under <dir>/<namespace>/slot-N (default: "
                  "$THREADLOG_STATE_DIR or ~/.local/state/threadlog/state)")


class _Help(argparse.HelpFormatter):
    """Every flag's help says its default, unless the help already does or there is none to say."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (not action.option_strings or "default" in text
                or action.default in (None, False, argparse.SUPPRESS)):
            return text
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """Usage errors (an unknown flag, a bad choice, a missing argument) end as every
    other user error does: `threadlog: INVALID_ARGUMENT: ...`, exit 2, one JSON
    object under `--log-format json` (a review: argparse printed its usage and
    `error:` line in text whatever the format, which a JSON log reader cannot
    parse). Without JSON the usage stays above the line: it says what was meant."""

    def error(self, message: str) -> NoReturn:
        from threadlog.kernel.errors import INVALID_ARGUMENT

        line = f"threadlog: {INVALID_ARGUMENT}: {self.prog}: {' '.join(message.split())}"
        if _usage_json:
            from threadlog import logs

            logs.configure(False, "json")
            logging.getLogger("threadlog.cli").error("%s", line)
        else:
            self.print_usage(sys.stderr)
            print(line, file=sys.stderr)
        raise SystemExit(2)


_usage_json = False  # main(): --log-format json is in its argv


def _json_asked(argv: list[str]) -> bool:
    """`--log-format json` anywhere in argv (before parsing could say so: the
    error may be in any flag, this one's included, before or after the command)."""
    for i, arg in enumerate(argv):
        if arg == "--log-format=json" or (arg == "--log-format" and argv[i + 1:i + 2] == ["json"]):
            return True
    return False


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="threadlog", description=__doc__, formatter_class=_Help)
    ap.add_argument("-v", "--verbose", action="store_true", help="log more; print tracebacks of errors")
    ap.add_argument("--log-format", choices=["text", "json"], default="text",
                    help="stderr log lines: text, or one JSON object per line (ts, level, logger, message, "
                         "exception)")
    ap.add_argument("--version", action="version", version=f"threadlog {_version()}")
    sub = ap.add_subparsers(dest="command", required=True)
    sub_parser = sub.add_parser

    def add_parser(name: str, **kwargs: Any) -> argparse.ArgumentParser:
        return sub_parser(name, formatter_class=_Help, **kwargs)

    sub.add_parser = add_parser  # type: ignore[method-assign,assignment]

    b = sub.add_parser("broker", help="local Kafka (KRaft) from Maven Central, no Docker")
    b.add_argument("action", choices=["start", "stop", "status"], help="start, stop or describe the local broker")
    b.add_argument("--port", type=int, default=None,
                   help="client port (default 9092); the controller takes the next one. With --nodes N, "
                        "the base: node i gets port+2(i-1) and the one after it")
    b.add_argument("--data-dir", default=None,
                   help="where the broker keeps its data and log (default: $THREADLOG_BROKER_DIR or "
                        "~/.local/state/threadlog/broker)")
    b.add_argument("--nodes", type=int, default=None,
                   help="start: run an N-node KRaft cluster (default: what the data dir holds, else 1); "
                        "stop and status find the count in the data dir")
    b.add_argument("--sasl", action="store_true",
                   help="start (one node): also a SASL_PLAINTEXT listener on port+2 with SCRAM-SHA-256 and "
                        "SCRAM-SHA-512 (users: threadlog.broker.create_scram_user); PLAINTEXT stays open")
    b.add_argument("--acls", action="store_true",
                   help="start, with --sasl: run Kafka's authorizer; SASL users may do only what ACLs allow "
                        "(PLAINTEXT is a super user: create the ACLs there)")
    b.set_defaults(fn=cmd_broker)

    w = sub.add_parser("worker", help="judge a namespace and serve its state to thin clients")
    _connects(w)
    w.add_argument("--namespace", default="threadlog", help="the namespace to judge and serve")
    w.add_argument("--partitions", type=int, default=4, help="partition count of topics this creates")
    w.add_argument("--delivery-retention-ms", type=int, default=7 * 24 * 3600 * 1000,
                   help="retention.ms of the deliveries topic if this creates it (default 7 days; an existing "
                        "topic keeps its own)")
    w.add_argument("--replication-factor", type=int, default=None,
                   help="replicas of topics this creates (default min(3, brokers alive)); given, existing topics "
                        "must have it")
    w.add_argument("--min-insync-replicas", type=int, default=None,
                   help="min.insync.replicas of topics this creates (default min(2, replicas)); existing topics "
                        "must have it (default: min(2, their own replicas))")
    w.add_argument("--state-dir", default=None, help=STATE_DIR_HELP)
    w.add_argument("--lease-duration-ms", type=int, default=120_000,
                   help="length of the writer leases granted on the partitions this worker owns (announced in "
                        "<ns>.members; thin clients propose it)")
    w.add_argument("--renew-after-ms", type=int, default=45_000,
                   help="the renew_after_ms hint of the writer leases granted on its partitions")
    w.add_argument("--listen", default="127.0.0.1:0",
                   help="HOST:PORT of the query service for thin clients (port 0: a free one, printed; an IPv6 "
                        "host in brackets: [::1]:0)")
    w.add_argument("--advertise", default=None, metavar="HOST",
                   help="the host thin clients reach the query service at, announced with its port in "
                        "<ns>.members (default: the --listen host; say it when listening on 0.0.0.0 or [::]; an "
                        "IPv6 address bare or in brackets)")
    w.add_argument("--http", default=None, metavar="HOST:PORT",
                   help="serve /metrics (Prometheus), /healthz and /readyz over HTTP here (default: off; "
                        "port 0: a free one, printed)")
    w.add_argument("--drain-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="on SIGTERM, how long to wait for requests in flight before leaving")
    w.add_argument("--stall-after", type=float, default=30.0, metavar="SECONDS",
                   help="/readyz is 503 while an owned partition has records to judge and its judged "
                        "position has not moved for this long")
    w.add_argument("--snapshot-every", type=int, default=50_000, metavar="RECORDS",
                   help="snapshot a partition's state after this many records judged")
    w.add_argument("--snapshot-interval", type=float, default=300.0, metavar="SECONDS",
                   help="...or after this long, if anything was judged")
    w.add_argument("--stop-snapshot-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="on SIGTERM, snapshot the partitions judged since their last snapshot first, while "
                        "still serving them, for at most this long, so their next owners restore instead of "
                        "judging again (0: no snapshot on stop)")
    w.add_argument("--resume-gap", type=int, default=500, metavar="RECORDS",
                   help="a partition given back to a local store this far behind its end restores its "
                        "latest snapshot instead, if that is this far ahead of the store")
    w.set_defaults(fn=cmd_worker)

    sv = sub.add_parser("serve", help="HTTP: the TanStack durability route, SSE and REST for delivery logs")
    _connects(sv)
    sv.add_argument("--namespace", default="threadlog", help="the namespace to serve")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on")
    sv.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed)")
    sv.add_argument("--path", default="/api/chat", help="path of the durability route")
    sv.add_argument("--processors", choices=["external", "embedded"], default="embedded",
                    help="'external': a thin client served by a `threadlog worker`; "
                         "'embedded': judge every partition in this process")
    sv.add_argument("--state-dir", default=None, help=STATE_DIR_HELP)
    sv.add_argument("--first-chunk-wait-ms", type=int, default=5000,
                    help="how long a join of a run with no chunk yet waits before RUN_NOT_FOUND")
    sv.add_argument("--drain-timeout", type=float, default=2.0, metavar="SECONDS",
                    help="on SIGTERM, how long requests in flight (and SSE streams) may go on")
    sv.add_argument("--stall-after", type=float, default=30.0, metavar="SECONDS",
                    help="/readyz names a partition that has records to judge and whose judged position "
                         "has not moved for this long (it stays 200: every embedded replica stalls alike)")
    sv.add_argument("--no-access-log", action="store_true",
                    help="no access log lines (method, path, status, duration; logger threadlog.access)")
    sv.add_argument("--token-file", default=None, metavar="FILE",
                    help="require Authorization: Bearer <token>, a token of FILE (one per line, # comments); "
                         "default: no authorization")
    sv.add_argument("--max-streams", type=int, default=1000, metavar="N",
                    help="SSE streams open at once, server-wide; beyond: 503 TOO_MANY_STREAMS")
    sv.add_argument("--max-stream-wait-ms", type=int, default=1000, metavar="MS",
                    help="how long a join beyond --max-streams waits for a stream to end before its 503 (0: none)")
    sv.add_argument("--max-write-stall-ms", type=int, default=30_000, metavar="MS",
                    help="an SSE stream whose client reads nothing this long is ended (its slot freed)")
    sv.add_argument("--max-body-bytes", type=int, default=64 * 1024, metavar="BYTES",
                    help="largest request body; beyond: 413 PAYLOAD_TOO_LARGE")
    sv.add_argument("--max-id-bytes", type=int, default=1024, metavar="BYTES",
                    help="longest thread or run id (UTF-8); beyond: 400 INVALID_ARGUMENT")
    sv.set_defaults(fn=cmd_serve)

    rp = sub.add_parser("replay", help="print a run's delivery chunks as JSON lines with their offsets")
    rp.add_argument("run_id", help="the run")
    rp.add_argument("--after", default="-1",
                    help="chunk offset to start strictly after (default: from the start); with --records, the "
                         "records from the one holding that chunk on (it may hold later chunks)")
    rp.add_argument("--follow", action="store_true", help="keep waiting for chunks until the log is closed")
    rp.add_argument("--first-chunk-wait-ms", type=int, default=5000,
                    help="how long a read from the start waits for a run's first chunk; following, a run that "
                         "is running is then read again, an unknown one is RUN_NOT_FOUND")
    rp.add_argument("--records", action="store_true",
                    help="print every record stored now instead: claims, dropped chunks and why, upserts, the "
                         "close (not with --follow)")
    _connects(rp)
    _namespace_state(rp)
    rp.set_defaults(fn=cmd_replay)

    rc = sub.add_parser("reclaim", help="list runs a dead driver left behind (running, detached or not "
                                         "heartbeating for --ttl-ms), "
                                         "or claim them")
    rc.add_argument("--ttl-ms", type=int, required=True,
                    help="a run is reclaimable once detachedSince (else its driver's last "
                         "heartbeatAt) <= now - TTL (milliseconds)")
    rc.add_argument("--claim", action="store_true",
                    help="claim each run (a new driver epoch, printed as epoch=N); without it nothing is written")
    _connects(rc)
    _namespace_state(rc)
    rc.set_defaults(fn=cmd_reclaim)

    g = sub.add_parser("gc", help="blob garbage collection: delete blobs no checkpoint references (older than "
                                  "--grace-ms) and reclaim the chunks of abandoned puts")
    g.add_argument("--grace-ms", type=int, default=3_600_000,
                   help="only blobs (and abandoned chunks) last written at least this long ago (default: 1 hour)")
    g.add_argument("--dry-run", action="store_true", help="report what would be collected; write nothing")
    g.add_argument("--json", action="store_true", help="print the report as one JSON object")
    _connects(g)
    _namespace_state(g)
    g.set_defaults(fn=cmd_gc)

    ins = sub.add_parser("inspect", help="time travel: a thread's state at an offset or time (inspect thread T), "
                                         "or its proposals with offsets and verdicts (inspect events --thread T)")
    ins.add_argument("what", choices=["thread", "events"],
                     help="thread: the thread's state (head, checkpoints, runs, interrupts, transcript); "
                          "events: its proposals with offsets, decision times and verdicts")
    ins.add_argument("thread_id", nargs="?", help="the thread (or --thread)")
    ins.add_argument("--thread", default=None, help="the thread")
    when = ins.add_mutually_exclusive_group()
    when.add_argument("--at", type=int, default=None, metavar="OFFSET",
                      help="the state right after this offset of the thread's events partition (default: now)")
    when.add_argument("--at-time", default=None, metavar="ISO8601",
                      help="the state after the last proposal decided at or before this time (no zone: UTC)")
    ins.add_argument("--json", action="store_true", help="print JSON (events: one object per line)")
    _connects(ins)
    _namespace_state(ins)
    ins.add_argument("--processors", choices=["embedded", "external"], default="embedded",
                     help="'embedded' (default): fold the namespace here, no worker needed; "
                          "'external': ask a `threadlog worker` for cross-partition facts")
    ins.set_defaults(fn=cmd_inspect)

    d = sub.add_parser("demo", help="round-trip a transcript through two clients (on the local broker, started "
                                    "or reused, unless --bootstrap or THREADLOG_BOOTSTRAP names one)")
    _connects(d, bootstrap=None)
    d.add_argument("--keep", action="store_true", help="keep the demo's namespace (topics, local state)")
    d.add_argument("--port", type=int, default=None,
                   help="port of the broker it starts (without --bootstrap; default 9092): a broker already "
                        "running in the default data dir on another port is then refused, not reused")
    d.add_argument("--namespace", default=None, help="namespace to use (default: a new demo-<random>)")
    d.add_argument("--state-dir", default=None, help=STATE_DIR_HELP)
    d.set_defaults(fn=cmd_demo)

    r = sub.add_parser("rebuild", help="drop a projection store and fold the events again")
    _connects(r)
    _namespace_state(r)
    r.add_argument("--store", default=None, help="store path (default: slot-0 of the namespace)")
    r.add_argument("--stall-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="give up (UNAVAILABLE) after this long without progress; a rebuild that moves is not "
                        "bounded")
    r.set_defaults(fn=cmd_rebuild)

    ns = sub.add_parser("namespaces", help="list the namespaces on the cluster, or delete one")
    ns.add_argument("action", choices=["list", "delete"], help="list the namespaces, or delete one")
    ns.add_argument("namespace", nargs="?", help="the namespace to delete")
    ns.add_argument("--yes", action="store_true", help="confirm a delete (it cannot be undone)")
    ns.add_argument("--partial", action="store_true",
                    help="delete also a prefix without the full topic set <ns>.events, .deliveries, .blobs (what "
                         "is left of a namespace): the threadlog topic names of it that exist")
    _connects(ns)
    ns.set_defaults(fn=cmd_namespaces)

    s = sub.add_parser("schemas", help="check or freeze Avro schema versions")
    s.add_argument("action", choices=["check", "freeze"],
                   help="check: the schemas are compatible with the frozen versions; freeze: record them")
    s.set_defaults(fn=cmd_schemas)
    for command in sub.choices.values():
        # Also after the command (`threadlog worker -v`); SUPPRESS keeps a flag
        # given before it.
        command.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                             help="log more; print tracebacks of errors")
        command.add_argument("--log-format", choices=["text", "json"], default=argparse.SUPPRESS,
                             help="stderr log lines: text or JSON lines (default: text)")
    return ap


def main(argv: list[str] | None = None) -> int:
    global _usage_json
    _usage_json = _json_asked(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    from threadlog import logs

    logs.configure(args.verbose, args.log_format)
    if not args.verbose:
        # librdkafka logs every failed connection attempt; while a command
        # starts, its error line says why instead (see _started()).
        logging.getLogger("threadlog.rdkafka").setLevel(logging.CRITICAL + 1)
    from threadlog.kernel.errors import INTERNAL, ThreadLogError
    from threadlog.kernel.kafka_config import say_dropped, scrub

    try:
        return int(args.fn(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # Whoever read stdout stopped (`threadlog inspect ... | head -1`): not an
        # error to report. Quiet, with the status of a process SIGPIPE ended
        # (128 + 13) as the shell's other tools give; stdout goes to /dev/null so
        # the interpreter's last flush does not raise (and print) again.
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as exc:
        # The coded line below is the last line printed: librdkafka's dropped
        # repeats are said now, not at exit after it, and nothing of theirs
        # comes later.
        logging.getLogger("threadlog.rdkafka").setLevel(logging.CRITICAL + 1)  # first: no new window opens
        say_dropped()
        if args.verbose and args.log_format != "json":
            traceback.print_exc()
        if isinstance(exc, ThreadLogError):
            code, message, status = exc.code, exc.message, 2
        else:
            code, message, status = INTERNAL, f"{type(exc).__name__}: {exc}", 1
        # One line: a message may quote multi-line broker text. Secrets from
        # the kafka config never reach the terminal, whatever quoted them.
        line = " ".join(scrub(message, getattr(args, "kafka_props", None)).split())
        if args.log_format == "json":
            # Still one line: a JSON object, the traceback in its "exception" with -v.
            logging.getLogger("threadlog.cli").error("threadlog: %s: %s", code, line,
                                                     exc_info=exc if args.verbose else None)
        else:
            print(f"threadlog: {code}: {line}", file=sys.stderr)
        return status


if __name__ == "__main__":
    raise SystemExit(main())
