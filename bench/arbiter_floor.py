"""The floor of Core v2's thin-client design on this machine: a judge that decides nothing but the CAS.

    .venv/bin/python bench/arbiter_floor.py [--bootstrap B] [--seconds 8] [--callers 16]
        [--threads 64] [--partitions 4] [--skip-postgres] [--seen]

Issue 9 asks a thin client + one worker for >= 0.3 x raw Kafka and more than a hand-written
PostgreSQL compare-and-set, on this 2-core machine. threadlog's CAS spends ~1 ms of CPU per
decision in all (client, worker, broker; docs/measurements.md). This bench measures what the
same *shape* costs with everything threadlog adds taken away, so the gap splits into "the
design on this machine" and "our rules in CPython":

- **floor writer** (this process): 16 asyncio callers over 64 threads, each call produces the
  checkpoint's JSON (prefixed by the expected head and the new id) straight to the thread's
  partition (idempotent, acks=all, linger 0: threadlog's proposal settings), awaits the ack,
  then the verdict at its offset. No validation, no Avro, no `seen` round (with `--seen`: one
  `ListOffsets` of every partition per call, shared by concurrent callers, as threadlog's).
- **floor judge** (a child process, as a `threadlog worker` is): one confluent-kafka consumer of
  every partition; per fetched batch, the head CAS in a dict (expected == head: accepted),
  heads and positions in ONE RocksDB write batch, then every verdict pushed in one write to the
  writer's TCP connection. Nothing else: no decode, no rules, no ids, no verdict window.

Same run: raw Kafka with 16 awaiting writers (the issue's baseline) and the hand-written
PostgreSQL CAS of bench/peers.py (same cluster setup, same shapes). Prints rates, ratios and
CPU per operation by process: if the floor itself misses a goal, no CPython implementation of
this design meets it here, and the CPU table says which process would have to shrink.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (
    PROPOSALS_LINGER_MS,
    Result,
    bench_args,
    bootstrap_or_local,
    closed_loop,
    delete_namespace,
    delete_topic,
    report,
    temp_topic,
)
from confluent_kafka import OFFSET_END, Consumer, Producer, TopicPartition
from peers import (
    PG_BIN,
    Shape,
    client_only,
    postgres_cas_row,
    postgres_cluster,
    print_cpu,
    raw_row,
    sized,
    threadlog_rows,
    with_broker,
)

VERDICT = struct.Struct(">IQB")  # partition, offset, accepted


# -- the judge (child process) --------------------------------------------------------------------
def judge_main(bootstrap: str, topic: str, partitions: int, port_file: str, state: str) -> None:
    from rocksdict import Options, Rdict, WriteBatch

    db = Rdict(state, Options())
    heads: dict[bytes, bytes] = {}
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"floor-{uuid.uuid4().hex[:6]}",
                         "enable.auto.commit": False, "isolation.level": "read_uncommitted",
                         "enable.partition.eof": False})
    consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    server = socket.create_server(("127.0.0.1", 0))
    Path(port_file).write_text(str(server.getsockname()[1]))
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    while not stop.is_set():
        # The first record as soon as it comes, then whatever else is already fetched
        # (consume(n, t) alone waits t for n records: 50 ms a verdict at this load).
        first = consumer.poll(0.05)
        if first is None:
            continue
        msgs = [first, *consumer.consume(499, 0)]
        batch = WriteBatch()
        out = bytearray()
        positions: dict[int, int] = {}
        for m in msgs:
            if m.error():
                continue
            value = m.value()
            first = value.index(b"\n")
            second = value.index(b"\n", first + 1)
            expected, cid = value[:first], value[first + 1:second]
            thread = m.key()
            ok = heads.get(thread, b"") == expected
            if ok:
                heads[thread] = cid
                batch.put(b"h" + thread, cid)
            p, o = m.partition(), m.offset()
            positions[p] = o + 1
            out += VERDICT.pack(p, o, ok)
        for p, o in positions.items():
            batch.put(b"pos" + p.to_bytes(4, "big"), o.to_bytes(8, "big"))
        db.write(batch)  # state and position together, as a judge's tracking record
        conn.sendall(out)
    consumer.close()
    db.close()


# -- the writer (this process) -------------------------------------------------------------------
class FloorWriter:
    def __init__(self, bootstrap: str, topic: str, partitions: int, port: int, seen: bool, linger_ms: float) -> None:
        self.topic, self.partitions, self.seen = topic, partitions, seen
        self.producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "acks": "all",
                                  "linger.ms": linger_ms})
        self.ends = Consumer({"bootstrap.servers": bootstrap, "group.id": "floor-ends"}) if seen else None
        self._stop = threading.Event()
        self._pump = threading.Thread(target=self._poll, daemon=True)
        self._pump.start()
        self.port = port
        self.waiting: dict[tuple[int, int], asyncio.Future] = {}
        self.early: dict[tuple[int, int], bool] = {}
        self.refused = 0
        self._seen_round: asyncio.Future | None = None

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.producer.poll(0.05)

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        reader, self._writer = await asyncio.open_connection("127.0.0.1", self.port)
        self._reader_task = asyncio.create_task(self._verdicts(reader))

    async def _verdicts(self, reader: asyncio.StreamReader) -> None:
        size = VERDICT.size
        buf = b""
        while True:
            data = await reader.read(65536)
            if not data:
                return
            buf += data
            n = len(buf) // size * size
            for p, o, ok in VERDICT.iter_unpack(buf[:n]):
                fut = self.waiting.pop((p, o), None)
                if fut is None:
                    self.early[(p, o)] = bool(ok)
                else:
                    fut.set_result(bool(ok))
            buf = buf[n:]

    async def _seen(self) -> None:
        """One ListOffsets round for every partition, shared by the callers that ask meanwhile."""
        if self._seen_round is None:
            # One ListOffsets request for every partition, as threadlog's `LatestOffsets`
            # (projections/barrier.py) asks it.
            tps = [TopicPartition(self.topic, p, OFFSET_END) for p in range(self.partitions)]

            def ask() -> None:
                self.ends.offsets_for_times(tps, 5)

            self._seen_round = asyncio.ensure_future(asyncio.to_thread(ask))
            self._seen_round.add_done_callback(lambda _: setattr(self, "_seen_round", None))
        await asyncio.shield(self._seen_round)

    async def append(self, thread: str, partition: int, expected: str, cid: str, body: bytes) -> bool:
        if self.seen:
            await self._seen()
        loop = self.loop
        ack = loop.create_future()
        self.producer.produce(self.topic, expected.encode() + b"\n" + cid.encode() + b"\n" + body,
                              thread.encode(), partition=partition,
                              on_delivery=lambda e, m: loop.call_soon_threadsafe(
                                  ack.set_exception if e else ack.set_result, e or (m.partition(), m.offset())))
        where = await ack
        ok = self.early.pop(where, None)
        if ok is None:
            verdict = loop.create_future()
            self.waiting[where] = verdict
            ok = await verdict
        if not ok:
            self.refused += 1
        return ok

    async def close(self) -> None:
        self._writer.close()
        self._reader_task.cancel()
        self._stop.set()
        self._pump.join()
        self.producer.flush(30)
        if self.ends is not None:
            self.ends.close()


async def floor_row(bootstrap: str, shape: Shape, seconds: float, partitions: int, seen: bool,
                    linger_ms: float) -> tuple[Result, int]:
    topic = temp_topic(bootstrap, partitions, prefix="bench-floor")
    with tempfile.TemporaryDirectory(prefix="threadlog-floor-") as d:
        port_file = f"{d}/port"
        judge = subprocess.Popen([sys.executable, __file__, "--judge", "--bootstrap", bootstrap, "--topic", topic,
                                  "--partitions", str(partitions), "--port-file", port_file, "--state", f"{d}/db"])
        try:
            deadline = time.monotonic() + 60
            while not (Path(port_file).exists() and Path(port_file).read_text()):
                if judge.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the floor judge did not start")
                await asyncio.sleep(0.05)
            writer = FloorWriter(bootstrap, topic, partitions, int(Path(port_file).read_text()), seen, linger_ms)
            await writer.start()
            threads = [f"floor-thread-{t}" for t in range(shape.threads)]
            heads = dict.fromkeys(threads, "")
            steps = dict.fromkeys(threads, 0)

            async def append(c: int, i: int) -> None:
                t = shape.thread(c, i)
                thread = threads[t]
                step = steps[thread] = steps[thread] + 1
                cid = f"{thread}/{step}"
                body = json.dumps(shape.checkpoint(cid, thread, heads[thread] or None, step),
                                  separators=(",", ":")).encode()
                if await writer.append(thread, t % partitions, heads[thread], cid, body):
                    heads[thread] = cid

            name = (f"floor: proposal + judge process{' + seen' if seen else ''}"
                    + (f", linger {linger_ms:g} ms" if linger_ms != PROPOSALS_LINGER_MS else ""))
            res = await sized(lambda n: closed_loop(name, shape.callers, n // shape.callers, append), seconds,
                              shape, processes=lambda: with_broker({**client_only(), "worker": [judge.pid]}))
            refused = writer.refused
            await writer.close()
            return res, refused
        finally:
            judge.terminate()
            try:
                judge.wait(30)
            except subprocess.TimeoutExpired:
                judge.kill()
            delete_topic(bootstrap, topic)


async def amain(args: argparse.Namespace, bootstrap: str, pg) -> None:
    shape = Shape(args.callers, args.threads, args.files, args.conversation_bytes)
    payload = json.dumps(shape.checkpoint("thread-0/0", "thread-0", None, 0), separators=(",", ":")).encode()
    topic = temp_topic(bootstrap, args.partitions, prefix="bench-floor-raw")
    try:
        base = await raw_row(bootstrap, topic, payload, shape, args.seconds, args.partitions)
    finally:
        delete_topic(bootstrap, topic)
    rows = [base]
    refused: dict[str, int] = {}
    for seen in ([False, True] if args.seen else [False]):
        res, refused[f"seen={seen}"] = (
            await floor_row(bootstrap, shape, args.seconds, args.partitions, seen, args.linger_ms))
        rows.append(res)
    if args.threadlog:
        ns = f"bench-floor-{uuid.uuid4().hex[:8]}"
        try:
            rows += await threadlog_rows(bootstrap, ns, shape, args.seconds, args.partitions, False, external=True)
        finally:
            delete_namespace(bootstrap, ns)
    if pg is not None:
        rows.append(await postgres_cas_row(pg, shape, args.seconds))
    for r in rows:
        r.bytes = r.count * len(payload)
    print(f"\nbroker {bootstrap}, {args.partitions} partitions; {shape.callers} closed-loop callers over "
          f"{shape.threads} threads; checkpoint {len(payload)} B as JSON; ~{args.seconds:g} s a row\n")
    report([(r, None if r is base else base) for r in rows], unit="ops/s")
    print(f"refused by the floor judge (must be 0: each caller owns its threads): {refused}")
    print_cpu(rows)
    if pg is not None:
        pg_rate = rows[-1].rate
        for r in rows[1:-1]:
            print(f"{r.name}: {r.rate / pg_rate:.2f} x the hand-written PostgreSQL CAS, "
                  f"{r.rate / base.rate:.3f} x raw")


def main() -> None:
    ap = bench_args(__doc__)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--callers", type=int, default=16)
    ap.add_argument("--threads", type=int, default=64)
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--conversation-bytes", type=int, default=512)
    ap.add_argument("--pg-bin", default=PG_BIN)
    ap.add_argument("--skip-postgres", action="store_true")
    ap.add_argument("--seen", action="store_true", help="also a row with one ListOffsets round per call")
    ap.add_argument("--linger-ms", type=float, default=PROPOSALS_LINGER_MS,
                    help="the floor writer's linger (threadlog's proposals: 0; the raw baseline keeps 0)")
    ap.add_argument("--threadlog", action="store_true",
                    help="also threadlog's own CAS row (bench/peers.py's: thin client + one worker process)")
    ap.add_argument("--judge", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--topic", help=argparse.SUPPRESS)
    ap.add_argument("--port-file", help=argparse.SUPPRESS)
    ap.add_argument("--state", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.judge:
        judge_main(args.bootstrap, args.topic, args.partitions, args.port_file, args.state)
        return
    bootstrap = bootstrap_or_local(args.bootstrap)
    if args.skip_postgres:
        asyncio.run(amain(args, bootstrap, None))
    else:
        with postgres_cluster(args.pg_bin) as pg:
            asyncio.run(amain(args, bootstrap, pg))


if __name__ == "__main__":
    main()
