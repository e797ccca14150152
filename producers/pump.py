"""Serve a producer's delivery callbacks from a background thread."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from threadlog.kernel import kafka_config, stuck
from threadlog.kernel.errors import OUTCOME_UNKNOWN, ThreadLogError, invalid_argument, unavailable
from threadlog.kernel.topics import MAX_MESSAGE_BYTES

log = logging.getLogger("threadlog.producers")

# A record this large (value, key, headers) fits any topic of ours alone, with
# its batch's framing (a few hundred bytes).
FITS_ALONE = MAX_MESSAGE_BYTES - 4096


def record_bytes(msg: Message) -> int:
    """What a record brings to the topic's size limit: value, key and headers."""
    headers = msg.headers() or []
    pairs = headers.items() if isinstance(headers, dict) else headers
    size = len(msg.value() or b"") + len(msg.key() or b"")
    for name, value in pairs:
        size += len(name) + len(value or b"")
    return size


# Errors no retry of the same call fixes: a principal without the ACL the write
# needs, or a producer librdkafka has failed for good (an idempotent producer
# refused its producer id). Still UNAVAILABLE ("not written"), but not retryable.
# librdkafka purges a producer's queue when it fails the producer for good, so
# a record it purged before sending is one of those too. (One purged in flight
# may have been written: see delivery_failure.) The purges threadlog makes
# itself -- of a replaced producer, and at close -- are reported as timeouts
# before they get here (`ProducerPump.produce`).
_FOR_GOOD = frozenset({KafkaError._FATAL, KafkaError.TOPIC_AUTHORIZATION_FAILED,
                       KafkaError.CLUSTER_AUTHORIZATION_FAILED, KafkaError._PURGE_QUEUE})
_PURGED = frozenset({KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT})


def for_good(err: KafkaError) -> bool:
    return err.code() in _FOR_GOOD or err.fatal()


def produce_refused(exc: KafkaException, what: str) -> ThreadLogError:
    """The error of a record librdkafka refused at `produce()`, before sending it:
    one too large for a Kafka record is bad input; a producer failed for good
    (KafkaError._FATAL) will not take this record later either."""
    code = kafka_config.error_code(exc)
    if code == KafkaError.MSG_SIZE_TOO_LARGE:
        return invalid_argument(f"{what} not written: too large for one Kafka record ({exc})")
    return unavailable(f"{what} not written: {exc}", retryable=code not in _FOR_GOOD)


def delivery_failure(err: KafkaError, what: str, msg: Message | None = None) -> ThreadLogError:
    """The error of a record librdkafka reported as not delivered. A timed-out record
    may have been written (its request was in flight): OUTCOME_UNKNOWN, it may still
    apply. Any other delivery error means it was not: UNAVAILABLE -- except a record
    too large for the topic, which is bad input (INVALID_ARGUMENT). The broker
    refuses a whole batch, so a record that would fit alone (with its own
    framing) only shared a batch that did not (a user's batch.size): UNAVAILABLE."""
    if err.code() in (KafkaError._MSG_TIMED_OUT, KafkaError._PURGE_INFLIGHT):
        return ThreadLogError(OUTCOME_UNKNOWN, f"{what} may have been written ({err}): it may still apply")
    if err.code() == KafkaError.MSG_SIZE_TOO_LARGE and (msg is None or record_bytes(msg) > FITS_ALONE):
        return invalid_argument(f"{what} not written: too large for one Kafka record ({err})")
    if err.code() == KafkaError._PURGE_QUEUE:
        return unavailable(f"{what} not written: librdkafka failed this client's producer for good ({err}; "
                           "the cause is logged, e.g. a principal without Write): reopen the client once it is "
                           "fixed", retryable=False)
    return unavailable(f"{what} not written: {err}", retryable=not for_good(err))


def settle(fut: asyncio.Future, exc: BaseException | None, value: Any) -> None:
    """Complete an awaited produce (on the caller's loop: call_soon_threadsafe), once."""
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(value)


