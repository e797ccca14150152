"""Named queries (projections/queries.py) over a real RocksDB store, no broker.

`langgraph.tuple` must answer what a reader of the keys would read, carry at
most its chunk budget, and tell a missing checkpoint from a moving head;
answers survive the query service's JSON wire unchanged.
"""

from __future__ import annotations

import base64
import json

import orjson
import pytest
from threadlog.projections.folds import langgraph as lg
from threadlog.projections.queries import QUERIES, from_wire, to_wire
from threadlog.projections.store import Store

from threadlog.kernel.errors import UNAVAILABLE, ThreadLogError


def inline(data: bytes) -> dict:
    return {"type": "bytes", "data": base64.b64encode(data).decode("ascii")}


def stored_thread(store: Store) -> dict[bytes, bytes]:
    """Thread "t": checkpoints c1 <- c2 (the head); c2 has an inline and a
    chunked (3 chunks) channel value, a channel without a value, and a write."""
    ck1, ck2 = lg.ckpt_key("t", "", "c1"), lg.ckpt_key("t", "", "c2")
    big = lg.blob_key("t", "", "big", "2")
    kv = {
        ck1: json.dumps({"parent": None, "runId": None, "versions": {}, "body": inline(b"b1"),
                         "metadata": inline(b"m1")}).encode(),
        ck2: json.dumps({"parent": "c1", "runId": None, "versions": {"a": "1", "big": "2", "gone": "9"},
                         "body": inline(b"b2"), "metadata": inline(b"m2")}).encode(),
        lg.head_key("t", ""): b"c2",
        lg.blob_key("t", "", "a", "1"): json.dumps(inline(b"A")).encode(),
        big: json.dumps({"type": "bytes", "chunks": 3, "size": 9}).encode(),
        lg.write_key("t", "", "c2", "task", 0): json.dumps(
            {"channel": "w", "taskPath": "", "value": inline(b"W")}).encode(),
    }
    for i in range(3):
        kv[lg.chunk_key("t", big, lg.SLOT_VALUE, i)] = b"xyz"
    store.apply(kv, {("events", 0): 1})
    return kv


def test_a_tuple_query_answers_what_the_keys_hold(tmp_path, monkeypatch):
    store = Store(tmp_path / "s")
    try:
        kv = stored_thread(store)
        query = QUERIES["langgraph.tuple"]
        got = query(store, thread="t", ns="", checkpoint_id=None)  # the head
        assert got["id"] == "c2" and got["rec"] == kv[lg.ckpt_key("t", "", "c2")]
        assert [ch for ch, _ in got["blobs"]] == ["a", "big", "gone"] and got["blobs"][2][1] is None
        assert [k for k, _ in got["writes"]] == [lg.write_key("t", "", "c2", "task", 0)]
        assert [raw for _, raw in got["chunks"]] == [b"xyz"] * 3
        assert from_wire(orjson.loads(orjson.dumps(to_wire(got)))) == got  # the JSON wire keeps it whole
        assert query(store, thread="t", ns="", checkpoint_id="c1")["id"] == "c1"
        assert query(store, thread="t", ns="", checkpoint_id="nope") is None
        assert query(store, thread="other", ns="", checkpoint_id=None) is None
        monkeypatch.setattr(lg, "TUPLE_CHUNK_BYTES", 4)  # two 3-byte chunks pass it: the reader asks the third
        assert len(query(store, thread="t", ns="", checkpoint_id=None)["chunks"]) == 2
        store.apply({lg.ckpt_key("t", "", "c2"): None}, {("events", 0): 2})  # the head names a deleted record
        with pytest.raises(ThreadLogError) as moving:
            query(store, thread="t", ns="", checkpoint_id=None)
        assert moving.value.code == UNAVAILABLE
    finally:
        store.close()


def test_the_wire_keeps_bytes_apart_from_text():
    answer = {"k": b"\x00\xff", "s": "\x00", "n": [1, None, [b"", "b"]], "d": {"x": b"y"}}
    assert from_wire(orjson.loads(orjson.dumps(to_wire(answer)))) == answer
