"""A producer that stopped delivering is replaced (producers/pump.py), on a real broker.

librdkafka can leave a producer's partitions without a leader for good after
a broker restart (librdkafka #5430; a fault probe saw a thin client's every
append time out for minutes after the broker was back). That state cannot be
made on demand, so a producer whose bootstrap refuses connections stands for
the stuck one: every record it takes times out. The replacement is made from
the real settings, as the pump makes it.
"""

from __future__ import annotations

import threading
import time

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient
from support import read_topic
from threadlog.producers.pump import ProducerPump

from threadlog.kernel import kafka_config, stuck
from threadlog.kernel.topics import Topics, ensure_topics


def test_a_producer_whose_records_only_time_out_is_replaced_and_nothing_goes_unreported(bootstrap, namespace,
                                                                                        monkeypatch):
    monkeypatch.setattr(stuck, "STUCK_S", 1.0)
    ensure_topics(AdminClient({"bootstrap.servers": bootstrap}), Topics(namespace), partitions=1, timeout=30)
    topic = Topics(namespace).events
    settings = kafka_config.producer(bootstrap, "stuck-producer-test", None,
                                     **{"linger.ms": 0, "message.timeout.ms": 500})
    pump = ProducerPump(Producer({**settings, "bootstrap.servers": "127.0.0.1:1"}), "stuck-test", settings)
    outcomes: dict[int, str] = {}
    lock = threading.Lock()
    try:
        deadline = time.monotonic() + 30
        n = 0
        # One record every 0.1 s until one is delivered: the first ones time out.
        while "ok" not in outcomes.values():
            assert time.monotonic() < deadline, f"nothing delivered: {outcomes}"

            def done(err, msg, n=n):
                with lock:
                    outcomes[n] = "ok" if err is None else err.name()

            pump.produce(topic, f"r{n}".encode(), b"k", partition=0, on_delivery=done)
            n += 1
            time.sleep(0.1)  # the pace of the writes; the outcomes are awaited below
        sent = n
        end = time.monotonic() + 10
        while len(outcomes) < sent and time.monotonic() < end:  # every record is reported, one way or the other
            time.sleep(0.02)
        assert len(outcomes) == sent
        assert pump.replacements == 1
        timed_out = [i for i, o in sorted(outcomes.items()) if o == "_MSG_TIMED_OUT"]
        delivered = [i for i, o in sorted(outcomes.items()) if o == "ok"]
        assert timed_out and delivered and max(timed_out) < min(delivered), outcomes
        assert set(outcomes.values()) == {"ok", "_MSG_TIMED_OUT"}
        stored = [m.value().decode() for m in read_topic(bootstrap, topic, 1)]
        assert stored == [f"r{i}" for i in delivered]
    finally:
        pump.stop()
