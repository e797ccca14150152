"""Shared pieces of the benchmarks: raw Kafka baselines on the same broker, stats, reports.

Every figure threadlog reports is a ratio against raw confluent-kafka on the
same broker in the same run, measured the same way:
- `raw_produce_closed_loop`: C concurrent writers, each awaiting the broker's
  ack (acks=all, idempotent) before sending its next record -- the baseline
  for request/response paths (a command awaits its reply);
- `raw_produce_pipelined`: one writer producing N records back to back, then
  flushing -- the ceiling for streaming paths (delivery appends, blob chunks);
- `raw_consume`: read N records of a topic from offset 0.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic


def bench_args(description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--bootstrap", default=os.environ.get("THREADLOG_BOOTSTRAP"),
                    help="cluster to use (default: start/reuse the local broker)")
    return ap


def bootstrap_or_local(bootstrap: str | None) -> str:
    if bootstrap:
        return bootstrap
    from threadlog import broker

    return broker.start(log=lambda m: print(m)).bootstrap


@dataclass
class Result:
    name: str
    count: int
    seconds: float
    bytes: int = 0
    latencies: list[float] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.count / self.seconds if self.seconds else 0.0

    @property
    def mib_s(self) -> float:
        return self.bytes / self.seconds / 2**20 if self.seconds else 0.0

    def pct(self, q: float) -> float:
        if not self.latencies:
            return float("nan")
        xs = sorted(self.latencies)
        return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3


def report(rows: list[tuple[Result, Result | None]], unit: str = "ops/s") -> str:
    """Rows of (measured, baseline); prints rate, MiB/s, p50/p99 and the ratio."""
    lines = [f"{'measurement':<44} {unit:>10} {'MiB/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'ratio':>7}"]
    for res, base in rows:
        ratio = f"{res.rate / base.rate:7.3f}" if base is not None and base.rate else "      -"
        p50 = f"{res.pct(0.5):8.2f}" if res.latencies else "       -"
        p99 = f"{res.pct(0.99):8.2f}" if res.latencies else "       -"
        lines.append(f"{res.name:<44} {res.rate:10.0f} {res.mib_s:8.2f} {p50} {p99} {ratio}")
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def temp_topic(bootstrap: str, partitions: int = 1, prefix: str = "bench") -> str:
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for f in admin.create_topics([NewTopic(name, partitions, 1,
                                           config={"max.message.bytes": str(16 * 2**20)})]).values():
        f.result(30)
    return name


def delete_topic(bootstrap: str, name: str) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for f in admin.delete_topics([name]).values():
        try:
            f.result(30)
        except Exception:
            pass


def _producer(bootstrap: str, **extra) -> Producer:
    return Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "acks": "all",
                     "linger.ms": 1, "message.max.bytes": 17 * 2**20, **extra})


# The linger of threadlog's proposal producer (producers/proposals.py): a proposal is
# awaited, so it is sent at once. A raw baseline compared with proposals uses the same:
# with 1 ms, a single raw writer's p50 was 1.35 ms against 0.64 ms for an embedded
# client's whole `save_thread`, so "2 x raw" measured the baseline's linger, not threadlog.
PROPOSALS_LINGER_MS = 0


async def raw_produce_closed_loop(bootstrap: str, topic: str, payload: bytes, total: int,
                                  concurrency: int, partitions: int = 1, *, linger_ms: float) -> Result:
    """`concurrency` writers, each awaiting its ack before the next record.
    `linger_ms`: the one the compared threadlog producer uses (same records, same settings:
    `PROPOSALS_LINGER_MS` for proposals, 0 for delivery appends)."""
    producer = _producer(bootstrap, **{"linger.ms": linger_ms})
    stop = threading.Event()
    pump = threading.Thread(target=lambda: [producer.poll(0.05) for _ in iter(stop.is_set, True)], daemon=True)
    pump.start()
    loop = asyncio.get_running_loop()
    latencies: list[float] = []
    per = total // concurrency

    async def writer(w: int) -> None:
        for i in range(per):
            fut = loop.create_future()
            t = time.perf_counter()
            producer.produce(topic, payload, f"k{w}-{i % 64}".encode(), partition=(w + i) % partitions,
                             on_delivery=lambda e, m, f=fut: loop.call_soon_threadsafe(
                                 f.set_exception if e else f.set_result, e or m))
            await fut
            latencies.append(time.perf_counter() - t)

    # warm up the connection and the idempotent producer id
    producer.produce(topic, payload, b"warmup", partition=0)
    producer.flush(30)
    t0 = time.perf_counter()
    await asyncio.gather(*[writer(w) for w in range(concurrency)])
    elapsed = time.perf_counter() - t0
    stop.set()
    pump.join()
    producer.flush(30)
    n = per * concurrency
    return Result(f"raw produce, {concurrency} awaiting writers", n, elapsed, n * len(payload), latencies)


async def closed_loop(name: str, callers: int, per: int, call: Callable[[int, int], Awaitable]) -> Result:
    """`callers` concurrent callers, caller c awaiting `call(c, i)` for i < per, each
    call timed: the closed loop every threadlog request/response path is measured in."""
    latencies: list[float] = []

    async def caller(c: int) -> None:
        for i in range(per):
            t = time.perf_counter()
            await call(c, i)
            latencies.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    await asyncio.gather(*[caller(c) for c in range(callers)])
    return Result(name, per * callers, time.perf_counter() - t0, 0, latencies)


def raw_produce_pipelined(bootstrap: str, topic: str, payload: bytes, total: int,
                          partitions: int = 1) -> Result:
    producer = _producer(bootstrap, **{"linger.ms": 5, "batch.size": 1_000_000})
    producer.produce(topic, payload, b"warmup", partition=0)
    producer.flush(30)
    t0 = time.perf_counter()
    for i in range(total):
        while True:
            try:
                producer.produce(topic, payload, f"k{i % 64}".encode(), partition=i % partitions)
                break
            except BufferError:
                producer.poll(0.01)
    producer.flush(60)
    elapsed = time.perf_counter() - t0
    return Result("raw produce, pipelined", total, elapsed, total * len(payload))


def raw_consume(bootstrap: str, topic: str, partitions: int = 1, expect: int | None = None) -> Result:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-{uuid.uuid4().hex[:6]}",
                  "enable.auto.commit": False, "enable.partition.eof": True,
                  "isolation.level": "read_committed", "fetch.max.bytes": 64 * 2**20,
                  "max.partition.fetch.bytes": 17 * 2**20})
    c.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    n = nbytes = 0
    eof: set[int] = set()
    t0 = time.perf_counter()
    while len(eof) < partitions or (expect is not None and n < expect):
        for m in c.consume(10000, 0.5):
            if m.error():
                if m.error().code() == KafkaError._PARTITION_EOF:
                    eof.add(m.partition())
                continue
            n += 1
            nbytes += len(m.value() or b"")
    elapsed = time.perf_counter() - t0
    c.close()
    return Result("raw consume from offset 0", n, elapsed, nbytes)


def delete_namespace(bootstrap: str, namespace: str) -> None:
    """Drop the topics a benchmark's threadlog namespace created."""
    from threadlog.kernel.topics import Topics, delete_topics

    delete_topics(AdminClient({"bootstrap.servers": bootstrap}), Topics(namespace))


