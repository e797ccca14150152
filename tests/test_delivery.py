"""tl.delivery end to end on a real broker (SPEC section 11): append, read, snapshot, close, upsert."""

from __future__ import annotations

import asyncio
import datetime
import enum
import uuid

import pytest
from confluent_kafka import KafkaError
from delivery_support import chunk, collect, take
from support import within
from threadlog.producers.pump import delivery_failure

from threadlog import ThreadLogError
from threadlog.errors import UNAVAILABLE
from threadlog.kernel.topics import MAX_MESSAGE_BYTES


async def test_append_returns_one_offset_per_chunk_and_read_replays_them(tl):
    log = tl.delivery("run-1")
    assert await within(log.append([])) == []
    first = await within(log.append([chunk(0), chunk(1), chunk(2)]))
    second = await within(log.append([chunk(3)]))
    assert len(first) == 3 and len(second) == 1
    offsets = first + second
    assert len(set(offsets)) == 4 and all(isinstance(o, str) for o in offsets)
    await within(log.close())
    got = await collect(log.read("-1"))
    assert got == [(o, chunk(i)) for i, o in enumerate(offsets)]


async def test_chunks_round_trip_deep_equal_as_fresh_dicts(tl):
    log = tl.delivery("run-rt")
    weird = {"type": "X", "text": "héllo — 你好 🌍\n\"q\"", "n": [1, 2.5, -0.0, 2**53 + 1, 5e-324],
             "nested": {"a": {"b": [None, True, False, {}]}}}
    [off] = await within(log.append([weird]))
    await within(log.close())
    [(o, got)] = await within(log.snapshot())
    assert o == off and got == weird
    got["text"] = "mutated"
    [(_, again)] = await within(log.snapshot())
    assert again == weird


async def test_read_resumes_strictly_after_the_cursor_even_inside_a_batch(tl):
    log = tl.delivery("run-cursor")
    offsets = []
    for b in range(4):
        offsets += await within(log.append([chunk(b * 3 + k) for k in range(3)]))
    await within(log.close())
    for k in (0, 1, 2, 4, 7, 10):
        got = await collect(log.read(offsets[k]))
        assert got == [(o, chunk(i)) for i, o in enumerate(offsets) if i > k], f"after chunk {k}"
    assert await collect(log.read(offsets[-1])) == []


async def test_blocked_reader_wakes_on_append_and_ends_on_close(tl):
    log = tl.delivery("run-live")
    [o0] = await within(log.append([chunk(0)]))
    reader = log.read(o0)
    pending = asyncio.ensure_future(reader.__anext__())
    await asyncio.sleep(0.3)  # not synchronization: proves the reader is still blocked, not done
    assert not pending.done()
    [o1] = await within(log.append([chunk(1)]))
    assert await within(pending, 10) == (o1, chunk(1))
    [o2, o3] = await within(log.append([chunk(2), chunk(3)]))
    assert await take(reader, 2, 10) == [(o2, chunk(2)), (o3, chunk(3))]
    ending = asyncio.ensure_future(reader.__anext__())
    await within(log.close())
    with pytest.raises(StopAsyncIteration):
        await within(ending, 10)


async def test_close_wakes_readers_on_another_client(open_client):
    a = await open_client()
    b = await open_client(processors="external")
    await within(a.delivery("run-x").append([chunk(0)]))
    readers = [asyncio.ensure_future(collect(b.delivery("run-x").read("-1"), 30)) for _ in range(3)]
    [o1] = await within(a.delivery("run-x").append([chunk(1)]))
    await within(a.delivery("run-x").close())
    for r in readers:
        got = await within(r, 30)
        assert [c for _, c in got] == [chunk(0), chunk(1)] and got[-1][0] == o1


