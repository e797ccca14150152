"""Metadata: one JSON value per (namespace, key).

The commands' partition key is a synthetic string (`partition_key`): if it
happens to equal a thread id, the two only share a partition and a per-key
seq counter, which is harmless. The STATE key is exact: `key(tag, namespace,
key)` never lets ("a:b", "c") and ("a", "b:c") meet.
"""

from __future__ import annotations

import json

from ..fold import EventMeta, folds
from ..keys import key
from ..view import View

METADATA_VALUE = b"metV"


def partition_key(namespace: str, name: str) -> str:
    # Unambiguous (a JSON array), though only the state key needs to be.
    return "metadata/" + json.dumps([namespace, name], ensure_ascii=False)


def value_key(namespace: str, name: str) -> bytes:
    return key(METADATA_VALUE, namespace, name)


@folds("threadlog.evt.MetadataSet")
def metadata_set(view: View, meta: EventMeta, ev: dict) -> None:
    view.put(value_key(ev["namespace"], ev["key"]), ev["value"].encode("utf-8"))


@folds("threadlog.evt.MetadataDeleted")
def metadata_deleted(view: View, meta: EventMeta, ev: dict) -> None:
    view.delete(value_key(ev["namespace"], ev["key"]))
