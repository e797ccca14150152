"""Discovery of query workers: the compacted topic `<ns>.members`.

Why a topic and not a registry service or a consumer group: the cluster is
the one thing every host already reaches, and a compacted topic is a tiny
key-value table with history -- key = worker id, value = JSON
`{address, startedAt, heartbeatAt, partitions, leaseDurationMs, renewAfterMs}`,
the latest record per key wins and a
tombstone (clean exit) removes it. Consumer-group membership would tell who
is alive but carries no address; a registry would be one more thing to run.

A worker re-announces itself every `HEARTBEAT_S` (and at once when its
partitions change); a client follows the topic (`MembersView`: one
partition, a few records after compaction) and trusts entries whose
heartbeat is younger than `LIVE_AFTER_S` (3 intervals). A killed worker
leaves a stale entry (tombstoned by a live worker after `FORGET_AFTER_S`),
trusted for at most `LIVE_AFTER_S`; a client that tries it gets
"connection refused" or NOT_OWNER and moves on, so staleness costs a retry,
never a wrong answer (see threadlog/remote.py). Heartbeats are wall-clock times of the worker
compared with the client's clock: hosts' clocks must agree within a few
seconds.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Producer, TopicPartition

from .kernel import kafka_config
from .kernel.checkpoint_rules import MAX_LEASE_MS
from .kernel.errors import unavailable
from .kernel.stuck import Liveness
from .kernel.validation import is_finite, is_int
from .producers.pump import ProducerPump

log = logging.getLogger("threadlog.members")

HEARTBEAT_S = 2.0
LIVE_AFTER_S = 3 * HEARTBEAT_S
# A worker silent this long is gone: a live worker tombstones its entry
# (`Announcer.sweep`, `MembersView.long_dead`). Why: a worker that dies without
# its tombstone (SIGKILL, OOM, a host lost) left its record on the compacted
# topic for good -- read by every process that starts, one more per crash (a
# soak helper). An hour, not LIVE_AFTER_S: a worker cut off from the cluster for
# a while keeps its entry, and one that comes back announces itself again anyway.
# "Silent" is measured by the sweeper's own monotonic clock since it last read a
# record of that worker, never by heartbeat wall-clock times (a review: a
# sweeper whose clock ran an hour ahead would have tombstoned every live worker).
FORGET_AFTER_S = 3600.0
# How often a worker looks for such entries (a dict scan; a tombstone each).
SWEEP_EVERY_S = 60.0


@dataclass(frozen=True)
class Member:
    worker_id: str
    address: str  # "host:port"
    started_at: float  # epoch ms
    heartbeat_at: float  # epoch ms
    # The events partitions it owns and serves; None: every partition (a
    # worker from before ownership, which judged them all).
    partitions: tuple[int, ...] | None = None
    # (lease_duration_ms, renew_after_ms) of the writer leases it grants; None:
    # not announced (a worker from before it), the proposer's own setting then.
    lease: tuple[int, int] | None = None

    def serves(self, partition: int) -> bool:
        return self.partitions is None or partition in self.partitions

    def live(self, now_ms: float, window_s: float = LIVE_AFTER_S) -> bool:
        return now_ms - self.heartbeat_at < window_s * 1000.0


class Announcer:
    """A worker's registration: heartbeats on a thread, a tombstone on `stop`."""

    def __init__(self, bootstrap: str, topic: str, worker_id: str, address: str,
                 interval: float = HEARTBEAT_S, kafka: Mapping[str, Any] | None = None,
                 partitions: Callable[[], list[int]] | None = None,
                 lease: tuple[int, int] | None = None,
                 gone: Callable[[str], list[str]] | None = None) -> None:
        self.topic = topic
        self.gone = gone  # ids of workers long gone, whose entries it tombstones (FORGET_AFTER_S)
        self._swept_at = -SWEEP_EVERY_S  # the first beat sweeps
        self.tombstoned = 0  # entries of workers long gone it removed (operators, tests)
        self.partitions = partitions
        self.lease = lease
        self.worker_id = worker_id
        self.address = address
        self.interval = interval
        self.started_at = time.time() * 1000.0
        # Through a pump that replaces a producer librdkafka left without a leader
        # after a broker restart (producers/pump.py): a worker whose heartbeats
        # stopped reaching the topic looked dead to every client and worker while
        # it judged on. A heartbeat older than LIVE_AFTER_S is worthless, so its
        # records give up after a few of them (librdkafka's default: 5 minutes).
        settings = kafka_config.producer(bootstrap, f"{worker_id}.members", kafka,
                                         **{"linger.ms": 0, "message.timeout.ms": int(5 * LIVE_AFTER_S * 1000)})
        self._pump = ProducerPump(Producer(settings), f"members-pump:{worker_id}", settings)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._started = False
        self._thread = threading.Thread(target=self._run, name="members-heartbeat", daemon=True)

    def start(self, timeout: float = 30.0) -> None:
        # The first announcement is awaited: once `start` returns, clients can find us.
        # Started before it: an ownership change while it flushes is announced too.
        first: list[KafkaError | None] = []
        with self._lock:
            self._started = True
            self._produce_entry(first.append)
        if self._pump.producer.flush(timeout) != 0 or first != [None]:
            with self._lock:
                self._started = False
            why = f": {first[0]}" if first and first[0] is not None else ""
            raise unavailable(f"could not register in {self.topic} within {timeout}s{why}")
        self._thread.start()

    def _produce_entry(self, delivered: Callable[[KafkaError | None], None] | None = None) -> None:
        # Under the lock, ownership read included: the heartbeat thread and an
        # ownership change announce concurrently, and clients route by the last
        # record of the key -- it must hold the newest reading, never an older
        # one produced behind it (and nothing may follow the tombstone).
        record: dict[str, Any] = {"address": self.address, "startedAt": self.started_at,
                                  "heartbeatAt": time.time() * 1000.0}
        if self.partitions is not None:
            record["partitions"] = list(self.partitions())
        if self.lease is not None:
            record["leaseDurationMs"], record["renewAfterMs"] = self.lease
        self._pump.produce(self.topic, json.dumps(record).encode(), self.worker_id.encode(), partition=0,
                           on_delivery=None if delivered is None else lambda err, _msg: delivered(err))

    def _announce(self) -> None:
        with self._lock:
            if self._started:
                self._produce_entry()

    def announce_now(self) -> None:
        """Re-announce at once (ownership changed): clients route by the newest record."""
        try:
            self._announce()
        except Exception:  # pragma: no cover - the next beat repeats it
            log.exception("announcement failed")

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._announce()
                if self.gone is not None and time.monotonic() - self._swept_at >= SWEEP_EVERY_S:
                    self.sweep()
            except Exception:  # pragma: no cover - a full queue: the next beat retries
                log.exception("heartbeat failed")

    def sweep(self) -> list[str]:
        """Tombstone the entries of workers long gone (never this one's own)."""
        assert self.gone is not None
        self._swept_at = time.monotonic()
        ids = self.gone(self.worker_id)  # never its own (MembersView.long_dead)
        with self._lock:
            if not self._started:
                return []  # stopping: nothing may follow this worker's own tombstone either
            for wid in ids:
                self._pump.produce(self.topic, None, wid.encode(), partition=0)
        if ids:
            self.tombstoned += len(ids)
            log.info("removed the %s entries of workers silent for over %.0f s: %s", self.topic, FORGET_AFTER_S,
                     ", ".join(ids))
        return ids

    def stop(self, timeout: float = 5.0) -> None:
        """Leave cleanly: a tombstone, so clients stop picking this worker at once."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        try:
            with self._lock:
                self._started = False
                self._pump.produce(self.topic, None, self.worker_id.encode(), partition=0)
            self._pump.stop(timeout)
        except Exception:  # pragma: no cover - the entry then ages out
            log.exception("could not tombstone %s", self.worker_id)


def parse_member(worker_id: str, v: Any) -> Member:
    """A members record's value (parsed JSON) as a Member; ValueError when it is not one.

    Anyone with Write on the topic can put any bytes there, and the view that
    reads them is every client's routing: a record that is not a worker's
    announcement is refused here, whatever its shape, never raised past this.
    """
    if not isinstance(v, dict):
        raise ValueError(f"a member record is a JSON object, got {type(v).__name__}")
    address, parts = v.get("address"), v.get("partitions")
    if not isinstance(address, str):
        raise ValueError("a member's address is a string")
    started, beat = _epoch_ms(v.get("startedAt")), _epoch_ms(v.get("heartbeatAt"))
    if parts is not None and not (isinstance(parts, list)
                                  and all(type(p) is int and p >= 0 for p in parts)):
        raise ValueError("a member's partitions are a list of partition numbers")
    return Member(worker_id, address, started, beat, None if parts is None else tuple(parts),
                  _lease(v.get("leaseDurationMs"), v.get("renewAfterMs")))


def _lease(duration: Any, renew_after: Any) -> tuple[int, int] | None:
    """The announced lease setting, or None (the proposer's own then) when there is
    none or it is not one this version's `open()` accepts (config.Options). Not a
    reason to drop the member: a later version may allow other settings, and its
    workers must stay reachable by the clients of this one."""
    if duration is None and renew_after is None:
        return None
    if not (is_int(duration) and is_int(renew_after) and 0 < renew_after < duration <= MAX_LEASE_MS):
        log.warning("a member's lease setting (renewAfterMs %s, leaseDurationMs %s) is not 0 < renewAfterMs < "
                    "leaseDurationMs <= %d: ignored, proposers use their own", str(renew_after)[:40],
                    str(duration)[:40], MAX_LEASE_MS)
        return None
    return duration, renew_after


def _epoch_ms(x: Any) -> float:
    if not is_finite(x):  # no bool, no NaN or infinity, no int beyond a double (10**400)
        raise ValueError(f"a member's times are finite numbers, got {str(x)[:40]}")
    return float(x)


class MembersView:
    """The members topic, followed continuously: who is alive and owns what.

    Read to its end at `start`, then tailed on a thread,
    so routing learns of an ownership change a few milliseconds after the
    worker announced it, without a discovery round per call.
    """

    def __init__(self, bootstrap: str, topic: str, client_id: str, kafka: Mapping[str, Any] | None = None) -> None:
        self.topic = topic
        self._members: dict[str, Member] = {}
        self._heard: dict[str, float] = {}  # worker id -> when this view last read a record of it (monotonic)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self.version = 0
        self._stop = threading.Event()
        self._settings = kafka_config.consumer(
            bootstrap, f"{client_id}.members", kafka,
            **{"enable.partition.eof": True, "isolation.level": "read_uncommitted", "fetch.wait.max.ms": 50},
        )
        self._consumer = Consumer(self._settings)
        self._caught_up = threading.Event()
        self._target = 0
        self._next = 0  # the offset after the last record read
        self._liveness = Liveness()  # when a record or the partition's end was last read
        self._thread = threading.Thread(target=self._run, name="members-view", daemon=True)

    def start(self, timeout: float) -> None:
        # Caught up = past the end offset asked now (waiting for librdkafka's
        # end-of-partition event instead costs a few fetch rounds: ~0.5 s).
        try:
            low, high = self._consumer.get_watermark_offsets(TopicPartition(self.topic, 0), timeout=timeout)
        except Exception as exc:  # the thread keeps reading; calls wait for workers until their deadline
            log.warning("end of %s unknown: %s", self.topic, exc)
            low = high = 0
        self._target = high
        if high <= low:
            self._caught_up.set()
        self._consumer.assign([TopicPartition(self.topic, 0, OFFSET_BEGINNING)])
        self._thread.start()
        if not self._caught_up.wait(timeout):
            log.warning("%s not read to its end within %ss", self.topic, timeout)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        try:
            self._consumer.close()
        except Exception:  # pragma: no cover
            pass

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                msgs = kafka_config.drain(self._consumer, 500, 0.2)
            except Exception:  # pragma: no cover
                log.exception("members view poll failed")
                time.sleep(0.2)
                continue
            changed = False
            reached = False
            self._liveness.saw(msgs, full=len(msgs) >= 500)
            for msg in msgs:
                err = msg.error()
                if err is not None:
                    reached = reached or err.code() == KafkaError._PARTITION_EOF
                    continue
                self._next = msg.offset() + 1
                reached = reached or msg.offset() + 1 >= self._target
                wid = (msg.key() or b"").decode(errors="replace")
                value = msg.value()
                with self._lock:
                    if value is None:
                        self._members.pop(wid, None)
                        self._heard.pop(wid, None)
                    else:
                        try:
                            self._members[wid] = received(parse_member(wid, json.loads(value)), time.time() * 1000.0)
                        except (ValueError, RecursionError):  # not JSON, too deep, or not an announcement
                            log.warning("malformed member record for %r ignored", wid)
                            continue
                        self._heard[wid] = time.monotonic()
                changed = True
            if changed:
                with self._changed:
                    self.version += 1
                    self._changed.notify_all()
            if reached:
                self._caught_up.set()
            # A consumer that stopped reading is replaced (threadlog/kernel/stuck.py). Tried
            # (a fault probe: two workers, a 12 s broker outage, 2 runs of 11): one worker's
            # view never read a record again after the broker came back; it saw no live
            # worker, so every question its judge asked the other owner failed, and its
            # partitions stopped for good.
            self._consumer = self._liveness.check(self._consumer, self.topic, (0,), {0: self._next}, self._settings,
                                                  lambda: [TopicPartition(self.topic, 0, self._next)])

    @property
    def restarts(self) -> int:
        """Consumers replaced because they stopped reading (operators, tests)."""
        return self._liveness.restarts

    def live(self) -> list[Member]:
        with self._lock:
            return live_members(self._members)

    def long_dead(self, own: str) -> list[str]:
        """Ids of the workers this view has read nothing of for FORGET_AFTER_S,
        asked by worker `own` -- none unless this view read `own`'s own heartbeat
        within LIVE_AFTER_S: a view not reading the topic (stuck, or behind) would
        take every worker for gone."""
        now = time.monotonic()
        with self._lock:
            if now - self._heard.get(own, -float("inf")) > LIVE_AFTER_S:
                return []
            return sorted(wid for wid in self._members
                          if wid != own and now - self._heard.get(wid, now) >= FORGET_AFTER_S)

    def wait_change(self, version: int, timeout: float) -> int:
        """Block until a record newer than `version` arrived (or the timeout); the new version."""
        with self._changed:
            self._changed.wait_for(lambda: self.version != version, timeout)
            return self.version


def received(member: Member, now_ms: float) -> Member:
    """`member` as a reader takes it at `now_ms`: its heartbeat no later than now.

    Why: a heartbeat is the worker's wall clock. One running ahead of this host's
    announced the future: once dead it stayed live (and, sorted newest first,
    preferred) until this clock caught up with its last heartbeat, however far
    ahead. Received now, it was sent no later than now, so it expires
    LIVE_AFTER_S after the last one received. (A clock behind still makes a
    worker look stale: hosts' clocks must agree, see the module doc.)
    """
    if member.heartbeat_at <= now_ms:
        return member
    return dataclasses.replace(member, heartbeat_at=now_ms)


def live_members(members: dict[str, Member], now_ms: float | None = None) -> list[Member]:
    now_ms = time.time() * 1000.0 if now_ms is None else now_ms
    return [m for m in members.values() if m.live(now_ms)]
