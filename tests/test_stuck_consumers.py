"""Tailing consumers that stop reading are replaced (threadlog/kernel/stuck.py), on a real broker.

librdkafka's assigned consumer sometimes never fetches again after a broker
restart (librdkafka #5153, rust-rdkafka #597; seen here by a fault probe in the
members view). A broker restart does not reproduce it on demand, so a consumer
paused on its own thread stands for the stuck one: it polls, reads nothing and
reports nothing. The members view's case is tests/test_members.py.
"""

from __future__ import annotations

import asyncio
import time

from confluent_kafka import Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from delivery_support import chunk, collect
from support import until, within
from threadlog.processors.query_server import QueryServer
from threadlog.projections.delivery_tail import DeliveryTail
from threadlog.schemas import default_codec

from threadlog.config import Options
from threadlog.kernel import kafka_config, stuck
from threadlog.kernel.partitioning import partition_for
from threadlog.kernel.topics import Topics
from threadlog.members import Announcer
from threadlog.runtime import Runtime


def _stall(monkeypatch, stalled: dict) -> None:
    """Pause `stalled["consumer"]` on the thread that polls it (librdkafka's pause
    from another thread waits on the polling one): from then on it reads nothing."""
    real_drain = kafka_config.drain

    def drain(consumer, max_messages, timeout):
        if consumer is stalled.get("consumer") and "paused" not in stalled:
            consumer.pause(consumer.assignment())
            stalled["paused"] = True
        return real_drain(consumer, max_messages, timeout)

    monkeypatch.setattr(kafka_config, "drain", drain)


async def test_a_run_index_whose_consumer_stopped_reading_replaces_it(open_client, monkeypatch):
    """The run index folds `<ns>.deliveries`: live readers of this process are fed
    from it, and reads of a run's state wait for its position (the read
    barrier). Stuck, both waited out their timeouts. Tried: the index's consumer
    paused, then a chunk appended: before, the index never folded it; after, a
    new consumer reads on from the index's position."""
    monkeypatch.setattr(stuck, "STUCK_S", 0.5)
    tl = await open_client()
    run = "run-stuck"
    p = partition_for(run, tl.runtime.layout.deliveries)
    log = tl.delivery(run)
    await within(log.append([chunk(0)]))
    index = tl.runtime.deliveries
    await until(lambda: index.applied(p) >= 1, 10, "the first chunk folded")
    stalled: dict = {}
    _stall(monkeypatch, stalled)
    stalled["consumer"] = index._consumer
    await until(lambda: "paused" in stalled, 10, "the index's consumer paused")
    await within(log.append([chunk(1)]))
    await until(lambda: index.applied(p) >= 2, 15, "the second chunk folded by the index")
    assert getattr(index, "restarts", 0) == 1
    await within(log.close())
    assert [c for _, c in await collect(log.read("-1"))] == [chunk(0), chunk(1)]


async def test_a_delivery_tail_whose_consumer_stopped_reading_replaces_it(open_client, bootstrap, namespace,
                                                                         monkeypatch):
    """A thin client's delivery tail feeds every live reader (SSE) of its process.
    Stuck, they heard nothing more. Tried: the tail's consumer paused after a
    reader joined, then a chunk appended: the reader gets it through a new
    consumer, from where the old one stopped (nothing lost, nothing twice)."""
    monkeypatch.setattr(stuck, "STUCK_S", 0.5)
    tl = await open_client()  # creates the topics; writes the records
    topic = Topics(namespace).deliveries
    run = "run-tailed"
    p = partition_for(run, tl.runtime.layout.deliveries)
    tail = DeliveryTail(bootstrap, topic, default_codec(), "tail-stuck-test", 20.0)
    stalled: dict = {}
    try:
        sub = await within(tail.subscribe(run, p))
        _stall(monkeypatch, stalled)
        stalled["consumer"] = tail._consumer
        await until(lambda: "paused" in stalled, 10, "the tail's consumer paused")
        await within(tl.delivery(run).append([chunk(7)]))
        assert await within(sub.wait(15), 20), "the chunk never reached the live reader"
        items = [sub.popleft() for _ in range(len(sub.items))]
        assert len(items) == 1 and items[0].partition == p and items[0].record["runId"] == run, items
        assert tail.restarts == 1
    finally:
        tail.stop()


