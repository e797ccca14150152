"""The floor of an exactly-once request/reply round trip with raw confluent-kafka, next to raw produce.

    .venv/bin/python bench/txn_floor.py [--bootstrap B] [--count N] [--clients 16] [--threads 64]
                                        [--partitions 4] [--payload 1500]
                                        [--variants eos,at-least-once,eos-2-relays] [--debug-eos]

What any design that commits every decision in a Kafka transaction can get at
best on this broker, in this run, with no threadlog code in the measured path:

- baseline: `raw_produce_closed_loop`, C writers each awaiting its ack;
- C closed-loop clients (asyncio tasks sharing one idempotent producer) each
  send a request (key = one of its threads, a correlation id in the first 16
  bytes of the value) to a `requests` topic and await the reply carrying that
  id on a `replies` topic, which ONE consumer thread reads (fetch.wait.max.ms=5,
  like threadlog's transactional readers) and resolves via call_soon_threadsafe;
- a relay in a separate process (this file with `--relay`) runs the canonical
  consume-transform-produce loop: consumer in a group, poll then take what is
  already fetched, and per poll batch one transaction: begin, one reply per
  request (same partition, same key), send_offsets_to_transaction(position),
  commit. It does not overlap one batch's commit with the next batch, which
  threadlog's decider does with a pool of producers.

Variants (rows of one table):
  eos            transactional relay, replies read read_committed;
  at-least-once  same relay with a plain idempotent producer, no transactions,
                 replies read read_uncommitted, offsets of acknowledged replies
                 committed asynchronously: what transactions cost;
  eos-2-relays   two transactional relays in one group sharing the partitions.

The client configs mirror threadlog/kernel/kafka_config.py (copied, not imported, so
the floor is plain confluent-kafka). Every wait has a timeout; a relay that
exits fails the run. `--debug-eos` turns on librdkafka's eos debug log in the
relays to count CONCURRENT_TRANSACTIONS retries (costs relay CPU: not for figures).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import queue
import statistics
import subprocess
import sys
import threading
import time
import traceback
import uuid
import zlib
from pathlib import Path

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

sys.path.insert(0, str(Path(__file__).parent))
from common import (
    Result,
    _producer,
    bench_args,
    bootstrap_or_local,
    delete_topic,
    raw_produce_closed_loop,
    report,
    temp_topic,
)

CORR = 16  # bytes of correlation id at the head of a request's value
GOAL_RATIO = 0.3
VARIANTS = {  # name -> (relay mode, relays, row label)
    "eos": ("eos", 1, "eos relay (txn per poll batch)"),
    "at-least-once": ("alo", 1, "at-least-once relay (no txn)"),
    "eos-2-relays": ("eos", 2, "eos, 2 relays in one group"),
}


# -- configs (as threadlog/kernel/kafka_config.py) -------------------------------------------
def _base(bootstrap: str, client_id: str) -> dict:
    return {"bootstrap.servers": bootstrap, "client.id": client_id, "socket.nagle.disable": True,
            "reconnect.backoff.ms": 50, "reconnect.backoff.max.ms": 2000}


def _consumer_config(bootstrap: str, client_id: str, **extra) -> dict:
    return {**_base(bootstrap, client_id), "group.id": f"{client_id}.unused", "enable.auto.commit": False,
            "enable.auto.offset.store": False, "isolation.level": "read_committed",
            "auto.offset.reset": "earliest", "fetch.wait.max.ms": 100, "fetch.error.backoff.ms": 20, **extra}


def _relay_producer_config(bootstrap: str, client_id: str, txn_id: str | None) -> dict:
    conf = {**_base(bootstrap, client_id), "enable.idempotence": True, "acks": "all", "linger.ms": 0}
    if txn_id:
        conf.update({"transactional.id": txn_id, "transaction.timeout.ms": 10000,
                     "retry.backoff.ms": 2, "retry.backoff.max.ms": 20})
    return conf


def drain(consumer: Consumer, max_messages: int, timeout: float) -> list:
    """Wait up to `timeout` for the first message, then take what is already fetched."""
    first = consumer.poll(timeout)
    if first is None:
        return []
    return [first, *consumer.consume(max_messages - 1, 0)]


# -- the relay (separate process) -------------------------------------------------------
class _CountingHandler(logging.Handler):
    """Counts CONCURRENT_TRANSACTIONS in librdkafka's eos debug log: a refused
    AddPartitionsToTxn logs one line per partition, so runs of consecutive
    lines count as one refusal (which librdkafka retries after retry.backoff.ms)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines = self.refusals = 0
        self._in_run = False

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        hit = "CONCURRENT_TRANSACTIONS" in text or "concurrent operation on the same transaction" in text
        if hit:
            self.lines += 1
            self.refusals += not self._in_run
        self._in_run = hit


