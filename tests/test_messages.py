"""tl.messages end to end: command -> decider -> event -> projection (SPEC section 5)."""

from __future__ import annotations

import math

import pytest
from support import within

from threadlog import ThreadLogError

TRANSCRIPT = [
    {"role": "user", "content": "héllo wörld — 你好 🌍", "parts": [{"type": "text", "text": "a\nb"}]},
    {"role": "assistant", "content": None, "toolCalls": [{"id": "c1", "args": {"x": 1.5, "y": -0.1}}]},
    {"nested": {"deep": [[[1, 2.25, {"z": None}]]], "big": 2**53 + 1, "tiny": 5e-324}},
    "a bare string",
    42,
    3.141592653589793,
    None,
    True,
    [],
    {},
]


async def test_transcript_round_trips_deep_equal(tl):
    await within(tl.messages.save_thread("thread-a", TRANSCRIPT))
    loaded = await within(tl.messages.load_thread("thread-a"))
    assert loaded == TRANSCRIPT
    # Floats come back bit-exact, not merely close.
    assert loaded[1]["toolCalls"][0]["args"]["y"] == -0.1
    assert loaded[2]["nested"]["tiny"] == 5e-324


async def test_unknown_thread_is_empty(tl):
    assert await within(tl.messages.load_thread("never-saved")) == []


async def test_save_overwrites_whole_transcript(tl):
    await within(tl.messages.save_thread("t", [{"n": 1}, {"n": 2}]))
    await within(tl.messages.save_thread("t", [{"n": 3}]))
    assert await within(tl.messages.load_thread("t")) == [{"n": 3}]
    await within(tl.messages.save_thread("t", []))
    assert await within(tl.messages.load_thread("t")) == []


async def test_returned_transcript_is_a_fresh_copy(tl):
    await within(tl.messages.save_thread("t", [{"n": 1}]))
    first = await within(tl.messages.load_thread("t"))
    first[0]["n"] = 99
    first.append("mutated")
    assert await within(tl.messages.load_thread("t")) == [{"n": 1}]


@pytest.mark.parametrize("bad_id", ["", "\ud800", "a\udc00b", None, 5, b"bytes"])
async def test_invalid_thread_ids_are_refused_and_store_nothing(tl, bad_id):
    with pytest.raises(ThreadLogError) as err:
        await within(tl.messages.save_thread(bad_id, [{"n": 1}]))
    assert err.value.code == "INVALID_ARGUMENT"
    with pytest.raises(ThreadLogError) as err:
        await within(tl.messages.load_thread(bad_id))
    assert err.value.code == "INVALID_ARGUMENT"
    # Nothing reached the log: the events topic of the namespace is still empty.
    await tl.read_barrier(None)
    assert tl.runtime.judge is not None
    assert all(tl.runtime.judge.applied(p) == 1 for p in range(tl.runtime.layout.events))  # its rules floor marker only


@pytest.mark.parametrize(
    "bad",
    [
        [math.nan],
        [{"x": math.inf}],
        [{1: "non-string key"}],
        [{"s": {1, 2}}],
        [b"raw bytes"],
        [{"lone": "\ud800"}],
        "not a list",
        {"role": "user"},
    ],
)
async def test_non_json_transcripts_are_refused(tl, bad):
    await within(tl.messages.save_thread("t", [{"kept": True}]))
    with pytest.raises(ThreadLogError) as err:
        await within(tl.messages.save_thread("t", bad))
    assert err.value.code == "INVALID_ARGUMENT"
    assert await within(tl.messages.load_thread("t")) == [{"kept": True}]


async def test_thread_ids_are_exact_strings(tl):
    # Ids differing only by normalization, case or NUL are different threads.
    ids = ["Thread", "thread", "caf\u00e9", "cafe\u0301", "a\x00b", "a"]
    for n, tid in enumerate(ids):
        await within(tl.messages.save_thread(tid, [n]))
    for n, tid in enumerate(ids):
        assert await within(tl.messages.load_thread(tid)) == [n]


async def test_large_transcripts_round_trip_and_oversized_ones_are_refused(tl):
    big = [{"role": "tool", "content": "é" * (4 * 1024 * 1024)}]  # 8 MiB of UTF-8
    await within(tl.messages.save_thread("big", big), 60)
    assert await within(tl.messages.load_thread("big"), 60) == big
    too_big = [{"content": "x" * (16 * 1024 * 1024)}]
    with pytest.raises(ThreadLogError) as err:
        await within(tl.messages.save_thread("big", too_big))
    assert err.value.code == "INVALID_ARGUMENT"
    assert await within(tl.messages.load_thread("big"), 60) == big
