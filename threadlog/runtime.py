"""What one process runs for a namespace: topics, stores, judge, read barrier.

Three roles:

- embedded (`threadlog.open`, the default; also `serve`, `replay`, `demo`): the
  judge (processors/judge.py) owns every partition of `events`, deciding every
  proposal in offset order into this process's stores -- one RocksDB per
  partition (projections/partition_stores.py) -- and the read barrier waits
  for it. Development and single-host use: a full replica.
- worker (`threadlog worker`): one member of the consumer group `<ns>.judges`;
  its judge owns the partitions the group gives it, serves their reads and
  verdicts (processors/query_server.py) and asks the other owners for
  cross-partition facts (processors/lookups.py).
- thin (`processors="external"`): no judge, no `events` state; verdicts,
  barriers and reads come from the owners through `query` (threadlog/remote.py).

The run index of the delivery log (`<ns>.deliveries`, projections/run_index.py)
goes with ownership: embedded clients fold every partition; a worker folds the
delivery partitions of its events partitions (`partitioning.owner_partition`)
and answers for them; a thin client folds none -- it asks the owners and tails
only the partitions its live readers read (threadlog/delivery/).
"""


from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable

from confluent_kafka.admin import AdminClient

from .config import Options
from .kernel import kafka_config
from .kernel.errors import ThreadLogError, invalid_argument
from .kernel.partitioning import owner_partition, partition_for
from .kernel.topics import INCARNATION_HEADER, TopicLayout, Topics, ensure_topics, require_topics
from .kernel.validation import avro_reader_problem, judging_problem
from .processors.handlers import load_all as load_handlers
from .processors.judge import Judge
from .processors.lookups import Lookups
from .processors.restores import RESUME_GAP
from .processors.snapshotter import EVERY_RECORDS, INTERVAL_S, Snapshotter
from .producers.rules_floor import write_floor_markers
from .projections import incarnation
from .projections.barrier import EndOffsets, LatestOffsets, ReadBarrier
from .projections.delivery_follower import DeliveryIndex
from .projections.fold import load_all as load_folds
from .projections.follower import Follower
from .projections.partition_stores import PartitionStores, Slot, claim_slot
from .projections.snapshots import Origin, RestoreInfo, SnapshotWriter
from .projections.snapshots import latest_position as latest_snapshot_position
from .projections.snapshots import restore as restore_snapshot
from .projections.store import Store
from .remote import QueryClient
from .schemas import Codec, default_codec

log = logging.getLogger("threadlog.runtime")

Headers = list[tuple[str, str | bytes | None]]


