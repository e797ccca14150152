"""`examples/takeover.py`: host A drives a run and is SIGKILLed mid-run; host B claims the
run and finishes it; a reader that followed the log throughout sees each word once, in order."""

from __future__ import annotations

import asyncio
import json
import sys

from delivery_support import collect
from example_support import EXAMPLES, ExampleProcess, run_example
from support import within

sys.path.insert(0, str(EXAMPLES))
from takeover import TEXT, words  # the example's own output, not a copy

RUN, THREAD = "run-takeover", "thread-takeover"


async def test_killed_driver_taken_over_reader_sees_one_stream(open_client, bootstrap, namespace, tmp_path):
    common = ["--bootstrap", bootstrap, "--namespace", namespace]
    drive = ["drive", "--run", RUN, "--thread", THREAD, "--delay", "0.05"]
    host_a = await ExampleProcess("takeover.py", *common, "--state-dir", str(tmp_path / "host-a"), *drive,
                                  log_dir=tmp_path).start()
    try:
        await host_a.wait_for('"index": 5,', 60)
        # This test is a third host: it follows the log live, from before the kill to the close.
        reader = await open_client()
        live = asyncio.create_task(collect(reader.delivery(RUN).read("-1"), 60))
        await host_a.wait_for('"index": 12,', 30)
        host_a.kill()  # mid-run, maybe mid-append: no cleanup, no close
        await within(host_a.proc.wait())
        assert host_a.proc.returncode == -9
    finally:
        await host_a.stop()
    by_a = [json.loads(line) for line in host_a.lines]
    assert by_a[0] == {"event": "claimed", "epoch": 1, "resume_at": 0}
    appended_a = [e for e in by_a if e["event"] == "appended"]

    host_b = await run_example("takeover.py", *common, "--state-dir", str(tmp_path / "host-b"), *drive,
                               log_dir=tmp_path)
    by_b = [json.loads(line) for line in host_b.lines]
    claimed = by_b[0]
    assert claimed["event"] == "claimed" and claimed["epoch"] == 2
    # B goes on after everything A got acknowledged (and maybe one more A wrote but never printed).
    assert claimed["resume_at"] in (len(appended_a), len(appended_a) + 1), (claimed, appended_a[-1])
    assert by_b[-1] == {"event": "finished", "epoch": 2}
    appended_b = [e for e in by_b if e["event"] == "appended"]
    assert appended_b[0]["index"] == claimed["resume_at"]

    got = await within(live, 60)
    chunks = [c for _, c in got]
    content = [c for c in chunks if c["type"] == "TEXT_MESSAGE_CONTENT"]
    # One stream: every word once, in order, across the kill and the claim.
    assert [c["index"] for c in content] == list(range(len(words())))
    assert "".join(c["delta"] for c in content) == TEXT
    assert [c["type"] for c in chunks] == ["RUN_STARTED", "TEXT_MESSAGE_START",
                                           *["TEXT_MESSAGE_CONTENT"] * len(content),
                                           "TEXT_MESSAGE_END", "RUN_FINISHED"]
    offsets = [o for o, _ in got]
    assert len(set(offsets)) == len(offsets)
    # Every acknowledged append of either driver is in the stream, at the offset it was given.
    by_offset = dict(got)
    for e in appended_a + appended_b:
        assert by_offset[e["offset"]]["index"] == e["index"]

    # A reader started after the fact (the example's `read`, another process) sees the same stream.
    late = await run_example("takeover.py", *common, "--state-dir", str(tmp_path / "host-c"), "read", "--run", RUN,
                             log_dir=tmp_path)
    assert [(e["offset"], e["chunk"]) for e in map(json.loads, late.lines)] == got

    run = await within(reader.runs.get(RUN))
    assert run["status"] == "completed" and run["driverEpoch"] == 2


