"""Blobs on Kafka: chunk records, tombstones, compaction, stale manifests, concurrent puts, forged commands.

These tests read `<ns>.blobs` and `<ns>.events` raw, to prove what the API
alone cannot show: a superseded or abandoned version leaves no live chunk
(every chunk key gets a tombstone), compaction really reclaims them, and a
reader never returns a chunk that is not the manifest's.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource
from support import read_topic, within
from threadlog.producers.blob_chunks import (
    CHUNK_SIZE,
    MAX_CHUNK,
    ChunkGone,
    ChunkRef,
    ChunkWriter,
    encode_chunk,
    new_version,
)
from threadlog.projections.folds import blobs as state
from threadlog.schemas import default_codec

from threadlog import ThreadLogError


def chunk_log(bootstrap: str, tl) -> dict[str, list[tuple[int, int, dict | None]]]:
    """chunk key -> [(partition, offset, decoded chunk or None for a tombstone)], in log order."""
    out: dict[str, list] = {}
    codec = default_codec()
    for m in read_topic(bootstrap, tl.runtime.topics.blobs, tl.runtime.layout.blobs):
        value = None if m.value() is None else codec.decode(m.value(), expect="threadlog.BlobChunk")[1]
        out.setdefault(m.key().decode("utf-8"), []).append((m.partition(), m.offset(), value))
    for entries in out.values():
        entries.sort(key=lambda e: e[1])
    return out


def versions_in(log: dict) -> dict[str, list[str]]:
    """version -> its chunk keys, from the chunk records in the log."""
    out: dict[str, list[str]] = {}
    for key, entries in log.items():
        for _, _, value in entries:
            if value is not None:
                out.setdefault(value["version"], []).append(key)
    return out


def is_tombstoned(log: dict, chunk_key: str) -> bool:
    """The chunk key's last record is a tombstone that follows its data, in one partition."""
    entries = log.get(chunk_key, [])
    return (len(entries) >= 2 and entries[-1][2] is None and entries[0][2] is not None
            and len({e[0] for e in entries}) == 1)


def flush_chunks(tl) -> None:
    """Wait until every chunk record and tombstone this client queued is acknowledged."""
    if tl.blobs._sink is not None:
        assert tl.blobs._sink.producer.flush(30) == 0


async def layout(tl, key: str) -> dict | None:
    return await tl.blobs._layout(key)


@pytest.mark.parametrize("size", [0, 1, 63, 64, 127, 128, 8191, 8192, 16384, CHUNK_SIZE, MAX_CHUNK])
def test_the_fast_chunk_encoding_is_the_codecs_byte_for_byte(size):
    codec = default_codec()
    data = os.urandom(size)
    for key, index in [("k", 0), ("é/🌍" * 50, 1), ("a/" + "0" * 32 + "/1", 2**31 - 1)]:
        fast = encode_chunk(codec, key, "f" * 32, index, memoryview(data))
        assert fast == codec.encode("threadlog.BlobChunk", {"blobKey": key, "version": "f" * 32,
                                                             "index": index, "data": data})
        assert codec.decode(fast)[1]["data"] == data


# -- tombstones -------------------------------------------------------------------------------
async def test_overwrite_and_delete_tombstone_every_superseded_chunk(tl, bootstrap):
    v1 = os.urandom(2 * CHUNK_SIZE + 1)
    v2 = os.urandom(CHUNK_SIZE + 7)
    await within(tl.blobs.put("doc", v1))
    l1 = await layout(tl, "doc")
    await within(tl.blobs.put("doc", v2))
    l2 = await layout(tl, "doc")
    assert len(l1["chunks"]) == 3 and len(l2["chunks"]) == 2

    log = chunk_log(bootstrap, tl)
    keys1, keys2 = sorted(versions_in(log)[l1["version"]]), sorted(versions_in(log)[l2["version"]])
    assert len(keys1) == 3 and len(keys2) == 2
    # The manifest points at exactly the records the put wrote: read by offset.
    for index, (p, o, n) in enumerate(l1["chunks"]):
        (data_p, data_o, chunk) = log[f"doc/{l1['version']}/{index}"][0]
        assert (data_p, data_o, chunk["index"], len(chunk["data"])) == (p, o, index, n)
    assert all(is_tombstoned(log, k) for k in keys1)  # superseded: reclaimable
    assert not any(is_tombstoned(log, k) for k in keys2)  # current: live

    await within(tl.blobs.delete("doc"))
    log = chunk_log(bootstrap, tl)
    assert all(is_tombstoned(log, k) for k in keys1 + keys2)
    await within(tl.blobs.delete("doc"))  # silent, and no new tombstones
    assert chunk_log(bootstrap, tl) == log


