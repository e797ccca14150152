"""What one process runs for a namespace: topics, store, follower, barrier, decider.

`threadlog.open` (embedded processors) and `threadlog worker` build the same
runtime; a client with external processors builds it without the decider.
"""

from __future__ import annotations

import hashlib
import logging
import socket
import time
import uuid

from confluent_kafka.admin import AdminClient

from . import kafka_config
from .config import Options
from .errors import invalid_argument
from .partitioning import partition_for
from .processors.decider import Decider
from .processors.handlers import Settings
from .processors.handlers import load_all as load_handlers
from .projections.barrier import ReadBarrier
from .projections.fold import load_all as load_folds
from .projections.follower import Follower
from .projections.store import Store, open_slot
from .schemas import Codec, default_codec
from .topics import TopicLayout, Topics, ensure_topics

log = logging.getLogger("threadlog.runtime")


class Runtime:
    def __init__(self, opts: Options, *, with_decider: bool, instance_id: str | None = None) -> None:
        load_handlers()
        load_folds()
        self.opts = opts
        self.topics = Topics(opts.namespace)
        self.codec: Codec = default_codec()
        self.with_decider = with_decider
        self.client_id = f"{opts.namespace}.{uuid.uuid4().hex[:12]}"
        self._instance_id = instance_id
        self.admin: AdminClient | None = None
        self.layout: TopicLayout | None = None
        self.store: Store | None = None
        self.follower: Follower | None = None
        self.barrier: ReadBarrier | None = None
        self.decider: Decider | None = None
        self.timings: dict[str, float] = {}

    def start(self) -> None:
        t0 = time.monotonic()
        self.admin = AdminClient(kafka_config.base(self.opts.bootstrap_servers, f"{self.client_id}.admin"))
        self.layout = ensure_topics(
            self.admin, self.topics, self.opts.partitions, self.opts.delivery_retention_ms,
            timeout=self.opts.request_timeout,
        )
        if self.layout.commands != self.layout.events:
            raise invalid_argument(
                f"{self.topics.commands} has {self.layout.commands} partitions but "
                f"{self.topics.events} has {self.layout.events}: they must be co-partitioned"
            )
        self.timings["topics"] = time.monotonic() - t0
        self.store = open_slot(self.opts.state_root / self.opts.namespace)
        self.follower = Follower(
            self.opts.bootstrap_servers, self.topics.events, self.layout.events, self.store,
            self.codec, self.client_id,
        )
        self.follower.start()
        self.barrier = ReadBarrier(self.admin, self.follower, timeout=self.opts.request_timeout)
        if self.with_decider:
            self.decider = Decider(
                bootstrap=self.opts.bootstrap_servers,
                topics=self.topics,
                layout=self.layout,
                store=self.store,
                follower=self.follower,
                barrier=self.barrier,
                codec=self.codec,
                instance_id=self.instance_id,
                settings=Settings(self.opts.lease_duration_ms, self.opts.renew_after_ms),
                clock=self.opts.clock,
            )
            self.decider.start()
        self.timings["started"] = time.monotonic() - t0

    @property
    def instance_id(self) -> str:
        """Stable across restarts of the same state slot: a restarted decider
        reuses its transactional ids, which fences its predecessor and aborts
        the transaction it left open instead of waiting for it to time out."""
        if self._instance_id:
            return self._instance_id
        assert self.store is not None
        digest = hashlib.sha1(str(self.store.path.resolve()).encode()).hexdigest()[:10]
        return f"{socket.gethostname()}-{self.store.path.name}-{digest}"

    def wait_assigned(self, timeout: float) -> bool:
        return self.decider is None or self.decider.first_assignment.wait(timeout)

    def partition_of(self, key: str) -> int:
        assert self.layout is not None
        return partition_for(key, self.layout.events)

    def stop(self) -> None:
        if self.decider is not None:
            self.decider.stop()
        if self.follower is not None:
            self.follower.stop()
        if self.store is not None:
            self.store.close()
