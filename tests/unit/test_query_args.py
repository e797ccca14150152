"""What the worker's query service answers a request it cannot take
(INVALID_ARGUMENT, before anything is read or waited for) and a request it
took and then failed on (INTERNAL, whatever the worker raised): no broker --
real RocksDB stores, stub judge and barriers, the real thin client.

Tried (a review): requests were classified by the exception they raised, so a
worker's own ValueError or KeyError (a stored record that does not decode, a
bug in a query) was answered INVALID_ARGUMENT, "bad request", telling the
caller to change a request that was fine.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
from test_queries import stored_thread
from test_query_client_faults import client_of  # noqa: F401 - a fixture (test_query_client_faults.py)
from test_query_server_limits import Judge
from threadlog.processors import lookups, query_server
from threadlog.processors.lookups import MAX_HOLDERS
from threadlog.processors.query_server import MAX_GETS, MAX_VERDICTS, QueryServer
from threadlog.projections import run_index
from threadlog.projections.folds import langgraph as lg
from threadlog.projections.partition_stores import PartitionStores
from threadlog.projections.queries import QUERIES
from threadlog.projections.store import Store

from threadlog import remote
from threadlog.kernel.errors import INTERNAL, INVALID_ARGUMENT, UNAVAILABLE, ThreadLogError
from threadlog.run_access import RemoteRuns

EVENTS, DELIVERIES = "ns.events", "ns.deliveries"


class Stores(PartitionStores):
    """Real stores that count what was read of them (a refused request reads nothing)."""

    def __init__(self, path: Any, topic: str) -> None:
        super().__init__(path, topic)
        self.reads: list[str] = []

    def get(self, k, partitions=None):
        self.reads.append("get")
        return super().get(k, partitions)

    def scan(self, prefix, start=None, partitions=None):
        self.reads.append("scan")
        return super().scan(prefix, start, partitions)

    def store_of(self, partition):
        self.reads.append("store_of")
        return super().store_of(partition)


class Ahead:
    def settles_at(self, q, kind, ident, asof):
        return asof

    def may_settle_earlier(self, q, kind, asof):
        return False


class Judged(Judge):
    """Judged as far as any floor asks; every verdict asked about is judged at once."""

    def __init__(self) -> None:
        self.owned = {0}
        self.ahead = Ahead()
        self.stats = {"judged": 3, "blocked": 0}
        self.restores: dict = {}
        self.restoring: list = []
        self.lookups = None
        self.calls: list[tuple] = []  # waits and verdict subscriptions a request began

    async def wait(self, targets, timeout):
        self.calls.append(("wait", targets))

    def on_verdict(self, p, o, callback):
        self.calls.append(("on_verdict", p, o))
        callback({"ok": True, "offset": o})

    def forget(self, p, o, callback):
        pass


class Ends:
    """A read barrier's end offsets."""

    def __init__(self, ends: dict[int, int]) -> None:
        self.ends = ends
        self.asked = 0

    async def end_offsets(self) -> dict[int, int]:
        self.asked += 1
        return dict(self.ends)


class Index:
    """The run index of delivery partition 0, over a real store."""

    topic = DELIVERIES

    def __init__(self, store: Store) -> None:
        self.store = store
        self.owned = {0}
        self.push = None
        self.waits: list[dict] = []

    async def wait(self, targets, timeout):
        self.waits.append(targets)


@pytest.fixture
async def rig(tmp_path):
    stores = Stores(tmp_path / "events", EVENTS)
    kv = stored_thread(stores.open(0))  # thread "t": checkpoints c1 <- c2
    dlv = Store(tmp_path / "deliveries")
    dlv.apply({}, {(DELIVERIES, 0): 5})
    judge, ends, dlv_ends, index = Judged(), Ends({0: 10}), Ends({0: 5}), Index(dlv)
    server = QueryServer(stores, judge, barrier=ends, timeout=5.0, deliveries=index, delivery_barrier=dlv_ends)
    address = await server.start("127.0.0.1", 0)

    def touched() -> dict:
        """What requests so far read, waited for or changed."""
        return {k: v for k, v in {"reads": stores.reads, "judge": judge.calls, "barrier": ends.asked,
                                  "delivery barrier": dlv_ends.asked, "delivery waits": index.waits,
                                  "holders asked": server.holders_asked, "pushing": server.push.active}.items()
                if v}

    yield SimpleNamespace(server=server, address=address, stores=stores, kv=kv, judge=judge, ends=ends,
                          index=index, touched=touched)
    await server.close()
    stores.close()
    dlv.close()