def relay_main(args) -> int:
    """Consume requests, reply to each; per poll batch one transaction (eos) or none (alo).

    stdin: "stats" asks for a stats line, "stop" (or EOF) ends the loop.
    stdout: "assigned N" after every rebalance, "stats k=v ..." on request and at exit.
    """
    eos = args.mode == "eos"
    stop, want_stats = threading.Event(), threading.Event()

    def control() -> None:
        for line in sys.stdin:
            if line.strip() == "stats":
                want_stats.set()
            elif line.strip() == "stop":
                break
        stop.set()

    threading.Thread(target=control, daemon=True).start()
    counter = _CountingHandler()
    pconf = _relay_producer_config(args.bootstrap, f"{args.name}.producer", args.name if eos else None)
    if args.debug_eos:
        log = logging.getLogger("relay.rdkafka")
        log.setLevel(logging.DEBUG)
        log.propagate = False
        log.addHandler(counter)
        pconf.update({"debug": "eos", "logger": log})
    producer = Producer(pconf)
    consumer = Consumer(_consumer_config(
        args.bootstrap, f"{args.name}.consumer",
        **{"group.id": args.group, "heartbeat.interval.ms": 250, "session.timeout.ms": 6000,
           "fetch.wait.max.ms": 20}))
    stats = {"requests": 0, "batches": 0, "aborts": 0, "retries": 0}
    assigned: set[int] = set()

    def say(line: str) -> None:
        print(line, flush=True)

    def on_assign(c, parts) -> None:
        assigned.update(tp.partition for tp in parts)
        say(f"assigned {len(assigned)}")

    def on_revoke(c, parts) -> None:
        assigned.difference_update(tp.partition for tp in parts)
        say(f"assigned {len(assigned)}")

    def stats_line() -> str:
        counts = {**stats, "concurrent": counter.refusals, "concurrent_lines": counter.lines}
        return "stats " + " ".join(f"{k}={v}" for k, v in counts.items())

    def retrying(call, *a) -> None:
        while True:
            try:
                return call(*a)
            except KafkaException as exc:
                if exc.args[0].retriable():
                    stats["retries"] += 1
                    continue
                raise

    # at-least-once: per partition, the next request offset whose reply was acknowledged
    acked: dict[int, int] = {}
    failed: list = []

    def delivered(err, _msg, partition: int, nxt: int) -> None:
        if err is not None:
            failed.append(err)
        else:
            acked[partition] = max(acked.get(partition, -1), nxt)

    if eos:
        producer.init_transactions(30)
    consumer.subscribe([args.requests], on_assign=on_assign, on_revoke=on_revoke)
    try:
        while not stop.is_set():
            if want_stats.is_set():
                want_stats.clear()
                say(stats_line())
            # (a batch straddling a rebalance keeps only the partitions still ours)
            msgs = [m for m in drain(consumer, 10000, 0.05) if m.error() is None and m.partition() in assigned]
            if msgs and eos:
                first: dict[int, int] = {}
                try:
                    producer.begin_transaction()
                    for m in msgs:
                        first.setdefault(m.partition(), m.offset())
                        producer.produce(args.replies, m.value()[:CORR], m.key(), partition=m.partition())
                    positions = [tp for tp in consumer.position(consumer.assignment()) if tp.offset >= 0]
                    retrying(producer.send_offsets_to_transaction, positions,
                             consumer.consumer_group_metadata(), 30)
                    retrying(producer.commit_transaction, 30)
                except KafkaException as exc:
                    if not exc.args[0].txn_requires_abort():
                        raise
                    # abort and decide the batch again
                    stats["aborts"] += 1
                    producer.abort_transaction(30)
                    for p, o in first.items():
                        consumer.seek(TopicPartition(args.requests, p, o))
                    continue
            elif msgs:
                for m in msgs:
                    producer.produce(args.replies, m.value()[:CORR], m.key(), partition=m.partition(),
                                     on_delivery=functools.partial(delivered, partition=m.partition(),
                                                                   nxt=m.offset() + 1))
            producer.poll(0)  # delivery reports (at-least-once), log lines (--debug-eos)
            if msgs:
                stats["requests"] += len(msgs)
                stats["batches"] += 1
            if failed:
                raise KafkaException(failed[0])
            if acked:
                consumer.commit(offsets=[TopicPartition(args.requests, p, o) for p, o in acked.items()],
                                asynchronous=True)
                acked.clear()
        producer.flush(10)
        say(stats_line())
    except BaseException as exc:
        traceback.print_exc()
        say(f"error {exc!r}")
        return 1
    finally:
        consumer.close()
    return 0


