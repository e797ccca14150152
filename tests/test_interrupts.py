"""tl.interrupts (SPEC section 7): a port of TanStack AI's interrupt-store
conformance behaviours, plus the first-decision race, validation and cross-host reads."""

from __future__ import annotations

import asyncio
import math

import pytest
from support import state_of, within

from threadlog import ThreadLogError


def _record(interrupt_id="i1", run_id="r1", thread_id="t1", requested_at=100, payload=None):
    return {"interruptId": interrupt_id, "runId": run_id, "threadId": thread_id,
            "requestedAt": requested_at, "payload": {"tool": "approve"} if payload is None else payload}


async def test_create_stores_a_pending_interrupt(tl):
    assert await within(tl.interrupts.create(_record(payload={"q": "ok?", "n": [1, 2.5, None]}))) is None
    assert await within(tl.interrupts.get("i1")) == {
        "interruptId": "i1", "runId": "r1", "threadId": "t1", "status": "pending", "requestedAt": 100,
        "payload": {"q": "ok?", "n": [1, 2.5, None]},
    }
    assert await within(tl.interrupts.get("unknown")) is None


async def test_create_is_insert_if_absent(tl):
    await within(tl.interrupts.create(_record(payload={"v": 1})))
    await within(tl.interrupts.resolve("i1", {"approved": True}))
    decided = await within(tl.interrupts.get("i1"))
    # Same id again -- same thread, then another thread: never overwritten, nothing revived.
    await within(tl.interrupts.create(_record(payload={"v": 2}, requested_at=5)))
    await within(tl.interrupts.create(_record(thread_id="t-other", run_id="r-other", payload={"v": 3})))
    assert await within(tl.interrupts.get("i1")) == decided
    assert await within(tl.interrupts.list("t-other")) == []
    assert await within(tl.interrupts.list_by_run("r-other")) == []


async def test_resolve_sets_resolved_at_and_response_and_returns_the_record(tl):
    await within(tl.interrupts.create(_record()))
    got = await within(tl.interrupts.resolve("i1", {"approved": True, "note": "é"}))
    assert got["status"] == "resolved" and got["response"] == {"approved": True, "note": "é"}
    assert isinstance(got["resolvedAt"], (int, float)) and not isinstance(got["resolvedAt"], bool)
    assert got == await within(tl.interrupts.get("i1"))


@pytest.mark.parametrize("response", [0, False, "", [], {}, "text", [1, {"a": None}]])
async def test_falsy_and_non_object_responses_are_kept(tl, response):
    await within(tl.interrupts.create(_record()))
    assert (await within(tl.interrupts.resolve("i1", response)))["response"] == response
    assert (await within(tl.interrupts.get("i1")))["response"] == response


async def test_resolve_without_response_stores_no_response_key(tl):
    await within(tl.interrupts.create(_record()))
    got = await within(tl.interrupts.resolve("i1"))
    assert got["status"] == "resolved" and "response" not in got and "resolvedAt" in got
    assert "response" not in await within(tl.interrupts.get("i1"))


async def test_cancel_and_first_decision_is_final(tl):
    await within(tl.interrupts.create(_record("a")))
    await within(tl.interrupts.create(_record("b")))
    cancelled = await within(tl.interrupts.cancel("a"))
    assert cancelled["status"] == "cancelled" and "response" not in cancelled
    assert await within(tl.interrupts.resolve("a", {"late": True})) == cancelled
    assert await within(tl.interrupts.cancel("a")) == cancelled
    resolved = await within(tl.interrupts.resolve("b", 1))
    assert await within(tl.interrupts.cancel("b")) == resolved
    assert await within(tl.interrupts.resolve("b", 2)) == resolved
    assert await within(tl.interrupts.get("b")) == resolved


async def test_deciding_an_unknown_interrupt_is_a_no_op(tl):
    before = await state_of(tl)
    assert await within(tl.interrupts.resolve("ghost", {"x": 1})) is None
    assert await within(tl.interrupts.cancel("ghost")) is None
    assert await within(tl.interrupts.get("ghost")) is None
    assert await state_of(tl) == before


async def test_lists_are_ordered_by_requested_at_then_id_bytes(tl):
    rows = [("c", "r1", "t1", 30), ("b", "r1", "t1", 10), ("é", "r2", "t1", 20), ("z", "r1", "t1", 20),
            ("a", "r2", "t1", 20), ("Z", "r1", "t1", 20), ("x", "r1", "t2", 5)]
    for interrupt_id, run_id, thread_id, at in rows:
        await within(tl.interrupts.create(_record(interrupt_id, run_id, thread_id, at)))
    await within(tl.interrupts.resolve("z"))
    await within(tl.interrupts.cancel("b"))
    ids = lambda records: [r["interruptId"] for r in records]  # noqa: E731
    assert ids(await within(tl.interrupts.list("t1"))) == ["b", "Z", "a", "z", "é", "c"]
    assert ids(await within(tl.interrupts.list_pending("t1"))) == ["Z", "a", "é", "c"]
    # A run's interrupts span threads: x (t2) belongs to r1 too.
    assert ids(await within(tl.interrupts.list_by_run("r1"))) == ["x", "b", "Z", "z", "c"]
    assert ids(await within(tl.interrupts.list_pending_by_run("r1"))) == ["x", "Z", "c"]
    assert ids(await within(tl.interrupts.list_by_run("r2"))) == ["a", "é"]
    assert await within(tl.interrupts.list("nobody")) == []
    assert await within(tl.interrupts.list_by_run("nobody")) == []


