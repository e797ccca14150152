"""tl.artifacts (SPEC section 9): a port of TanStack AI's artifact-store
conformance behaviours, plus thread ownership, validation and cross-host reads."""

from __future__ import annotations

import asyncio
import math

import pytest
from confluent_kafka import Producer
from replay_support import replayed_verdicts
from support import encode_frozen, namespace_of_an_earlier_version, raw_proposal, state_of, within
from threadlog.processors.judge import all_verdicts

from threadlog import ThreadLogError
from threadlog.kernel.partitioning import partition_for


def _art(artifact_id="a1", run_id="r1", thread_id="t1", created_at=100, **extra):
    return {"artifactId": artifact_id, "runId": run_id, "threadId": thread_id, "name": "cat.png",
            "mimeType": "image/png", "size": 1234, "createdAt": created_at, **extra}


def _ids(records):
    return [r["artifactId"] for r in records]


async def test_save_and_get_round_trip(tl):
    full = _art(blobKey="artifacts/r1/a1", sourceUrl="https://example.com/cat.png", created_at=1.5)
    await within(tl.artifacts.save(full))
    assert await within(tl.artifacts.get("a1")) == full
    bare = _art("a2", blobKey=None, sourceUrl=None)
    await within(tl.artifacts.save(bare))
    assert await within(tl.artifacts.get("a2")) == _art("a2")  # None = absent
    assert await within(tl.artifacts.get("missing")) is None


async def test_save_upserts_the_whole_record(tl):
    await within(tl.artifacts.save(_art(blobKey="k1")))
    replaced = _art(run_id="r2", name="dog.png", size=0, created_at=50)
    await within(tl.artifacts.save(replaced))
    assert await within(tl.artifacts.get("a1")) == replaced  # blobKey gone with the old record
    assert await within(tl.artifacts.list("r1")) == []
    assert await within(tl.artifacts.list("r2")) == [replaced]
    assert await within(tl.artifacts.list_for_thread("t1")) == [replaced]


async def test_lists_are_ordered_by_created_at_then_id_bytes(tl):
    rows = [("c", "r1", "t1", 30), ("b", "r1", "t1", 10), ("é", "r2", "t1", 20), ("z", "r1", "t1", 20),
            ("a", "r2", "t1", 20), ("Z", "r1", "t1", 20), ("x", "r1", "t2", 5)]
    for artifact_id, run_id, thread_id, at in rows:
        await within(tl.artifacts.save(_art(artifact_id, run_id, thread_id, at)))
    assert _ids(await within(tl.artifacts.list_for_thread("t1"))) == ["b", "Z", "a", "z", "é", "c"]
    assert _ids(await within(tl.artifacts.list("r1"))) == ["x", "b", "Z", "z", "c"]
    assert _ids(await within(tl.artifacts.list("r2"))) == ["a", "é"]
    assert await within(tl.artifacts.list("none")) == []
    assert await within(tl.artifacts.list_for_thread("none")) == []


async def test_delete_and_delete_for_run(tl):
    for artifact_id, run_id, thread_id in [("a", "r1", "t1"), ("b", "r1", "t2"), ("c", "r1", "t3"),
                                           ("d", "r2", "t1"), ("e", "r2", "t2")]:
        await within(tl.artifacts.save(_art(artifact_id, run_id, thread_id)))
    await within(tl.artifacts.delete("a"))
    assert await within(tl.artifacts.get("a")) is None
    await within(tl.artifacts.delete("a"))  # absent: silent
    await within(tl.artifacts.delete("never-existed"))
    await within(tl.artifacts.delete_for_run("r1"))  # spans threads t2, t3
    assert await within(tl.artifacts.list("r1")) == []
    assert _ids(await within(tl.artifacts.list("r2"))) == ["d", "e"]
    assert _ids(await within(tl.artifacts.list_for_thread("t2"))) == ["e"]
    assert await within(tl.artifacts.list_for_thread("t3")) == []
    await within(tl.artifacts.delete_for_run("r1"))  # nothing left: silent
    await within(tl.artifacts.delete_for_run("no-such-run"))