# -- the bench process ----------------------------------------------------------------
class Relay:
    """A relay process and the lines it prints."""

    def __init__(self, args, mode: str, requests: str, replies: str, group: str, name: str) -> None:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--relay", "--bootstrap", args.bootstrap,
               "--mode", mode, "--requests", requests, "--replies", replies, "--group", group, "--name", name]
        if args.debug_eos:
            cmd.append("--debug-eos")
        self.name = name
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.assigned = 0
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.strip()
            if line.startswith("assigned "):
                self.assigned = int(line.split()[1])
            self.lines.put(line)
        self.lines.put(None)

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def expect(self, prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"relay {self.name}: no {prefix!r} line in {timeout:.0f} s") from None
            if line is None:
                raise RuntimeError(f"relay {self.name} exited (rc={self.proc.wait(5)}) before {prefix!r}")
            if line.startswith("error "):
                raise RuntimeError(f"relay {self.name}: {line}")
            if line.startswith(prefix):
                return line

    def stats(self, timeout: float) -> dict[str, int]:
        self.send("stats")
        line = self.expect("stats ", timeout)
        return {k: int(v) for k, v in (kv.split("=") for kv in line.split()[1:])}

    def stop(self, timeout: float) -> dict[str, int]:
        self.send("stop")
        line = self.expect("stats ", timeout)
        self.proc.wait(timeout)
        return {k: int(v) for k, v in (kv.split("=") for kv in line.split()[1:])}

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _settle(fut: asyncio.Future, exc: BaseException | None = None) -> None:
    if not fut.done():
        if exc is None:
            fut.set_result(None)
        else:
            fut.set_exception(exc)


