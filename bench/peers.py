"""threadlog's checkpoint appends next to the stores users would pick instead, same shapes, same run.

    .venv/bin/pip install -e '.[test,bench]'
    THREADLOG_BOOTSTRAP=127.0.0.1:19092 .venv/bin/python bench/peers.py [--seconds 8] [--callers 16]
        [--threads 64] [--skip-threadlog] [--skip-postgres] [--skip-sqlite] [--skip-reads] [--external]

Every row is a closed loop: `--callers` concurrent callers over `--threads` threads, caller c
owning the threads t with t % callers == c and writing them in turn, each call awaited before
the next. The checkpoint is the one bench/checkpoints_bench.py appends (8 file entries, 512 B
of conversation, ~1.5-1.9 KB however it is encoded). Rows:

- raw Kafka: `--callers` confluent-kafka writers each awaiting its ack (acks=all, idempotent),
  the checkpoint's JSON as the value: the baseline every rate is a ratio of;
- threadlog: `checkpoints.append(checkpoint=, expected_head_id=, writer=)` under a writer lease,
  each append a compare-and-set on the thread's head (public API only, so the same script
  measures any core); reads: `checkpoints.get_head` then `checkpoints.get`;
- with `--external`, threadlog's rows go through a thin client, a `threadlog worker` process
  judging (one per namespace);
- threadlog's LangGraph saver (`threadlog.integrations.langgraph.AsyncThreadLogSaver`)
  `aput` / `aget_tuple`: the very calls of the AsyncPostgresSaver rows, for a LangGraph user
  choosing between the two;
- LangGraph `AsyncPostgresSaver` (16 pooled connections) `aput` / `aget_tuple`, on a temporary
  PostgreSQL cluster (`initdb` in a temp dir, fsync and synchronous_commit on, the defaults);
- hand-written PostgreSQL compare-and-set, same cluster, 16 pooled connections: one transaction
  `INSERT` the checkpoint; `UPDATE heads SET head = new WHERE thread_id = t AND head = expected`,
  rolled back (and the call failed) unless exactly one head moved;
- LangGraph `AsyncSqliteSaver` `aput` on a file in a temp dir (its defaults: WAL).

LangGraph's savers decide nothing (`aput` upserts by id); threadlog and the hand-written
transaction refuse a stale head. After the rates, a second table gives each row's CPU per
operation by process -- this client, the worker (`--external`), the local broker, PostgreSQL's
server processes -- and the rate that CPU allows on this machine's cores: on a 2-core machine
they all share the cores, so it says what a design costs, not only how fast it went. Each row
first runs a short warm-up that also sizes it to about `--seconds`. The PostgreSQL cluster is
stopped and deleted, and the Kafka topics of the run's namespace are deleted, whatever happens.
"""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from checkpoints_bench import appends, make_checkpoint
from common import (
    PROPOSALS_LINGER_MS,
    CpuMeter,
    Result,
    Roles,
    bench_args,
    bootstrap_or_local,
    broker_pids,
    closed_loop,
    delete_namespace,
    delete_topic,
    raw_produce_closed_loop,
    report,
    temp_topic,
    tree_cpu,
)
from workers import Worker

import threadlog

PG_BIN = "/usr/lib/postgresql/15/bin"
POOL_SIZE = 16
# The 1-min load average as each measured row ended: this 2-core machine may be shared.
LOAD_AFTER: dict[int, float] = {}
# CPU seconds each process of a row used per operation in its measured run, by role.
CPU_PER_OP: dict[int, dict[str, float]] = {}
# The processes whose CPU a row's operations use, by role (common.Roles), asked when its
# measured run starts.
Processes = Callable[[], Roles]


def client_only() -> Roles:
    return {"client": [os.getpid()]}


def with_broker(roles: Roles) -> Roles:
    """`roles` and the local broker's JVM; no broker role when none runs on this machine
    (a remote `--bootstrap`): its CPU is not ours to see, and 0 would flatter the total."""
    pids = broker_pids()
    return {**roles, "broker": pids} if pids else roles


