"""The judge: the log is the arbiter.

Every record of `<ns>.events` is a *proposal* (`threadlog.Proposal`), produced
straight to its key's partition by whoever wants the change -- no command hop,
no Kafka transaction. Kafka's partition order is the total order. The judge
folds a partition in offset order and decides each proposal against the state
of everything before it, with the rules in `processors/handlers/`:

- accepted: its effects are folded into state (`projections/folds/`);
- refused: nothing changes; the verdict (code, message) is kept for whoever asks.

Verdicts are a pure function of the log prefix: no judge reads a clock (time
is the proposal's, made monotonic per partition and bounded by the broker's
LogAppendTime), draws randomness (the proposer does) or looks at another
partition except as of fixed positions the proposal names (`seen`, see
projections/global_ids.py). So two judges of the same partition -- two hosts,
a zombie, a rebuild from offset 0 -- reach identical verdicts, and a zombie
judge is harmless: it computes what everybody computes.

State, verdicts and the position they reflect reach RocksDB in one write batch
(`Store.apply`), so a crash never leaves them apart; a restarted judge resumes
at its stored position. A record that cannot be decoded is judged refused
(`INVALID_MESSAGE`); the judge never stops on input.
"""

from __future__ import annotations

import json
import logging
import math
import struct
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import islice
from typing import TYPE_CHECKING, Any

from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, Consumer, TopicPartition
from threadlog.projections.fold import EventMeta, apply_event, current_seq
from threadlog.projections.follower import Follower
from threadlog.projections.global_ids import CHECKPOINT
from threadlog.projections.global_ids import holders_as_of as index_holders
from threadlog.projections.keys import key
from threadlog.projections.partition_stores import PartitionStores
from threadlog.projections.reader import StateReader
from threadlog.projections.snapshots import summary
from threadlog.projections.view import View
from threadlog.schemas import Codec, CodecError
from threadlog.schemas.codec import MARKER

from threadlog.kernel import kafka_config, stuck
from threadlog.kernel.errors import (
    INVALID_ARGUMENT,
    INVALID_MESSAGE,
    NOT_OWNER,
    OUTCOME_UNKNOWN,
    ThreadLogError,
)
from threadlog.kernel.kafka_config import Consumed, Props
from threadlog.kernel.partitioning import partition_for
from threadlog.kernel.topics import reply_of
from threadlog.kernel.validation import dumps, judging_problem

from .ahead import Ahead
from .handlers import GLOBAL_READS, HANDLERS, Context, Decision, newer_schemas, reads_other_partitions
from .restores import RESUME_GAP, RETRY_S, Peek, Restorer, Restores, reason
from .verdict_push import VerdictPush

if TYPE_CHECKING:
    from .lookups import Lookups, Question

log = logging.getLogger("threadlog.judge")

# (partition q, id kind, id, offset of q) -> threads holding the id there, or None: not known yet.
Others = Callable[[int, str, str, int], "list[str] | None"]

# The judging rules this code implements (Proposal.rules). A proposal naming a
# newer version is not guessed at: its partition stops until judges are upgraded.
# 3: run heartbeats (threadlog.cmd.HeartbeatRun; claims set heartbeatAt) and blob
#    garbage collection (processors/handlers/blob_gc.py).
# 4: a claim leaves heartbeatAt alone and is refused on a finished run; LangGraph's
#    keep_latest keeps writes of a checkpoint newer than the latest (its put may
#    be on its way); agent-session items are JSON values (no NaN); transcripts and
#    metadata values hold no number JSON cannot write back (1e400); an artifact's
#    blob is a reference blob garbage collection keeps. And rules never go back on
#    a partition: from its first proposal of rules 4 on, every proposal there is
#    judged by at least those (`read_clock`).
# 5: an artifact saved with another thread than the one it lives on moves there
#    (threadlog.cmd.SaveArtifact, then ReleaseArtifactCopy on each other thread);
#    a blob-GC fence's lowering names positions and marks only collects before them.
# 6: a run claim removes the run's heartbeatAt (processors/handlers/runs.py `claim`).
# 7: the rules floor marker a namespace's creator writes to each events partition
#    (threadlog.cmd.RaiseRulesFloor, processors/handlers/rules_floor.py).
# 8: an artifact copy's removal (ReleaseArtifactCopy v2, `before`) names the position
#    its save saw and spares a copy saved at or after it (processors/handlers/artifacts.py).
#    Every artifact save names rules 8, so a judge of rules 7 stops on any save of
#    a client of this version.
# 9: a keep_latest LangGraphPrune (v2, `calls`) removes whole the namespaces of the
#    finished subgraph calls its proposer names (processors/handlers/langgraph.py).
# 10: a LangGraph copy too large for one command is staged and committed by a
#    LangGraphCopyStaged (processors/handlers/langgraph.py `copy_staged`). And a
#    thread holding a blob a GC sweep has fenced may go on naming it
#    (processors/handlers/blob_gc.py `require_unfenced`), on a partition judging by
#    rules 10: its floor (the marker of a namespace created by a client of this
#    version) or any proposal naming 10 judged there before (rules never go back).
#    Of a client's proposals only those two name 10; the rest name what they did.
# 11: a keep_latest LangGraphPrune (v3, `keep`) also keeps the checkpoints its
#    proposer names: the ancestors a DeltaChannel's value is rebuilt from
#    (processors/handlers/langgraph.py `_kept`). Every prune names 11.
RULES = 11
# The first rules that raise a partition's floor. Logs written before it were
# judged by the rules each proposal named: a floor from older versions would
# make their rebuild reach other verdicts than their clients were told.
FLOOR_FROM = 4

# How far a proposal's own time may run ahead of the broker's clock (its
# LogAppendTime). Time only ever moves forward per partition, so a proposer
# with a clock far ahead could otherwise expire every lease of its partition;
# this bounds what a wrong (or forged) clock can do. Injected test clocks that
# jump ahead a few lease lengths stay well inside it.
MAX_LEAD_MS = 15 * 60 * 1000

VERDICT = b"jv"  # (partition 4B, offset 8B) -> JSON verdict
APPLIED = b"jp"  # (proposal id) -> JSON {"p", "o"}: where an accepted proposal was judged
APPLIED_AT = b"ja"  # (partition 4B, offset 8B) -> the proposal id applied there (to forget it)

# Verdicts, and the ids that make re-sent proposals idempotent, are kept for
# the last VERDICT_WINDOW offsets of each partition, then forgotten as the
# judge moves on. Why: a verdict per record would make a partition's state --
# what a new owner restores -- grow with its history instead of its threads.
# Who needs them is recent: a proposer awaiting its verdict (seconds), a
# re-send after an unknown outcome (within a request timeout). Forgetting is
# part of judging (at offset o, the verdict of o - VERDICT_WINDOW goes), so
# every judge and every rebuild forget alike.
VERDICT_WINDOW = 50_000
CLOCK = b"jc"  # (partition 4B) -> decision time of its last proposal (8B double) + rules floor (2B): read_clock

# A partition whose proposal waits for another partition holds at most this
# many fetched records before its fetching is paused.
MAX_PENDING = 20_000
# A waiting partition is looked at again at least this often (decided again
# only once it may move: Judge._may_retry).
RETRY_WAITING_S = 0.005
# At most this many proposals of one partition are judged into one write buffer
# (then applied): a partition released after a long wait holds up to
# MAX_PENDING, and one buffer of all of them would cost seconds to keep sorted.
MAX_BATCH = 2000
# How many proposals queued behind a waiting one have their lookups started ahead.
PREFETCH_AHEAD = 64
# At most this many questions asked on arrival wait for their appends (Judge._ask_early):
# half the lookups' cache (processors/lookups.py MAX_CACHED), so none is evicted first.
MAX_EARLY = 50_000
# At most this many questions are in flight when another is asked on arrival
# (`Lookups.in_flight`); the others wait in `_early` and are asked as judging
# comes near their appends (`_unanswered`, `_ask_early_again`). Why (a probe:
# two workers, one SIGSTOPped 12 s): the worker that came back took over two
# partitions with ~7 000 records to judge again and asked about every fetched
# append at once -- 13 700 questions in 6 800 requests within 2 s. The other
# worker, judging on the same cores, answered them one behind the other, most
# after the 3 s request timeout, and ~3 600 failed together: recovery took
# 17-87 s (17-21 s with this bound). Steady state keeps ~70 in flight.
MAX_EARLY_IN_FLIGHT = 256
# The least time between two replacements of the judge's consumer (`Judge._watch`).
REPLACE_GAP_S = 60.0
# How long the assignment callback waits for a partition's end offset (`Judge._far_behind`).
FAR_BEHIND_ASK_S = 1.0


