"""Bad input on the topics never stops a processor (DESIGN: the decider never
stops on bad input; a poison event is skipped by the follower)."""

from __future__ import annotations

import asyncio

import pytest
from confluent_kafka import Producer
from support import within

from threadlog import ThreadLogError
from threadlog.partitioning import partition_for

GARBAGE = [
    b"",  # empty value
    b"\x00\x01\x02 not avro at all",
    b"\xc3\x01" + b"\xff" * 8 + b"unknown fingerprint",
    b"\xc3\x01",  # marker only, truncated header
    bytes(range(256)) * 4,
]


def _produce_raw(bootstrap: str, topic: str, partition: int, values: list[bytes]) -> None:
    p = Producer({"bootstrap.servers": bootstrap})
    for v in values:
        p.produce(topic, v, b"garbage", partition=partition)
    p.produce(topic, None, b"null-value", partition=partition)  # a tombstone-like record
    assert p.flush(10) == 0


async def test_garbage_commands_are_skipped_and_the_decider_keeps_serving(tl, bootstrap):
    part = partition_for("t", tl.runtime.layout.commands)
    _produce_raw(bootstrap, tl.runtime.topics.commands, part, GARBAGE)
    # The next valid command on the same partition is decided normally.
    await within(tl.messages.save_thread("t", ["after garbage"]))
    assert await within(tl.messages.load_thread("t")) == ["after garbage"]
    decider = tl.runtime.decider
    assert decider.alive and decider.failure is None
    assert decider.stats["poison"] == len(GARBAGE) + 1


async def test_undecodable_payload_is_refused_with_a_code(tl):
    with pytest.raises(ThreadLogError) as err:
        await within(tl.bus.send_encoded("threadlog.cmd.SaveTranscript", "t", b"\xc3\x01garbage!"))
    assert err.value.code == "INVALID_MESSAGE"
    # A payload of the wrong schema for the declared type is refused too.
    other = tl.runtime.codec.encode("threadlog.Reply", {"commandId": "x", "clientId": "y", "ok": True})
    with pytest.raises(ThreadLogError) as err:
        await within(tl.bus.send_encoded("threadlog.cmd.SaveTranscript", "t", other))
    assert err.value.code == "INVALID_MESSAGE"
    assert await within(tl.messages.load_thread("t")) == []
    await within(tl.messages.save_thread("t", [1]))
    assert await within(tl.messages.load_thread("t")) == [1]


async def test_unknown_command_type_is_refused(tl):
    # A well-formed payload whose type no handler decides (e.g. from a newer client).
    payload = tl.runtime.codec.encode("threadlog.evt.TranscriptSaved", {"threadId": "t", "messages": "[]"})
    with pytest.raises(ThreadLogError) as err:
        await within(tl.bus.send_encoded("threadlog.evt.TranscriptSaved", "t", payload))
    assert err.value.code == "INVALID_ARGUMENT"
    assert "unknown command type" in err.value.message


async def test_poison_events_are_skipped_by_the_follower(tl, open_client, bootstrap):
    await within(tl.messages.save_thread("t", ["before"]))
    part = partition_for("t", tl.runtime.layout.events)
    _produce_raw(bootstrap, tl.runtime.topics.events, part, GARBAGE)
    await within(tl.messages.save_thread("t", ["after"]))
    # A fresh client folds the whole log, garbage included, and still answers.
    fresh = await open_client(processors="external")
    assert await within(fresh.messages.load_thread("t")) == ["after"]
    assert fresh.runtime.follower.skipped == len(GARBAGE) + 1
    assert await within(tl.messages.load_thread("t")) == ["after"]


async def test_a_decision_kafka_cannot_record_is_refused_not_retried_forever(tl, monkeypatch):
    # A decision whose event exceeds the events topic's record limit: Kafka
    # refuses the record for good. The decider must refuse that command and
    # keep serving the others decided in the same batches -- not retry forever.
    from threadlog.processors import handlers

    original = handlers.HANDLERS["threadlog.cmd.SaveTranscript"]

    def oversized(ctx, cmd):
        if cmd["messages"] == '["boom"]':
            return handlers.Decision(events=[("threadlog.evt.TranscriptSaved", {
                "threadId": cmd["threadId"], "messages": '["' + "x" * (17 * 1024 * 1024) + '"]'})])
        return original(ctx, cmd)

    monkeypatch.setitem(handlers.HANDLERS, "threadlog.cmd.SaveTranscript", oversized)

    async def save(tid, msgs):
        try:
            await tl.messages.save_thread(tid, msgs)
            return "ok"
        except ThreadLogError as exc:
            return exc.code

    outcomes = await within(asyncio.gather(*[save(f"t{n}", ["boom"] if n == 3 else [n]) for n in range(8)]), 60)
    assert outcomes == ["ok", "ok", "ok", "INVALID_ARGUMENT", "ok", "ok", "ok", "ok"]
    for n in range(8):
        assert await within(tl.messages.load_thread(f"t{n}")) == ([] if n == 3 else [n])
    assert tl.runtime.decider.alive and tl.runtime.decider.failure is None