async def test_a_deleted_id_can_be_saved_again_anywhere(tl):
    await within(tl.artifacts.save(_art()))
    await within(tl.artifacts.delete("a1"))
    moved = _art(thread_id="t9")
    await within(tl.artifacts.save(moved))
    assert await within(tl.artifacts.get("a1")) == moved
    assert await within(tl.artifacts.list_for_thread("t1")) == []


def _threads(tl, same_partition: bool) -> tuple[str, str]:
    """Two threads on one partition, or on two."""
    total = tl.runtime.layout.events
    first = "t1"
    for n in range(1000):
        other = f"t-other-{n}"
        if (partition_for(other, total) == partition_for(first, total)) == same_partition:
            return first, other
    raise AssertionError("no such thread")


@pytest.mark.parametrize("same_partition", [False, True], ids=["across-partitions", "one-partition"])
async def test_save_on_another_thread_moves_the_artifact_there(open_client, same_partition):
    """SPEC 9: `save(record)` upserts -- also with another threadId than the one the
    artifact lives on. Before, that save was refused (INVALID_ARGUMENT) because a move
    spans two partitions; now it moves in two steps (the handler's doc)."""
    tl = await open_client()
    old_thread, new_thread = _threads(tl, same_partition)
    await within(tl.artifacts.save(_art(thread_id=old_thread, blobKey="artifacts/r1/a1")))
    moved = _art(thread_id=new_thread, name="moved.png", run_id="r2")
    await within(tl.artifacts.save(moved))
    assert await within(tl.artifacts.get("a1")) == moved
    assert await within(tl.artifacts.list_for_thread(old_thread)) == []
    assert await within(tl.artifacts.list_for_thread(new_thread)) == [moved]
    assert await within(tl.artifacts.list("r1")) == []
    assert await within(tl.artifacts.list("r2")) == [moved]
    # And back, then an upsert where it now lives; a fresh host judging the log agrees.
    back = _art(thread_id=old_thread, size=7)
    await within(tl.artifacts.save(back))
    await within(tl.artifacts.save({**back, "size": 8}))
    fresh = await open_client()
    for client in (tl, fresh):
        assert await within(client.artifacts.get("a1")) == {**back, "size": 8}
        assert await within(client.artifacts.list_for_thread(new_thread)) == []
        assert await within(client.artifacts.list("r1")) == [{**back, "size": 8}]


async def test_a_save_interrupted_between_its_steps_leaves_a_twin_the_next_save_removes(open_client):
    """Step 1 of a move (the save on the new thread) judged, step 2 (removing the old
    copy) never sent: the client died in between. Tried (a review of the first
    version of moves): the twin stayed for good -- a retried save on the new thread
    was a plain upsert there, `get` kept answering the old copy, and saves on a
    third thread were refused. Every save now removes the copies it finds on other
    threads."""
    tl = await open_client()
    old_thread, new_thread = _threads(tl, False)
    await within(tl.artifacts.save(_art(thread_id=old_thread)))
    moved = _art(thread_id=new_thread, name="moved.png")
    body = tl.runtime.codec.encode("threadlog.cmd.SaveArtifact",
                                   {"artifact": {"blobKey": None, "sourceUrl": None, **moved}})
    verdict = await within(tl.bus.propose("threadlog.cmd.SaveArtifact", new_thread, body))
    assert verdict["ok"] and [f["type"] for f in verdict["follow"]] == ["threadlog.cmd.ReleaseArtifactCopy"]
    for t in (old_thread, new_thread):  # the twin: a copy on each thread
        assert len(await within(tl.artifacts.list_for_thread(t))) == 1
    again = {**moved, "size": 5}
    await within(tl.artifacts.save(again))  # the retry
    fresh = await open_client()
    for client in (tl, fresh):
        assert await within(client.artifacts.get("a1")) == again
        assert await within(client.artifacts.list_for_thread(old_thread)) == []
        assert await within(client.artifacts.list("r1")) == [again]
    third = _art(thread_id="t-third", size=6)
    await within(tl.artifacts.save(third))
    assert await within(tl.artifacts.get("a1")) == third


