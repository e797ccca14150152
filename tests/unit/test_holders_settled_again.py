"""A `holders` question about a position the owner has not fetched yet is
settled again as records are fetched (processors/query_server.py, RESETTLE_S).

No broker: the query server is real, on a real socket; its judge is a stand-in
that fetches (a real `Ahead` of real encoded proposals) but never judges, as a
worker whose judge waits for the asker's answers, or catches up, does; the
holders are read from a real RocksDB store.
"""

from __future__ import annotations

import asyncio
import time

import orjson
from checkpoint_helpers import checkpoint
from test_ahead import Fetched
from test_judging_rules import Log, acquire, append, codec
from threadlog.processors.ahead import Ahead
from threadlog.processors.judge import RULES
from threadlog.processors.query_server import QueryServer
from threadlog.projections.store import Store

from threadlog.kernel.errors import UNAVAILABLE, ThreadLogError
from threadlog.kernel.partitioning import partition_for

PARTITIONS = 4


class Stores:
    def __init__(self, store: Store) -> None:
        self.store = store

    def store_of(self, q: int) -> Store:
        return self.store

    def offset(self, topic: str, p: int) -> int:
        return 0


class StuckJudge:
    """Owns every partition, has judged none of it, and never will in this test."""

    push = None
    partitions = PARTITIONS
    topic = "ns.events"

    def __init__(self) -> None:
        self.owned = set(range(PARTITIONS))
        self.ahead = Ahead(codec, RULES)
        for p in self.owned:
            self.ahead.reset(p, 0)

    def applied(self, p: int) -> int:
        return 0

    async def wait(self, targets: dict[int, int], timeout: float) -> None:
        if all(t <= 0 for t in targets.values()):
            return
        await asyncio.sleep(timeout)
        raise ThreadLogError(UNAVAILABLE, f"did not reach {targets} in {timeout}s")


async def _ask(writer, reader, n: int, cid: str, q: int, asof: int, wait: float) -> dict:
    args = {"q": q, "kind": "cp", "id": cid, "asof": asof, "partitions": [q], "wait": wait}
    writer.write(orjson.dumps({"id": n, "op": "holders", "args": args}) + b"\n")
    await writer.drain()
    return orjson.loads(await asyncio.wait_for(reader.readline(), wait + 5))


async def test_an_answer_comes_once_the_records_before_the_position_are_fetched(tmp_path):
    """Tried (a fault probe, two workers catching up after a broker outage): the
    asker's position lay beyond what the owner had fetched when the question
    came, so the owner waited for every record before it to be *judged* --
    while its judge waited for the asker's answers. Before: BEHIND after the
    whole wait, though the records fetched meanwhile could not mark the id.
    After: answered once fetched, and the id that a fetched record may mark
    still waits (its answer is not final)."""
    thread = "t-holders"
    q = partition_for(thread, PARTITIONS)
    log = Log()
    acquire(log, thread, "k" * 32)
    for n in range(5):
        append(log, checkpoint(f"other-{n}", thread, None), None, "k" * 32, 1)
    mine = [r for r in log.records if r.partition == q]
    store = Store(tmp_path / "s")
    judge = StuckJudge()
    server = QueryServer(Stores(store), judge, barrier=None, timeout=5.0)
    host, port = (await server.start("127.0.0.1", 0)).split(":")
    reader, writer = await asyncio.open_connection(host, int(port), limit=64 * 1024 * 1024)
    try:
        began = time.monotonic()
        fresh = asyncio.create_task(_ask(writer, reader, 1, "fresh", q, len(mine), 3.0))
        await asyncio.sleep(0.3)  # the question waits at the server; then the judge fetches
        assert not fresh.done()
        judge.ahead.fetched(q, [Fetched(r) for r in mine])
        answer = await fresh
        assert answer["ok"] is True and answer["result"] == {"threads": []}, answer
        assert time.monotonic() - began < 2.0  # not the whole wait
        # An id a fetched, unjudged record may mark: not final until judged that far.
        marked = await _ask(writer, reader, 2, "other-4", q, len(mine), 0.5)
        assert marked["ok"] is False and marked["code"] == "BEHIND", marked
    finally:
        writer.close()
        await server.close()
        store.close()
