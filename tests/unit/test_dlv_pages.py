"""A thin reader's replaced texts come from the run's owner a page at a time.

A reader joining a run below its owner's position asks the owner for the
verdicts of the records it fetched and for their replaced texts (upserts).
Those texts have no bound of their own -- every chunk position of a record
may be replaced by a text as large as a record -- while one answer is bounded
(48 MiB). Tried (my last note's list): a range whose texts passed one answer
was refused ANSWER_TOO_LARGE, and the reader failed on every attempt, however
it was retried. Also tried: a single text of control characters, which JSON
escapes in six bytes each, so one 16 MiB record could not be answered alone.

No broker: real RocksDB stores, the real query server and the real thin
client's RemoteRuns (the rig of test_query_args.py).
"""

from __future__ import annotations

import json

import pytest
from test_query_args import Consumed, answer, rig  # noqa: F401 - fixtures and helpers
from test_query_client_faults import client_of  # noqa: F401 - a fixture
from threadlog.processors import query_server
from threadlog.projections import run_index

from threadlog.kernel.errors import INVALID_ARGUMENT
from threadlog.kernel.topics import ANSWER_TOO_LARGE
from threadlog.run_access import RemoteRuns

RUN = "r"


def stored(rig, texts: dict[tuple[int, int], str]) -> None:  # noqa: F811 - the fixture's value
    """Records at offsets 0..4 of the run, each standing, and these replaced texts."""
    writes = {run_index.rec_key(RUN, x): json.dumps({"n": 3}).encode() for x in range(5)}
    writes.update({run_index.rep_key(RUN, x, i): text.encode() for (x, i), text in texts.items()})
    rig.index.store.apply(writes, {})


def counted(rig, asked: list[dict]) -> None:  # noqa: F811 - the fixture's value
    dispatch = rig.server.dispatch

    async def recorded(op, args):
        if op == "dlv_verdicts":
            asked.append(args)
        return await dispatch(op, args)

    rig.server.dispatch = recorded


async def reps_read(rig, client_of) -> dict:  # noqa: F811 - the fixtures' values
    runs = RemoteRuns(client_of(rig.address, 10.0), tail=None, events_partitions=1,  # type: ignore[arg-type]
                      timeout=10.0)
    reading = await runs.reading(RUN, 0)
    judged = await reading.judge([Consumed(x) for x in range(5)], None)
    assert [v for _, v in judged] == [{"n": 3}] * 5  # every verdict, once, whatever the pages
    return reading.reps


async def test_replaced_texts_past_one_answer_are_read_in_pages(rig, client_of, monkeypatch):  # noqa: F811
    texts = {(x, i): f"text {x}.{i} " + "y" * 300 for x in range(5) for i in range(4)}
    stored(rig, texts)
    monkeypatch.setattr(query_server, "MAX_ANSWER_BYTES", 4_000)  # 20 texts of ~310 B: ~8 KB in one answer
    monkeypatch.setattr(query_server, "REPS_PAGE_BYTES", 1_000)
    # All at once (how a reader before pages asked): refused, as every reader was.
    got = await answer(rig.address, {"id": 1, "op": "dlv_verdicts", "args": {"d": 0, "run": RUN, "lo": 0, "hi": 5}})
    assert got["code"] == ANSWER_TOO_LARGE
    asked: list[dict] = []
    counted(rig, asked)
    assert await reps_read(rig, client_of) == texts
    # 1 000 B pages of texts of ~450 B as answered: 3 texts a page (a page ends
    # after the text that reaches the budget), resumed after the last it held.
    assert run_index.answered_size(texts[0, 0].encode()) * 2 < 1_000 < run_index.answered_size(texts[0, 0].encode()) * 3
    positions = sorted(texts)
    assert [a.get("after") for a in asked] == [None, *([x, i] for x, i in positions[2:-1:3])]


async def test_a_text_json_inflates_past_one_answer_comes_whole_in_its_own_page(rig, client_of,  # noqa: F811
                                                                                  monkeypatch):
    huge = "\x01" * 3_000  # 18 000 B as JSON, 4 000 B as base64
    stored(rig, {(1, 0): "a", (2, 0): huge, (2, 1): "\x00nul\ud7ff\U0001f600", (4, 7): "z"})
    monkeypatch.setattr(query_server, "MAX_ANSWER_BYTES", 6_000)
    monkeypatch.setattr(query_server, "REPS_PAGE_BYTES", 1)
    asked: list[dict] = []
    counted(rig, asked)
    assert await reps_read(rig, client_of) == {(1, 0): "a", (2, 0): huge, (2, 1): "\x00nul\ud7ff\U0001f600",
                                               (4, 7): "z"}
    assert len(asked) == 4  # one text a page: each page holds at least one


