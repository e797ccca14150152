"""librdkafka settings shared by every client threadlog creates.

Every producer, consumer and admin client is configured here, so the
properties a user passes (`threadlog.open(..., kafka={...})`, the CLI's
`--kafka-config`) reach all of them through one place: `base()` and the
role-specific builders below layer them over threadlog's tunables and under
the settings threadlog needs for correctness (which `check()` refuses).
"""

from __future__ import annotations

import atexit
import contextlib
import heapq
import itertools
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol, cast

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer

from .errors import UNAVAILABLE, ThreadLogError, invalid_argument
from .topics import MAX_MESSAGE_BYTES

# The user's librdkafka properties (`Options.kafka`), as the client builders take them.
Props = Mapping[str, Any]

_rdkafka_log = logging.getLogger("threadlog.rdkafka")


class _SharedPropertyFilter(logging.Filter):
    """Drop librdkafka's "X is a producer property and will be ignored by this consumer".

    The user's properties go to every client, producers and consumers alike,
    so each would warn about the other role's properties on every start.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not ("property and will be ignored by this" in msg and "CONFWARN" in msg)


class _RepeatFilter(logging.Filter):
    """Let one of each repeated librdkafka line through per window, then count the rest.

    While a broker is unreachable every client logs each failed reconnect
    (`FAIL ... Connection refused`), up to ~30 lines a second per client: a
    service's log, or an example's terminal, drowned in the same line during an
    outage. The first of a kind passes; repeats within `window` seconds are
    dropped, and the next one after the window says how many were. A kind is the
    text with its timings ("after 12ms") masked, so a line that differs only in
    them is a repeat, while another broker or another error is a new kind.

    If no line of the kind comes after the window (the outage ended, or the
    client closed), a timer says how many were dropped when the window ends:
    otherwise the log would show one failure where there were dozens. The
    timers are daemons, so a process exiting within a window says its counts at
    exit (`say_dropped`); the CLI says them before its one coded error line,
    which must stay the last line it prints (a CI run caught a count said after
    it).
    """

    _TIMING = re.compile(r"\d+ms\b")
    _MAX_KINDS = 1024  # bounded: kinds carry broker addresses, which may churn
    _SUMMARY = "threadlog_repeats"  # set on the timer's summary record: it passes as is

    def __init__(self, window: float = 30.0) -> None:
        super().__init__()
        self.window = window
        self._lock = threading.Lock()
        # kind -> [window start, lines dropped, the last line dropped]
        self._kinds: dict[str, list[Any]] = {}
        # Windows with drops, by when they end, said by one thread for them all:
        # a timer thread per window was one more thread for 30 s per client that
        # logged a repeat, so a process retrying open() gathered them (a review).
        self._due: list[tuple[float, int, str, list[Any]]] = []
        self._order = itertools.count()
        self._woken = threading.Condition(self._lock)
        self._sayer: threading.Thread | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, self._SUMMARY, False):
            return True
        kind = self._TIMING.sub("#ms", record.getMessage())
        now = time.monotonic()
        with self._lock:
            entry = self._kinds.get(kind)
            if entry is not None and now - entry[0] < self.window:
                entry[1] += 1
                entry[2] = record
                if entry[1] == 1:  # the window's first drop: make sure the count is said
                    heapq.heappush(self._due, (entry[0] + self.window, next(self._order), kind, entry))
                    if self._sayer is None:
                        self._sayer = threading.Thread(target=self._say_due, name="threadlog.rdkafka-repeats",
                                                       daemon=True)
                        self._sayer.start()
                    self._woken.notify()
                return False
            if len(self._kinds) >= self._MAX_KINDS:
                self._kinds.clear()
            self._kinds[kind] = [now, 0, None]
        if entry is not None and entry[1]:
            record.msg = f"{record.getMessage()} ({entry[1]} more like it in the last {now - entry[0]:.0f}s)"
            record.args = None
        return True

    def say_all(self) -> None:
        """Say every open window's drops now (its timer may never fire: the process exits)."""
        with self._lock:
            pending = [(kind, entry) for kind, entry in self._kinds.items() if entry[1]]
        for kind, entry in pending:
            self._summarize(kind, entry)

    def _say_due(self) -> None:
        """The sayer thread: each window with drops summarized when it ends."""
        while True:
            with self._woken:
                while not self._due or self._due[0][0] > time.monotonic():
                    self._woken.wait(self._due[0][0] - time.monotonic() if self._due else None)
                _, _, kind, entry = heapq.heappop(self._due)
            self._summarize(kind, entry)

    def _summarize(self, kind: str, entry: list[Any]) -> None:
        """The window of `entry` ended: say its drops, unless a later line of the kind already did."""
        with self._lock:
            if self._kinds.get(kind) is not entry:
                return  # a line after the window carried the count (or the kinds were cleared)
            del self._kinds[kind]  # the next line of the kind passes and starts a window
        start, dropped, last = entry
        summary = logging.makeLogRecord({
            **last.__dict__, "args": None, self._SUMMARY: True,
            "msg": f"{last.getMessage()} ({dropped} more like it in the last {time.monotonic() - start:.0f}s)"})
        logging.getLogger(last.name).handle(summary)