def judge_line(stats: dict) -> str:
    """What the judge of the measuring client decided."""
    return (f"judge: {stats['judged']} proposals judged, {stats['accepted']} accepted, {stats['refused']} refused, "
            f"{stats['blocked']} waits for another partition")


def summary(xs: list[float]) -> str:
    return f"mean {statistics.mean(xs) * 1e3:.2f} ms" if xs else "-"


_TICK = os.sysconf("SC_CLK_TCK")  # /proc's CPU times are in clock ticks


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state, ppid, ...), None once gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _pids() -> list[int]:
    """Every process on this machine now."""
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def _cpu_of(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far; 0.0 once it is gone."""
    fields = _stat(pid)
    return 0.0 if fields is None else (int(fields[11]) + int(fields[12])) / _TICK


def tree_cpu(root: int) -> float:
    """CPU seconds of `root` and its children: root's own and reaped children's (cutime,
    cstime) plus every live child's. Re-listed at each call, so a child that starts or
    exits between two calls (PostgreSQL's autovacuum workers) is counted, not lost."""
    fields = _stat(root)
    if fields is None:
        return 0.0
    total = sum(int(x) for x in fields[11:15]) / _TICK
    for pid in _pids():
        child = _stat(pid)
        if child is not None and child[1] == str(root):
            total += (int(child[11]) + int(child[12])) / _TICK
    return total


def broker_pids() -> list[int]:
    """Local Kafka JVMs (the broker a benchmark talks to when it runs on this machine)."""
    pids = []
    for pid in _pids():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if b"java" in cmd and b"kafka" in cmd.lower():
            pids.append(pid)
    return pids


# The processes a measurement's CPU is metered in, by role: pids, or a function
# returning CPU seconds so far (a process tree, `tree_cpu`).
Roles = dict[str, list[int] | Callable[[], float]]


class CpuMeter:
    """CPU used by named processes between `start()` and `stop()`, reported per operation.

    On a 2-core machine the Python processes and the broker share the cores, so
    where the CPU of one decision goes (client, worker, broker) is what says
    which part caps the rate. Each pid of a role counts from its own reading at
    `start()`, and one gone by `stop()` counts nothing rather than minus what it
    had used; a function role is one such reading.
    """

    def __init__(self, processes: Roles) -> None:
        self.processes = processes
        self._before: dict[str, dict[int, float]] = {}
        self.used: dict[str, float] = {}

    def _read(self) -> dict[str, dict[int, float]]:
        return {name: {0: what()} if callable(what) else {p: _cpu_of(p) for p in what}
                for name, what in self.processes.items()}

    def start(self) -> CpuMeter:
        self._before = self._read()
        return self

    def stop(self) -> dict[str, float]:
        now = self._read()
        self.used = {name: sum(max(0.0, cpu - self._before[name][k]) for k, cpu in after.items())
                     for name, after in now.items()}
        return self.used

    def line(self, ops: int, seconds: float) -> str:
        parts = [f"{name} {used / ops * 1e6:.0f} us ({used / seconds:.2f} cores)" for name, used in self.used.items()]
        return "CPU per operation: " + ", ".join(parts)
