"""Delivery log benchmark: appends, replay and SSE latency next to raw Kafka, same broker, same run.

    .venv/bin/python bench/delivery_bench.py [--bootstrap B] [--batches N] [--replay-chunks N]
                                             [--latency-chunks N] [--clients 1,8]

1. Append throughput, chunks/s, batches of 100 chunks x 200 B: C drivers (one
   run each) awaiting every `append` (one Kafka record + the run index's
   verdict), as a ratio of C raw writers producing the very same records
   (acks=all, idempotent, linger 0 as threadlog's writer) and awaiting each
   ack. One more row: an append's produce step alone (threadlog's writer, same
   record, no JSON proof, no verdict), to show where the difference goes.
2. Replay from "-1" of a closed run (one partition) by a fresh reader, as a
   ratio of a raw consumer reading the same partition from offset 0 (same
   records, no decoding) -- the goal's measure. Two more rows say what bounds
   it: the same raw consumer also decoding each record and yielding its chunks
   from an async generator (the same work without threadlog's index, fencing
   and offsets), and CPython's floor -- an async generator yielding the same
   (offset, chunk) pairs from memory, no Kafka at all.
3. SSE end to end: the real `@tanstack/ai-client` (Node) joins a run on a
   separate `threadlog serve` process; latency from just before `append` to the
   client yielding the chunk, p50/p99; next to raw produce -> consume latency
   and to a floor: the same client and pace on a minimal Python relay (`bench/sse_relay.py`: raw producer, raw consumer,
   Starlette under the same uvicorn; no threadlog on the path).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import orjson
from common import (
    Result,
    _producer,
    bench_args,
    bootstrap_or_local,
    delete_namespace,
    delete_topic,
    raw_produce_closed_loop,
    raw_produce_pipelined,
    report,
    temp_topic,
)
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition

import threadlog
from threadlog.kernel.delivery_records import chunks_record
from threadlog.kernel.topics import Topics

ROOT = Path(__file__).resolve().parent.parent
NODE_DIR = ROOT / "tests" / "node"


def make_batch(n: int, size: int, tag: str) -> list[dict]:
    base = {"type": "TEXT_MESSAGE_CONTENT", "messageId": "m1", "delta": ""}
    filler = "x" * max(1, size - len(json.dumps(base)) - 12)
    return [{**base, "delta": filler, "i": f"{tag}{k:04d}"} for k in range(n)]


async def appends(tl, drivers: int, batches: int, batch: list[dict]) -> Result:
    logs = [tl.delivery(f"bench-append-{uuid.uuid4().hex[:8]}") for _ in range(drivers)]
    for log in logs:  # warm up: producer id, partition leaders, index positions
        await log.append(batch)
    latencies: list[float] = []

    async def driver(log) -> None:
        for _ in range(batches):
            t = time.perf_counter()
            await log.append(batch)
            latencies.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    await asyncio.gather(*[driver(log) for log in logs])
    elapsed = time.perf_counter() - t0
    n = drivers * batches * len(batch)
    return Result(f"append, {drivers} drivers (chunks)", n, elapsed, n * 200, latencies)


async def produce_step(tl, batches: int, batch: list[dict], record: bytes) -> Result:
    """An append's produce step alone: threadlog's DeliveryWriter sending the very
    record an append sends and awaiting its ack, no validation, no verdict -- on the
    deliveries topic, which this client's run index follows (and folds meanwhile)."""
    writer = tl._delivery.writer
    run = f"bench-step-{uuid.uuid4().hex[:8]}"
    _, rec = tl.runtime.codec.decode(record, expect="threadlog.Delivery")
    rec = {**rec, "runId": run}
    await writer.write(run, rec)
    latencies: list[float] = []
    t0 = time.perf_counter()
    for _ in range(batches):
        t = time.perf_counter()
        await writer.write(run, rec)
        latencies.append(time.perf_counter() - t)
    n = batches * len(batch)
    return Result("  its produce step alone (chunks)", n, time.perf_counter() - t0, n * 200, latencies)