async def answer(address: str, request: dict | bytes) -> dict:
    """One request on its own connection, and the worker's answer line."""
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port), limit=1 << 24)
    try:
        writer.write((request if isinstance(request, bytes) else orjson.dumps(request)) + b"\n")
        await writer.drain()
        return orjson.loads(await asyncio.wait_for(reader.readline(), 10))
    finally:
        writer.close()


# -- (a) a request that is not what its operation takes -------------------------------------
R = {"partitions": [0]}  # what every routed request carries
QUESTION = [0, "cp", "c1", 5]
MALFORMED = [  # (op, args, the field the refusal names)
    ("get", {**R}, "key"),
    ("get", {**R, "key": 5}, "key"),
    ("get", {**R, "key": "A"}, "key"),  # not base64
    ("get", {**R, "key": "AA==", "barrier": "yes"}, "barrier"),
    ("get", {"key": "AA==", "partitions": "0"}, "partitions"),
    ("get", {**R, "key": "AA==", "floor": {"zero": 1}}, "floor"),
    ("get", {**R, "key": "AA==", "wait": "soon"}, "wait"),
    ("gets", {**R}, "keys"),
    ("gets", {**R, "keys": "AA=="}, "keys"),
    ("gets", {**R, "keys": ["AA==", 7]}, "keys[1]"),
    ("gets", {**R, "keys": ["AA=="] * (MAX_GETS + 1)}, str(MAX_GETS)),
    ("query", {**R}, "name"),
    ("query", {**R, "name": 3}, "name"),
    ("query", {**R, "name": "no.such"}, "unknown query 'no.such'"),
    ("query", {**R, "name": "langgraph.tuple", "args": ["t"]}, "args"),
    ("query", {**R, "name": "langgraph.tuple", "args": {"ns": "", "checkpoint_id": None}}, "thread"),
    ("query", {**R, "name": "langgraph.tuple", "args": {"thread": "t", "ns": 0, "checkpoint_id": None}}, "ns"),
    ("query", {**R, "name": "langgraph.tuple", "args": {"thread": "t", "ns": "", "checkpoint_id": None,
                                                         "depth": 2}}, "depth"),
    ("query", {**R, "name": "agents.items", "args": {"session": "s"}}, "limit"),
    ("query", {**R, "name": "runs.quiet", "args": {"cutoff": True}}, "cutoff"),
    ("slice", {**R, "key": "AA==", "start": 0}, "length"),
    ("slice", {**R, "key": "AA==", "start": -1, "length": 5}, "start"),
    ("slice", {**R, "key": "AA==", "start": 0, "length": 0}, "length"),
    ("slice", {**R, "key": "AA==", "start": "0", "length": 5}, "start"),
    ("scan", {**R, "start": None}, "prefix"),
    ("scan", {**R, "prefix": "", "limit": "10"}, "limit"),
    ("scan", {**R, "prefix": "", "start": 1}, "start"),
    ("verdict", {"o": 0}, "p"),
    ("verdict", {"p": True, "o": 0}, "p"),  # JSON true is not an integer
    ("verdict", {"p": 0, "o": 1.5}, "o"),
    ("verdict", {"p": 0, "o": 0, "timeout": "30"}, "timeout"),
    ("verdicts", {"p": 0}, "os"),
    ("verdicts", {"p": 0, "os": []}, "os"),
    ("verdicts", {"p": 0, "os": [1, -1]}, "os[1]"),
    ("verdicts", {"p": 0, "os": list(range(MAX_VERDICTS + 1))}, str(MAX_VERDICTS)),
    ("barrier", {"partitions": [0, "1"]}, "partitions[1]"),
    ("holders", {"q": 0, "kind": "cp", "id": "c1"}, "asof"),
    ("holders", {"q": 0, "kind": "cp", "id": 5, "asof": 1}, "id"),
    ("holders_many", {**R}, "asked"),
    ("holders_many", {**R, "asked": [QUESTION[:3]]}, "asked[0]"),
    ("holders_many", {**R, "asked": [[*QUESTION[:3], "5"]]}, "asked[0][3]"),
    ("holders_many", {**R, "asked": [QUESTION] * (MAX_HOLDERS + 1)}, str(MAX_HOLDERS)),
    ("dlv_verdict", {"d": 0, "run": "r", "x": 0, "kind": run_index.CHUNKS}, "epoch"),
    ("dlv_state", {"run": "r"}, "d"),
    ("dlv_state", {"d": 0, "run": "r", "xs": [0, None]}, "xs[1]"),
    ("dlv_verdicts", {"d": 0, "run": "r", "lo": 0}, "hi"),
    ("dlv_verdicts", {"d": 0, "run": 7, "lo": 0, "hi": 1}, "run"),
    ("push", {}, "secret"),
]