async def test_an_empty_blob_has_no_chunks_and_replacing_it_tombstones_nothing(tl, bootstrap):
    await within(tl.blobs.put("e", b""))
    assert (await layout(tl, "e"))["chunks"] == []
    await within(tl.blobs.put("e", b"now one byte"))
    log = chunk_log(bootstrap, tl)
    assert len(log) == 1 and not any(is_tombstoned(log, k) for k in log)


@pytest.mark.parametrize("failure", ["str-chunk", "source-error", "cancelled"])
async def test_a_put_that_fails_midway_tombstones_the_chunks_it_wrote(tl, bootstrap, failure):
    before = await within(tl.blobs.put("k", b"kept"))
    started = asyncio.Event()
    never = asyncio.Event()

    async def body():
        yield os.urandom(CHUNK_SIZE)
        yield os.urandom(CHUNK_SIZE + 3)
        started.set()
        if failure == "str-chunk":
            yield "a str"
        elif failure == "source-error":
            raise OSError("disk gone")
        else:
            await never.wait()

    task = asyncio.create_task(tl.blobs.put("k", body()))
    if failure == "cancelled":
        await within(started.wait())
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    else:
        with pytest.raises((ThreadLogError, OSError)) as err:
            await within(task)
        if failure == "str-chunk":
            assert err.value.code == "INVALID_ARGUMENT"
    flush_chunks(tl)
    assert await within(tl.blobs.head("k")) == before
    log = chunk_log(bootstrap, tl)
    failed = {v: ks for v, ks in versions_in(log).items() if v != before["etag"]}
    assert len(failed) == 1
    (keys,) = failed.values()
    assert len(keys) >= 2 and all(is_tombstoned(log, k) for k in keys)
    assert (await within(tl.blobs.get("k")))["body"] == b"kept"


async def test_an_unanswered_commit_is_abandoned_unless_it_committed(tl, bootstrap):
    # A put whose PutBlob got no reply sends AbandonBlobVersion: the decider
    # tombstones the chunks unless that version is the committed one.
    committed = await within(tl.blobs.put("k", os.urandom(CHUNK_SIZE + 1)))
    orphan = new_version()
    writer = ChunkWriter(tl.blobs._chunk_sink(), "k", orphan)
    await writer.write(os.urandom(2 * CHUNK_SIZE))
    refs = await writer.finish()
    assert len(refs) == 2
    await within(tl.blobs._abandon("k", orphan, len(refs)))
    await within(tl.blobs._abandon("k", committed["etag"], 2))  # the committed version stays
    log = chunk_log(bootstrap, tl)
    versions = versions_in(log)
    assert all(is_tombstoned(log, k) for k in versions[orphan])
    assert not any(is_tombstoned(log, k) for k in versions[committed["etag"]])
    assert await within(tl.blobs.head("k")) == committed
    assert (await within(tl.blobs.get("k")))["size"] == CHUNK_SIZE + 1


