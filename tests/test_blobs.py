"""tl.blobs (SPEC section 10): a Python port of TanStack AI's blob conformance behaviours, on a real broker.

Round trips at 0 B, 1 B, 1 MiB + 1 and 8 MiB; every body kind; ranges with
validation and clamping; head, silent delete, list by literal prefix with
cursor paging; overwrite semantics; read-your-writes from a second client;
bad input refused with INVALID_ARGUMENT and nothing changed.
"""

from __future__ import annotations

import array
import os
import tracemalloc

import pytest
from support import within
from threadlog.producers.blob_chunks import CHUNK_SIZE
from threadlog.projections.folds import blobs as state

from threadlog import ThreadLogError
from threadlog.kernel.topics import specs

MiB = 1024 * 1024
RECORD_KEYS = {"key", "size", "etag", "contentType", "customMetadata", "createdAt", "updatedAt"}


def blob_topic_max_message_bytes() -> int:
    from threadlog.kernel.topics import Topics

    (blobs,) = [t for t in specs(Topics("x"), 1, 1) if t.topic == "x.blobs"]
    return int(blobs.config["max.message.bytes"])


async def expect_invalid(awaitable) -> ThreadLogError:
    with pytest.raises(ThreadLogError) as err:
        await within(awaitable)
    assert err.value.code == "INVALID_ARGUMENT", err.value
    return err.value


class Clock:
    def __init__(self, now: int = 1_000) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# -- round trips ----------------------------------------------------------------------
