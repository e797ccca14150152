"""Transcripts: `save_thread` replaces the whole transcript of a thread."""

from __future__ import annotations

from . import Context, Decision, handles


@handles("threadlog.cmd.SaveTranscript")
def save_transcript(ctx: Context, cmd: dict) -> Decision:
    # Validated by the client; the decider re-checks only what could be forged.
    return Decision(events=[("threadlog.evt.TranscriptSaved", {"threadId": cmd["threadId"],
                                                              "messages": cmd["messages"]})])
