"""Run updates, claims and interrupt resolutions judged by the log, beside raw Kafka on the same broker, same run.

    .venv/bin/python bench/runs_bench.py [--bootstrap B] [--count N] [--clients C] [--runs R] [--external]

`tl.runs.update(run_id, patch)` is a global read barrier (to resolve the run's
thread through the run index: one ListOffsets round trip, shared by concurrent
calls) followed by a proposal on the thread's partition, answered once judged.
The baseline is raw confluent-kafka producing the very bytes of that proposal
(an encoded threadlog.Proposal carrying an UpdateRun) with acks=all, each
writer awaiting its ack, at the same concurrency. `claim` (a claim granted on
the run's delivery partition, then mirrored on the run record) and
`interrupts.resolve` are reported too. `--external` runs them through a thin
client, judged by a `threadlog worker` process (verdicts pushed by its judge).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import tempfile
import time
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
    raw_produce_closed_loop,
    report,
    temp_topic,
)
from threadlog.schemas import default_codec

import threadlog
from threadlog.kernel.validation import dumps


def patch_for(i: int) -> dict:
    return {"detachedSince": 1_700_000_000_000 + i, "sandboxKey": f"sandbox-{i % 97}",
            "usage": {"promptTokens": i, "completionTokens": 2 * i, "totalTokens": 3 * i}}


def command_bytes(run_id: str, thread_id: str) -> bytes:
    """The exact bytes `update` produces for one patch (the raw baseline's payload)."""
    codec = default_codec()
    body = codec.encode("threadlog.cmd.UpdateRun", {"runId": run_id, "threadId": thread_id,
                                                   "patch": dumps(patch_for(12345))})
    return codec.encode("threadlog.Proposal", {
        "proposalId": uuid.uuid4().hex, "key": thread_id, "type": "threadlog.cmd.UpdateRun",
        "at": time.time() * 1000, "rules": 2, "seen": [], "payload": body})


async def updates(tl, total: int, concurrency: int, runs: list[str]) -> Result:
    per = total // concurrency
    return await closed_loop(f"runs.update, {concurrency} concurrent callers", concurrency, per,
                             lambda c, i: tl.runs.update(runs[(c * per + i) % len(runs)], patch_for(c * per + i)))


async def claims(tl, total: int, concurrency: int, runs: list[str]) -> Result:
    per = total // concurrency
    return await closed_loop(f"runs.claim, {concurrency} concurrent callers", concurrency, per,
                             lambda c, i: tl.runs.claim(runs[(c * per + i) % len(runs)]))


async def resolves(tl, total: int, concurrency: int) -> Result:
    """interrupts.resolve of `total` pending interrupts (each decided once)."""
    per = total // concurrency
    await closed_loop("create", concurrency, per, lambda c, i: tl.interrupts.create({
        "interruptId": f"i-{c}-{i}", "runId": f"run-{c}", "threadId": f"thread-{c}", "requestedAt": i,
        "payload": {"tool": "approve", "n": i}}))
    return await closed_loop(f"interrupts.resolve, {concurrency} concurrent callers", concurrency, per,
                             lambda c, i: tl.interrupts.resolve(f"i-{c}-{i}", {"approved": True}))


async def main() -> None:
    ap = bench_args(__doc__)
    ap.add_argument("--count", type=int, default=2000)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--runs", type=int, default=64, help="distinct runs (over 16 threads)")
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--external", action="store_true", help="a thin client; a `threadlog worker` process judges")
    args = ap.parse_args()
    bootstrap = bootstrap_or_local(args.bootstrap)
    run_ids = [f"run-{n}" for n in range(args.runs)]
    payload = command_bytes(run_ids[0], "thread-0")

    topic = temp_topic(bootstrap, args.partitions)
    ns = f"bench-{uuid.uuid4().hex[:6]}"
    try:
        raw1 = await raw_produce_closed_loop(bootstrap, topic, payload, args.count // 4, 1, args.partitions,
                                             linger_ms=PROPOSALS_LINGER_MS)
        rawc = await raw_produce_closed_loop(bootstrap, topic, payload, args.count, args.clients, args.partitions,
                                             linger_ms=PROPOSALS_LINGER_MS)
        with tempfile.TemporaryDirectory() as state, contextlib.ExitStack() as workers:
            if args.external:
                from workers import Worker

                workers.callback(Worker(bootstrap, ns, f"{state}/worker", "w", partitions=args.partitions).stop)
            async with threadlog.open(bootstrap, namespace=ns, state_dir=f"{state}/client", partitions=args.partitions,
                                      processors="external" if args.external else "embedded") as tl:
                for n, run_id in enumerate(run_ids):
                    await tl.runs.create_or_resume(run_id=run_id, thread_id=f"thread-{n % 16}", started_at=n)
                await tl.runs.update(run_ids[0], patch_for(0))  # warm up
                u1 = await updates(tl, args.count // 4, 1, run_ids)
                uc = await updates(tl, args.count, args.clients, run_ids)
                c1 = await claims(tl, args.count // 8, 1, run_ids)
                cc = await claims(tl, args.count // 2, args.clients, run_ids)
                rc = await resolves(tl, args.count // 2, args.clients)
                stats = dict(tl.runtime.judge.stats) if tl.runtime.judge is not None else {}
                check = await tl.runs.get(run_ids[0])
                assert check is not None and check["status"] == "running"
        mode = "thin client, 1 worker process judging" if args.external else "judge embedded in the client"
        print(f"\nbroker {bootstrap}; command {len(payload)} B; {args.partitions} partitions; "
              f"{args.runs} runs on 16 threads; {mode}\n")
        report([(raw1, None), (rawc, None), (u1, raw1), (uc, rawc), (c1, raw1), (cc, rawc), (rc, rawc)])
        print("\nratio = store rate / raw closed-loop produce rate of the same command bytes at the same concurrency")
        if stats:
            print(judge_line(stats))
    finally:
        delete_topic(bootstrap, topic)
        delete_namespace(bootstrap, ns)


if __name__ == "__main__":
    asyncio.run(main())
