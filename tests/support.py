"""Helpers for tests: bounded waits and raw Kafka access to a namespace's topics."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Callable

from confluent_kafka import Consumer, KafkaError, TopicPartition


async def within(awaitable, seconds: float = 30.0):
    """Every wait in a test is bounded: a bug fails instead of hanging."""
    return await asyncio.wait_for(awaitable, seconds)


async def until(predicate, seconds: float = 30.0, what: str = "the condition") -> None:
    """Poll `predicate` (sync or async) every 20 ms until it holds; fail after
    `seconds`. For states no event announces to a test (a lease renewed in the
    background, a judge's ownership)."""
    deadline = time.monotonic() + seconds
    while True:
        got = predicate()
        if asyncio.iscoroutine(got):
            got = await got
        if got:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {seconds} s")
        await asyncio.sleep(0.02)


def read_topic(bootstrap: str, topic: str, partitions: int, timeout: float = 30.0, committed: bool = True) -> list:
    """Every record of `topic`, read to its end: committed only (read_committed), or everything written."""
    c = Consumer({
        "bootstrap.servers": bootstrap,
        "group.id": "test-reader",
        "enable.auto.commit": False,
        "isolation.level": "read_committed" if committed else "read_uncommitted",
        "enable.partition.eof": True,
    })
    c.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    out, eof = [], set()
    deadline = time.monotonic() + timeout
    try:
        while len(eof) < partitions:
            if time.monotonic() > deadline:
                raise TimeoutError(f"did not reach the end of {topic}")
            msg = c.poll(0.2)
            if msg is None:
                continue
            if msg.error():
                if msg.error().code() == KafkaError._PARTITION_EOF:
                    eof.add(msg.partition())
                continue
            eof.discard(msg.partition())
            out.append(msg)
    finally:
        c.close()
    return out


# Judge bookkeeping that a refused proposal does write: its verdict, the
# partition's decision time, the store's positions. Everything else is state.
_BOOKKEEPING = (b"jv", b"jc", b"jp", b"ja", b"\x00off")


def store_of(tl, key: str):
    """The store of the events partition that holds `key`'s state (fault injection writes there)."""
    return tl.runtime.stores.store_of(tl.runtime.partition_of(key))


async def state_of(tl) -> dict[bytes, bytes]:
    """Every key of the client's store after a read barrier, bookkeeping aside:
    equal before and after a call exactly when the call changed no state."""
    await tl.read_barrier(None)
    return {k: v for k, v in tl.runtime.store.scan(b"") if not k.startswith(_BOOKKEEPING)}


def raw_proposal(codec, type_name: str, key: str, body: dict | bytes, *, rules: int = 2,
                 seen: list[int] | None = None, proposal_id: str | None = None, at: float = 1.0) -> bytes:
    """A `threadlog.Proposal` as any producer could write it to `events`: `body`
    encoded as `type_name` (bytes: already encoded), naming `rules` and the
    positions `seen` (none by default)."""
    return codec.encode("threadlog.Proposal", {
        "proposalId": proposal_id or uuid.uuid4().hex, "key": key, "type": type_name, "at": at, "rules": rules,
        "seen": seen or [], "payload": body if isinstance(body, bytes) else codec.encode(type_name, body)})


def encode_frozen(name: str, version: int, record: dict) -> bytes:
    """`record` encoded with frozen version `version` of schema `name` (what a
    writer of that version wrote), as the codec frames it."""
    import io

    from fastavro import schemaless_writer
    from threadlog.schemas.codec import MARKER, load_history

    source = f"{name}.v{version}.avsc"
    frozen = next(v for v in load_history() if v.source == source)
    buf = io.BytesIO()
    buf.write(MARKER + frozen.fingerprint)
    schemaless_writer(buf, frozen.schema, record)
    return buf.getvalue()


def namespace_of_an_earlier_version(bootstrap: str, namespace: str, partitions: int = 4) -> None:
    """Create the namespace's topics as threadlog before judging rules 7 did: with
    no rules floor marker, so its partitions judge each raw proposal by the rules
    it names until one of rules >= 4 lands there (tests of older logs' verdicts)."""
    from confluent_kafka.admin import AdminClient

    from threadlog.kernel.topics import Topics, ensure_topics

    ensure_topics(AdminClient({"bootstrap.servers": bootstrap}), Topics(namespace), partitions=partitions)


def in_forked_child(report: Callable[[], str]) -> str:
    """Run `report` in an os.fork child and return what it returned (the child
    leaves at once after: no pytest teardown, no Kafka). The child's exception is
    reported as "error <repr>"."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            try:
                said = report()
            except BaseException as exc:
                said = f"error {exc!r}"
            os.write(write_end, said.encode())
        finally:
            os._exit(0)
    os.close(write_end)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(read_end) as reader:
        said = reader.read()
    assert status == 0, said
    return said