_rdkafka_log.addFilter(_SharedPropertyFilter())
_repeats = _RepeatFilter()
_rdkafka_log.addFilter(_repeats)


def say_dropped() -> None:
    """Say how many repeated librdkafka lines each open window dropped, now.

    At exit (registered below, so before logging's own shutdown: atexit runs
    last-in first), and by the CLI before its final error line."""
    _repeats.say_all()


atexit.register(say_dropped)
# The throwaway clients of `validate()` must not add connection noise to the logs.
_validate_log = logging.getLogger("threadlog.rdkafka.validate")
_validate_log.propagate = False
_validate_log.disabled = True

# Properties whose value threadlog depends on for correctness; a user value
# would silently break a guarantee, so it is refused instead of applied.
FORBIDDEN: dict[str, str] = {
    "bootstrap.servers": "pass bootstrap_servers (or --bootstrap) instead",
    "metadata.broker.list": "pass bootstrap_servers (or --bootstrap) instead",
    "enable.idempotence": "retried sends must never duplicate or reorder proposals",
    "acks": "a proposal is a fact only once every in-sync replica has it",
    "request.required.acks": "a proposal is a fact only once every in-sync replica has it",
    "transactional.id": "proposals are idempotent, not transactional: the judge's fold orders them, not a transaction",
    "transaction.timeout.ms": "no threadlog producer is transactional",
    "isolation.level": "only committed transactions are facts",
    "enable.auto.commit": "positions live in the projection store, not in consumer groups",
    "enable.auto.offset.store": "positions live in the projection store, not in consumer groups",
    "group.id": "threadlog assigns partitions itself and owns its group ids",
    # The judges' group (processors/judge.py) restores state on its own
    # assignment callbacks: another protocol or assignor, or a static member
    # id shared by every worker reading the same properties, broke it (a
    # review: the worker exited, its judge thread died, or one worker fenced
    # the other) while open() accepted the properties.
    "group.protocol": "the judges' group uses the classic protocol with its own assignment callbacks",
    "group.remote.assignor": "the judges' group uses the classic protocol with its own assignment callbacks",
    "partition.assignment.strategy": "the judges' group restores state incrementally (cooperative-sticky)",
    "group.instance.id": "every worker is its own group member (a shared static id fences the others)",
    "auto.offset.reset": "a fold must start from the beginning of the log",
    "enable.partition.eof": "readers rely on end-of-partition events to know they caught up",
    "delivery.report.only.error": "writers wait for every delivery report",
    "on_delivery": "writers attach their own delivery callbacks",
    "on_commit": "threadlog does not commit consumer offsets",
}

# Keys whose values are secrets: never logged, printed or put in an error.
# Broad on purpose: a secret logged is worse than a harmless value hidden
# (`sasl.oauthbearer.assertion.private.key.passphrase` was missed by a narrower list).
SECRET_KEY = re.compile(r"password|passphrase|secret|token|oauthbearer\.config|private\.key|key\.pem|jaas|"
                        r"credential", re.IGNORECASE)
REDACTED = "[redacted]"


def is_secret(key: str) -> bool:
    return bool(SECRET_KEY.search(key))


def redacted(props: Mapping[str, Any]) -> dict[str, Any]:
    """`props` fit for a log line or an error: secret values replaced."""
    return {k: (REDACTED if is_secret(k) else v) for k, v in props.items()}