@pytest.mark.parametrize("size", [0, 1, MiB + 1, 8 * MiB], ids=["0B", "1B", "1MiB+1", "8MiB"])
async def test_round_trip_sizes(tl, size):
    data = os.urandom(size)
    rec = await within(tl.blobs.put("objects/blob", data))
    assert set(rec) == {"key", "size", "etag", "createdAt", "updatedAt"}  # no optional field was given
    assert rec["key"] == "objects/blob" and rec["size"] == size
    assert isinstance(rec["etag"], str) and rec["etag"]
    assert isinstance(rec["createdAt"], int) and rec["createdAt"] == rec["updatedAt"]

    got = await within(tl.blobs.get("objects/blob"))
    assert got["body"] == data
    assert "range" not in got  # only a ranged read reports a range
    assert {k: v for k, v in got.items() if k != "body"} == rec
    assert await within(tl.blobs.head("objects/blob")) == rec

    layout = tl.runtime.store.get_json(state.layout_key("objects/blob"))
    assert len(layout["chunks"]) == -(-size // CHUNK_SIZE)
    if size == 8 * MiB:
        # Far larger than one record of the blobs topic may be.
        assert size > 3 * blob_topic_max_message_bytes()


async def test_blob_sizes_straddling_the_chunk_size(tl):
    for size in (CHUNK_SIZE - 1, CHUNK_SIZE, CHUNK_SIZE + 1, 2 * CHUNK_SIZE):
        data = os.urandom(size)
        await within(tl.blobs.put(f"s{size}", data))
        assert (await within(tl.blobs.get(f"s{size}")))["body"] == data


# -- bodies -----------------------------------------------------------------------------
def strided(data: bytes) -> memoryview:
    """A view of `data` that is not contiguous: every other byte of a buffer twice as long."""
    spread = bytearray(2 * len(data))
    spread[::2] = data
    return memoryview(spread)[::2]


async def test_every_body_kind_stores_the_same_bytes(tl):
    data = os.urandom(CHUNK_SIZE * 2 + 12345)
    pieces = [data[i:i + 70001] for i in range(0, len(data), 70001)]

    def sync_gen():
        yield b""  # empty pieces are fine
        yield from pieces

    async def async_gen():
        for p in pieces:
            yield bytearray(p)
        yield memoryview(b"")

    class AsyncOnly:  # an async iterable that is not a generator
        def __aiter__(self):
            self._it = iter(pieces)
            return self

        async def __anext__(self):
            try:
                return next(self._it)
            except StopIteration:
                raise StopAsyncIteration from None

    bodies = {
        "bytes": data,
        "bytearray": bytearray(data),
        "memoryview": memoryview(data),
        "memoryview-slice": memoryview(b"xx" + data + b"yy")[2:-2],
        # Strided (not contiguous), alone and in an iterable: tried, a bare TypeError.
        "memoryview-strided": strided(data),
        "list-of-strided": [strided(p) for p in pieces],
        "list": list(pieces),
        "tuple-of-views": tuple(memoryview(p) for p in pieces),
        "generator": sync_gen(),
        "async-generator": async_gen(),
        "async-iterable": AsyncOnly(),
    }
    for name, body in bodies.items():
        rec = await within(tl.blobs.put(name, body))
        assert rec["size"] == len(data), name
        assert (await within(tl.blobs.get(name)))["body"] == data, name


async def test_a_streamed_put_holds_only_a_bounded_part_of_the_body(tl):
    piece = os.urandom(64 * 1024)
    count = 48 * MiB // len(piece)

    def body():
        for _ in range(count):
            yield piece

    tracemalloc.start()
    try:
        rec = await within(tl.blobs.put("stream", body()), 90)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert rec["size"] == count * len(piece)
    # 48 MiB went through; Python never held more than a few chunks of it at once.
    assert peak < 4 * MiB, peak
    got = await within(tl.blobs.get("stream"))
    assert got["body"] == piece * count


async def test_str_bodies_are_utf8(tl):
    text = "héllo wörld — 你好 🌍\n" * 1000
    rec = await within(tl.blobs.put("text", text, content_type="text/plain; charset=utf-8"))
    assert rec["size"] == len(text.encode("utf-8"))
    got = await within(tl.blobs.get("text"))
    assert got["body"].decode("utf-8") == text
    assert got["contentType"] == "text/plain; charset=utf-8"
    await within(tl.blobs.put("empty-text", ""))
    assert (await within(tl.blobs.get("empty-text")))["body"] == b""


async def test_non_byte_memoryviews_store_their_raw_bytes(tl):
    arr = array.array("I", range(1000))
    await within(tl.blobs.put("ints", memoryview(arr)))
    assert (await within(tl.blobs.get("ints")))["body"] == arr.tobytes()


async def test_expected_length_is_only_a_hint(tl):
    data = b"0123456789"
    for hint in (0, 5, 10, 10_000):
        rec = await within(tl.blobs.put("hinted", iter([data[:4], data[4:]]), expected_length=hint))
        assert rec["size"] == 10
        assert (await within(tl.blobs.get("hinted")))["body"] == data


# -- records ----------------------------------------------------------------------------
async def test_content_type_and_custom_metadata_round_trip_as_fresh_copies(tl):
    meta = {"owner": "ana", "empty": "", "ünï": "cödé 🌍"}
    rec = await within(tl.blobs.put("m", b"x", content_type="image/png", custom_metadata=meta))
    assert rec["contentType"] == "image/png" and rec["customMetadata"] == meta
    meta["owner"] = "mutated after put"
    rec["customMetadata"]["owner"] = "mutated result"
    head = await within(tl.blobs.head("m"))
    assert head["customMetadata"]["owner"] == "ana"
    head["customMetadata"]["owner"] = "mutated head"
    got = await within(tl.blobs.get("m"))
    assert got["customMetadata"] == {"owner": "ana", "empty": "", "ünï": "cödé 🌍"}
    got["body"] = b"changed"
    assert (await within(tl.blobs.get("m")))["body"] == b"x"
    # None is absent; an empty dict is a value.
    await within(tl.blobs.put("n", b"y", content_type=None, custom_metadata=None))
    assert set(await within(tl.blobs.head("n"))) == {"key", "size", "etag", "createdAt", "updatedAt"}
    assert (await within(tl.blobs.put("e", b"y", custom_metadata={})))["customMetadata"] == {}


async def test_overwrite_keeps_created_at_and_changes_etag(open_client):
    clock = Clock(1_000)
    tl = await open_client(clock=clock)
    first = await within(tl.blobs.put("k", b"same", content_type="a/b", custom_metadata={"v": "1"}))
    assert first["createdAt"] == first["updatedAt"] == 1_000
    clock.now = 5_000
    second = await within(tl.blobs.put("k", b"same"))  # identical content, still a new version
    assert second["createdAt"] == 1_000 and second["updatedAt"] == 5_000
    assert second["etag"] != first["etag"]
    # An overwrite replaces the options: nothing given, nothing kept.
    assert "contentType" not in second and "customMetadata" not in second
    clock.now = 7_000
    third = await within(tl.blobs.put("k", b"different"))
    assert third["createdAt"] == 1_000 and third["updatedAt"] == 7_000
    assert len({first["etag"], second["etag"], third["etag"]}) == 3
    assert await within(tl.blobs.head("k")) == third
    assert (await within(tl.blobs.get("k")))["body"] == b"different"


async def test_delete_is_silent_and_a_new_put_starts_a_new_object(open_client):
    clock = Clock(1_000)
    tl = await open_client(clock=clock)
    assert await within(tl.blobs.delete("never-there")) is None
    await within(tl.blobs.put("k", b"v1"))
    await within(tl.blobs.put("other", b"o"))
    assert await within(tl.blobs.delete("k")) is None
    assert await within(tl.blobs.head("k")) is None
    assert await within(tl.blobs.get("k")) is None
    assert await within(tl.blobs.get("k", range={"offset": 0})) is None
    assert [o["key"] for o in (await within(tl.blobs.list()))["objects"]] == ["other"]
    assert await within(tl.blobs.delete("k")) is None  # twice: still silent
    clock.now = 9_000
    again = await within(tl.blobs.put("k", b"v2"))
    assert again["createdAt"] == 9_000  # the deleted object's createdAt is not inherited
    assert (await within(tl.blobs.get("other")))["body"] == b"o"


async def test_keys_are_exact_strings(tl):
    version_like = "a/" + "0" * 32 + "/1"  # shaped like a chunk key of blob "a"
    keys = ["k", "K", "caf\u00e9", "cafe\u0301", "a\x00b", "a", version_like, "a/b/c", " ", "🌍"]
    for n, key in enumerate(keys):
        await within(tl.blobs.put(key, f"content {n}".encode()))
    for n, key in enumerate(keys):
        got = await within(tl.blobs.get(key))
        assert got["key"] == key and got["body"] == f"content {n}".encode()


# -- ranges -----------------------------------------------------------------------------
async def test_range_reads_slice_and_clamp(tl):
    data = os.urandom(2 * CHUNK_SIZE + 1000)
    size = len(data)
    await within(tl.blobs.put("r", data))
    cases = [
        ({"offset": 0}, 0, size),
        ({"offset": 10, "length": 5}, 10, 5),
        ({"offset": CHUNK_SIZE - 3, "length": 6}, CHUNK_SIZE - 3, 6),  # across a chunk boundary
        ({"offset": CHUNK_SIZE, "length": CHUNK_SIZE}, CHUNK_SIZE, CHUNK_SIZE),  # exactly one chunk
        ({"offset": 5, "length": size}, 5, size - 5),  # clamped at the end
        ({"offset": size - 1}, size - 1, 1),
        ({"offset": size - 1, "length": 10**12}, size - 1, 1),
        ({"offset": 7, "length": 0}, 7, 0),
        ({"offset": 7, "length": None}, 7, size - 7),  # None is absent
    ]
    for rng, offset, length in cases:
        got = await within(tl.blobs.get("r", range=rng))
        assert got["range"] == {"offset": offset, "length": length}, rng
        assert got["body"] == data[offset:offset + length], rng
        assert got["size"] == size  # the whole size, not the slice's


async def test_a_range_fetches_only_the_chunks_it_needs(tl):
    data = os.urandom(4 * CHUNK_SIZE)
    await within(tl.blobs.put("r", data))
    reader = tl.blobs._chunk_reader()
    fetched: list[list[int]] = []
    real_fetch = reader.fetch

    def observed(blob_key, version, wanted):
        fetched.append([i for i, _ in wanted])
        return real_fetch(blob_key, version, wanted)

    reader.fetch = observed
    await within(tl.blobs.get("r", range={"offset": CHUNK_SIZE + 10, "length": 20}))
    await within(tl.blobs.get("r", range={"offset": 2 * CHUNK_SIZE - 1, "length": 2}))
    await within(tl.blobs.get("r", range={"offset": 3, "length": 0}))
    await within(tl.blobs.get("r"))
    assert fetched == [[1], [1, 2], [0, 1, 2, 3]]  # the empty slice fetched nothing


@pytest.mark.parametrize(
    "rng",
    [
        {"offset": -1},
        {"offset": 1.0},
        {"offset": True},
        {"offset": "1"},
        {"offset": None},
        {},
        {"length": 3},
        {"offset": 0, "length": -1},
        {"offset": 0, "length": 2.5},
        {"offset": 0, "length": False},
        {"offset": 0, "length": "2"},
        {"offset": 0, "extra": 1},
        [0, 1],
        5,
        "0-10",
    ],
)
async def test_malformed_ranges_are_refused_before_the_lookup(tl, rng):
    await within(tl.blobs.put("r", b"0123456789"))
    await expect_invalid(tl.blobs.get("r", range=rng))
    # Refused before the key is looked up: an absent key does not turn it into None.
    await expect_invalid(tl.blobs.get("absent", range=rng))


async def test_offsets_outside_the_object_are_refused(tl):
    await within(tl.blobs.put("r", b"0123456789"))
    for offset in (10, 11, 10**15):
        await expect_invalid(tl.blobs.get("r", range={"offset": offset}))
        await expect_invalid(tl.blobs.get("r", range={"offset": offset, "length": 0}))
    await within(tl.blobs.put("empty", b""))
    await expect_invalid(tl.blobs.get("empty", range={"offset": 0}))
    assert (await within(tl.blobs.get("empty")))["body"] == b""


# -- list -------------------------------------------------------------------------------
LIST_KEYS = ["b", "a", "A", "a/x", "a/y", "ab", "a%", "a_", "aB", "é", "z", "\U0001f600", "\uffff", "a\x00"]


def bytes_order(keys):
    return sorted(keys, key=lambda k: k.encode("utf-8"))


async def put_all(tl, keys):
    for key in keys:
        await within(tl.blobs.put(key, key.encode("utf-8")))


async def test_list_orders_by_bytes_and_matches_literal_case_sensitive_prefixes(tl):
    await put_all(tl, LIST_KEYS)
    page = await within(tl.blobs.list())
    assert set(page) == {"objects"}  # complete: no cursor, not truncated
    assert [o["key"] for o in page["objects"]] == bytes_order(LIST_KEYS)
    assert all(set(o) <= RECORD_KEYS for o in page["objects"])
    assert page["objects"][0] == await within(tl.blobs.head(page["objects"][0]["key"]))
    prefixes = {
        "a": ["a", "a\x00", "a%", "a/x", "a/y", "aB", "a_", "ab"],
        "A": ["A"],
        "a%": ["a%"],  # not a wildcard
        "a_": ["a_"],  # not a wildcard
        "a/": ["a/x", "a/y"],
        "a\x00": ["a\x00"],
        "é": ["é"],
        "\U0001f600": ["\U0001f600"],
        "": bytes_order(LIST_KEYS),
        "nothing": [],
        "ab": ["ab"],
        "abc": [],
    }
    for prefix, expected in prefixes.items():
        got = await within(tl.blobs.list(prefix=prefix))
        assert [o["key"] for o in got["objects"]] == bytes_order(expected), prefix


async def test_list_pages_with_opaque_cursors(tl):
    await put_all(tl, LIST_KEYS)
    for limit in (1, 2, 3, 5, len(LIST_KEYS) - 1):
        seen, cursor, pages = [], None, 0
        while True:
            page = await within(tl.blobs.list(limit=limit, cursor=cursor))
            pages += 1
            assert len(page["objects"]) <= limit
            seen += [o["key"] for o in page["objects"]]
            if "cursor" not in page:
                assert "truncated" not in page
                break
            assert page["truncated"] is True and isinstance(page["cursor"], str)
            cursor = page["cursor"]
        assert seen == bytes_order(LIST_KEYS), limit
        assert pages == -(-len(LIST_KEYS) // limit)
    # A page as large as what is left is complete, not truncated.
    assert set(await within(tl.blobs.list(limit=len(LIST_KEYS)))) == {"objects"}
    assert set(await within(tl.blobs.list(limit=10**6))) == {"objects"}
    # A cursor combines with a prefix.
    first = await within(tl.blobs.list(prefix="a", limit=3))
    assert [o["key"] for o in first["objects"]] == ["a", "a\x00", "a%"]
    rest = await within(tl.blobs.list(prefix="a", cursor=first["cursor"]))
    assert [o["key"] for o in rest["objects"]] == ["a/x", "a/y", "aB", "a_", "ab"]
    assert set(rest) == {"objects"}


async def test_limit_zero_is_an_empty_untruncated_page(tl):
    await put_all(tl, ["a", "b"])
    assert await within(tl.blobs.list(limit=0)) == {"objects": []}
    assert await within(tl.blobs.list(limit=0, prefix="a")) == {"objects": []}


async def test_list_cursor_skips_deleted_keys(tl):
    await put_all(tl, ["a", "b", "c", "d"])
    page = await within(tl.blobs.list(limit=2))
    await within(tl.blobs.delete("b"))
    await within(tl.blobs.delete("c"))
    rest = await within(tl.blobs.list(cursor=page["cursor"]))
    assert [o["key"] for o in rest["objects"]] == ["d"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"limit": -1},
        {"limit": True},
        {"limit": 1.5},
        {"limit": "2"},
        {"cursor": "garbage"},
        {"cursor": ""},
        {"cursor": 5},
        {"cursor": "b1.!!!"},
        {"cursor": "b1."},  # an empty key
        {"cursor": "b1.7aA"},  # not canonical / not UTF-8
        {"prefix": 5},
        {"prefix": b"a"},
        {"prefix": "\ud800"},
    ],
)
async def test_bad_list_arguments_are_refused(tl, kwargs):
    await put_all(tl, ["a", "b"])
    await expect_invalid(tl.blobs.list(**kwargs))


