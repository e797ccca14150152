"""What one process runs for a namespace: topics, store, judge, read barrier.

`threadlog worker` and an embedded `threadlog.open` (the default) build the
full runtime: the judge (processors/judge.py) folds the namespace's `events`
partitions, deciding every proposal in offset order, into this process's
RocksDB store; the read barrier waits for it.

A thin client (`processors="external"`) builds no judge and folds no
`events`: verdicts, barriers and reads come from a worker through `query`
(threadlog/remote.py). Its store still holds the run index of the delivery
log, which every client folds from `<ns>.deliveries` itself for now
(threadlog/delivery.py) -- moving that to workers is a later step.
"""

from __future__ import annotations

import logging
import time
import uuid

from confluent_kafka.admin import AdminClient

from . import kafka_config
from .config import Options
from .errors import ThreadLogError
from .partitioning import partition_for
from .processors.handlers import load_all as load_handlers
from .processors.judge import Judge
from .projections.barrier import ReadBarrier
from .projections.fold import load_all as load_folds
from .projections.store import Store, open_slot
from .remote import QueryClient
from .schemas import Codec, default_codec
from .topics import TopicLayout, Topics, ensure_topics, require_topics

log = logging.getLogger("threadlog.runtime")


class Runtime:
    def __init__(self, opts: Options) -> None:
        load_handlers()
        load_folds()
        self.opts = opts
        self.topics = Topics(opts.namespace)
        self.codec: Codec = default_codec()
        self.client_id = f"{opts.namespace}.{uuid.uuid4().hex[:12]}"
        self.admin: AdminClient | None = None
        self.layout: TopicLayout | None = None
        self.store: Store | None = None
        self.judge: Judge | None = None
        self.barrier: ReadBarrier | None = None
        self.query: QueryClient | None = None
        self.timings: dict[str, float] = {}

    def start(self) -> None:
        t0 = time.monotonic()
        kafka = self.opts.kafka
        if kafka:
            log.info("kafka properties for %s: %s", self.client_id, kafka_config.redacted(kafka))
        trap = kafka_config.ErrorTrap(kafka.get("error_cb"))
        self.admin = AdminClient(kafka_config.base(self.opts.bootstrap_servers, f"{self.client_id}.admin",
                                                   kafka, trap))
        try:
            self.layout = ensure_topics(
                self.admin, self.topics, self.opts.partitions, self.opts.delivery_retention_ms,
                timeout=self.opts.request_timeout, replication_factor=self.opts.replication_factor,
                min_insync_replicas=self.opts.min_insync_replicas,
            ) if self.opts.create_topics else require_topics(self.admin, self.topics, self.opts.request_timeout)
        except ThreadLogError as exc:
            raise trap.explain(exc, self.admin, kafka) from None
        self.timings["topics"] = time.monotonic() - t0
        self.store = open_slot(self.opts.state_root / self.opts.namespace)
        if self.thin:
            self.query = QueryClient(self.opts.bootstrap_servers, self.topics.members, self.client_id,
                                     self.opts.request_timeout, self.opts.kafka)
            self.query.start()
            self.timings["started"] = time.monotonic() - t0
            return
        self.judge = Judge(
            self.opts.bootstrap_servers, self.topics.events, self.layout.events, self.store,
            self.codec, self.client_id, kafka=kafka,
        )
        self.judge.start()
        self.barrier = ReadBarrier(self.admin, self.judge, timeout=self.opts.request_timeout)
        self.timings["started"] = time.monotonic() - t0

    @property
    def thin(self) -> bool:
        """No judge here: a worker answers (processors="external")."""
        return self.opts.processors == "external"

    def partition_of(self, key: str) -> int:
        assert self.layout is not None
        return partition_for(key, self.layout.events)

    def stop(self) -> None:
        if self.query is not None:
            self.query.close()
        if self.judge is not None:
            self.judge.stop()
        if self.store is not None:
            self.store.close()