async def test_read_now_yields_only_what_comes_after_the_iteration_started(tl):
    log = tl.delivery("run-now")
    await within(log.append([chunk(-1, old=True)]))
    reader = log.read("now")
    first = asyncio.ensure_future(reader.__anext__())
    appended = []
    # Append until the reader has seen something: "now" is fixed when its first
    # iteration starts, which this test cannot observe directly.
    for i in range(200):
        appended.append((await within(log.append([chunk(i)])))[0])
        if first.done():
            break
        await asyncio.sleep(0.02)
    assert first.done()
    o, c = first.result()
    k = appended.index(o)
    assert c == chunk(k)
    rest_task = asyncio.ensure_future(collect(reader, 30))
    more = await within(log.append([chunk(1000)]))
    await within(log.close())
    rest = await within(rest_task, 30)
    assert [x for x, _ in rest] == appended[k + 1:] + more
    # "now" on a closed log ends at once.
    assert await collect(log.read("now"), 10) == []


async def test_appends_after_close_are_refused_and_change_nothing(tl):
    log = tl.delivery("run-closed")
    offs = await within(log.append([chunk(0), chunk(1)]))
    await within(log.close())
    await within(log.close())  # closing twice is harmless
    before = await within(log.snapshot())
    records_before = await within(log.records())
    with pytest.raises(ThreadLogError) as e:
        await within(log.append([chunk(2)]))
    assert e.value.code == "RUN_LOG_CLOSED"
    with pytest.raises(ThreadLogError) as e:
        await within(log.upsert([(offs[0], chunk(9))]))
    assert e.value.code == "RUN_LOG_CLOSED"
    # Another handle (another driver of the same epoch) learns it too.
    with pytest.raises(ThreadLogError) as e:
        await within(tl.delivery("run-closed").append([chunk(3)]))
    assert e.value.code == "RUN_LOG_CLOSED"
    assert await within(log.snapshot()) == before
    assert await within(log.records()) == records_before
    assert await collect(log.read("-1")) == before


async def test_a_close_that_lands_before_an_append_drops_it_and_the_append_raises(open_client, tl):
    """Two writers: B closes while A's handle still believes the log is open
    (A's pre-check passed); A's record lands after the close and must raise."""
    other = await open_client(processors="external")
    await within(tl.delivery("run-cl2").append([chunk(0)]))
    await within(other.delivery("run-cl2").close())
    # Force A past its pre-check: the verdict after writing is what counts.
    log = tl.delivery("run-cl2")
    log._precheck = lambda: None
    with pytest.raises(ThreadLogError) as e:
        await within(log.append([chunk(1)]))
    assert e.value.code == "RUN_LOG_CLOSED"
    assert [c for _, c in await within(tl.delivery("run-cl2").snapshot())] == [chunk(0)]
    rows = await within(tl.delivery("run-cl2").records())
    assert [(r["kind"], r.get("dropped")) for r in rows] == [("chunks", None), ("close", None),
                                                             ("chunks", "RUN_LOG_CLOSED")]


async def test_closing_a_run_that_never_produced_ends_its_readers_at_once(tl):
    log = tl.delivery("run-empty-closed")
    await within(log.close())
    assert await collect(log.read("-1"), 10) == []
    assert await within(log.snapshot()) == []


async def test_snapshot_is_point_in_time_and_empty_for_unknown_runs(tl):
    assert await within(tl.delivery("never-seen").snapshot()) == []
    log = tl.delivery("run-snap")
    offs = await within(log.append([chunk(0), chunk(1)]))
    snap = await within(log.snapshot(), 5)  # an open log: it never waits for more
    assert snap == [(offs[0], chunk(0)), (offs[1], chunk(1))]
    more = await within(log.append([chunk(2)]))
    assert snap == [(offs[0], chunk(0)), (offs[1], chunk(1))]
    assert await within(log.snapshot(), 5) == [*snap, (more[0], chunk(2))]


async def test_read_from_start_of_a_run_that_never_produced_fails_within_the_wait(open_client):
    tl = await open_client(first_chunk_wait_ms=400)
    reader = tl.delivery("ghost").read("-1")  # no error until iterated
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(ThreadLogError) as e:
        await within(reader.__anext__(), 10)
    assert e.value.code == "RUN_NOT_FOUND"
    assert 0.35 <= loop.time() - t0 < 8