def as_chunks(res: Result, per_record: int, name: str) -> Result:
    return Result(name, res.count * per_record, res.seconds, res.bytes, res.latencies)


def raw_read_partition(bootstrap: str, topic: str, partition: int) -> tuple[int, float]:
    """Records of one partition from offset 0 to its end, by a fresh consumer: (records, seconds)."""
    t0 = time.perf_counter()
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-{uuid.uuid4().hex[:6]}",
                  "enable.auto.commit": False, "enable.partition.eof": True,
                  "isolation.level": "read_committed", "fetch.max.bytes": 64 * 2**20,
                  "max.partition.fetch.bytes": 17 * 2**20, "fetch.wait.max.ms": 5})
    c.assign([TopicPartition(topic, partition, 0)])
    n = 0
    while True:
        # consume(n, t) waits for n messages or t: take what is here instead (as threadlog's readers do).
        first = c.poll(5.0)
        msgs = [first, *c.consume(10000, 0)] if first is not None else []
        n += sum(1 for m in msgs if not m.error())
        if any(m.error() and m.error().code() == KafkaError._PARTITION_EOF for m in msgs):
            break
    elapsed = time.perf_counter() - t0
    c.close()
    return n, elapsed


async def raw_read_chunks(bootstrap: str, topic: str, partition: int, codec) -> tuple[int, float]:
    """A raw consumer of the partition that yields every chunk as a dict: (chunks, seconds)."""
    async def chunks():
        c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-{uuid.uuid4().hex[:6]}",
                      "enable.auto.commit": False, "enable.partition.eof": True,
                      "isolation.level": "read_committed", "fetch.max.bytes": 64 * 2**20,
                      "max.partition.fetch.bytes": 17 * 2**20, "fetch.wait.max.ms": 5})
        c.assign([TopicPartition(topic, partition, 0)])
        try:
            while True:
                first = c.poll(5.0)
                msgs = [first, *c.consume(10000, 0)] if first is not None else []
                for m in msgs:
                    if m.error():
                        if m.error().code() == KafkaError._PARTITION_EOF:
                            return
                        continue
                    _, rec = codec.decode(m.value(), expect="threadlog.Delivery")
                    if rec["kind"] == "chunks":
                        for chunk in orjson.loads(rec["batch"]):
                            yield chunk
        finally:
            c.close()

    t0 = time.perf_counter()
    n = 0
    async for _ in chunks():
        n += 1
    return n, time.perf_counter() - t0


async def iteration_floor(pairs: list) -> float:
    """Seconds for `async for` over an async generator yielding `pairs` from memory."""
    async def gen():
        for pair in pairs:
            yield pair

    t0 = time.perf_counter()
    async for _ in gen():
        pass
    return time.perf_counter() - t0