class _Ends:
    """The end offsets of the partitions one assignment gives, asked at most once
    (one request, FAR_BEHIND_ASK_S at most: the assignment callback blocks the
    judge's thread) and only when a kept local store needs them (`_far_behind`).
    Why one: asked per partition, an outage cost the callback a second for each
    (a review: six kept stores, 6.1 s)."""

    def __init__(self, consumer: Consumer, topic: str, partitions: list[int]) -> None:
        self._consumer = consumer
        self._topic = topic
        self._partitions = partitions
        self._ends: dict[int, int] | None = None
        self._starts: dict[int, int] | None = None
        self._down = False  # a request was not answered: none is asked again (an outage)

    def start_of(self, p: int) -> int | None:
        """Where `p`'s log starts now (records before it deleted); None: not answered."""
        if self._starts is None:
            self._starts = self._ask(OFFSET_BEGINNING, "start")
        return self._starts.get(p)

    def of(self, p: int) -> int | None:
        if self._ends is None:
            self._ends = self._ask(OFFSET_END, "end")
        return self._ends.get(p)

    def _ask(self, which: int, name: str) -> dict[int, int]:
        if self._down:
            return {}
        try:
            got = self._consumer.offsets_for_times(
                [TopicPartition(self._topic, q, which) for q in self._partitions], FAR_BEHIND_ASK_S)
            return {tp.partition: tp.offset for tp in got if tp.error is None and tp.offset >= 0}
        except Exception as exc:  # an outage: every kept store is resumed, never worse than before
            self._down = True
            log.info("%s offsets of %s not answered (%s)", name, self._partitions, exc)
            return {}


def verdict_key(partition: int, offset: int) -> bytes:
    return VERDICT + struct.pack(">IQ", partition, offset)


def verdict_prefix(partition: int) -> bytes:
    return VERDICT + struct.pack(">I", partition)


def applied_key(proposal_id: str) -> bytes:
    return key(APPLIED, proposal_id)


def applied_at_key(partition: int, offset: int) -> bytes:
    return APPLIED_AT + struct.pack(">IQ", partition, offset)


def clock_key(partition: int) -> bytes:
    return CLOCK + struct.pack(">I", partition)


_CLOCK = struct.Struct(">d")
_CLOCK_FLOOR = struct.Struct(">dH")


def read_clock(raw: bytes | None) -> tuple[float, int]:
    """A partition's (decision time, judging rules floor; 0: none yet).

    Why a floor: `Proposal.rules` is the proposer's word, and a rule tightened
    in a later version (a check against forged input) would be no check if a
    forger could name the older rules to be judged by them. Once a partition
    has judged a proposal of rules >= FLOOR_FROM, it judges every later one by
    at least those: a position in the log, so every judge and rebuild agrees.
    """
    if raw is None:
        return 0.0, 0
    if len(raw) == _CLOCK.size:  # written before the floor existed
        return _CLOCK.unpack(raw)[0], 0
    return _CLOCK_FLOOR.unpack(raw)


class _Blocked(Exception):
    """The proposal needs partition `q` judged up to `offset` first (or, with
    q == -1, a newer judge): set it aside, judge other partitions meanwhile."""

    def __init__(self, q: int, offset: int, questions: list[Question] | None = None) -> None:
        super().__init__(q, offset)
        self.q = q
        self.offset = offset
        self.questions = questions or []  # the lookups (q, kind, id, as of) whose answers it waits for


@dataclass
class _Pending:
    msgs: deque[Consumed]
    needs: tuple[int, int] | None = None
    questions: list[Question] = field(default_factory=list)  # the lookups the waiting proposal needs answered
    prefetched: int = -1  # the last offset whose lookups were started ahead (see Judge._prefetch)


def _remote(questions: list[Question], owned: set[int]) -> list[Question]:
    """The questions only another worker can answer."""
    return [x for x in questions if x[0] not in owned]


def decision_time(previous: float, proposed: float, broker_ms: int | None) -> float:
    """Monotonic per partition; the proposal's time, capped at the broker's clock + MAX_LEAD_MS."""
    t = proposed if isinstance(proposed, (int, float)) and math.isfinite(proposed) else previous
    if broker_ms is not None and broker_ms > 0:
        t = min(t, broker_ms + MAX_LEAD_MS)
    return max(previous, t)


def refusal(code: str, message: str) -> dict:
    return {"ok": False, "code": code, "message": message}


