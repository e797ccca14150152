"""tl.metadata (SPEC section 9): a port of TanStack AI's metadata-store
conformance behaviours, plus exact keys, validation and cross-host reads."""

from __future__ import annotations

import math

import pytest
from support import state_of, within
from threadlog.projections.folds import metadata as state

from threadlog import ThreadLogError

VALUES = [
    {"nested": {"deep": [1, 2.5, None, True]}, "text": "héllo 🌍"},
    [1, "two", {"three": 3}],
    "a string",
    0,
    -1.25,
    5e-324,
    2**53 + 1,
    True,
    False,
    [],
    {},
]



async def test_absent_is_none(tl):
    assert await within(tl.metadata.get("ns", "k")) is None


@pytest.mark.parametrize("value", VALUES)
async def test_values_round_trip_exactly(tl, value):
    await within(tl.metadata.set("ns", "k", value))
    got = await within(tl.metadata.get("ns", "k"))
    assert got == value and type(got) is type(value)


async def test_set_overwrites_and_delete_removes(tl):
    await within(tl.metadata.set("ns", "k", {"v": 1}))
    await within(tl.metadata.set("ns", "k", {"v": 2}))
    assert await within(tl.metadata.get("ns", "k")) == {"v": 2}
    await within(tl.metadata.delete("ns", "k"))
    assert await within(tl.metadata.get("ns", "k")) is None
    await within(tl.metadata.set("ns", "k", "back"))
    assert await within(tl.metadata.get("ns", "k")) == "back"


async def test_deleting_an_absent_entry_is_silent_and_writes_nothing(tl):
    before = await state_of(tl)
    assert await within(tl.metadata.delete("ns", "never")) is None
    await within(tl.metadata.set("ns", "k", 1))
    after_set = await state_of(tl)
    await within(tl.metadata.delete("other-ns", "k"))
    assert await state_of(tl) == after_set != before
    assert await within(tl.metadata.get("ns", "k")) == 1


async def test_none_is_a_storable_value_that_reads_as_none(tl):
    await within(tl.metadata.set("ns", "k", None))
    assert await within(tl.metadata.get("ns", "k")) is None
    assert tl.runtime.store.get(state.value_key("ns", "k")) == b"null"  # stored, not absent


async def test_keys_never_collide_across_namespaces(tl):
    pairs = [("a:b", "c"), ("a", "b:c"), ("a", "b"), ("b", "a"), ("a\x00", "b"), ("a", "\x00b"),
             ("ns", "k"), ("NS", "k"), ("ns", "K"), ("a/b", "c"), ("a", "b/c"), ('["a"', '"b"]')]
    for n, (namespace, key) in enumerate(pairs):
        await within(tl.metadata.set(namespace, key, n))
    for n, (namespace, key) in enumerate(pairs):
        assert await within(tl.metadata.get(namespace, key)) == n, (namespace, key)
    await within(tl.metadata.delete("a:b", "c"))
    assert await within(tl.metadata.get("a:b", "c")) is None
    assert await within(tl.metadata.get("a", "b:c")) == 1


async def test_metadata_and_a_thread_sharing_a_partition_key_do_not_interfere(tl):
    # A thread whose id equals the synthetic partition key: harmless.
    thread_id = state.partition_key("ns", "k")
    await within(tl.messages.save_thread(thread_id, ["m"]))
    await within(tl.metadata.set("ns", "k", "v"))
    assert await within(tl.messages.load_thread(thread_id)) == ["m"]
    assert await within(tl.metadata.get("ns", "k")) == "v"


async def test_returned_values_are_fresh_copies(tl):
    await within(tl.metadata.set("ns", "k", {"list": [1]}))
    got = await within(tl.metadata.get("ns", "k"))
    got["list"].append(2)
    assert await within(tl.metadata.get("ns", "k")) == {"list": [1]}


@pytest.mark.parametrize("value", [math.nan, math.inf, {"x": -math.inf}, {1: "int key"}, {"s": {1}},
                                   b"bytes", object(), {"lone": "\ud800"}])
async def test_non_json_values_are_refused_and_change_nothing(tl, value):
    await within(tl.metadata.set("ns", "k", "kept"))
    before = await state_of(tl)
    with pytest.raises(ThreadLogError) as err:
        await within(tl.metadata.set("ns", "k", value))
    assert err.value.code == "INVALID_ARGUMENT"
    assert await state_of(tl) == before
    assert await within(tl.metadata.get("ns", "k")) == "kept"


# (not named `namespace`: that is the fixture giving each test its topics)
@pytest.mark.parametrize("meta_ns, key", [("", "k"), ("ns", ""), ("\ud800", "k"), ("ns", None), (1, "k")])
async def test_invalid_namespace_or_key_is_refused(tl, meta_ns, key):
    before = await state_of(tl)
    for call in (tl.metadata.get(meta_ns, key), tl.metadata.set(meta_ns, key, 1),
                 tl.metadata.delete(meta_ns, key)):
        with pytest.raises(ThreadLogError) as err:
            await within(call)
        assert err.value.code == "INVALID_ARGUMENT"
    assert await state_of(tl) == before


async def test_forged_commands_are_refused(tl):
    before = await state_of(tl)
    for key, payload in [("wrong-key", {"namespace": "ns", "key": "k", "value": "1"}),
                         (state.partition_key("ns", "k"), {"namespace": "ns", "key": "k", "value": "NaN"}),
                         (state.partition_key("ns", "k"), {"namespace": "ns", "key": "k", "value": "{"})]:
        with pytest.raises(ThreadLogError) as err:
            await within(tl.bus.send("threadlog.cmd.SetMetadata", key, payload))
        assert err.value.code == "INVALID_ARGUMENT"
    assert await state_of(tl) == before


async def test_a_second_client_reads_every_write_immediately(open_client):
    a = await open_client()
    b = await open_client()
    for n in range(10):
        await within(a.metadata.set("ns", f"k{n % 3}", n))
        assert await within(b.metadata.get("ns", f"k{n % 3}")) == n
    await within(b.metadata.delete("ns", "k0"))
    assert await within(a.metadata.get("ns", "k0")) is None
