"""Which incarnation of a namespace's topics a local store was folded from.

A store keeps positions (offsets) of `<ns>.events` and `<ns>.deliveries`. If
the namespace is deleted and created again under the same name (`threadlog
namespaces delete`, a demo run twice, a test cluster reset) while a host's
state directory stays, those positions point into a log that no longer
exists: the new log starts at 0 again, so the store served the old state and
its judge skipped the new log's first records -- other verdicts than every
other judge's, for good. Kafka gives every topic an id that a new topic of
the same name does not share, so the slot records the ids it was folded from
(`topics.json`) and a slot of another incarnation is emptied before any of
its stores opens. Derived state only: it is folded again, or restored from a
snapshot (of the new topics).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from confluent_kafka import KafkaException, TopicCollection
from confluent_kafka.admin import AdminClient

from threadlog.kernel.errors import unavailable

log = logging.getLogger("threadlog.state")

MARKER = "topics.json"


def topic_ids(admin: AdminClient, names: list[str], timeout: float) -> dict[str, str]:
    """name -> Kafka topic id (base64 text)."""
    try:
        futures = admin.describe_topics(TopicCollection(names), request_timeout=timeout)
        return {name: str(fut.result(timeout=timeout).topic_id) for name, fut in futures.items()}
    except KafkaException as exc:
        raise unavailable(f"could not describe topics {names}: {exc}") from None


def settle(slot: Path, ids: dict[str, str]) -> bool:
    """Make `slot` hold state of these topic ids only: empty it if its marker names
    others, then record `ids`. True if it was emptied. Call before opening its stores."""
    marker = slot / MARKER
    try:
        recorded = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        recorded = None  # a new slot, or one from before markers: taken as it is
    emptied = False
    if isinstance(recorded, dict) and recorded != ids:
        log.warning("state in %s was folded from other topics of this namespace (deleted and created again): "
                    "emptied, to be folded again", slot)
        for entry in slot.iterdir():
            if entry.name != MARKER:
                shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
        emptied = True
    if recorded != ids:
        slot.mkdir(parents=True, exist_ok=True)
        tmp = slot / (MARKER + ".tmp")
        tmp.write_text(json.dumps(ids, sort_keys=True), encoding="utf-8")
        os.replace(tmp, marker)
    return emptied