async def round_trips(args, label: str, mode: str, relays: list[Relay], requests: str, replies: str,
                      total: int, payload: bytes) -> tuple[Result, dict[str, int]]:
    """C closed-loop clients, each sending a request and awaiting its reply."""
    loop = asyncio.get_running_loop()
    pending: dict[bytes, asyncio.Future] = {}
    stop = threading.Event()
    failure: list[BaseException] = []
    producer = _producer(args.bootstrap)
    reader = Consumer(_consumer_config(
        args.bootstrap, f"floor-replies-{uuid.uuid4().hex[:6]}",
        **{"fetch.wait.max.ms": 5, "isolation.level": "read_committed" if mode == "eos" else "read_uncommitted"}))
    reader.assign([TopicPartition(replies, p, 0) for p in range(args.partitions)])  # fresh topic

    def pump() -> None:
        while not stop.is_set():
            producer.poll(0.05)

    def listen() -> None:
        try:
            while not stop.is_set():
                for m in drain(reader, 1000, 0.1):
                    if m.error() is not None:
                        if m.error().code() != KafkaError._PARTITION_EOF:
                            raise KafkaException(m.error())
                        continue
                    fut = pending.pop(m.value(), None)
                    if fut is not None:
                        loop.call_soon_threadsafe(_settle, fut)
        except BaseException as exc:
            failure.append(exc)

    threads = [threading.Thread(target=pump, daemon=True), threading.Thread(target=listen, daemon=True)]
    for t in threads:
        t.start()
    owned = [[f"thread-{t}".encode() for t in range(args.threads) if t % args.clients == c]
             for c in range(args.clients)]
    latencies: list[float] = []

    def request_failed(err, _msg, fut: asyncio.Future) -> None:
        if err is not None:
            loop.call_soon_threadsafe(_settle, fut, KafkaException(err))

    async def client(c: int, n: int, tag: int) -> None:
        for i in range(n):
            key = owned[c][i % len(owned[c])]
            corr = f"{tag:02x}{c:04x}{i:010x}".encode()
            fut = loop.create_future()
            pending[corr] = fut
            start = time.perf_counter()
            producer.produce(requests, corr + payload[CORR:], key, partition=zlib.crc32(key) % args.partitions,
                             on_delivery=lambda e, m, f=fut: request_failed(e, m, f))
            try:
                await asyncio.wait_for(fut, args.timeout)
            except TimeoutError:
                raise TimeoutError(f"{label}: no reply to {corr.decode()} in {args.timeout} s") from None
            latencies.append(time.perf_counter() - start)

    async def watchdog() -> None:
        while True:
            await asyncio.sleep(0.2)
            dead = [r for r in relays if r.proc.poll() is not None]
            if dead or failure:
                exc = failure[0] if failure else RuntimeError(
                    f"relay {dead[0].name} exited with rc={dead[0].proc.returncode}")
                for fut in list(pending.values()):
                    _settle(fut, exc)
                raise exc

    async def phase(n_per: int, tag: int) -> float:
        t0 = time.perf_counter()
        clients = asyncio.ensure_future(asyncio.gather(*[client(c, n_per, tag) for c in range(args.clients)]))
        dog = asyncio.ensure_future(watchdog())
        try:
            await asyncio.wait({clients, dog}, return_when=asyncio.FIRST_COMPLETED)
            if dog.done():
                dog.result()  # raises
            clients.result()  # raises a client's failure
            return time.perf_counter() - t0
        finally:
            for task in (clients, dog):
                task.cancel()
            await asyncio.gather(clients, dog, return_exceptions=True)

    try:
        await phase(10, 0)  # warm up: connections, group join, the first transactions
        latencies.clear()
        before = [r.stats(args.timeout) for r in relays]
        per = total // args.clients
        elapsed = await phase(per, 1)
        after = [r.stats(args.timeout) for r in relays]
    finally:
        stop.set()
        for t in threads:
            t.join(5)
        reader.close()
        producer.flush(10)
    d = {k: sum(a[k] - b[k] for a, b in zip(after, before, strict=True)) for k in after[0]}
    return Result(label, per * args.clients, elapsed, per * args.clients * len(payload), latencies), d


