"""CPU per judged proposal, without a broker: the judging fold alone, deterministic.

    .venv/bin/python bench/judge_cpu.py [--appends N] [--batch 16] [--files 8] [--profile]

The same checkpoint appends as `checkpoints_bench.py` (64 threads, a writer
lease each, 8 file entries, 512 B of conversation, head CAS with `seen`
naming every partition), encoded as real proposals and judged by
`processors.judge.judge_record` into a real RocksDB store in batches (one
`Store.apply` per batch, as a judge applies a fetched batch). It prints CPU
microseconds per proposal: the part of a decision's cost that no broker,
network or other thread blurs, so changes to the judging path can be compared
on a busy machine. `--profile` prints the top functions (cProfile).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from checkpoints_bench import make_checkpoint
from threadlog.processors.handlers import load_all as load_handlers
from threadlog.processors.judge import Record, judge_record
from threadlog.projections.fold import load_all as load_folds
from threadlog.projections.store import Store
from threadlog.projections.view import View
from threadlog.schemas import default_codec

from threadlog.kernel.checkpoint_rules import to_wire
from threadlog.kernel.partitioning import partition_for

PARTITIONS = 4
BROKER_MS = 1_700_000_000_000


def build(appends: int, threads: int, files: int, conv_bytes: int) -> tuple[list[Record], list[Record]]:
    """(lease acquisitions, checkpoint appends) as encoded proposals, in log order."""
    codec = default_codec()
    ends = dict.fromkeys(range(PARTITIONS), 0)
    n = [0]

    def propose(type_name: str, key: str, payload: dict, seen: bool) -> Record:
        p = partition_for(key, PARTITIONS)
        n[0] += 1
        env = {"proposalId": f"bench-{n[0]}", "key": key, "type": type_name, "at": 1_000.0 + n[0], "rules": 3,
               "seen": [ends[q] for q in range(PARTITIONS)] if seen else [],
               "payload": codec.encode(type_name, payload)}
        rec = Record(p, ends[p], codec.encode("threadlog.Proposal", env), BROKER_MS)
        ends[p] += 1
        return rec

    names = [f"thread-{t}" for t in range(threads)]
    tokens = {t: f"owner-token-of-{t}-0123456789" for t in names}
    leases = [propose("threadlog.cmd.AcquireCheckpointWriter", t,
                      {"threadId": t, "ownerToken": tokens[t], "leaseDurationMs": 600_000, "renewAfterMs": 1},
                      False) for t in names]
    heads: dict[str, str | None] = dict.fromkeys(names)
    out = []
    for i in range(appends):
        t = names[i % threads]
        cid = f"{t}/{i}"
        cp = make_checkpoint(cid, t, heads[t], i, files, conv_bytes)
        out.append(propose("threadlog.cmd.AppendCheckpoint", t, {
            "checkpoint": to_wire(cp), "expectedHeadId": heads[t],
            "writer": {"threadId": t, "ownerToken": tokens[t], "fence": 1}}, True))
        heads[t] = cid
    return leases, out


def judge(store: Store, records: list[Record], batch: int, progress: dict[int, int]) -> list[dict]:
    codec = default_codec()
    verdicts = []
    for start in range(0, len(records), batch):
        view = View(store)
        for rec in records[start:start + batch]:
            verdicts.append(judge_record(view, rec, codec=codec, partitions=PARTITIONS, progress=progress))
            progress[rec.partition] = rec.offset + 1
        store.apply(view.buffer, {})
    return verdicts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--appends", type=int, default=4000)
    ap.add_argument("--threads", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16, help="proposals per applied batch")
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--conversation-bytes", type=int, default=512)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--sort", default="tottime", help="cProfile sort key with --profile (tottime, cumulative)")
    args = ap.parse_args()
    load_handlers()
    load_folds()
    leases, appends = build(args.appends, args.threads, args.files, args.conversation_bytes)
    with tempfile.TemporaryDirectory() as d:
        store = Store(Path(d) / "state")
        try:
            progress = dict.fromkeys(range(PARTITIONS), 0)
            granted = judge(store, leases, args.batch, progress)
            assert all(v["ok"] for v in granted), granted[:3]
            prof = cProfile.Profile() if args.profile else None
            c0, w0 = time.process_time(), time.perf_counter()
            if prof is not None:
                prof.enable()
            verdicts = judge(store, appends, args.batch, progress)
            if prof is not None:
                prof.disable()
            cpu, wall = time.process_time() - c0, time.perf_counter() - w0
        finally:
            store.close()
    refused = [v for v in verdicts if not v["ok"]]
    assert not refused, refused[:3]  # every append is a valid CAS: a refusal is a bug here
    print(f"{len(appends)} checkpoint appends judged ({args.files} files, batches of {args.batch}): "
          f"{cpu / len(appends) * 1e6:.0f} us CPU per proposal ({len(appends) / wall:.0f}/s on one thread)")
    if prof is not None:
        pstats.Stats(prof).sort_stats(args.sort).print_stats(30)


if __name__ == "__main__":
    main()