class Judge(Follower):
    """Judges every proposal of the `<ns>.events` partitions it owns.

    Without `group` (an embedded client, a rebuild, `threadlog replay`) it owns
    every partition. With `group` (`threadlog worker`) it is one member of the
    consumer group `group`: Kafka hands it some partitions, it judges those,
    keeps their state in its own stores (projections/partition_stores.py) and
    gives them up at the next rebalance. A partition taken over starts from the
    store left here by an earlier ownership, else from `restore` (a state
    snapshot), else from offset 0.

    Cross-partition rules look at other partitions only as of positions the
    proposal names (see `judge_record`): partitions owned here are read from
    their stores, the others are asked of their owners through `lookups`
    (an answer about fixed positions never changes, so it is cached).
    """

    metrics = None  # threadlog.metrics.Metrics, when attached

    def __init__(self, bootstrap: str, topic: str, partitions: int, stores: PartitionStores, codec: Codec,
                 client_id: str, *, kafka: Props | None = None, group: str | None = None,
                 lookups: Lookups | None = None, restore: Restorer | None = None, peek: Peek | None = None,
                 resume_gap: int = RESUME_GAP, on_ownership: Callable[[list[int]], None] | None = None) -> None:
        self.stores = stores
        self.group = group
        self.member_id: str | None = None  # in `group`, as of the last assignment (`_assigned`)
        self.lookups = lookups
        self.restore = restore
        # Partitions taken over without local state, restored off this thread (processors/restores.py).
        self._restoring = (Restores(stores, restore, peek, resume_gap)
                           if restore is not None and group is not None else None)
        # Restored and served by the stores, not assigned yet: `_own` failed (tried again).
        self._to_own: set[int] = set()
        self._own_retry_at = 0.0
        self._own_failing: str | None = None  # why the last take-over of restored partitions failed
        self.on_ownership = on_ownership
        # Called on this thread with the partitions a rebalance takes from this judge
        # (not those lost), while their stores are open and nothing else is judged:
        # a worker snapshots them (processors/snapshotter.py `giving_up`).
        self.before_giving_up: Callable[[set[int]], object] | None = None
        # When the group's last assignment or revocation reached this judge (monotonic;
        # readiness tells a description of the group asked for since from an older one).
        self.rebalanced_at = 0.0
        if group is None:
            for p in range(partitions):
                stores.open(p)
        self._pending: dict[int, _Pending] = {}
        # Ends of partition reported while records there waited: applied once they are judged.
        self._ends: dict[int, int] = {}
        self._paused: set[int] = set()
        # (partition, offset) -> the questions asked on arrival for that append (`_ask_early`).
        self._early: dict[tuple[int, int], list[Question]] = {}
        self._early_n = 0  # questions in `_early`
        # Callbacks waiting for the verdict at (partition, offset).
        self._verdict_waiters: dict[tuple[int, int], list[Callable[[dict], None]]] = {}
        # Verdicts written to their proposers' connections (a worker's thin clients).
        self.push: VerdictPush | None = None
        self.reply_header = None  # a local proposer learns its verdicts by callback (producers.proposals.Verdicts)
        self.stats = {"judged": 0, "accepted": 0, "refused": 0, "poison": 0, "blocked": 0, "restored": 0}
        self.restores: dict[int, dict[str, Any]] = {}  # partition -> summary of its restore
        # What fetched records can mark, so an id question about a partition (ours or,
        # for another worker, its owner's) is answered before that partition is
        # judged as far as asked when the answer cannot change (processors/ahead.py).
        self.ahead = Ahead(codec, RULES)
        self._watch_after = 0.0  # no consumer replacement before this (monotonic; `_watch`)
        super().__init__(bootstrap, topic, partitions, stores, codec, client_id, kafka=kafka)  # type: ignore[arg-type]
        if group is not None:
            self.owned = set()
        else:
            for p in range(partitions):  # every partition, from its stored position (Follower._begin)
                self.ahead.reset(p, stores.offset(topic, p))

    # -- ownership ----------------------------------------------------------------------
    def _consumer_extra(self) -> dict:
        # A stored position the log no longer holds means the topic was deleted and
        # created again (or records were deleted: `events` keeps everything): judging
        # from offset 0 onto this state -- librdkafka's reset -- would reach other
        # verdicts than every other judge. The partition waits instead
        # (Follower._sort) and the incarnation watch stops the process's judging.
        refuse_reset = {"auto.offset.reset": "error"}
        if self.group is None:
            return refuse_reset
        return {
            **refuse_reset,
            "group.id": self.group,
            # Sticky and incremental: a rebalance moves only the partitions that
            # must move; the others keep being judged meanwhile.
            "partition.assignment.strategy": "cooperative-sticky",
            # A dead worker's partitions move after this long (the broker's minimum).
            "session.timeout.ms": 6000,
            "heartbeat.interval.ms": 1500,
        }

    def _assignment(self) -> list[TopicPartition]:
        # From offset 0, not OFFSET_BEGINNING, when nothing is judged yet. Why (a
        # review): a log whose first records were deleted (`delete_records`) was
        # judged from wherever it now starts -- other verdicts than every judge
        # that saw the whole log, and reads served from them. Offset 0 gone is
        # then a reset librdkafka refuses (`auto.offset.reset` error): the
        # partition waits, unreadable, as for a stored position the log lost.
        # `events` keeps every record; only a snapshot may stand for its head.
        return [TopicPartition(self.topic, p, self._applied[p]) for p in sorted(self.owned)]

    def _begin(self) -> None:
        if self.group is None:
            super()._begin()
            return
        self._consumer.subscribe([self.topic], on_assign=self._assigned, on_revoke=self._revoked,
                                 on_lost=self._lost)

    def _assigned(self, consumer: Consumer, tps: list[TopicPartition]) -> None:
        """Called on the judge's thread (inside poll): take the partitions over.

        Only what can be judged at once is assigned here; a partition that needs a
        snapshot first is restored off this thread and assigned when it is
        (`_restored`): a restore inside poll outlasting max.poll.interval.ms made
        the worker leave its group, and stopped all judging meanwhile."""
        if consumer is not self._consumer:
            return  # a retired consumer's (`_watch`): its partitions were given up when it was
        # Read here, on the thread that polls: memberid() blocks while another polls.
        # Readiness finds this worker in the group's description by it.
        self.member_id = consumer.memberid()
        self.rebalanced_at = time.monotonic()
        ready = []
        ends = _Ends(consumer, self.topic, [tp.partition for tp in tps])
        for tp in tps:
            # Given back mid-restore, its store is still being filled: not opened here.
            mid_restore = self._restoring is not None and tp.partition in self._restoring
            restore = (0, False) if mid_restore else self._resumable(tp.partition, ends)
            if restore is None:
                ready.append(tp)
            else:
                assert self._restoring is not None
                floor, eager = restore
                self._restoring.start(tp.partition, floor, eager=eager)
        self._own(consumer, ready)  # even none: the assignment callback must assign

    def _restored(self, consumer: Consumer) -> None:
        """On the judge's thread: own the partitions whose restore ended."""
        assert self._restoring is not None
        for p, info in self._restoring.finished():
            if info is not None:
                self.stats["restored"] += 1
                self.restores[p] = summary(info)
            self._to_own.add(p)
        if not self._to_own or time.monotonic() < self._own_retry_at:
            return
        try:
            self._own(consumer, [TopicPartition(self.topic, p) for p in sorted(self._to_own)])
        except Exception as exc:
            # Kept to be tried again: dropped, the partition would stay assigned by the
            # group, served by the stores and judged by no one until the next rebalance.
            log.exception("partitions %s restored but not taken over; trying again in %gs", sorted(self._to_own),
                          RETRY_S)
            self._own_retry_at = time.monotonic() + RETRY_S
            self._own_failing = reason(exc)
            # (On success `_own` forgets them and their failure, with the ownership.)

    def _own(self, consumer: Consumer, tps: list[TopicPartition]) -> None:
        """Assign `tps`, each from its store's position, and judge them from now on
        (the ownership listeners are told, even of none)."""
        for tp in tps:
            pos = self.stores.offset(self.topic, tp.partition)
            tp.offset = pos  # offset 0 too: see `_assignment`
            self.ahead.reset(tp.partition, pos)
        consumer.incremental_assign(tps)
        # Silent since the last ownership is not silent now (`_watch`): a partition
        # coming back (or restored) is behind its end until its first fetch.
        self._liveness.fresh(tp.partition for tp in tps)
        self.unreadable -= {tp.partition for tp in tps}  # its new position may be in the log
        # librdkafka keeps an application pause across unassign and assign: a
        # partition paused by flow control when it was last owned here would
        # otherwise never be fetched again (and never be in `_pending`, where
        # `_flow_control` would resume it).
        if tps:
            try:
                consumer.resume(tps)
            except Exception:
                # Undone, so a retry (`_restored`) starts as this try did: kept
                # assigned, the partitions would be fetched and their records
                # dropped as not owned, the retry's assign would fail for good,
                # and a revoke would leave them out of its unassign.
                consumer.incremental_unassign(tps)
                raise
        # Told even when nothing was added: a member given no partition (or only
        # partitions to restore) is in the group, and readiness says so.
        with self._cond:
            for tp in tps:
                self._applied[tp.partition] = self.stores.offset(self.topic, tp.partition)
            self.owned |= {tp.partition for tp in tps}
            # Owned and no longer failing in one step: `unserved` (readiness) named a
            # partition already owned, its last failure, until `_restored` went on (a
            # full run caught it between the two).
            self._to_own -= self.owned
            if not self._to_own:
                self._own_failing = None
            self._cond.notify_all()
        log.info("%s now owns %s of %s", self.group, sorted(self.owned), self.topic)
        self._ownership_changed()

    def _resumable(self, p: int, ends: _Ends) -> tuple[int, bool] | None:
        """Judge `p` from its local store now (None: opened and served); or the
        position of the local store that a restore must beat first (`Restores`;
        0: none worth keeping) and whether any snapshot past it beats it (the
        store is before the log's start: `Restores.start`, eager)."""
        if self._restoring is None:
            try:
                self.stores.open(p)
            except Exception:  # a corrupt directory: start it again
                # Never raised out of the assignment callback: that leaves the partition
                # assigned by the group but owned by no one -- judged by nobody until the
                # next rebalance.
                log.exception("partition %d: local state unusable; starting it again from offset 0", p)
                self.stores.replace(p)
            return None
        if p in self.stores.partitions:
            return None  # served already: resumed as it is
        if not self.stores.has_local(p):
            return 0, False
        try:
            # Opened unserved, and served (`adopt`) only if resumed: no read can
            # hold it open -- and its RocksDB lock -- once a restore may take its
            # place (a review: a page scan during the ends request kept it locked).
            store = self.stores.local(p)
        except Exception:  # a corrupt directory: start it again (never raised: see above)
            log.exception("partition %d: local state unusable; starting it again from a snapshot or offset 0", p)
            return 0, False  # `Restores` drops the directory
        position = store.offset(self.topic, p)
        # Asked only where a snapshot could take its place (`peek`: snapshots are kept).
        start = ends.start_of(p) if position > 0 and self._restoring.peek is not None else None
        if start is not None and position < start:
            # The records from its position on were deleted: not resumed, and a
            # snapshot standing for the deleted head is restored in its place (a
            # review: a worker back with such a store owned the partition and could
            # not judge it). Kept if none is (`Restores.start`, eager): it holds
            # the only copy of that head's state.
            log.warning("partition %d: local store at %d, but the log now starts at %d: restoring a snapshot "
                        "over it", p, position, start)
            store.close()
            return position, True
        if position > 0 and not self._far_behind(ends, p, position):
            self.stores.adopt(p, store)
            return None  # resumes where an earlier ownership stopped
        # Empty, or keys without a position (a restore that did not finish): never
        # fold onto that, restore again. Or far behind: a snapshot may be nearer.
        store.close()
        return position, False

    def _far_behind(self, ends: _Ends, p: int, position: int) -> bool:
        """Is `p`'s local store far behind the partition's end, so a snapshot may
        be nearer (processors/restores.py)? Unanswered: no -- resumed, as before."""
        assert self._restoring is not None
        if self._restoring.peek is None:
            return False  # no snapshots to compare with
        end = ends.of(p)
        if end is None:
            log.info("partition %d: end offset not answered: resuming its local store at %d", p, position)
            return False
        return self._restoring.far_behind(position, end)

    def _lost(self, consumer: Consumer, tps: list[TopicPartition]) -> None:
        self._revoked(consumer, tps, lost=True)

    def _revoked(self, consumer: Consumer, tps: list[TopicPartition], lost: bool = False) -> None:
        if consumer is not self._consumer:
            return  # a retired consumer leaving the group (`_watch`): given up already
        gone = {tp.partition for tp in tps}
        self.rebalanced_at = time.monotonic()
        # Those still restoring, or restored but not assigned yet, were never assigned to
        # the consumer (unassigning one fails the whole call).
        restoring = {p for p in gone if (self._restoring is not None and self._restoring.drop(p))
                     or p in self._to_own}
        judged_here = gone - restoring
        if not lost and judged_here and self.before_giving_up is not None:
            # Lost ones may be judged by another already: nothing is written of them.
            try:
                self.before_giving_up(judged_here)
            except Exception:  # pragma: no cover - the next owner judges more, that is all
                log.exception("before giving up partitions %s", sorted(judged_here))
        self._to_own -= gone
        if not self._to_own:  # nothing left to take over: no failure of it to report or wait out
            self._own_failing, self._own_retry_at = None, 0.0
        calls: list[Callable[[dict], None]] = []
        with self._cond:
            self.owned -= gone
            for pos in [pos for pos in self._verdict_waiters if pos[0] in gone]:
                calls.extend(self._verdict_waiters.pop(pos))
            self._drop_waiters(gone)
        # Through `_answer`: a waiter's failure must not skip the rest of the hand-over
        # (closing the stores, the unassign, telling the ownership listeners).
        moved = refusal(NOT_OWNER, "the partition moved to another worker")
        _answer([(cb, moved) for cb in calls])
        self._early = {pos: x for pos, x in self._early.items() if pos[0] not in gone}
        self._early_n = sum(len(x) for x in self._early.values())
        for p in gone:
            self._pending.pop(p, None)
            self._ends.pop(p, None)
            self.ahead.drop(p)
        self._resume(gone)
        try:
            consumer.incremental_unassign([tp for tp in tps if tp.partition not in restoring])
        except Exception:  # pragma: no cover - on_lost: the assignment is already gone
            pass
        for p in gone:
            self.stores.close_partition(p)
        log.info("%s gave up %s of %s", self.group, sorted(gone), self.topic)
        self._ownership_changed()

    def halt(self) -> None:
        if self._restoring is not None:
            self._restoring.cancel()  # no more reading of snapshots of a log this state is not of
        super().halt()

    def stop(self) -> None:
        # Restores are cancelled first (each ends at its next read), closed once this
        # thread is gone (`close` copes with one that outlived its join: it works on copies).
        if self._restoring is not None:
            self._restoring.cancel()
        super().stop()
        if self._restoring is not None:
            self._restoring.close()

    @property
    def restoring(self) -> list[int]:
        """Partitions assigned here whose restore has not ended (not owned yet)."""
        return [] if self._restoring is None else sorted({*self._restoring.partitions, *self._to_own})

    @property
    def unserved(self) -> dict[int, str]:
        """Partitions restored but failing to be served or taken over (each tried
        again every RETRY_S), with the last error: why readiness says not ready."""
        if self._restoring is None:
            return {}
        out = self._restoring.unserved
        failing = self._own_failing
        if failing is not None:
            with self._cond:  # `_own` empties it with the ownership, under this lock
                out.update(dict.fromkeys(set(self._to_own), failing))
        return out

    def _ownership_changed(self) -> None:
        if self.on_ownership is not None:
            try:
                self.on_ownership(sorted(self.owned))
            except Exception:  # pragma: no cover
                log.exception("ownership callback failed")

    # -- verdicts -------------------------------------------------------------------
    def verdict(self, partition: int, offset: int) -> dict | None:
        """The stored verdict at (partition, offset), None if not judged (yet)."""
        raw = self.stores.get(verdict_key(partition, offset), [partition])
        return None if raw is None else json.loads(raw)

    def on_verdict(self, partition: int, offset: int, callback: Callable[[dict], None]) -> None:
        """Call `callback(verdict)` once the proposal at (partition, offset) is
        judged: at once if it was already, else from the judge's thread (keep
        the callback short and thread-safe). A partition not owned here gets a
        NOT_OWNER refusal (only thin clients' workers ever answer that)."""
        with self._cond:
            if partition not in self.owned:
                found = refusal(NOT_OWNER, f"partition {partition} is not judged here")
            elif self._applied[partition] <= offset:
                self._verdict_waiters.setdefault((partition, offset), []).append(callback)
                return
            else:
                found = None
        if found is None:
            try:
                found = self.verdict(partition, offset)
            except Exception:  # the store closed under us: a revocation, told apart below
                found = None
        if found is None:
            # Read outside the lock: a revocation in between closes the store, and
            # "nothing stored" must then send the caller to the new owner, not claim
            # the verdict fell out of the window (the proposal was written either way:
            # never UNAVAILABLE, which says nothing was).
            with self._cond:
                moved = partition not in self.owned
            found = refusal(NOT_OWNER, f"partition {partition} moved to another worker") if moved else refusal(
                OUTCOME_UNKNOWN, f"the verdict at events[{partition}]@{offset} is no longer kept (more than "
                                 f"{VERDICT_WINDOW} offsets ago): read the state")
        callback(found)

    def forget(self, partition: int, offset: int, callback: Callable[[dict], None]) -> None:
        with self._cond:
            waiting = self._verdict_waiters.get((partition, offset))
            if waiting and callback in waiting:
                waiting.remove(callback)
                if not waiting:
                    del self._verdict_waiters[(partition, offset)]

    # -- the loop -----------------------------------------------------------------------
    def _run(self) -> None:
        retried_at = 0.0  # when waiting partitions were last retried
        while not self._stop.is_set():
            pending = self._pending.values()
            # Fetched records not judged yet (a partition past MAX_BATCH): judge on at once.
            backlog = any(pend.needs is None and pend.msgs for pend in pending)
            waiting = [pend for pend in pending if pend.needs is not None and pend.msgs]
            # A partition waiting for other owners' answers is decided again as soon as it
            # may move (Judge._may_retry: all its answers arrived, or a failed question
            # may be asked again), polled every millisecond: answers land on the query
            # thread while this one sits in librdkafka. A partition waiting for one of
            # ours moves with our own records; every RETRY_WAITING_S it is looked at.
            asked = any(_remote(pend.questions, self.owned) for pend in waiting)
            timeout = 0.0 if backlog else 0.001 if asked else RETRY_WAITING_S if waiting else 0.1
            if self._restoring or self._to_own:
                try:
                    self._restored(self._consumer)
                except Exception:  # pragma: no cover - the judge's thread never dies of it
                    log.exception("restored partitions could not be taken over")
                timeout = min(timeout, 0.02)  # a restore ending is no Kafka event: look again soon
            push = self.push  # read once: the query server unsets it when it closes
            if push is not None:
                push.beat()  # an idle subscriber hears it is still subscribed
                if push.backlogged:
                    push.flush()  # verdicts a client's socket did not take at once
                    timeout = min(timeout, 0.01)
            try:
                msgs = kafka_config.drain(self._consumer, 2000, timeout)
            except Exception:  # pragma: no cover - librdkafka hiccup
                log.exception("judge consume failed")
                time.sleep(0.1)
                continue
            self._liveness.saw(msgs, full=len(msgs) >= 2000)
            try:
                self._watch()
            except Exception:  # pragma: no cover - the judge's thread never dies of it
                log.exception("%s: checking or replacing the judge's consumer failed", self.topic)
            if waiting and not msgs and not backlog:
                owned, progress = set(self.owned), dict(self._applied)
                answered = any(self._may_retry(pend, owned, progress) for pend in waiting)
                if not answered and time.monotonic() - retried_at < RETRY_WAITING_S:
                    continue  # nothing new to judge with
                retried_at = time.monotonic()
            if msgs or waiting or backlog:
                try:
                    self._handle(msgs)
                except Exception:  # pragma: no cover - a bug must not stop judging
                    log.exception("judge failed on a batch; retrying from stored positions")
                    # Until it succeeds: fetched records were dropped, so judging on
                    # without the seek back would skip them.
                    while not self._stop.is_set():
                        try:
                            self._rewind()
                            break
                        except Exception:  # the store that failed the batch may fail this too
                            log.exception("judge could not rewind; trying again")
                            time.sleep(0.5)

    def _handle(self, msgs: list[Consumed]) -> None:
        by_partition, eof = self._sort(msgs)
        owned = set(self.owned)
        for p, records in by_partition.items():
            if p in owned:  # records fetched before a revocation are dropped
                self._pending.setdefault(p, _Pending(deque())).msgs.extend(records)
                appends = self.ahead.fetched(p, records)  # (offset, checkpoint id, seen) of each append
                if self.lookups is not None:
                    self._ask_early(p, appends, owned)
        verdicts: dict[tuple[int, int], dict] = {}
        positions: dict[int, int] = {}
        push = self.push  # read once: the query server unsets it when it closes
        if push is not None and not push.active:
            push = None
        replies: list[tuple[bytes, int, int, dict]] = []  # (token, p, offset, verdict) to push
        with self.stores.lock:
            views: dict[int, View] = {}

            def view_of(q: int) -> View:
                view = views.get(q)
                if view is None:
                    view = views[q] = View(self.stores.store_of(q))
                return view

            progress = {p: self._applied[p] for p in owned}
            others = self._others(owned, view_of, progress)
            moved = True
            pend: _Pending | None
            judged: Counter[int] = Counter()  # proposals judged into this write buffer, by partition
            while moved:  # a partition unblocked by another's progress is retried at once
                moved = False
                for p, pend in self._pending.items():
                    if pend.needs is not None:
                        if not self._may_retry(pend, owned, progress):
                            continue
                        pend.needs = None
                        pend.questions = []
                    while pend.msgs and judged[p] < MAX_BATCH:
                        if self._stop.is_set():
                            # Stopping: drop the batch unapplied (positions stay where they are
                            # stored, so nothing is lost). Why: a catch-up batch can take seconds,
                            # and `stop` closes the stores once the join gives up; judging on
                            # into a closed RocksDB failed ("Already mutably borrowed").
                            return
                        msg = pend.msgs[0]
                        if msg.offset() < progress[p]:
                            pend.msgs.popleft()  # already judged (a re-fetch after a rewind)
                            self._forget_early(p, msg.offset())
                            continue
                        unanswered = self._unanswered(p, msg.offset(), owned) if self._early else None
                        if unanswered:
                            pend.needs = (unanswered[0][0], unanswered[0][3])
                            pend.questions = unanswered
                            self.stats["blocked"] += 1
                            self._prefetch(view_of(p), p, pend, progress, others)
                            break
                        try:
                            verdict = self._judge(view_of(p), p, msg, progress, others)
                        except _Blocked as blocked:
                            pend.needs = (blocked.q, blocked.offset)
                            pend.questions = blocked.questions
                            self.stats["blocked"] += 1
                            if blocked.q >= 0:
                                self._prefetch(view_of(p), p, pend, progress, others)
                            break
                        pend.msgs.popleft()
                        judged[p] += 1
                        verdicts[(p, msg.offset())] = verdict
                        if push is not None:
                            token = reply_of(msg.headers())
                            if token is not None:
                                replies.append((token, p, msg.offset(), verdict))
                        progress[p] = msg.offset() + 1
                        positions[p] = msg.offset() + 1
                        moved = True
            for p, nxt in positions.items():
                # State, verdicts and position of one partition: one atomic batch.
                self.stores.store_of(p).apply(views[p].buffer, {(self.topic, p): nxt})
                self.ahead.judged(p, nxt)
        # The end of a partition is its judged position once every record before it
        # is judged. Kept meanwhile: librdkafka reports it once, and dropped (the
        # partition waiting then), a log ending in records no consumer yields (a
        # transaction's commit marker, aborted records) left the idle partition
        # short of its end offset: read barriers waited for its next record, its
        # fold lag stayed > 0 and /readyz called it stalled.
        for p, off in eof.items():
            if p in owned:
                self._ends[p] = max(self._ends.get(p, 0), off)
        for p, off in list(self._ends.items()):
            pend = self._pending.get(p)
            if pend is None or not pend.msgs:
                positions[p] = max(positions.get(p, 0), off)
                del self._ends[p]
        self._flow_control()
        if positions or verdicts:
            self._publish(positions, verdicts)
        if replies and push is not None:
            # After the positions moved: a read its client sends next is not
            # held back waiting for the verdict it already has.
            push.push(replies)

    def _may_retry(self, pend: _Pending, owned: set[int], progress: dict[int, int]) -> bool:
        """Is deciding a waiting partition's first proposal again worth it now?

        Why: a proposal waits for every question it asked; deciding it again on
        each fetched batch or on each single answer (a checkpoint append asks
        the other owner about two partitions) cost a whole decision each time:
        with two workers, a checkpoint append cost 3.5 times the judging CPU of
        one worker's.
        """
        assert pend.needs is not None
        if pend.needs[0] < 0:
            return False  # a newer judge's rules: nothing here will ever decide it
        # (`needs` is the first of the questions: they say all it waits for.)
        if any(x[0] in owned and progress.get(x[0], 0) < self._settles_at(x) for x in pend.questions):
            return False  # one of ours is not judged that far yet
        remote = _remote(pend.questions, owned)
        return not remote or self.lookups is None or self.lookups.settled(remote)

    def _settles_at(self, question: Question) -> int:
        """How far the partition asked about must be judged here to answer (processors/ahead.py)."""
        return self.ahead.settles_at(*question)

    def _others(self, owned: set[int], view_of: Callable[[int], View], progress: dict[int, int]) -> Others:
        """Holders of an id on another partition q as of offset `need` of q, or
        None when that cannot be known yet (q not judged that far here, or its
        owner not answered yet)."""

        def others(q: int, kind: str, ident: str, need: int) -> list[str] | None:
            if need <= 0:
                return []
            if q in owned:
                if progress.get(q, 0) < self._settles_at((q, kind, ident, need)):
                    return None
                return index_holders(view_of(q), kind, ident, need)
            if self.lookups is None:
                return None
            return self.lookups.get(q, kind, ident, need)

        return others

    def _ask_early(self, p: int, asks: list[tuple[int, str, list[int]]], owned: set[int]) -> None:
        """Ask the other owners about fetched checkpoint appends' ids now, before
        judging reaches them.

        Why: a proposal whose answers are not in when it is judged waits, is
        decided again once they are, and every proposal queued behind it is
        decided once more as a guess only to start its own questions -- about
        three decisions per append with two workers. An append's questions are
        known from the proposal alone (its checkpoint id as of `seen` on each
        other partition), so they are asked on arrival; by the time judging
        reaches the append its answers are usually in.

        One request per append (per owner asked), never the questions of several
        appends in one: an owner answers a request once every question in it is
        settled, and a question of one append can wait for another append to be
        judged (two appends racing for one id on two partitions). Bundled, two
        such could wait for each other until the request timed out.

        At most MAX_EARLY questions wait for their appends at once (a worker
        catching up on a backlog fetches thousands): beyond that an append is
        asked about when judging comes near it, as any other proposal
        (`_prefetch`), so early answers are never evicted from the lookups'
        cache before their appends use them. Of those, only the first are
        asked at once (MAX_EARLY_IN_FLIGHT in flight); the rest are asked when
        judging comes within PREFETCH_AHEAD of them (`_ask_early_again`).
        """
        assert self.lookups is not None
        for offset, ident, seen in asks:
            if len(seen) != self.partitions or self._early_n >= MAX_EARLY:
                continue  # names no positions (only its own partition is consulted); or too many waiting
            questions = [(q, CHECKPOINT, ident, need) for q, need in enumerate(seen)
                         if q != p and need > 0 and q not in owned]
            if questions:
                self._early[(p, offset)] = questions
                self._early_n += len(questions)
                if self.lookups.in_flight < MAX_EARLY_IN_FLIGHT:
                    self.lookups.ask(questions)

    def _unanswered(self, p: int, offset: int, owned: set[int]) -> list[Question]:
        """The questions asked on arrival for the proposal at (p, offset) whose
        answers are not in yet: it is not decided before they are (deciding it
        would only stop at its first question, a wasted partial decision)."""
        questions = self._forget_early(p, offset)
        if not questions or self.lookups is None:
            return []
        remote = _remote(questions, owned)
        if self.lookups.answered(remote):
            return []
        self.lookups.ask(remote)  # not asked on arrival (MAX_EARLY_IN_FLIGHT), or failed; never twice in flight
        return remote

    def _prefetch(self, view: View, p: int, pend: _Pending, progress: dict[int, int], others: Others) -> None:
        """Start the other owners' lookups of the proposals queued behind a waiting one.

        Why: a partition judges in order, so each proposal that needs another
        owner's answer held the partition for one round trip, one proposal
        after the other (two workers: 132 CAS appends/s). The questions are
        about fixed positions, so they can be asked ahead: each queued proposal
        is decided on a scratch view (discarded) with unknown answers taken as
        none, only to start its questions. A wrong guess costs a question,
        never a verdict: the real judging asks again and waits for the answer.
        """
        if self.lookups is None:
            return  # every partition is judged here: nothing to ask ahead
        self._ask_early_again(p, pend)

        def ask(q: int, kind: str, ident: str, need: int) -> list[str]:
            return others(q, kind, ident, need) or []

        for n, msg in enumerate(pend.msgs):
            if n > PREFETCH_AHEAD:
                break
            if n == 0 or msg.offset() <= pend.prefetched:
                continue  # the waiting proposal asked already; these were asked ahead before
            pend.prefetched = msg.offset()
            if not self._asks_when_judged(p, msg):
                continue
            try:
                _decide(view.child(), Record.of(p, msg), self.codec, self.partitions, progress, self.topic, ask,
                        quiet=True)
            except Exception:  # a guess; the real judging decides and reports
                continue

    def _ask_early_again(self, p: int, pend: _Pending) -> None:
        """Ask again the arrival questions of the appends queued behind a waiting one.

        Why (tried, a probe: two workers, a broker outage, 3 s request timeouts):
        after the rebalance each worker asked the other about every append of its
        gained partition at once; the other, catching up too, answered none in
        time, and ~2 000 questions failed together. Asked on arrival only, those
        appends were then asked about one at a time as judging reached each: the
        partition judged ~50 records/s and recovered in 58 s instead of 11-17.
        Questions answered, in flight or failed a moment ago are not sent again
        (Lookups.ask). It runs whenever a partition waits, not only within a
        while of a failure (as it did until 2026-12-05): a backlog of appends
        whose questions failed, or were never sent (MAX_EARLY_IN_FLIGHT),
        outlasts any such window, and after it each was asked only when judged
        -- one round trip per append, ~26 records/s in the probe.
        """
        assert self.lookups is not None
        owned = set(self.owned)
        for msg in islice(pend.msgs, 1, PREFETCH_AHEAD + 1):
            questions = self._early.get((p, msg.offset()))
            if questions:
                self.lookups.ask(_remote(questions, owned))  # one request per append, as on arrival

    def _forget_early(self, p: int, offset: int) -> list[Question] | None:
        questions = self._early.pop((p, offset), None)
        if questions is not None:
            self._early_n -= len(questions)
        return questions

    def _asks_when_judged(self, p: int, msg: Consumed) -> bool:
        """Whether guessing this proposal ahead may start questions not asked yet:
        its type asks other partitions, and it is not an append asked about on
        arrival (`_ask_early`). One envelope decode (~15 us) instead of a guess
        (a whole decision)."""
        if (p, msg.offset()) in self._early:
            return False
        try:
            _, env = self.codec.decode(msg.value(), expect="threadlog.Proposal")
        except CodecError:
            return False
        return reads_other_partitions(env["type"])

    def _watch(self) -> None:
        """Replace the consumer when it stopped fetching (threadlog/kernel/stuck.py).

        Why the judge too: a stuck judge consumer stops every decision of the
        partitions it owns -- every write to them ends OUTCOME_UNKNOWN, for good
        (librdkafka #5153 after a broker restart; the readiness probe only says
        so). Only partitions that should be fetching are looked at: one paused
        by flow control, or with fetched records still to judge (waiting for
        answers, or a backlog), is not fetched on purpose and its end is ahead.
        Such a partition has nothing fetched and not judged, so the judged
        position is the consumer's."""
        if time.monotonic() < self._watch_after or not self._liveness.due():
            return  # every poll: nothing to work out
        fetching = [p for p in self.owned if p not in self._paused and p not in self.unreadable
                    and not (p in self._pending and self._pending[p].msgs)]
        why = self._liveness.stuck(self._consumer, self.topic, fetching, self._applied)
        if why is None:
            return
        # At most one replacement per REPLACE_GAP_S, whatever the cause: a partition
        # this check misreads as stuck must not make a worker give every partition up
        # every few seconds (each give-up answers NOT_OWNER and cancels restores).
        self._watch_after = time.monotonic() + REPLACE_GAP_S
        old = self._consumer
        new = Consumer(dict(self._settings))
        if self.group is not None and not self._served_elsewhere(new, self._liveness.suspect):
            # The cluster does not serve that partition to a new handle either (its
            # leader is down: an offline partition of a multi-node cluster, an outage):
            # not this consumer's fault, and giving every partition up would only stop
            # the healthy ones. It waits, as before; readiness says it is stalled.
            log.warning("%s: %s, and a new consumer cannot read its end either: the cluster, not this "
                        "consumer; kept", self.topic, why)
            new.close()
            return
        log.warning("%s: %s: replacing the judge's consumer", self.topic, why)
        if self.group is None:
            # Every partition again from its stored position; nothing fetched is kept
            # (fetched again by the new consumer), and no pause carries over.
            self._drop_fetched()
            self._paused.clear()
            self._consumer = new
            self._retire(old)
            for p in self.owned:
                self.ahead.reset(p, self._applied[p])
            self._consumer.assign(self._assignment())  # from the judged positions
        else:
            # A group member: give every partition up as a rebalance does (waiters told
            # NOT_OWNER, stores closed and kept), then join again with the new consumer;
            # the group hands the partitions to it (or to another worker) and they resume
            # from their stores. The old one leaves off this thread: its close can wait
            # on a cluster that does not answer, and its callbacks are ignored.
            held = self.owned | set(self.restoring)
            try:
                self._revoked(old, [TopicPartition(self.topic, p) for p in sorted(held)])
            finally:  # whatever failed of the hand-over, the new consumer joins: the group reassigns
                self._consumer = new
                self._liveness.replaced()
                threading.Thread(target=self._retire, args=(old,), name="judge:retire", daemon=True).start()
                self._begin()
            return
        self._liveness.replaced()

    def _served_elsewhere(self, fresh: Consumer, p: int | None) -> bool:
        """Does a new handle read partition `p`'s end, ahead of the judged position?
        (The stuck handle did not fetch it.) Asked before a worker's judge gives
        every partition up for one: that costs every caller of the healthy ones."""
        if p is None:
            return True
        try:
            _, high = fresh.get_watermark_offsets(TopicPartition(self.topic, p), timeout=stuck.ASK_S)
        except Exception:
            return False
        return high > self._applied.get(p, 0)

    @staticmethod
    def _retire(consumer: Consumer) -> None:
        try:
            consumer.close()
        except Exception:  # pragma: no cover - it is being replaced
            log.exception("closing a replaced judge consumer failed")

    def _flow_control(self) -> None:
        """Stop fetching a partition that waits with many records in hand."""
        for p, pend in self._pending.items():
            tp = TopicPartition(self.topic, p)
            if len(pend.msgs) > MAX_PENDING and p not in self._paused:
                self._consumer.pause([tp])
                self._paused.add(p)
            elif len(pend.msgs) <= MAX_PENDING // 2 and p in self._paused:
                self._consumer.resume([tp])
                self._paused.discard(p)

    def _publish(self, positions: dict[int, int], verdicts: dict[tuple[int, int], dict]) -> None:
        calls: list[tuple[Callable[[dict], None], dict]] = []
        # One critical section for both: a waiter registers only while its offset
        # is not yet applied, so taking the waiters and moving the positions must
        # not be separable (a registration in between would never be answered).
        with self._cond:  # an RLock: advance() takes it again
            for pos, verdict in verdicts.items():
                for cb in self._verdict_waiters.pop(pos, ()):
                    calls.append((cb, verdict))
            self.advance(positions)
        _answer(calls)

    def _resume(self, partitions: set[int]) -> None:
        """Resume what flow control paused of `partitions` (nothing else resumes them
        once their fetched records are dropped)."""
        paused = partitions & self._paused
        if paused:
            self._paused -= paused
            try:
                self._consumer.resume([TopicPartition(self.topic, p) for p in sorted(paused)])
            except Exception:  # pragma: no cover - on_lost: the assignment is already gone
                log.exception("could not resume %s of %s", sorted(paused), self.topic)

    def _drop_fetched(self) -> None:
        """Forget every record fetched and not judged (fetched again from the stored positions)."""
        self._pending.clear()
        self._ends.clear()  # the records before them were dropped: fetched again, with their end
        self._early.clear()
        self._early_n = 0

    def _rewind(self) -> None:
        self._drop_fetched()
        self._resume(set(self._paused))
        stored: dict[int, int] = {}
        for p in sorted(self.owned):
            stored[p] = self.stores.offset(self.topic, p)
            self.ahead.reset(p, stored[p])
            try:
                self._consumer.seek(TopicPartition(self.topic, p, stored[p]))
            except Exception:
                pass
        # The failed batch may have been applied to some partitions before it
        # failed: their verdicts are stored and will never be published again
        # (the seek starts after them), so their waiters hear them now.
        # One critical section, as in _publish: no waiter registers in between.
        calls: list[tuple[Callable[[dict], None], dict]] = []
        with self._cond:
            for pos in [pos for pos in self._verdict_waiters if pos[0] in stored and pos[1] < stored[pos[0]]]:
                try:
                    verdict = self.verdict(*pos)
                except Exception:  # the store that failed the batch: the outcome stays unknown to them
                    verdict = None
                calls.extend((cb, verdict or refusal(OUTCOME_UNKNOWN, f"the verdict at events[{pos[0]}]@{pos[1]} "
                                                                      "could not be read: read the state"))
                             for cb in self._verdict_waiters.pop(pos))
            self.advance(stored)
        _answer(calls)
        time.sleep(0.1)

    # -- one proposal -----------------------------------------------------------------------
    def _judge(self, view: View, p: int, msg: Consumed, progress: dict[int, int], others: Others) -> dict:
        """Judge the record at (p, offset) (see `judge_record`) and count it."""
        rec = Record.of(p, msg)
        verdict = judge_record(view, rec, codec=self.codec, partitions=self.partitions, progress=progress,
                               topic=self.topic, others=others)
        self.stats["judged"] += 1
        self.stats["accepted" if verdict["ok"] else "refused"] += 1
        if verdict.get("code") == INVALID_MESSAGE:
            self.stats["poison"] += 1
        if self.metrics is not None:
            self.metrics.decided(verdict)
        return verdict