async def test_read_from_start_waits_for_a_first_chunk_that_comes_in_time(open_client):
    tl = await open_client(first_chunk_wait_ms=10_000)
    reader = tl.delivery("late").read("-1")
    first = asyncio.ensure_future(reader.__anext__())
    await asyncio.sleep(0.3)  # the reader is waiting for the run's first chunk
    assert not first.done()
    [o] = await within(tl.delivery("late").append([chunk(0)]))
    assert await within(first, 10) == (o, chunk(0))
    await within(tl.delivery("late").close())
    assert await collect(reader, 10) == []


@pytest.mark.parametrize("bad", ["", "garbage", "-2", "NOW", "1.2.3", "01.0.0.00000000", "0.0.0.zzzzzzzz",
                                 " -1", "0.0.0.0000000g"])
async def test_malformed_offsets_are_refused_at_first_iteration(tl, bad):
    log = tl.delivery("run-bad")
    await within(log.append([chunk(0)]))
    reader = log.read(bad)
    with pytest.raises(ThreadLogError) as e:
        await within(reader.__anext__())
    assert e.value.code == "INVALID_OFFSET"


async def test_non_string_offsets_are_refused(tl):
    for bad in (None, 0, -1, b"-1", ("0", 0)):
        with pytest.raises(ThreadLogError) as e:
            await within(tl.delivery("r").read(bad).__anext__())
        assert e.value.code == "INVALID_OFFSET", bad


async def refused_by_read_and_upsert(log, bad) -> None:
    """`bad` is INVALID_OFFSET to `read` and to `upsert`."""
    with pytest.raises(ThreadLogError) as e:
        await within(log.read(bad).__anext__())
    assert e.value.code == "INVALID_OFFSET"
    with pytest.raises(ThreadLogError) as e:
        await within(log.upsert([(bad, chunk(1))]))
    assert e.value.code == "INVALID_OFFSET"


async def test_offsets_of_another_run_are_refused(tl):
    a, b = tl.delivery("run-a"), tl.delivery("run-b")
    [oa] = await within(a.append([chunk(0)]))
    [ob] = await within(b.append([chunk(0)]))
    for log, foreign in ((a, ob), (b, oa)):
        await refused_by_read_and_upsert(log, foreign)
    # Well-formed, right run, but no such position: beyond the batch, or a record that is not this run's.
    p, x, _i, tag = oa.split(".")
    for forged in (f"{p}.{x}.1.{tag}", f"{p}.{int(x) + 50}.0.{tag}"):
        with pytest.raises(ThreadLogError) as e:
            await within(a.read(forged).__anext__())
        assert e.value.code == "INVALID_OFFSET"
    assert [c for _, c in await within(a.snapshot())] == [chunk(0)]


async def test_an_offset_with_a_trailing_newline_is_malformed(tl):
    """Tried (a review): `$` also matches before a final newline, so `read(off + "\n")`
    read as `read(off)` and `upsert` took the offset and answered the clean one."""
    log = tl.delivery("run-newline")
    [o] = await within(log.append([chunk(0)]))
    for bad in (o + "\n", o + "\r\n"):
        await refused_by_read_and_upsert(log, bad)
    assert await within(log.snapshot()) == [(o, chunk(0))]


class Colour(enum.Enum):
    RED = "red"


