"""Telling a consumer that stopped fetching from a partition that is quiet.

Why: an assigned librdkafka consumer sometimes never fetches again after a
broker restart -- its poll returns nothing, for good, and nothing it reports
says so (librdkafka #5153 and rust-rdkafka #597, both open; restarting the
consumer is the known remedy). Seen here by a fault probe (two workers, a
12 s broker outage, 2 runs of 11): one worker's view of `<ns>.members` read
nothing for minutes while the other's read every heartbeat.

From poll alone a stuck consumer and a quiet partition look the same; the
partition's end tells them apart. So every long-lived consumer that tails
partitions (the members view, the delivery run index, a thin client's
delivery tail) notes when it last heard of each partition -- a record or its
end (an error is no sign of life: a consumer that only reports errors is
stuck too) -- and when one was silent for `after_s`, asks its end: beyond the
consumer's position, or not answered, at two checks `confirm_s` apart with
nothing read in between, the consumer is replaced by a new one that reads on
from that position. A replacement costs a connection; a
consumer left stuck stops whatever depends on it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from confluent_kafka import Consumer, KafkaError, TopicPartition

from .kafka_config import Consumed

log = logging.getLogger("threadlog.stuck")

STUCK_S = 12.0  # a partition's silence before its end is asked
# A partition found behind its end is asked again this much later, and the
# consumer replaced only if nothing of it was read in between: a record that
# landed just before a check on a partition quiet until then is no sign of a
# stuck consumer (it is fetched a few milliseconds later).
CONFIRM_S = 1.0
# How long one question about a partition's end may take. The consumer's own
# thread asks (and does not poll meanwhile), and a check stops at the first
# partition that is behind or unanswered, so a cluster that does not answer
# holds a tailing thread at most this long per check.
ASK_S = 2.0
# A gap this long between two polls means the thread was not polling (busy, or
# the process was stopped: SIGSTOP, a VM paused): silence meanwhile says nothing
# of the consumer. Seen by a fault probe: a worker resumed after a 12 s SIGSTOP
# found every partition silent and behind, replaced its judge's consumer, and
# the extra group rejoin delayed recovery by ~30 s.
PAUSE_S = 2.0


class Liveness:
    """When each partition was last heard of; whether the consumer is stuck."""

    def __init__(self, after_s: float | None = None, confirm_s: float | None = None,
                 pause_s: float | None = None) -> None:
        # Read when made, not bound as defaults: tests scale them down.
        self.after_s = STUCK_S if after_s is None else after_s
        self.confirm_s = CONFIRM_S if confirm_s is None else confirm_s
        self.pause_s = PAUSE_S if pause_s is None else pause_s
        self._heard: dict[int, float] = {}
        self._since = self._checked = self._polled = time.monotonic()  # partitions never heard count from here
        self._behind: dict[int, float] = {}  # partition -> when it was first found behind its end, unread since
        self.restarts = 0  # consumers replaced (operators, tests)
        self.suspect: int | None = None  # the partition the last "stuck" verdict was about

    def saw(self, msgs: list[Consumed], full: bool = False) -> None:
        """Note the records and end-of-partition events of a batch. `full`: the
        batch took all it could (more may be queued locally).

        Why `full` counts as life for every partition: librdkafka queues fetched
        records in one queue, in arrival order, so while a backlog is folded a
        quiet partition's record waits behind it -- fetched, not yet read (a
        review: a delivery index catching up on 200 000 records had its healthy
        consumer replaced every 13 s). Only a batch that emptied the queue
        shows that what was not read was not fetched. Call it after every poll,
        with what it returned (nothing too): a poll long after the last one
        (`pause_s`) counts as life for every partition, as `full` does."""
        now = time.monotonic()
        paused, self._polled = now - self._polled > self.pause_s, now
        if full or paused:
            self._forget(now)
            return
        for msg in msgs:
            err = msg.error()
            if err is None or err.code() == KafkaError._PARTITION_EOF:
                p = msg.partition()
                self._heard[p] = now
                self._behind.pop(p, None)

    def check(self, consumer: Consumer, topic: str, partitions: Iterable[int], positions: Mapping[int, int],
              settings: Mapping[str, Any], assignment: Callable[[], list[TopicPartition]]) -> Consumer:
        """`consumer`, or, when it is stuck (`stuck`), a new consumer of `settings`
        reading `assignment()` in its place (the old one closed; a warning says
        why). Call it after every poll, on the consumer's own thread; it never
        raises: the tailing thread must not die of it."""
        try:
            why = self.stuck(consumer, topic, partitions, positions)
            if why is None:
                return consumer
            log.warning("%s: %s: replacing its consumer", topic, why)
            new = Consumer(dict(settings))
            try:
                consumer.close()
            except Exception:  # pragma: no cover - it is being replaced
                pass
            new.assign(assignment())
        except Exception:  # pragma: no cover - a tailing thread never dies of it
            log.exception("%s: checking or replacing its consumer failed", topic)
            return consumer
        self.replaced()
        return new

    def replaced(self) -> None:
        """A new consumer took the stuck one's place: counted, and silence counts from now."""
        self.restart()
        self.restarts += 1

    def fresh(self, partitions: Iterable[int]) -> None:
        """`partitions` were (re)assigned just now: their silence counts from now."""
        now = time.monotonic()
        for p in partitions:
            self._heard[p] = now
            self._behind.pop(p, None)

    def restart(self) -> None:
        """A consumer was (re)assigned: every partition's silence counts from now."""
        self._forget(time.monotonic())
        self._checked = self._since

    def _forget(self, now: float) -> None:
        self._heard.clear()
        self._behind.clear()
        self._since = now

    def due(self) -> bool:
        """Whether `stuck` may ask anything now: cheap, for every poll (a caller
        can skip working out which partitions to pass)."""
        now = time.monotonic()
        if now - self._checked >= self.after_s:
            return True
        return bool(self._behind) and now - min(self._behind.values()) >= self.confirm_s

    def stuck(self, consumer: Consumer, topic: str, partitions: Iterable[int], positions: Mapping[int, int],
              timeout: float = ASK_S) -> str | None:
        """Why `consumer`, reading `partitions` of `topic` at `positions`
        (partition -> next offset), must be replaced, or None. Cheap unless a
        check is due: at most one per `after_s`, and one `confirm_s` after a
        partition was found behind.

        Call it on the consumer's own thread: librdkafka serialises calls on one
        handle, and a watermark query from another thread waits behind its poll.
        """
        if not self.due():
            return None  # every poll: nothing to do
        now = time.monotonic()
        owned = set(partitions)
        for p in [p for p in self._behind if p not in owned]:
            del self._behind[p]
        confirming = bool(self._behind) and now - min(self._behind.values()) >= self.confirm_s
        if not confirming and now - self._checked < self.after_s:
            return None
        self._checked = now
        due = [p for p in sorted(owned) if now - self._heard.get(p, self._since) >= self.after_s]
        for p in due:
            try:
                _, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout)
            except Exception as exc:
                # The cluster is down, or this handle's view of it is stale (after a
                # broker restart a handle's cached leader epoch can fail its requests
                # until a metadata refresh, minutes later): a new one costs little.
                why = f"the end of {topic}[{p}] was not answered ({exc})"
            else:
                if high <= positions[p]:
                    self._behind.pop(p, None)
                    continue  # quiet, not stuck
                why = f"{topic}[{p}] ends at {high} and this consumer is at {positions[p]}"
            finally:
                # This thread's own questions are no pause of its polling (`saw`).
                self._polled = time.monotonic()
            first = self._behind.setdefault(p, now)
            if now - first >= self.confirm_s:
                self.suspect = p
                return f"nothing read for {now - self._heard.get(p, self._since):.0f} s and {why}"
            # One suspect is enough for this round: each question may block this
            # thread (its poll too) up to `timeout` on a cluster that does not answer.
            return None
        return None