def _answer(calls: list[tuple[Callable[[dict], None], dict]]) -> None:
    """Give verdict waiters their verdicts (outside the judge's lock)."""
    for cb, verdict in calls:
        try:
            cb(verdict)
        except Exception:  # pragma: no cover - a waiter's bug must not stop judging
            log.exception("verdict callback failed")


@dataclass(frozen=True)
class Record:
    """What judging needs of a Kafka record."""

    partition: int
    offset: int
    value: bytes | None
    broker_ms: int | None  # LogAppendTime (or CreateTime); None if the record has none

    @classmethod
    def of(cls, partition: int, msg: Consumed) -> Record:
        ts_type, ts = msg.timestamp()
        return cls(partition, msg.offset(), msg.value(), ts if ts_type != 0 else None)


def judge_record(view: View, rec: Record, *, codec: Codec, partitions: int, progress: dict[int, int],
                 topic: str = "events", others: Others | None = None) -> dict:
    """THE judging step, a pure function of (state before the record, the record).

    Decides the proposal at (rec.partition, rec.offset) against `view`, folds
    its effects into `view` if accepted, stores the verdict there and returns
    it. `progress` (partition -> next offset judged) only says whether the
    positions the proposal names are judged yet: if not, raises `_Blocked`
    having written nothing (the answer, once it can be given, does not depend
    on how far the other partitions got). Never raises for bad input.

    `others(q, kind, id, need)` answers "who holds this id on partition q as of
    offset need" (None: not known yet); by default from `view` itself, which
    then holds every partition's state (one store, as in unit tests).
    """
    problem = judging_problem()
    if problem is not None:
        # Not a verdict: another setting would reach another one. The judge stops
        # here (its batch fails and is retried) until the setting is back.
        raise RuntimeError(problem)
    if others is None:
        others = _local_others(view, progress, partitions)
    verdict = _decide(view, rec, codec, partitions, progress, topic, others)
    view.put(verdict_key(rec.partition, rec.offset), dumps(verdict).encode())
    _forget(view, rec.partition, rec.offset - VERDICT_WINDOW)
    return verdict


