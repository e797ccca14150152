"""End to end: a LangGraph graph pauses on `interrupt()` in this process and is resumed
with `Command(resume=...)` by a second process, each a host with its own client and state."""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
from pathlib import Path

import pytest
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import Command
from langgraph_approval import build
from support import within

from threadlog import ThreadLogError
from threadlog.integrations.langgraph import AsyncThreadLogSaver

SCRIPT = Path(__file__).with_name("langgraph_approval.py")


async def run_second_host(*args: str, timeout: float = 90.0) -> dict:
    # Below pytest's 120 s timeout, so a hung host is killed here and its stderr reported.
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(SCRIPT), *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise AssertionError(f"the second host did not finish within {timeout}s") from None
    assert proc.returncode == 0, err.decode(errors="replace")[-4000:]
    return json.loads(out.decode().strip().splitlines()[-1])


async def test_interrupt_here_resume_in_another_process(open_client, bootstrap, namespace, tmp_path):
    tl = await open_client()
    graph = build(AsyncThreadLogSaver(tl))
    config = {"configurable": {"thread_id": "approval-1"}}

    paused = await within(graph.ainvoke({"request": "deploy"}, config), 60)
    assert paused["__interrupt__"][0].value == {"question": "approve DEPLOY?"}
    state = await within(graph.aget_state(config))
    assert state.next == ("review",)

    second = await run_second_host(bootstrap, namespace, str(tmp_path / "host-2"), "approval-1", "yes")
    assert second["seen_interrupt"] == {"question": "approve DEPLOY?"}
    assert second["final"] == {"request": "DEPLOY", "drafts": 1, "answer": "yes", "result": "DEPLOY approved"}

    # Back on the first host: the other host's acknowledged writes are read here.
    done = await within(graph.aget_state(config))
    assert done.next == ()
    assert done.values == second["final"]
    history = [s async for s in graph.aget_state_history(config)]
    # input, before draft, paused before review (this host), after review and after finish
    # (the other host): one chain, newest first.
    assert [s.metadata["step"] for s in history] == [3, 2, 1, 0, -1]
    for child, parent in itertools.pairwise(history):
        assert child.parent_config["configurable"]["checkpoint_id"] == parent.config["configurable"]["checkpoint_id"]


async def _time_travel(graph, thread_id: str) -> list[tuple]:
    """Pause, approve, go back to before `draft` and replay, then reject: a tree with two branches."""
    config = {"configurable": {"thread_id": thread_id}}
    await within(graph.ainvoke({"request": "ship"}, config), 60)
    approved = await within(graph.ainvoke(Command(resume="yes"), config), 60)
    assert approved["result"] == "SHIP approved"
    history = [s async for s in graph.aget_state_history(config)]
    before_draft = next(s for s in history if s.next == ("draft",))
    replayed = await within(graph.ainvoke(None, before_draft.config), 60)
    assert "__interrupt__" in replayed
    rejected = await within(graph.ainvoke(Command(resume="no"), config), 60)
    assert rejected["result"] == "SHIP rejected"
    history = [s async for s in graph.aget_state_history(config)]
    # The tree's shape, ids replaced by their position in the history.
    position = {s.config["configurable"]["checkpoint_id"]: n for n, s in enumerate(history)}
    return [(n, s.metadata["source"], s.metadata["step"], s.next, s.values,
             position.get(s.parent_config["configurable"]["checkpoint_id"]) if s.parent_config else None)
            for n, s in enumerate(history)]


async def test_time_travel_makes_the_same_tree_as_langgraphs_own_saver(open_client):
    """Replaying from an older checkpoint forks the thread: threadlog keeps the same tree,
    values, pending writes and order as LangGraph's InMemorySaver for the same run."""
    tl = await open_client()
    ours = await _time_travel(build(AsyncThreadLogSaver(tl)), "approval-2")
    reference = await _time_travel(build(InMemorySaver()), "approval-2")
    assert ours == reference
    parents = [row[5] for row in ours]
    assert len(parents) == 9 and len(set(parents)) < len(parents)  # one checkpoint has two children


async def test_a_thread_id_of_none_is_refused_not_stored_as_the_text_none(open_client):
    """Tried (a new-user review): `thread_id=None` was stored as the thread "None",
    so every caller that forgot to set one shared that real thread, and
    `delete_thread(None)` deleted it. InMemorySaver keeps None apart from "None";
    the Postgres saver fails on it. Refused now, and the thread "None" is untouched."""
    tl = await open_client()
    graph = build(AsyncThreadLogSaver(tl))
    named_none = {"configurable": {"thread_id": "None"}}
    await within(graph.ainvoke({"request": "kept"}, named_none), 60)
    before = (await within(graph.aget_state(named_none))).values
    with pytest.raises(ThreadLogError) as err:
        await within(graph.ainvoke({"request": "lost"}, {"configurable": {"thread_id": None}}), 60)
    assert err.value.code == "INVALID_ARGUMENT" and "thread_id" in err.value.message
    saver = AsyncThreadLogSaver(tl)
    for call in (saver.adelete_thread(None), saver.aprune([None]), saver.acopy_thread("None", None)):
        with pytest.raises(ThreadLogError) as err:
            await within(call)
        assert err.value.code == "INVALID_ARGUMENT"
    assert before["request"] == "KEPT"
    assert (await within(graph.aget_state(named_none))).values == before
