"""Core v2: the log is the arbiter.

Every record of `<ns>.events` is a proposal judged by a deterministic fold, so:
- two independent judges (two hosts, each folding into its own store) and a
  rebuild from offset 0 in another process reach identical verdicts, proposal
  by proposal, under racing writers, lease expiry by an injected clock and
  checks of ids held on other partitions;
- nothing written straight to a topic changes state without passing the rules:
  garbage, a proposal on the wrong partition, a forged claim, a chunk of an
  epoch nobody granted.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
from checkpoint_helpers import MutableClock, checkpoint, refused, threads_on_distinct_partitions
from confluent_kafka import Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from delivery_support import chunk, collect
from replay_support import replayed_verdicts
from support import namespace_of_an_earlier_version, raw_proposal, state_of, within
from threadlog.processors.judge import all_verdicts, decision_time
from threadlog.projections.partition_stores import PartitionStores

from threadlog.kernel.errors import (
    INVALID_ARGUMENT,
    INVALID_MESSAGE,
    RUN_CLAIM_LOST,
    STALE_HEAD,
    UNAVAILABLE,
    WRITER_CONFLICT,
    WRITER_LOST,
    ThreadLogError,
)
from threadlog.kernel.partitioning import partition_for


def _verdicts(store: PartitionStores, partitions: int) -> dict[int, list]:
    return {p: all_verdicts(store, p) for p in range(partitions)}


async def _race_appends(tl, thread: str, writer, rounds: int) -> list:
    """`rounds` pairs of appends racing for the same head: one of each pair wins."""
    outcomes = []
    head = None
    for i in range(rounds):
        calls = [tl.checkpoints.append(checkpoint=checkpoint(f"{thread}-{i}-{side}", thread, head),
                                       expected_head_id=head, writer=writer) for side in "ab"]
        results = await asyncio.gather(*calls, return_exceptions=True)
        won = [r for r in results if isinstance(r, str)]
        lost = [r for r in results if isinstance(r, ThreadLogError)]
        assert len(won) == 1 and len(lost) == 1, results
        assert lost[0].code in (STALE_HEAD, "SANDBOX_SNAPSHOT_PARENT_MISMATCH")
        head = won[0]
        outcomes.append(head)
    return outcomes


async def test_two_judges_and_a_rebuild_reach_identical_verdicts(open_client, bootstrap, namespace, tmp_path):
    clock = MutableClock()
    a = await open_client(clock=clock, lease_duration_ms=10_000, renew_after_ms=1_000)
    b = await open_client(clock=clock, lease_duration_ms=10_000, renew_after_ms=1_000)
    threads = threads_on_distinct_partitions(a, 3, "judged")
    # Renewed by nobody: expiry is decided by the injected clock below.
    leases = [await within(a.checkpoints.acquire_writer(t, auto_renew=False)) for t in threads]
    # Racing writers on two hosts, each racing pair on one thread.
    await within(asyncio.gather(*[_race_appends(cl, t, lease, 4)
                                  for cl, t, lease in zip([a, b, a], threads, leases, strict=True)]), 60)
    # A duplicate checkpoint id held on ANOTHER partition: judged as of `seen`.
    dup = checkpoint(f"{threads[0]}-0-a", threads[1], None) | {"id": (await a.checkpoints.list(threads[0]))[0]["id"]}
    lease1 = leases[1]
    head1 = await a.checkpoints.get_head(threads[1])
    await refused(b.checkpoints.append(checkpoint=dup | {"parentCheckpointId": head1}, expected_head_id=head1,
                                       writer=lease1), "SANDBOX_SNAPSHOT_DUPLICATE_ID")
    # Lease expiry by the injected clock, carried in the proposals.
    await refused(b.checkpoints.acquire_writer(threads[2]), WRITER_CONFLICT)
    clock.advance(10_000)
    successor = await within(b.checkpoints.acquire_writer(threads[2]))
    assert successor.fence == leases[2].fence + 1
    await refused(a.checkpoints.append(checkpoint=checkpoint("late", threads[2], "x"), expected_head_id="x",
                                       writer=leases[2]), WRITER_LOST)
    # Runs, claims, interrupts, transcripts: the other rule sets too.
    await within(a.runs.create_or_resume(run_id="r1", thread_id=threads[0], started_at=1))
    await within(b.runs.create_or_resume(run_id="r1", thread_id=threads[1], started_at=2))  # exists elsewhere
    assert [await within(cl.runs.claim("r1")) for cl in (a, b)] == [1, 2]
    await within(b.messages.save_thread(threads[2], [{"n": 1}]))

    partitions = a.runtime.layout.events
    await a.read_barrier(None)
    await b.read_barrier(None)
    va, vb = _verdicts(a.runtime.store, partitions), _verdicts(b.runtime.store, partitions)
    assert sum(len(v) for v in va.values()) > 20
    assert any(not verdict["ok"] for vs in va.values() for _, verdict in vs)
    assert va == vb
    # A rebuild from offset 0 in another process judges everything again, alike.
    path = tmp_path / "rebuilt"
    proc = subprocess.run([sys.executable, "-m", "threadlog", "rebuild", "--bootstrap", bootstrap,
                           "--namespace", namespace, "--store", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rebuilt = PartitionStores(path, a.runtime.topics.events)
    for p in range(partitions):
        rebuilt.open(p)
    try:
        assert _verdicts(rebuilt, partitions) == va
    finally:
        rebuilt.close()


async def test_garbage_and_misrouted_proposals_are_refused_and_change_nothing(tl, bootstrap):
    await within(tl.messages.save_thread("t", [{"n": 1}]))
    before = await state_of(tl)
    topic, partitions = tl.runtime.topics.events, tl.runtime.layout.events
    p = partition_for("t", partitions)
    wrong = (p + 1) % partitions
    codec = tl.runtime.codec
    forged = raw_proposal(codec, "threadlog.cmd.SaveTranscript", "t", {"threadId": "t", "messages": "[]"})
    old_event = codec.encode("threadlog.Event", {"key": "t", "seq": 9, "decidedAt": 1.0, "commandId": "x",
                                                 "type": "threadlog.evt.TranscriptSaved",
                                                 "payload": codec.encode("threadlog.evt.TranscriptSaved",
                                                                         {"threadId": "t", "messages": "[]"})})
    producer = Producer({"bootstrap.servers": bootstrap})
    # Deliveries on different partitions are acknowledged in any order: each is kept at its send index.
    sent: dict[int, tuple[int, int]] = {}
    for i, (part, value) in enumerate([(p, b"\xc3\x01garbage"), (p, old_event), (wrong, forged)]):
        producer.produce(topic, value, b"t", partition=part,
                         on_delivery=lambda err, msg, i=i: sent.__setitem__(i, (msg.partition(), msg.offset())))
    assert producer.flush(30) == 0 and len(sent) == 3
    assert await state_of(tl) == before
    assert await within(tl.messages.load_thread("t")) == [{"n": 1}]
    codes = [tl.runtime.judge.verdict(*sent[i])["code"] for i in range(3)]
    assert codes == [INVALID_MESSAGE, INVALID_MESSAGE, INVALID_ARGUMENT]
    # The judge is still judging.
    await within(tl.messages.save_thread("t", [{"n": 2}]))
    assert await within(tl.messages.load_thread("t")) == [{"n": 2}]


async def test_a_batch_failing_after_it_was_stored_still_answers_who_waits(tl, bootstrap, monkeypatch):
    """A bug raised in the middle of a batch -- here once, right after a
    partition's state, verdicts and position were stored: the judge rewinds to
    the stored positions and goes on, and whoever waits for a verdict that
    batch stored hears it (it is never judged or published again)."""
    judge, topic = tl.runtime.judge, tl.runtime.topics.events
    p = 0
    await within(tl.read_barrier(None))
    at = judge.applied(p)  # a fresh namespace: past its rules floor marker, the next record of p is here
    assert at == 1
    loop = asyncio.get_running_loop()
    heard: asyncio.Future = loop.create_future()
    judge.on_verdict(p, at, lambda v: loop.call_soon_threadsafe(heard.set_result, v))
    real, failed = judge.ahead.judged, []

    def judged_then_fail(part: int, nxt: int) -> None:
        real(part, nxt)
        if not failed:
            failed.append((part, nxt))
            raise RuntimeError("injected: a bug after the batch was stored")

    monkeypatch.setattr(judge.ahead, "judged", judged_then_fail)
    producer = Producer({"bootstrap.servers": bootstrap})
    sent = []
    producer.produce(topic, b"\xc3\x01garbage", b"t", partition=p,
                     on_delivery=lambda err, msg: sent.append(msg.offset()))
    assert producer.flush(30) == 0 and sent == [at]
    verdict = await within(heard, 10)
    assert failed == [(p, at + 1)] and verdict["ok"] is False and verdict["code"] == INVALID_MESSAGE
    assert judge.applied(p) == at + 1
    # The judge is still judging.
    await within(tl.messages.save_thread("t", [{"n": 1}]))
    assert await within(tl.messages.load_thread("t")) == [{"n": 1}]


async def test_an_epoch_claim_never_granted_is_refused_and_never_read(tl, bootstrap):
    await within(tl.runs.create_or_resume(run_id="r", thread_id="t", started_at=1))
    assert await within(tl.runs.claim("r")) == 1
    assert await within(tl.runs.claim("r")) == 2
    current = tl.delivery("r", epoch=2)
    await within(current.append([chunk(0)]))
    # A driver that makes an epoch up holds nothing.
    made_up = await refused(tl.delivery("r", epoch=7).append([chunk(99)]), RUN_CLAIM_LOST)
    assert "never granted" in made_up.message and "epoch 2" in made_up.message, made_up  # not "superseded"
    # Its close too (tried: it returned as if closed, and the log stayed open).
    made_up = await refused(tl.delivery("r", epoch=7).close(), RUN_CLAIM_LOST)
    assert "never granted" in made_up.message, made_up
    # Nor does a record of that epoch forged straight onto the topic, nor a
    # forged claim marker: a claim is granted by the fold, it never names its epoch.
    svc = tl._delivery
    producer = Producer({"bootstrap.servers": bootstrap})
    part = svc.writer.partition_of("r")
    forged_chunk = svc.writer.encode({"runId": "r", "kind": "chunks", "epoch": 7, "chunks": ['{"i": 98}']})
    producer.produce(svc.topic, forged_chunk, b"r", partition=part)
    assert producer.flush(30) == 0
    await within(current.append([chunk(1)]))  # still the holder: epoch 2
    forged_claim = svc.writer.encode({"runId": "r", "kind": "claim", "epoch": 99})
    producer.produce(svc.topic, forged_claim, b"r", partition=part)
    assert producer.flush(30) == 0
    await refused(current.append([chunk(2)]), RUN_CLAIM_LOST)  # the forged claim is a claim: epoch 100
    assert await within(tl.runs.claim("r")) == 101
    await within(tl.delivery("r", epoch=101).close())
    got = [c for _, c in await within(collect(tl.delivery("r").read("-1")))]
    assert got == [chunk(0), chunk(1)]


async def test_a_log_whose_first_records_were_deleted_is_not_judged_from_where_it_now_starts(open_client,
                                                                                            bootstrap):
    """Tried (a review): the first records of an events partition deleted
    (`delete_records`, as an operator could), a fresh client judged that
    partition from where the log now starts -- verdicts no judge of the whole
    log reaches, and reads served from them -- while its reads of other
    partitions timed out saying only "did not reach". Now the partition is
    not judged at all and a read of it says why at once."""
    first = await open_client(partitions=1)
    await within(first.messages.save_thread("t", ["one"]))
    await within(first.messages.save_thread("t", ["two"]))
    topic = first.runtime.topics.events
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for fut in admin.delete_records([TopicPartition(topic, 0, 1)], request_timeout=30).values():
        fut.result(timeout=30)
    fresh = await open_client()
    with pytest.raises(ThreadLogError) as refused_read:
        await within(fresh.messages.load_thread("t"), 60)
    assert refused_read.value.code == UNAVAILABLE
    assert "partition 0 of" in refused_read.value.message and "no longer in the log" in refused_read.value.message
    assert fresh.runtime.judge.applied(0) == 0  # nothing of the cut log judged
    assert await within(first.messages.load_thread("t")) == ["two"]  # a judge that saw it all goes on


async def test_decision_time_is_the_proposals_monotonic_and_bounded_by_the_broker():
    broker = 1_700_000_000_000
    assert decision_time(0.0, 1_000.0, broker) == 1_000.0  # an injected clock in the past works
    assert decision_time(5_000.0, 1_000.0, broker) == 5_000.0  # never backwards per partition
    lead = decision_time(0.0, broker + 10 ** 9, broker)
    assert lead == broker + 15 * 60 * 1000  # a clock far ahead is capped
    assert decision_time(7.0, float("nan"), broker) == 7.0


async def test_a_lease_granted_on_one_host_expires_by_record_time_on_another(open_client):
    clock = MutableClock()
    a = await open_client(clock=clock, lease_duration_ms=5_000, renew_after_ms=1_000)
    b = await open_client()  # its own real clock: it proposes nothing about time
    lease = await within(a.checkpoints.acquire_writer("t", auto_renew=False))  # expires by the injected clock
    await refused(b.checkpoints.acquire_writer("t"), WRITER_CONFLICT)
    clock.advance(5_000)
    # Expired by A's clock, but B's proposals carry B's (real, earlier-or-equal)
    # time... and time only moves forward per partition: B's grant is judged at
    # the later of the two, so it is refused or granted exactly as every judge says.
    grant = await within(a.checkpoints.acquire_writer("t"))
    assert grant.fence == lease.fence + 1
    await refused(b.checkpoints.append(checkpoint=checkpoint("c", "t"), expected_head_id=None, writer=lease),
                  WRITER_LOST)


async def test_one_proposal_id_on_two_partitions_is_judged_alike_by_every_judge(tl, bootstrap, tmp_path):
    """A proposal id names one proposal on its partition: a re-send there is answered
    as a duplicate; the same id on another partition (a raw producer) is another
    proposal, applied there. Tried (a review): the reference replay judged every
    partition into one store and called the second a duplicate of the first,
    where every judge (a store per partition) had applied both."""
    total = tl.runtime.layout.events
    a = next(f"a-{i}" for i in range(100) if partition_for(f"a-{i}", total) == 0)
    b = next(f"b-{i}" for i in range(100) if partition_for(f"b-{i}", total) == 1)
    codec, topic = tl.runtime.codec, tl.runtime.topics.events
    producer = Producer({"bootstrap.servers": bootstrap})
    for thread in (a, b, a):  # the last: a re-send on the first partition
        producer.produce(topic, raw_proposal(codec, "threadlog.cmd.SaveTranscript", thread,
                                             {"threadId": thread, "messages": f'["{thread}"]'}, proposal_id="one-id"),
                         thread.encode(), partition=partition_for(thread, total))
    assert producer.flush(30) == 0
    await within(tl.read_barrier(None))
    assert await within(tl.messages.load_thread(a)) == [a] and await within(tl.messages.load_thread(b)) == [b]
    replayed = await asyncio.to_thread(replayed_verdicts, bootstrap, topic, total, tmp_path / "replayed")
    for p in (0, 1):
        assert all_verdicts(tl.runtime.store, p) == replayed[p]
    # Each partition's first record is its rules floor marker (a namespace threadlog created).
    assert "duplicateOf" not in replayed[1][1][1] and "duplicateOf" in replayed[0][2][1]


@pytest.mark.parametrize("earlier", [False, True], ids=["new namespace", "namespace of an earlier version"])
async def test_a_new_namespace_judges_raw_proposals_naming_older_rules_by_the_newest(
        open_client, bootstrap, namespace, tmp_path, earlier):
    """Tried (a review): on a fresh partition (floor 0 until a proposal of rules >= 4
    landed there) a raw SaveTranscript naming rules 3 was judged by rules 3: a
    transcript holding 1e400, which every current check refuses, was accepted,
    then loaded as inf, could not be written back nor served as JSON. A namespace
    threadlog creates now starts each events partition with a rules floor marker.
    One created by an earlier version has none and is judged as before -- and a
    replay of either log agrees with its judge."""
    if earlier:
        namespace_of_an_earlier_version(bootstrap, namespace)
    tl = await open_client()
    total, topic = tl.runtime.layout.events, tl.runtime.topics.events
    forged = raw_proposal(tl.runtime.codec, "threadlog.cmd.SaveTranscript", "victim",
                          {"threadId": "victim", "messages": '["forged", 1e400]'}, rules=3)
    producer = Producer({"bootstrap.servers": bootstrap})
    producer.produce(topic, forged, b"victim", partition=partition_for("victim", total))
    assert producer.flush(30) == 0
    await within(tl.read_barrier(None))
    verdict = (await within(tl.history("victim")))[-1]["verdict"]
    if earlier:
        assert verdict == {"ok": True} and (await within(tl.messages.load_thread("victim")))[0] == "forged"
    else:
        assert verdict["code"] == INVALID_ARGUMENT and "1e400" in verdict["message"]
        assert await within(tl.messages.load_thread("victim")) == []
    replayed = await asyncio.to_thread(replayed_verdicts, bootstrap, topic, total, tmp_path / "replayed")
    p = partition_for("victim", total)
    assert all_verdicts(tl.runtime.store, p) == replayed[p]


SCRIPT = """
import asyncio, os, sys, threadlog
from threadlog.processors.judge import Record, judge_record
from threadlog.projections.view import View
from threadlog.projections.store import Store
from threadlog.schemas import default_codec

