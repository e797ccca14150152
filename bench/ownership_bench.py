"""State owned by partition: two workers split a namespace, then one is SIGKILLed under load.

    .venv/bin/python bench/ownership_bench.py [--bootstrap B] [--history 100000] [--callers 8]

1. A namespace with H proposals of history (written raw, like bench/thin_bench.py).
   Two `threadlog worker` processes start; each judges only the partitions the
   group gave it: printed, records judged per worker (they sum to H, not 2H).
2. Load: C thin-client callers saving transcripts on threads of every partition.
   The worker that owns the most partitions is SIGKILLed; the survivor takes
   them over. Printed: time from the kill until every partition answers a read
   again, how the survivor restored the partitions it took (from the state
   snapshots on `<ns>.snapshots`: bytes read and seconds, vs the bytes of
   history of those partitions), and the longest stall a writer saw.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import bench_args, bootstrap_or_local, delete_namespace
from thin_bench import PARTITIONS, THREADS, write_history
from workers import Worker, split

import threadlog
from threadlog.kernel.partitioning import partition_for


def thread_on(p: int, n: int) -> str:
    found = 0
    i = 0
    while True:
        t = f"load-{i}"
        if partition_for(t, PARTITIONS) == p:
            if found == n:
                return t
            found += 1
        i += 1


async def main() -> None:
    ap = bench_args(__doc__ or "")
    ap.add_argument("--history", type=int, default=100_000)
    ap.add_argument("--callers", type=int, default=8)
    args = ap.parse_args()
    bootstrap = bootstrap_or_local(args.bootstrap)
    ns = f"bench-own-{uuid.uuid4().hex[:6]}"
    with tempfile.TemporaryDirectory() as state:
        workers: list[Worker] = []
        try:
            async with threadlog.open(bootstrap, namespace=ns, state_dir=f"{state}/init", partitions=PARTITIONS):
                pass
            t0 = time.perf_counter()
            history_bytes = write_history(bootstrap, ns, 0, args.history)
            print(f"history: {args.history} proposals, {sum(history_bytes.values()) / 2**20:.1f} MiB "
                  f"over {THREADS} threads, written in {time.perf_counter() - t0:.1f}s", flush=True)
            workers = [Worker(bootstrap, ns, f"{state}/w{n}", f"w{n}", "--snapshot-every", "10000",
                              "--snapshot-interval", "5") for n in (1, 2)]
            owned = await split(workers)
            async with threadlog.open(bootstrap, namespace=ns, state_dir=f"{state}/thin", processors="external",
                                      partitions=PARTITIONS, request_timeout_ms=120_000) as tl:
                t0 = time.perf_counter()
                await tl.read_barrier(None)  # both workers caught up with the history
                print(f"two workers caught up in {time.perf_counter() - t0:.1f}s", flush=True)
                for w in workers:
                    st = await w.stats()
                    print(f"  {w.name} owns {st['owned']}: judged {st['judged']} records", flush=True)
                total = sum([(await w.stats())["judged"] for w in workers])
                # Above the history when the second worker restored partitions from a snapshot older
                # than what the first had judged of them before the rebalance moved them (judged again).
                print(f"  together {total} records judged for {args.history} in the log "
                      f"({total - args.history} judged twice across the hand-over)", flush=True)

                # Load on every partition, then kill the bigger owner.
                victim = max(workers, key=lambda w: len(owned[w.name]))
                survivor = next(w for w in workers if w is not victim)
                moved = owned[victim.name]
                threads = [thread_on(p, n) for p in range(PARTITIONS) for n in range(args.callers // PARTITIONS or 1)]
                stop = asyncio.Event()
                stalls: list[float] = []
                counts = [0]

                async def caller(t: str) -> None:
                    n = 0
                    while not stop.is_set():
                        n += 1
                        s = time.perf_counter()
                        await tl.messages.save_thread(t, [n])
                        stalls.append(time.perf_counter() - s)
                        counts[0] += 1

                tasks = [asyncio.ensure_future(caller(t)) for t in threads]
                await asyncio.sleep(3)  # a measured stretch of load before the kill
                before = counts[0]
                print(f"load: {before / 3:.0f} saves/s over {len(threads)} callers; killing {victim.name} "
                      f"(owns {moved})", flush=True)
                killed_at = time.perf_counter()
                victim.proc.send_signal(signal.SIGKILL)
                victim.proc.wait(10)
                await split([survivor], timeout=120)
                owned_at = time.perf_counter() - killed_at
                # Every partition answers a read again (through the survivor).
                await asyncio.gather(*(tl.messages.load_thread(thread_on(p, 0)) for p in moved))
                served_at = time.perf_counter() - killed_at
                await asyncio.sleep(2)
                stop.set()
                await asyncio.gather(*tasks)
                st = await survivor.stats()
                print(f"\n{survivor.name} owned every partition {owned_at:.2f}s after the kill; partitions {moved} "
                      f"answered reads {served_at:.2f}s after it", flush=True)
                moved_history = sum(history_bytes.get(p, 0) for p in moved)
                for p in moved:
                    info = st["restored"].get(str(p))
                    print(f"  partition {p}: history {history_bytes.get(p, 0) / 2**20:.2f} MiB; restored: {info}",
                          flush=True)
                print(f"  history of the moved partitions: {moved_history / 2**20:.2f} MiB", flush=True)
                print(f"  longest writer stall {max(stalls):.2f}s; {counts[0]} saves acknowledged", flush=True)
        finally:
            for w in workers:
                w.stop()
            delete_namespace(bootstrap, ns)


if __name__ == "__main__":
    asyncio.run(main())