async def test_bad_input_is_refused_and_writes_nothing(tl):
    for run_id in ("", None, 5, "\ud800"):
        with pytest.raises(ThreadLogError) as e:
            tl.delivery(run_id)
        assert e.value.code == "INVALID_ARGUMENT"
    for epoch in (-1, True, 1.0, "1", 2**63, 2**70):  # an epoch is an Avro long (2**63 raised OverflowError)
        with pytest.raises(ThreadLogError) as e:
            tl.delivery("r", epoch=epoch)
        assert e.value.code == "INVALID_ARGUMENT"
    tl.delivery("r", epoch=2**63 - 1)  # the largest long is an epoch
    log = tl.delivery("run-input")
    for bad in (None, {"type": "x"}, "abc", [1], [{"x": float("nan")}], [{"x": object()}], [{1: "a"}],
                [{"ok": 1}, "not a dict"], [{"s": "\ud800"}],
                # orjson (the fast path) would write these as JSON; plain JSON has no such values
                [{"t": datetime.datetime(2020, 1, 1)}], [{"u": uuid.UUID(int=1)}], [{"c": Colour.RED}],
                [{"x": float("inf")}]):
        with pytest.raises(ThreadLogError) as e:
            await within(log.append(bad))
        assert e.value.code == "INVALID_ARGUMENT", bad
    assert await within(log.records()) == []
    assert await within(log.snapshot()) == []


async def test_an_append_too_large_for_one_record_is_invalid_even_just_under_the_limit(tl):
    """Tried (a review): a chunk whose encoded record came within ~90 bytes under the
    topic's 16 MiB limit passed the value-size check, and the broker refused the
    record (key, headers and framing count too): UNAVAILABLE, "not written" as if
    the cluster were down. Bad input is INVALID_ARGUMENT and writes nothing."""
    log = tl.delivery("run-huge")
    for size in (MAX_MESSAGE_BYTES - 200, MAX_MESSAGE_BYTES + 10):
        with pytest.raises(ThreadLogError) as e:
            await within(log.append([{"s": "x" * size}]))
        assert e.value.code == "INVALID_ARGUMENT", (size, e.value)
    assert await within(log.records()) == []


class _Sent:
    """What delivery_failure reads of a reported record (a delivery report's Message)."""

    def __init__(self, value: bytes, key: bytes = b"k", headers=None) -> None:
        self._value, self._key, self._headers = value, key, headers

    def value(self) -> bytes:
        return self._value

    def key(self) -> bytes:
        return self._key

    def headers(self):
        return self._headers


def test_a_record_the_cluster_finds_too_large_is_invalid_argument_not_unavailable():
    too_large = KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)
    assert delivery_failure(too_large, "delivery record").code == "INVALID_ARGUMENT"
    big = _Sent(b"x" * (MAX_MESSAGE_BYTES - 1000), headers=[("reply", b"t" * 2000)])
    assert delivery_failure(too_large, "delivery record", big).code == "INVALID_ARGUMENT"
    # A record that fits alone was refused with the batch it shared (a user's batch.size):
    # not bad input, and not written -- UNAVAILABLE, which a caller retries.
    assert delivery_failure(too_large, "delivery record", _Sent(b"x" * 8_000_000)).code == "UNAVAILABLE"
    assert delivery_failure(KafkaError(KafkaError._MSG_TIMED_OUT), "x").code == "OUTCOME_UNKNOWN"
    assert delivery_failure(KafkaError(KafkaError._TRANSPORT), "x").code == "UNAVAILABLE"


async def test_a_run_id_too_long_to_fit_beside_its_chunks_is_invalid_argument(tl):
    """Tried (a review): a 400 kB run id (a record's key) beside a chunk near the
    value limit: librdkafka's own size check raised a bare KafkaException."""
    log = tl.delivery("r" * 400_000)
    with pytest.raises(ThreadLogError) as e:
        # The value (chunks and run id) passes the value check; with the key it does not fit.
        await within(log.append([{"s": "x" * (MAX_MESSAGE_BYTES - 500_000)}]))
    assert e.value.code == "INVALID_ARGUMENT", e.value
    assert await within(log.records()) == []


