"""`examples/approval_agent.py` as two processes: one pauses the agent at `interrupt()`,
another resumes it with `Command(resume=...)`; this test is a third host reading both."""

from __future__ import annotations

import sys

from example_support import EXAMPLES, run_example
from support import within

from threadlog.integrations.langgraph import AsyncThreadLogSaver

sys.path.insert(0, str(EXAMPLES))
from approval_agent import build  # the example's graph, so this host reads the same state schema


async def test_pause_in_one_process_resume_in_another(open_client, bootstrap, namespace, tmp_path):
    common = ["--bootstrap", bootstrap, "--namespace", namespace]
    first = await run_example("approval_agent.py", *common, "--state-dir", str(tmp_path / "host-1"),
                              "start", "--thread", "refund-42", "refund order 42, it arrived broken",
                              log_dir=tmp_path)
    question = {"question": "Run issue_refund(order=42)?", "plan": {"tool": "issue_refund", "args": {"order": "42"}}}
    assert first.last_json() == {"interrupt": question}

    # A third host (this test) sees the paused thread: it waits at the approval.
    tl = await open_client()
    graph = build(AsyncThreadLogSaver(tl))
    config = {"configurable": {"thread_id": "refund-42"}}
    paused = await within(graph.aget_state(config))
    assert paused.next == ("approval",)
    assert [i.value for i in paused.interrupts] == [question]

    second = await run_example("approval_agent.py", *common, "--state-dir", str(tmp_path / "host-2"),
                               "resume", "--thread", "refund-42", "approve", log_dir=tmp_path)
    out = second.last_json()
    assert out["seen_interrupt"] == question
    # `plan` ran once, in the first process: the resume continued the run, it did not restart it.
    assert out["final"] == {"request": "refund order 42, it arrived broken", "plan": question["plan"],
                            "decision": "approve", "outcome": "refund issued for order 42",
                            "steps": ["plan", "approval", "act"]}

    done = await within(graph.aget_state(config))
    assert done.next == ()
    assert done.values == out["final"]
