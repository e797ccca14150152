"""Faults with real processes on a real broker, on the Core v2 model.

A proposal is judged by whoever folds its partition; nothing is decided in a
transaction that a crash could leave open. So the faults that matter are:

- a **writer killed** (SIGKILL) with appends in flight: every proposal it
  wrote is judged all the same; every acknowledged append is there exactly
  once, whole; nothing it never wrote appears; chains and blob references
  stay consistent;
- a **judge killed** mid-stream and restarted on its state: it resumes at its
  stored position and reaches the verdicts every other judge reached (a fold
  applied twice would show in the reference counts and the sequence numbers);
- a **frozen judge** (SIGSTOP, a zombie) resumed long after: it computes the
  same verdicts as everyone else and writes nothing, so it is harmless.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

from append_writer import body
from checkpoint_helpers import checkpoint
from support import until, within
from threadlog.processors.judge import all_verdicts
from threadlog.projections.fold import current_seq
from threadlog.projections.partition_stores import PartitionStores
from worker_support import WorkerProcess

from threadlog.kernel.checkpoint_rules import blob_keys, normalized

HERE = Path(__file__).resolve().parent


class WriterProcess:
    """tests/append_writer.py: streams appends, prints ACK/FAIL lines."""

    def __init__(self, bootstrap: str, namespace: str, state_dir: Path, threads: list[str]) -> None:
        self.cmd = [sys.executable, str(HERE / "append_writer.py"), bootstrap, namespace, str(state_dir), *threads]
        self.proc: asyncio.subprocess.Process | None = None
        self.acked: list[str] = []
        self.failed: list[str] = []
        self.ready = asyncio.Event()
        self._reader: asyncio.Task | None = None

    async def start(self) -> None:
        env = dict(os.environ, PYTHONPATH=str(HERE))
        self.proc = await asyncio.create_subprocess_exec(*self.cmd, stdout=asyncio.subprocess.PIPE,
                                                         stderr=asyncio.subprocess.DEVNULL, env=env)
        self._reader = asyncio.create_task(self._read())
        await within(self.ready.wait(), 60)

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            word, _, rest = line.decode().strip().partition(" ")
            if word == "ACK":
                self.acked.append(rest)
            elif word == "FAIL":
                self.failed.append(rest.split(" ")[0])
            elif word == "READY":
                self.ready.set()

    async def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        await within(self.proc.wait(), 10)
        assert self._reader is not None
        await within(self._reader, 10)


def worker_verdicts(state_dir: Path, namespace: str, partitions: int) -> dict[int, list]:
    store = PartitionStores(state_dir / namespace / "slot-0", f"{namespace}.events")
    for p in range(partitions):
        if store.has_local(p):
            store.open(p)
    try:
        return {p: all_verdicts(store, p) for p in range(partitions)}
    finally:
        store.close()


async def test_writer_and_judge_killed_mid_stream_lose_nothing_and_agree(bootstrap, namespace, tmp_path,
                                                                      open_client):
    threads = [f"stream-{n}" for n in range(6)]
    judge_dir = tmp_path / "judge"
    judge = WorkerProcess(bootstrap, namespace, judge_dir, "judge-1")
    restarted = WorkerProcess(bootstrap, namespace, judge_dir, "judge-1")
    writer = WriterProcess(bootstrap, namespace, tmp_path / "writer", threads)
    try:
        await judge.start()
        await writer.start()
        await until(lambda: len(writer.acked) >= 30, 60)
        judge.signal(signal.SIGKILL)  # a judge dies mid-stream...
        assert await judge.wait_exit(10) == -signal.SIGKILL
        await until(lambda: len(writer.acked) >= 60, 60)
        await restarted.start()  # ...and resumes on its own store
        await until(lambda: len(writer.acked) >= 90, 60)
        await writer.kill()  # the writer dies with appends in flight
        acked = set(writer.acked)

        tl = await open_client()  # a fresh host judges the whole log itself
        present: dict[str, dict] = {}
        for t in threads:
            listed = await within(tl.checkpoints.list(t))
            ids = [c["id"] for c in listed]
            assert len(ids) == len(set(ids))
            for c in listed:
                n = int(c["id"].split("/")[1])
                assert c == normalized(body(c["id"], t, c["parentCheckpointId"], n)), c["id"]
                present[c["id"]] = c
            assert [c["parentCheckpointId"] for c in listed] == [None, *ids[:-1]]
            assert await within(tl.checkpoints.get_head(t)) == (ids[-1] if ids else None)
            # One accepted effect per grant and per append on this thread: no fold twice.
            assert current_seq(tl.runtime.store, t) == 1 + len(ids)
        assert acked <= set(present)
        # Beyond the acknowledged, only what was in flight at the kill (one per thread) can be there.
        assert len(set(present) - acked - set(writer.failed)) <= len(threads)
        expected_refs: dict[str, int] = {}
        for c in present.values():
            for key in blob_keys(c):
                expected_refs[key] = expected_refs.get(key, 0) + 1
        assert await within(tl.checkpoints.list_blob_references()) == [
            {"key": k, "references": v} for k, v in sorted(expected_refs.items())]

        # The restarted judge caught up and agrees with the fresh host, verdict by verdict.
        partitions = tl.runtime.layout.events
        await tl.read_barrier(None)
        # Through the worker: answered once it owns every partition and judged past the end.
        await within((await open_client(processors="external", own_worker=True)).read_barrier(None), 60)
        await restarted.stop()
        theirs = worker_verdicts(judge_dir, namespace, partitions)
        ours = {p: all_verdicts(tl.runtime.store, p) for p in range(partitions)}
        for p in range(partitions):
            # It may have stopped a little short of the end: what it judged, it judged alike.
            assert theirs[p] == ours[p][:len(theirs[p])]
        assert sum(len(v) for v in theirs.values()) >= 90
    finally:
        if writer.proc is not None and writer.proc.returncode is None:
            await writer.kill()
        await judge.stop()
        await restarted.stop()


async def test_a_frozen_judge_resumed_later_is_harmless_and_agrees(bootstrap, namespace, tmp_path, open_client):
    zombie_dir = tmp_path / "zombie"
    zombie = WorkerProcess(bootstrap, namespace, zombie_dir, "zombie")
    try:
        await zombie.start()
        tl = await open_client()
        lease = await within(tl.checkpoints.acquire_writer("t"))
        zombie.signal(signal.SIGSTOP)
        # While it is frozen, life goes on: writes are judged by the log's other judges.
        head = None
        for n in range(10):
            head = await within(tl.checkpoints.append(checkpoint=checkpoint(f"c{n}", "t", head),
                                                      expected_head_id=head, writer=lease))
        racing = await asyncio.gather(*[tl.checkpoints.acquire_writer("u") for _ in range(5)],
                                      return_exceptions=True)
        assert sum(not isinstance(r, BaseException) for r in racing) == 1
        zombie.signal(signal.SIGCONT)
        partitions = tl.runtime.layout.events
        await tl.read_barrier(None)
        # Stop it (it finishes judging what it fetched) and compare every verdict it reached.
        await zombie.stop()
        theirs = worker_verdicts(zombie_dir, namespace, partitions)
        ours = {p: all_verdicts(tl.runtime.store, p) for p in range(partitions)}
        for p in range(partitions):
            assert theirs[p] == ours[p][:len(theirs[p])]
        assert await within(tl.checkpoints.get_head("t")) == "c9"
    finally:
        await zombie.stop()
