"""Generation runs: records on their thread's partition, plus the index every host folds.

- `genR` (thread, run) -> the generation run record (JSON, what `get` returns);
- `genI` (run) -> thread, for calls naming only a run id.

Generation run ids are their own id space: a chat run and a generation run
may share an id.
"""

from __future__ import annotations

import json

from threadlog.kernel.records import apply_patch

from .. import global_ids
from ..fold import EventMeta, folds
from ..keys import key
from ..view import View
from . import presence

GENERATION_RECORD = b"genR"
GENERATION_INDEX = b"genI"

FIELDS = ("runId", "threadId", "activity", "provider", "model", "status", "startedAt")


def record_key(thread_id: str, run_id: str) -> bytes:
    return key(GENERATION_RECORD, thread_id, run_id)


def thread_prefix(thread_id: str) -> bytes:
    return key(GENERATION_RECORD, thread_id)


def index_key(run_id: str) -> bytes:
    return key(GENERATION_INDEX, run_id)


@folds("threadlog.evt.GenerationRunCreated")
def generation_run_created(view: View, meta: EventMeta, ev: dict) -> None:
    k = record_key(ev["threadId"], ev["runId"])
    if view.get(k) is None:
        presence.add(view, ev["threadId"], presence.GENERATION_RUN)
        global_ids.mark(view, meta, global_ids.GENERATION_RUN, ev["runId"], ev["threadId"], True)
    view.put_json(k, {f: ev[f] for f in FIELDS})
    view.put(index_key(ev["runId"]), ev["threadId"].encode("utf-8"))


@folds("threadlog.evt.GenerationRunUpdated")
def generation_run_updated(view: View, meta: EventMeta, ev: dict) -> None:
    k = record_key(ev["threadId"], ev["runId"])
    old = view.get_json(k)
    if old is not None:
        view.put_json(k, apply_patch(old, json.loads(ev["patch"])))
