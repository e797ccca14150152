"""Writing the rules floor marker to each events partition of a namespace just created.

Why (processors/handlers/rules_floor.py): without it, a fresh partition judged
a raw proposal by whatever older rules it named, until an honest proposal of
rules >= 4 happened to land there.
"""

from __future__ import annotations

import uuid

from confluent_kafka import Producer
from threadlog.processors.handlers.rules_floor import FLOOR_MARKER_RULES, MARKER_TYPE
from threadlog.schemas import Codec

from threadlog.kernel import kafka_config
from threadlog.kernel.errors import unavailable
from threadlog.kernel.partitioning import partition_for


def marker_key(partition: int, partitions: int) -> str:
    """A key of `partition` (the judge refuses a proposal keyed for another one)."""
    return next(k for k in (f"threadlog.rules-floor.{i}" for i in range(1_000_000))
                if partition_for(k, partitions) == partition)


def write_floor_markers(bootstrap: str, topic: str, partitions: int, codec: Codec, client_id: str,
                        kafka: kafka_config.Props | None, timeout: float) -> None:
    """One marker per partition, acknowledged (UNAVAILABLE if not within `timeout`)."""
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
            "rules": FLOOR_MARKER_RULES, "seen": [], "payload": payload})
        producer.produce(topic, value, key.encode("utf-8"), partition=p,
                         on_delivery=lambda err, _msg: failures.append(str(err)) if err is not None else None)
    left = producer.flush(timeout)
    if left or failures:
        raise unavailable(f"the rules floor markers of {topic} were not written: "
                          f"{failures[0] if failures else f'{left} not acknowledged in {timeout:g}s'}")
