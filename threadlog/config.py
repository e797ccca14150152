"""Options of `threadlog.open`, validated in one place (SPEC section 2)."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .kernel import kafka_config
from .kernel.checkpoint_rules import MAX_LEASE_MS
from .kernel.errors import invalid_argument
from .kernel.topics import MAX_NAMESPACE, MAX_TOPIC_NAME
from .kernel.validation import is_int

# \Z: "$" also matches before a final newline. Not only dots: a namespace names a
# folder under the state root, and "." or ".." is that root or its parent (a
# demo's clean-up removed the parent folder's every file).
NAMESPACE = re.compile(r"(?!\.+\Z)[A-Za-z0-9._-]+\Z")


def default_state_root() -> Path:
    base = os.environ.get("THREADLOG_STATE_DIR") or os.path.join(
        os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state"), "threadlog", "state"
    )
    return Path(base)


@dataclass(frozen=True)
class Options:
    bootstrap_servers: str
    namespace: str = "threadlog"
    processors: str = "embedded"
    lease_duration_ms: int = 120_000
    renew_after_ms: int = 45_000
    clock: Callable[[], float] | None = None
    first_chunk_wait_ms: int = 5_000
    state_dir: str | None = None
    partitions: int = 4
    request_timeout_ms: int = 30_000
    delivery_retention_ms: int = 7 * 24 * 3600 * 1000
    # librdkafka properties for every client threadlog creates (kafka_config).
    # Kept out of repr: it may hold secrets (sasl.password...).
    kafka: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False, hash=False)
    # False: only use a namespace that exists (read-only commands must not
    # create topics as a side effect of a typo): NAMESPACE_NOT_FOUND otherwise.
    create_topics: bool = True
    # Durability of new topics. None: min(3, brokers) replicas, and
    # min.insync.replicas = min(2, replication factor) -- with acks=all, an
    # acknowledged write then survives the loss of any one broker.
    replication_factor: int | None = None
    min_insync_replicas: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.bootstrap_servers, str) or not self.bootstrap_servers:
            raise invalid_argument("bootstrap_servers must be a non-empty string")
        if not isinstance(self.namespace, str) or not NAMESPACE.match(self.namespace):
            raise invalid_argument(f"namespace must match [A-Za-z0-9._-]+ and not be only dots, got {self.namespace!r}")
        if len(self.namespace) > MAX_NAMESPACE:
            raise invalid_argument(f"namespace must be at most {MAX_NAMESPACE} characters (its topics' names are "
                                   f"at most {MAX_TOPIC_NAME}), got {len(self.namespace)}")
        if self.processors not in ("embedded", "external"):
            raise invalid_argument(f"processors must be 'embedded' or 'external', got {self.processors!r}")
        for name in ("lease_duration_ms", "renew_after_ms", "first_chunk_wait_ms",
                     "partitions", "request_timeout_ms", "delivery_retention_ms"):
            value = getattr(self, name)
            if not is_int(value) or value <= 0:
                raise invalid_argument(f"{name} must be a positive int, got {value!r}")
        if self.lease_duration_ms > MAX_LEASE_MS:
            raise invalid_argument(f"lease_duration_ms must be at most {MAX_LEASE_MS} (30 days), "
                                   f"got {self.lease_duration_ms}")
        if self.renew_after_ms >= self.lease_duration_ms:
            raise invalid_argument(
                f"renew_after_ms ({self.renew_after_ms}) must be less than "
                f"lease_duration_ms ({self.lease_duration_ms})"
            )
        if self.clock is not None and not callable(self.clock):
            raise invalid_argument("clock must be a callable returning epoch ms")
        if self.state_dir is not None and not isinstance(self.state_dir, (str, os.PathLike)):
            raise invalid_argument("state_dir must be a path")
        # A file where the state goes is the caller's mistake, not an outage: it
        # surfaced as UNAVAILABLE ("Not a directory"), which callers may retry.
        for path in (self.state_root, self.namespace_state):
            try:
                a_file = path.exists() and not path.is_dir()
            except OSError:  # e.g. not searchable: left to the open, which says why
                a_file = False
            if a_file:
                raise invalid_argument(f"state_dir: {str(path)!r} is not a directory")
        for name in ("replication_factor", "min_insync_replicas"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value <= 0):
                raise invalid_argument(f"{name} must be a positive int or None, got {value!r}")
        if (self.replication_factor is not None and self.min_insync_replicas is not None
                and self.min_insync_replicas > self.replication_factor):
            raise invalid_argument(f"min_insync_replicas ({self.min_insync_replicas}) cannot exceed "
                                   f"replication_factor ({self.replication_factor})")
        if not isinstance(self.create_topics, bool):
            raise invalid_argument(f"create_topics must be a bool, got {self.create_topics!r}")
        # Frozen: replace the caller's mapping by the checked copy, so a later
        # change to their dict cannot reach clients created afterwards.
        object.__setattr__(self, "kafka", kafka_config.check(self.kafka))
        kafka_config.validate(self.bootstrap_servers, self.kafka)

    @property
    def state_root(self) -> Path:
        """The root the namespace's directory goes under: `state_dir`, else
        $THREADLOG_STATE_DIR, else ~/.local/state/threadlog/state. The one place
        that picks it: every store path is `<root>/<namespace>/slot-N`, whichever
        way the root was given (the default once added the namespace twice)."""
        return Path(self.state_dir) if self.state_dir is not None else default_state_root()

    @property
    def namespace_state(self) -> Path:
        """`<root>/<namespace>`: where this namespace's slots are."""
        return self.state_root / self.namespace

    @property
    def request_timeout(self) -> float:
        return self.request_timeout_ms / 1000.0
