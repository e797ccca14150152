"""The namespace's topics: names, configs, idempotent creation."""

from __future__ import annotations

import time
from dataclasses import dataclass

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, ClusterMetadata, ConfigResource, NewTopic

from .errors import invalid_argument, namespace_not_found, unavailable

MAX_MESSAGE_BYTES = 16 * 1024 * 1024
HOUR_MS = 3600 * 1000

# The header of a thin client's proposals naming where its verdicts are pushed
# (processors/verdict_push.py); its value is the client's reply token, the
# hash of the secret (at most MAX_REPLY_SECRET_BYTES) it subscribes with.
REPLY_HEADER = "threadlog.reply"
# The header naming the incarnation of the topic a client wrote a record for:
# the topic id (base64 text) the client read when it opened. Why: a namespace
# deleted and created again under a running judge, whose new log had already
# grown past the judge's stored positions, was judged from those positions
# onto the old state (librdkafka does not notice a topic recreated under the
# same name), wrong verdicts answered until the incarnation watch's next round
# (up to 10 s). A record naming another id makes the judge ask at once
# (`Follower._foreign`); the header never changes a verdict.
INCARNATION_HEADER = "threadlog.topic"
MAX_REPLY_SECRET_BYTES = 64
# The query service's refusal of an answer too long for one line (a code of
# the wire protocol between clients and workers, not of the public API).
ANSWER_TOO_LARGE = "ANSWER_TOO_LARGE"


def reply_of(headers: list[tuple[str, bytes | None]] | None) -> bytes | None:
    """The reply token of a record's headers, if it carries one."""
    if headers:
        for name, value in headers:
            if name == REPLY_HEADER:
                return value
    return None


@dataclass(frozen=True)
class Topics:
    namespace: str

    @property
    def events(self) -> str:
        return f"{self.namespace}.events"

    @property
    def deliveries(self) -> str:
        return f"{self.namespace}.deliveries"

    @property
    def blobs(self) -> str:
        return f"{self.namespace}.blobs"

    @property
    def members(self) -> str:
        return f"{self.namespace}.members"

    @property
    def snapshots(self) -> str:
        return f"{self.namespace}.snapshots"

    def all(self) -> list[str]:
        return [self.events, self.deliveries, self.blobs, self.members, self.snapshots]


# Kafka's limit on a topic name's length (`Topic.MAX_NAME_LENGTH`).
MAX_TOPIC_NAME = 249
# Why a bound of its own: a longer namespace names a topic Kafka refuses, and
# its refusal reached `open` as UNAVAILABLE -- "retry later" for a name no
# retry can help (a review).
MAX_NAMESPACE = MAX_TOPIC_NAME - max(map(len, Topics("").all()))


@dataclass(frozen=True)
class TopicLayout:
    """Partition counts as they exist on the cluster (the source of truth)."""

    events: int
    deliveries: int
    blobs: int
    members: int = 1
    snapshots: int = 0  # as many as events on a namespace threadlog created


@dataclass(frozen=True)
class Durability:
    """Replicas of every topic and how many must hold a write before it is acknowledged."""

    replication_factor: int
    min_insync_replicas: int

    @classmethod
    def choose(cls, brokers: int, replication_factor: int | None, min_insync_replicas: int | None,
               creating: bool = True) -> Durability:
        """Defaults min(3, brokers) and min(2, RF): with acks=all (every threadlog
        producer), an acknowledged write is on at least two brokers whenever the
        cluster has two, so losing any one broker loses nothing acknowledged.

        `creating`: topics are to be created, so the brokers alive must hold the
        replicas. Not so when every topic exists: asked for 3 replicas with one
        broker of three down -- the outage they are for -- a worker's restart was
        refused "needs 3 brokers" (a review); existing topics are only compared."""
        rf = min(3, max(1, brokers)) if replication_factor is None else replication_factor
        if creating and rf > brokers:
            raise invalid_argument(f"replication_factor={rf} needs {rf} brokers; the cluster has {brokers}")
        isr = min(2, rf) if min_insync_replicas is None else min_insync_replicas
        if isr > rf and (creating or replication_factor is not None):
            raise invalid_argument(f"min_insync_replicas={isr} cannot exceed the replication factor {rf}")
        return cls(rf, isr)


# Settings a namespace's topics must have for threadlog to be correct, checked
# on topics that already exist (created by someone else, or by an older version).
# `events` keeps every proposal (a rebuild, a new judge and time travel read it
# from offset 0): a retention there deletes facts (a review pre-created it with
# retention.ms=60000 and open accepted it).
REQUIRED_CONFIG = {
    "events": {"cleanup.policy": "delete", "message.timestamp.type": "LogAppendTime",
               "retention.ms": "-1", "retention.bytes": "-1"},
    "deliveries": {"cleanup.policy": "delete"},
    "blobs": {"cleanup.policy": "compact"},
    "members": {"cleanup.policy": "compact"},
    "snapshots": {"cleanup.policy": "compact"},
}