async def test_a_move_whose_copy_release_is_not_written_is_outcome_unknown_and_a_second_save_completes_it(
        open_client):
    """Step 1 of a move (the save on the new thread) accepted, step 2 (removing the
    old copy) refused by this client's producer before it was written (its queue
    full; a client closing does the same). Tried (a review): the save raised
    UNAVAILABLE -- "nothing written" -- with the artifact already on its new
    thread. Now OUTCOME_UNKNOWN, and the same save made again completes the move."""
    tl = await open_client()
    old_thread, new_thread = _threads(tl, False)
    await within(tl.artifacts.save(_art(thread_id=old_thread)))
    pump = tl.bus._pump
    produce = pump.produce

    def full_for_releases(topic, value, key, **kw):
        if value is not None and b"ReleaseArtifactCopy" in value:
            raise BufferError("Local: Queue full")  # what librdkafka raises at a full queue
        return produce(topic, value, key, **kw)

    moved = _art(thread_id=new_thread, name="moved.png")
    pump.produce = full_for_releases
    try:
        with pytest.raises(ThreadLogError) as err:
            await within(tl.artifacts.save(moved))
    finally:
        pump.produce = produce
    assert err.value.code == "OUTCOME_UNKNOWN" and "ReleaseArtifactCopy" in err.value.message
    assert await within(tl.artifacts.get("a1")) == moved  # step 1 applied: not "nothing written"
    assert len(await within(tl.artifacts.list_for_thread(old_thread))) == 1  # the twin step 2 would remove
    await within(tl.artifacts.save(moved))
    assert await within(tl.artifacts.list_for_thread(old_thread)) == []
    assert await within(tl.artifacts.list_for_thread(new_thread)) == [moved]


async def test_a_copy_release_naming_older_rules_is_judged_as_judges_of_those_rules_did(open_client, bootstrap,
                                                                                       namespace):
    """`ReleaseArtifactCopy` is new in judging rules 5. A judge of rules 4 did not
    know its schema and refused it (INVALID_MESSAGE); tried (a review): one sent
    raw naming rules 4 was accepted here and removed the artifact, so a rebuild by
    this code disagreed with what older judges told. Refused alike now, changing
    nothing; naming rules 5, it is judged. Its second schema version (`before`)
    came with rules 8: written with it and naming rules 5, it is refused as judges
    of rules 5 to 7 refused it (they could not decode it), with their message also
    when the payload is corrupt besides (tried, a review: decoded first, it got
    another). (On a partition that
    judged only rules 4 so far: one past rules 5 judges every proposal by at least
    those.) A namespace created by an earlier version: no rules floor marker."""
    namespace_of_an_earlier_version(bootstrap, namespace)
    tl = await open_client()
    codec, total = tl.runtime.codec, tl.runtime.layout.events
    p = partition_for("t1", total)
    saved = codec.encode("threadlog.cmd.SaveArtifact", {"artifact": {"blobKey": None, "sourceUrl": None, **_art()}})
    release = {"artifactId": "a1", "threadId": "t1", "savedOn": "t-other"}
    v1 = encode_frozen("threadlog.cmd.ReleaseArtifactCopy", 1, release)
    v2 = codec.encode("threadlog.cmd.ReleaseArtifactCopy", release)  # `before` null: what rules 5-7 meant
    assert v1[2:10] != v2[2:10]
    sent: list[int] = []
    producer = Producer({"bootstrap.servers": bootstrap})
    for n, (kind, body, rules) in enumerate([("SaveArtifact", saved, 4), ("ReleaseArtifactCopy", v1, 4),
                                             ("ReleaseArtifactCopy", v2, 4), ("ReleaseArtifactCopy", v2, 5),
                                             ("ReleaseArtifactCopy", v2 + b"\x00", 5),
                                             ("ReleaseArtifactCopy", v1, 5)]):
        producer.produce(tl.runtime.topics.events,
                         raw_proposal(codec, f"threadlog.cmd.{kind}", "t1", body, rules=rules, seen=[0] * total),
                         b"t1", partition=p, on_delivery=lambda err, msg: sent.append(msg.offset()))
        assert producer.flush(30) == 0
        await within(tl.read_barrier(None))
        if n == 0:
            assert await within(tl.artifacts.get("a1")) == _art()
            continue
        verdict = tl.runtime.judge.verdict(p, sent[-1])
        if n < 5:  # corrupt too (n == 4): refused as those judges did, not decoded first
            assert verdict == {"ok": False, "code": "INVALID_MESSAGE",
                               "message": f"proposal payload undecodable: unknown schema fingerprint "
                                          f"{body[2:10].hex()}"}, (n, verdict)
            assert await within(tl.artifacts.get("a1")) == _art()
        else:
            assert verdict["ok"] and await within(tl.artifacts.get("a1")) is None


