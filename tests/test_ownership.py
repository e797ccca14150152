"""State owned by partition: workers in a group, each judging only its partitions.

`threadlog worker` processes of a namespace form the consumer group
`<ns>.judges`; each judges the partitions Kafka gives it, keeps their state,
serves their reads and verdicts. Thin clients route each call to the owner of
the partition it concerns. Tried here, on a real broker and real processes:
two workers split the partitions and each judges only its own; rules spanning
partitions (a checkpoint id unique over every thread) hold when the partitions
have different owners; ownership moving under load -- a worker joining, a
worker SIGKILLed -- loses no acknowledged write, never lets a read go back to
an older state, and clients carry on by themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import signal
import threading
import time

import orjson
import pytest
from checkpoint_helpers import checkpoint
from confluent_kafka import Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from replay_support import replayed_verdicts
from support import read_topic, until, within
from threadlog.processors.judge import all_verdicts
from threadlog.projections.snapshots import MANIFEST_KEY, parse_chunk_key
from worker_support import WorkerProcess, ask_worker, owned_by

from threadlog.config import Options
from threadlog.kernel.errors import DUPLICATE_ID, OUTCOME_UNKNOWN, ThreadLogError
from threadlog.kernel.partitioning import partition_for
from threadlog.metrics import Readiness
from threadlog.runtime import Runtime


def thread_on(partitions: set[int] | list[int], total: int, prefix: str, skip: int = 0) -> str:
    n = 0
    found = 0
    while True:
        t = f"{prefix}-{n}"
        if partition_for(t, total) in partitions:
            if found == skip:
                return t
            found += 1
        n += 1


@contextlib.asynccontextmanager
async def _two_workers(bootstrap, namespace, tmp_path, open_client):
    """Workers w1 and w2 splitting the partitions, a thin client: (w1, w2, thin, partitions, owned)."""
    w1 = await WorkerProcess(bootstrap, namespace, tmp_path / "w1", "w1").start()
    w2 = await WorkerProcess(bootstrap, namespace, tmp_path / "w2", "w2").start()
    try:
        thin = await open_client(processors="external", own_worker=True)
        total = thin.runtime.layout.events
        yield w1, w2, thin, total, await owned_by([w1, w2], total)
    finally:
        await w1.stop()
        await w2.stop()


async def test_two_workers_split_the_partitions_and_judge_only_their_own(bootstrap, namespace, tmp_path,
                                                                         open_client):
    async with _two_workers(bootstrap, namespace, tmp_path, open_client) as (w1, w2, thin, total, owned):
        assert set(owned["w1"]).isdisjoint(owned["w2"])
        threads = [f"split-{n}" for n in range(24)]
        await within(asyncio.gather(*(thin.messages.save_thread(t, [t]) for t in threads)), 60)
        assert await within(asyncio.gather(*(thin.messages.load_thread(t) for t in threads))) == [[t] for t in threads]
        stats = {w.name: await ask_worker(w.address, "stats") for w in (w1, w2)}
        for name, st in stats.items():
            # Each judged the records of its own partitions, and only those -- besides
            # the rules floor markers (each partition's first record) of partitions it
            # held before the other worker joined (one taken from the other since is
            # restored from the snapshot written as it was given up: marker judged).
            mine = [t for t in threads if partition_for(t, total) in st["owned"]]
            assert len(mine) <= st["judged"] <= len(mine) + total, (name, st)
            print(f"{name} owns {st['owned']} and judged {st['judged']} of {len(threads)} records")

        # A checkpoint id is unique over every thread, also across owners: the
        # judge of the second thread asks the owner of the first.
        t1 = thread_on(owned["w1"], total, "dup")
        t2 = thread_on(owned["w2"], total, "dup")
        lease1 = await within(thin.checkpoints.acquire_writer(t1))
        lease2 = await within(thin.checkpoints.acquire_writer(t2))
        await within(thin.checkpoints.append(checkpoint=checkpoint("shared-id", t1), expected_head_id=None,
                                             writer=lease1))
        try:
            await within(thin.checkpoints.append(checkpoint=checkpoint("shared-id", t2), expected_head_id=None,
                                                 writer=lease2))
        except ThreadLogError as exc:
            assert exc.code == DUPLICATE_ID
        else:
            raise AssertionError("a checkpoint id held on another owner's partition was accepted")
        assert (await ask_worker(w2.address, "stats"))["lookups"] + (await ask_worker(w1.address, "stats"))[
            "lookups"] >= 1
        # An embedded client judging everything itself reaches the same state.
        embedded = await open_client()
        for t in (t1, t2, *threads):
            assert await within(embedded.checkpoints.list(t)) == await within(thin.checkpoints.list(t))
            assert await within(embedded.messages.load_thread(t)) == await within(thin.messages.load_thread(t))


async def _chain(tl, thread: str, lease, ids: list[str]) -> list[str]:
    """Appends `ids` to `thread` one after the other, each on the head the last
    accepted one left; returns the outcome of each (the id, or the error code)."""
    head = None
    out = []
    for cid in ids:
        try:
            head = await within(tl.checkpoints.append(checkpoint=checkpoint(cid, thread, head),
                                                      expected_head_id=head, writer=lease), 60)
            out.append(head)
        except ThreadLogError as exc:
            out.append(exc.code)
    return out


async def test_ids_raced_across_two_owners_are_judged_as_a_judge_of_everything_judges_them(
        bootstrap, namespace, tmp_path, open_client):
    """Each worker answers the other's id questions, often before it has judged
    its partition as far as asked (processors/ahead.py): as soon as no fetched
    record in between can mark the id. Racing appends that share ids across
    the two owners' partitions, a head deletion releasing an id, and a re-use
    of it: every verdict of both workers equals the verdict of the judging
    step alone replaying the log and waiting for every position asked (and an
    embedded client's)."""
    async with _two_workers(bootstrap, namespace, tmp_path, open_client) as (w1, w2, thin, total, owned):
        threads = [thread_on(owned[name], total, f"race-{name}", k) for name in ("w1", "w2") for k in range(4)]
        leases = await within(asyncio.gather(*(thin.checkpoints.acquire_writer(t) for t in threads)))
        # Every 3rd id is shared by all 8 threads (racing first writes of one id
        # on both owners' partitions), the others are fresh.
        ids = {t: [f"shared-{i}" if i % 3 == 0 else f"{t}-{i}" for i in range(12)] for t in threads}
        outcomes = await within(asyncio.gather(*(_chain(thin, t, lease, ids[t])
                                                 for t, lease in zip(threads, leases, strict=True))), 120)
        for i in range(0, 12, 3):
            won = [t for t, out in zip(threads, outcomes, strict=True) if out[i] == f"shared-{i}"]
            assert won, f"shared-{i} accepted nowhere"
            assert all(out[i] in (f"shared-{i}", DUPLICATE_ID)
                       for out in outcomes), [out[i] for out in outcomes]
        # Acknowledged on one owner's thread, then refused on the other's.
        a, b = threads[0], threads[4]
        head_a = await within(thin.checkpoints.get_head(a))
        head_b = await within(thin.checkpoints.get_head(b))
        try:
            await within(thin.checkpoints.append(checkpoint=checkpoint(head_a, b, head_b), expected_head_id=head_b,
                                                 writer=leases[4]))
        except ThreadLogError as exc:
            assert exc.code == DUPLICATE_ID
        else:
            raise AssertionError("an id acknowledged on the other owner's partition was accepted")
        # Released by a head deletion (a record that may mark any id), then free again.
        await within(thin.checkpoints.delete_head(thread_id=a, checkpoint_id=head_a, writer=leases[0]))
        assert await within(thin.checkpoints.append(checkpoint=checkpoint(head_a, b, head_b),
                                                    expected_head_id=head_b, writer=leases[4])) == head_a
        # The race an early answer could get wrong: the record holding the id is in
        # the log but its owner (w1, stopped) has not even fetched it when the
        # other owner's question about it arrives. It must wait, then say "held".
        x, a2, b2 = "frozen-race", threads[1], threads[5]
        pa = partition_for(a2, total)
        heads = [await within(thin.checkpoints.get_head(t)) for t in (a2, b2)]
        before = (await within(thin.runtime.seen_offsets.end_offsets()))[pa]
        questions = (await ask_worker(w2.address, "stats"))["lookups"]

        w1.signal(signal.SIGSTOP)
        try:
            first = asyncio.ensure_future(thin.checkpoints.append(
                checkpoint=checkpoint(x, a2, heads[0]), expected_head_id=heads[0], writer=leases[1]))
            await until(lambda: _past(thin, pa, before), 30, "the first append reaching the log")
            second = asyncio.ensure_future(thin.checkpoints.append(
                checkpoint=checkpoint(x, b2, heads[1]), expected_head_id=heads[1], writer=leases[5]))

            async def asked() -> bool:
                return (await ask_worker(w2.address, "stats"))["lookups"] > questions

            await until(asked, 30, "w2 asking w1")
        finally:
            w1.signal(signal.SIGCONT)
        assert await within(first, 60) == x
        try:
            await within(second, 60)
        except ThreadLogError as exc:
            assert exc.code == DUPLICATE_ID
        else:
            raise AssertionError("an id in the log but not yet judged on the other owner's partition was accepted")
        stats = [await ask_worker(w.address, "stats") for w in (w1, w2)]
        asked = sum(st["holders"]["asked"] for st in stats)
        print(f"id questions answered for the other worker: {asked}, "
              f"before judging that far: {sum(st['holders']['ahead'] for st in stats)}")
        assert asked > 0
        # The judging step alone replays the log, waiting for every position asked;
        # an embedded client judges it too. Both agree with the workers, verdict by verdict.
        replayed = await asyncio.to_thread(replayed_verdicts, bootstrap, thin.runtime.topics.events, total,
                                           tmp_path / "replayed")
        embedded = await open_client()
        await within(embedded.read_barrier(None), 60)
        for w in (w1, w2):
            for p in owned[w.name]:
                mine = replayed[p]
                assert mine and all_verdicts(embedded.runtime.store, p) == mine, p
                got = await ask_worker(w.address, "verdicts", {"p": p, "os": [o for o, _ in mine]})
                assert got["verdicts"] == [v for _, v in mine], (w.name, p)
        refused = [v for vs in replayed.values() for _, v in vs if not v["ok"]]
        assert any(v["code"] == DUPLICATE_ID for v in refused), refused


async def _past(tl, p: int, offset: int) -> bool:
    return (await tl.runtime.seen_offsets.end_offsets())[p] > offset


async def _writer(tl, thread: str, acked: list[int], stop: asyncio.Event) -> None:
    """Saves version n+1 of its thread after version n is acknowledged; records acks."""
    n = 0
    while not stop.is_set():
        n += 1
        await within(tl.messages.save_thread(thread, [n]), 60)
        acked.append(n)


async def _reader(tl, threads: list[str], acked: dict[str, list[int]], stop: asyncio.Event,
                  problems: list[str]) -> int:
    """Reads every thread over and over: never older than what was acknowledged
    before the read began, never older than what this reader already saw."""
    seen = dict.fromkeys(threads, 0)
    reads = 0
    while not stop.is_set():
        for t in threads:
            floor = acked[t][-1] if acked[t] else 0
            got = await within(tl.messages.load_thread(t), 60)
            version = got[0] if got else 0
            if version < floor:
                problems.append(f"{t}: read {version} after {floor} was acknowledged")
            if version < seen[t]:
                problems.append(f"{t}: read {version} after reading {seen[t]}")
            seen[t] = max(seen[t], version)
            reads += 1
    return reads


async def test_ownership_moves_under_load_and_no_read_goes_back(bootstrap, namespace, tmp_path, open_client):
    w1 = await WorkerProcess(bootstrap, namespace, tmp_path / "w1", "w1").start()
    w2 = WorkerProcess(bootstrap, namespace, tmp_path / "w2", "w2")
    try:
        writer_tl = await open_client(processors="external", own_worker=True)
        reader_tl = await open_client(processors="external", own_worker=True)
        total = writer_tl.runtime.layout.events
        await owned_by([w1], total)
        threads = [thread_on(range(total), total, "moving", n) for n in range(8)]
        acked: dict[str, list[int]] = {t: [] for t in threads}
        stop = asyncio.Event()
        problems: list[str] = []
        writers = [asyncio.ensure_future(_writer(writer_tl, t, acked[t], stop)) for t in threads]
        reader = asyncio.ensure_future(_reader(reader_tl, threads, acked, stop, problems))

        async def progress(n: int) -> None:
            target = {t: len(a) + n for t, a in acked.items()}
            while any(len(acked[t]) < target[t] for t in threads):
                done = [f for f in (*writers, reader) if f.done()]
                for f in done:
                    f.result()  # a failed writer or reader fails the test now
                await asyncio.sleep(0.05)  # polling the writers' lists, bounded by `within`

        await within(progress(5), 60)
        await w2.start()  # a worker joins: half the partitions move to it
        owned = await owned_by([w1, w2], total)
        await within(progress(5), 60)
        w1.signal(signal.SIGKILL)  # the other owner dies mid-load: w2 takes its partitions over
        assert await w1.wait_exit(10) == -signal.SIGKILL
        await owned_by([w2], total, timeout=60)
        await within(progress(5), 90)
        stop.set()
        await within(asyncio.gather(*writers), 90)
        reads = await within(reader, 90)
        assert not problems, problems[:5]
        assert reads > 0 and owned["w1"] and owned["w2"]
        # Nothing acknowledged is lost: a fresh host judging the log itself agrees.
        embedded = await open_client()
        for t in threads:
            assert acked[t] == list(range(1, len(acked[t]) + 1))
            assert await within(embedded.messages.load_thread(t)) == [acked[t][-1]]
            assert await within(reader_tl.messages.load_thread(t)) == [acked[t][-1]]
    finally:
        await w1.stop()
        await w2.stop()


async def _snapshotted(workers: list[WorkerProcess], ends: dict[int, int], total: int) -> None:
    """Until the workers' snapshots reached `ends` on every partition."""
    while True:
        done: dict[int, int] = {}
        for w in workers:
            for snap in (await ask_worker(w.address, "stats"))["snapshots"]:
                done[snap["partition"]] = max(done.get(snap["partition"], -1), snap["position"])
        if all(done.get(p, -1) == ends[p] for p in range(total)):
            return
        await asyncio.sleep(0.2)  # polling the workers' stats, bounded by the caller's `within`


@contextlib.asynccontextmanager
async def _snapshotting(bootstrap, namespace, tmp_path, open_client, every: str, interval: str):
    """Worker w1 started, w2 not yet, both snapshotting; a thin client: (w1, w2, thin, partitions)."""
    snapshots = ("--snapshot-every", every, "--snapshot-interval", interval)
    w1 = await WorkerProcess(bootstrap, namespace, tmp_path / "w1", "w1", *snapshots).start()
    w2 = WorkerProcess(bootstrap, namespace, tmp_path / "w2", "w2", *snapshots)
    try:
        thin = await open_client(processors="external", own_worker=True)
        yield w1, w2, thin, thin.runtime.layout.events
    finally:
        await w1.stop()
        await w2.stop()


async def test_a_partition_taken_over_is_restored_from_a_snapshot_not_replayed(bootstrap, namespace, tmp_path,
                                                                               open_client):
    async with _snapshotting(bootstrap, namespace, tmp_path, open_client, "100", "0.5") as (w1, w2, thin, total):
        await owned_by([w1], total)
        threads = [f"snap-{n}" for n in range(40)]
        for round_ in range(10):  # 400 records of history
            await within(asyncio.gather(*(thin.messages.save_thread(t, [round_]) for t in threads)), 60)
        history = await within(thin.runtime.query.barrier(None))
        assert sum(history.values()) >= 400
        await within(_snapshotted([w1], history, total), 30)
        # A tail after the snapshots, then the owner dies and a fresh worker takes over.
        await within(asyncio.gather(*(thin.messages.save_thread(t, ["tail"]) for t in threads[:8])))
        await w2.start()
        w1.signal(signal.SIGKILL)
        assert await w1.wait_exit(10) == -signal.SIGKILL
        await owned_by([w2], total, timeout=60)
        loaded = await within(asyncio.gather(*(thin.messages.load_thread(t) for t in threads)), 60)
        assert loaded == [["tail"]] * 8 + [[9]] * 32
        st = await ask_worker(w2.address, "stats")
        restored = {int(p): info for p, info in st["restored"].items()}
        assert sorted(restored) == list(range(total))
        ends = await within(thin.runtime.query.barrier(None))
        assert all(history[p] <= restored[p]["position"] <= ends[p] for p in range(total))
        # The new owner judged only what came after each snapshot (at most the
        # 8-record tail), not the 400 records before it.
        assert st["judged"] == sum(ends[p] - restored[p]["position"] for p in range(total)) <= 8, st
        print(f"restored {sum(i['bytes_read'] for i in restored.values())} bytes "
              f"in {sum(i['seconds'] for i in restored.values()):.3f}s instead of judging {sum(history.values())}")


@pytest.mark.parametrize("move", ["stop", "join"])
async def test_partitions_moving_away_are_snapshotted_first_so_their_next_owner_judges_nothing_again(
        bootstrap, namespace, tmp_path, open_client, move):
    """A young namespace (no periodic snapshot yet: 50 000 records or 300 s) whose
    partitions move from its only worker to a second one, which found no snapshot
    and judged the whole history again, the partitions' calls waiting meanwhile.
    `stop` (a helper's rolling restarts, 2026-12-06): the worker is stopped with
    SIGTERM; proposals of other partitions naming positions past the moved ones
    waited too, and accepted writes answered OUTCOME_UNKNOWN. Now it snapshots its
    partitions first, while still serving them. `join`: the second worker joins
    while the first runs on; now the first snapshots what the rebalance takes from
    it. Either way the next owner restores them and judges nothing."""
    w1 = await WorkerProcess(bootstrap, namespace, tmp_path / "w1", "w1").start()
    w2 = WorkerProcess(bootstrap, namespace, tmp_path / "w2", "w2")
    try:
        thin = await open_client(processors="external", own_worker=True)
        total = thin.runtime.layout.events
        await owned_by([w1], total)
        threads = [f"{move}-{n}" for n in range(40)]
        for round_ in range(5):  # 200 records of history
            await within(asyncio.gather(*(thin.messages.save_thread(t, [round_]) for t in threads)), 60)
        ends = await within(thin.runtime.query.barrier(None))
        if move == "stop":
            w1.signal(signal.SIGTERM)
            assert await w1.wait_exit(60) == 0
            assert f"worker stopping: snapshotted partitions {list(range(total))}" in w1.lines, w1.lines
            await w2.start()
            moved = (await owned_by([w2], total, timeout=60))["w2"]
        else:
            await w2.start()
            moved = (await owned_by([w1, w2], total, timeout=60))["w2"]
        loaded = await within(asyncio.gather(*(thin.messages.load_thread(t) for t in threads)), 60)
        assert loaded == [[4]] * 40
        st = await ask_worker(w2.address, "stats")
        restored = {int(p): info["position"] for p, info in st["restored"].items()}
        assert restored == {p: ends[p] for p in moved}, (restored, ends, moved)
        assert st["judged"] == 0, st
    finally:
        await w1.stop()
        await w2.stop()


async def test_a_partition_given_back_to_a_stale_local_store_restores_its_newer_snapshot(bootstrap, namespace,
                                                                                          tmp_path, open_client):
    """A worker keeps the store of every partition it gives up, and a partition
    that comes back resumed from it -- judging again every record since, however
    old the store and however recent the partition's snapshot (found by a probe's
    helper: the first worker of a group owns every partition until the others
    join). Tried: worker `old` judged one save per partition and left; `w1`
    judged 30 more rounds, snapshotted them and was killed; `old` started again on
    its state directory took every partition over. Before: its stale stores were
    resumed and the 120 records judged again. Now (`--resume-gap 20`): each
    partition's snapshot is restored over its store and nothing is judged again."""
    gap = ("--resume-gap", "20")
    old = WorkerProcess(bootstrap, namespace, tmp_path / "old", "old", *gap)
    w1 = WorkerProcess(bootstrap, namespace, tmp_path / "w1", "w1", "--snapshot-every", "10",
                       "--snapshot-interval", "0.5")
    back = WorkerProcess(bootstrap, namespace, tmp_path / "old", "back", *gap)  # old's state directory
    try:
        await old.start()
        thin = await open_client(processors="external", own_worker=True)
        total = thin.runtime.layout.events
        threads = [thread_on({p}, total, "stale") for p in range(total)]
        await owned_by([old], total)
        await within(asyncio.gather(*(thin.messages.save_thread(t, ["old"]) for t in threads)))
        old.signal(signal.SIGTERM)
        assert await old.wait_exit(30) == 0
        await w1.start()
        await owned_by([w1], total)
        for round_ in range(30):
            await within(asyncio.gather(*(thin.messages.save_thread(t, [round_]) for t in threads)), 60)
        history = await within(thin.runtime.query.barrier(None))
        await within(_snapshotted([w1], history, total), 30)
        w1.signal(signal.SIGKILL)
        assert await w1.wait_exit(10) == -signal.SIGKILL
        await back.start()
        await owned_by([back], total, timeout=60)
        assert await within(asyncio.gather(*(thin.messages.load_thread(t) for t in threads)), 60) == [[29]] * total
        st = await ask_worker(back.address, "stats")
        restored = {int(p): info for p, info in st["restored"].items()}
        assert sorted(restored) == list(range(total)), st
        assert all(restored[p]["position"] == history[p] for p in range(total)), (restored, history)
        assert st["judged"] == 0, st
    finally:
        await old.stop()
        await w1.stop()
        await back.stop()


async def test_a_partition_paused_by_flow_control_is_judged_again_when_it_comes_back(bootstrap, namespace,
                                                                                      tmp_path):
    """Flow control pauses fetching a partition that waits with many records in
    hand (Judge._flow_control). Tried: every partition of an in-process worker
    paused that way, then some of them moved to a second worker and back (it
    left cleanly): those are fetched and judged again -- librdkafka keeps an
    application pause across unassign and assign, so the judge must resume."""
    rt = Runtime(Options(bootstrap_servers=bootstrap, namespace=namespace, state_dir=str(tmp_path / "a")),
                 worker=True)
    paused: list[int] = []

    def pause_all(owned: list[int]) -> None:
        # On the judge's thread, where _flow_control pauses (librdkafka's pause
        # called from another thread while the judge polls did not return).
        judge = rt.judge
        if not paused and judge is not None and rt.layout is not None and len(owned) == rt.layout.events:
            judge._consumer.pause([TopicPartition(rt.topics.events, p) for p in owned])
            judge._paused.update(owned)
            paused.extend(owned)

    rt.ownership_listeners.append(pause_all)
    await asyncio.to_thread(rt.start)
    w2 = WorkerProcess(bootstrap, namespace, tmp_path / "w2", "w2")
    producer = Producer({"bootstrap.servers": bootstrap})
    try:
        judge, topic = rt.judge, rt.topics.events
        assert judge is not None and rt.layout is not None
        everything = set(range(rt.layout.events))
        await until(lambda: sorted(paused) == sorted(everything), 60)
        await w2.start()
        await until(lambda: judge.owned and judge.owned != everything, 60)
        moved = everything - judge.owned
        w2.signal(signal.SIGTERM)
        assert await w2.wait_exit(30) == 0
        await until(lambda: judge.owned == everything, 60)
        offsets = {}
        for p in sorted(moved):  # a record each (poison is judged too: refused, INVALID_MESSAGE)
            producer.produce(topic, b"not a proposal", b"k", partition=p,
                             on_delivery=lambda err, msg: offsets.__setitem__(msg.partition(), msg.offset()))
        assert producer.flush(30) == 0 and len(offsets) == len(moved)
        await until(lambda: all(judge.applied(p) > off for p, off in offsets.items()), 30)
        assert all(judge.verdict(p, off)["code"] == "INVALID_MESSAGE" for p, off in offsets.items())
    finally:
        await w2.stop()
        await asyncio.to_thread(rt.stop)


async def _snapshotted_then_left(bootstrap, namespace, tmp_path, open_client, prefix: str) -> tuple[dict, int]:
    """A thread saved on every partition, snapshotted by worker w1, which then left
    the group cleanly: (the events' ends the snapshots stand at, partitions)."""
    async with _snapshotting(bootstrap, namespace, tmp_path, open_client, "100", "0.5") as (w1, _w2, thin, total):
        await owned_by([w1], total)
        threads = [thread_on({p}, total, prefix) for p in range(total)]
        await within(asyncio.gather(*(thin.messages.save_thread(t, ["kept"]) for t in threads)))
        history = await within(thin.runtime.query.barrier(None))
        await within(_snapshotted([w1], history, total), 30)
        w1.signal(signal.SIGTERM)
        assert await w1.wait_exit(30) == 0
    return history, total


async def test_a_long_restore_neither_stops_judging_nor_drops_the_worker_from_its_group(bootstrap, namespace,
                                                                                        tmp_path, open_client):
    """A partition taken over is restored from its snapshot, which takes as long as
    its state is large. Restored inside the assignment callback (inside poll), a
    restore longer than librdkafka's max.poll.interval.ms made the worker leave its
    group mid-restore, and no partition was judged until every restore ended.
    Tried: an in-process worker (max.poll.interval.ms 7 s) takes every partition of
    a snapshotted namespace; partition 0's restore is held past 8 s. Meanwhile the
    other partitions are owned and judged; after it, partition 0 is owned and
    judged from its snapshot, and the worker never gave a partition up."""
    history, total = await _snapshotted_then_left(bootstrap, namespace, tmp_path, open_client, "long-restore")

    rt = Runtime(Options(bootstrap_servers=bootstrap, namespace=namespace, state_dir=str(tmp_path / "rt"),
                         kafka={"session.timeout.ms": 6000, "max.poll.interval.ms": 7000}), worker=True)
    release, began = threading.Event(), {}
    real = rt._restore

    def slow_restore(p, store, *rest):
        began[p] = time.monotonic()
        if p == 0:
            release.wait(40)  # the fault: this partition's snapshot takes long to read
        return real(p, store, *rest)

    rt._restore = slow_restore
    seen: list[set[int]] = []
    rt.ownership_listeners.append(lambda owned: seen.append(set(owned)))
    readiness = Readiness(rt)
    await asyncio.to_thread(rt.start)
    readiness.start()
    producer = Producer({"bootstrap.servers": bootstrap})

    async def judged(p: int) -> None:
        sent: list[int] = []
        producer.produce(rt.topics.events, b"not a proposal", b"k", partition=p,
                         on_delivery=lambda err, msg: sent.append(msg.offset()))
        assert producer.flush(30) == 0 and len(sent) == 1
        await until(lambda: rt.judge.applied(p) > sent[0], 20, f"partition {p} judged past {sent[0]}")

    try:
        judge, others = rt.judge, set(range(1, total))
        await until(lambda: judge.owned == others, 30, "every partition but 0 owned during its restore")
        await judged(1)
        # The restore is held past max.poll.interval.ms: waiting on elapsed time is the point here.
        await asyncio.sleep(max(0.0, began[0] + 8.0 - time.monotonic()))
        assert judge.owned == others and 0 not in judge.restores
        ready, detail = await within(readiness.check())
        assert not ready and detail["restoring"] == [0], detail  # an assignment restoring is not caught up
        # Taking the restored partition over fails (a review: it was then served by
        # the stores, assigned by the group and judged by no one): tried again, and
        # readiness says why meanwhile. It fails after the partition was assigned
        # (its resume), so each try must undo its assign for the next to succeed.
        failed, failing = [], threading.Event()
        failing.set()

        class ResumeFailing:
            def __init__(self, consumer) -> None:
                self.consumer = consumer

            def __getattr__(self, name: str):
                return getattr(self.consumer, name)

            def resume(self, tps):
                if failing.is_set() and any(tp.partition == 0 for tp in tps):
                    failed.append(sorted(tp.partition for tp in tps))
                    raise RuntimeError("injected: resuming a restored partition failed")
                return self.consumer.resume(tps)

        judge._consumer = ResumeFailing(judge._consumer)  # the judge's thread polls through it from now on
        release.set()
        await until(lambda: judge.unserved, 30, "the failing take-over reported")
        assert judge.unserved == {0: "RuntimeError: injected: resuming a restored partition failed"}
        ready, detail = await within(readiness.check())
        assert not ready and detail["unserved"] == {"0": judge.unserved[0]}, detail
        failing.clear()
        await until(lambda: judge.owned == set(range(total)), 30, "partition 0 owned once restored")
        assert failed and all(tps == [0] for tps in failed) and judge.unserved == {}
        await judged(0)

        async def ready() -> bool:
            return (await readiness.check())[0]

        await until(ready, 30, "ready once every partition is restored and caught up")
        assert history[0] <= judge.restores[0]["position"], judge.restores
        assert all(before <= after for before, after in itertools.pairwise(seen)), seen
    finally:
        release.set()
        await asyncio.to_thread(rt.stop)


async def test_partitions_revoked_mid_restore_move_to_another_worker_and_the_rest_are_owned_once_restored(
        bootstrap, namespace, tmp_path, open_client):
    """A partition revoked while its restore runs was never assigned to the
    consumer: it must be left out of the unassign (librdkafka refuses the whole
    call for one partition it does not hold) and never served here. Tried: every
    restore of an in-process worker held; a second worker joins and takes its
    share; then the restores end: each partition is owned by exactly one of the
    two, and every one is judged."""
    history, total = await _snapshotted_then_left(bootstrap, namespace, tmp_path, open_client, "moved-restore")

    rt = Runtime(Options(bootstrap_servers=bootstrap, namespace=namespace, state_dir=str(tmp_path / "rt")),
                 worker=True)
    release = threading.Event()
    real = rt._restore

    def held_restore(p, store, *rest):
        release.wait(60)  # the fault: every snapshot takes long to read
        return real(p, store, *rest)

    rt._restore = held_restore
    await asyncio.to_thread(rt.start)
    w2 = WorkerProcess(bootstrap, namespace, tmp_path / "w2", "w2")
    producer = Producer({"bootstrap.servers": bootstrap})
    try:
        judge, everything = rt.judge, set(range(total))
        await until(lambda: set(judge.restoring) == everything, 30, "every partition restoring")
        await w2.start()
        await until(lambda: set(judge.restoring) != everything, 30, "a partition revoked mid-restore")
        theirs: set[int] = set()
        deadline = time.monotonic() + 60
        while not theirs or theirs | set(judge.restoring) != everything:
            assert time.monotonic() < deadline, (theirs, judge.restoring)
            theirs = set((await ask_worker(w2.address, "stats"))["owned"])
            await asyncio.sleep(0.1)  # polling two owners' views, no event announces them
        assert judge.owned == set() and theirs and theirs != everything
        release.set()
        await until(lambda: judge.owned == everything - theirs and not judge.restoring, 30,
                    "the partitions still assigned here owned once restored")
        assert set((await ask_worker(w2.address, "stats"))["owned"]) == theirs
        sent: dict[int, int] = {}
        for p in range(total):
            producer.produce(rt.topics.events, b"not a proposal", b"k", partition=p,
                             on_delivery=lambda err, msg: sent.__setitem__(msg.partition(), msg.offset()))
        assert producer.flush(30) == 0 and len(sent) == total

        async def all_judged() -> bool:
            applied = (await ask_worker(w2.address, "stats"))["applied"]
            return all(int(applied[str(p)]) > sent[p] for p in theirs) and all(
                judge.applied(p) > sent[p] for p in everything - theirs)

        await until(all_judged, 30, "every partition judged by its one owner")
        assert all(history[p] <= judge.restores[p]["position"] for p in everything - theirs), judge.restores
    finally:
        release.set()
        await w2.stop()
        await asyncio.to_thread(rt.stop)


def _live_snapshot_chunks(bootstrap: str, topic: str, partitions: int) -> dict[int, tuple[str, set[str]]]:
    """Per partition of `topic`: (the latest manifest's snapshot id, the snapshot
    ids of every chunk key whose last record is not a tombstone) -- what
    compaction keeps."""
    last: dict[tuple[int, bytes], bytes | None] = {}
    for msg in read_topic(bootstrap, topic, partitions, committed=False):
        last[(msg.partition(), msg.key())] = msg.value()
    out: dict[int, tuple[str, set[str]]] = {}
    for p in range(partitions):
        manifest = last.get((p, MANIFEST_KEY))
        live = {parsed[0] for (q, k), v in last.items() if q == p and v is not None
                for parsed in [parse_chunk_key(k)] if parsed is not None}
        out[p] = (orjson.loads(manifest)["snapshotId"] if manifest else "", live)
    return out


async def test_snapshots_of_a_partition_that_moves_away_and_back_leave_only_the_latest(bootstrap, namespace,
                                                                                        tmp_path, open_client):
    """Each snapshot tombstones the chunks of the ones before it, so the compacted
    topic holds one snapshot per partition. Tried: partitions snapshotted by w1,
    half of them taken by w2 (which restores and snapshots them), given back when
    w2 leaves, snapshotted by w1 again: only the latest snapshot's chunks live."""
    async with _snapshotting(bootstrap, namespace, tmp_path, open_client, "1", "0.2") as (w1, w2, thin, total):
        topic = thin.runtime.topics.snapshots
        threads = [thread_on({p}, total, "moving") for p in range(total)]

        async def saved_and_snapshotted(workers: list[WorkerProcess], round_: int) -> None:
            await within(asyncio.gather(*(thin.messages.save_thread(t, [round_]) for t in threads)))
            await within(_snapshotted(workers, await within(thin.runtime.query.barrier(None)), total), 60)

        await owned_by([w1], total)
        await saved_and_snapshotted([w1], 1)
        await w2.start()
        await owned_by([w1, w2], total)
        await saved_and_snapshotted([w1, w2], 2)
        w2.signal(signal.SIGTERM)
        assert await w2.wait_exit(30) == 0
        await owned_by([w1], total)
        await saved_and_snapshotted([w1], 3)
        for p, (latest, live) in (await asyncio.to_thread(_live_snapshot_chunks, bootstrap, topic, total)).items():
            assert latest and live == {latest}, (p, latest, live)


async def test_a_local_store_that_does_not_open_is_started_again_not_left_unjudged(bootstrap, namespace, tmp_path,
                                                                                  open_client):
    """A worker restarted on its state directory resumes each partition from its
    local store. Tried: the store of partition 0 corrupted while the worker was
    down (its CURRENT file overwritten): the worker starts that partition again
    (from a snapshot, else offset 0) instead of leaving it assigned and unjudged."""
    w1 = await WorkerProcess(bootstrap, namespace, tmp_path / "w1", "w1").start()
    w1b = WorkerProcess(bootstrap, namespace, tmp_path / "w1", "w1b")  # the same state directory
    try:
        thin = await open_client(processors="external", own_worker=True)
        total = thin.runtime.layout.events
        t = thread_on({0}, total, "corrupt")
        await within(thin.messages.save_thread(t, ["kept"]))
        await owned_by([w1], total)
        w1.signal(signal.SIGTERM)
        assert await w1.wait_exit(30) == 0
        [current] = list((tmp_path / "w1").glob("*/slot-*/events-0/CURRENT"))
        current.write_text("MANIFEST-999999\n")
        await w1b.start()
        await owned_by([w1b], total, timeout=30)
        assert await within(thin.messages.load_thread(t)) == ["kept"]
        await within(thin.messages.save_thread(t, ["after"]))
        assert await within(thin.messages.load_thread(t)) == ["after"]
    finally:
        await w1.stop()
        await w1b.stop()


async def test_a_snapshot_of_the_namespace_before_it_was_created_again_is_not_restored(bootstrap, namespace,
                                                                                      tmp_path, open_client):
    """Tried (a review): `<ns>.events` and `<ns>.deliveries` deleted and created again
    (a demo run twice, a test cluster reset) while `<ns>.snapshots` stays. Before, a
    worker taking partition 0 over restored the old life's snapshot at position 6:
    the old threads came back, and the new log's acknowledged writes below offset 6
    were never judged (read as never written). Snapshots now name the topic id of the
    log they were folded from; one of another incarnation is not restored."""
    snapshots = ("--snapshot-every", "1", "--snapshot-interval", "0.5")
    w1 = await WorkerProcess(bootstrap, namespace, tmp_path / "w1", "w1", *snapshots).start()
    w2 = WorkerProcess(bootstrap, namespace, tmp_path / "w2", "w2")
    try:
        thin = await open_client(processors="external", own_worker=True)
        total = thin.runtime.layout.events
        old = [thread_on({0}, total, "old", n) for n in range(6)]
        for t in old:
            await within(thin.messages.save_thread(t, ["old life"]))
        ends = await within(thin.runtime.query.barrier(None))
        assert ends[0] == 7  # the rules floor marker, then the six
        await within(_snapshotted([w1], {0: 7}, 1), 30)  # partition 0's snapshot at 7
        await thin.close()
        await w1.stop()
        topics = thin.runtime.topics
        admin = AdminClient({"bootstrap.servers": bootstrap})
        for fut in admin.delete_topics([topics.events, topics.deliveries]).values():
            fut.result(timeout=30)
        await until(lambda: not {topics.events, topics.deliveries} & set(admin.list_topics(timeout=10).topics),
                    30, "the topics deleted")
        embedded = await open_client()  # creates them again: a new log, from offset 0
        new = [thread_on({0}, total, "new", n) for n in range(8)]
        for t in new:
            await within(embedded.messages.save_thread(t, ["new life"]))
        await w2.start()
        await owned_by([w2], total, timeout=60)
        reader = await open_client(processors="external", own_worker=True)
        assert await within(asyncio.gather(*(reader.messages.load_thread(t) for t in old))) == [[]] * 6
        assert await within(asyncio.gather(*(reader.messages.load_thread(t) for t in new))) == [["new life"]] * 8
        assert "0" not in (await ask_worker(w2.address, "stats"))["restored"]
    finally:
        await w1.stop()
        await w2.stop()


async def test_twins_of_one_id_are_read_by_a_thin_client_as_by_an_embedded_one(bootstrap, namespace, tmp_path,
                                                                                open_client):
    """Two creates of one interrupt id on threads of different partitions, each begun
    before the other was written, both stand (README: concurrent first writes across
    partitions). Calls naming only the id follow the lowest partition's copy. Tried
    (a review) with the copies on two owners: a thin client followed the other copy
    than an embedded client -- it took the last owner's answer -- and so resolved
    the one the embedded client did not see resolved."""
    async with _two_workers(bootstrap, namespace, tmp_path, open_client) as (_w1, _w2, thin, total, owned):
        low = min(p for ps in owned.values() for p in ps)
        other = next(name for name, ps in owned.items() if low not in ps)
        t_low, t_high = thread_on({low}, total, "twin-lo"), thread_on({max(owned[other])}, total, "twin-hi")
        embedded = await open_client()

        def interrupt(thread: str) -> dict:
            return {"interruptId": "i1", "runId": "r", "threadId": thread, "requestedAt": 1, "payload": {}}

        await within(thin.interrupts.create(interrupt(t_high)))

        async def began_before_it() -> dict[int, int]:
            return dict.fromkeys(range(total), 0)  # the positions of a create begun before that write

        embedded.bus.end_offsets = began_before_it
        await within(embedded.interrupts.create(interrupt(t_low)))
        for t in (t_low, t_high):
            assert [i["threadId"] for i in await within(thin.interrupts.list(t))] == [t]  # twins
        assert (await within(embedded.interrupts.get("i1")))["threadId"] == t_low
        assert (await within(thin.interrupts.get("i1")))["threadId"] == t_low
        assert (await within(thin.interrupts.resolve("i1", {"ok": 1})))["threadId"] == t_low
        assert (await within(embedded.interrupts.get("i1")))["status"] == "resolved"
        assert [i["status"] for i in await within(embedded.interrupts.list(t_high))] == ["pending"]


async def test_a_fork_answers_within_one_request_timeout_across_its_two_steps(bootstrap, namespace, tmp_path,
                                                                              open_client):
    """A fork is two proposals: its source's step, then its destination's. The
    second had the whole request timeout again, so a fork whose source owner
    answered late and whose destination owner never answered took the time
    before the first verdict plus a whole timeout (a review: up to 2x the
    bound SPEC §2 gives a call). One deadline covers both steps now.
    Tried: w1 (the source's owner) stopped for 3.5 s, w2 (the destination's)
    stopped throughout, a 4 s request timeout."""
    async with _two_workers(bootstrap, namespace, tmp_path, open_client) as (w1, w2, thin, total, owned):
        src = thread_on(owned["w1"], total, "fork-src")
        dst = thread_on(owned["w2"], total, "fork-dst")
        writer = await within(thin.checkpoints.acquire_writer(src))
        await within(thin.checkpoints.append(checkpoint=checkpoint("fork-src-1", src, None), expected_head_id=None,
                                             writer=writer))
        dst_writer = await within(thin.checkpoints.acquire_writer(dst))
        timed = await open_client(processors="external", own_worker=True, request_timeout_ms=4000)
        ps = partition_for(src, total)
        before = (await within(thin.runtime.seen_offsets.end_offsets()))[ps]
        loop = asyncio.get_running_loop()
        w1.signal(signal.SIGSTOP)
        w2.signal(signal.SIGSTOP)
        try:
            began = loop.time()
            fork = asyncio.ensure_future(timed.checkpoints.fork_from_checkpoint(
                source_thread_id=src, source_checkpoint_id="fork-src-1", destination_thread_id=dst,
                destination_checkpoint_id="fork-dst-root", created_at=20, writer=dst_writer))
            await until(lambda: _past(thin, ps, before), 30, "the fork's first step reaching the log")
            await asyncio.sleep(3.5)  # the source's owner answering late is the point, not a wait for an event
            w1.signal(signal.SIGCONT)
            with pytest.raises(ThreadLogError) as err:
                await within(fork, 30)
            took = loop.time() - began
        finally:
            w1.signal(signal.SIGCONT)
            w2.signal(signal.SIGCONT)
        assert err.value.code == OUTCOME_UNKNOWN, err.value
        # One 4 s deadline (and the answer's way back, slack for a loaded machine); the old code took 3.5 + 4.
        assert took < 7.0, f"the fork took {took:.1f}s with a 4 s request timeout"