async def test_an_embedded_judge_whose_consumer_stopped_reading_replaces_it(open_client, monkeypatch):
    """The judge decides every proposal; stuck, every write ended OUTCOME_UNKNOWN
    for good (only the readiness probe said why). Tried: an embedded client's
    judge consumer paused, then a thread saved: the save is judged through a new
    consumer, from the judged positions (the earlier save is not judged again)."""
    monkeypatch.setattr(stuck, "STUCK_S", 0.5)
    tl = await open_client()
    await _saved_across_a_stall(tl, tl.runtime.judge, monkeypatch)


async def _saved_across_a_stall(tl, judge, monkeypatch) -> None:
    """A save, the judge's consumer stalled, a save: both stored, the judge's
    consumer replaced once, nothing judged twice."""
    await within(tl.messages.save_thread("before-the-stall", ["one"]))
    await within(tl.read_barrier(None))  # every record so far judged (the rules-floor markers too)
    judged = judge.stats["judged"]
    stalled: dict = {}
    _stall(monkeypatch, stalled)
    stalled["consumer"] = judge._consumer
    await until(lambda: "paused" in stalled, 10, "the judge's consumer paused")
    await within(tl.messages.save_thread("after-the-stall", ["two"]), 40)
    assert judge.restarts == 1
    await until(lambda: judge.owned == set(range(tl.runtime.layout.events)), 30, "every partition owned again")
    assert judge.stats["judged"] == judged + 1, judge.stats
    assert await within(tl.messages.load_thread("after-the-stall")) == ["two"]
    assert await within(tl.messages.load_thread("before-the-stall")) == ["one"]


async def test_a_workers_judge_whose_consumer_stopped_reading_rejoins_its_group(bootstrap, namespace, tmp_path,
                                                                              open_client, monkeypatch):
    """A worker's judge is a group member: its stuck consumer is replaced by one
    that joins the group again (the old one leaves off the judge's thread), and
    its partitions come back from their local stores. Tried: the only worker's
    judge consumer paused, then a thin client saves a thread: the save succeeds
    once the new consumer owns the partitions, which were not judged again."""
    monkeypatch.setattr(stuck, "STUCK_S", 0.5)
    rt = Runtime(Options(bootstrap_servers=bootstrap, namespace=namespace, state_dir=str(tmp_path / "worker")),
                 worker=True)
    await asyncio.to_thread(rt.start)
    server = announcer = None
    try:
        judge = rt.judge
        assert judge is not None and rt.layout is not None and rt.stores is not None and rt.barrier is not None
        everything = set(range(rt.layout.events))
        await until(lambda: judge.owned == everything, 60, "the worker owns every partition")
        # What `threadlog worker` adds to its runtime (threadlog/cli.py), in this process.
        server = QueryServer(rt.stores, judge, rt.barrier, timeout=rt.opts.request_timeout,
                             deliveries=rt.deliveries, delivery_barrier=rt.delivery_barrier)
        announcer = Announcer(bootstrap, rt.topics.members, rt.client_id, await server.start("127.0.0.1", 0),
                              partitions=lambda: sorted(judge.owned),
                              lease=(rt.opts.lease_duration_ms, rt.opts.renew_after_ms))
        rt.ownership_listeners.append(lambda owned: announcer.announce_now())
        await asyncio.to_thread(announcer.start, rt.opts.request_timeout)
        await _saved_across_a_stall(await open_client(processors="external", own_worker=True), judge, monkeypatch)
    finally:
        if announcer is not None:
            await asyncio.to_thread(announcer.stop)
        if server is not None:
            await server.close()
        await asyncio.to_thread(rt.stop)