@pytest.mark.parametrize("same_partition", [False, True], ids=["across-partitions", "one-partition"])
async def test_two_saves_of_one_id_racing_on_two_threads_never_leave_none(open_client, bootstrap, namespace,
                                                                           tmp_path, same_partition):
    """Tried (a review, reproduced before judging rules 8): the artifact lives on A;
    X saves it on B while Y saves it again on A. X's first step (on B) saw A's old
    copy; Y's first step ran after it, saw X's copy on B and removed it; then X's
    second step removed A's copy -- Y's new one. Both calls succeeded and no thread
    held the artifact. X's removal now names the position it saw and spares Y's
    copy, saved after it: serial order X then Y. Driven step by step (X's second
    step held back as a client between its steps would); a fresh client rebuilding
    the log, and a replay of the verdicts, agree."""
    tl = await open_client()
    a, b = _threads(tl, same_partition)
    await within(tl.artifacts.save(_art(thread_id=a)))
    x = _art(thread_id=b, name="x.png")
    step1 = await within(tl.bus.propose("threadlog.cmd.SaveArtifact", b, tl.runtime.codec.encode(
        "threadlog.cmd.SaveArtifact", {"artifact": {"blobKey": None, "sourceUrl": None, **x}})))
    assert step1["ok"] and [(f["key"], f["type"]) for f in step1["follow"]] == [
        (a, "threadlog.cmd.ReleaseArtifactCopy")]
    y = _art(thread_id=a, name="y.png", size=9)
    await within(tl.artifacts.save(y))  # Y, whole: its removal of X's copy on B included
    assert await within(tl.artifacts.list_for_thread(b)) == []
    step2 = step1["follow"][0]
    verdict = await within(tl.bus.propose(step2["type"], step2["key"],
                                          tl.runtime.codec.encode(step2["type"], step2["payload"])))
    assert verdict["ok"]
    fresh = await open_client()
    for client in (tl, fresh):
        assert await within(client.artifacts.get("a1")) == y
        assert await within(client.artifacts.list_for_thread(a)) == [y]
        assert await within(client.artifacts.list_for_thread(b)) == []
    total, topic = tl.runtime.layout.events, tl.runtime.topics.events
    replayed = await asyncio.to_thread(replayed_verdicts, bootstrap, topic, total, tmp_path / "replayed")
    for p in {partition_for(a, total), partition_for(b, total)}:
        assert all_verdicts(tl.runtime.store, p) == replayed[p]


async def _judged(tl, bootstrap, type_name: str, key: str, body: bytes, *, rules: int, seen: list[int]) -> dict:
    """Write a proposal raw (naming `seen` as its proposer would have) and return its verdict."""
    total = tl.runtime.layout.events
    p, sent = partition_for(key, total), []
    producer = Producer({"bootstrap.servers": bootstrap})
    producer.produce(tl.runtime.topics.events, raw_proposal(tl.runtime.codec, type_name, key, body, rules=rules,
                                                            seen=seen),
                     key.encode(), partition=p, on_delivery=lambda err, msg: sent.append(msg.offset()))
    assert producer.flush(30) == 0
    await within(tl.read_barrier(None))
    return tl.runtime.judge.verdict(p, sent[-1])