async def test_upsert_validates_the_whole_batch_first_and_leaves_the_log_unchanged(tl):
    log = tl.delivery("run-up")
    offs = await within(log.append([chunk(0), chunk(1), chunk(2)]))
    [other] = await within(tl.delivery("run-other").append([chunk(0)]))
    before = await within(log.snapshot())
    rows_before = await within(log.records())
    bad_batches = [
        [(offs[0], chunk(10)), ("garbage", chunk(11))],
        [(offs[0], chunk(10)), (offs[0], chunk(11))],  # repeated
        [(offs[1], chunk(10)), (other, chunk(11))],  # another run's
        [(offs[1], chunk(10)), (offs[2][:-1] + ("0" if offs[2][-1] != "0" else "1"), chunk(11))],
    ]
    for batch in bad_batches:
        with pytest.raises(ThreadLogError) as e:
            await within(log.upsert(batch))
        assert e.value.code == "INVALID_OFFSET", batch
    for batch in ([(offs[0], "not a dict")], [(offs[0],)], "nope", [(offs[0], {"x": float("inf")})]):
        with pytest.raises(ThreadLogError) as e:
            await within(log.upsert(batch))
        assert e.value.code == "INVALID_ARGUMENT", batch
    assert await within(log.snapshot()) == before
    assert await within(log.records()) == rows_before  # nothing was written
    assert await within(log.upsert([])) == []


async def test_upsert_replaces_positions_for_snapshot_and_later_readers_never_re_yields(tl):
    log = tl.delivery("run-up2")
    offs = await within(log.append([chunk(0), chunk(1), chunk(2)]))
    live = log.read("-1")
    assert await take(live, 3) == [(o, chunk(i)) for i, o in enumerate(offs)]
    got = await within(log.upsert([(offs[1], chunk(1, fixed=True)), (offs[0], chunk(0, fixed=True))]))
    assert got == [offs[1], offs[0]]
    [o3] = await within(log.append([chunk(3)]))
    # The live reader already had positions 0 and 1: it goes on with 3, nothing twice.
    assert await take(live, 1) == [(o3, chunk(3))]
    expected = [(offs[0], chunk(0, fixed=True)), (offs[1], chunk(1, fixed=True)), (offs[2], chunk(2)),
                (o3, chunk(3))]
    assert await within(log.snapshot()) == expected
    await within(log.close())
    assert await collect(live) == []
    assert await collect(log.read("-1")) == expected
    assert await collect(log.read(offs[0])) == expected[1:]
    # Upserting again: the latest replacement wins.
    with pytest.raises(ThreadLogError) as e:
        await within(log.upsert([(offs[2], chunk(2, again=True))]))
    assert e.value.code == "RUN_LOG_CLOSED"


async def test_a_reader_on_another_client_sees_every_acknowledged_append(open_client):
    a = await open_client()
    b = await open_client(processors="external")
    for i in range(5):
        [o] = await within(a.delivery("run-ryw").append([chunk(i)]))
        snap = await within(b.delivery("run-ryw").snapshot())
        assert snap[-1] == (o, chunk(i)) and len(snap) == i + 1


async def test_abandoned_readers_release_their_resources(tl):
    log = tl.delivery("run-abandon")
    for b in range(20):
        await within(log.append([chunk(b * 10 + k) for k in range(10)]))
    svc = tl._delivery
    for _ in range(30):
        reader = log.read("-1")
        await take(reader, 3)
        await reader.aclose()
    assert not svc.runs.index._subs
    await within(log.close())
    got = await collect(log.read("-1"))
    assert [c["i"] for _, c in got] == list(range(200))


async def test_a_reader_that_falls_behind_the_live_feed_catches_up_from_kafka(tl):
    tl._delivery.runs.index.max_queued = 4  # tiny live queue: overflow at once
    log = tl.delivery("run-slow")
    [o0] = await within(log.append([chunk(0)]))
    reader = log.read("-1")
    assert await take(reader, 1) == [(o0, chunk(0))]
    expected = []
    for i in range(1, 40):
        expected += await within(log.append([chunk(i)]))
    await within(log.close())
    got = await collect(reader)
    assert [o for o, _ in got] == expected
    assert [c["i"] for _, c in got] == list(range(1, 40))