async def test_a_partition_the_judge_may_not_read_is_not_a_stuck_consumer(bootstrap, namespace, tmp_path,
                                                                          monkeypatch):
    """A judge refuses to judge from offset 0 onto state whose position the log no
    longer holds (records deleted while it was down): that partition is never
    fetched, on purpose, and its end stays ahead. Tried (a review reproduced it):
    a worker's stored position of events[0] deleted from the log; before, the
    worker gave up and took back every partition each ~13 s (NOT_OWNER to every
    caller of the healthy partitions, restores cancelled); after, the partition
    waits alone and the other partitions stay owned and judged."""
    monkeypatch.setattr(stuck, "STUCK_S", 0.5)
    opts = Options(bootstrap_servers=bootstrap, namespace=namespace, state_dir=str(tmp_path / "worker"))
    rt = Runtime(opts, worker=True)
    await asyncio.to_thread(rt.start)
    producer = Producer({"bootstrap.servers": bootstrap})
    try:
        assert rt.judge is not None and rt.layout is not None
        everything, topic = set(range(rt.layout.events)), rt.topics.events
        await until(lambda: rt.judge.owned == everything, 60, "the worker owns every partition")
        first = _poison(producer, topic, 0, 3)
        await until(lambda: rt.judge.applied(0) >= first, 30, "events[0] judged")
    finally:
        await asyncio.to_thread(rt.stop)
    end = _poison(producer, topic, 0, 4)  # past the stored position, then deleted with it
    admin = AdminClient({"bootstrap.servers": bootstrap})  # kept: its futures die with it
    for fut in admin.delete_records([TopicPartition(topic, 0, end)]).values():
        fut.result(30)
    rt = Runtime(opts, worker=True)
    await asyncio.to_thread(rt.start)
    try:
        judge = rt.judge
        assert judge is not None
        await until(lambda: judge.owned == everything and 0 in judge.unreadable, 60, "events[0] refused its reset")
        # Nothing to await: the fault is an event that must not happen. Watched for
        # eight periods of the scaled-down watchdog (STUCK_S 0.5 s).
        watched = time.monotonic() + 4
        while time.monotonic() < watched:
            assert judge.owned == everything and judge.restarts == 0
            await asyncio.sleep(0.05)
        later = _poison(producer, topic, 1, 1)
        await until(lambda: judge.applied(1) >= later, 30, "events[1] still judged")
        assert judge.restarts == 0 and judge.applied(0) < end
    finally:
        await asyncio.to_thread(rt.stop)


def _poison(producer: Producer, topic: str, partition: int, n: int) -> int:
    """`n` records that are no proposal (judged: refused) on `partition`: the end after them."""
    offsets: list[int] = []
    for _ in range(n):
        producer.produce(topic, b"not a proposal", b"k", partition=partition,
                         on_delivery=lambda err, msg: offsets.append(-1 if err else msg.offset()))
    assert producer.flush(30) == 0 and len(offsets) == n and min(offsets) >= 0, offsets
    return max(offsets) + 1


async def test_a_worker_keeps_its_partitions_when_a_new_consumer_cannot_read_the_partition_either(
        bootstrap, namespace, tmp_path, monkeypatch):
    """Giving every partition up costs every caller of the healthy ones, so a
    worker's judge does it only when a new consumer reads the silent partition's
    end where the old one fetched nothing. Tried: the judge's consumer paused with
    a record to fetch, and every new consumer pointed at a refused address
    (standing for a cluster that serves that partition to no one: its leader is
    down): the judge keeps its consumer and every partition."""
    monkeypatch.setattr(stuck, "STUCK_S", 0.5)
    rt = Runtime(Options(bootstrap_servers=bootstrap, namespace=namespace, state_dir=str(tmp_path / "worker")),
                 worker=True)
    await asyncio.to_thread(rt.start)
    try:
        judge = rt.judge
        assert judge is not None and rt.layout is not None
        everything = set(range(rt.layout.events))
        await until(lambda: judge.owned == everything, 60, "the worker owns every partition")
        stalled: dict = {}
        _stall(monkeypatch, stalled)
        stalled["consumer"] = judge._consumer
        await until(lambda: "paused" in stalled, 10, "the judge's consumer paused")
        judge._settings = {**judge._settings, "bootstrap.servers": "127.0.0.1:1"}
        end = _poison(Producer({"bootstrap.servers": bootstrap}), rt.topics.events, 0, 1)
        await until(lambda: judge._watch_after > 0, 30, "the judge found events[0] silent and behind")
        assert judge.restarts == 0 and judge.owned == everything and judge.applied(0) < end
    finally:
        await asyncio.to_thread(rt.stop)
