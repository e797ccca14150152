"""Thin clients served by a worker vs embedded (full-replica) clients, same broker, same run.

    .venv/bin/python bench/thin_bench.py [--bootstrap B] [--history 10000,50000] [--count 2000]

1. Open + first read of a fresh client on a namespace with H proposals of
   history: an embedded client folds (judges) all H before its first read;
   a thin client asks a worker that already has, so it should not grow with H.
   History is written raw (encoded proposals, pipelined) to keep set-up short;
   the worker is warm (it serves the namespace already) before timing.
2. Checkpoint appends (head compare-and-set), 16 callers over 64 threads,
   through a thin client + one worker process vs an embedded client.
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from confluent_kafka import Producer

sys.path.insert(0, str(Path(__file__).parent))
from checkpoints_bench import appends
from common import Result, bench_args, bootstrap_or_local, delete_namespace, report
from threadlog.schemas import default_codec

import threadlog
from threadlog.kernel.partitioning import partition_for
from threadlog.kernel.topics import Topics

PARTITIONS = 4
THREADS = 1000


def write_history(bootstrap: str, ns: str, start: int, count: int) -> dict[int, int]:
    """`count` SaveTranscript proposals over THREADS threads, produced back to back; bytes per partition."""
    written: dict[int, int] = {}
    codec = default_codec()
    topic = Topics(ns).events
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": 5,
                         "batch.size": 1_000_000})
    for n in range(start, start + count):
        thread = f"h-{n % THREADS}"
        payload = codec.encode("threadlog.cmd.SaveTranscript", {"threadId": thread, "messages": f'["m{n}"]'})
        value = codec.encode("threadlog.Proposal", {
            "proposalId": uuid.uuid4().hex, "key": thread, "type": "threadlog.cmd.SaveTranscript",
            "at": time.time() * 1000.0, "rules": 2, "seen": [], "payload": payload})
        p = partition_for(thread, PARTITIONS)
        written[p] = written.get(p, 0) + len(value) + len(thread)
        while True:
            try:
                producer.produce(topic, value, thread.encode(), partition=p)
                break
            except BufferError:
                producer.poll(0.05)
        producer.poll(0)
    assert producer.flush(60) == 0
    return written


async def open_and_read(bootstrap: str, ns: str, state: str, processors: str, expect: list) -> float:
    t0 = time.perf_counter()
    async with threadlog.open(bootstrap, namespace=ns, state_dir=state, processors=processors,
                              partitions=PARTITIONS, request_timeout_ms=120_000) as tl:
        got = await tl.messages.load_thread("h-0")
        elapsed = time.perf_counter() - t0
    assert got == expect, (processors, got, expect)
    return elapsed


def start_worker(bootstrap: str, ns: str, state: str) -> subprocess.Popen:
    worker = subprocess.Popen([sys.executable, "-m", "threadlog", "worker", "--bootstrap", bootstrap,
                               "--namespace", ns, "--partitions", str(PARTITIONS), "--state-dir", state],
                              stdout=subprocess.PIPE, text=True)
    assert worker.stdout is not None
    print(worker.stdout.readline().strip(), flush=True)
    return worker


def stop_worker(worker: subprocess.Popen) -> None:
    worker.terminate()
    try:
        worker.wait(20)
    except subprocess.TimeoutExpired:
        worker.kill()


async def main() -> None:
    ap = bench_args(__doc__ or "")
    ap.add_argument("--history", default="10000,50000", help="history sizes (cumulative), comma separated")
    ap.add_argument("--count", type=int, default=2000, help="CAS appends measured per mode")
    ap.add_argument("--samples", type=int, default=5, help="fresh thin clients timed per history size")
    ap.add_argument("--callers", type=int, default=16)
    ap.add_argument("--threads", type=int, default=64)
    args = ap.parse_args()
    bootstrap = bootstrap_or_local(args.bootstrap)
    sizes = [int(x) for x in args.history.split(",")]

    ns = f"bench-thin-{uuid.uuid4().hex[:6]}"
    rows: list[tuple[int, float, float]] = []
    with tempfile.TemporaryDirectory() as state:
        worker = None
        try:
            # Create the topics (an embedded open), then start the worker that thin clients use.
            async with threadlog.open(bootstrap, namespace=ns, state_dir=f"{state}/init", partitions=PARTITIONS):
                pass
            worker = start_worker(bootstrap, ns, f"{state}/worker")
            written = 0
            for n, size in enumerate(sizes):
                write_history(bootstrap, ns, written, size - written)
                written = size
                last = max(i for i in range(written) if i % THREADS == 0)
                expect = [f"m{last}"]
                # Warm the worker: it serves the namespace before clients come and go.
                await open_and_read(bootstrap, ns, f"{state}/warm-{n}", "external", expect)
                # Several fresh thin clients, one after another: one sample is at the mercy of
                # whatever else the worker or the machine does that moment (a snapshot, a compaction).
                samples = sorted([await open_and_read(bootstrap, ns, f"{state}/thin-{n}-{i}", "external", expect)
                                  for i in range(args.samples)])
                thin = statistics.median(samples)
                embedded = await open_and_read(bootstrap, ns, f"{state}/embedded-{n}", "embedded", expect)
                rows.append((size, thin, embedded))
                print(f"history {size:>6}: fresh client open + first read: thin {thin * 1e3:8.1f} ms "
                      f"(median of {len(samples)}; {samples[0] * 1e3:.1f}-{samples[-1] * 1e3:.1f}), "
                      f"embedded {embedded * 1e3:8.1f} ms", flush=True)

            cas: list[tuple[Result, Result | None]] = []
            for processors in ("embedded", "external"):
                async with threadlog.open(bootstrap, namespace=ns, state_dir=f"{state}/cas-{processors}",
                                          processors=processors, partitions=PARTITIONS,
                                          request_timeout_ms=600_000) as tl:
                    tag = f"{processors}-{uuid.uuid4().hex[:4]}"
                    await appends(tl, args.callers * 20, args.threads, args.callers, 8, 512, f"warm-{tag}")
                    res = await appends(tl, args.count, args.threads, args.callers, 8, 512, tag)
                    res.name = f"CAS append, {args.callers} callers, {processors}" + (
                        " (thin + 1 worker)" if processors == "external" else "")
                    cas.append((res, cas[0][0] if cas else None))
        finally:
            if worker is not None:
                stop_worker(worker)
            delete_namespace(bootstrap, ns)

    print(f"\nbroker {bootstrap}; {PARTITIONS} partitions; history over {THREADS} threads\n")
    print(f"{'history':>8} {'thin open+read ms (median)':>27} {'embedded open+read ms':>22}")
    for size, thin, embedded in rows:
        print(f"{size:>8} {thin * 1e3:27.1f} {embedded * 1e3:22.1f}")
    print()
    report(cas)
    print("ratio = thin rate / embedded rate")


if __name__ == "__main__":
    asyncio.run(main())