def scrub(text: str, props: Mapping[str, Any] | None) -> str:
    """`text` with every secret value of `props` replaced (librdkafka may quote values)."""
    for key, value in (props or {}).items():
        if is_secret(key) and isinstance(value, str) and value:
            text = text.replace(value, REDACTED)
    return text


def check(kafka: Any) -> dict[str, Any]:
    """Shape-check user properties (no client built): INVALID_ARGUMENT naming the property."""
    if kafka is None:
        return {}
    if not isinstance(kafka, Mapping):
        raise invalid_argument(f"kafka must be a mapping of librdkafka properties, got {type(kafka).__name__}")
    for key in kafka:
        if not isinstance(key, str) or not key:
            raise invalid_argument(f"kafka property names must be non-empty strings, got {key!r}")
    # Every forbidden property at once, in the order given (a file's line order),
    # before any other complaint: naming only the first (an operator review:
    # `enable.idempotence=false` and `acks=1` named only the first) had an operator
    # fix and retry once per property. Names and reasons only: never a value.
    refused = [key for key in kafka if key in FORBIDDEN]
    if len(refused) == 1:
        raise invalid_argument(f"kafka property {refused[0]!r} cannot be overridden: {FORBIDDEN[refused[0]]}")
    if refused:
        raise invalid_argument(f"kafka properties {_listed(refused)} cannot be overridden: "
                               + "; ".join(f"{key!r}: {FORBIDDEN[key]}" for key in refused))
    out: dict[str, Any] = {}
    for key, value in kafka.items():
        # Callbacks (stats_cb, error_cb, oauth_cb, logger...) are librdkafka's
        # callable properties; everything else is a scalar.
        if not (callable(value) or isinstance(value, (str, int, float, bool))):
            raise invalid_argument(
                f"kafka property {key!r} must be a string, number or bool, got {type(value).__name__}")
        out[key] = value
    return out


def validate(bootstrap: str, kafka: Mapping[str, Any]) -> None:
    """Let librdkafka judge the properties now, so a typo fails `open` rather than a later client.

    A throwaway producer and consumer are configured exactly as threadlog's
    own (so conflicts with the enforced settings show too) and destroyed;
    neither sends a request.
    """
    if not kafka:
        return
    for build, make in ((producer, Producer), (consumer, Consumer)):
        try:
            client = make({**build(bootstrap, "threadlog.validate", kafka), "logger": _validate_log})
        except KafkaException as exc:
            raise invalid_argument(_explain(exc, kafka)) from None
        except (TypeError, ValueError) as exc:
            raise invalid_argument(scrub(f"kafka properties refused: {exc}", kafka)) from None
        if isinstance(client, Consumer):
            client.close()
        del client


def dispose(admin: Any) -> None:
    """Destroy an AdminClient now, on a thread of its own (it has no close():
    leaving its context destroys the handle; later calls raise RuntimeError).

    Now, not when it is collected: after a failed start the error's traceback
    holds it in a reference cycle, so its librdkafka threads lived until gc ran
    and a process retrying `open()` gathered them (an operator review). On a
    thread of its own: destroying waits for its broker threads, and one may be
    in a `getaddrinfo` of a host that does not resolve, which nothing
    interrupts -- up to the resolver's 5 s timeout, which the error (or a CLI's
    exit) waited for. The thread is a daemon: a process that exits meanwhile
    takes the client's threads with it."""
    threading.Thread(target=admin.__exit__, args=(None, None, None), name="threadlog.dispose",
                     daemon=True).start()