class _Inbox:
    """Calls handed to one event loop from other threads: one wake-up per burst.

    Why: `call_soon_threadsafe` writes to the loop's self-pipe, a syscall that
    releases the GIL; getting it back behind the judge, follower and pump
    threads cost ~0.2 ms per verdict. A judge decides a batch of proposals at
    once, so their completions ride one wake-up.

    The loop is held weakly (the registry below is keyed by it): an inbox must
    not keep every loop that ever awaited a produce alive.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)
        self._lock = threading.Lock()
        self._items: list[tuple[Callable[..., None], tuple]] = []
        self._armed = False

    def post(self, fn: Callable[..., None], *args: Any) -> None:
        """Run `fn(*args)` on the loop, with whatever else arrives before it wakes."""
        loop = self._loop()
        with self._lock:
            if loop is None or loop.is_closed():
                # Nobody awaits these any more (a wake-up queued on a loop that
                # then closed never runs: without this they would pile up).
                self._items.clear()
                self._armed = False
                return
            self._items.append((fn, args))
            if self._armed:
                return  # a wake-up is already on its way and takes this one too
            self._armed = True
        try:
            loop.call_soon_threadsafe(self._drain)
        except BaseException:  # closed meanwhile (RuntimeError), or worse: never stay armed
            with self._lock:
                self._items.clear()
                self._armed = False
            if not loop.is_closed():
                raise

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, []
            self._armed = False
        for fn, args in items:
            fn(*args)


_inboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Inbox] = weakref.WeakKeyDictionary()
_inboxes_lock = threading.Lock()


def inbox(loop: asyncio.AbstractEventLoop) -> _Inbox:
    """The loop's inbox (see `_Inbox`), from any thread."""
    box = _inboxes.get(loop)
    if box is None:
        with _inboxes_lock:
            box = _inboxes.setdefault(loop, _Inbox(loop))
    return box


def settle_threadsafe(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, exc: BaseException | None,
                      value: Any) -> None:
    """`settle` on `loop` from any thread, batched with other completions for that loop."""
    inbox(loop).post(settle, fut, exc, value)


def _expire(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError())


async def within(fut: asyncio.Future, timeout: float) -> Any:
    """`await asyncio.wait_for(fut, timeout)` for a future only this caller awaits.

    Why: every proposal, delivery append and remote read awaits one future
    under a deadline, and Python 3.11's `wait_for` costs ~22 us of the GIL on
    top of the await (a timer plus a second future and its callbacks); one
    timer that fails the future costs ~10. On timeout the future is failed
    with `TimeoutError` (a completion arriving later is dropped by `settle`);
    a cancelled caller cancels the future, as with `wait_for`.
    """
    timer = asyncio.get_running_loop().call_later(timeout, _expire, fut)
    try:
        return await fut
    finally:
        timer.cancel()