async def test_a_move_racing_a_save_in_place_that_neither_saw_leaves_a_twin_the_next_save_removes(
        open_client, bootstrap):
    """X moves the artifact from A to B while Y saves it again on A, neither seeing
    the other. The move's removal spares Y's copy (X did not see it): a twin, the
    price of never losing a save (processors/handlers/artifacts.py says why the
    rules that made one copy here were dropped). The id's next save removes it."""
    tl = await open_client()
    codec, total = tl.runtime.codec, tl.runtime.layout.events
    a, b = _threads(tl, False)
    await within(tl.artifacts.save(_art(thread_id=a)))
    y_began = await within(tl.bus.end_offsets())  # Y reads the positions before X's first step lands

    def save(record: dict) -> bytes:
        return codec.encode("threadlog.cmd.SaveArtifact", {"artifact": {"blobKey": None, "sourceUrl": None, **record}})

    x = _art(thread_id=b, name="x.png")
    step1 = await _judged(tl, bootstrap, "threadlog.cmd.SaveArtifact", b, save(x), rules=8,
                          seen=[(await within(tl.bus.end_offsets()))[q] for q in range(total)])
    y = _art(thread_id=a, name="y.png", size=9)
    assert (await _judged(tl, bootstrap, "threadlog.cmd.SaveArtifact", a, save(y), rules=8,
                          seen=[y_began[q] for q in range(total)])).get("follow") is None  # Y saw no copy elsewhere
    [step2] = step1["follow"]
    assert (await _judged(tl, bootstrap, step2["type"], step2["key"], codec.encode(step2["type"], step2["payload"]),
                          rules=8, seen=[]))["ok"]
    assert await within(tl.artifacts.list_for_thread(a)) == [y]
    assert await within(tl.artifacts.list_for_thread(b)) == [x]
    z = _art(thread_id=b, name="z.png")
    await within(tl.artifacts.save(z))
    fresh = await open_client()
    for client in (tl, fresh):
        assert await within(client.artifacts.list_for_thread(a)) == []
        assert await within(client.artifacts.get("a1")) == z


async def test_two_saves_on_twins_that_neither_saw_keep_both_copies(open_client, bootstrap):
    """The artifact has a twin (A and B each hold a copy: a save interrupted between
    its steps). X saves it again on B and Y on A, each seeing the other thread's
    old copy but not the other's save, and each asks for the other's copy to go.
    Tried (a review's model of the interleavings, on a rule that spared only copies
    whose save saw the asking one): both copies went. Each removal now spares the
    copy its save did not see: the twin stays, both saves stand."""
    tl = await open_client()
    codec, total = tl.runtime.codec, tl.runtime.layout.events
    a, b = _threads(tl, False)

    def save(record: dict) -> bytes:
        return codec.encode("threadlog.cmd.SaveArtifact", {"artifact": {"blobKey": None, "sourceUrl": None, **record}})

    await within(tl.artifacts.save(_art(thread_id=a)))
    assert (await within(tl.bus.propose("threadlog.cmd.SaveArtifact", b, save(_art(thread_id=b)))))["ok"]
    for t in (a, b):  # the twin (its step 2 never sent)
        assert len(await within(tl.artifacts.list_for_thread(t))) == 1
    began = await within(tl.bus.end_offsets())
    seen = [began[q] for q in range(total)]
    x, y = _art(thread_id=b, name="x.png"), _art(thread_id=a, name="y.png")
    steps = []
    for thread, record in ((b, x), (a, y)):
        verdict = await _judged(tl, bootstrap, "threadlog.cmd.SaveArtifact", thread, save(record), rules=8, seen=seen)
        steps += verdict["follow"]
    assert sorted(step["key"] for step in steps) == sorted([a, b])
    for step in steps:
        assert (await _judged(tl, bootstrap, step["type"], step["key"], codec.encode(step["type"], step["payload"]),
                              rules=8, seen=[]))["ok"]
    fresh = await open_client()
    for client in (tl, fresh):
        assert await within(client.artifacts.list_for_thread(a)) == [y]
        assert await within(client.artifacts.list_for_thread(b)) == [x]