async def replay(bootstrap: str, chunks: int, batch: list[dict]) -> list[tuple[Result, Result | None]]:
    """Replay rows. The run gets a namespace of its own with one partition, so the
    raw consumers read exactly the run's records (and its close), nothing else."""
    ns = f"bench-replay-{uuid.uuid4().hex[:6]}"
    run = f"bench-replay-{uuid.uuid4().hex[:8]}"
    try:
        with tempfile.TemporaryDirectory() as state:
            async with threadlog.open(bootstrap, namespace=ns, state_dir=f"{state}/w", partitions=1) as writer:
                log = writer.delivery(run)
                for _ in range(chunks // len(batch)):
                    await log.append(batch)
                await log.close()
                codec = writer.runtime.codec
                partition = log.partition
            async with threadlog.open(bootstrap, namespace=ns, state_dir=f"{state}/r",
                                      processors="embedded") as reader:
                await reader.delivery(run).snapshot()  # the fresh client's run index is caught up (not timed)
                best = None
                for _ in range(3):
                    t0 = time.perf_counter()
                    n = 0
                    async for _ in reader.delivery(run).read("-1"):
                        n += 1
                    elapsed = time.perf_counter() - t0
                    assert n == chunks, (n, chunks)
                    best = elapsed if best is None else min(best, elapsed)
                pairs = await reader.delivery(run).snapshot()
        topic = Topics(ns).deliveries
        raw_best = None
        records = 0
        for _ in range(3):
            records, seconds = raw_read_partition(bootstrap, topic, partition)
            raw_best = seconds if raw_best is None else min(raw_best, seconds)
        assert records == chunks // len(batch) + 1, records  # the run's chunks records and its close
        same_work = min([await raw_read_chunks(bootstrap, topic, partition, codec) for _ in range(3)],
                        key=lambda r: r[1])
        assert same_work[0] == chunks, (same_work, chunks)
        floor = min([await iteration_floor(pairs) for _ in range(3)])
    finally:
        delete_namespace(bootstrap, ns)
    raw = Result("raw consume of the same partition, as chunks", chunks, raw_best, chunks * 200)
    ours = Result('read("-1") of a closed run, chunks', chunks, best, chunks * 200)
    decoded = Result("raw consume + decode, async-yielding chunks", chunks, same_work[1], chunks * 200)
    return [(raw, None), (ours, raw), (decoded, raw), (ours, decoded),
            (Result("CPython floor: async for over the pairs", chunks, floor), raw)]


def raw_latency(bootstrap: str, count: int) -> Result:
    """Raw produce -> consume latency on the same broker (one record at a time)."""
    topic = temp_topic(bootstrap, 1, "bench-lat")
    try:
        p = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "acks": "all", "linger.ms": 0})
        c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-{uuid.uuid4().hex[:6]}",
                      "enable.auto.commit": False, "isolation.level": "read_committed", "fetch.wait.max.ms": 5,
                      "enable.partition.eof": False})
        c.assign([TopicPartition(topic, 0, 0)])
        p.produce(topic, b"warm", b"k")
        p.flush(10)
        while c.poll(1.0) is None:
            pass
        lat = []
        t0 = time.perf_counter()
        for _ in range(count):
            t = time.perf_counter()
            p.produce(topic, b"x" * 200, b"k")
            p.poll(0)
            while True:
                m = c.poll(5.0)
                if m is not None and not m.error():
                    break
            lat.append(time.perf_counter() - t)
            p.poll(0)
            time.sleep(0.005)
        elapsed = time.perf_counter() - t0
        p.flush(10)
        c.close()
        return Result("raw produce -> consume latency", count, elapsed, 0, lat)
    finally:
        delete_topic(bootstrap, topic)


async def _node_join(base: str, run: str) -> asyncio.subprocess.Process:
    """The real `@tanstack/ai-client` joining `run` at `base`; returns once it has its first chunk."""
    node = await asyncio.create_subprocess_exec(
        "node", "sse_latency.mjs", cwd=NODE_DIR, stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "THREADLOG_URL": base, "RUN_ID": run})
    assert (await asyncio.wait_for(node.stdout.readline(), 60)).strip() == b"ready"
    return node


async def _node_latencies(node: asyncio.subprocess.Process, count: int) -> list[float]:
    out = json.loads((await asyncio.wait_for(node.stdout.readline(), 60)).decode())
    await node.wait()
    lat = [x / 1000.0 for x in out["latenciesMs"]]
    assert len(lat) == count, (len(lat), count)
    return lat


def _timed_chunk(i: int) -> dict:
    # `t`: this process's wall clock just before the write, which the Node client subtracts.
    return {"type": "TEXT_MESSAGE_CONTENT", "messageId": "m", "delta": "x" * 150, "i": i, "t": time.time() * 1000.0}


