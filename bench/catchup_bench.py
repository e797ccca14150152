"""A fresh embedded client's first read after N checkpoint appends of history: the judge's catch-up.

    .venv/bin/python bench/catchup_bench.py [--bootstrap B] [--appends 4000]

Writes `--appends` checkpoint appends (the shapes of checkpoints_bench.py: 64
threads, 8 file entries, 512 B of conversation) with one client, then opens a
second embedded client with empty state and times its first `get_head`: that
read waits until its judge has folded the whole history, in fetched batches of
up to 2000 records. (Before the view kept its buffered keys sorted, a batch was
quadratic: 4000 appends took 150 s here; see docs/measurements.md.)
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from checkpoints_bench import appends
from common import bootstrap_or_local, delete_namespace

import threadlog


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bootstrap", default=None)
    ap.add_argument("--appends", type=int, default=4000)
    args = ap.parse_args()
    bootstrap = bootstrap_or_local(args.bootstrap)
    ns = f"bench-catchup-{uuid.uuid4().hex[:6]}"
    try:
        with tempfile.TemporaryDirectory() as state:
            async with threadlog.open(bootstrap, namespace=ns, state_dir=f"{state}/writer", partitions=4) as tl:
                wrote = await appends(tl, args.appends, 64, 16, 8, 512, "hist")
            t0 = time.perf_counter()
            async with threadlog.open(bootstrap, namespace=ns, state_dir=f"{state}/fresh", partitions=4) as tl:
                opened = time.perf_counter() - t0
                head = await tl.checkpoints.get_head("hist-thread-0")
                first = time.perf_counter() - t0
        assert head is not None
        print(f"history: {wrote.count} checkpoint appends (+64 writer leases), written at {wrote.rate:.0f}/s")
        print(f"fresh embedded client: open {opened:.1f} s, first read {first:.1f} s after open began "
              f"(every proposal judged by then) = {first / (wrote.count + 64) * 1e3:.2f} ms per proposal")
    finally:
        delete_namespace(bootstrap, ns)


if __name__ == "__main__":
    asyncio.run(main())
