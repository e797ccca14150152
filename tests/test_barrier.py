"""The read barrier against transactional writes: trailing commit and abort
markers occupy offsets no consumer yields, and must never make a read hang."""

from __future__ import annotations

import uuid

from confluent_kafka import Producer
from support import within

from threadlog.partitioning import partition_for


async def test_barrier_passes_trailing_commit_markers(tl, open_client):
    for n in range(5):
        await within(tl.messages.save_thread("t", [n]))
    part = partition_for("t", tl.runtime.layout.events)
    stable = tl.runtime.barrier.stable_offsets_sync()[part]
    # 5 events, each followed by its transaction's commit marker: the stable
    # offset lies past a marker, beyond the last record any consumer yields.
    fresh = await open_client(processors="external")
    assert await within(fresh.messages.load_thread("t"), 20) == [4]
    assert fresh.runtime.follower.applied(part) >= stable
    assert fresh.runtime.store.offset(tl.runtime.topics.events, part) < stable


async def test_barrier_passes_an_aborted_transaction_at_the_tail(tl, bootstrap, open_client):
    await within(tl.messages.save_thread("t", ["committed"]))
    part = partition_for("t", tl.runtime.layout.events)
    p = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"test-abort-{uuid.uuid4().hex[:6]}"})
    p.init_transactions(30)
    p.begin_transaction()
    p.produce(tl.runtime.topics.events, b"never visible", b"t", partition=part)
    p.flush(30)
    p.abort_transaction(30)
    # The aborted record and its abort marker sit at the end of the partition.
    before = tl.runtime.barrier.stable_offsets_sync()[part]
    fresh = await open_client(processors="external")
    assert await within(fresh.messages.load_thread("t"), 20) == ["committed"]
    assert await within(tl.messages.load_thread("t"), 20) == ["committed"]
    assert fresh.runtime.follower.applied(part) >= before
    assert fresh.runtime.follower.skipped == 0  # the aborted record was never delivered


async def test_barrier_waits_for_an_open_transaction_to_end(tl, bootstrap):
    # A write in flight (transaction open) holds the stable offset back; a read
    # that began before it commits does not wait for it, and after the commit
    # the next read does see it.
    part = partition_for("t", tl.runtime.layout.events)
    p = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"test-open-{uuid.uuid4().hex[:6]}"})
    p.init_transactions(30)
    p.begin_transaction()
    codec = tl.runtime.codec
    payload = codec.encode("threadlog.evt.TranscriptSaved", {"threadId": "t", "messages": '["in flight"]'})
    env = {"key": "t", "seq": 1, "decidedAt": 0.0, "commandId": "x", "type": "threadlog.evt.TranscriptSaved",
           "payload": payload}
    p.produce(tl.runtime.topics.events, codec.encode("threadlog.Event", env), b"t", partition=part)
    p.flush(30)
    assert await within(tl.messages.load_thread("t"), 20) == []
    p.commit_transaction(30)
    assert await within(tl.messages.load_thread("t"), 20) == ["in flight"]
    wm = tl.runtime.barrier.stable_offsets_sync()[part]
    assert wm == 2  # one record + its commit marker