@pytest.mark.parametrize(("op", "args", "field"), MALFORMED, ids=[f"{op}-{field}" for op, _, field in MALFORMED])
async def test_a_malformed_request_is_refused_naming_its_field_before_anything_is_read(rig, op, args, field):
    got = await answer(rig.address, {"id": 7, "op": op, "args": args})
    assert got["id"] == 7 and got["ok"] is False and got["code"] == INVALID_ARGUMENT, got
    # An unknown query is said exactly so: a client takes it for a worker of an earlier version.
    said = got["message"]
    assert field in said and said.startswith(field if field.startswith("unknown") else f"{op}: "), got
    assert rig.touched() == {}


OPS = ["get", "gets", "query", "slice", "scan", "verdict", "verdicts", "barrier", "holders", "holders_many",
       "dlv_verdict", "dlv_state", "dlv_verdicts", "push", "stats", "end_offsets"]


@pytest.mark.parametrize("op", OPS)
async def test_args_that_are_not_an_object_are_refused_for_every_operation(rig, op):
    for args in ([0], "x", 1):
        got = await answer(rig.address, {"id": 1, "op": op, "args": args})
        assert got["code"] == INVALID_ARGUMENT and got["message"].startswith(f"{op}: args must be an object"), got
    assert rig.touched() == {}


async def test_a_line_that_is_no_request_is_refused(rig):
    for line, says in ((b"{not json", "JSON object per line"), (b"[1, 2]", "JSON object"),
                       (b'{"op": "stats", "args": {}}', "`id`"), (b'{"id": 3, "op": 5}', "`op`"),
                       (b'{"id": 3, "op": "compact"}', "unknown operation 'compact'")):
        got = await answer(rig.address, line)
        assert got["ok"] is False and got["code"] == INVALID_ARGUMENT and says in got["message"], (line, got)
    assert rig.touched() == {}


def test_every_query_has_its_args_and_they_are_its_parameters():
    # The table the worker checks a query's args by is the queries' own signatures
    # (a query added or changed without it would be checked by names only).
    assert set(query_server._QUERY_ARGS) == set(QUERIES)
    for name, query in QUERIES.items():
        params = list(inspect.signature(query).parameters.values())[1:]  # after the store
        spec = query_server._QUERY_ARGS[name]
        assert list(spec) == [p.name for p in params], name
        assert [spec[p.name][1] for p in params] == [p.default is inspect.Parameter.empty for p in params], name


# -- (b) a request taken, then the worker failing -------------------------------------------
def raising(exc: Exception):
    def fail(*args, **kwargs):
        raise exc
    return fail


def async_raising(exc: Exception):
    async def fail(*args, **kwargs):
        raise exc
    return fail