class SharedAdmin:
    """An AdminClient that threads other than its owner's ask (the incarnation
    watch, readiness checks), destroyed once the last of them is done with it.

    Why: destroying the handle while another thread's call runs on it is
    undefined behaviour in confluent-kafka (its destroy releases the GIL before
    the handle is cleared), and a read barrier's watch question or a readiness
    check given up by its caller's timeout still runs on its thread (a review)."""

    def __init__(self, admin: Any) -> None:
        self._admin = admin
        self._lock = threading.Lock()
        self._users = 0
        self._closed = False

    @contextlib.contextmanager
    def use(self) -> Iterator[Any]:
        """The client, for one call; UNAVAILABLE once closed."""
        with self._lock:
            if self._closed:
                raise ThreadLogError(UNAVAILABLE, "this client is closed")
            self._users += 1
        try:
            yield self._admin
        finally:
            with self._lock:
                self._users -= 1
                last = self._closed and self._users == 0
            if last:
                dispose(self._admin)

    def close(self) -> None:
        """No new users; destroyed now if none is in a call, else by the last one."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            idle = self._users == 0
        if idle:
            dispose(self._admin)


def error_code(exc: BaseException) -> int | None:
    """The librdkafka error code a KafkaException carries (None: none)."""
    err = exc.args[0] if exc.args else None
    return err.code() if isinstance(err, KafkaError) else None


def error_text(exc: BaseException) -> str:
    """librdkafka's own words for `exc`, without the KafkaError{code=...} wrapping, on one line.

    One line: every caller puts them in a one-line message, and librdkafka ends
    some with a newline (`... outside allowed range 0..900000\\n`)."""
    err = exc.args[0] if exc.args else None
    text = err.str() if isinstance(err, KafkaError) else str(exc)
    return " ".join(text.split())


def _listed(keys: list[str]) -> str:
    return ", ".join(repr(key) for key in keys)


def _explain(exc: KafkaException, kafka: Mapping[str, Any]) -> str:
    text = error_text(exc)
    names = _culprits(text, kafka)
    if len(names) == 1:
        prefix = f"kafka property {names[0]!r} refused by librdkafka"
    elif names:
        prefix = f"kafka properties {_listed(names)} refused by librdkafka"
    else:
        prefix = "kafka properties refused by librdkafka"
    return scrub(f"{prefix}: {text}", kafka)


def _culprits(text: str, kafka: Mapping[str, Any]) -> list[str]:
    """The user's properties librdkafka's refusal `text` is about, in the order given.

    librdkafka's own words decide, and the first of these rules that names any:
    1. the properties it names (`Invalid value ... for configuration property
       "ssl.endpoint.identification.algorithm"`, `ssl.ca.location failed: ...`);
    2. the properties whose value it quotes (`Unsupported SASL mechanism: BOGUS`:
       `sasl.mechanism`, or its alias `sasl.mechanisms`, as the user spelled it);
    3. the properties that alone reproduce the very refusal: librdkafka may name
       an alias (`linger.ms` is reported as `queue.buffering.max.ms`) and quote
       no value.
    Why not a probe of each property alone first, as before: librdkafka checks
    a client as a whole too (SASL, TLS, fetch sizes), so a property that is fine
    may fail alone for another reason -- `security.protocol=SASL_PLAINTEXT`
    alone lacks credentials -- and it was blamed for `sasl.mechanism=BOGUS`
    (an operator review). None: the refusal is about no property given (one
    that is missing, say), and librdkafka's words say which.
    """
    named = [key for key in kafka if _names(text, key)]
    if named:
        return named
    # Never by a secret's value: the text shows it scrubbed, and blaming its key
    # would tell that the secret is a word librdkafka wrote.
    quoted = [key for key, value in kafka.items()
              if isinstance(value, str) and not is_secret(key) and any(c.isalpha() for c in value)
              and _mentions(text, value)]
    if quoted:
        return quoted
    return [key for key, value in kafka.items() if _alone_refused(key, value) == _unprefixed(text)]


def _mentions(text: str, word: str) -> bool:
    """Whether `word` is in `text` as a whole: not part of a longer name, value or path."""
    return re.search(rf"(?<![\w./-]){re.escape(word)}(?![\w/-]|\.\w)", text) is not None


def _names(text: str, key: str) -> bool:
    # A dotted name is unmistakable anywhere; an undotted one (`debug`, `retries`)
    # may be an English word, so it counts only quoted as librdkafka quotes names.
    return _mentions(text, key) if "." in key else f'"{key}"' in text or f"`{key}`" in text


# librdkafka's checks of a client as a whole say which client they were building.
_CLIENT_PREFIX = re.compile(r"^Failed to create \w+: ")


def _unprefixed(text: str) -> str:
    return _CLIENT_PREFIX.sub("", text)


def _alone_refused(key: str, value: Any) -> str | None:
    """librdkafka's refusal of a producer configured with `key` alone (None: accepted)."""
    try:
        Producer({"client.id": "threadlog.validate", "logger": _validate_log, key: value})
    except KafkaException as exc:
        return _unprefixed(error_text(exc))
    except (TypeError, ValueError):
        return None  # confluent-kafka's own refusal, never the librdkafka one being explained
    return None


