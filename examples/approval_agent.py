"""A LangGraph agent that asks a human before it acts, and is resumed later by another process.

    # process 1: the agent plans a refund and pauses at the approval step (`interrupt()`)
    .venv/bin/python examples/approval_agent.py start --thread refund-42 "refund order 42, it arrived broken"
    # later, from any host: the human's answer resumes the same thread (`Command(resume=...)`)
    .venv/bin/python examples/approval_agent.py resume --thread refund-42 approve

Each command is its own process with its own threadlog client (`ThreadLogSaver`,
`threadlog.integrations.langgraph`): the paused graph lives in Kafka, so the
process that resumes it needs nothing from the one that started it. Both print
one JSON line (`start`: the interrupt's payload; `resume`: the final state).
`show` prints where a thread stands.
"""

from __future__ import annotations

import argparse
import json
import operator
import os
import re
import sys
from typing import Annotated, Any, TypedDict

from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, interrupt

from threadlog import ThreadLogError


class State(TypedDict, total=False):
    request: str
    plan: dict
    decision: str
    outcome: str
    # Every node that completed, in order: a resume must continue the run, not redo `plan`.
    steps: Annotated[list[str], operator.add]


def plan(state: State) -> State:
    # The "model": a deterministic planner that turns the request into one tool call.
    order = re.search(r"\d+", state["request"])
    return {"plan": {"tool": "issue_refund", "args": {"order": order.group() if order else "unknown"}},
            "steps": ["plan"]}


def approval(state: State) -> State:
    call = state["plan"]
    # The first execution stops the run here; after `Command(resume=answer)` it returns the answer.
    decision = interrupt({"question": f"Run {call['tool']}(order={call['args']['order']})?", "plan": call})
    return {"decision": decision, "steps": ["approval"]}


def act(state: State) -> State:
    order = state["plan"]["args"]["order"]
    if state["decision"] == "approve":
        outcome = f"refund issued for order {order}"
    else:
        outcome = f"refund for order {order} declined ({state['decision']})"
    return {"outcome": outcome, "steps": ["act"]}


def build(checkpointer: Any):
    """The compiled graph on any LangGraph checkpointer (the sync or async threadlog saver)."""
    builder = StateGraph(State)
    builder.add_node("plan", plan)
    builder.add_node("approval", approval)
    builder.add_node("act", act)
    builder.add_edge(START, "plan")
    builder.add_edge("plan", "approval")
    builder.add_edge("approval", "act")
    builder.add_edge("act", END)
    return builder.compile(checkpointer=checkpointer)


def start(graph, config: dict, request: str) -> dict:
    paused = graph.invoke({"request": request}, config)
    return {"interrupt": paused["__interrupt__"][0].value}


def resume(graph, config: dict, answer: str) -> dict:
    pending = graph.get_state(config)
    if pending.next != ("approval",):
        raise SystemExit(f"thread {config['configurable']['thread_id']!r} is not waiting for an approval "
                         f"(next: {pending.next})")
    final = graph.invoke(Command(resume=answer), config)
    return {"seen_interrupt": pending.interrupts[0].value, "final": final}


def show(graph, config: dict) -> dict:
    state = graph.get_state(config)
    return {"next": list(state.next), "values": state.values,
            "interrupts": [i.value for i in state.interrupts]}


def main(argv: list[str] | None = None) -> int:
    from threadlog.integrations.langgraph import ThreadLogSaver

    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--bootstrap", default=os.environ.get("THREADLOG_BOOTSTRAP", "127.0.0.1:9092"))
    parser.add_argument("--namespace", default="approval-example")
    parser.add_argument("--state-dir", default=None,
                        help="this host's RocksDB state (default: under $THREADLOG_STATE_DIR or ~/.local/state)")
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("start", help="run the agent until it asks for approval")
    p.add_argument("--thread", required=True)
    p.add_argument("request")
    p = commands.add_parser("resume", help="answer the pending approval and finish the run")
    p.add_argument("--thread", required=True)
    p.add_argument("answer", help="approve, or anything else to decline")
    p = commands.add_parser("show", help="where the thread stands")
    p.add_argument("--thread", required=True)
    args = parser.parse_args(argv)

    config = {"configurable": {"thread_id": args.thread}}
    with ThreadLogSaver(args.bootstrap, args.namespace, state_dir=args.state_dir, timeout=60) as saver:
        graph = build(saver)
        if args.command == "start":
            out = start(graph, config, args.request)
        elif args.command == "resume":
            out = resume(graph, config, args.answer)
        else:
            out = show(graph, config)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ThreadLogError as exc:
        # An operational error (broker down, unknown namespace, a refused call):
        # its code and message are the whole story, not a traceback.
        sys.exit(f"approval_agent.py: {exc.code}: {exc.message}")
    except KeyboardInterrupt:
        sys.exit(130)