async def _server(*argv: str) -> tuple[asyncio.subprocess.Process, str]:
    """A server subprocess printing `... at http://host:port/api/chat`; (process, base URL)."""
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE)
    line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
    return proc, line.strip().split(" at ", 1)[1].rsplit("/api/chat", 1)[0]


async def sse_latency(bootstrap: str, ns: str, tl, count: int) -> Result:
    if not (NODE_DIR / "node_modules" / "@tanstack" / "ai-client").is_dir():
        raise SystemExit("run scripts/setup first (npm install in tests/node)")
    with tempfile.TemporaryDirectory() as state:
        serve, base = await _server(sys.executable, "-m", "threadlog", "serve", "--bootstrap", bootstrap,
                                    "--namespace", ns, "--port", "0", "--state-dir", state)
        try:
            run = f"bench-sse-{uuid.uuid4().hex[:8]}"
            log = tl.delivery(run)
            await log.append([{"type": "RUN_STARTED", "runId": run, "threadId": "t"}])
            node = await _node_join(base, run)
            t0 = time.perf_counter()
            for i in range(count):
                await log.append([_timed_chunk(i)])
                await asyncio.sleep(0.005)  # a model's pace, not a flood: latency, not throughput
            elapsed = time.perf_counter() - t0
            await log.append([{"type": "RUN_FINISHED", "runId": run, "threadId": "t"}])
            await log.close()
            lat = await _node_latencies(node, count)
            return Result("SSE append -> @tanstack/ai-client latency", count, elapsed, 0, lat)
        finally:
            serve.terminate()
            await serve.wait()


async def sse_floor_latency(bootstrap: str, count: int) -> Result:
    """The same client and pace on a bare relay (`bench/sse_relay.py`): a raw
    producer awaiting each ack, a raw consumer, Starlette under uvicorn. No
    threadlog on the path: the floor of a Kafka-fed SSE stream on this machine."""
    topic = temp_topic(bootstrap, 1, "bench-sse-floor")
    relay = None
    try:
        relay, base = await _server(sys.executable, str(ROOT / "bench" / "sse_relay.py"), bootstrap, topic)
        p = _producer(bootstrap, **{"linger.ms": 0, "socket.nagle.disable": True})  # as threadlog's writers

        def write(chunk: dict) -> None:
            p.produce(topic, json.dumps(chunk).encode(), b"run")
            p.flush(10)

        write({"type": "RUN_STARTED", "runId": "r", "threadId": "t"})
        node = await _node_join(base, "r")
        t0 = time.perf_counter()
        for i in range(count):
            write(_timed_chunk(i))
            await asyncio.sleep(0.005)
        elapsed = time.perf_counter() - t0
        write({"type": "RUN_FINISHED", "runId": "r", "threadId": "t"})
        lat = await _node_latencies(node, count)
        return Result("SSE floor: bare relay -> ai-client latency", count, elapsed, 0, lat)
    finally:
        if relay is not None:
            relay.terminate()
            await relay.wait()
        delete_topic(bootstrap, topic)