Q = {"thread": "t", "ns": "", "checkpoint_id": None}
FAILING = [  # (op, well-formed args, what raises in its body)
    ("get", {**R, "key": "AA=="}, lambda rig, exc: setattr(rig.stores, "get", raising(exc))),
    ("gets", {**R, "keys": ["AA=="]}, lambda rig, exc: setattr(rig.stores, "get", raising(exc))),
    ("slice", {**R, "key": "AA==", "start": 0, "length": 4}, lambda rig, exc: setattr(rig.stores, "get",
                                                                                       raising(exc))),
    ("scan", {**R, "prefix": ""}, lambda rig, exc: setattr(rig.stores, "scan", raising(exc))),
    ("query", {**R, "name": "langgraph.tuple", "args": Q},
     lambda rig, exc: rig.monkeypatch.setitem(QUERIES, "langgraph.tuple", raising(exc))),
    ("verdict", {"p": 0, "o": 1}, lambda rig, exc: setattr(rig.judge, "on_verdict", raising(exc))),
    ("verdicts", {"p": 0, "os": [1]}, lambda rig, exc: setattr(rig.judge, "on_verdict", raising(exc))),
    ("barrier", {**R}, lambda rig, exc: setattr(rig.ends, "end_offsets", async_raising(exc))),
    ("holders", {"q": 0, "kind": "cp", "id": "c1", "asof": 5},
     lambda rig, exc: setattr(rig.stores, "store_of", raising(exc))),
    ("holders_many", {**R, "asked": [QUESTION]}, lambda rig, exc: setattr(rig.stores, "store_of", raising(exc))),
    ("dlv_verdict", {"d": 0, "run": "r", "x": 1, "kind": run_index.CHUNKS, "epoch": 1},
     lambda rig, exc: rig.monkeypatch.setattr(run_index, "decided", raising(exc))),
    ("dlv_state", {"d": 0, "run": "r"}, lambda rig, exc: rig.monkeypatch.setattr(run_index, "run_state",
                                                                                 raising(exc))),
    ("dlv_verdicts", {"d": 0, "run": "r", "lo": 0, "hi": 2},
     lambda rig, exc: rig.monkeypatch.setattr(run_index, "verdicts_between", raising(exc))),
    ("stats", {}, lambda rig, exc: setattr(rig.judge, "applied", raising(exc))),
    ("end_offsets", {}, lambda rig, exc: setattr(rig.ends, "end_offsets", async_raising(exc))),
]


@pytest.mark.parametrize("exc", [ValueError("a stored record does not decode"), KeyError("fence")],
                         ids=["ValueError", "KeyError"])
@pytest.mark.parametrize(("op", "args", "fail"), FAILING, ids=[op for op, _, _ in FAILING])
async def test_a_worker_raising_value_or_key_error_answers_internal(rig, monkeypatch, caplog, op, args, fail, exc):
    rig.monkeypatch = monkeypatch
    fail(rig, exc)
    got = await answer(rig.address, {"id": 2, "op": op, "args": args})
    assert got["id"] == 2 and got["ok"] is False and got["code"] == INTERNAL, got
    assert got["message"].startswith("the worker failed: ") and repr(exc) in got["message"], got
    assert any(r.exc_info and r.exc_info[1] is exc for r in caplog.records)  # its traceback, logged


async def test_a_stored_record_that_does_not_decode_is_the_workers_failure(rig):
    # Real records, as a query and the run index read them.
    store = rig.stores.store_of(0)
    request = {"id": 1, "op": "query", "args": {**R, "name": "langgraph.tuple", "args": Q}}
    for record, raised in ((b"{not json", "JSONDecodeError"), (b'{"parent": null}', "KeyError('versions')")):
        store.apply({lg.ckpt_key("t", "", "c2"): record}, {})
        got = await answer(rig.address, request)
        assert got["code"] == INTERNAL and raised in got["message"], got
    rig.index.store.apply({run_index.run_key("r"): b"\xff"}, {})
    got = await answer(rig.address, {"id": 1, "op": "dlv_state", "args": {"d": 0, "run": "r"}})
    assert got["code"] == INTERNAL and "UnicodeDecodeError" in got["message"], got


async def test_a_refusal_the_operation_raises_keeps_its_code(rig, monkeypatch):
    monkeypatch.setitem(QUERIES, "langgraph.tuple", raising(ThreadLogError(UNAVAILABLE, "not now")))
    got = await answer(rig.address, {"id": 1, "op": "query", "args": {**R, "name": "langgraph.tuple", "args": Q}})
    assert got["code"] == UNAVAILABLE and got["message"] == "not now", got
    got = await answer(rig.address, {"id": 1, "op": "verdict", "args": {"p": 1, "o": 0}})  # one partition: 0
    assert got["code"] == INVALID_ARGUMENT and "partition 1" in got["message"], got


