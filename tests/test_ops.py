"""Operating threadlog: Prometheus /metrics, /healthz, /readyz on `serve` and `worker --http`,
SIGTERM draining, JSON logs and access logs.

Everything against a real broker and real processes: metrics are scraped over
HTTP while load runs and the exposition text is parsed."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid

import httpx
import orjson
import pytest
from confluent_kafka import Producer
from delivery_support import chunk
from http_support import read_stream, serve_process, serving, sse_events
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from support import raw_proposal, until, within
from threadlog.processors.judge import RULES
from worker_support import WorkerProcess, owned_by

from threadlog.kernel.errors import ThreadLogError
from threadlog.kernel.partitioning import partition_for
from threadlog.metrics import attach

FINISHED = {"type": "RUN_FINISHED", "runId": "r", "threadId": "t"}


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """Exposition text -> {(sample name, sorted labels): value}."""
    out: dict[tuple[str, tuple], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(scraped: dict, name: str, **labels: str) -> float:
    return scraped.get((name, tuple(sorted(labels.items()))), 0.0)


def total(scraped: dict, name: str, **labels: str) -> float:
    """Sum over every label set containing `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in scraped.items() if n == name and want <= set(ls))


async def scrape(client: httpx.AsyncClient, base: str) -> dict:
    r = await client.get(f"{base}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text
    return samples(r.text)


def metrics_url(worker: WorkerProcess) -> str:
    line = next(ln for ln in worker.lines if "worker metrics and health at " in ln)
    return line.split(" at ", 1)[1].strip().removesuffix("/metrics")


async def readyz_until_owned(http: httpx.AsyncClient, workers: list[WorkerProcess],
                             owned: list[list[int]]) -> list[dict]:
    """The workers' /readyz answers once all are ready and own `owned` between them (sorted)."""
    while True:
        answers = [await http.get(f"{metrics_url(w)}/readyz") for w in workers]
        if all(a.status_code == 200 for a in answers) and sorted(a.json()["owned"] for a in answers) == owned:
            return [a.json() for a in answers]
        await asyncio.sleep(0.2)  # polling: the rebalance announces itself to no test


async def test_worker_metrics_scraped_under_load(bootstrap, namespace, tmp_path, open_client):
    worker = WorkerProcess(bootstrap, namespace, tmp_path / "w", "w1", "--http", "127.0.0.1:0")
    try:
        await worker.start()
        base = metrics_url(worker)
        thin = await open_client(processors="external", own_worker=True)
        mine = attach(thin)  # the thin client's own registry: proposal -> verdict latency
        async with httpx.AsyncClient(timeout=30) as http:
            assert (await http.get(f"{base}/healthz")).status_code == 200
            await owned_by([worker], 4)  # "judging" is printed before the group assigns anything
            await within(thin.read_barrier(None))  # each partition's rules floor marker judged, before counting
            before = await scrape(http, base)
            n = 40
            load_done = asyncio.Event()

            async def load() -> None:
                try:
                    await asyncio.gather(*(thin.messages.save_thread(f"t{i % 8}", [f"m{i}"]) for i in range(n)))
                    for _ in range(3):  # refused: undecodable payloads
                        with pytest.raises(ThreadLogError):
                            await thin.bus.send_encoded("threadlog.cmd.SaveTranscript", "t0", b"\xc3\x01garbage")
                finally:
                    load_done.set()

            async def scrape_while_loaded() -> int:
                count = 0
                while not load_done.is_set() or count == 0:
                    got = await scrape(http, base)  # parses while the judge is busy
                    assert value(got, "threadlog_partitions_owned") == 4
                    count += 1
                return count

            _, scrapes = await within(asyncio.gather(load(), scrape_while_loaded()), 60)
            assert scrapes >= 1
            await within(thin.read_barrier(None))
            after = await scrape(http, base)
            accepted = value(after, "threadlog_decisions_total", outcome="accepted", code="OK") - \
                value(before, "threadlog_decisions_total", outcome="accepted", code="OK")
            assert accepted == n
            assert value(after, "threadlog_decisions_total", outcome="refused", code="INVALID_MESSAGE") == 3
            assert value(after, "threadlog_records_judged_total") - value(before, "threadlog_records_judged_total") \
                == n + 3
            for p in range(4):
                assert ("threadlog_fold_lag_records", (("partition", str(p)),)) in after
                assert value(after, "threadlog_fold_lag_records", partition=str(p)) == 0
            # n + 3 proposals and, first on each partition, its rules floor marker
            assert sum(value(after, "threadlog_fold_applied_offset", partition=str(p)) for p in range(4)) == n + 3 + 4
            r = await http.get(f"{base}/readyz")
            assert r.status_code == 200 and r.json()["ready"] is True and r.json()["owned"] == [0, 1, 2, 3]
        theirs = samples(generate_latest(mine.registry).decode())
        assert total(theirs, "threadlog_proposal_verdict_seconds_count",
                     type="threadlog.cmd.SaveTranscript") >= n
        worker.signal(signal.SIGTERM)
        assert await worker.wait_exit(30) == 0
    finally:
        await worker.stop()


async def test_serve_app_metrics_sse_readers_appends_and_access_log(tl, open_client, caplog):
    caplog.set_level(logging.INFO, logger="threadlog.access")
    other = await open_client()  # a second app in the same process: its own registry
    log = tl.delivery("run-m")
    async with serving(tl) as base, serving(other) as base2, httpx.AsyncClient(timeout=30) as http:
        # Counted from when the app instrumented the client (create_app).
        await within(log.append([chunk(0), chunk(1)]))
        await within(tl.messages.save_thread("t", ["hello"]))
        assert (await http.get(f"{base}/healthz")).status_code == 200
        r = await http.get(f"{base}/readyz")
        assert r.status_code == 200 and r.json() == {"ready": True, "role": "embedded", "owned": [0, 1, 2, 3]}
        got = await scrape(http, base)
        assert value(got, "threadlog_delivery_appends_total") == 1
        assert value(got, "threadlog_delivery_chunks_appended_total") == 2
        assert value(got, "threadlog_partitions_owned") == 4
        assert value(got, "threadlog_decisions_total", outcome="accepted", code="OK") >= 1
        assert total(got, "threadlog_proposal_verdict_seconds_count", type="threadlog.cmd.SaveTranscript") == 1
        assert value(got, "threadlog_http_sse_connections") == 0
        # An SSE reader held open: one connection, one delivery reader, while it lasts.
        async with http.stream("GET", f"{base}/runs/run-m/stream") as response:
            events = sse_events(response)
            first = await within(anext(events))
            assert first.data == chunk(0)
            got = await scrape(http, base)
            assert value(got, "threadlog_http_sse_connections") == 1
            assert value(got, "threadlog_delivery_readers") == 1
            assert value(await scrape(http, base2), "threadlog_http_sse_connections") == 0
            await within(log.append([FINISHED]))
            await within(log.close())
            rest = [ev async for ev in events]
            assert [ev.data for ev in rest] == [chunk(1), FINISHED]

        async def closed() -> None:
            while True:
                got = await scrape(http, base)
                if value(got, "threadlog_http_sse_connections") == 0 and \
                        value(got, "threadlog_delivery_readers") == 0:
                    return
                await asyncio.sleep(0.05)  # the server notices the end after the client

        await within(closed(), 10)
        got = await scrape(http, base)
        assert value(got, "threadlog_delivery_appends_total") == 2
        assert value(got, "threadlog_http_requests_total", method="GET", status="200") >= 5
        # Any token is a method to the HTTP parser; each label value is a series kept for
        # good. Tried (a review): 3 000 made-up methods made 3 000 series.
        for n in range(3):
            assert (await within(http.request(f"MADEUP{n}", f"{base}/healthz"))).status_code == 405
        got = await scrape(http, base)
        assert value(got, "threadlog_http_requests_total", method="other", status="405") == 3
        assert total(got, "threadlog_http_requests_total") == sum(
            v for (n, labels), v in got.items() if n == "threadlog_http_requests_total"
            and dict(labels)["method"] in {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "other"})
        _, events = await read_stream(http, f"{base}/api/chat?runId=run-m&offset=-1&token=s3cret")
        assert events[-1].data == FINISHED
    access = [rec for rec in caplog.records if rec.name == "threadlog.access"]
    paths = {rec.path for rec in access}
    assert {"/healthz", "/readyz", "/metrics", "/runs/run-m/stream", "/api/chat"} <= paths
    assert all("?" not in rec.getMessage() and "s3cret" not in rec.getMessage() for rec in access)
    sse_line = next(rec for rec in access if rec.path == "/api/chat")
    assert sse_line.status == 200 and sse_line.method == "GET" and sse_line.duration_ms >= 0


async def test_sigterm_answers_the_worker_request_in_flight_then_exits_0(bootstrap, namespace, tmp_path,
                                                                         open_client):
    worker = WorkerProcess(bootstrap, namespace, tmp_path / "w", "w1", "--http", "127.0.0.1:0")
    try:
        await worker.start()
        base = metrics_url(worker)
        client = await open_client()  # embedded: writes the proposal the request waits for
        await within(client.read_barrier(None))
        async with httpx.AsyncClient(timeout=10) as http:
            # Ready once it joined the group and caught up; asked before that, it answers 503.
            await within(readyz_until_owned(http, [worker], [[0, 1, 2, 3]]), 60)
        p = partition_for("t-drain", client.runtime.layout.events)
        end = (await within(client.runtime.barrier.end_offsets()))[p]
        host, _, port = worker.address.rpartition(":")
        reader, writer = await within(asyncio.open_connection(host, int(port)))
        try:
            # In flight: the verdict of the next record of partition p, not written yet.
            writer.write(orjson.dumps({"id": 1, "op": "verdict", "args": {"p": p, "o": end, "timeout": 30}}) + b"\n")
            await writer.drain()
            async with httpx.AsyncClient(timeout=10) as http:
                assert (await http.get(f"{base}/readyz")).status_code == 200
                worker.signal(signal.SIGTERM)
                await worker.wait_for("worker stopping: draining", 30)
                r = await http.get(f"{base}/readyz")
                assert r.status_code == 503 and r.json()["ready"] is False
            await within(client.messages.save_thread("t-drain", ["written after SIGTERM"]))
            reply = orjson.loads(await within(reader.readline()))
        finally:
            writer.close()
        assert reply["id"] == 1 and reply["ok"] is True and reply["result"]["ok"] is True, reply
        # Tried (a review): /readyz was refused (its listener closed) while the worker
        # still left its group, seconds before exiting; a balancer saw no 503. Now it
        # answers 503 until the group is left, the last thing before the exit.
        answers: list[int] = []

        def left() -> bool:
            return any("worker stopped: left the group" in line for line in worker.lines)

        async def poll() -> None:
            async with httpx.AsyncClient(timeout=10) as http:
                while not left() and worker.proc.returncode is None:
                    try:
                        answers.append((await http.get(f"{base}/readyz")).status_code)
                    except httpx.TransportError:
                        if not left():  # not the line arriving while this poll went out
                            answers.append(-1)  # refused while the group was still being left
                    await asyncio.sleep(0.02)  # polling: the shutdown announces itself to no test

        await within(poll(), 60)
        assert answers and set(answers) == {503}, answers
        assert await worker.wait_exit(30) == 0
    finally:
        await worker.stop()


async def test_serve_json_logs_access_lines_and_sigterm_exit_0(bootstrap, namespace, tl, tmp_path):
    await within(tl.messages.save_thread("t", ["hi"]))
    # -v and --log-format after the command, as operators type them.
    async with serve_process(bootstrap, namespace, tmp_path / "serve", "-v", "--log-format", "json") as serve:
        base = serve.base
        async with httpx.AsyncClient(timeout=30) as http:
            r = await http.get(f"{base}/api/chat", params={"threadId": "t", "token": "s3cret-token"})
            assert r.status_code == 200 and r.json()["messages"] == ["hi"]
            assert (await http.get(f"{base}/readyz")).status_code == 200
            assert (await http.get(f"{base}/nope")).status_code == 404
        err = await within(serve.stop())
    lines = [json.loads(ln) for ln in err.splitlines() if ln.strip()]  # every line is one JSON object
    assert lines and all({"ts", "level", "logger", "message"} <= ln.keys() for ln in lines)
    access = [ln for ln in lines if ln["logger"] == "threadlog.access"]
    assert [(a["method"], a["path"], a["status"]) for a in access] == [
        ("GET", "/api/chat", 200), ("GET", "/readyz", 200), ("GET", "/nope", 404)]
    assert all(isinstance(a["duration_ms"], float) for a in access)
    assert "s3cret-token" not in err and "threadId" not in err
    assert any(ln["logger"].startswith("uvicorn") for ln in lines)  # -v: uvicorn's own lines, as JSON too


async def test_a_worker_s_own_warning_is_a_json_line_under_log_format_json(bootstrap, namespace, tmp_path):
    """Tried (a review): `--log-format json worker --listen 0.0.0.0:0` wrote its
    "listening on every interface" warning as plain text among the JSON lines."""
    worker = WorkerProcess(bootstrap, namespace, tmp_path / "w", "w", "--log-format", "json", "--listen", "0.0.0.0:0")
    try:
        await worker.start()
    finally:
        await worker.stop()
    lines = [json.loads(ln) for ln in worker.stderr().splitlines() if ln.strip()]  # every line one JSON object
    [warning] = [ln for ln in lines if "listening on every interface" in ln["message"]]
    assert warning["level"] == "WARNING" and warning["logger"] == "threadlog.worker"


def test_json_log_lines_carry_exception_text():
    from threadlog.logs import JsonFormatter

    try:
        raise ValueError("boom")
    except ValueError:
        rec = logging.getLogger("x").makeRecord("x", logging.ERROR, __file__, 1, "failed %s", ("here",),
                                                sys.exc_info())
    out = json.loads(JsonFormatter().format(rec))
    assert out["level"] == "ERROR" and out["logger"] == "x" and out["message"] == "failed here"
    assert "ValueError: boom" in out["exception"] and "\n" not in JsonFormatter().format(rec)


def test_a_failing_command_in_json_mode_is_one_json_line_with_the_traceback_under_v():
    args = ["namespaces", "list", "--bootstrap", "127.0.0.1:1", "--request-timeout-ms", "2000"]
    env = {k: v for k, v in os.environ.items() if k != "THREADLOG_KAFKA_CONFIG"}
    for verbose in ([], ["-v"]):
        proc = subprocess.run([sys.executable, "-m", "threadlog", "--log-format", "json", *verbose, *args],
                              capture_output=True, text=True, timeout=60, env=env)
        assert proc.returncode == 2
        lines = [json.loads(ln) for ln in proc.stderr.splitlines()]  # every line one JSON object
        last = lines[-1]
        assert last["logger"] == "threadlog.cli" and last["message"].startswith("threadlog: UNAVAILABLE: ")
        assert ("Traceback" in last.get("exception", "")) == bool(verbose)


async def test_a_joining_worker_is_not_ready_before_the_group_gives_it_its_share(bootstrap, namespace, tmp_path):
    """Tried (a review): a restarted worker answered 200 `"owned": []` right after
    it joined -- cooperative-sticky gives a joining member nothing at first and
    its share a rebalance later -- so a rolling restart gated on /readyz
    stopped the next worker while this one owned nothing. Ready now only once
    the group is Stable and balanced: here with two of the four partitions."""
    workers = [WorkerProcess(bootstrap, namespace, tmp_path / f"w{i}", f"w{i}", "--http", "127.0.0.1:0")
               for i in range(2)]
    try:
        await workers[0].start()
        async with httpx.AsyncClient(timeout=10) as http:
            await within(readyz_until_owned(http, workers[:1], [[0, 1, 2, 3]]), 60)
            await workers[1].start()
            answers: list[tuple[int, dict]] = []

            async def until_ready() -> dict:
                while True:
                    r = await http.get(f"{metrics_url(workers[1])}/readyz")
                    answers.append((r.status_code, r.json()))
                    if r.status_code == 200:
                        return r.json()
                    await asyncio.sleep(0.05)  # polling: the rebalance announces itself to no test

            ready = await within(until_ready(), 60)
            assert len(ready["owned"]) == 2, answers
            waiting = [a.get("reason", "") for code, a in answers if code == 503]
            assert all("group" in why or "caught up" in why or "restoring" in why for why in waiting), waiting
    finally:
        for w in workers:
            await w.stop()


async def test_a_worker_owning_no_partition_is_ready_and_a_thin_serve_is_ready(bootstrap, namespace, tmp_path,
                                                                              open_client):
    # One partition, two workers: the group gives one of them nothing; both are ready.
    workers = [WorkerProcess(bootstrap, namespace, tmp_path / f"w{i}", f"w{i}", "--partitions", "1",
                             "--http", "127.0.0.1:0") for i in range(2)]
    try:
        for w in workers:
            await w.start()
        async with httpx.AsyncClient(timeout=10) as http:
            await within(readyz_until_owned(http, workers, [[], [0]]), 60)
            for w in workers:
                got = await scrape(http, metrics_url(w))
                assert value(got, "threadlog_partitions_owned") in (0, 1)
            thin = await open_client(processors="external", own_worker=True)
            await within(thin.messages.save_thread("t", ["x"]))
            async with serving(thin) as base:
                r = await http.get(f"{base}/readyz")
                assert r.status_code == 200 and r.json() == {"ready": True, "role": "thin"}
                got = await scrape(http, base)
                assert value(got, "threadlog_partitions_owned") == 0
        for w in workers:
            w.signal(signal.SIGTERM)
        for w in workers:
            assert await w.wait_exit(30) == 0
        # No worker left: not ready, saying why (a review: the reason was "" when
        # the barrier's wait timed out, str() of a TimeoutError).
        async with serving(thin) as base, httpx.AsyncClient(timeout=30) as http:
            r = await http.get(f"{base}/readyz")
            assert r.status_code == 503 and r.json()["ready"] is False, r.text
            assert r.json()["reason"].strip(), r.text
    finally:
        for w in workers:
            await w.stop()


STALL_S = 1.0  # the readiness stall bound these tests serve with (30 s by default)


def produce(bootstrap: str, topic: str, partition: int, key: str, value: bytes, transactional: bool = False) -> int:
    """Write one record to `topic`[partition] as any producer could (blocking); its offset.
    `transactional`: in a transaction, committed: a commit marker follows it."""
    conf = {"bootstrap.servers": bootstrap}
    if transactional:
        conf["transactional.id"] = f"test-ready-{uuid.uuid4().hex[:8]}"
    producer = Producer(conf)
    if transactional:
        producer.init_transactions(30)
        producer.begin_transaction()
    offsets: list[int] = []
    producer.produce(topic, value, key.encode(), partition=partition,
                     on_delivery=lambda err, msg: offsets.append(msg.offset()))
    if transactional:
        producer.commit_transaction(30)
    assert producer.flush(30) == 0 and len(offsets) == 1
    return offsets[0]


async def readyz_until(http: httpx.AsyncClient, base: str, status: int, stalled: bool | None = None) -> dict:
    """The first /readyz answer with `status` (and naming stalled partitions or
    not, when `stalled` is given; polled: a stall announces itself to no one)."""
    while True:
        r = await http.get(f"{base}/readyz")
        if r.status_code == status and (stalled is None or ("stalled" in r.json()) == stalled):
            return r.json()
        await asyncio.sleep(0.05)


async def test_readyz_names_a_caught_up_partition_that_waits_for_a_judge_of_newer_rules(open_client, bootstrap):
    """Tried: a record naming judging rules newer than this judge's lands on a
    caught-up partition; its judge waits for an upgraded one, for good. /readyz
    said nothing (only the fold lag gauge showed it): now it names that
    partition, once it has had that record to judge for the stall bound, not
    before. Embedded, it stays 200: every replica stalls alike (a worker's 503
    is the next test)."""
    tl = await open_client()
    await within(tl.messages.save_thread("t", ["x"]))
    p = partition_for("t", tl.runtime.layout.events)
    async with serving(tl, stall_after=STALL_S) as base, httpx.AsyncClient(timeout=10) as http:
        # Every rules floor marker judged first: a full-suite run asked at once and
        # found partition 0's marker (another partition than t's) not judged yet.
        await within(tl.read_barrier(None))
        r = await http.get(f"{base}/readyz")
        assert r.status_code == 200, r.text
        newer = raw_proposal(tl.runtime.codec, "threadlog.cmd.SaveTranscript", "t",
                             {"threadId": "t", "messages": "[]"}, rules=RULES + 1)
        began = time.monotonic()
        await asyncio.to_thread(produce, bootstrap, tl.runtime.topics.events, p, "t", newer)
        answer = await within(readyz_until(http, base, 200, stalled=True), STALL_S + 20)
        assert time.monotonic() - began >= STALL_S  # never before the bound
        assert answer["ready"] is True and list(answer["stalled"]) == [str(p)], answer
        assert f"partitions [{p}] stalled" in answer["warning"]
        assert answer["stalled"][str(p)]["end"] == answer["stalled"][str(p)]["applied"] + 1


async def test_readyz_is_ready_again_once_a_stalled_partition_moves_and_stays_ready_when_idle(open_client, bootstrap):
    """Tried: a proposal naming a far-future `seen` position of another partition
    holds its partition until that one gets there. While it waits a transaction
    writes a proposal there too, so the partition's log ends with a commit
    marker, which no consumer yields. /readyz says the partition stalled, is
    ready again once the other partition moves, and stays ready while the
    partition is idle with the marker past its last record (lag 0: the judge
    moves past the marker; before, the end it reached while waiting was
    forgotten, and the idle partition stayed 1 short of its end offset)."""
    tl = await open_client()
    total = tl.runtime.layout.events
    p = partition_for("t1", total)
    other = next(f"u{i}" for i in range(100) if partition_for(f"u{i}", total) != p)
    q = partition_for(other, total)
    codec, events = tl.runtime.codec, tl.runtime.topics.events
    async with serving(tl, stall_after=STALL_S) as base, httpx.AsyncClient(timeout=10) as http:
        await within(tl.read_barrier(None))  # every rules floor marker judged
        assert (await http.get(f"{base}/readyz")).status_code == 200
        seen = [(await within(tl.bus.end_offsets()))[x] for x in range(total)]
        seen[q] += 1  # a position of q not written yet
        save = codec.encode("threadlog.cmd.SaveArtifact", {"artifact": {
            "artifactId": "a1", "runId": "r1", "threadId": "t1", "name": "cat.png", "mimeType": "image/png",
            "size": 1234, "createdAt": 100, "blobKey": None, "sourceUrl": None}})
        held = await asyncio.to_thread(produce, bootstrap, events, p, "t1",
                                       raw_proposal(codec, "threadlog.cmd.SaveArtifact", "t1", save, rules=RULES,
                                                    seen=seen))
        answer = await within(readyz_until(http, base, 200, stalled=True), STALL_S + 20)
        assert list(answer["stalled"]) == [str(p)] and answer["stalled"][str(p)]["applied"] == held, answer
        last = await asyncio.to_thread(produce, bootstrap, events, p, "t1",
                                       raw_proposal(codec, "threadlog.cmd.SaveTranscript", "t1",
                                                    {"threadId": "t1", "messages": "[]"}, rules=RULES),
                                       transactional=True)
        judge = tl.runtime.judge
        # The judge fetched it (and reached the end past the marker) while the partition waits...
        await until(lambda: len(judge._pending[p].msgs) == 2, 30, "the transaction's record fetched")
        # ...and holds the end of partition reported past the marker while the records
        # before it wait (a judge that dropped it never gets it again).
        await until(lambda: p in judge._ends, 30, "the end of the partition held while it waits")
        assert judge.verdict(p, held) is None
        await within(tl.messages.save_thread(other, ["moves q"]))  # q reaches the position named
        await until(lambda: judge.verdict(p, last) is not None, 30, "the partition judged on")
        assert judge.verdict(p, held)["ok"]
        await within(readyz_until(http, base, 200, stalled=False), 20)
        # Idle now, past its last record a commit marker: no stall for several bounds on end.
        until_s = time.monotonic() + 3 * STALL_S
        while time.monotonic() < until_s:
            r = await http.get(f"{base}/readyz")
            assert r.status_code == 200 and "stalled" not in r.json(), r.text
            await asyncio.sleep(0.05)
        got = await scrape(http, base)
        assert value(got, "threadlog_fold_lag_records", partition=str(p)) == 0
        assert value(got, "threadlog_fold_applied_offset", partition=str(p)) == last + 2  # past the marker


async def test_a_worker_with_a_stalled_partition_is_not_ready(open_client, bootstrap, namespace, tmp_path):
    """A worker owns its partitions alone: one stalled (a record naming newer
    judging rules) makes its /readyz 503 naming it, after `--stall-after`."""
    worker = WorkerProcess(bootstrap, namespace, tmp_path / "w", "w1", "--http", "127.0.0.1:0",
                           "--stall-after", str(STALL_S))
    try:
        await worker.start()
        base = metrics_url(worker)
        thin = await open_client(processors="external", own_worker=True)
        await owned_by([worker], 4)
        await within(thin.read_barrier(None))  # every rules floor marker judged
        p = partition_for("t", thin.runtime.layout.events)
        async with httpx.AsyncClient(timeout=10) as http:
            await within(readyz_until(http, base, 200), 30)
            newer = raw_proposal(thin.runtime.codec, "threadlog.cmd.SaveTranscript", "t",
                                 {"threadId": "t", "messages": "[]"}, rules=RULES + 1)
            await asyncio.to_thread(produce, bootstrap, thin.runtime.topics.events, p, "t", newer)
            answer = await within(readyz_until(http, base, 503), STALL_S + 30)
        assert answer["ready"] is False and list(answer["stalled"]) == [str(p)], answer
        assert f"partitions [{p}] stalled" in answer["reason"]
    finally:
        await worker.stop()
