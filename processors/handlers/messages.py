"""Transcripts: `save_thread` replaces the whole transcript of a thread."""

from __future__ import annotations

import json

from threadlog.kernel.errors import invalid_argument
from threadlog.kernel.validation import json_problem, require_id

from . import Context, Decision, handles
from .global_ids import own_thread


@handles("threadlog.cmd.SaveTranscript")
def save_transcript(ctx: Context, cmd: dict) -> Decision:
    # The client validates the same (stores/messages.py); the judge checks it
    # again because anyone who may write the topic may propose: a transcript
    # that is not a JSON list would make every later load_thread fail.
    thread = own_thread(ctx, require_id(cmd["threadId"], "thread_id"))
    text = cmd["messages"]
    try:
        messages = json.loads(text)
    except ValueError as exc:
        raise invalid_argument(f"messages is not JSON text: {exc}") from None
    if not isinstance(messages, list):
        raise invalid_argument(f"messages must be a JSON list, got {type(messages).__name__}")
    problem = json_problem(messages, "messages")
    if problem:
        raise invalid_argument(problem)
    return Decision(events=[("threadlog.evt.TranscriptSaved", {"threadId": thread, "messages": text})])