class ErrorTrap:
    """An `error_cb` keeping librdkafka's last error, to say *why* a request timed out.

    librdkafka retries an unreachable broker quietly; a request then ends with
    a bare timeout while the cause (connection refused, TLS, SASL...) went to
    the error callback. `chain` is a user's own `error_cb`, still called.
    """

    def __init__(self, chain: Callable[[KafkaError], None] | None = None) -> None:
        self.last: str | None = None
        # librdkafka's first authentication failure (SASL or TLS client auth):
        # retrying will not fix wrong credentials, so `reach` fails at once.
        self.auth: str | None = None
        self._chain = chain
        self._lock = threading.Lock()

    def __call__(self, err: KafkaError) -> None:
        with self._lock:
            self.last = err.str() if isinstance(err, KafkaError) else str(err)
            if isinstance(err, KafkaError) and err.code() == KafkaError._AUTHENTICATION and self.auth is None:
                self.auth = self.last
        if self._chain is not None:
            self._chain(err)

    def explain(self, exc: ThreadLogError, client: Any, kafka: Mapping[str, Any] | None) -> ThreadLogError:
        """`exc` (a timeout) with the cause librdkafka reported, in one message.

        Callbacks of an admin client run only when it is polled: serve them first.
        """
        if exc.code != UNAVAILABLE:
            return exc
        try:
            client.poll(0)
        except Exception:  # pragma: no cover - a closed handle: no cause to add
            pass
        cause = self.auth or self.last  # "all brokers are down" would hide the reason they are
        if cause is None:
            return exc
        return ThreadLogError(UNAVAILABLE, scrub(f"{exc.message} (last broker error: {cause})", kafka))


# How long one metadata attempt of `reach` waits before the trap is looked at.
_REACH_STEP_S = 0.25


def reach(admin: Any, trap: ErrorTrap, timeout: float, kafka: Mapping[str, Any] | None) -> None:
    """Until the cluster answers a metadata request, at most `timeout` seconds.

    librdkafka retries a refused authentication like any connection failure, so
    a bare request would wait out the whole timeout; here wrong credentials end
    in UNAVAILABLE within about a second, naming librdkafka's authentication error.
    Any other failure is UNAVAILABLE after `timeout` (its cause added by `explain`).
    """
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        try:
            admin.list_topics(timeout=max(0.05, min(_REACH_STEP_S, remaining)))
            return
        except KafkaException as exc:
            failure = exc
        try:
            admin.poll(0)  # serves error_cb: the trap learns why
        except Exception:  # pragma: no cover - a closed handle
            pass
        if trap.auth is not None:
            raise ThreadLogError(UNAVAILABLE, scrub(f"authentication failed: {trap.auth}", kafka), retryable=False)
        if time.monotonic() >= deadline:
            raise trap.explain(ThreadLogError(UNAVAILABLE, f"cluster metadata unavailable: {error_text(failure)}"),
                               admin, kafka)


def _defaults(bootstrap: str, client_id: str) -> dict[str, Any]:
    return {
        "bootstrap.servers": bootstrap,
        "client.id": client_id,
        "logger": _rdkafka_log,
        "socket.nagle.disable": True,
        "reconnect.backoff.ms": 50,
        "reconnect.backoff.max.ms": 2000,
    }


def _layer(defaults: dict[str, Any], kafka: Mapping[str, Any] | None, enforced: dict[str, Any]) -> dict[str, Any]:
    # threadlog's tunables < the user's properties < what correctness needs.
    # `check()` already refused forbidden keys; `enforced` wins regardless.
    return {**defaults, **(kafka or {}), **enforced}


def base(bootstrap: str, client_id: str, kafka: Mapping[str, Any] | None = None,
         error_trap: ErrorTrap | None = None) -> dict:
    """An admin client's (and every client's common) settings, with the user's `kafka` properties."""
    conf = _layer(_defaults(bootstrap, client_id), kafka, {"bootstrap.servers": bootstrap})
    if error_trap is not None:
        conf["error_cb"] = error_trap
    return conf