async def test_ten_thousand_chunks_replay_complete_and_in_order(open_client):
    writer = await open_client()
    log = writer.delivery("run-10k")
    expected = []
    sizes = [1, 7, 100, 250, 42]
    n = 0
    while n < 10_000:
        size = min(sizes[len(expected) % len(sizes)], 10_000 - n)
        expected += await within(log.append([chunk(n + k) for k in range(size)]))
        n += size
    await within(log.close())
    reader = await open_client(processors="external")
    got = await collect(reader.delivery("run-10k").read("-1"), 120)
    assert len(got) == 10_000
    assert [o for o, _ in got] == expected
    assert [c["i"] for _, c in got] == list(range(10_000))
    snap = await within(reader.delivery("run-10k").snapshot(), 120)
    assert snap == got


async def test_closing_the_client_ends_waiting_readers_with_unavailable(open_client):
    tl = await open_client()
    log = tl.delivery("run-shutdown")
    [o] = await within(log.append([chunk(0)]))
    reader = log.read("-1")
    assert await take(reader, 1) == [(o, chunk(0))]
    pending = asyncio.ensure_future(reader.__anext__())
    await asyncio.sleep(0.2)  # not synchronization: the reader is parked on the live feed
    assert not pending.done()
    await within(tl.close())
    with pytest.raises(ThreadLogError) as e:
        await within(pending, 10)
    assert e.value.code == "UNAVAILABLE"
    with pytest.raises(ThreadLogError) as e:
        await within(log.append([chunk(1)]))
    assert e.value.code == "UNAVAILABLE"


async def test_a_reader_that_stopped_reading_gives_its_consumer_back(tl):
    """Catch-up reads share a bounded pool of consumers (delivery/reader.py).
    Tried: with a pool of one, a reader takes one chunk of a run and then stops
    reading (an SSE client that stopped reading blocks its send): another read
    still gets a consumer well within its timeout, and the first reader, when it
    reads on, gets every chunk once from where it was."""
    tl._delivery.pool.max_open = 1  # the bound under test, made small enough to exhaust
    run = "stalled"
    log = tl.delivery(run)
    offsets = await within(log.append([chunk(i) for i in range(5)]))
    stalled = log.read("-1")
    assert await within(stalled.__anext__()) == (offsets[0], chunk(0))
    # The stalled reader holds the pool's only consumer mid catch-up; this read needs one.
    assert await within(tl.delivery(run).snapshot(), 10) == list(zip(offsets, [chunk(i) for i in range(5)],
                                                                     strict=True))
    await within(log.close())
    assert await within(collect(stalled)) == list(zip(offsets[1:], [chunk(i) for i in range(1, 5)], strict=True))


async def test_readers_of_a_closed_run_whose_records_retention_removed_fail_not_retryable(tl, bootstrap):
    # Tried (a review): the deliveries topic keeps records for its retention only; the
    # run index outlives them. A reader of a closed run whose records were deleted
    # (delete_records stands in for retention) waited for the close record forever;
    # then it ended as if the run had no chunks. It says they are gone, for good.
    from confluent_kafka import TopicPartition
    from confluent_kafka.admin import AdminClient

    log = tl.delivery("run-expired")
    offsets = await within(log.append([chunk(0), chunk(1)]))
    await within(log.close())
    end = await within(log._svc.high_watermark(log.partition))
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for fut in admin.delete_records([TopicPartition(tl.runtime.topics.deliveries, log.partition, end)]).values():
        fut.result(timeout=30)
    for after in ("-1", offsets[0]):
        with pytest.raises(ThreadLogError) as err:
            await within(collect(log.read(after)), 10)
        assert (err.value.code, err.value.retryable) == (UNAVAILABLE, False)