class ProducerPump:
    """librdkafka calls delivery callbacks only from `poll`/`flush`: this thread
    polls, so an awaited produce completes without the caller polling.

    It also replaces a producer that stopped delivering (given the `settings`
    to make another). Why: after a broker restart (or a KRaft broker fenced for
    a moment) librdkafka can leave a producer's partitions without a leader for
    good -- its metadata update skips a partition whose leader was -1, and
    later answers naming the leader do not revive it (librdkafka #5430, open;
    logged as "new leader-1 not found in cache"). Every record then times out,
    and a client could not write again until its process restarted (a fault
    probe: every append OUTCOME_UNKNOWN for minutes after the broker was back,
    the workers healthy). So when records only time out, none delivered, for
    `STUCK_S`, a new producer takes the next records. The old one is polled
    until its queue is empty, none of its records dropped unreported: those
    in flight are reported as before; those it has not sent are purged (see
    `_purge`). During a real outage this replaces a producer every `STUCK_S`
    or so, which costs a connection attempt.
    """

    def __init__(self, producer: Producer, name: str, settings: dict[str, Any] | None = None) -> None:
        self.producer = producer
        self.name = name
        self._settings = settings  # None: never replaced
        self._failed = False  # poll raised (logged once)
        self._timed_out_since: float | None = None  # first timeout since the last delivery
        self._replaced_at = time.monotonic()
        self._retiring: list[Producer] = []  # replaced, polled until their queues are empty
        self.replacements = 0  # producers replaced because they stopped delivering (operators, tests)
        self._stop = threading.Event()
        # A record is handed to a producer, or refused as closed, never to one
        # closed under it (`produce` and `stop` exclude each other).
        self._closing = threading.Lock()
        self._closed = False
        self._stopped = threading.Event()  # the first stop's flush is over
        self._stopper: threading.Thread | None = None  # the thread of the first stop
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def produce(self, topic: str, value: bytes | None, key: bytes | None, *, partition: int,
                on_delivery: Callable[[KafkaError | None, Message], None] | None = None,
                headers: list[tuple[str, str | bytes | None]] | None = None) -> None:
        """`Producer.produce` on the current producer, noting each record's outcome."""
        def delivered(err: KafkaError | None, msg: Message) -> None:
            self._saw(err)
            if err is not None and err.code() == KafkaError._PURGE_QUEUE and producer in self._retiring:
                # Purged by `_purge` (librdkafka's own purges are for good). Not sent
                # again -- but a record queued for a retry may have been written by
                # its first send, and librdkafka does not say which: a timeout.
                err = KafkaError(KafkaError._MSG_TIMED_OUT, "not sent again: its producer stopped delivering and "
                                 "was replaced; an earlier send may have been written")
            elif err is not None and err.code() in _PURGED and self._closed:
                # Purged by `stop` (see `_purge_left`): maybe written, as above.
                err = KafkaError(KafkaError._MSG_TIMED_OUT, "not sent again: the client closed before the cluster "
                                 "acknowledged it; an earlier send may have been written")
            if on_delivery is not None:
                on_delivery(err, msg)

        with self._closing:
            if self._closed:
                raise unavailable(f"{self.name} is closed")
            producer = self.producer
            producer.produce(topic, value, key, partition=partition, on_delivery=delivered, headers=headers)

    def _saw(self, err: KafkaError | None) -> None:
        if err is None:
            self._timed_out_since = None
        elif err.code() == KafkaError._MSG_TIMED_OUT and self._timed_out_since is None:
            self._timed_out_since = time.monotonic()

    def _replace_if_stuck(self) -> None:
        since = self._timed_out_since
        if self._settings is None or since is None:
            return
        now = time.monotonic()
        after = stuck.STUCK_S
        if now - since < after or now - self._replaced_at < after:
            return
        log.warning("%s: nothing delivered for %.0f s, every record timed out: replacing its producer "
                    "(librdkafka can leave a producer without partition leaders after a broker restart)",
                    self.name, now - since)
        new = Producer(dict(self._settings))
        # Swapped under the lock `produce` holds while it produces: no record
        # reaches the old producer after its purge (a review: swapped after the
        # purge, a concurrent `produce` could still queue one there).
        with self._closing:
            old, self.producer = self.producer, new
        self._retiring.append(old)  # a purge report is served while it is still there
        self._purge(old)
        self._timed_out_since = None
        self._replaced_at = now
        self.replacements += 1

    def _purge(self, old: Producer, in_flight: bool = False) -> None:
        """Purge what a replaced producer has not sent yet (it is polled until its queue is empty);
        `in_flight` too at close (`_purge_left`).

        Why purge: a producer stuck now may deliver again later (its broker
        back, its metadata mended), and then sent what it still held *after*
        the records its replacement delivered meanwhile: a run's chunk whose
        append had ended OUTCOME_UNKNOWN stood after the next chunk (the likely
        cause of a broker-kill test's one "chunks repeated or out of order"),
        and a save could be applied after a later save. A purged
        record is reported timed out (OUTCOME_UNKNOWN), not "not written": one
        queued again for a retry (its request to a broker that then died) may
        have been written by that first send, and librdkafka does not tell it
        apart from one never sent. Records in flight are left to the broker's
        answer; one whose request fails is queued again for a retry, and is
        purged at the next poll (this runs on every retiring producer each
        time the pump polls them) -- a request in flight to a broker that
        appends it late is not ruled out, only far narrower.
        """
        try:
            # `blocking=True` asks for librdkafka's NON-blocking purge: confluent-kafka
            # (2.16, Producer.c) inverts the flag -- checked with debug=queue, which
            # logs "flags queue,non-blocking" for True. A blocking purge holds the GIL
            # until every broker thread took it: one stuck in a slow DNS lookup during
            # a broker restart would freeze the whole process. The purge is done by
            # the broker threads; its reports come by poll.
            old.purge(in_queue=True, in_flight=in_flight, blocking=True)
        except KafkaException as exc:  # pragma: no cover - its reports still come by poll
            log.warning("%s: purging a producer's queue failed: %s", self.name, exc)

    def _run(self) -> None:
        # Never dies: poll raises librdkafka's fatal errors (an idempotent producer
        # whose principal may not write: CLUSTER_AUTHORIZATION_FAILED). A review
        # saw this thread end so; no delivery report was served again, and every
        # write waited out its whole timeout to say OUTCOME_UNKNOWN -- a blob put
        # forever. Polling on serves the reports that fail those records.
        while not self._stop.is_set():
            try:
                self.producer.poll(0.05)
            except KafkaException as exc:
                if not self._failed:
                    self._failed = True
                    log.warning("%s: %s (the writes through this producer fail)", self.name, exc)
                self._stop.wait(0.05)
            try:
                for old in list(self._retiring):
                    self._purge(old)
                    old.poll(0)
                    if len(old) == 0:
                        self._retiring.remove(old)
                self._replace_if_stuck()
            except Exception:  # pragma: no cover - this thread never dies of it
                log.exception("%s: serving or replacing a stuck producer failed", self.name)
                self._stop.wait(0.05)

    def _purge_left(self, serve_s: float = 2.0) -> None:
        """After the last flush: purge what is still queued or in flight, and serve its reports.

        Why: during an outage -- when clients tend to be closed -- records are
        still queued when the flush gives up. Nothing polls after `stop`, so their
        callers waited out their whole timeouts, and a producer with records left
        is not closed: its handle and threads lived until a garbage collection (a
        review). Purged, each is reported at once as maybe written
        (OUTCOME_UNKNOWN: one in flight may still land), and the producer closes.
        """
        left = [p for p in [*self._retiring, self.producer] if len(p) > 0]
        if not left:
            return
        for producer in left:
            self._purge(producer, in_flight=True)
        deadline = time.monotonic() + serve_s
        while any(len(p) > 0 for p in left) and time.monotonic() < deadline:
            for producer in left:
                try:
                    producer.poll(0.02)
                except KafkaException:  # pragma: no cover - a fatal error: its reports were served
                    pass

    def stop(self, flush_timeout: float = 5.0) -> None:
        with self._closing:
            first = not self._closed
            self._closed = True
            if first:
                self._stopper = threading.current_thread()
        if not first:
            # Stopped already, or being stopped: returns once that flush is over, as
            # the first stop does (it returned at once, with records still on their
            # way). Not on the polling thread, which that stop is joining, nor on the
            # first stopper's (a delivery callback its flush runs): both would wait
            # for themselves.
            if threading.current_thread() not in (self._thread, self._stopper):
                self._stopped.wait(flush_timeout + 5)
            return
        try:
            self._stop.set()
            self._thread.join(timeout=5)
            for old in self._retiring:
                old.flush(0)
            self.producer.flush(flush_timeout)
            if not self._thread.is_alive():
                self._purge_left()
        finally:
            self._stopped.set()
        # Closed now, not when collected. Why (a soak helper, 2026-12-06): a closed
        # client sits in reference cycles, so its producers -- 8 threads and 10 fds
        # for two -- lived until a full garbage collection, and for good while the
        # application kept the client (or a lease or delivery log made from it):
        # 40 clients opened and closed in turn held up to 15 Kafka handles at once.
        # Only a producer with nothing left to deliver: `close` flushes what is
        # left, without a deadline. On a thread of its own, as `kafka_config.dispose`
        # destroys an admin client: destroying waits for the producer's threads.
        if self._thread.is_alive():
            return  # still polling them (its join timed out): closed under it, its poll would raise
        for producer in [*self._retiring, self.producer]:
            close = getattr(producer, "close", None)  # in the confluent-kafka versions that have it
            if close is not None and len(producer) == 0:
                threading.Thread(target=close, name=f"{self.name}.close", daemon=True).start()
