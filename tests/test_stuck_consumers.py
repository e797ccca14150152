"""Tailing consumers that stop reading are replaced (threadlog/kernel/stuck.py), on a real broker.

librdkafka's assigned consumer sometimes never fetches again after a broker
restart (librdkafka #5153, rust-rdkafka #597; seen here by a fault probe in the
members view). A broker restart does not reproduce it on demand, so a consumer
paused on its own thread stands for the stuck one: it polls, reads nothing and
reports nothing. The members view's case is tests/test_members.py.
"""

from __future__ import annotations

from delivery_support import chunk, collect
from support import until, within
from threadlog.projections.delivery_tail import DeliveryTail
from threadlog.schemas import default_codec

from threadlog.kernel import kafka_config, stuck
from threadlog.kernel.partitioning import partition_for
from threadlog.kernel.topics import Topics


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