async def test_a_driver_that_died_after_its_last_append_is_finished_without_writing_it_twice(
        open_client, bootstrap, namespace, tmp_path):
    """Tried (a review): host A's last append (END + FINISHED) stood, then A died
    before finishing the run; host B found every word there and appended END and
    FINISHED again, so readers saw the run finish twice. And a run finished already
    made the command crash with RUN_TERMINAL."""
    tl = await open_client()
    await within(tl.runs.create_or_resume(run_id=RUN, thread_id=THREAD, started_at=1))
    log = tl.delivery(RUN, await within(tl.runs.claim(RUN)))
    message = {"messageId": f"msg-{RUN}"}
    await within(log.append([{"type": "RUN_STARTED", "threadId": THREAD, "runId": RUN},
                             {"type": "TEXT_MESSAGE_START", **message, "role": "assistant"}]))
    await within(log.append([{"type": "TEXT_MESSAGE_CONTENT", **message, "delta": w, "index": i}
                             for i, w in enumerate(words())]))
    await within(log.append([{"type": "TEXT_MESSAGE_END", **message},
                             {"type": "RUN_FINISHED", "threadId": THREAD, "runId": RUN, "finishReason": "stop"}]))
    common = ["--bootstrap", bootstrap, "--namespace", namespace]
    drive = ["drive", "--run", RUN, "--thread", THREAD, "--delay", "0"]
    host_b = await run_example("takeover.py", *common, "--state-dir", str(tmp_path / "host-b"), *drive,
                               log_dir=tmp_path)
    assert [json.loads(line) for line in host_b.lines] == [
        {"event": "claimed", "epoch": 2, "resume_at": len(words())}, {"event": "finished", "epoch": 2}]
    chunks = [c for _, c in await within(collect(tl.delivery(RUN).read("-1")))]
    assert [c["type"] for c in chunks].count("RUN_FINISHED") == 1 and chunks[-1]["type"] == "RUN_FINISHED"
    again = await run_example("takeover.py", *common, "--state-dir", str(tmp_path / "host-c"), *drive,
                              log_dir=tmp_path)
    assert [json.loads(line) for line in again.lines] == [{"event": "already finished"}]


async def test_a_run_completed_with_its_log_left_open_is_closed_and_keeps_its_thread(
        open_client, bootstrap, namespace, tmp_path):
    """Tried (a review): the driver marked the run completed, then closed its log;
    dying in between left a log no one closed -- `drive` said "already finished"
    and every reader waited forever. And `--thread` of another thread went into
    the chunks of a run that has its own."""
    tl = await open_client()
    common = ["--bootstrap", bootstrap, "--namespace", namespace]
    await within(tl.runs.create_or_resume(run_id="done", thread_id=THREAD, started_at=1))
    await within(tl.runs.claim("done"))
    await within(tl.runs.update("done", {"status": "completed", "finishedAt": 2}))  # died before closing
    finished = await run_example("takeover.py", *common, "--state-dir", str(tmp_path / "b"),
                                 "drive", "--run", "done", "--thread", THREAD, "--delay", "0", log_dir=tmp_path)
    assert [json.loads(line) for line in finished.lines] == [{"event": "already finished"}]
    assert await within(collect(tl.delivery("done").read("-1"))) == []  # the read ends: closed

    await within(tl.runs.create_or_resume(run_id="other", thread_id=THREAD, started_at=1))
    taken = await run_example("takeover.py", *common, "--state-dir", str(tmp_path / "c"),
                              "drive", "--run", "other", "--thread", "not-its-thread", "--delay", "0",
                              log_dir=tmp_path)
    assert json.loads(taken.lines[-1]) == {"event": "finished", "epoch": 1}
    chunks = [c for _, c in await within(collect(tl.delivery("other").read("-1")))]
    assert {c.get("threadId") for c in chunks if "threadId" in c} == {THREAD}


async def test_an_operational_error_is_one_coded_line_not_a_traceback(open_client, bootstrap, namespace, tmp_path):
    """Tried (a review of the examples): reading a run that never produced printed a
    30-line traceback ending in RUN_NOT_FOUND."""
    await open_client()  # the namespace exists: the read itself is what fails
    proc = await ExampleProcess("takeover.py", "--bootstrap", bootstrap, "--namespace", namespace,
                                "--state-dir", str(tmp_path / "r"), "read", "--run", "never-ran",
                                log_dir=tmp_path).start()
    try:
        await within(proc.proc.wait(), 60)
    finally:
        await proc.stop()
    err = proc.stderr()
    assert proc.proc.returncode == 1 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("takeover.py: RUN_NOT_FOUND: run 'never-ran'"), err