async def test_a_reader_of_an_open_run_whose_records_retention_removed_fails_not_retryable(tl, bootstrap):
    # Tried: an open run whose first chunks were deleted (delete_records stands in for
    # retention), read from its start. The reader's UNAVAILABLE must say no retry cures
    # it (`retryable`), so an SSE stream ends with RUN_ERROR instead of reconnecting forever.
    from confluent_kafka import TopicPartition
    from confluent_kafka.admin import AdminClient

    log = tl.delivery("run-expired-open")
    offsets = await within(log.append([chunk(0), chunk(1)]))
    # Read once: the run index has folded the record (retention deletes old records,
    # never one an index has yet to fetch; an append returns before its fold).
    assert [c for _, c in await within(take(log.read("-1"), 2))] == [chunk(0), chunk(1)]
    end = await within(log._svc.high_watermark(log.partition))
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for fut in admin.delete_records([TopicPartition(tl.runtime.topics.deliveries, log.partition, end)]).values():
        fut.result(timeout=30)
    later = await within(log.append([chunk(2)]))
    # Before: "-1" showed chunk 2 as the run's first, and a deleted offset was "not a chunk".
    for after in ("-1", offsets[0]):
        with pytest.raises(ThreadLogError) as err:
            await within(take(log.read(after), 1), 20)
        assert (err.value.code, err.value.retryable) == (UNAVAILABLE, False)
        assert "retention" in err.value.message
    # Resumed after the deleted record's last chunk, nothing of it is needed. Tried (a
    # review): it failed "gone" too, though every chunk after it is stored.
    assert await within(take(log.read(offsets[1]), 1), 20) == [(later[0], chunk(2))]


async def test_a_read_that_keeps_scanning_past_other_runs_records_is_not_cut_off(open_client, monkeypatch):
    # Tried (a review): a reader's fetch had one request timeout in all, so the next
    # record of a quiet run behind millions of other runs' records (about 1M/s
    # scanned here) failed UNAVAILABLE while the scan was still moving. Made small:
    # a fetch that sees one record per 0.2 s, 8 other records, a 1 s timeout.
    import time as clock

    from threadlog.delivery import reader as reader_module
    from threadlog.kernel import kafka_config
    from threadlog.kernel.partitioning import partition_for

    # The records are written by a client of the default timeout (a first write
    # within 1 s failed OUTCOME_UNKNOWN on a loaded CI machine); only the reader
    # has the 1 s timeout under test.
    writer = await open_client()
    tl = await open_client(request_timeout_ms=1_000)
    parts = tl.runtime.layout.deliveries
    run = "run-quiet"
    others = [r for r in (f"run-busy-{n}" for n in range(1000))
              if partition_for(r, parts) == partition_for(run, parts)][:8]
    await within(writer.delivery(run).append([chunk(0)]))
    for other in others:
        await within(writer.delivery(other).append([chunk(9)]))
    await within(writer.delivery(run).append([chunk(1)]))
    await within(writer.delivery(run).close())

    class SlowScan:
        def __getattr__(self, name):
            return getattr(kafka_config, name)

        @staticmethod
        def drain(consumer, n, timeout):
            clock.sleep(0.2)
            return kafka_config.drain(consumer, 1, timeout)

    monkeypatch.setattr(reader_module, "kafka_config", SlowScan())
    got = await within(collect(tl.delivery(run).read("-1"), 30), 40)
    assert [c for _, c in got] == [chunk(0), chunk(1)]


async def test_a_now_read_whose_reading_fails_raises_that_at_once(tl, monkeypatch):
    """Tried (a review): a "now" read awaited its end-offsets round in a `finally`:
    when the run index's reading failed, the read first waited out that round, and
    if the round failed too its error replaced the reading's."""
    log = tl.delivery("run-now-fails")
    await within(log.append([chunk(0)]))
    svc = tl._delivery
    rounds: list[asyncio.Future] = []

    async def slow_and_failing(p):
        fut = asyncio.get_running_loop().create_future()
        rounds.append(fut)
        await fut  # never set: cancelled, or it would wait for good
        raise ThreadLogError("UNAVAILABLE", "the end-offsets round failed")

    async def failing_reading(run_id, p):
        while not rounds:  # the round under way (bounded by the `within` below)
            await asyncio.sleep(0.001)
        raise ThreadLogError("INTERNAL", "the reading failed")

    monkeypatch.setattr(svc, "high_watermark", slow_and_failing)
    monkeypatch.setattr(svc.runs, "reading", failing_reading)
    with pytest.raises(ThreadLogError) as e:
        await within(log.read("now").__anext__(), 5)
    assert e.value.code == "INTERNAL"
    assert [f.cancelled() for f in rounds] == [True]  # the round was not waited out


