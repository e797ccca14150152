"""Runs, generation runs, interrupts and artifacts move the per-thread presence
counters the fork's emptiness check reads (SPEC section 4: the destination must
have no run, generation run, interrupt or artifact)."""

from __future__ import annotations

import pytest
from support import within
from threadlog.projections.folds import presence

from threadlog import ThreadLogError


def _counts(tl, thread_id: str) -> dict[str, int]:
    store = tl.runtime.store
    kinds = (presence.RUN, presence.GENERATION_RUN, presence.INTERRUPT, presence.ARTIFACT)
    return {k: presence.count(store, thread_id, k) for k in kinds if presence.count(store, thread_id, k)}


def _art(artifact_id, run_id="r", thread_id="t"):
    return {"artifactId": artifact_id, "runId": run_id, "threadId": thread_id, "name": "n",
            "mimeType": "text/plain", "size": 1, "createdAt": 1}


async def _fill(tl):
    for _ in range(2):  # the second round resumes / re-inserts: no double counting
        await within(tl.runs.create_or_resume(run_id="r", thread_id="t", started_at=1))
        await within(tl.runs.create_or_resume(run_id="r2", thread_id="t", started_at=2))
        await within(tl.generation_runs.create_or_resume(run_id="g", thread_id="t", activity="a", provider="p",
                                                         model="m", started_at=1))
        await within(tl.interrupts.create({"interruptId": "i", "runId": "r", "threadId": "t", "requestedAt": 1,
                                           "payload": {}}))
        await within(tl.artifacts.save(_art("a1")))
        await within(tl.artifacts.save(_art("a2")))


async def test_each_store_counts_what_exists_on_the_thread(tl):
    assert presence.kinds_present(tl.runtime.store, "t") == []
    await _fill(tl)
    await tl.read_barrier(None)
    assert _counts(tl, "t") == {presence.RUN: 2, presence.GENERATION_RUN: 1, presence.INTERRUPT: 1,
                                presence.ARTIFACT: 2}
    # Deciding an interrupt or finishing a run does not remove it from the thread.
    await within(tl.interrupts.resolve("i"))
    await within(tl.runs.update("r", {"status": "completed"}))
    await within(tl.artifacts.delete("a1"))
    await tl.read_barrier(None)
    assert _counts(tl, "t")[presence.ARTIFACT] == 1
    await within(tl.artifacts.delete_for_run("r"))
    await tl.read_barrier(None)
    assert _counts(tl, "t") == {presence.RUN: 2, presence.GENERATION_RUN: 1, presence.INTERRUPT: 1}
    assert _counts(tl, "other") == {}


async def test_a_fresh_host_folds_the_same_counts(open_client):
    a = await open_client()
    await _fill(a)
    await within(a.artifacts.delete("a2"))
    fresh = await open_client()  # a fresh full replica: its own store is inspected
    await fresh.read_barrier(None)
    await a.read_barrier(None)
    assert _counts(fresh, "t") == _counts(a, "t") == {presence.RUN: 2, presence.GENERATION_RUN: 1,
                                                      presence.INTERRUPT: 1, presence.ARTIFACT: 1}


@pytest.mark.parametrize("payload", [
    {"artifact": {**_art("x", thread_id="other"), "blobKey": None, "sourceUrl": None}},
    {"artifact": {**_art("x"), "size": -5, "blobKey": None, "sourceUrl": None}},
    {"artifact": {**_art("x"), "name": "", "blobKey": None, "sourceUrl": None}},
])
async def test_forged_artifact_saves_are_refused_by_the_decider(tl, payload):
    with pytest.raises(ThreadLogError) as err:
        await within(tl.bus.send("threadlog.cmd.SaveArtifact", "t", payload))
    assert err.value.code == "INVALID_ARGUMENT"
    assert await within(tl.artifacts.get("x")) is None
    assert _counts(tl, "t") == {}
