"""Transcripts: the latest saved transcript of each thread."""

from __future__ import annotations

from ..fold import EventMeta, folds
from ..keys import key
from ..view import View
from . import presence

TRANSCRIPT = b"tx"


def transcript_key(thread_id: str) -> bytes:
    return key(TRANSCRIPT, thread_id)


@folds("threadlog.evt.TranscriptSaved")
def transcript_saved(view: View, meta: EventMeta, ev: dict) -> None:
    # Stored as the JSON text it arrived as: it round-trips exactly.
    view.put(transcript_key(ev["threadId"]), ev["messages"].encode("utf-8"))
    presence.mark(view, ev["threadId"], presence.TRANSCRIPT)