# Snapshot chunks are at most projections/snapshots.py's CHUNK_BYTES (512 KiB)
# of payload plus a small header; a producer batch stays under 1 MB.
SNAPSHOT_MAX_MESSAGE_BYTES = 2 * 1024 * 1024
# Blob chunks: at most 1 MiB (producers/blob_chunks.py MAX_CHUNK) plus headers.
BLOBS_MAX_MESSAGE_BYTES = 2 * 1024 * 1024

# The least `max.message.bytes` each topic needs: the records threadlog writes
# there pass the size checks of its writers. Smaller, a write the API accepted
# came back UNAVAILABLE ("not written", as if the cluster were down) -- a review
# pre-created the topics at 100 000 bytes and a 2 MB blob put failed so.
MIN_MESSAGE_BYTES = {"events": MAX_MESSAGE_BYTES, "deliveries": MAX_MESSAGE_BYTES,
                     "blobs": BLOBS_MAX_MESSAGE_BYTES, "snapshots": SNAPSHOT_MAX_MESSAGE_BYTES}


def specs(topics: Topics, partitions: int, delivery_retention_ms: int,
          durability: Durability | None = None, snapshot_partitions: int | None = None) -> list[NewTopic]:
    """`snapshot_partitions`: the events topic's count when it already exists (default `partitions`)."""
    durability = durability or Durability(1, 1)
    rf = durability.replication_factor
    isr = {"min.insync.replicas": str(durability.min_insync_replicas)}
    big = {"max.message.bytes": str(MAX_MESSAGE_BYTES), **isr}
    return [
        # Proposals, judged in partition order: the source of truth, kept forever,
        # never compacted. Stamped with the broker's clock (LogAppendTime): a
        # proposal's own time is capped by it, so a wrong client clock cannot
        # run a partition's decision time far ahead (processors/judge.py).
        NewTopic(topics.events, partitions, rf,
                 config={**big, "retention.ms": "-1", "retention.bytes": "-1",
                         "message.timestamp.type": "LogAppendTime"}),
        NewTopic(topics.deliveries, partitions, rf,
                 config={**big, "retention.ms": str(delivery_retention_ms)}),
        # Blob manifests and chunks: the latest record per key wins; tombstones reclaim.
        NewTopic(topics.blobs, partitions, rf,
                 config={**isr, "max.message.bytes": str(BLOBS_MAX_MESSAGE_BYTES), "cleanup.policy": "compact",
                         "min.cleanable.dirty.ratio": "0.1", "segment.ms": str(HOUR_MS)}),
        # Query workers announce themselves here (threadlog/members.py): key = worker
        # id, latest heartbeat wins, a tombstone on clean exit. One partition: a
        # client reads the whole (small, compacted) membership at open.
        NewTopic(topics.members, 1, rf,
                 config={**isr, "cleanup.policy": "compact", "min.cleanable.dirty.ratio": "0.1",
                         "segment.ms": str(HOUR_MS), "delete.retention.ms": str(HOUR_MS)}),
        # State snapshots of each events partition (projections/snapshots.py), on the
        # same partition number: chunk keys of one snapshot id, then the `manifest`
        # key; the next snapshot tombstones the previous one's chunks, so after
        # compaction a partition holds about one snapshot. Segments roll hourly (or
        # at 64 MiB) so superseded snapshots become compactable.
        NewTopic(topics.snapshots, snapshot_partitions or partitions, rf,
                 config={**isr, "max.message.bytes": str(SNAPSHOT_MAX_MESSAGE_BYTES),
                         "cleanup.policy": "compact", "min.cleanable.dirty.ratio": "0.1",
                         "segment.ms": str(HOUR_MS), "segment.bytes": str(64 * 1024 * 1024),
                         "delete.retention.ms": str(HOUR_MS)}),
    ]


