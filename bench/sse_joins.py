"""Idle SSE joins against a `threadlog serve` process: its threads, fds and hydration latency.

    THREADLOG_BOOTSTRAP=B .venv/bin/python bench/sse_joins.py [--joins 500]

The issue's measurement: every catch-up read opened its own Kafka consumer, so
500 idle joins took the server to 2,040 threads and 4,500 fds and stalled
hydration for up to 10.8 s. Prints the server's peak threads and fds (from
/proc/<pid>) and the worst hydration latency while the joins come in and stay,
beside the worst `/healthz` (no Kafka, no store: the event loop's own delay).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
import uuid

import httpx

import threadlog


def proc_count(pid: int, what: str) -> int:
    return len(os.listdir(f"/proc/{pid}/{what}"))


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--joins", type=int, default=500)
    ap.add_argument("--runs", type=int, default=50)
    args = ap.parse_args()
    bootstrap = os.environ.get("THREADLOG_BOOTSTRAP", "127.0.0.1:9092")
    ns = f"bench-sse-{uuid.uuid4().hex[:8]}"
    state = tempfile.mkdtemp(prefix="sse-joins-")
    async with threadlog.open(bootstrap, namespace=ns, partitions=4, state_dir=state) as tl:
        runs = [f"run-{i}" for i in range(args.runs)]
        for run in runs:
            await tl.delivery(run).append([{"type": "TEXT_MESSAGE_CONTENT", "delta": "x"}])
        await tl.messages.save_thread("t", [{"role": "user", "content": "hi"}])
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "threadlog", "serve", "--bootstrap", bootstrap, "--namespace", ns,
            "--port", "0", "--state-dir", state + "/serve", "--no-access-log",
            "--max-streams", str(args.joins + 10), stdout=asyncio.subprocess.PIPE)
        try:
            assert proc.stdout is not None
            line = (await asyncio.wait_for(proc.stdout.readline(), 120)).decode()
            base = line.split(" at ", 1)[1].strip().removesuffix("/api/chat")
            async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=args.joins + 10)) as many, \
                    httpx.AsyncClient(timeout=60) as probe:
                await probe.get(f"{base}/threads/t")
                threads0, fds0 = proc_count(proc.pid, "task"), proc_count(proc.pid, "fd")
                peak = [threads0, fds0]
                joined = 0
                release = asyncio.Event()

                async def join(i: int) -> None:
                    nonlocal joined
                    async with many.stream("GET", f"{base}/runs/{runs[i % len(runs)]}/stream") as r:
                        async for _ in r.aiter_lines():
                            break
                        joined += 1
                        await release.wait()

                started = time.monotonic()
                tasks = [asyncio.ensure_future(join(i)) for i in range(args.joins)]
                worst = worst_health = 0.0
                while joined < args.joins and time.monotonic() - started < 300:
                    t0 = time.monotonic()
                    r = await probe.get(f"{base}/threads/t")
                    assert r.status_code == 200
                    worst = max(worst, time.monotonic() - t0)
                    t0 = time.monotonic()
                    assert (await probe.get(f"{base}/healthz")).status_code == 200
                    worst_health = max(worst_health, time.monotonic() - t0)
                    peak = [max(peak[0], proc_count(proc.pid, "task")), max(peak[1], proc_count(proc.pid, "fd"))]
                    await asyncio.sleep(0.05)
                took = time.monotonic() - started
                release.set()
                await asyncio.gather(*tasks, return_exceptions=True)
            print(f"{joined}/{args.joins} idle joins in {took:.1f}s; server threads {threads0} -> {peak[0]}, "
                  f"fds {fds0} -> {peak[1]}; hydration worst {worst * 1000:.0f} ms, "
                  f"/healthz worst {worst_health * 1000:.0f} ms")
        finally:
            proc.terminate()
            await proc.wait()
    from threadlog.cli import _delete_namespace

    _delete_namespace(bootstrap, ns, {}, 30.0)


if __name__ == "__main__":
    asyncio.run(main())