async def thin_rows(bootstrap: str, ns: str, state: str, args, batch: list[dict],
                    rows: list[tuple[Result, Result | None]]) -> list[tuple[Result, Result | None]]:
    """Appends and a replay through a thin client: verdicts from the worker owning
    the partition, records read from Kafka, verdicts of the replayed records
    asked of the owner per fetched batch. Compared with the raw rows above."""
    from workers import Worker

    raws = {r.name: r for r, base in rows if base is None}
    worker = Worker(bootstrap, ns, f"{state}/worker", "w", partitions=args.partitions)
    out: list[tuple[Result, Result | None]] = []
    try:
        async with threadlog.open(bootstrap, namespace=ns, state_dir=f"{state}/thin",
                                  processors="external") as thin:
            for c in (int(x) for x in args.clients.split(",")):
                res = await appends(thin, c, args.batches, batch)
                out.append((Result(f"thin: {res.name}", res.count, res.seconds, res.bytes, res.latencies),
                            raws.get(f"raw produce, {c} awaiting writers (chunks)")))
            run = f"bench-thin-replay-{uuid.uuid4().hex[:8]}"
            log = thin.delivery(run)
            for _ in range(args.replay_chunks // len(batch)):
                await log.append(batch)
            await log.close()
            best = None
            for _ in range(3):
                t0 = time.perf_counter()
                n = sum([1 async for _ in thin.delivery(run).read("-1")])
                assert n == args.replay_chunks // len(batch) * len(batch), n
                best = min(best or 1e9, time.perf_counter() - t0)
            out.append((Result('thin: read("-1") of a closed run, chunks', n, best, n * 200), None))
    finally:
        worker.stop()
    return out


async def main() -> None:
    ap = bench_args(__doc__)
    ap.add_argument("--batches", type=int, default=300, help="append batches per driver")
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--size", type=int, default=200, help="bytes per chunk (JSON)")
    ap.add_argument("--clients", default="1,8", help="driver counts to measure")
    ap.add_argument("--replay-chunks", type=int, default=100_000)
    ap.add_argument("--latency-chunks", type=int, default=500)
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--thin", action="store_true",
                    help="also append and replay through a thin client and one `threadlog worker`")
    args = ap.parse_args()
    bootstrap = bootstrap_or_local(args.bootstrap)
    batch = make_batch(args.batch, args.size, "c")
    ns = f"bench-dlv-{uuid.uuid4().hex[:6]}"
    topic = temp_topic(bootstrap, args.partitions)
    rows: list[tuple[Result, Result | None]] = []
    try:
        with tempfile.TemporaryDirectory() as state:
            async with threadlog.open(bootstrap, namespace=ns, state_dir=state, partitions=args.partitions) as tl:
                fields, _ = chunks_record(batch, "chunks")  # the very record an append writes
                record = tl.runtime.codec.encode("threadlog.Delivery", {
                    "runId": "bench-append-00000000", "kind": "chunks", "epoch": 0, "chunks": [],
                    "writtenAt": time.time() * 1000, **fields})
                print(f"one append = one record of {len(record)} B ({args.batch} chunks x ~{args.size} B)")
                for c in (int(x) for x in args.clients.split(",")):
                    # linger 0, as DeliveryWriter: an awaited append is sent at once
                    raw = await raw_produce_closed_loop(bootstrap, topic, record, c * args.batches, c,
                                                        args.partitions, linger_ms=0)
                    ours = await appends(tl, c, args.batches, batch)
                    raw = as_chunks(raw, args.batch, f"raw produce, {c} awaiting writers (chunks)")
                    rows += [(raw, None), (ours, raw)]
                    if c == 1:  # where the difference goes: produce + the index folding meanwhile
                        rows.append((await produce_step(tl, args.batches, batch, record), raw))
                if args.thin:
                    rows += await thin_rows(bootstrap, ns, state, args, batch, rows)
                pipe = raw_produce_pipelined(bootstrap, topic, record, 2000, args.partitions)
                rows.append((as_chunks(pipe, args.batch, "raw produce, pipelined (chunks; ceiling)"), None))
                rows += await replay(bootstrap, args.replay_chunks, batch)
                rows.append((raw_latency(bootstrap, args.latency_chunks), None))
                rows.append((await sse_floor_latency(bootstrap, args.latency_chunks), None))
                rows.append((await sse_latency(bootstrap, ns, tl, args.latency_chunks), None))
        print(f"\nbroker {bootstrap}; {args.partitions} partitions\n")
        report(rows, unit="chunks/s")
        print("\nratio = rate / the raw Kafka row above it that it is compared with (same records, same broker, "
              "same run)")
    finally:
        delete_topic(bootstrap, topic)
        delete_namespace(bootstrap, ns)


if __name__ == "__main__":
    asyncio.run(main())