def ensure_topics(
    admin: AdminClient,
    topics: Topics,
    partitions: int = 4,
    delivery_retention_ms: int = 7 * 24 * HOUR_MS,
    timeout: float = 30.0,
    replication_factor: int | None = None,
    min_insync_replicas: int | None = None,
    created: list[str] | None = None,
) -> TopicLayout:
    """Create missing topics (idempotent), check the existing ones, and return
    the layout the cluster has. `created` gets the names this call created."""
    deadline = time.monotonic() + timeout
    try:
        md0 = admin.list_topics(timeout=timeout)
    except KafkaException as exc:
        raise unavailable(f"cluster metadata unavailable: {exc}") from None
    brokers = len(md0.brokers)
    # Only the missing ones: a principal without Create (the README's deploy-job
    # setup) opens an existing namespace. Asking to create every topic failed it
    # with TOPIC_AUTHORIZATION_FAILED though every topic was there.
    absent = {name for name in topics.all() if name not in md0.topics}
    durability = Durability.choose(brokers, replication_factor, min_insync_replicas, creating=bool(absent))
    # A namespace from before the snapshots topic: one snapshot partition per events partition.
    events = md0.topics.get(topics.events)
    snapshot_partitions = len(events.partitions) if events is not None and events.partitions else None
    missing = [spec for spec in specs(topics, partitions, delivery_retention_ms, durability, snapshot_partitions)
               if spec.topic in absent]
    try:
        futures = admin.create_topics(missing, operation_timeout=timeout, request_timeout=timeout) if missing else {}
    except KafkaException as exc:
        raise unavailable(f"cannot create topics: {exc}") from None
    for name, fut in futures.items():
        try:
            fut.result(timeout=max(0.1, deadline - time.monotonic()))
            if created is not None:
                created.append(name)
        except KafkaException as exc:
            err = exc.args[0] if exc.args else None
            if isinstance(err, KafkaError) and err.code() == KafkaError.TOPIC_ALREADY_EXISTS:
                continue  # created meanwhile by another process
            if isinstance(err, KafkaError) and err.code() in (KafkaError.TOPIC_AUTHORIZATION_FAILED,
                                                              KafkaError.CLUSTER_AUTHORIZATION_FAILED):
                # Retrying will not grant it: not retryable, and says what would.
                raise unavailable(f"cannot create topic {name}: {exc}: this principal needs Create on the "
                                  f"topic prefix {topics.namespace}. (README, ACLs), or the namespace created "
                                  "first by one that has it", retryable=False) from None
            raise unavailable(f"cannot create topic {name}: {exc}") from None
        except Exception as exc:  # the future's own timeout: str() is empty
            raise unavailable(f"cannot create topic {name}: {exc or f'no answer within {timeout:g}s'}") from None
    layout, md = _describe(admin, topics, deadline)
    check_topics(admin, topics, md, deadline, replication_factor, min_insync_replicas)
    return layout


def _topic_configs(admin: AdminClient, topics: Topics, names: list[str], deadline: float) -> dict:
    """The configs of `names`, asked until the deadline while a broker does not know them yet.

    Why ask again: right after CreateTopics, the broker that answers
    DescribeConfigs may not have the new topics in its metadata yet (seen on a
    3-broker cluster: UNKNOWN_TOPIC_OR_PART for topics created a moment before).
    """
    resources = [ConfigResource(ConfigResource.Type.TOPIC, name) for name in names]
    while True:
        try:
            return {res.name: fut.result(timeout=max(0.5, deadline - time.monotonic()))
                    for res, fut in admin.describe_configs(resources).items()}
        except KafkaException as exc:
            err = exc.args[0] if exc.args else None
            unknown = isinstance(err, KafkaError) and err.code() == KafkaError.UNKNOWN_TOPIC_OR_PART
            if not unknown or time.monotonic() + 0.1 >= deadline:
                raise unavailable(f"cannot read the settings of {topics.namespace}'s topics: {exc}") from None
            time.sleep(0.1)  # a backoff before asking again, not a wait for an event
        except TimeoutError:  # the future's own timeout: callers expect ThreadLogError only
            raise unavailable(f"cannot read the settings of {topics.namespace}'s topics within the "
                              "request timeout") from None


