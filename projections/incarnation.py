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
import time
from pathlib import Path

from confluent_kafka import KafkaError, KafkaException, TopicCollection
from confluent_kafka.admin import AdminClient

log = logging.getLogger("threadlog.state")

MARKER = "topics.json"


def topic_ids(admin: AdminClient, names: list[str], timeout: float) -> dict[str, str] | None:
    """name -> Kafka topic id (base64 text); None when they cannot be read (the
    check is then skipped, with a warning: it guards a rare mistake, and must not
    keep a host from opening -- e.g. on a broker without DescribeTopics)."""
    deadline = time.monotonic() + timeout
    while True:
        left = max(0.5, deadline - time.monotonic())
        try:
            futures = admin.describe_topics(TopicCollection(names), request_timeout=left)
            return {name: str(fut.result(timeout=left).topic_id) for name, fut in futures.items()}
        except Exception as exc:
            # Only a namespace just created (not in every broker's metadata yet) is
            # worth waiting for; anything else (a broker without DescribeTopics)
            # would cost every open the whole wait.
            if not _unknown_topic(exc) or time.monotonic() + 0.2 >= deadline:
                log.warning("could not read the ids of topics %s (%s): the state directory is not checked "
                            "against a namespace deleted and created again", names, exc)
                return None
            time.sleep(0.2)


def _unknown_topic(exc: Exception) -> bool:
    err = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
    return isinstance(err, KafkaError) and err.code() == KafkaError.UNKNOWN_TOPIC_OR_PART


def settle(slot: Path, ids: dict[str, str]) -> None:
    """Make `slot` hold state of these topic ids only: empty it if its marker names
    others, then record `ids`. Call before opening any of its stores."""
    marker = slot / MARKER
    try:
        recorded = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        recorded = None  # a new slot, or one from before markers: taken as it is
    if isinstance(recorded, dict) and recorded != ids:
        # Emptied before the marker names the new ids: a crash in between leaves
        # the old marker, so the next start empties the rest.
        log.warning("state in %s was folded from other topics of this namespace (deleted and created again): "
                    "emptied, to be folded again", slot)
        for entry in slot.iterdir():
            if entry.name != MARKER:
                # Errors raise: the marker must not name the new ids over old state.
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink(missing_ok=True)
    if recorded != ids:
        slot.mkdir(parents=True, exist_ok=True)
        tmp = slot / (MARKER + ".tmp")
        tmp.write_text(json.dumps(ids, sort_keys=True), encoding="utf-8")
        os.replace(tmp, marker)
