"""Evaluate faust-streaming for the projection workers against threadlog's follower.

    .venv/bin/pip install -e '.[faust]'
    .venv/bin/python bench/faust_eval.py [--bootstrap B] [--events N]

Both fold the same N committed events (TranscriptSaved, Avro single-object
encoded, written transactionally like the decider writes them) from offset 0
into RocksDB, decoding with the same codec:
- threadlog's follower: a confluent-kafka consumer (read_committed) + one
  RocksDB write batch per poll, offsets stored in the same batch;
- faust-streaming: an agent over the topic writing a faust Table stored in
  RocksDB (`rocksdb://`, rocksdict driver), the app's default settings for
  everything else.
Reported: events folded per second for each, and the ratio.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import Result, bench_args, bootstrap_or_local, delete_topic, report, temp_topic
from confluent_kafka import Producer
from threadlog.projections.fold import load_all
from threadlog.projections.follower import Follower
from threadlog.projections.store import Store
from threadlog.schemas import default_codec


def write_events(bootstrap: str, topic: str, n: int, batch: int = 200) -> None:
    codec = default_codec()
    p = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"faust-eval-{uuid.uuid4().hex[:6]}",
                  "linger.ms": 5})
    p.init_transactions()
    for start in range(0, n, batch):
        p.begin_transaction()
        for i in range(start, min(n, start + batch)):
            tid = f"thread-{i % 500}"
            payload = codec.encode("threadlog.evt.TranscriptSaved", {"threadId": tid, "messages": f'[{{"n":{i}}}]'})
            env = {"key": tid, "seq": i // 500 + 1, "decidedAt": 1.0, "commandId": str(i),
                   "type": "threadlog.evt.TranscriptSaved", "payload": payload}
            p.produce(topic, codec.encode("threadlog.Event", env), tid.encode(), partition=0)
        p.commit_transaction()


def run_follower(bootstrap: str, topic: str, n: int) -> Result:
    load_all()
    with tempfile.TemporaryDirectory() as d:
        store = Store(Path(d) / "db")
        f = Follower(bootstrap, topic, 1, store, default_codec(), "faust-eval")
        t0 = time.perf_counter()
        f.start()
        f.wait_sync({0: n + n // 200}, timeout=300)  # n events + one commit marker per transaction
        elapsed = time.perf_counter() - t0
        f.stop()
        store.close()
    return Result("threadlog follower (confluent-kafka + rocksdict)", n, elapsed)


def run_faust(bootstrap: str, topic: str, n: int, done) -> None:
    """Runs the faust worker; calls done(result_from_start, result_from_first_event) and exits."""
    import faust

    codec = default_codec()
    d = tempfile.mkdtemp()
    app = faust.App(f"faust-eval-{uuid.uuid4().hex[:6]}", broker=f"kafka://{bootstrap}",
                    store="rocksdb://", datadir=d, processing_guarantee="exactly_once",
                    topic_partitions=1, web_enabled=False)
    source = app.topic(topic, key_type=bytes, value_type=bytes, value_serializer="raw",
                       key_serializer="raw", partitions=1)
    table = app.Table("transcripts", default=None, partitions=1)
    seen = {"n": 0, "t0": None}
    t_start = time.perf_counter()

    @app.agent(source)
    async def fold(stream):
        async for value in stream:
            if seen["t0"] is None:
                seen["t0"] = time.perf_counter()
            _, env = codec.decode(value, expect="threadlog.Event")
            _, ev = codec.decode(env["payload"], expect=env["type"])
            table[ev["threadId"]] = ev["messages"]
            seen["n"] += 1
            if seen["n"] >= n:
                t1 = time.perf_counter()
                done(Result("faust-streaming agent + rocksdb table, from start", n, t1 - t_start),
                     Result("faust-streaming, from its first event", n, t1 - seen["t0"]))

    faust.Worker(app, loglevel="ERROR", quiet=True).execute_from_commandline()


def main() -> None:
    ap = bench_args(__doc__)
    ap.add_argument("--events", type=int, default=20000)
    args = ap.parse_args()
    bootstrap = bootstrap_or_local(args.bootstrap)
    topic = temp_topic(bootstrap, 1, "faust-eval")
    write_events(bootstrap, topic, args.events)
    ours = run_follower(bootstrap, topic, args.events)

    def done(from_start: Result, from_first: Result) -> None:
        # faust's worker redirects sys.stdout into its logger: write to the real fd.
        text = report([(ours, None), (from_start, ours), (from_first, ours)], unit="events/s")
        os.write(1, (text + "\nratio = faust rate / follower rate (same events, same broker, same run)\n").encode())
        delete_topic(bootstrap, topic)
        sys.stdout.flush()
        os._exit(0)  # faust's worker does not stop cleanly from inside an agent

    run_faust(bootstrap, topic, args.events, done)


if __name__ == "__main__":
    asyncio.set_event_loop(asyncio.new_event_loop())
    main()
