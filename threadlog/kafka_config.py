"""librdkafka settings shared by every client threadlog creates."""

from __future__ import annotations

import logging

from .topics import MAX_MESSAGE_BYTES

_rdkafka_log = logging.getLogger("threadlog.rdkafka")


def base(bootstrap: str, client_id: str) -> dict:
    return {
        "bootstrap.servers": bootstrap,
        "client.id": client_id,
        "logger": _rdkafka_log,
        "socket.nagle.disable": True,
        "reconnect.backoff.ms": 50,
        "reconnect.backoff.max.ms": 2000,
    }


def producer(bootstrap: str, client_id: str, **extra) -> dict:
    return {
        **base(bootstrap, client_id),
        # Idempotent: a retried send never duplicates or reorders; implies acks=all.
        "enable.idempotence": True,
        "acks": "all",
        "linger.ms": 1,
        "message.max.bytes": MAX_MESSAGE_BYTES + 65536,
        **extra,
    }


def transactional_producer(bootstrap: str, client_id: str, transactional_id: str) -> dict:
    return producer(
        bootstrap,
        client_id,
        **{
            "transactional.id": transactional_id,
            # Bounds how long a crashed decider's open transaction can hold back
            # read_committed readers before the broker aborts it.
            "transaction.timeout.ms": 10000,
            # Back-to-back transactions meet CONCURRENT_TRANSACTIONS while the
            # previous commit's markers are written; retry fast (default 100 ms).
            "retry.backoff.ms": 2,
            "retry.backoff.max.ms": 20,
            "linger.ms": 0,
        },
    )


# A read_committed fetch waiting in the broker's purgatory is not woken when a
# commit marker makes records readable; it returns only at fetch.wait.max.ms
# (measured: a follower at 100 ms read other hosts' writes ~100 ms late). So
# the consumers that wait for *transactional* records poll with a short wait.
TXN_READER_WAIT_MS = 5


def consumer(bootstrap: str, client_id: str, **extra) -> dict:
    return {
        **base(bootstrap, client_id),
        "group.id": extra.pop("group.id", f"{client_id}.unused"),
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        # Only committed transactions are facts.
        "isolation.level": "read_committed",
        "auto.offset.reset": "earliest",
        "fetch.wait.max.ms": 100,
        "fetch.error.backoff.ms": 20,
        "max.partition.fetch.bytes": MAX_MESSAGE_BYTES + 65536,
        "fetch.max.bytes": 64 * 1024 * 1024,
        "receive.message.max.bytes": 80 * 1024 * 1024,
        **extra,
    }


def drain(consumer, max_messages: int, timeout: float) -> list:
    """Wait up to `timeout` for the first message, then take what is already here.

    `Consumer.consume(n, timeout)` blocks until it has n messages or the
    timeout passed, so on a quiet topic every batch would cost the full
    timeout; this returns as soon as anything arrived.
    """
    first = consumer.poll(timeout)
    if first is None:
        return []
    rest = consumer.consume(max_messages - 1, 0) if max_messages > 1 else []
    return [first, *rest]