# -- concurrency --------------------------------------------------------------------------------
async def test_concurrent_puts_last_committed_wins_and_losers_leave_no_live_chunk(open_client, bootstrap):
    a = await open_client()
    b = await open_client()
    bodies = {n: bytes([n]) * (CHUNK_SIZE + 1000 * n) for n in range(8)}
    results = await within(asyncio.gather(*[
        (a if n % 2 else b).blobs.put("hot", bodies[n], custom_metadata={"n": str(n)}) for n in range(8)
    ]), 60)
    assert len({r["etag"] for r in results}) == 8
    assert len({r["createdAt"] for r in results}) == 1  # the first committed set it; all kept it

    # The last accepted PutBlob proposal in the key's log is the winner, and what everyone reads.
    codec = default_codec()
    puts = []
    for m in read_topic(bootstrap, a.runtime.topics.events, a.runtime.layout.events):
        _, env = codec.decode(m.value(), expect="threadlog.Proposal")
        if env["key"] == state.partition_key("hot") and env["type"] == "threadlog.cmd.PutBlob":
            assert a.runtime.judge.verdict(m.partition(), m.offset())["ok"]
            puts.append((m.offset(), codec.decode(env["payload"])[1]))
    assert len(puts) == 8
    winner = max(puts, key=lambda p: p[0])[1]
    for client in (a, b):
        got = await within(client.blobs.get("hot"))
        assert got["etag"] == winner["version"]
        assert got["body"] == bodies[int(got["customMetadata"]["n"])]

    log = chunk_log(bootstrap, a)
    versions = versions_in(log)
    assert set(versions) == {r["etag"] for r in results}
    for version, keys in versions.items():
        if version == winner["version"]:
            assert not any(is_tombstoned(log, k) for k in keys)
        else:
            assert all(is_tombstoned(log, k) for k in keys), version


# -- stale manifests ------------------------------------------------------------------------------
async def test_chunks_are_verified_against_the_manifest(tl):
    v1, v2 = os.urandom(2 * CHUNK_SIZE), os.urandom(2 * CHUNK_SIZE)
    await within(tl.blobs.put("k", v1))
    l1 = await layout(tl, "k")
    await within(tl.blobs.put("k", v2))
    l2 = await layout(tl, "k")
    reader = tl.blobs._chunk_reader()

    def fetch(version, chunks):
        wanted = [(i, ChunkRef(*c)) for i, c in enumerate(chunks)]
        return asyncio.to_thread(reader.fetch, "k", version, wanted)

    # A manifest naming offsets that hold another version's chunks is refused, whichever way round.
    with pytest.raises(ChunkGone):
        await within(fetch(l2["version"], l1["chunks"]))
    with pytest.raises(ChunkGone):
        await within(fetch(l1["version"], l2["chunks"]))
    # Offsets past the end of the partition, or a partition the topic does not
    # have: the chunk is gone, not waited for.
    with pytest.raises(ChunkGone):
        await within(fetch(l2["version"], [[p, o + 10_000, n] for p, o, n in l2["chunks"]]))
    with pytest.raises(ChunkGone):
        await within(fetch(l2["version"], [[tl.runtime.layout.blobs, 0, n] for _, _, n in l2["chunks"]]), 5)
    # A reader still holding the old manifest gets the old version whole -- never a mix.
    got = await within(fetch(l1["version"], l1["chunks"]))
    assert b"".join(got[i] for i in range(2)) == v1
    got = await within(fetch(l2["version"], l2["chunks"]))
    assert b"".join(got[i] for i in range(2)) == v2


async def test_a_get_whose_chunks_vanished_rereads_the_manifest(tl):
    v1, v2 = os.urandom(CHUNK_SIZE + 5), os.urandom(CHUNK_SIZE + 9)
    await within(tl.blobs.put("k", v1))
    l1 = await layout(tl, "k")
    await within(tl.blobs.put("k", v2))
    # The read began before the overwrite: it got v1's manifest, whose chunks
    # compaction then removed (modelled by offsets that hold nothing any more).
    vanished = {**l1, "chunks": [[p, o + 10_000, n] for p, o, n in l1["chunks"]]}
    real_layout = tl.blobs._layout
    calls = []

    async def first_stale(key):
        calls.append(key)
        return vanished if len(calls) == 1 else await real_layout(key)

    tl.blobs._layout = first_stale
    got = await within(tl.blobs.get("k"))
    assert len(calls) == 2
    assert got["body"] == v2 and got["etag"] == (await within(tl.blobs.head("k")))["etag"]