# -- (c) every request a real client sends --------------------------------------------------
class Consumed:
    def __init__(self, offset: int) -> None:
        self._offset = offset

    def offset(self) -> int:
        return self._offset


async def test_every_request_a_real_client_sends_is_answered(rig, client_of):  # noqa: F811 - the fixture
    answered: list[str] = []
    dispatch = rig.server.dispatch

    async def recorded(op, args):
        result = await dispatch(op, args)
        answered.append(op)
        return result

    rig.server.dispatch = recorded
    qc = client_of(rig.address, 10.0)
    head, kv = lg.head_key("t", ""), rig.kv
    # Reads (threadlog/remote.py, as the stores and integrations call them).
    assert await qc.barrier(None) == {0: 10}
    assert await qc.read(head, None, False) == b"c2"
    assert await qc.read(head, None, True) == b"c2"  # `get` with its barrier
    assert await qc.read_many([head, b"absent"], None, True) == [b"c2", None]
    assert await qc.read_sliced(head, None) == b"c2"
    assert set(kv.items()) <= set(await qc.scan(b"", None))
    (got,) = await qc.query("langgraph.tuple", {"thread": "t", "ns": "", "checkpoint_id": None}, None, True)
    assert got["id"] == "c2"
    # The other queries with the args their callers send (threadlog/integrations/openai_agents.py,
    # threadlog/stores/checkpoints.py, interrupts.py, runs.py).
    assert await qc.query("agents.items", {"session": "s", "limit": None}, None, True) == [[]]
    assert await qc.query("agents.items", {"session": "s", "limit": 5}, None, False) == [[]]
    assert await qc.query("checkpoints.get", {"checkpoint_id": "c1"}, None, True) == [[]]
    assert await qc.query("interrupts.of_run", {"run_id": "r"}, None, True) == [[]]
    assert await qc.query("runs.quiet", {"cutoff": float(time.time() * 1000)}, None, True) == [[]]
    # Verdicts asked (RemoteVerdicts) and pushed (its push connection).
    verdicts = remote.RemoteVerdicts(qc)
    assert await qc.on_loop(verdicts._verdicts(0, [3, 1])) == [{"ok": True, "offset": 3}, {"ok": True, "offset": 1}]

    async def subscribe() -> bool:
        return verdicts._pushing(0)

    await qc.on_loop(subscribe())
    (stream,) = verdicts._streams.values()
    # Set once the worker answered the subscription (`push`), on the client's loop thread.
    assert await asyncio.to_thread(stream.ready.wait, 5)
    assert rig.server.push.active
    # Another worker's judge (processors/lookups.py; time travel asks `holders` as `_one` does).
    asker = lookups.Lookups(qc)
    assert await qc.on_loop(asker._one((0, "cp", "c1", 5))) == []
    assert await qc.on_loop(asker._many([(0, "cp", "c1", 5), (0, "cp", "c2", -1)])) == [[], []]
    # The run index at its owner (threadlog/run_access.py).
    runs = RemoteRuns(qc, tail=None, events_partitions=1, timeout=10.0)  # type: ignore[arg-type]
    verdict, fence = await runs.decide("r", 0, 3, run_index.CHUNKS, 1, 5.0)
    assert isinstance(verdict, dict) and fence == 0  # the run's verdict, whatever it is: answered
    reading = await runs.reading("r", 0)
    assert reading.at == 5 and await runs.counts("r", 0, [1, 2]) == {1: None, 2: None}
    assert [v for _, v in await reading.judge([Consumed(1), Consumed(2)], None)] == [None, None]  # dlv_verdicts
    # Operators and tests (tests/worker_support.py `ask_worker`, tests/test_ops.py).
    assert (await qc.acall("stats", {}, [0]))[(0,)]["owned"] == [0]
    assert (await qc.acall("stats", {}))[()]["judged"] == 3
    assert (await answer(rig.address, {"id": 1, "op": "verdict", "args": {"p": 0, "o": 4, "timeout": 30}}))[
        "result"] == {"ok": True, "offset": 4}
    assert (await answer(rig.address, {"id": 1, "op": "end_offsets", "args": {}}))["result"] == {"0": 10}
    assert set(answered) | {"push"} == set(OPS) == set(query_server._ARGS)  # every operation, each answered
