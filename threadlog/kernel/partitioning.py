"""Key -> partition, identical to Kafka's default (murmur2) partitioner.

Commands and events are co-partitioned by this one function: the decider that
owns command partition p writes the thread's events to events partition p, and
a read barrier for a thread waits on exactly that partition.
"""

from __future__ import annotations

from functools import lru_cache

_M = 0x5BD1E995
_MASK = 0xFFFFFFFF


def murmur2(data: bytes) -> int:
    length = len(data)
    h = (0x9747B28C ^ length) & _MASK
    n4 = length // 4
    for i in range(n4):
        k = int.from_bytes(data[i * 4 : i * 4 + 4], "little")
        k = (k * _M) & _MASK
        k ^= k >> 24
        k = (k * _M) & _MASK
        h = (h * _M) & _MASK
        h ^= k
    rest = length & 3
    tail = n4 * 4
    if rest == 3:
        h ^= data[tail + 2] << 16
    if rest >= 2:
        h ^= data[tail + 1] << 8
    if rest >= 1:
        h ^= data[tail]
        h = (h * _M) & _MASK
    h ^= h >> 13
    h = (h * _M) & _MASK
    h ^= h >> 15
    return h


# Remembered: a judged proposal asks this several times (its key, each holder
# of an id it checks), a client once per call, always of the same few thousand
# thread ids; murmur2 in Python is ~1 us per 4 bytes of key.
@lru_cache(maxsize=65_536)
def partition_for(key: str, partitions: int) -> int:
    """Same result as Java's `Utils.toPositive(murmur2(key)) % partitions`."""
    return (murmur2(key.encode("utf-8")) & 0x7FFFFFFF) % partitions


def owner_partition(delivery_partition: int, events_partitions: int) -> int:
    """The events partition whose owner also owns this `deliveries` partition.

    Workers are given events partitions by their group; the run index of the
    delivery log goes with them so a thin client asks one owner per partition
    number (the identity when both topics have as many partitions, as
    threadlog creates them).
    """
    return delivery_partition % events_partitions