# -- bad input changes nothing --------------------------------------------------------------
BAD_KEYS = ["", "\ud800", "a\udc00b", None, 5, b"bytes", ["k"]]


@pytest.mark.parametrize("bad_key", BAD_KEYS)
async def test_invalid_keys_are_refused_everywhere(tl, bad_key):
    await expect_invalid(tl.blobs.put(bad_key, b"x"))
    await expect_invalid(tl.blobs.get(bad_key))
    await expect_invalid(tl.blobs.head(bad_key))
    await expect_invalid(tl.blobs.delete(bad_key))
    assert await within(tl.blobs.list()) == {"objects": []}
    # Nothing reached the event log.
    await tl.read_barrier(None)
    assert all(tl.runtime.judge.applied(p) == 1 for p in range(tl.runtime.layout.events))  # its rules floor marker only


@pytest.mark.parametrize(
    "kwargs",
    [
        {"body": None},
        {"body": 5},
        {"body": 1.5},
        {"body": object()},
        {"body": {"a": b"x"}},  # a mapping is not a body
        {"body": "\ud800"},
        {"body": [b"ok", "str chunk"]},
        {"body": ["only a str"]},
        {"body": [b"ok", 5]},
        {"body": [b"a", None]},
        {"body": b"x", "content_type": 5},
        {"body": b"x", "content_type": "\ud800"},
        {"body": b"x", "content_type": b"text/plain"},
        {"body": b"x", "custom_metadata": {"a": 1}},
        {"body": b"x", "custom_metadata": {1: "a"}},
        {"body": b"x", "custom_metadata": {"a": None}},
        {"body": b"x", "custom_metadata": ["a"]},
        {"body": b"x", "custom_metadata": "a=b"},
        {"body": b"x", "custom_metadata": {"a": "\ud800"}},
        {"body": b"x", "custom_metadata": {"\udc00": "a"}},
        {"body": b"x", "expected_length": -1},
        {"body": b"x", "expected_length": True},
        {"body": b"x", "expected_length": 1.0},
        {"body": b"x", "expected_length": "1"},
    ],
)
async def test_bad_puts_are_refused_and_change_nothing(tl, kwargs):
    before = await within(tl.blobs.put("k", b"original", content_type="text/plain"))
    await expect_invalid(tl.blobs.put("k", **kwargs))
    await expect_invalid(tl.blobs.put("new", **kwargs))
    assert await within(tl.blobs.head("k")) == before
    assert (await within(tl.blobs.get("k")))["body"] == b"original"
    assert await within(tl.blobs.head("new")) is None