async def test_a_flood_of_records_that_stand_for_nothing_does_not_stretch_the_first_chunk_wait(open_client,
                                                                                                 monkeypatch):
    """Tried (a review): a from-start read waiting for a run's first chunk looks
    again when its live queue overflows -- and each look began a fresh
    first_chunk_wait, by recursion, so a flood of records that stand for nothing
    (claims here) kept a reader of a run that never produced waiting for as long as
    it lasted, or until RecursionError (what this test met on the old code)."""
    from threadlog.delivery.log import DeliveryLog

    tl = await open_client(first_chunk_wait_ms=1000)
    await within(tl.runs.create_or_resume(run_id="r-flood", thread_id="t", started_at=1))
    tl.runtime.deliveries.max_queued = 1  # a batch of two overflows a reader's queue: it looks again
    looks = []
    first = DeliveryLog._first

    async def counted(self, *args, **kwargs):
        looks.append(args)
        return await first(self, *args, **kwargs)

    monkeypatch.setattr(DeliveryLog, "_first", counted)
    stop = asyncio.Event()

    async def flood():
        while not stop.is_set():
            await tl.runs.claim("r-flood")

    floods = [asyncio.ensure_future(flood()) for _ in range(4)]
    try:
        with pytest.raises(ThreadLogError) as e:
            await within(tl.delivery("r-flood").read("-1").__anext__(), 15)
        assert e.value.code == "RUN_NOT_FOUND"
        assert len(looks) >= 2  # it did look again, within its one wait
    finally:
        stop.set()
        await asyncio.gather(*floods, return_exceptions=True)


async def test_a_catch_up_batch_holds_at_most_its_byte_bound_and_the_batches_miss_and_repeat_nothing(tl):
    """A reader yields a catch-up batch record by record, and one whose client
    stopped reading keeps the batch for as long as it is stalled. Tried (a review):
    batches of as many records as librdkafka had fetched -- 42 records, 16 MiB of
    400 KB chunks -- ~72 MiB of RSS per stalled SSE reader. Now a batch stops at
    MAX_BATCH_BYTES (one record more at most), and what the consumer had fetched
    beyond it is read again by the next batch: every record once, in order."""
    from threadlog.delivery.reader import MAX_BATCH_BYTES, Fetcher
    from threadlog.kernel.partitioning import partition_for

    svc = tl._delivery
    parts = tl.runtime.layout.deliveries
    p = partition_for("big", parts)
    other = next(f"other-{i}" for i in range(10_000) if partition_for(f"other-{i}", parts) == p)
    big, mine = "x" * 400_000, []
    for i in range(30):
        [offset] = await within(tl.delivery("big").append([chunk(i) | {"delta": big}]))
        mine.append(int(offset.split(".")[1]))
        if i % 3 == 0:
            await within(tl.delivery(other).append([chunk(i)]))  # another run's records between
    stop_at = await within(svc.high_watermark(p))
    fetcher = Fetcher(svc, "big", p, 0)
    got: list[int] = []
    try:
        while batch := await within(fetcher.next_batch(stop_at)):
            values = [len(m.value()) for m in batch]
            assert sum(values[:-1]) < MAX_BATCH_BYTES, values  # the last one may pass it
            got += [m.offset() for m in batch]
    finally:
        fetcher.release()
    assert got == mine  # none missed, none twice, in order
    assert len(got) > MAX_BATCH_BYTES // 400_000 + 1  # so it took several batches
