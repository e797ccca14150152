"""Our key -> partition function is Kafka's (murmur2), as librdkafka computes it."""

from __future__ import annotations

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from threadlog.kernel.partitioning import partition_for


def test_partition_for_matches_kafkas_murmur2_partitioner(bootstrap, namespace):
    topic = f"{namespace}.murmur"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for f in admin.create_topics([NewTopic(topic, 7, 1)]).values():
        f.result(30)
    keys = ["", "a", "ab", "abc", "abcd", "thread-1", "héllo", "🧵" * 5, "x" * 101]
    got = {}
    p = Producer({"bootstrap.servers": bootstrap, "partitioner": "murmur2"})
    for k in keys:
        p.produce(topic, b"v", k.encode(), on_delivery=lambda e, m, k=k: got.__setitem__(k, m.partition()))
    assert p.flush(30) == 0
    try:
        assert got == {k: partition_for(k, 7) for k in keys}
    finally:
        for f in admin.delete_topics([topic]).values():
            f.result(30)