def producer(bootstrap: str, client_id: str, kafka: Mapping[str, Any] | None = None, **extra: Any) -> dict:
    return _layer(
        {
            **_defaults(bootstrap, client_id),
            "linger.ms": 1,
            "message.max.bytes": MAX_MESSAGE_BYTES + 65536,
            **extra,
        },
        kafka,
        {
            "bootstrap.servers": bootstrap,
            # Idempotent: a retried send never duplicates or reorders; implies acks=all.
            "enable.idempotence": True,
            "acks": "all",
            **{k: v for k, v in extra.items() if k in FORBIDDEN},
        },
    )


# How long a follower's fetch may wait in the broker for a record. It bounds
# idle polling only: a waiting fetch returns as soon as a record lands. (A
# commit marker does not wake it: a read after an outside *transactional*
# writer's commit may wait up to this long; nothing threadlog writes is
# transactional.) Measured: 5 ms (round 1's setting, for its transactions)
# made every idle follower ask the broker 200 times a second -- an idle worker
# cost the broker 0.18 cores, now 0.05 -- and ~35-40% of the broker's CPU per
# decided proposal, for no latency: save_thread, 1 caller, p50 2.0 ms either
# way; SSE p50 3.2-3.4 ms either way.
FOLLOWER_WAIT_MS = 100
# Consumers that are assigned new partitions while they run (the delivery
# readers' pool, the delivery tail): librdkafka keeps one fetch per broker in
# flight, so a partition assigned while a fetch waits is first fetched when
# that one returns -- an SSE join or replay would start up to the wait late.
READER_WAIT_MS = 5


def consumer(bootstrap: str, client_id: str, kafka: Mapping[str, Any] | None = None, **extra: Any) -> dict:
    enforced = {
        "bootstrap.servers": bootstrap,
        "group.id": f"{client_id}.unused",
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        # Only committed transactions are facts.
        "isolation.level": "read_committed",
        "auto.offset.reset": "earliest",
    }
    # A call site may set a correctness property deliberately (the blob reader
    # reads uncommitted chunks; followers need EOF events): it wins over the user.
    enforced.update({k: v for k, v in extra.items() if k in FORBIDDEN})
    return _layer(
        {
            **_defaults(bootstrap, client_id),
            "fetch.wait.max.ms": 100,
            "fetch.error.backoff.ms": 20,
            "max.partition.fetch.bytes": MAX_MESSAGE_BYTES + 65536,
            "fetch.max.bytes": 64 * 1024 * 1024,
            "receive.message.max.bytes": 80 * 1024 * 1024,
            **{k: v for k, v in extra.items() if k not in FORBIDDEN},
        },
        kafka,
        enforced,
    )


class Consumed(Protocol):
    """A message a consumer returned: a record or an event such as partition EOF.

    confluent_kafka's stubs type `topic`, `partition` and `offset` of every
    `Message` as Optional (a `Message` built in Python has none); librdkafka sets
    them on everything `poll` / `consume` return, which is what this type says.
    """

    def error(self) -> KafkaError | None: ...
    def topic(self) -> str: ...
    def partition(self) -> int: ...
    def offset(self) -> int: ...
    def key(self) -> bytes | None: ...
    def value(self) -> bytes | None: ...
    def timestamp(self) -> tuple[int, int]: ...
    def headers(self) -> list[tuple[str, bytes | None]] | None: ...


def drain(consumer: Consumer, max_messages: int, timeout: float) -> list[Consumed]:
    """Wait up to `timeout` for the first message, then take what is already here.

    `Consumer.consume(n, timeout)` blocks until it has n messages or the
    timeout passed, so on a quiet topic every batch would cost the full
    timeout; this returns as soon as anything arrived.
    """
    first = consumer.poll(timeout)
    if first is None:
        return []
    rest = consumer.consume(max_messages - 1, 0) if max_messages > 1 else []
    # Consumed messages: topic, partition and offset are set (see Consumed).
    return cast("list[Consumed]", [first, *rest])


_BLANK = " \t\f"
_LINE_END = re.compile(r"\r\n|\r|\n")
_ESCAPED = {"t": "\t", "n": "\n", "r": "\r", "f": "\f"}


