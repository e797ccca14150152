"""Blob put/get throughput (MiB/s) beside raw produce/consume of the same bytes, same broker, same run.

    .venv/bin/python bench/blobs_bench.py [--bootstrap B] [--size-mib 32] [--count 8]
                                          [--small-kib 256] [--small-count 200] [--clients 8]

Raw baselines write the same total bytes as CHUNK_SIZE records (pipelined,
idempotent, acks=all) to a fresh topic with the namespace's partition count,
and read them back from offset 0. Blob rows: sequential puts/gets of large
blobs (streaming path), and small blobs with C concurrent callers (the
commit/decider path dominates). ratio = blob MiB/s / raw MiB/s.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (
    Result,
    bench_args,
    bootstrap_or_local,
    delete_namespace,
    delete_topic,
    judge_line,
    raw_consume,
    raw_produce_closed_loop,
    raw_produce_pipelined,
    temp_topic,
)
from threadlog.producers.blob_chunks import CHUNK_SIZE

import threadlog

MiB = 2**20


def row(res: Result, base: Result | None) -> str:
    ratio = f"{res.mib_s / base.mib_s:7.3f}" if base is not None and base.mib_s else "      -"
    p50 = f"{res.pct(0.5):9.1f}" if res.latencies else "        -"
    p99 = f"{res.pct(0.99):9.1f}" if res.latencies else "        -"
    return f"{res.name:<48} {res.count:>6} {res.mib_s:9.1f} {p50} {p99} {ratio}"


async def timed(name: str, calls, nbytes: int, concurrency: int = 1) -> Result:
    latencies: list[float] = []
    queue = list(calls)

    async def worker() -> None:
        while queue:
            call = queue.pop(0)
            t = time.perf_counter()
            await call()
            latencies.append(time.perf_counter() - t)

    n = len(queue)
    t0 = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(concurrency)])
    return Result(name, n, time.perf_counter() - t0, nbytes, latencies)


async def main() -> None:
    ap = bench_args(__doc__)
    ap.add_argument("--size-mib", type=int, default=32, help="size of each large blob")
    ap.add_argument("--count", type=int, default=8, help="large blobs put and read back")
    ap.add_argument("--small-kib", type=int, default=256)
    ap.add_argument("--small-count", type=int, default=200)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--partitions", type=int, default=4)
    args = ap.parse_args()
    bootstrap = bootstrap_or_local(args.bootstrap)

    big = os.urandom(args.size_mib * MiB)
    small = os.urandom(args.small_kib * 1024)
    big_total = len(big) * args.count
    small_total = len(small) * args.small_count
    topic = temp_topic(bootstrap, args.partitions)
    ns = f"bench-blobs-{uuid.uuid4().hex[:6]}"
    try:
        chunk = big[:CHUNK_SIZE]
        raw_put = raw_produce_pipelined(bootstrap, topic, chunk, big_total // CHUNK_SIZE, args.partitions)
        raw_put.name = f"raw produce {CHUNK_SIZE // 1024} KiB records, pipelined"
        raw_get = raw_consume(bootstrap, topic, args.partitions)
        raw_get.name = f"raw consume {CHUNK_SIZE // 1024} KiB records from 0"
        # A small put is chunk records (linger 2) plus one proposal (linger 0): no one setting
        # matches it; this baseline keeps the 1 ms it has always been measured with.
        raw_small = await raw_produce_closed_loop(bootstrap, topic, small, args.small_count, args.clients,
                                                  args.partitions, linger_ms=1)
        raw_small.name = f"raw produce {args.small_kib} KiB, {args.clients} awaiting writers"
        with tempfile.TemporaryDirectory() as state:
            async with threadlog.open(bootstrap, namespace=ns, state_dir=state, partitions=args.partitions) as tl:
                await tl.blobs.put("warmup", big[: 2 * CHUNK_SIZE])
                await tl.blobs.get("warmup")
                puts = await timed(f"put {args.size_mib} MiB blobs, sequential",
                                   [lambda n=n: tl.blobs.put(f"big/{n}", big) for n in range(args.count)],
                                   big_total)
                gets = await timed(f"get {args.size_mib} MiB blobs, sequential",
                                   [lambda n=n: tl.blobs.get(f"big/{n}") for n in range(args.count)],
                                   big_total)
                ranged = await timed("get 4 KiB range of a large blob, sequential",
                                     [lambda n=n: tl.blobs.get(f"big/{n % args.count}",
                                                               range={"offset": (n * 7919 * 4096) % len(big),
                                                                      "length": 4096})
                                      for n in range(200)], 200 * 4096)
                sputs = await timed(f"put {args.small_kib} KiB blobs, {args.clients} concurrent",
                                    [lambda n=n: tl.blobs.put(f"small/{n}", small) for n in range(args.small_count)],
                                    small_total, args.clients)
                sgets = await timed(f"get {args.small_kib} KiB blobs, {args.clients} concurrent",
                                    [lambda n=n: tl.blobs.get(f"small/{n}") for n in range(args.small_count)],
                                    small_total, args.clients)
                overwrite = await timed(f"overwrite {args.size_mib} MiB blobs, sequential",
                                        [lambda n=n: tl.blobs.put(f"big/{n}", big) for n in range(args.count)],
                                        big_total)
                stats = dict(tl.runtime.judge.stats)
        print(f"\nbroker {bootstrap}; {args.partitions} partitions; chunk {CHUNK_SIZE // 1024} KiB\n")
        print(f"{'measurement':<48} {'calls':>6} {'MiB/s':>9} {'p50 ms':>9} {'p99 ms':>9} {'ratio':>7}")
        for res, base in [(raw_put, None), (raw_get, None), (raw_small, None), (puts, raw_put), (overwrite, raw_put),
                          (gets, raw_get), (sputs, raw_small), (sgets, raw_get), (ranged, None)]:
            print(row(res, base))
        print("\nratio = blob MiB/s / raw MiB/s of the same bytes: large puts vs pipelined produce, small puts vs")
        print("awaiting writers at the same concurrency, gets vs consume from offset 0")
        print(judge_line(stats))
    finally:
        delete_topic(bootstrap, topic)
        delete_namespace(bootstrap, ns)


if __name__ == "__main__":
    asyncio.run(main())