class Runtime:
    """`worker=True`: this process is one member of the namespace's group of
    workers (`<ns>.judges`) and judges only the partitions the group gives it."""

    def __init__(self, opts: Options, *, worker: bool = False, snapshot_every: int = EVERY_RECORDS,
                 snapshot_interval_s: float = INTERVAL_S, resume_gap: int = RESUME_GAP) -> None:
        load_handlers()
        load_folds()
        self.opts = opts
        self.worker = worker
        self.snapshot_every = snapshot_every
        self.snapshot_interval_s = snapshot_interval_s
        self.resume_gap = resume_gap
        self.snapshotter: Snapshotter | None = None
        self.topics = Topics(opts.namespace)
        self.codec: Codec = default_codec()
        self.client_id = f"{opts.namespace}.{uuid.uuid4().hex[:12]}"
        self.admin: AdminClient | None = None
        self.shared_admin: kafka_config.SharedAdmin | None = None  # `admin`, for other threads (watch, readiness)
        self.ends: LatestOffsets | None = None  # end offsets for `seen` and read barriers
        self.layout: TopicLayout | None = None
        self.slot: Slot | None = None
        self.stores: PartitionStores | None = None  # events state, by partition (not in a thin client)
        self.index_store: Store | None = None  # the delivery run index
        self.deliveries: DeliveryIndex | None = None  # its fold (not in a thin client)
        self.delivery_barrier: ReadBarrier | None = None
        self.judge: Judge | None = None
        self.barrier: ReadBarrier | None = None
        # Where a proposal's `seen` is read: the read barrier's shared rounds, or a
        # thin client's own (straight from Kafka: through a worker it took three hops).
        self.seen_offsets: EndOffsets | None = None
        self.query: QueryClient | None = None
        self.lookups: Lookups | None = None
        self.ownership_listeners: list[Callable[[list[int]], None]] = []
        self.timings: dict[str, float] = {}
        # Set when this process's state stopped being of its namespace's topics
        # (deleted and created again while it ran): calls are refused, nothing
        # more is judged or served; listeners hear the reason (a worker exits).
        self.failed: str | None = None
        self.failure_listeners: list[Callable[[str], None]] = []
        self.watch: incarnation.Watch | None = None
        # The ids of the topics this process opened against (None: not readable);
        # its records carry them (INCARNATION_HEADER in threadlog/kernel/topics.py).
        self.topic_ids: dict[str, str] | None = None
        self.origin: Origin | None = None  # the log this state is folded from (a worker's snapshots name it)

    def start(self) -> None:
        t0 = time.monotonic()
        # A thin client judges no proposal, but its delivery readers fold their run's
        # records (`run_index.RunFold`): it decodes as judges do.
        problem = avro_reader_problem() if self.thin else judging_problem()
        if problem is not None:  # see threadlog/kernel/validation.py
            raise invalid_argument(problem)
        kafka = self.opts.kafka
        if kafka:
            log.info("kafka properties for %s: %s", self.client_id, kafka_config.redacted(kafka))
        trap = kafka_config.ErrorTrap(kafka.get("error_cb"))
        self.admin = AdminClient(kafka_config.base(self.opts.bootstrap_servers, f"{self.client_id}.admin",
                                                   kafka, trap))
        self.shared_admin = kafka_config.SharedAdmin(self.admin)
        # Fails within about a second on wrong credentials, not after request_timeout;
        # its errors already name librdkafka's cause.
        kafka_config.reach(self.admin, trap, self.opts.request_timeout, kafka)
        created: list[str] = []
        try:
            self.layout = ensure_topics(
                self.admin, self.topics, self.opts.partitions, self.opts.delivery_retention_ms,
                timeout=self.opts.request_timeout, replication_factor=self.opts.replication_factor,
                min_insync_replicas=self.opts.min_insync_replicas, created=created,
            ) if self.opts.create_topics else require_topics(
                self.admin, self.topics, self.opts.request_timeout,
                replication_factor=self.opts.replication_factor, min_insync_replicas=self.opts.min_insync_replicas)
        except ThreadLogError as exc:
            raise trap.explain(exc, self.admin, kafka) from None
        if self.topics.events in created:
            # First, before this client proposes anything: a new namespace is judged
            # by the newest rules from its start (producers/rules_floor.py says why).
            write_floor_markers(self.opts.bootstrap_servers, self.topics.events, self.layout.events, self.codec,
                                self.client_id, kafka, self.opts.request_timeout)
        self.timings["topics"] = time.monotonic() - t0
        if not self.thin:
            # A thin client keeps no state: it takes no slot (the one it took sat
            # empty while an embedded client of the host refolded in the next).
            self.slot = claim_slot(self.opts.namespace_state)
            stale = self.opts.namespace_state / self.opts.namespace
            if self.opts.state_dir is None and (stale / "slot-0").is_dir():
                # Earlier versions named the namespace twice under the default root. That state is
                # derived (refolded, or restored from a snapshot), so it is not moved.
                log.warning("state of an older layout at %s is no longer used; delete it", stale)
        if self.thin or self.worker:
            # Thin clients ask the workers; a worker asks the other workers
            # (cross-partition facts of partitions it does not own).
            self.query = QueryClient(self.opts.bootstrap_servers, self.topics.members, self.client_id,
                                     self.opts.request_timeout, self.opts.kafka, partitions=self.layout.events)
            self.query.start(warn_alone=self.thin)
        self.ends = LatestOffsets(self.opts.bootstrap_servers, self.client_id, kafka)
        ids = self.topic_ids = incarnation.topic_ids(self.admin, [self.topics.events, self.topics.deliveries],
                                                     min(10.0, self.opts.request_timeout))
        if self.thin:
            self.seen_offsets = EndOffsets(self.ends, self.topics.events, self.layout.events,
                                           self.opts.request_timeout)
            # A thin client keeps no state, but what it learned of this incarnation
            # (where runs live, read floors as offsets) is wrong in another: it stops
            # too, as every other process does.
            self._watch(ids)
            self.timings["started"] = time.monotonic() - t0
            return
        assert self.slot is not None
        if ids is not None:
            incarnation.settle(self.slot.path, ids)  # before any store of the slot opens
        # Snapshots name the log they were folded from; only those of this one are restored.
        self.origin = Origin(self.topics.events, (ids or {}).get(self.topics.events))
        self.stores = PartitionStores(self.slot.path, self.topics.events)
        self.index_store = Store(self.slot.path / "deliveries")
        self.deliveries = DeliveryIndex(self.opts.bootstrap_servers, self.topics.deliveries,
                                        self.layout.deliveries, self.index_store, self.codec, self.client_id,
                                        kafka=kafka, owned=set() if self.worker else None)
        self.delivery_barrier = ReadBarrier(self.ends, self.deliveries, timeout=self.opts.request_timeout,
                                            replaced=self._replaced)
        self._vet_incarnation(self.deliveries, self.topics.deliveries)
        self.deliveries.start()
        group = None
        restore = None
        if self.worker:
            assert self.query is not None
            self.lookups = Lookups(self.query)
            group = f"{self.opts.namespace}.judges"
            restore = self._restore
        self.judge = Judge(
            self.opts.bootstrap_servers, self.topics.events, self.layout.events, self.stores,
            self.codec, self.client_id, kafka=kafka, group=group, lookups=self.lookups,
            restore=restore, peek=self._peek if restore is not None else None, resume_gap=self.resume_gap,
            on_ownership=self._ownership_changed,
        )
        self._vet_incarnation(self.judge, self.topics.events)
        self.judge.start()
        if self.worker:
            writer = SnapshotWriter(self.opts.bootstrap_servers, self.topics.snapshots, self.client_id, kafka,
                                    origin=self.origin, timeout=self.opts.request_timeout * 2)
            self.snapshotter = Snapshotter(self.judge, writer, self.snapshot_every, self.snapshot_interval_s)
            self.ownership_listeners.append(self.snapshotter.ownership_changed)
            self.judge.before_giving_up = self.snapshotter.giving_up
            self.snapshotter.start()
        self.barrier = self.seen_offsets = ReadBarrier(self.ends, self.judge, timeout=self.opts.request_timeout,
                                                       replaced=self._replaced)
        self._watch(ids)
        self.timings["started"] = time.monotonic() - t0

    def _watch(self, ids: dict[str, str] | None) -> None:
        """Stop (`_incarnation_changed`) if the namespace's topics are replaced under us."""
        if ids is not None:
            assert self.shared_admin is not None
            self.watch = incarnation.Watch(self.shared_admin, ids, self._incarnation_changed)
            self.watch.start()

    def _vet_incarnation(self, follower: Follower, topic: str) -> None:
        """Have `follower` check the incarnation named by the records it folds (Follower._foreign)."""
        if self.topic_ids is not None and topic in self.topic_ids:
            follower.incarnation = self.topic_ids[topic].encode()
            follower.replaced = self._replaced

    def record_headers(self, topic: str, reply_header: Headers | None) -> Headers | None:
        """The headers of every record this process writes to `topic`: the reply
        token a worker pushes its answers by (thin clients), and the incarnation
        of `topic` it opened against (if known)."""
        tid = (self.topic_ids or {}).get(topic)
        return [*(reply_header or ()), *(() if tid is None else [(INCARNATION_HEADER, tid.encode())])] or None

    def _replaced(self) -> str | None:
        """Were the topics replaced under us? Asked by a read barrier that found a
        folded position past its partition's end (projections/barrier.py)."""
        if self.failed is not None:
            return self.failed
        return self.watch.confirm() if self.watch is not None else None

    def _incarnation_changed(self, reason: str) -> None:
        """The topics were deleted and created again under this process (projections/incarnation.py)."""
        self.failed = reason
        # Halt, not stop: `stop()` closes what is halted here. No more judging or
        # folding of a log this state is not of, and no snapshot of that state.
        for part in (self.snapshotter, self.judge):
            if part is not None:
                part.halt()
        if self.deliveries is not None:
            self.deliveries.halt(reason)
        for listener in list(self.failure_listeners):
            listener(reason)

    def _restore(self, partition: int, store: Store, cancel: threading.Event | None = None) -> RestoreInfo | None:
        """A partition taken over without local state: from its latest snapshot (None: fold from 0)."""
        return restore_snapshot(self.opts.bootstrap_servers, self.topics.snapshots, partition, store,
                                self.client_id, self.opts.kafka, timeout=self.opts.request_timeout,
                                origin=self.origin, cancel=cancel)

    def _peek(self, partition: int, cancel: threading.Event) -> int | None:
        """The position of a partition's latest snapshot (is it worth restoring over a kept store?)."""
        return latest_snapshot_position(self.opts.bootstrap_servers, self.topics.snapshots, partition,
                                        self.client_id, self.opts.kafka, timeout=self.opts.request_timeout,
                                        origin=self.origin, cancel=cancel)

    def _ownership_changed(self, owned: list[int]) -> None:
        if self.deliveries is not None and self.layout is not None:
            mine = set(owned)
            self.deliveries.set_owned({d for d in range(self.layout.deliveries)
                                       if owner_partition(d, self.layout.events) in mine})
        for listener in list(self.ownership_listeners):
            listener(owned)

    @property
    def thin(self) -> bool:
        """No judge here: a worker answers (processors="external")."""
        return self.opts.processors == "external"

    @property
    def store(self) -> PartitionStores | None:
        """The events state judged here (every partition, or a worker's own)."""
        return self.stores

    def partition_of(self, key: str) -> int:
        assert self.layout is not None
        return partition_for(key, self.layout.events)

    def stop(self) -> None:
        if self.watch is not None:
            self.watch.stop()
        if self.snapshotter is not None:
            self.snapshotter.stop()
        if self.judge is not None:
            self.judge.stop()
        if self.deliveries is not None:
            self.deliveries.stop()
        if self.query is not None:
            self.query.close()
        if self.stores is not None:
            self.stores.close()
        if self.index_store is not None:
            self.index_store.close()
        if self.ends is not None:
            self.ends.close()
        if self.shared_admin is not None:  # made with `admin`, at once
            self.shared_admin.close()  # destroyed now, not at gc (kafka_config.dispose), once no thread asks it
        if self.slot is not None:
            self.slot.release()