async def test_a_resolve_racing_a_cancel_leaves_exactly_one_decision(open_client):
    a = await open_client()
    b = await open_client()
    for n in range(8):
        await within(a.interrupts.create(_record(f"i{n}", thread_id=f"t{n}")))
    for n in range(8):
        resolved, cancelled = await within(asyncio.gather(
            a.interrupts.resolve(f"i{n}", {"by": "a"}), b.interrupts.cancel(f"i{n}")))
        stored = await within(b.interrupts.get(f"i{n}"))
        # Both callers are told the one stored outcome, whichever came first.
        assert resolved == cancelled == stored
        assert stored["status"] in ("resolved", "cancelled")
        assert ("response" in stored) == (stored["status"] == "resolved")
        assert await within(a.interrupts.list_pending(f"t{n}")) == []


async def test_a_second_client_reads_every_interrupt_write_immediately(open_client):
    a = await open_client()
    b = await open_client()
    for n in range(5):
        await within(a.interrupts.create(_record(f"i{n}", thread_id=f"t{n % 2}")))
        assert (await within(b.interrupts.get(f"i{n}")))["status"] == "pending"
        assert f"i{n}" in [r["interruptId"] for r in await within(b.interrupts.list_pending_by_run("r1"))]
        await within(b.interrupts.resolve(f"i{n}", n))
        assert (await within(a.interrupts.get(f"i{n}")))["response"] == n
        assert f"i{n}" not in [r["interruptId"] for r in await within(a.interrupts.list_pending(f"t{n % 2}"))]


async def test_returned_records_are_fresh_copies(tl):
    await within(tl.interrupts.create(_record(payload={"a": [1]})))
    got = await within(tl.interrupts.get("i1"))
    got["payload"]["a"].append(2)
    (await within(tl.interrupts.list("t1")))[0]["status"] = "resolved"
    assert await within(tl.interrupts.get("i1")) == {**got, "payload": {"a": [1]}}


BAD_RECORDS = [
    ({**_record(), "status": "pending"}, "status is not an input"),
    ({**_record(), "resolvedAt": 1}, "resolvedAt is not an input"),
    ({**_record(), "response": 1}, "response is not an input"),
    ({**_record(), "extra": 1}, "unexpected key"),
    ({k: v for k, v in _record().items() if k != "payload"}, "missing payload"),
    ({k: v for k, v in _record().items() if k != "runId"}, "missing runId"),
    (_record(interrupt_id=""), "empty id"),
    (_record(interrupt_id="\ud800"), "lone surrogate id"),
    (_record(run_id=5), "int run id"),
    (_record(thread_id=None), "None thread id"),
    (_record(requested_at="1"), "str requestedAt"),
    (_record(requested_at=True), "bool requestedAt"),
    (_record(requested_at=math.nan), "NaN requestedAt"),
    ({**_record(), "payload": [1]}, "list payload"),
    ({**_record(), "payload": "x"}, "str payload"),
    ({**_record(), "payload": {"x": math.inf}}, "non-JSON payload"),
    ({**_record(), "payload": {1: "x"}}, "non-str payload key"),
    ("i1", "not a dict"),
]


@pytest.mark.parametrize("record, why", BAD_RECORDS)
async def test_bad_records_are_refused_and_change_nothing(tl, record, why):
    await within(tl.interrupts.create(_record("keep")))
    before = await state_of(tl)
    with pytest.raises(ThreadLogError) as err:
        await within(tl.interrupts.create(record))
    assert err.value.code == "INVALID_ARGUMENT", why
    assert await state_of(tl) == before
    assert [r["interruptId"] for r in await within(tl.interrupts.list("t1"))] == ["keep"]
    assert await within(tl.interrupts.get("i1")) is None


async def test_bad_ids_and_responses_are_refused(tl):
    await within(tl.interrupts.create(_record()))
    before = await state_of(tl)
    for bad in ("", "\ud800", None, 1):
        for method in (tl.interrupts.get, tl.interrupts.cancel, tl.interrupts.resolve, tl.interrupts.list,
                       tl.interrupts.list_pending, tl.interrupts.list_by_run, tl.interrupts.list_pending_by_run):
            with pytest.raises(ThreadLogError) as err:
                await within(method(bad))
            assert err.value.code == "INVALID_ARGUMENT", (method.__name__, bad)
    for response in (math.nan, {"x": {1, 2}}, b"bytes", "\ud800"):
        with pytest.raises(ThreadLogError) as err:
            await within(tl.interrupts.resolve("i1", response))
        assert err.value.code == "INVALID_ARGUMENT"
    assert await state_of(tl) == before
    assert (await within(tl.interrupts.get("i1")))["status"] == "pending"


async def test_forged_decisions_are_refused_by_the_decider(tl):
    await within(tl.interrupts.create(_record()))
    before = await state_of(tl)
    for payload in ({"interruptId": "i1", "threadId": "t1", "status": "pending", "response": None},
                    {"interruptId": "i1", "threadId": "t1", "status": "cancelled", "response": "1"},
                    {"interruptId": "i1", "threadId": "t1", "status": "resolved", "response": "{nope"},
                    {"interruptId": "i1", "threadId": "t1", "status": "resolved", "response": "NaN"},
                    {"interruptId": "", "threadId": "t1", "status": "resolved", "response": None}):
        with pytest.raises(ThreadLogError) as err:
            await within(tl.bus.send("threadlog.cmd.DecideInterrupt", "t1", payload))
        assert err.value.code == "INVALID_ARGUMENT", payload
    with pytest.raises(ThreadLogError) as err:
        await within(tl.bus.send("threadlog.cmd.CreateInterrupt", "t1", {
            "interruptId": "i2", "runId": "r", "threadId": "t1", "requestedAt": 1, "payload": "[]"}))
    assert err.value.code == "INVALID_ARGUMENT"
    assert await state_of(tl) == before
    assert (await within(tl.interrupts.get("i1")))["status"] == "pending"