async def test_a_chunk_missing_from_the_current_version_is_an_error_never_wrong_bytes(tl):
    await within(tl.blobs.put("k", os.urandom(CHUNK_SIZE + 5)))
    current = await layout(tl, "k")
    broken = {**current, "chunks": [[p, o + 10_000, n] for p, o, n in current["chunks"]]}

    async def always_broken(key):
        return broken

    tl.blobs._layout = always_broken
    with pytest.raises(ThreadLogError) as err:
        await within(tl.blobs.get("k"))
    assert err.value.code == "UNAVAILABLE" and "missing" in err.value.message


def compact_fast(bootstrap: str, topic: str) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    entries = [ConfigEntry(name, value, incremental_operation=AlterConfigOpType.SET) for name, value in {
        "segment.ms": "100", "min.cleanable.dirty.ratio": "0.0001", "min.compaction.lag.ms": "0",
    }.items()]
    for fut in admin.incremental_alter_configs([ConfigResource("topic", topic, incremental_configs=entries)]).values():
        fut.result(30)


async def test_compaction_reclaims_superseded_chunks_and_reads_survive_it(tl, bootstrap):
    """Real log compaction: superseded chunks disappear, the current version still reads,
    and a reader holding the superseded manifest re-reads and gets the current one."""
    topic, partitions = tl.runtime.topics.blobs, tl.runtime.layout.blobs
    compact_fast(bootstrap, topic)
    v1, v2 = os.urandom(3 * CHUNK_SIZE), os.urandom(3 * CHUNK_SIZE + 1)
    await within(tl.blobs.put("k", v1))
    l1 = await layout(tl, "k")
    await within(tl.blobs.put("k", v2))
    l2 = await layout(tl, "k")

    # The log cleaner runs on the broker's own schedule (log.cleaner.backoff.ms)
    # and never touches a partition's active segment: keep rolling segments with
    # filler tombstones until the superseded chunks are gone, bounded.
    filler = Producer({"bootstrap.servers": bootstrap})
    old_keys = {f"k/{l1['version']}/{i}" for i in range(len(l1["chunks"]))}
    deadline = time.monotonic() + 100
    while True:
        for p in range(partitions):
            filler.produce(topic, None, b"filler", partition=p)
        filler.flush(10)
        log = chunk_log(bootstrap, tl)
        live_old = [k for k in old_keys if any(v is not None for _, _, v in log.get(k, []))]
        if not live_old:
            break
        assert time.monotonic() < deadline, f"compaction did not reclaim {live_old}"
        await asyncio.sleep(0.5)

    # Only the data went: each superseded chunk key is down to its tombstone.
    assert all(log.get(k) and all(v is None for _, _, v in log[k]) for k in old_keys)
    cur_keys = {f"k/{l2['version']}/{i}" for i in range(len(l2["chunks"]))}
    assert all(log[k][0][2] is not None for k in cur_keys)  # the current version is untouched
    assert (await within(tl.blobs.get("k")))["body"] == v2
    rng = await within(tl.blobs.get("k", range={"offset": CHUNK_SIZE - 1, "length": 2}))
    assert rng["body"] == v2[CHUNK_SIZE - 1:CHUNK_SIZE + 1]

    # A read that took v1's manifest just before the overwrite: its chunks are gone now.
    with pytest.raises(ChunkGone):
        await within(asyncio.to_thread(tl.blobs._chunk_reader().fetch, "k", l1["version"],
                                       [(i, ChunkRef(*c)) for i, c in enumerate(l1["chunks"])]))
    real_layout, calls = tl.blobs._layout, []

    async def first_stale(key):
        calls.append(key)
        return l1 if len(calls) == 1 else await real_layout(key)

    tl.blobs._layout = first_stale
    assert (await within(tl.blobs.get("k")))["body"] == v2
    assert len(calls) == 2


