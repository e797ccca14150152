"""Checkpoint appends decided by head compare-and-set, next to raw Kafka on the same broker, same run.

    .venv/bin/python bench/checkpoints_bench.py [--bootstrap B] [--count N] [--threads 64] [--clients 16]
                                                 [--files 8] [--conversation-bytes 512] [--external]

64 threads, 16 concurrent callers; each caller owns threads/clients threads, holds
a writer lease on each and appends checkpoints with `expected_head_id` = the head
it last wrote (every append is a full CAS decision: writer fence, global duplicate-id
check, head, parent). The baselines produce the same bytes -- the encoded
AppendCheckpoint command -- with raw confluent-kafka: C writers each awaiting
their ack (the closed loop a request/response path is compared with), and one
pipelined writer (the ceiling). `--external` runs the decider in a separate
`threadlog worker` process instead of inside the benchmark's client.
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
    PROPOSALS_LINGER_MS,
    CpuMeter,
    Result,
    bench_args,
    bootstrap_or_local,
    broker_pids,
    closed_loop,
    delete_namespace,
    delete_topic,
    judge_line,
    raw_produce_closed_loop,
    raw_produce_pipelined,
    report,
    temp_topic,
)
from threadlog.schemas import default_codec
from workers import Worker, split

import threadlog
from threadlog.kernel.checkpoint_rules import to_wire


def make_checkpoint(cid: str, thread: str, parent: str | None, n: int, files: int, conv_bytes: int) -> dict:
    return {
        "id": cid,
        "threadId": thread,
        "parentCheckpointId": parent,
        "createdAt": n,
        "reason": "automatic",
        "files": [{"path": f"src/file-{i}.py", "kind": "file",
                   "blobKey": f"sandbox-files/sha256/{(i * 7919 + n) % 16**8:064x}", "size": 100 + i}
                  for i in range(files)],
        "conversation": [{"role": "user", "content": "x" * max(1, conv_bytes - 30)}],
        "artifacts": [],
    }


async def appends(tl, total: int, threads: int, callers: int, files: int, conv_bytes: int, tag: str) -> Result:
    per_caller = total // callers
    owned = [[f"{tag}-thread-{t}" for t in range(threads) if t % callers == c] for c in range(callers)]
    leases = {}
    for group in owned:
        for t in group:
            leases[t] = await tl.checkpoints.acquire_writer(t)
    latencies: list[float] = []

    async def caller(c: int) -> None:
        heads: dict[str, str | None] = dict.fromkeys(owned[c])
        for i in range(per_caller):
            t = owned[c][i % len(owned[c])]
            cid = f"{t}/{i}"
            cp = make_checkpoint(cid, t, heads[t], i, files, conv_bytes)
            start = time.perf_counter()
            heads[t] = await tl.checkpoints.append(checkpoint=cp, expected_head_id=heads[t], writer=leases[t])
            latencies.append(time.perf_counter() - start)

    t0 = time.perf_counter()
    await asyncio.gather(*[caller(c) for c in range(callers)])
    n = per_caller * callers
    return Result(f"checkpoint append (CAS), {callers} callers", n, time.perf_counter() - t0, 0, latencies)


async def save_threads(tl, size: int, total: int, threads: int, callers: int) -> Result:
    transcript = [{"role": "user", "content": "x" * max(1, size - 30)}]
    return await closed_loop(f"save_thread (same bytes), {callers} callers", callers, total // callers,
                             lambda c, i: tl.messages.save_thread(f"save-thread-{(c + i * callers) % threads}",
                                                                  transcript))


async def main() -> None:
    ap = bench_args(__doc__)
    ap.add_argument("--count", type=int, default=4000, help="appends measured")
    ap.add_argument("--threads", type=int, default=64)
    ap.add_argument("--clients", type=int, default=16, help="concurrent callers")
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--files", type=int, default=8, help="file entries per checkpoint")
    ap.add_argument("--conversation-bytes", type=int, default=512)
    ap.add_argument("--external", action="store_true", help="a thin client; judges in `threadlog worker` processes")
    ap.add_argument("--workers", type=int, default=1, help="worker processes with --external (they split partitions)")
    args = ap.parse_args()
    bootstrap = bootstrap_or_local(args.bootstrap)

    sample = make_checkpoint("thread-0/0", "thread-0", None, 0, args.files, args.conversation_bytes)
    payload = default_codec().encode("threadlog.cmd.AppendCheckpoint", {
        "checkpoint": to_wire(sample), "expectedHeadId": None,
        "writer": {"threadId": "thread-0", "ownerToken": str(uuid.uuid4()), "fence": 1}})

    topic = temp_topic(bootstrap, args.partitions)
    ns = f"bench-cp-{uuid.uuid4().hex[:6]}"
    workers: list[Worker] = []
    try:
        rawc = await raw_produce_closed_loop(bootstrap, topic, payload, args.count, args.clients, args.partitions,
                                             linger_ms=PROPOSALS_LINGER_MS)
        pipe = raw_produce_pipelined(bootstrap, topic, payload, args.count * 5, args.partitions)
        with tempfile.TemporaryDirectory() as state:
            try:
                if args.external:
                    workers = [Worker(bootstrap, ns, f"{state}/worker-{n}", f"w{n}", partitions=args.partitions)
                               for n in range(args.workers)]
                    print(f"workers own {await split(workers, partitions=args.partitions)}")
                async with threadlog.open(bootstrap, namespace=ns, state_dir=f"{state}/client",
                                          partitions=args.partitions,
                                          processors="external" if args.external else "embedded") as tl:
                    await appends(tl, args.clients * 20, args.threads, args.clients, args.files,
                                  args.conversation_bytes, "warmup")
                    meter = CpuMeter({"client": [os.getpid()], "worker": [w.proc.pid for w in workers],
                                      "broker": broker_pids()}).start()
                    res = await appends(tl, args.count, args.threads, args.clients, args.files,
                                        args.conversation_bytes, "measured")
                    meter.stop()
                    # The engine's simplest command (a transcript save, same bytes) in the same run:
                    # what any decided command costs here, whatever it decides.
                    save_meter = CpuMeter(meter.processes).start()
                    save = await save_threads(tl, len(payload), args.count, args.threads, args.clients)
                    save_meter.stop()
                    # A thin client has no judge (its worker judges).
                    stats = dict(tl.runtime.judge.stats) if tl.runtime.judge is not None else {}
                    learned = tl.session.bus.verdicts
                    if args.external:
                        print(f"verdicts learned by this thin client: {learned.pushed} pushed by the judge, "
                              f"{learned.asked} asked for")
                    if len(workers) > 1:
                        wstats = [await w.stats() for w in workers]
                        asked = sum(st["lookups"] for st in wstats)
                        blocked = sum(st.get("blocked", 0) for st in wstats)
                        n = res.count + args.clients * 20
                        requests = sum(st.get("lookup_requests", 0) for st in wstats)
                        print(f"per checkpoint append (warm-up included): {asked / n:.2f} questions asked of the "
                              f"other worker in {requests / n:.2f} requests, {blocked / n:.2f} decisions that "
                              f"waited for an answer")
                        ahead = sum(st.get("holders", {}).get("ahead", 0) for st in wstats)
                        print(f"questions answered before the partition asked about was judged that far: "
                              f"{ahead} of {asked}")
            finally:
                for w in workers:
                    w.stop()
        mode = (f"thin client, {args.workers} worker process(es) judging" if args.external
                else "judge embedded in the client")
        print(f"\nbroker {bootstrap}; command payload {len(payload)} B ({args.files} files, "
              f"{args.conversation_bytes} B conversation); {args.threads} threads; {args.partitions} partitions; "
              f"{mode}\n")
        report([(rawc, None), (pipe, None), (res, rawc), (save, rawc)])
        print(f"\nratio = rate / raw closed-loop produce rate at {args.clients} awaiting writers; "
              f"appends vs pipelined: {res.rate / pipe.rate:.3f}; appends vs save_thread: {res.rate / save.rate:.2f}")
        print(meter.line(res.count, res.seconds))
        print("save_thread " + save_meter.line(save.count, save.seconds))
        if stats:
            print(judge_line(stats))
    finally:
        delete_topic(bootstrap, topic)
        delete_namespace(bootstrap, ns)


if __name__ == "__main__":
    asyncio.run(main())