async def test_a_run_without_replaced_texts_is_one_request(rig, client_of):  # noqa: F811
    stored(rig, {})
    asked: list[dict] = []
    counted(rig, asked)
    assert await reps_read(rig, client_of) == {}
    assert len(asked) == 1 and asked[0]["paged"] is True


async def test_a_worker_before_pages_is_still_understood(rig, client_of, monkeypatch):  # noqa: F811
    """A worker of an earlier version ignores `paged` (fields it does not name are
    ignored) and answers everything at once, as {"v", "r"}: the reader takes it."""
    texts = {(0, 0): "old", (3, 2): "format"}
    stored(rig, texts)
    dispatch = rig.server.dispatch

    async def earlier(op, args):
        if op == "dlv_verdicts":
            args = {k: v for k, v in args.items() if k not in ("paged", "after")}
        return await dispatch(op, args)

    rig.server.dispatch = earlier
    assert await reps_read(rig, client_of) == texts


@pytest.mark.parametrize("after", [[5, 0], [0, 1 << 32], [7, 0]])
async def test_a_page_position_outside_the_range_is_refused(rig, after):  # noqa: F811
    stored(rig, {(0, 0): "x"})
    got = await answer(rig.address, {"id": 1, "op": "dlv_verdicts", "args": {
        "d": 0, "run": RUN, "lo": 0, "hi": 5, "paged": True, "after": after}})
    assert got["code"] == INVALID_ARGUMENT and "`after`" in got["message"]


def test_a_page_resumes_after_the_last_index_a_position_can_have(tmp_path):
    store = run_index.Store(tmp_path / "s")
    try:
        store.apply({run_index.rep_key(RUN, 0, (1 << 32) - 1): b"last", run_index.rep_key(RUN, 1, 0): b"next"}, {})
        page, more = run_index.replacements_page(store, RUN, 0, 5, (0, (1 << 32) - 1), 100)
        assert (page, more) == ([(1, 0, b"next")], None)
    finally:
        store.close()


async def test_a_reader_keeps_only_the_replaced_texts_of_the_batch_it_judged_last(rig, client_of):  # noqa: F811
    """Tried (a review): every batch's texts were added to the reading and kept until
    the read ended: a replay of a run whose every chunk was upserted held the
    whole run's texts, once per SSE join."""
    stored(rig, {(x, 0): f"text {x}" for x in range(5)})
    runs = RemoteRuns(client_of(rig.address, 10.0), tail=None, events_partitions=1,  # type: ignore[arg-type]
                      timeout=10.0)
    reading = await runs.reading(RUN, 0)
    await reading.judge([Consumed(0), Consumed(1)], None)
    assert reading.replacement(0, 0) == "text 0" and reading.replacement(1, 0) == "text 1"
    await reading.judge([Consumed(2), Consumed(3), Consumed(4)], None)
    assert reading.reps == {(2, 0): "text 2", (3, 0): "text 3", (4, 0): "text 4"}
    await reading.judge([Consumed(5)], None)  # at the owner's position: the reader's own fold
    assert not reading.has_reps()


async def test_many_small_texts_are_counted_as_answered_not_as_stored(rig, client_of, monkeypatch):  # noqa: F811
    """Tried (a review): the budget counted stored text bytes only, so millions of
    two-byte texts ("{}", ~40 bytes each as an entry) made a 107 MiB page of an
    8 MiB budget, refused ANSWER_TOO_LARGE on every retry. Scaled: 2 000 texts,
    a 1 000-byte budget, 6 000-byte answers (48 MiB to 8 MiB)."""
    texts = {(0, i): "{}" for i in range(2_000)}
    stored(rig, texts)
    monkeypatch.setattr(query_server, "MAX_ANSWER_BYTES", 6_000)
    monkeypatch.setattr(query_server, "REPS_PAGE_BYTES", 1_000)
    asked: list[dict] = []
    counted(rig, asked)
    assert await reps_read(rig, client_of) == texts
    assert len(asked) > 1
