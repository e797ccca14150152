"""tl.generation_runs (SPEC section 8): a port of TanStack AI's generation-run
conformance behaviours, plus validation and cross-host reads."""

from __future__ import annotations

import math

import pytest
from support import state_of, store_of, within

from threadlog import ThreadLogError


async def _create(tl, run_id="g1", thread_id="t", started_at=100, status=None, **kw):
    args = {"activity": "image", "provider": "openai", "model": "gpt-image-1", **kw}
    return await within(tl.generation_runs.create_or_resume(run_id=run_id, thread_id=thread_id,
                                                            started_at=started_at, status=status, **args))


async def test_create_get_and_idempotent_resume(tl):
    created = await _create(tl)
    assert created == {"runId": "g1", "threadId": "t", "activity": "image", "provider": "openai",
                       "model": "gpt-image-1", "status": "running", "startedAt": 100}
    assert await within(tl.generation_runs.get("g1")) == created
    assert await within(tl.generation_runs.get("nope")) is None
    await within(tl.generation_runs.update("g1", {"status": "completed", "finishedAt": 200}))
    resumed = await _create(tl, thread_id="t2", started_at=5, status="running", activity="speech",
                            provider="x", model="y")
    assert resumed == {**created, "status": "completed", "finishedAt": 200}
    assert await within(tl.generation_runs.find_latest_for_thread("t2")) is None


async def test_generation_and_chat_run_ids_are_separate(tl):
    await _create(tl, "same")
    assert await within(tl.runs.get("same")) is None
    run = await within(tl.runs.create_or_resume(run_id="same", thread_id="t", started_at=1))
    assert run["status"] == "running" and "activity" not in run


PATCH = {
    "status": "completed",
    "finishedAt": 250.5,
    "error": {"message": "partial", "code": "E"},
    "result": {"images": [{"url": "https://x/y.png", "w": 1024}], "text": "é"},
    "artifacts": [{"artifactId": "a1", "blobKey": "artifacts/g1/a1", "mimeType": "image/png"}],
    "usage": {"totalTokens": 12},
}


async def test_update_round_trips_clears_and_leaves(tl):
    base = await _create(tl)
    await within(tl.generation_runs.update("g1", PATCH))
    assert await within(tl.generation_runs.get("g1")) == {**base, **PATCH}
    await within(tl.generation_runs.update("g1", {"error": None, "result": None}))
    expected = {**base, **PATCH}
    del expected["error"], expected["result"]
    assert await within(tl.generation_runs.get("g1")) == expected


@pytest.mark.parametrize("result", [0, False, "", [], {}, "text", 1.5, [None]])
async def test_any_json_result_is_kept(tl, result):
    await _create(tl)
    await within(tl.generation_runs.update("g1", {"result": result}))
    assert (await within(tl.generation_runs.get("g1")))["result"] == result


async def test_update_of_unknown_run_is_a_no_op(tl):
    before = await state_of(tl)
    await within(tl.generation_runs.update("ghost", {"status": "failed"}))
    assert await within(tl.generation_runs.get("ghost")) is None
    assert await state_of(tl) == before


@pytest.mark.parametrize("patch, why", [
    ({"sandboxKey": "k"}, "a chat-run key"),
    ({"driverEpoch": 1}, "a chat-run key"),
    ({"model": "other"}, "model is not patchable"),
    ({"status": "finished"}, "bad status"),
    ({"status": None}, "status cannot be cleared"),
    ({"finishedAt": "now"}, "str finishedAt"),
    ({"error": {"message": "m", "extra": 1}}, "bad error"),
    ({"result": math.nan}, "non-JSON result"),
    ({"result": {"b": b"bytes"}}, "non-JSON result"),
    ({"artifacts": {"a": 1}}, "artifacts not a list"),
    ({"artifacts": ["a1"]}, "artifact refs are objects"),
    ({"usage": 5}, "usage not a dict"),
    ([("status", "completed")], "not a dict"),
])
async def test_bad_patches_are_refused_and_change_nothing(tl, patch, why):
    base = await _create(tl)
    before = await state_of(tl)
    for run_id in ("g1", "ghost"):
        with pytest.raises(ThreadLogError) as err:
            await within(tl.generation_runs.update(run_id, patch))
        assert err.value.code == "INVALID_ARGUMENT", why
    assert await state_of(tl) == before
    assert await within(tl.generation_runs.get("g1")) == base


@pytest.mark.parametrize("kw, why", [
    ({"run_id": ""}, "empty id"), ({"thread_id": "\ud800"}, "bad thread"), ({"activity": None}, "no activity"),
    ({"provider": 3}, "int provider"), ({"model": "\udc00"}, "lone surrogate model"),
    ({"started_at": "1"}, "str time"), ({"status": "queued"}, "bad status"),
])
async def test_bad_create_arguments_are_refused_even_for_an_existing_run(tl, kw, why):
    base = await _create(tl)
    before = await state_of(tl)
    for run_id in ("g1", "fresh"):
        args = {"run_id": run_id, "thread_id": "t", "activity": "image", "provider": "p", "model": "m",
                "started_at": 1, **kw}
        with pytest.raises(ThreadLogError) as err:
            await within(tl.generation_runs.create_or_resume(**args))
        assert err.value.code == "INVALID_ARGUMENT", why
    assert await state_of(tl) == before
    assert await within(tl.generation_runs.get("g1")) == base
    assert await within(tl.generation_runs.get("fresh")) is None


async def test_find_latest_for_thread_is_the_greatest_started_at_whatever_its_status(tl):
    assert await within(tl.generation_runs.find_latest_for_thread("t")) is None
    await _create(tl, "old", started_at=10)
    await _create(tl, "new", started_at=30, status="failed")
    await _create(tl, "middle", started_at=20)
    await _create(tl, "elsewhere", thread_id="t2", started_at=99)
    assert (await within(tl.generation_runs.find_latest_for_thread("t")))["runId"] == "new"
    await _create(tl, "b", started_at=30)
    await _create(tl, "z", started_at=30)
    assert (await within(tl.generation_runs.find_latest_for_thread("t")))["runId"] == "z"


async def test_a_second_client_reads_every_write_immediately(open_client):
    a = await open_client()
    b = await open_client()
    await _create(a, "g", started_at=1)
    assert (await within(b.generation_runs.get("g")))["status"] == "running"
    await within(b.generation_runs.update("g", {"status": "completed", "result": {"ok": 1}}))
    assert (await within(a.generation_runs.get("g")))["result"] == {"ok": 1}
    assert (await within(a.generation_runs.find_latest_for_thread("t")))["status"] == "completed"


async def test_a_corrupt_stored_status_is_an_error(tl):
    from threadlog.projections.folds import generation_runs as state

    await _create(tl)
    # Settle first: a read barrier means every fold of the create reached the
    # store, so the corruption below is not overwritten by a late fold.
    assert (await within(tl.generation_runs.get("g1")))["status"] == "running"
    raw = b'{"runId":"g1","threadId":"t","activity":"a","provider":"p","model":"m","startedAt":1,"status":"done"}'
    store_of(tl, "t").apply({state.record_key("t", "g1"): raw}, {})
    for call in (tl.generation_runs.get("g1"), tl.generation_runs.find_latest_for_thread("t")):
        with pytest.raises(ThreadLogError) as err:
            await within(call)
        assert err.value.code == "CORRUPT_RECORD"