async def floor(args, variant: str, payload: bytes, run: str) -> tuple[Result, dict[str, int]]:
    """One variant on fresh topics and a fresh group: its row and the relays' counts in the measured window."""
    mode, n_relays, label = VARIANTS[variant]
    requests = temp_topic(args.bootstrap, args.partitions, prefix=f"floor-req-{run}")
    replies = temp_topic(args.bootstrap, args.partitions, prefix=f"floor-rep-{run}")
    group = f"floor-{run}-{variant}"
    relays: list[Relay] = []
    try:
        relays = [Relay(args, mode, requests, replies, group, f"floor-{run}-{variant}-{i}") for i in range(n_relays)]
        deadline = time.monotonic() + args.timeout
        while not (sum(r.assigned for r in relays) == args.partitions and all(r.assigned for r in relays)):
            for r in relays:
                if r.proc.poll() is not None:
                    raise RuntimeError(f"relay {r.name} exited with rc={r.proc.returncode} before its assignment")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{variant}: relays not assigned all {args.partitions} partitions "
                                   f"in {args.timeout} s ({[r.assigned for r in relays]})")
            await asyncio.sleep(0.05)
        res, counts = await round_trips(args, label, mode, relays, requests, replies, args.count, payload)
        for r in relays:
            r.stop(args.timeout)
        return res, counts
    finally:
        for r in relays:
            r.kill()
        delete_topic(args.bootstrap, requests)
        delete_topic(args.bootstrap, replies)


async def main() -> None:
    ap = bench_args(__doc__)
    ap.add_argument("--count", type=int, default=4000, help="round trips (and raw produces) measured")
    ap.add_argument("--clients", type=int, default=16, help="concurrent closed-loop clients / raw writers")
    ap.add_argument("--threads", type=int, default=64, help="thread ids (request keys) spread over the clients")
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--payload", type=int, default=1500, help="request bytes")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds any single wait may take")
    ap.add_argument("--debug-eos", action="store_true",
                    help="count CONCURRENT_TRANSACTIONS in the relays' librdkafka eos debug log")
    # relay process
    ap.add_argument("--relay", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=["eos", "alo"], help=argparse.SUPPRESS)
    for name in ("--requests", "--replies", "--group", "--name"):
        ap.add_argument(name, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.relay:
        sys.exit(relay_main(args))

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    args.bootstrap = bootstrap_or_local(args.bootstrap)
    payload = b"x" * max(CORR, args.payload)
    run = uuid.uuid4().hex[:8]

    topic = temp_topic(args.bootstrap, args.partitions, prefix=f"floor-raw-{run}")
    try:
        # 1 ms: the linger of this floor's own request producer (`_producer`, as round 1 measured it).
        raw = await raw_produce_closed_loop(args.bootstrap, topic, payload, args.count, args.clients,
                                            args.partitions, linger_ms=1)
    finally:
        delete_topic(args.bootstrap, topic)
    rows: list[tuple[Result, Result | None]] = [(raw, None)]
    counts: list[tuple[str, dict[str, int]]] = []
    for v in variants:
        res, c = await floor(args, v, payload, run)
        rows.append((res, raw))
        counts.append((v, c))

    print(f"\nbroker {args.bootstrap}; request {len(payload)} B, reply {CORR} B; {args.clients} clients; "
          f"{args.threads} thread keys; {args.partitions} partitions; {args.count} measured per row\n")
    report(rows)
    print(f"\nratio = rate / raw produce rate at {args.clients} awaiting writers")
    for (res, _), (v, s) in zip(rows[1:], counts, strict=True):
        eos = VARIANTS[v][0] == "eos"
        unit = "transactions" if eos else "poll batches"
        extra = (f", {s['concurrent']} CONCURRENT_TRANSACTIONS refusals retried by librdkafka "
                 f"({s['concurrent_lines']} per-partition log lines)" if args.debug_eos and eos else "")
        print(f"{res.name}: mean {statistics.mean(res.latencies) * 1e3:.2f} ms; relay {s['requests']} requests "
              f"in {s['batches']} {unit} ({s['requests'] / max(1, s['batches']):.1f} per), "
              f"{s['aborts']} aborts, {s['retries']} retried calls{extra}")
    need = GOAL_RATIO * raw.rate
    print(f"goal: ratio >= {GOAL_RATIO} -> >= {need:.0f} ops/s; by Little's law {args.clients} callers then "
          f"need a mean round trip <= {args.clients / need * 1e3:.2f} ms ({args.clients} / ({GOAL_RATIO} * "
          f"{raw.rate:.0f}/s))")


if __name__ == "__main__":
    asyncio.run(main())
