"""A reference judge for tests: the judging step alone, waiting for every position.

`replayed_verdicts` reads a namespace's `events` topic from offset 0 and judges
every record with `processors.judge.judge_record` into temporary stores, one
per partition as every judge keeps them, in offset order per partition; a
proposal naming a position of another partition not judged that far yet waits
(`_Blocked`) while the other partitions move, and is then answered from that
partition's store as of the position. No early answers (processors/ahead.py),
no lookups, no worker: what any judge must agree with. (One store holding
every partition -- judge_record's default -- is not such a judge: a proposal
id applied on one partition would make a re-use of it on another look like a
re-send. Tried, a review: the replay said `duplicateOf` where every judge
had applied it.)
"""

from __future__ import annotations

from collections import deque
from pathlib import Path

from confluent_kafka import Consumer, TopicPartition
from threadlog.processors.handlers import load_all as load_handlers
from threadlog.processors.judge import Record, _Blocked, judge_record
from threadlog.projections.fold import load_all as load_folds
from threadlog.projections.global_ids import holders_as_of as index_holders
from threadlog.projections.store import Store
from threadlog.projections.view import View
from threadlog.schemas import default_codec


def _read_all(bootstrap: str, topic: str, partitions: int, timeout: float = 30.0) -> dict[int, list[Record]]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "replay-support", "enable.auto.commit": False,
                         "enable.partition.eof": True})
    try:
        ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout)[1] for p in range(partitions)}
        consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
        out: dict[int, list[Record]] = {p: [] for p in range(partitions)}
        while any((out[p][-1].offset + 1 if out[p] else 0) < ends[p] for p in range(partitions)):
            msg = consumer.poll(timeout)
            assert msg is not None, f"no record of {topic} within {timeout}s"
            if msg.error() is None and msg.offset() < ends[msg.partition()]:
                out[msg.partition()].append(Record.of(msg.partition(), msg))
        return out
    finally:
        consumer.close()


def replayed_verdicts(bootstrap: str, topic: str, partitions: int, path: Path) -> dict[int, list[tuple[int, dict]]]:
    """{partition: [(offset, verdict), ...]} of every record of `topic`, judged alone."""
    load_handlers()
    load_folds()
    codec = default_codec()
    records = {p: deque(recs) for p, recs in _read_all(bootstrap, topic, partitions).items()}
    progress = dict.fromkeys(range(partitions), 0)
    verdicts: dict[int, list[tuple[int, dict]]] = {p: [] for p in range(partitions)}
    stores = {p: Store(path / f"events-{p}") for p in range(partitions)}
    views = {p: View(store) for p, store in stores.items()}

    def others(q: int, kind: str, ident: str, need: int) -> list[str] | None:
        if progress[q] < need:
            return None
        return index_holders(views[q], kind, ident, need)

    try:
        while any(records.values()):
            moved = False
            for p, queue in records.items():
                while queue:
                    rec = queue[0]
                    try:
                        verdict = judge_record(views[p], rec, codec=codec, partitions=partitions,
                                               progress=progress, topic=topic, others=others)
                    except _Blocked:
                        break  # waits for another partition to be judged further
                    queue.popleft()
                    progress[p] = rec.offset + 1
                    verdicts[p].append((rec.offset, verdict))
                    moved = True
            assert moved, f"the replay of {topic} is stuck: {[q[0].offset for q in records.values() if q]}"
        return verdicts
    finally:
        for store in stores.values():
            store.close()
