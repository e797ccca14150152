"""Baseline: raw Kafka next to `save_thread` through the decider, same broker, same run.

    .venv/bin/python bench/baseline.py [--bootstrap B] [--count N] [--size S] [--clients C]

Prints raw produce (C writers awaiting acks; pipelined), raw consume, and
`save_thread` throughput and p50/p99 with 1 and C concurrent callers, each as
a ratio of the raw closed-loop produce rate at the same concurrency.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (
    PROPOSALS_LINGER_MS,
    Result,
    bench_args,
    bootstrap_or_local,
    closed_loop,
    delete_namespace,
    delete_topic,
    judge_line,
    raw_consume,
    raw_produce_closed_loop,
    raw_produce_pipelined,
    report,
    temp_topic,
)

import threadlog
import threadlog.kernel.validation


async def save_threads(tl, payload: list, total: int, concurrency: int, threads: int) -> Result:
    per = total // concurrency
    await tl.messages.save_thread("warmup", payload)
    return await closed_loop(f"save_thread, {concurrency} concurrent callers", concurrency, per,
                             lambda c, i: tl.messages.save_thread(f"thread-{(c * per + i) % threads}", payload))


async def main() -> None:
    ap = bench_args(__doc__)
    ap.add_argument("--count", type=int, default=2000)
    ap.add_argument("--size", type=int, default=512, help="bytes of transcript JSON per save")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--partitions", type=int, default=4)
    args = ap.parse_args()
    bootstrap = bootstrap_or_local(args.bootstrap)
    text = "x" * max(1, args.size - 40)
    transcript = [{"role": "user", "content": text}]
    payload = threadlog.kernel.validation.dumps(transcript).encode()

    topic = temp_topic(bootstrap, args.partitions)
    ns = f"bench-{uuid.uuid4().hex[:6]}"
    try:
        raw1 = await raw_produce_closed_loop(bootstrap, topic, payload, args.count // 4, 1, args.partitions,
                                             linger_ms=PROPOSALS_LINGER_MS)
        rawc = await raw_produce_closed_loop(bootstrap, topic, payload, args.count, args.clients, args.partitions,
                                             linger_ms=PROPOSALS_LINGER_MS)
        pipe = raw_produce_pipelined(bootstrap, topic, payload, args.count * 10, args.partitions)
        cons = raw_consume(bootstrap, topic, args.partitions)
        with tempfile.TemporaryDirectory() as state:
            async with threadlog.open(bootstrap, namespace=ns, state_dir=state,
                                      partitions=args.partitions) as tl:
                s1 = await save_threads(tl, transcript, args.count // 4, 1, 64)
                sc = await save_threads(tl, transcript, args.count, args.clients, 64)
                stats = dict(tl.runtime.judge.stats)
        print(f"\nbroker {bootstrap}; payload {len(payload)} B; {args.partitions} partitions\n")
        report([(raw1, None), (rawc, None), (pipe, None), (cons, None), (s1, raw1), (sc, rawc)])
        print("\nratio = save_thread rate / raw closed-loop produce rate at the same concurrency")
        print(judge_line(stats))
    finally:
        delete_topic(bootstrap, topic)
        delete_namespace(bootstrap, ns)


if __name__ == "__main__":
    asyncio.run(main())