def load_properties(path: str) -> dict[str, str]:
    """A Java `client.properties` file (UTF-8), read as `java.util.Properties.load` reads it:
    `key=value` (or `key: value`, `key value`), `#`/`!` comment lines (which never
    continue), a line ending in an odd number of backslashes continued on the next
    (also at the end of the file), escapes (`\\=`, `\\:`, `\\\\`, `\\t`, `\\uHHHH`...)
    decoded in keys and values. Two choices: trailing blanks of a value are
    dropped (unless escaped), as Kafka's Java clients trim what they parse, and a
    line of a key alone is refused (Java reads it as an empty value: a typo).

    Values stay strings: librdkafka parses them as it parses its own config
    files. Errors name the file and line, never the line's text (it may be a secret).
    """
    try:
        with open(path, encoding="utf-8") as fh:
            # Lines end at \r\n, \r or \n only, as for Java (str.splitlines also splits
            # at \f, \x1c-\x1e, \x85, \u2028, \u2029: a password holding one broke).
            raw = _LINE_END.split(fh.read())
    except OSError as exc:
        raise invalid_argument(f"cannot read kafka config {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        # Read as UTF-8, which Java's Properties.load(Reader) takes too; a byte that is
        # not UTF-8 (a Latin-1 file) was an INTERNAL error, a bug's code (a review).
        # Where, never what: the line may be a secret.
        raise invalid_argument(f"kafka config {path} is not UTF-8 (byte {exc.start}); save it as UTF-8, or "
                               "write its non-ASCII characters as \\uHHHH escapes") from None
    props: dict[str, str] = {}
    for number, line in _logical_lines(raw):
        try:
            key, value = _key_value(line)
        except ValueError as exc:
            raise invalid_argument(f"{path}:{number}: {exc}") from None
        props[key] = value
    return props


def _logical_lines(raw: list[str]) -> Iterator[tuple[int, str]]:
    """(number of its first line, text) of each logical line, as Java joins them."""
    joined: str | None = None
    first = 0
    for number, natural in enumerate(raw, 1):
        text = natural.lstrip(_BLANK)
        if joined is None:
            if not text or text[0] in "#!":
                continue  # blank, or a comment: never continued
            first, joined = number, ""
        joined += text
        if (len(joined) - len(joined.rstrip("\\"))) % 2 == 1:
            joined = joined[:-1]  # continued on the next line
            continue
        yield first, joined
        joined = None
    if joined is not None:
        yield first, joined  # continued past the last line: what it has


def _key_value(line: str) -> tuple[str, str]:
    # The key ends at the first unescaped '=', ':' or blank; then blanks, at most one '=' or ':', blanks.
    i, n = 0, len(line)
    while i < n and line[i] not in "=:" + _BLANK:
        i += 2 if line[i] == "\\" else 1
    j = min(i, n)
    while j < n and line[j] in _BLANK:
        j += 1
    separated = j < n and line[j] in "=:"
    if separated:
        j += 1
        while j < n and line[j] in _BLANK:
            j += 1
    value = line[j:]
    while value and value[-1] in _BLANK and (len(value) - 1 - len(value[:-1].rstrip("\\"))) % 2 == 0:
        value = value[:-1]  # an unescaped trailing blank
    if not line[:i] or not (separated or value):
        raise ValueError("expected key=value")
    return _unescape(line[:i]), _unescape(value)


def _unescape(text: str) -> str:
    if "\\" not in text:
        return text
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        i += 1
        if c != "\\":
            out.append(c)
        elif i < n and text[i] == "u":
            digits = text[i + 1:i + 5]
            if len(digits) < 4 or not all(d in "0123456789abcdefABCDEF" for d in digits):
                raise ValueError("malformed \\uHHHH escape")
            out.append(chr(int(digits, 16)))
            i += 5
        elif i < n:
            out.append(_ESCAPED.get(text[i], text[i]))
            i += 1
    try:  # \uHHHH pairs are UTF-16: join surrogate pairs, refuse a lone one
        return "".join(out).encode("utf-16-le", "surrogatepass").decode("utf-16-le")
    except UnicodeError:
        raise ValueError("a \\uHHHH escape leaves a lone surrogate") from None
