"""Transcripts: `save_thread` replaces the whole transcript of a thread."""

from __future__ import annotations

from threadlog.kernel.errors import invalid_argument
from threadlog.kernel.validation import loads_json_value, require_id

from . import Context, Decision, handles
from .global_ids import own_thread


@handles("threadlog.cmd.SaveTranscript", rules=4)
def save_transcript(ctx: Context, cmd: dict) -> Decision:
    # The client validates the same (stores/messages.py); the judge checks it
    # again because anyone who may write the topic may propose: a transcript
    # that is not a JSON list would make every later load_thread fail.
    thread = own_thread(ctx, require_id(cmd["threadId"], "thread_id"))
    text = cmd["messages"]
    try:
        # rules 4: no number beyond a double (json.loads makes 1e400 an inf that
        # every later load_thread would fail to encode); rules 3 took it.
        messages = loads_json_value(text, "messages", finite=ctx.rules >= 4)
    except ValueError as exc:
        raise invalid_argument(str(exc)) from None
    if not isinstance(messages, list):
        raise invalid_argument(f"messages must be a JSON list, got {type(messages).__name__}")
    return Decision(events=[("threadlog.evt.TranscriptSaved", {"threadId": thread, "messages": text})])