@dataclass(frozen=True)
class Shape:
    callers: int
    threads: int
    files: int
    conv_bytes: int

    def thread(self, c: int, i: int) -> int:
        """The thread caller c writes at its i-th call: its own threads in turn."""
        return c + self.callers * (i % (self.threads // self.callers))

    def checkpoint(self, cid: str, thread: str, parent: str | None, n: int) -> dict:
        return make_checkpoint(cid, thread, parent, n, self.files, self.conv_bytes)


async def sized(run: Callable[[int], Awaitable[Result]], seconds: float, shape: Shape, floor: int = 0,
                processes: Processes = client_only) -> Result:
    """Warm `run` up with growing counts until a run lasts >= 0.5 s (or four tries), then run it
    for about `seconds` at the rate the warm-up reached. `run(n)` makes n calls; n is a
    multiple of the callers and at least `floor`. The measured run's CPU is metered in
    `processes()` (this client, a worker, the broker, PostgreSQL's process tree): on a
    2-core machine every one of them competes for the same cores."""
    step = shape.callers
    n = step * 8
    for _ in range(4):
        warm = await run(n)
        if warm.seconds >= 0.5:
            break
        n = max(n * 2, int(warm.rate * 0.75) // step * step)
    total = max(floor, step, int(warm.rate * seconds) // step * step)
    meter = CpuMeter(processes()).start()
    res = await run(-(-total // step) * step)
    used = meter.stop()
    LOAD_AFTER[id(res)] = os.getloadavg()[0]
    CPU_PER_OP[id(res)] = {role: cpu / res.count for role, cpu in used.items()} if res.count else {}
    return res


# -- a temporary PostgreSQL cluster --------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class PgCluster:
    conninfo: str
    data: str

    def processes(self) -> Roles:
        """This client and the server: the postmaster and every process it starts (backends,
        WAL writer, checkpointer, autovacuum workers that come and go), whose CPU a
        PostgreSQL row's operations use."""
        try:
            with open(f"{self.data}/postmaster.pid") as f:
                master = int(f.readline())
        except (OSError, ValueError):
            return client_only()
        return {**client_only(), "postgres": lambda: tree_cpu(master)}


@contextmanager
def postgres_cluster(bin_dir: str) -> Iterator[PgCluster]:
    """initdb + pg_ctl start in a temp dir on a free localhost port; yields its conninfo and data
    directory; stops the server and deletes the directory on the way out, whatever happened.
    PostgreSQL refuses to run as root, so as root the cluster belongs to `postgres` (or `nobody`)."""
    root = tempfile.mkdtemp(prefix="threadlog-peers-pg-")
    as_user: list[str] = []
    if os.geteuid() == 0:
        for name in ("postgres", "nobody"):
            try:
                user = pwd.getpwnam(name)
            except KeyError:
                continue
            os.chown(root, user.pw_uid, user.pw_gid)
            as_user = ["runuser", "-u", name, "--"]
            break
        else:
            raise RuntimeError("running as root and no `postgres` or `nobody` user to run PostgreSQL as")
    data = f"{root}/data"
    port = _free_port()

    def pg(*cmd: str) -> None:
        subprocess.run([*as_user, *cmd], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                       cwd=root, text=True)

    started = False
    try:
        pg(f"{bin_dir}/initdb", "-D", data, "-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-locale",
           "--no-sync")
        pg(f"{bin_dir}/pg_ctl", "-D", data, "-l", f"{root}/server.log", "-w", "-t", "60", "-o",
           f"-p {port} -k {root} -c listen_addresses=127.0.0.1", "start")
        started = True
        yield PgCluster(f"host=127.0.0.1 port={port} user=postgres dbname=postgres", data)
    except subprocess.CalledProcessError as exc:
        log = Path(f"{root}/server.log")
        raise RuntimeError(f"{' '.join(exc.cmd)} failed: {exc.stderr.strip()}"
                           + (f"\n{log.read_text()[-2000:]}" if log.exists() else "")) from exc
    finally:
        if started or Path(f"{data}/postmaster.pid").exists():
            for mode in ("fast", "immediate"):
                try:
                    pg(f"{bin_dir}/pg_ctl", "-D", data, "-m", mode, "-w", "-t", "30", "stop")
                    break
                except subprocess.CalledProcessError:
                    continue
        shutil.rmtree(root, ignore_errors=True)


# -- the rows ------------------------------------------------------------------------------------
@contextmanager
def judged_by(bootstrap: str, ns: str, state: str, partitions: int, external: bool
              ) -> Iterator[tuple[dict, Processes]]:
    """`threadlog.open` options: embedded, or (`--external`) a thin client with a worker process
    judging; and the processes whose CPU its operations use (client, worker, the local broker)."""
    if not external:
        yield {}, lambda: with_broker(client_only())
        return
    worker = Worker(bootstrap, ns, f"{state}/worker", "w", partitions=partitions)
    try:
        yield {"processors": "external"}, lambda: with_broker({**client_only(), "worker": [worker.proc.pid]})
    finally:
        worker.stop()


async def threadlog_rows(bootstrap: str, ns: str, shape: Shape, seconds: float, partitions: int,
                         reads: bool, external: bool = False) -> list[Result]:
    runs = 0
    with tempfile.TemporaryDirectory(prefix="threadlog-peers-state-") as state, \
            judged_by(bootstrap, ns, state, partitions, external) as (opts, processes):
        async with threadlog.open(bootstrap, namespace=ns, state_dir=state, partitions=partitions, **opts) as tl:

            async def append_run(n: int) -> Result:
                nonlocal runs
                runs += 1
                return await appends(tl, n, shape.threads, shape.callers, shape.files, shape.conv_bytes,
                                     f"run{runs}")

            res = await sized(append_run, seconds, shape, floor=2 * shape.threads, processes=processes)
            res.name = "threadlog checkpoints.append (CAS)"
            out = [res]
            if reads:
                tag = f"run{runs}"  # every thread of the measured run has a head

                async def read(c: int, i: int) -> None:
                    thread = f"{tag}-thread-{shape.thread(c, i)}"
                    head = await tl.checkpoints.get_head(thread)
                    assert head is not None and await tl.checkpoints.get(head) is not None

                res = await sized(lambda n: closed_loop("threadlog get_head + get", shape.callers,
                                                        n // shape.callers, read), seconds, shape,
                                  processes=processes)
                out.append(res)
            return out


async def threadlog_saver_rows(bootstrap: str, ns: str, shape: Shape, seconds: float, partitions: int,
                               reads: bool, external: bool = False) -> list[Result]:
    """LangGraph's own put/get_tuple, through threadlog's AsyncThreadLogSaver: the same calls the
    AsyncPostgresSaver rows make, so the two rows compare the saver a LangGraph user would swap."""
    from threadlog.integrations.langgraph import AsyncThreadLogSaver

    with tempfile.TemporaryDirectory(prefix="threadlog-peers-saver-") as state, \
            judged_by(bootstrap, f"{ns}-lg", state, partitions, external) as (opts, processes):
        async with threadlog.open(bootstrap, namespace=f"{ns}-lg", state_dir=state, partitions=partitions,
                                  **opts) as tl:
            lg = LangGraphWriter(AsyncThreadLogSaver(tl), shape, "tl-lg-thread")
            out = [await sized(lambda n: closed_loop("threadlog AsyncThreadLogSaver.aput", shape.callers,
                                                     n // shape.callers, lg.put), seconds, shape,
                               processes=processes)]
            if reads:
                out.append(await sized(lambda n: closed_loop("threadlog AsyncThreadLogSaver.aget_tuple",
                                                             shape.callers, n // shape.callers, lg.get),
                                       seconds, shape, processes=processes))
            return out


class LangGraphWriter:
    """Checkpoints as LangGraph writes them: the files and the conversation are two channels
    (stored as blobs), both new at every step; the parent is the thread's last checkpoint."""

    def __init__(self, saver: Any, shape: Shape, prefix: str) -> None:
        from langgraph.checkpoint.base import empty_checkpoint

        self.saver = saver
        self.shape = shape
        self.prefix = prefix
        self.configs: dict[int, dict] = {}
        self.versions: dict[int, dict[str, str]] = {}
        self.steps: dict[int, int] = {}
        self._empty = empty_checkpoint

    def config(self, t: int) -> dict:
        return self.configs.get(t) or {"configurable": {"thread_id": f"{self.prefix}-{t}", "checkpoint_ns": ""}}

    async def put(self, c: int, i: int) -> None:
        from langgraph.checkpoint.base.id import uuid6

        t = self.shape.thread(c, i)
        step = self.steps.get(t, -1) + 1
        self.steps[t] = step
        body = self.shape.checkpoint(f"{self.prefix}-{t}/{step}", f"{self.prefix}-{t}", None, step)
        versions = {ch: self.saver.get_next_version(self.versions.get(t, {}).get(ch), None)
                    for ch in ("files", "messages")}
        self.versions[t] = versions
        cp = self._empty()
        cp["id"] = str(uuid6(clock_seq=step))
        cp["channel_values"] = {"files": body["files"], "messages": body["conversation"]}
        cp["channel_versions"] = dict(versions)
        self.configs[t] = await self.saver.aput(self.config(t), cp, {"source": "loop", "step": step, "parents": {}},
                                                versions)

    async def get(self, c: int, i: int) -> None:
        t = self.shape.thread(c, i)
        config = {"configurable": {"thread_id": f"{self.prefix}-{t}", "checkpoint_ns": ""}}
        assert await self.saver.aget_tuple(config) is not None


async def postgres_saver_rows(pg: PgCluster, shape: Shape, seconds: float, reads: bool) -> list[Result]:
    from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
    from psycopg.rows import dict_row
    from psycopg_pool import AsyncConnectionPool

    async with AsyncConnectionPool(pg.conninfo, min_size=POOL_SIZE, max_size=POOL_SIZE, open=False,
                                   kwargs={"autocommit": True, "prepare_threshold": 0,
                                           "row_factory": dict_row}) as pool:
        await pool.wait()
        saver = AsyncPostgresSaver(pool)
        await saver.setup()
        lg = LangGraphWriter(saver, shape, "lg-thread")
        out = [await sized(lambda n: closed_loop(f"LangGraph AsyncPostgresSaver.aput ({POOL_SIZE} conns)",
                                                 shape.callers, n // shape.callers, lg.put), seconds, shape,
                           processes=pg.processes)]
        if reads:
            out.append(await sized(lambda n: closed_loop("LangGraph AsyncPostgresSaver.aget_tuple",
                                                         shape.callers, n // shape.callers, lg.get), seconds, shape,
                                   processes=pg.processes))
        return out


CAS_SCHEMA = """
CREATE TABLE cas_checkpoints (thread_id text NOT NULL, id text NOT NULL, parent text, body bytea NOT NULL,
                              PRIMARY KEY (thread_id, id));
CREATE TABLE cas_heads (thread_id text PRIMARY KEY, head text);
"""


async def postgres_cas_row(pg: PgCluster, shape: Shape, seconds: float) -> Result:
    from psycopg import AsyncConnection
    from psycopg_pool import AsyncConnectionPool

    threads = [f"cas-thread-{t}" for t in range(shape.threads)]
    async with await AsyncConnection.connect(pg.conninfo, autocommit=True) as conn:
        await conn.execute(CAS_SCHEMA)
        async with conn.cursor() as cur:
            await cur.executemany("INSERT INTO cas_heads (thread_id, head) VALUES (%s, NULL)", [(t,) for t in threads])
    heads: dict[str, str | None] = dict.fromkeys(threads)
    steps = dict.fromkeys(threads, 0)

    async with AsyncConnectionPool(pg.conninfo, min_size=POOL_SIZE, max_size=POOL_SIZE, open=False,
                                   kwargs={"autocommit": True}) as pool:
        await pool.wait()

        async def append(c: int, i: int) -> None:
            thread = threads[shape.thread(c, i)]
            step = steps[thread] = steps[thread] + 1
            expected = heads[thread]
            cid = f"{thread}/{step}"
            body = json.dumps(shape.checkpoint(cid, thread, expected, step), separators=(",", ":")).encode()
            async with pool.connection() as conn, conn.transaction():
                await conn.execute("INSERT INTO cas_checkpoints (thread_id, id, parent, body) VALUES (%s, %s, %s, %s)",
                                   (thread, cid, expected, body))
                cur = await conn.execute("UPDATE cas_heads SET head = %s WHERE thread_id = %s "
                                         "AND head IS NOT DISTINCT FROM %s", (cid, thread, expected))
                if cur.rowcount != 1:
                    raise RuntimeError(f"head of {thread} moved: expected {expected!r}")  # rolls back
            heads[thread] = cid

        return await sized(lambda n: closed_loop(f"PostgreSQL INSERT+UPDATE head CAS ({POOL_SIZE} conns)",
                                                 shape.callers, n // shape.callers, append), seconds, shape,
                           processes=pg.processes)


async def sqlite_saver_row(shape: Shape, seconds: float) -> Result:
    from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

    with tempfile.TemporaryDirectory(prefix="threadlog-peers-sqlite-") as d:
        async with AsyncSqliteSaver.from_conn_string(f"{d}/checkpoints.db") as saver:
            await saver.setup()
            lg = LangGraphWriter(saver, shape, "sqlite-thread")
            return await sized(lambda n: closed_loop("LangGraph AsyncSqliteSaver.aput", shape.callers,
                                                     n // shape.callers, lg.put), seconds, shape)


async def raw_row(bootstrap: str, topic: str, payload: bytes, shape: Shape, seconds: float, partitions: int
                  ) -> Result:
    """Raw Kafka, `shape.callers` writers each awaiting its ack with the proposal producer's
    settings: the baseline every rate is a ratio of."""
    async def raw(n: int) -> Result:
        return await raw_produce_closed_loop(bootstrap, topic, payload, n, shape.callers, partitions,
                                             linger_ms=PROPOSALS_LINGER_MS)

    base = await sized(raw, seconds, shape, processes=lambda: with_broker(client_only()))
    base.name = f"raw Kafka produce, {shape.callers} awaiting writers"
    return base


# -- the report ----------------------------------------------------------------------------------
def print_vs_threadlog(write: Result | None, read: Result | None, writes: list[Result], reads: list[Result]) -> None:
    pairs = [(write, peer) for peer in writes] + [(read, peer) for peer in reads]
    pairs = [(tl, peer) for tl, peer in pairs if tl is not None]
    if not pairs:
        return
    print(f"\n{'threadlog ÷ peer':<44} {'threadlog/s':>11} {'peer/s':>10} {'÷':>7}  verdict")
    for tl, peer in pairs:
        x = tl.rate / peer.rate if peer.rate else float("nan")
        print(f"{peer.name:<44} {tl.rate:11.0f} {peer.rate:10.0f} {x:7.2f}  {'beats' if x > 1 else 'LOSES'}")


async def amain(args: Any, bootstrap: str, pg: PgCluster | None) -> None:
    shape = Shape(args.callers, args.threads, args.files, args.conversation_bytes)
    ns = f"bench-peers-{uuid.uuid4().hex[:8]}"
    payload = json.dumps(shape.checkpoint("thread-0/0", "thread-0", None, 0), separators=(",", ":")).encode()
    rows: list[Result] = []
    tl_write = tl_read = None
    peer_writes: list[Result] = []
    peer_reads: list[Result] = []
    topic = temp_topic(bootstrap, args.partitions, prefix=ns)
    try:
        base = await raw_row(bootstrap, topic, payload, shape, args.seconds, args.partitions)
        rows.append(base)
        if not args.skip_threadlog:
            tl_rows = await threadlog_rows(bootstrap, ns, shape, args.seconds, args.partitions, not args.skip_reads,
                                           args.external)
            tl_write, tl_read = tl_rows[0], (tl_rows[1] if len(tl_rows) > 1 else None)
            rows += tl_rows
            rows += await threadlog_saver_rows(bootstrap, ns, shape, args.seconds, args.partitions,
                                               not args.skip_reads, args.external)
        if pg is not None:
            pg_rows = await postgres_saver_rows(pg, shape, args.seconds, not args.skip_reads)
            peer_writes.append(pg_rows[0])
            peer_reads += pg_rows[1:]
            peer_writes.append(await postgres_cas_row(pg, shape, args.seconds))
            rows += pg_rows + peer_writes[-1:]
        if not args.skip_sqlite:
            peer_writes.append(await sqlite_saver_row(shape, args.seconds))
            rows.append(peer_writes[-1])
    finally:
        delete_topic(bootstrap, topic)
        delete_namespace(bootstrap, ns)
        delete_namespace(bootstrap, f"{ns}-lg")

    for r in rows:
        if r.latencies and not r.bytes:
            r.bytes = r.count * len(payload)  # same checkpoint, whatever the encoding
    print(f"\nbroker {bootstrap}, {args.partitions} partitions; {shape.callers} closed-loop callers over "
          f"{shape.threads} threads; checkpoint {args.files} files + {args.conversation_bytes} B conversation "
          f"= {len(payload)} B as JSON; ~{args.seconds:g} s a row\n")
    report([(r, None if r is base else base) for r in rows], unit="ops/s")
    print("\nratio = rate / raw Kafka closed-loop produce; MiB/s counts the checkpoint's JSON size")
    print("1-min load average as each row ended: "
          + ", ".join(f"{LOAD_AFTER[id(r)]:.1f}" for r in rows if id(r) in LOAD_AFTER))
    print_cpu(rows)
    print_vs_threadlog(tl_write, tl_read, peer_writes, peer_reads)


def print_cpu(rows: list[Result]) -> None:
    """Where each row's CPU went, per operation, and the rate those CPU seconds allow on this
    machine's cores if nothing waited: what says whether a row is bound by work or by waiting,
    and what a design must cost per operation to match another row."""
    roles = ["client", "worker", "broker", "postgres"]
    cores = len(os.sched_getaffinity(0))  # the cores this process may use, not the machine's
    print(f"\nCPU per operation, us (user + system, every process the row uses on this machine; "
          f"ceiling = {cores} cores / total)")
    print(f"{'measurement':<44}" + "".join(f"{r:>9}" for r in roles) + f"{'total':>9}{'ceiling/s':>11}")
    for r in rows:
        cpu = CPU_PER_OP.get(id(r))
        if not cpu:
            continue
        total = sum(cpu.values())
        cells = "".join(f"{cpu[role] * 1e6:9.0f}" if role in cpu else f"{'-':>9}" for role in roles)
        print(f"{r.name:<44}{cells}{total * 1e6:9.0f}{cores / total if total else float('nan'):11.0f}")


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM unwinds like Ctrl-C, so the cluster and the topics are still cleaned up."""
    raise KeyboardInterrupt


def main() -> None:
    ap = bench_args(__doc__)
    ap.add_argument("--seconds", type=float, default=8.0, help="measured seconds per row (about)")
    ap.add_argument("--callers", type=int, default=16, help="concurrent closed-loop callers")
    ap.add_argument("--threads", type=int, default=64, help="threads written (a multiple of --callers)")
    ap.add_argument("--partitions", type=int, default=4, help="threadlog partitions, and the raw topic's")
    ap.add_argument("--files", type=int, default=8, help="file entries per checkpoint")
    ap.add_argument("--conversation-bytes", type=int, default=512)
    ap.add_argument("--pg-bin", default=PG_BIN, help="directory of initdb and pg_ctl")
    ap.add_argument("--skip-threadlog", action="store_true")
    ap.add_argument("--external", action="store_true",
                    help="threadlog's rows through a thin client; a `threadlog worker` process judges")
    ap.add_argument("--skip-postgres", action="store_true", help="no AsyncPostgresSaver nor hand-written CAS rows")
    ap.add_argument("--skip-sqlite", action="store_true")
    ap.add_argument("--skip-reads", action="store_true", help="no get_head+get / aget_tuple rows")
    args = ap.parse_args()
    if args.threads < args.callers or args.threads % args.callers:
        ap.error("--threads must be a positive multiple of --callers")
    bootstrap = bootstrap_or_local(args.bootstrap)
    signal.signal(signal.SIGTERM, _interrupt)
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    try:
        if args.skip_postgres:
            asyncio.run(amain(args, bootstrap, None))
        else:
            with postgres_cluster(args.pg_bin) as pg:
                asyncio.run(amain(args, bootstrap, pg))
    except KeyboardInterrupt:
        print("interrupted: PostgreSQL cluster and Kafka topics cleaned up", file=sys.stderr)
        sys.exit(130)
    # A load above ~1 before the run means something else was busy on this 2-core machine too.
    print(f"\nwhole run {time.perf_counter() - t0:.0f} s; 1-min load average {load0:.2f} at start")


if __name__ == "__main__":
    main()
