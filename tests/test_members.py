"""Workers' announcements on `<ns>.members` as a client's view takes them, on a real broker."""

from __future__ import annotations

import json
import time

from confluent_kafka import Producer, TopicPartition
from support import until, within

from threadlog import members
from threadlog.kernel import stuck
from threadlog.kernel.topics import Topics
from threadlog.members import LIVE_AFTER_S, MembersView


async def test_a_dead_worker_whose_clock_ran_ahead_stops_being_live(open_client, bootstrap, namespace):
    """Tried: an announcement whose heartbeat is an hour ahead of this host's clock
    (its worker's clock ran ahead, then it died). The view kept it live, and first
    in the newest-first order clients try, for that hour. Now it expires
    LIVE_AFTER_S after it was received, like any other."""
    await open_client()  # creates the namespace's topics
    topic = Topics(namespace).members
    producer = Producer({"bootstrap.servers": bootstrap})
    now = time.time() * 1000.0
    producer.produce(topic, json.dumps({"address": "127.0.0.1:1", "startedAt": now, "heartbeatAt": now + 3_600_000,
                                        "partitions": [0]}).encode(), b"ghost")
    assert producer.flush(10) == 0
    view = MembersView(bootstrap, topic, "members-test")
    try:
        view.start(30)
        await until(lambda: [m.worker_id for m in view.live()] == ["ghost"], 30, "the announcement read")
        await within(until(lambda: view.live() == [], LIVE_AFTER_S + 10, "the dead worker no longer live"),
                     LIVE_AFTER_S + 20)
    finally:
        view.close()


async def test_a_view_whose_consumer_stopped_reading_replaces_it(open_client, bootstrap, namespace, monkeypatch):
    """Tried (a fault probe, 2 runs of 11: two workers, a 12 s broker outage): one
    worker's view never read a record again after the broker came back -- its
    poll returned nothing for minutes while the other worker read its heartbeats
    -- so it saw no live worker and its judge's questions to the other owner all
    failed: its partitions stopped for good. Here a paused consumer stands for
    the stuck one: the view notices its position is behind the partition's end
    and reads on with a new consumer."""
    monkeypatch.setattr(stuck, "STUCK_S", 0.5)
    await open_client()  # creates the namespace's topics
    topic = Topics(namespace).members
    stalled: dict = {}
    real_drain = members.kafka_config.drain

    def drain(consumer, max_messages, timeout):
        # Paused on the view's own thread (librdkafka's pause from another thread
        # waits on the polling one): from here on it reads nothing.
        if consumer is stalled.get("consumer") and "paused" not in stalled:
            consumer.pause([TopicPartition(topic, 0)])
            stalled["paused"] = True
        return real_drain(consumer, max_messages, timeout)

    monkeypatch.setattr(members.kafka_config, "drain", drain)
    view = MembersView(bootstrap, topic, "members-stuck-test")
    producer = Producer({"bootstrap.servers": bootstrap})
    try:
        view.start(30)
        stalled["consumer"] = view._consumer
        await until(lambda: "paused" in stalled, 10, "the view's consumer paused")
        now = time.time() * 1000.0
        producer.produce(topic, json.dumps({"address": "127.0.0.1:1", "startedAt": now, "heartbeatAt": now,
                                            "partitions": [0]}).encode(), b"announced-while-stuck")
        assert producer.flush(10) == 0
        await until(lambda: [m.worker_id for m in view.live()] == ["announced-while-stuck"], 30,
                    "the announcement read by a new consumer")
        assert view.restarts == 1
    finally:
        view.close()



async def test_a_worker_removes_the_entries_of_workers_long_gone(open_client, bootstrap, namespace, monkeypatch):
    """Tried (a soak helper): every worker that died without its tombstone (SIGKILL,
    OOM) left its record on the compacted members topic for good, read by every
    process that starts. Now a live worker tombstones the entries its view has read
    nothing of for FORGET_AFTER_S (its own monotonic clock, never heartbeat times:
    a review) -- and only while its view reads its own heartbeats."""
    from threadlog.members import Announcer

    monkeypatch.setattr(members, "FORGET_AFTER_S", 4.0)
    monkeypatch.setattr(members, "SWEEP_EVERY_S", 0.3)
    await open_client()  # creates the namespace's topics
    topic = Topics(namespace).members
    producer = Producer({"bootstrap.servers": bootstrap})
    now = time.time() * 1000.0
    # Its heartbeat claims "now" (a clock ahead would too): only silence counts.
    producer.produce(topic, json.dumps({"address": "127.0.0.1:1", "startedAt": now, "heartbeatAt": now,
                                        "partitions": [0]}).encode(), b"gone-worker")
    assert producer.flush(10) == 0
    view = MembersView(bootstrap, topic, "members-test")
    sweeper = Announcer(bootstrap, topic, "sweeper", "127.0.0.1:2", interval=0.2, gone=view.long_dead)
    try:
        view.start(30)
        read_at = time.monotonic()
        assert view.long_dead("sweeper") == []  # its own heartbeat not read yet: this view cannot tell
        sweeper.start(30)  # sweeping every 0.3 s from its first beat
        await until(lambda: "sweeper" in [m.worker_id for m in view.live()], 30, "the sweeper's own heartbeat read")
        await until(lambda: "gone-worker" not in view._members, 30, "the silent worker's entry tombstoned")
        assert time.monotonic() - read_at >= members.FORGET_AFTER_S  # not before it was silent that long
        assert sweeper.tombstoned == 1
        assert [m.worker_id for m in view.live()] == ["sweeper"]  # its own entry untouched
    finally:
        sweeper.stop()
        view.close()
