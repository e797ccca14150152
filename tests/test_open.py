"""`threadlog.open` options and isolation (SPEC section 2)."""

from __future__ import annotations

import time

import pytest
from confluent_kafka.admin import AdminClient
from support import within

import threadlog
from threadlog import ThreadLogError
from threadlog.kernel.topics import Topics, delete_topics


@pytest.mark.parametrize(
    "kwargs",
    [
        {"namespace": "has space"},
        {"namespace": ""},
        {"namespace": "slash/ns"},
        {"namespace": "ünïcode"},
        {"namespace": "ends-in-newline\n"},
        {"namespace": "."},  # a folder under the state root: the root itself, or its parent
        {"namespace": ".."},
        # Past 238 its `.deliveries` topic passes Kafka's 249 characters: refused by
        # the cluster, this was UNAVAILABLE, "retry later" (a review).
        {"namespace": "a" * 239},
        {"lease_duration_ms": 1000, "renew_after_ms": 1000},
        {"lease_duration_ms": 1000, "renew_after_ms": 2000},
        {"lease_duration_ms": 0},
        {"lease_duration_ms": 31 * 24 * 3600 * 1000},  # over the judge's 30 days: every acquire was refused
        {"renew_after_ms": -1},
        {"lease_duration_ms": True},
        {"first_chunk_wait_ms": 0},
        {"processors": "sometimes"},
        {"clock": "not callable"},
    ],
)
def test_bad_options_are_refused_by_open_itself(kwargs):
    with pytest.raises(ThreadLogError) as err:
        threadlog.open("127.0.0.1:1", **kwargs)
    assert err.value.code == "INVALID_ARGUMENT"


async def test_the_longest_namespace_opens_and_names_every_topic_kafka_takes(open_client, namespace, bootstrap):
    ns = (namespace + "-").ljust(238, "n")  # fresh, as the fixture's
    try:
        tl = await open_client(namespace=ns)
        await within(tl.messages.save_thread("t", ["long"]))
        assert await within(tl.messages.load_thread("t")) == ["long"]
        assert max(map(len, tl.runtime.topics.all())) == 249
        await tl.close()
    finally:
        delete_topics(AdminClient({"bootstrap.servers": bootstrap}), Topics(ns), timeout=10)


async def test_unreachable_cluster_fails_bounded_with_unavailable(tmp_path):
    started = time.monotonic()
    with pytest.raises(ThreadLogError) as err:
        await within(
            threadlog.open("127.0.0.1:1", namespace="nowhere", state_dir=str(tmp_path),
                           request_timeout_ms=3000),
            30,
        )
    assert err.value.code == "UNAVAILABLE"
    assert time.monotonic() - started < 20


async def test_namespaces_share_nothing(open_client, namespace):
    a = await open_client()
    b = await open_client(namespace=namespace + "-other")
    try:
        await within(a.messages.save_thread("t", ["in a"]))
        assert await within(b.messages.load_thread("t")) == []
        await within(b.messages.save_thread("t", ["in b"]))
        assert await within(a.messages.load_thread("t")) == ["in a"]
    finally:
        await b.close()
        from confluent_kafka.admin import AdminClient

        from threadlog.kernel.topics import Topics, delete_topics

        delete_topics(AdminClient({"bootstrap.servers": b.opts.bootstrap_servers}), Topics(b.opts.namespace))


async def test_open_is_idempotent_on_existing_topics(open_client):
    a = await open_client()
    b = await open_client()  # topics exist: creation is a no-op, layout read back
    assert a.runtime.layout == b.runtime.layout


async def test_await_open_without_context_manager(bootstrap, namespace, tmp_path):
    tl = await within(threadlog.open(bootstrap, namespace=namespace, state_dir=str(tmp_path)))
    try:
        await within(tl.messages.save_thread("t", [1]))
        assert await within(tl.messages.load_thread("t")) == [1]
    finally:
        await tl.close()
    with pytest.raises(ThreadLogError) as err:
        await tl.messages.load_thread("t")
    assert err.value.code == "UNAVAILABLE"


def _rdkafka_threads() -> set[int]:
    """Ids of the OS threads of librdkafka handles in this process (named rdk:...)."""
    import os

    tids = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().startswith("rdk:"):
                    tids.add(int(tid))
        except OSError:  # ended meanwhile
            continue
    return tids


async def _until_ended(tids: set[int], timeout: float = 15) -> set[int]:
    """The threads of `tids` still running once they all ended or `timeout` passed."""
    import asyncio

    deadline = time.monotonic() + timeout
    while (left := tids & _rdkafka_threads()) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return left


@pytest.mark.parametrize("processors", ["embedded", "external"])
async def test_close_ends_the_clients_kafka_handles_while_it_is_still_referenced(open_client, processors):
    """A closed client sits in reference cycles; its producers lived until a full
    garbage collection -- for good while the application kept the client (a soak
    helper: 40 clients opened and closed in turn held 15 Kafka handles at once).
    Tried: open, write, close, keep the reference, no garbage collection.

    Threads are told apart by id, not counted: a live client's handles still
    start threads after it opened (librdkafka's thread per learned broker); a
    count taken beside one failed CI once (22 > 21) with nothing left running
    of the closed client."""
    import gc

    present = _rdkafka_threads()
    warm = await open_client(processors=processors)  # a thin client's worker starts with it
    await warm.close()
    assert not await _until_ended(_rdkafka_threads() - present), "the first closed client's threads still run"
    before = _rdkafka_threads()
    gc.disable()
    try:
        tl = await open_client(processors=processors)
        await within(tl.messages.save_thread("t", ["one"]))
        mine = _rdkafka_threads() - before
        assert mine, "the client's handles run no thread of their own?"
        await tl.close()
        assert not await _until_ended(mine), "a closed client's librdkafka threads still run"
        with pytest.raises(ThreadLogError):  # and it refuses calls, as before
            await within(tl.messages.save_thread("t", ["one", "two"]))
    finally:
        gc.enable()
