"""Workers' announcements on `<ns>.members` as a client's view takes them, on a real broker."""

from __future__ import annotations

import json
import time

from confluent_kafka import Producer
from support import until, within

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