async def test_a_str_chunk_deep_in_an_async_stream_is_refused_and_changes_nothing(tl):
    before = await within(tl.blobs.put("k", b"original"))

    async def body():
        yield os.urandom(CHUNK_SIZE + 5)
        yield os.urandom(CHUNK_SIZE)
        yield "a str chunk"

    err = await expect_invalid(tl.blobs.put("k", body()))
    assert "str" in err.message
    assert await within(tl.blobs.head("k")) == before
    assert (await within(tl.blobs.get("k")))["body"] == b"original"


async def test_an_error_raised_by_the_body_propagates_and_changes_nothing(tl):
    before = await within(tl.blobs.put("k", b"original"))

    def body():
        yield os.urandom(CHUNK_SIZE * 2)
        raise RuntimeError("the source broke")

    with pytest.raises(RuntimeError, match="the source broke"):
        await within(tl.blobs.put("k", body()))
    assert await within(tl.blobs.head("k")) == before


# -- across clients ---------------------------------------------------------------------------
async def test_a_second_client_reads_every_write_immediately(open_client):
    writer = await open_client()
    reader = await open_client()
    for n in range(3):
        data = os.urandom(CHUNK_SIZE * n + 17)
        rec = await within(writer.blobs.put("shared", data, custom_metadata={"n": str(n)}))
        # No waiting: each read begins after the write was acknowledged.
        assert await within(reader.blobs.head("shared")) == rec
        got = await within(reader.blobs.get("shared"))
        assert got["body"] == data and got["etag"] == rec["etag"]
        ranged = await within(reader.blobs.get("shared", range={"offset": 1, "length": 3}))
        assert ranged["body"] == data[1:4]
        assert [o["key"] for o in (await within(reader.blobs.list(prefix="sh")))["objects"]] == ["shared"]
    other = await within(reader.blobs.put("from-reader", b"r"))
    assert await within(writer.blobs.head("from-reader")) == other
    await within(writer.blobs.delete("shared"))
    assert await within(reader.blobs.get("shared")) is None
    assert await within(reader.blobs.head("shared")) is None
    assert [o["key"] for o in (await within(reader.blobs.list()))["objects"]] == ["from-reader"]


async def test_a_blob_key_longer_than_64_kib_is_refused_and_one_at_the_bound_works(tl):
    # Tried: a 16 MiB key raised librdkafka's MSG_SIZE_TOO_LARGE from put, without a code.
    from threadlog.stores.blobs import MAX_KEY_BYTES

    await expect_invalid(tl.blobs.put("k" * (MAX_KEY_BYTES + 1), b"x"))
    await expect_invalid(tl.blobs.put("é" * (MAX_KEY_BYTES // 2 + 1), b"x"))  # bytes counted, not characters
    longest = "k" * MAX_KEY_BYTES
    await within(tl.blobs.put(longest, b"x" * 1000))
    assert (await within(tl.blobs.get(longest)))["body"] == b"x" * 1000
