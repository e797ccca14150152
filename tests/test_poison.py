"""Bad input on the topics never stops a judge: a record that is not a
proposal is judged refused (`INVALID_MESSAGE`), changes nothing, and the next
proposal on the same partition is judged normally."""

from __future__ import annotations

import asyncio

import pytest
from confluent_kafka import Producer
from support import within
from threadlog.processors.judge import all_verdicts

from threadlog import ThreadLogError
from threadlog.kernel.partitioning import partition_for

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


async def test_garbage_records_are_judged_refused_and_the_judge_keeps_judging(tl, bootstrap):
    await within(tl.messages.save_thread("t", ["before"]))
    part = partition_for("t", tl.runtime.layout.events)
    _produce_raw(bootstrap, tl.runtime.topics.events, part, GARBAGE)
    # The next valid proposal on the same partition is judged normally.
    await within(tl.messages.save_thread("t", ["after garbage"]))
    assert await within(tl.messages.load_thread("t")) == ["after garbage"]
    judge = tl.runtime.judge
    assert judge.stats["poison"] == len(GARBAGE) + 1
    refused_codes = [v["code"] for _, v in all_verdicts(tl.runtime.store, part) if not v["ok"]]
    assert refused_codes == ["INVALID_MESSAGE"] * (len(GARBAGE) + 1)


async def test_undecodable_payload_is_refused_with_a_code(tl):
    with pytest.raises(ThreadLogError) as err:
        await within(tl.bus.send_encoded("threadlog.cmd.SaveTranscript", "t", b"\xc3\x01garbage!"))
    assert err.value.code == "INVALID_MESSAGE"
    # A payload of the wrong schema for the declared type is refused too.
    other = tl.runtime.codec.encode("threadlog.cmd.SetMetadata", {"namespace": "n", "key": "k", "value": "1"})
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
    assert "unknown proposal type" in err.value.message


async def test_a_fresh_host_judges_the_garbage_alike(tl, open_client, bootstrap):
    await within(tl.messages.save_thread("t", ["before"]))
    part = partition_for("t", tl.runtime.layout.events)
    _produce_raw(bootstrap, tl.runtime.topics.events, part, GARBAGE)
    await within(tl.messages.save_thread("t", ["after"]))
    # A fresh client judges the whole log, garbage included, and still answers.
    fresh = await open_client()  # a fresh full replica: its own judge is inspected
    assert await within(fresh.messages.load_thread("t")) == ["after"]
    assert fresh.runtime.judge.stats["poison"] == len(GARBAGE) + 1
    assert all_verdicts(fresh.runtime.store, part) == all_verdicts(tl.runtime.store, part)
    assert await within(tl.messages.load_thread("t")) == ["after"]


async def test_a_rule_that_fails_refuses_its_proposal_and_only_that_one(tl, monkeypatch):
    # A bug in one rule (here: an effect no fold can apply) must refuse that
    # proposal -- deterministically, the same for every judge -- and leave the
    # others judged in the same batches alone; the judge never stops.
    from threadlog.processors import handlers

    original = handlers.HANDLERS["threadlog.cmd.SaveTranscript"]

    def broken(ctx, cmd):
        if cmd["messages"] == '["boom"]':
            return handlers.Decision(events=[("threadlog.evt.TranscriptSaved", {"threadId": cmd["threadId"]})])
        return original(ctx, cmd)

    monkeypatch.setitem(handlers.HANDLERS, "threadlog.cmd.SaveTranscript", broken)

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
    await within(tl.messages.save_thread("t3", [3]))
    assert await within(tl.messages.load_thread("t3")) == [3]


async def test_a_proposal_written_under_a_clients_next_id_cannot_answer_for_its_write(tl, bootstrap):
    # Tried (a review): proposal ids were a per-process prefix plus a visible counter.
    # Anyone who can write `events` read a client's last id from the log, wrote a
    # harmless accepted proposal under each of its next ids (one per partition), and
    # the client's next save_thread was answered with that verdict ("already
    # applied"): success, nothing stored. Ids are now a keyed hash of the counter.
    from support import raw_proposal, read_topic

    await within(tl.messages.save_thread("victim", ["v1"]))
    n = tl.runtime.layout.events
    codec = tl.runtime.codec
    ids = [codec.decode(r.value(), expect="threadlog.Proposal")[1]["proposalId"]
           for r in read_topic(bootstrap, tl.runtime.topics.events, n)]
    last = ids[-1]
    guesses = {f"{last[:24]}{int(last[24:], 16) + k:x}" for k in range(1, 4)}  # the old scheme's next ids
    guesses |= {f"{last[:-1]}{c}" for c in "0123456789abcdef"}  # and anything one digit away
    forger = Producer({"bootstrap.servers": bootstrap})
    for pid in guesses:
        for p in range(n):
            key = next(f"atk-{i}" for i in range(10_000) if partition_for(f"atk-{i}", n) == p)
            forger.produce(tl.runtime.topics.events, raw_proposal(
                codec, "threadlog.cmd.SaveTranscript", key, {"threadId": key, "messages": "[]"}, rules=4,
                proposal_id=pid), key.encode(), partition=p)
    assert forger.flush(30) == 0
    await within(tl.messages.save_thread("victim", ["v2"]))
    assert await within(tl.messages.load_thread("victim")) == ["v2"]