# -- forged commands --------------------------------------------------------------------------------
def put_payload(key: str, **over) -> dict:
    payload = {"key": key, "version": new_version(), "size": 3, "contentType": None, "customMetadata": None,
               "chunks": [{"partition": 0, "offset": 0, "length": 3}]}
    payload.update(over)
    return payload


@pytest.mark.parametrize(
    "why,type_name,partition_key,payload",
    [
        ("wrong partition key", "threadlog.cmd.PutBlob", "k", put_payload("k")),
        ("another blob's partition key", "threadlog.cmd.PutBlob", "blob:other", put_payload("k")),
        ("bad version", "threadlog.cmd.PutBlob", "blob:k", put_payload("k", version="not-hex")),
        ("upper-case version", "threadlog.cmd.PutBlob", "blob:k", put_payload("k", version="A" * 32)),
        ("size is not the sum", "threadlog.cmd.PutBlob", "blob:k", put_payload("k", size=4)),
        ("empty chunk", "threadlog.cmd.PutBlob", "blob:k",
         put_payload("k", size=0, chunks=[{"partition": 0, "offset": 0, "length": 0}])),
        ("oversized chunk", "threadlog.cmd.PutBlob", "blob:k",
         put_payload("k", size=MAX_CHUNK + 1, chunks=[{"partition": 0, "offset": 0, "length": MAX_CHUNK + 1}])),
        ("negative offset", "threadlog.cmd.PutBlob", "blob:k",
         put_payload("k", chunks=[{"partition": 0, "offset": -1, "length": 3}])),
        ("empty key", "threadlog.cmd.PutBlob", "blob:", put_payload("")),
        ("delete, wrong partition key", "threadlog.cmd.DeleteBlob", "k", {"key": "k"}),
        ("abandon, negative count", "threadlog.cmd.AbandonBlobVersion", "blob:k",
         {"key": "k", "version": new_version(), "chunkCount": -1}),
        ("abandon, bad version", "threadlog.cmd.AbandonBlobVersion", "blob:k",
         {"key": "k", "version": "x", "chunkCount": 1}),
    ],
)
async def test_forged_commands_are_refused_by_the_decider(tl, bootstrap, why, type_name, partition_key, payload):
    before = await within(tl.blobs.put("k", b"abc"))
    log_before = chunk_log(bootstrap, tl)
    with pytest.raises(ThreadLogError) as err:
        await within(tl.bus.send(type_name, partition_key, payload))
    assert err.value.code == "INVALID_ARGUMENT", why
    assert await within(tl.blobs.head("k")) == before
    assert (await within(tl.blobs.get("k")))["body"] == b"abc"
    assert chunk_log(bootstrap, tl) == log_before  # no tombstone either


async def test_a_replayed_commit_returns_the_record_and_keeps_the_chunks(tl, bootstrap):
    data = os.urandom(CHUNK_SIZE + 1)
    version = new_version()
    writer = ChunkWriter(tl.blobs._chunk_sink(), "k", version)
    await writer.write(data)
    refs = await writer.finish()
    payload = {"key": "k", "version": version, "size": len(data), "contentType": None, "customMetadata": None,
               "chunks": [r.as_avro() for r in refs]}
    first = await within(tl.bus.send("threadlog.cmd.PutBlob", "blob:k", payload))
    again = await within(tl.bus.send("threadlog.cmd.PutBlob", "blob:k", payload))
    assert again == first and first["etag"] == version
    log = chunk_log(bootstrap, tl)
    assert not any(is_tombstoned(log, k) for k in versions_in(log)[version])
    assert (await within(tl.blobs.get("k")))["body"] == data