def check_topics(admin: AdminClient, topics: Topics, md: ClusterMetadata, deadline: float,
                 replication_factor: int | None = None, min_insync_replicas: int | None = None) -> None:
    """Every existing topic has the settings threadlog relies on; all mismatches
    are reported at once, in one INVALID_ARGUMENT (changing them is the
    operator's decision: threadlog never alters an existing topic).

    The replication factor is checked only when the caller named one
    (`replication_factor`): the default follows the brokers alive now, so comparing
    with it refused every open of a namespace of 3 replicas while one broker
    of 3 was down -- the very outage 3 replicas are for -- and a namespace
    made with another factor could not be served by `threadlog worker`.
    Unnamed, `min.insync.replicas` must be min(2, the topic's own factor):
    what the default guarantee (an acknowledged write on two brokers) needs."""
    roles = {topics.events: "events", topics.deliveries: "deliveries", topics.blobs: "blobs",
             topics.members: "members", topics.snapshots: "snapshots"}
    configs = _topic_configs(admin, topics, list(roles), deadline)
    problems = []
    for name, role in roles.items():
        meta = md.topics.get(name)
        isr = min_insync_replicas
        if meta is not None and meta.partitions:
            rf = min(len(p.replicas) for p in meta.partitions.values())
            if replication_factor is not None and rf != replication_factor:
                problems.append(f"{name}: replication factor {rf}, expected {replication_factor} "
                                "(a topic's factor changes only by reassigning its partitions)")
            if isr is None:
                isr = min(2, rf)
        entries = configs.get(name, {})
        wanted = dict(REQUIRED_CONFIG[role])
        if isr is not None:  # None only for a topic not in `md` (its replicas unknown)
            wanted["min.insync.replicas"] = str(isr)
        for key, value in wanted.items():
            have = entries[key].value if key in entries else None
            if have != value:
                problems.append(f"{name}: {key}={have}, expected {value}")
        least = MIN_MESSAGE_BYTES.get(role)
        have_max = entries["max.message.bytes"].value if "max.message.bytes" in entries else None
        if least is not None and (have_max is None or not have_max.isdigit() or int(have_max) < least):
            problems.append(f"{name}: max.message.bytes={have_max}, expected at least {least}")
    events, snaps = md.topics.get(topics.events), md.topics.get(topics.snapshots)
    if events is not None and snaps is not None and events.partitions and snaps.partitions \
            and len(snaps.partitions) < len(events.partitions):
        problems.append(f"{topics.snapshots}: {len(snaps.partitions)} partitions, expected "
                        f"{len(events.partitions)} (one per partition of {topics.events})")
    if problems:
        raise invalid_argument(
            f"the topics of namespace {topics.namespace!r} do not have the settings threadlog needs "
            f"({'; '.join(problems)}): fix the settings with kafka-configs (a replication factor by "
            "reassigning partitions) or use a new namespace; a durability asked for (replication_factor= / "
            "min_insync_replicas=, the worker's --replication-factor / --min-insync-replicas) must match the topics")


def describe(admin: AdminClient, topics: Topics, deadline: float) -> TopicLayout:
    return _describe(admin, topics, deadline)[0]


def _describe(admin: AdminClient, topics: Topics, deadline: float) -> tuple[TopicLayout, ClusterMetadata]:
    """The layout, once every topic is visible, with the metadata it was read from."""
    while True:
        try:
            md = admin.list_topics(timeout=max(0.5, deadline - time.monotonic()))
        except KafkaException as exc:
            raise unavailable(f"cluster metadata unavailable: {exc}") from None
        counts = {}
        for name in topics.all():
            t = md.topics.get(name)
            if t is not None and t.error is None and t.partitions:
                counts[name] = len(t.partitions)
        if len(counts) == len(topics.all()):
            return TopicLayout(
                events=counts[topics.events],
                deliveries=counts[topics.deliveries],
                blobs=counts[topics.blobs],
                members=counts[topics.members],
                snapshots=counts[topics.snapshots],
            ), md
        if time.monotonic() > deadline:
            missing = sorted(set(topics.all()) - set(counts))
            raise unavailable(f"topics not visible in metadata: {missing}")
        time.sleep(0.05)


def delete_topics(admin: AdminClient, topics: Topics, timeout: float = 30.0) -> None:
    futures = admin.delete_topics(topics.all(), operation_timeout=timeout)
    for fut in futures.values():
        try:
            fut.result(timeout=timeout)
        except Exception:
            pass


def require_topics(admin: AdminClient, topics: Topics, timeout: float = 30.0,
                   replication_factor: int | None = None,
                   min_insync_replicas: int | None = None) -> TopicLayout:
    """The layout of a namespace that must already exist; never creates a topic.

    Read-only commands use this, so a mistyped namespace is an error instead
    of three new empty topics. A namespace with none of its topics fails at
    once; one with some (still being created elsewhere) gets until `timeout`.
    A caller that names a durability gets it checked, as `ensure_topics`
    checks it: asked for and not there is an error, never ignored.
    """
    deadline = time.monotonic() + timeout
    try:
        md = admin.list_topics(timeout=timeout)
    except KafkaException as exc:
        err = exc.args[0] if exc.args else None
        text = err.str() if isinstance(err, KafkaError) else exc
        raise unavailable(f"cluster metadata unavailable: {text}") from None
    if not any(name in md.topics for name in topics.all()):
        raise namespace_not_found(
            f"namespace {topics.namespace!r} does not exist (no topics {', '.join(topics.all())})")
    try:
        layout, md = _describe(admin, topics, deadline)  # the metadata every topic is visible in
    except Exception as exc:
        if getattr(exc, "code", None) != "UNAVAILABLE" or "not visible" not in str(exc):
            raise
        raise namespace_not_found(f"namespace {topics.namespace!r} is incomplete: {exc}") from None
    if replication_factor is not None or min_insync_replicas is not None:
        # Validates what was asked (min.insync.replicas within the replicas asked).
        Durability.choose(len(md.brokers), replication_factor, min_insync_replicas, creating=False)
        check_topics(admin, topics, md, deadline, replication_factor, min_insync_replicas)
    return layout