@pytest.mark.parametrize("between", ["a delete", "two saves"])
async def test_a_late_removal_never_takes_a_copy_saved_after_its_save(open_client, bootstrap, between):
    """X moves the artifact from A to B; its removal of A's copy is late. Meanwhile,
    in order, each seeing everything before it: Y saves it again on A (removing X's
    copy on B), or X's copy is deleted and then Y saves on A; then Z saves on A
    too. Tried (a review's model, on a rule deciding which of two saves came
    later): X's late removal took A's copy, and no thread held the artifact.
    Serial order X, ..., Z keeps Z's copy on A, and so does the judge."""
    tl = await open_client()
    codec, total = tl.runtime.codec, tl.runtime.layout.events
    a, b = _threads(tl, False)
    await within(tl.artifacts.save(_art(thread_id=a)))
    x = _art(thread_id=b, run_id="rx", name="x.png")
    step1 = await _judged(tl, bootstrap, "threadlog.cmd.SaveArtifact", b, codec.encode(
        "threadlog.cmd.SaveArtifact", {"artifact": {"blobKey": None, "sourceUrl": None, **x}}), rules=8,
        seen=[(await within(tl.bus.end_offsets()))[q] for q in range(total)])
    if between == "a delete":
        await within(tl.artifacts.delete_for_run("rx"))
    await within(tl.artifacts.save(_art(thread_id=a, name="y.png")))
    z = _art(thread_id=a, name="z.png")
    await within(tl.artifacts.save(z))
    [step2] = step1["follow"]
    assert (await _judged(tl, bootstrap, step2["type"], step2["key"], codec.encode(step2["type"], step2["payload"]),
                          rules=8, seen=[]))["ok"]
    fresh = await open_client()
    for client in (tl, fresh):
        assert await within(client.artifacts.list_for_thread(a)) == [z]
        assert await within(client.artifacts.list_for_thread(b)) == []
        assert await within(client.artifacts.get("a1")) == z


BAD = [
    ({**_art(), "extra": 1}, "unexpected key"),
    ({**_art(), "status": "ok"}, "unexpected key"),
    ({k: v for k, v in _art().items() if k != "size"}, "missing size"),
    ({k: v for k, v in _art().items() if k != "createdAt"}, "missing createdAt"),
    (_art(artifact_id=""), "empty id"),
    (_art(run_id="\ud800"), "lone surrogate run id"),
    (_art(thread_id=5), "int thread id"),
    ({**_art(), "name": ""}, "empty name"),
    ({**_art(), "name": None}, "None name"),
    ({**_art(), "mimeType": 3}, "int mimeType"),
    ({**_art(), "size": -1}, "negative size"),
    ({**_art(), "size": 1.0}, "float size"),
    ({**_art(), "size": True}, "bool size"),
    ({**_art(), "size": 2**53}, "size past 2**53-1"),
    (_art(created_at=math.nan), "NaN createdAt"),
    (_art(created_at="1"), "str createdAt"),
    (_art(blobKey=5), "int blobKey"),
    (_art(sourceUrl=""), "empty sourceUrl"),
    ("a1", "not a dict"),
]


@pytest.mark.parametrize("record, why", BAD)
async def test_bad_records_are_refused_and_change_nothing(tl, record, why):
    await within(tl.artifacts.save(_art("keep")))
    before = await state_of(tl)
    with pytest.raises(ThreadLogError) as err:
        await within(tl.artifacts.save(record))
    assert err.value.code == "INVALID_ARGUMENT", why
    assert await state_of(tl) == before
    assert _ids(await within(tl.artifacts.list_for_thread("t1"))) == ["keep"]


async def test_bad_ids_are_refused(tl):
    for bad in ("", "\ud800", None, 1):
        for method in (tl.artifacts.get, tl.artifacts.list, tl.artifacts.list_for_thread, tl.artifacts.delete,
                       tl.artifacts.delete_for_run):
            with pytest.raises(ThreadLogError) as err:
                await within(method(bad))
            assert err.value.code == "INVALID_ARGUMENT", (method.__name__, bad)


async def test_returned_records_are_fresh_copies(tl):
    await within(tl.artifacts.save(_art()))
    got = await within(tl.artifacts.get("a1"))
    got["name"] = "changed"
    (await within(tl.artifacts.list("r1")))[0]["size"] = 0
    assert await within(tl.artifacts.get("a1")) == _art()


async def test_a_second_client_reads_every_write_immediately(open_client):
    a = await open_client()
    b = await open_client()
    for n in range(4):
        await within(a.artifacts.save(_art(f"a{n}", thread_id=f"t{n % 2}", created_at=n)))
        assert (await within(b.artifacts.get(f"a{n}")))["threadId"] == f"t{n % 2}"
        assert _ids(await within(b.artifacts.list("r1"))) == [f"a{i}" for i in range(n + 1)]
    await within(b.artifacts.delete("a0"))
    assert await within(a.artifacts.get("a0")) is None
    await within(b.artifacts.delete_for_run("r1"))
    assert await within(a.artifacts.list("r1")) == []
    assert await within(a.artifacts.list_for_thread("t1")) == []
