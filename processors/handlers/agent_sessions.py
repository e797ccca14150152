"""OpenAI Agents SDK session commands (threadlog.integrations.openai_agents), decided on the session's partition.

Every command names one session and is keyed `agents:<session id>`
(`partition_key`); a handler reads only that session's keys
(projections/folds/agent_sessions.py). Each command is one atomic step:
`add_items` appends all its items or none, `pop_item` removes the newest item
and answers it as the verdict's result -- decided in offset order, so two
concurrent pops never answer the same item -- and `clear_session` removes all.
"""

from __future__ import annotations

import json

from threadlog.projections.folds import agent_sessions as state

from threadlog.kernel.errors import invalid_argument
from threadlog.kernel.validation import is_text, loads_json_value, require_id, require_json_depth

from . import Context, Decision, handles

PREFIX = "agents:"


def partition_key(session_id: str) -> str:
    """The proposal key of a session: its own key space, apart from threadlog thread ids."""
    return PREFIX + session_id


def _session(ctx: Context, cmd: dict) -> str:
    session = require_id(cmd["sessionId"], "session_id")
    # A session is decided on the partition its key maps to, or two judges
    # could change one session concurrently.
    if ctx.key != partition_key(session):
        raise invalid_argument(f"a command for session {session!r} must be keyed {partition_key(session)!r}, "
                               f"not {ctx.key!r}")
    return session


@handles("threadlog.cmd.AgentSessionAddItems", rules=4, thread_keyed=False)
def add_items(ctx: Context, cmd: dict) -> Decision:
    session = _session(ctx, cmd)
    items = cmd["items"]
    if not items:
        return Decision()  # the SDK's sessions treat an empty add as a no-op
    for i, text in enumerate(items):
        # The client sends canonical JSON; a forged proposal must not store
        # text that every later get_items would fail to parse.
        if not is_text(text):
            raise invalid_argument(f"items[{i}] is not well-formed Unicode text")
        try:
            if ctx.rules >= 4:
                loads_json_value(text, f"items[{i}]", finite=True)  # JSON values only: no NaN, no 1e400
            else:
                _loads_rules_3(text, f"items[{i}]")
        except ValueError as exc:
            raise invalid_argument(str(exc)) from None
    m = state.read_meta(ctx.view, session)
    return Decision(events=[("threadlog.evt.AgentSessionItemsAdded",
                             {"sessionId": session, "first": m["next"], "items": list(items)})],
                    result=len(items))


@handles("threadlog.cmd.AgentSessionPopItem", thread_keyed=False)
def pop_item(ctx: Context, cmd: dict) -> Decision:
    session = _session(ctx, cmd)
    m = state.read_meta(ctx.view, session)
    if m["next"] <= m["first"]:
        return Decision()  # empty: result None, nothing written
    position = m["next"] - 1
    raw = ctx.view.get(state.item_key(session, position))
    if raw is None:  # pragma: no cover - positions [first, next) are always stored
        raise invalid_argument(f"session {session!r} has no item at position {position}")
    # The verdict carries the item's JSON text: the caller parses it, so it
    # round-trips exactly like get_items.
    return Decision(events=[("threadlog.evt.AgentSessionItemPopped", {"sessionId": session, "position": position})],
                    result={"item": raw.decode("utf-8")})


@handles("threadlog.cmd.AgentSessionClear", thread_keyed=False)
def clear(ctx: Context, cmd: dict) -> Decision:
    session = _session(ctx, cmd)
    m = state.read_meta(ctx.view, session)
    if m["next"] <= m["first"]:
        return Decision()  # already empty: nothing to write
    return Decision(events=[("threadlog.evt.AgentSessionCleared", {"sessionId": session})])


def _loads_rules_3(text: str, label: str) -> None:
    """What rules 3 accepted as an item: any text `json.loads` parses (NaN too),
    within the nesting bound every rule parses with (for determinism)."""
    require_json_depth(text, label)
    try:
        json.loads(text)
    except ValueError:
        raise ValueError(f"{label} is not JSON text") from None