async def main():
    for processors in ("embedded", "external"):
        try:
            tl = await threadlog.open(sys.argv[1], namespace=sys.argv[2], state_dir=sys.argv[3] + processors,
                                      processors=processors, request_timeout_ms=3_000)
            await tl.close()
            print(processors, "opened")
        except threadlog.ThreadLogError as exc:
            print(processors, exc.code, exc.message)
    try:
        judge_record(View(Store(sys.argv[3] + "store")), Record(0, 0, b"", 0), codec=default_codec(), partitions=1,
                     progress={})
    except RuntimeError as exc:
        print("judge_record", exc)

asyncio.run(main())
"""


def test_a_process_that_would_judge_needs_the_default_int_digits_limit(bootstrap, namespace, tmp_path):
    """Judges parse proposals' JSON with json.loads, which refuses integers of more
    digits than the interpreter's int_max_str_digits -- a per-process setting.
    Tried (a review): a transcript of a 5 000-digit integer was refused with the
    default and accepted with PYTHONINTMAXSTRDIGITS=0: two verdicts for one record.
    A process set otherwise opens no judging client (INVALID_ARGUMENT, saying
    what to change), and judge_record judges nothing; a thin client, which judges
    nothing, opens."""
    out = subprocess.run([sys.executable, "-c", SCRIPT, bootstrap, namespace, str(tmp_path / "s-")],
                         env={**os.environ, "PYTHONINTMAXSTRDIGITS": "0"}, capture_output=True, text=True,
                         timeout=120)
    lines = out.stdout.splitlines()
    assert lines[0].startswith("embedded INVALID_ARGUMENT this Python's int_max_str_digits is 0"), out
    assert lines[1] in ("external opened", "external UNAVAILABLE") or lines[1].startswith("external UNAVAILABLE"), out
    assert lines[2].startswith("judge_record this Python's int_max_str_digits is 0"), out


# fastavro falls back to pure-Python modules when its C extension does not import.
WITHOUT_FASTAVRO_C = """
import sys
for m in ("_read", "_write", "_schema", "_validation", "_logical_readers", "_logical_writers"):
    sys.modules["fastavro." + m] = None  # an ImportError, as on a host without the extension
"""


def test_a_process_that_would_judge_needs_fastavros_compiled_reader(bootstrap, namespace, tmp_path):
    """fastavro's compiled reader and its pure-Python fallback read an over-long
    varint (ten bytes, bits above 2**64) as different numbers. Tried (a review): a
    heartbeat whose epoch 1 was written so was accepted by a judge with the
    compiled reader, and refused RUN_CLAIM_LOST by one without it (epoch 2**63 + 1).
    A process without it opens no client (INVALID_ARGUMENT, saying what to install:
    a thin client's delivery readers fold their run's records too) and
    judge_record judges nothing."""
    out = subprocess.run([sys.executable, "-c", WITHOUT_FASTAVRO_C + SCRIPT, bootstrap, namespace,
                          str(tmp_path / "s-")], capture_output=True, text=True, timeout=120)
    lines = out.stdout.splitlines()
    assert lines[0].startswith("embedded INVALID_ARGUMENT fastavro decodes with fastavro._read_py"), out
    assert lines[1].startswith("external INVALID_ARGUMENT fastavro decodes with fastavro._read_py"), out
    assert lines[2].startswith("judge_record fastavro decodes with fastavro._read_py"), out
