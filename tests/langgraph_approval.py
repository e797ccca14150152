"""A small LangGraph graph with a human approval step, shared by the e2e test and its second process.

Run as a script, it is the second host: it opens its own threadlog client
(sync `ThreadLogSaver`, its own state dir), resumes the interrupted thread
with `Command(resume=...)` and prints the final state as one JSON line.

    python tests/langgraph_approval.py BOOTSTRAP NAMESPACE STATE_DIR THREAD_ID ANSWER
"""

from __future__ import annotations

import json
import operator
import sys
from typing import Annotated, TypedDict

from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, interrupt


class State(TypedDict, total=False):
    request: str
    drafts: Annotated[int, operator.add]  # counts runs of `draft`: a resume must not redo it
    answer: str
    result: str


def draft(state: State) -> State:
    return {"request": state["request"].upper(), "drafts": 1}


def review(state: State) -> State:
    # Pauses the run on first execution; on resume returns the human's answer.
    answer = interrupt({"question": f"approve {state['request']}?"})
    return {"answer": answer}


def finish(state: State) -> State:
    verdict = "approved" if state["answer"] == "yes" else "rejected"
    return {"result": f"{state['request']} {verdict}"}


def build(checkpointer):
    builder = StateGraph(State)
    builder.add_node("draft", draft)
    builder.add_node("review", review)
    builder.add_node("finish", finish)
    builder.add_edge(START, "draft")
    builder.add_edge("draft", "review")
    builder.add_edge("review", "finish")
    builder.add_edge("finish", END)
    return builder.compile(checkpointer=checkpointer)


def main(argv: list[str]) -> int:
    from threadlog.integrations.langgraph import ThreadLogSaver

    bootstrap, namespace, state_dir, thread_id, answer = argv
    config = {"configurable": {"thread_id": thread_id}}
    with ThreadLogSaver(bootstrap, namespace, state_dir=state_dir, timeout=60) as saver:
        graph = build(saver)
        pending = graph.get_state(config)
        # This host never ran the graph: what it resumes it read from threadlog.
        assert pending.next == ("review",), pending.next
        final = graph.invoke(Command(resume=answer), config)
        print(json.dumps({"seen_interrupt": pending.interrupts[0].value, "final": final}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
