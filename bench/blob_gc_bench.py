"""How long a blob GC sweep takes: a dry run, then a sweep deleting N unreferenced blobs (of M in all).

    .venv/bin/python bench/blob_gc_bench.py [--bootstrap B] [--blobs 500] [--referenced 100] [--kib 4]

One embedded client in a fresh namespace puts M blobs of K KiB, references
`--referenced` of them from checkpoints, then times `tl.blobs.gc(grace_ms=0,
dry_run=True)` and `tl.blobs.gc(grace_ms=0)`. Prints blobs/s deleted and what
the reports say.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import bench_args, bootstrap_or_local, delete_namespace

import threadlog


async def main() -> None:
    p = bench_args(__doc__ or "")
    p.add_argument("--blobs", type=int, default=500)
    p.add_argument("--referenced", type=int, default=100)
    p.add_argument("--kib", type=int, default=4)
    args = p.parse_args()
    bootstrap = bootstrap_or_local(args.bootstrap)
    ns = f"bench-gc-{uuid.uuid4().hex[:8]}"
    body = b"x" * (args.kib * 1024)
    keys = [f"sandbox-files/sha256/{i:064x}" for i in range(args.blobs)]
    try:
        with tempfile.TemporaryDirectory() as state:
            async with threadlog.open(bootstrap, namespace=ns, state_dir=state) as tl:
                sem = asyncio.Semaphore(32)

                async def put(k: str) -> None:
                    async with sem:
                        await tl.blobs.put(k, body)

                await asyncio.gather(*(put(k) for k in keys))
                lease = await tl.checkpoints.acquire_writer("bench")
                head = None
                for i in range(0, args.referenced, 50):
                    files = [{"path": f"f{j}", "kind": "file", "blobKey": keys[j], "size": len(body)}
                             for j in range(i, min(i + 50, args.referenced))]
                    cp = {"id": f"c{i}", "threadId": "bench", "parentCheckpointId": head, "createdAt": i,
                          "reason": "automatic", "files": files, "conversation": [], "artifacts": []}
                    head = await tl.checkpoints.append(checkpoint=cp, expected_head_id=head, writer=lease)
                t0 = time.perf_counter()
                dry = await tl.blobs.gc(grace_ms=0, dry_run=True)
                t1 = time.perf_counter()
                rep = await tl.blobs.gc(grace_ms=0)
                t2 = time.perf_counter()
                print(f"{args.blobs} blobs of {args.kib} KiB, {args.referenced} referenced")
                print(f"dry run: {t1 - t0:.2f} s (candidates {dry.candidates})")
                print(f"sweep:   {t2 - t1:.2f} s, deleted {rep.deleted} ({rep.deleted / (t2 - t1):.0f} blobs/s), "
                      f"{rep.bytes_reclaimed} bytes, kept {rep.kept}")
    finally:
        delete_namespace(bootstrap, ns)


if __name__ == "__main__":
    asyncio.run(main())