def _forget(view: View, p: int, old: int) -> None:
    """Drop the verdict (and applied proposal id) of offset `old`: see VERDICT_WINDOW.

    The id's entry points at `old` for sure: an id is applied once (a re-send
    inside the window is answered as a duplicate and writes no entry), so no
    second read is needed to check it."""
    if old < 0:
        return
    view.delete(verdict_key(p, old))
    at = applied_at_key(p, old)
    pid = view.get(at)
    if pid is not None:
        view.delete(at)
        view.delete(applied_key(pid.decode()))


def _local_others(view: View, progress: dict[int, int], partitions: int) -> Others:
    def others(q: int, kind: str, ident: str, need: int) -> list[str] | None:
        if progress.get(q, 0) < need:
            return None
        return index_holders(view, kind, ident, need, lambda thread: partition_for(thread, partitions) == q)

    return others


def _decide(view: View, rec: Record, codec: Codec, partitions: int, progress: dict[int, int], topic: str,
            others: Others, quiet: bool = False) -> dict:
    """Decide one proposal (see `judge_record`).

    `quiet`: a guess ahead (Judge._prefetch), only to start its lookups: logs
    nothing and folds nothing (questions are asked while deciding, never while
    folding, and a guess's view is discarded: folding it would double the
    judging CPU of every proposal queued behind a waiting one).
    """
    p, offset = rec.partition, rec.offset
    try:
        _, env = codec.decode(rec.value, expect="threadlog.Proposal")
    except CodecError as exc:
        if not quiet:
            log.warning("undecodable record at %s[%d]@%d judged refused: %s", topic, p, offset, exc.message)
        return refusal(INVALID_MESSAGE, f"not a proposal: {exc.message}")
    if env["rules"] > RULES:
        if not quiet:
            log.error("%s[%d]@%d needs judging rules %d; this judge knows %d: the partition waits for an "
                      "upgraded judge", topic, p, offset, env["rules"], RULES)
        raise _Blocked(-1, 0)
    if partition_for(env["key"], partitions) != p:
        # One partition owns each key's state: a proposal for a key on another
        # partition would let two partitions change one thread.
        return refusal(INVALID_ARGUMENT, f"proposal keyed {env['key']!r} was written to partition {p}")
    # Decision time: monotonic per partition, bounded by the broker's clock.
    prev, floor = read_clock(view.get(clock_key(p)))
    now = decision_time(prev, env["at"], rec.broker_ms)
    rules = max(env["rules"], floor)
    if rules > RULES:
        # State a newer judge wrote (its snapshot restored here): every proposal of
        # this partition is judged by rules this code does not know. Wait, as above.
        if not quiet:
            log.error("%s[%d]@%d: the partition was judged by rules %d; this judge knows %d: the partition "
                      "waits for an upgraded judge", topic, p, offset, floor, RULES)
        raise _Blocked(-1, 0)
    first = view.get(applied_key(env["proposalId"]))
    if first is not None:
        # Re-sent after an unknown outcome (idempotence lasts one producer
        # session): answered with the first verdict, never applied twice.
        where = json.loads(first)
        earlier = view.get(verdict_key(where["p"], where["o"]))
        answer = json.loads(earlier) if earlier is not None else {"ok": True}
        return {**answer, "effects": [], "follow": [], "duplicateOf": where}
    fingerprint = env["payload"][2:10]
    if env["payload"][:2] == MARKER and newer_schemas(codec).get(fingerprint, 0) > rules:
        # A payload schema newer than the rules the proposal (and partition) names
        # (a type added later, INTRODUCED, or a later version of one,
        # SCHEMA_INTRODUCED): judged as a judge of those rules judged it -- its
        # codec did not know the schema. Else a raw proposal naming old rules was
        # accepted here and refused there, and a rebuild by newer code disagreed
        # with the verdicts given. Before decoding, as theirs: a payload that is
        # also corrupt is refused with the same message.
        return refusal(INVALID_MESSAGE, f"proposal payload undecodable: unknown schema fingerprint "
                                        f"{fingerprint.hex()}")
    try:
        ptype, payload = codec.decode(env["payload"], expect=env["type"])
    except CodecError as exc:
        return refusal(INVALID_MESSAGE, f"proposal payload undecodable: {exc.message}")
    handler = HANDLERS.get(ptype)
    if handler is None:
        return refusal(INVALID_ARGUMENT, f"unknown proposal type {ptype}")
    seen = env["seen"]
    if len(seen) != partitions and ptype in GLOBAL_READS:
        # Its rules ask other partitions as of these positions; without them the
        # judge could only look at its own partition, and a raw proposal naming
        # none would skip every cross-partition id check. Every client names them
        # (producers/proposals.py), so only a forged or broken proposal lacks them.
        return refusal(INVALID_ARGUMENT, f"{ptype} must name the end offset of each of the {partitions} events "
                                         f"partitions in `seen`; it names {len(seen)}")
    child = view.child()
    limits = {q: o for q, o in enumerate(seen) if q != p} if len(seen) == partitions else {}

    def holders(kind: str, ident: str) -> list[str]:
        # Its own partition as of now; every other as of the position the proposal names.
        found = set(index_holders(child, kind, ident, None, lambda thread: partition_for(thread, partitions) == p))
        missing: list[Question] = []
        for q, need in limits.items():
            held = others(q, kind, ident, need)
            if held is None:
                missing.append((q, kind, ident, need))  # every lookup is started before waiting
            else:
                found.update(held)
        if missing:
            raise _Blocked(missing[0][0], missing[0][3], missing)
        return sorted(found)

    ctx = Context(now=now, key=env["key"], command_id=env["proposalId"], partition=p, view=child, holders=holders,
                  partitions=partitions, offset=offset, seen=list(seen) if len(seen) == partitions else [],
                  rules=rules)
    try:
        decision = handler(ctx, payload)
        if quiet:
            return {"ok": True}
        effects = _fold_effects(ctx, p, offset, decision)
    except _Blocked:
        raise
    except ThreadLogError as exc:
        verdict = refusal(exc.code, exc.message)
    except (MemoryError, OSError):
        # The machine, not the proposal: a judge with more memory (or a disk that
        # answers) accepts it. Stored as a refusal, that was a verdict no other
        # judge reaches (a review: a 40 MB LangGraph copy refused "could not judge
        # ... MemoryError()" under a memory limit). Not a verdict: the batch fails
        # and is judged again, as for `judging_problem`.
        raise
    except Exception as exc:  # a rule's bug refuses the proposal; it never stops the judge
        if not quiet:
            log.exception("judging %s at %s[%d]@%d failed", ptype, topic, p, offset)
        verdict = refusal(INVALID_ARGUMENT, f"could not judge {ptype}: {exc!r}")
    else:
        child.merge()
        if effects:
            view.put(applied_key(env["proposalId"]), dumps({"p": p, "o": offset}).encode())
            view.put(applied_at_key(p, offset), env["proposalId"].encode())
        verdict = {"ok": True}
        if decision.reply and decision.result is not None:
            verdict["result"] = decision.result
        if decision.records:
            verdict["effects"] = [r.effect() for r in decision.records]
        if decision.follow_ups:
            verdict["follow"] = [{"key": f.key, "type": f.type, "payload": f.payload} for f in decision.follow_ups]
    # Time moves on with every judged proposal, accepted or refused.
    raised = rules if rules >= FLOOR_FROM else floor
    if now != prev or raised != floor:
        view.put(clock_key(p), _CLOCK_FLOOR.pack(now, raised) if raised else _CLOCK.pack(now))
    return verdict


def _fold_effects(ctx: Context, p: int, offset: int, decision: Decision) -> int:
    seq = current_seq(ctx.view, ctx.key)
    for etype, payload in decision.events:
        seq += 1
        apply_event(ctx.view, EventMeta(ctx.key, seq, ctx.now, ctx.command_id, etype, p, offset), payload)
    return len(decision.events)


def all_verdicts(store: StateReader, partition: int) -> list[tuple[int, dict]]:
    """Every stored verdict of a partition, by offset (tests compare judges with it)."""
    prefix = verdict_prefix(partition)
    return [(struct.unpack(">Q", k[len(prefix):])[0], json.loads(v)) for k, v in store.scan(prefix)]

