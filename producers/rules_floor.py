"""Writing the rules floor marker to each events partition of a namespace just created.

Why (processors/handlers/rules_floor.py): without it, a fresh partition judged
a raw proposal by whatever older rules it named, until an honest proposal of
rules >= 4 happened to land there.
"""

from __future__ import annotations

import uuid

from confluent_kafka import Producer
from threadlog.processors.handlers.rules_floor import MARKER_TYPE
from threadlog.processors.judge import RULES
from threadlog.schemas import Codec

from threadlog.kernel import kafka_config
from threadlog.kernel.errors import unavailable
from threadlog.kernel.partitioning import partition_for

# The least time the markers get, whatever the client's request timeout. They go
# to topics created a moment before, whose leaders a loaded broker may take
# seconds to elect; a client opened with a short request timeout (tests of
# outages use 1 s) is bounding requests to a live namespace, not its creation.
# A CI run met a 1 s bound here: all four markers unacknowledged.
MIN_TIMEOUT = 30.0


def marker_key(partition: int, partitions: int) -> str:
    """A key of `partition` (the judge refuses a proposal keyed for another one)."""
    return next(k for k in (f"threadlog.rules-floor.{i}" for i in range(1_000_000))
                if partition_for(k, partitions) == partition)


def write_floor_markers(bootstrap: str, topic: str, partitions: int, codec: Codec, client_id: str,
                        kafka: kafka_config.Props | None, timeout: float) -> None:
    """One marker per partition, acknowledged (UNAVAILABLE if not within `timeout`,
    raised to MIN_TIMEOUT)."""
    timeout = max(timeout, MIN_TIMEOUT)
    producer = Producer(kafka_config.producer(bootstrap, f"{client_id}.rules-floor", kafka))
    # Time 0: a partition's decision time is the latest any proposal brought, and the
    # marker must not move it (a client's injected clock behind the creator's would
    # have its leases judged at the creator's time).
    at = 0.0
    failures: list[str] = []
    payload = codec.encode(MARKER_TYPE, {})
    for p in range(partitions):
        key = marker_key(p, partitions)
        value = codec.encode("threadlog.Proposal", {
            # Random: a duplicate id is answered before the floor is raised, and a
            # forger must not be able to write one ahead of the marker.
            "proposalId": uuid.uuid4().hex, "key": key, "type": MARKER_TYPE, "at": at,
            # The newest rules this code knows: a namespace is judged by them from
            # its start (a client of older code, naming older rules, included).
            "rules": RULES, "seen": [], "payload": payload})
        producer.produce(topic, value, key.encode("utf-8"), partition=p,
                         on_delivery=lambda err, _msg: failures.append(str(err)) if err is not None else None)
    left = producer.flush(timeout)
    # Said before the purge below, whose own reports (_PURGE_QUEUE) land in `failures` too.
    why = failures[0] if failures else f"{left} not acknowledged in {timeout:g}s"
    if left:
        # Dropped here, not when collected: the error's traceback holds this frame,
        # and with it the producer and its librdkafka threads, until gc runs.
        producer.purge()
        producer.flush(0)
    del producer
    if left or failures:
        raise unavailable(f"the rules floor markers of {topic} were not written: {why}")
