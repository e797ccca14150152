"""Stopping a producer pump twice at once (producers/pump.py), no broker: the
producer's bootstrap refuses connections, so what it holds stays undelivered
until the flush gives up."""

from __future__ import annotations

import threading
import time

from confluent_kafka import KafkaError, Producer
from threadlog.producers.pump import ProducerPump, delivery_failure

from threadlog.kernel.errors import OUTCOME_UNKNOWN


def test_a_second_stop_returns_only_once_the_first_ones_flush_is_over():
    # Tried (a review): the second of two concurrent stops returned at once, while
    # the first still flushed -- its caller went on as if every record had gone.
    settings = {"bootstrap.servers": "127.0.0.1:1", "message.timeout.ms": 30_000, "log_level": 0}
    pump = ProducerPump(Producer(settings), "stop-twice", settings)
    pump.produce("t", b"v", b"k", partition=0, on_delivery=lambda err, msg: None)
    first_done = threading.Event()

    def first() -> None:
        pump.stop(flush_timeout=1.5)  # the record cannot go: the whole 1.5 s
        first_done.set()

    threading.Thread(target=first, daemon=True).start()
    deadline = time.monotonic() + 10
    while not pump._closed:  # the first stop has begun
        assert time.monotonic() < deadline, "the first stop never began"
        time.sleep(0.01)
    began = time.monotonic()
    pump.stop(flush_timeout=1.5)
    assert first_done.wait(1), "the second stop returned while the first still flushed"
    assert time.monotonic() - began < 8  # bounded: the first's flush, not for ever


def test_a_stop_from_a_delivery_callback_run_by_the_first_stops_flush_returns_at_once():
    # Tried (a review): the first stop's flush runs delivery callbacks on its own
    # thread; one that stopped the pump again (a caller closing on a failed write)
    # waited for that flush -- for itself -- flush_timeout + 5 s.
    settings = {"bootstrap.servers": "127.0.0.1:1", "message.timeout.ms": 1000, "log_level": 0}
    pump = ProducerPump(Producer(settings), "stop-in-callback", settings)
    nested: list[float] = []

    def on_delivery(err, msg) -> None:
        began = time.monotonic()
        pump.stop(flush_timeout=5)
        nested.append(time.monotonic() - began)

    pump.produce("t", b"v", b"k", partition=0, on_delivery=on_delivery)
    began = time.monotonic()
    pump.stop(flush_timeout=5)  # the record times out after 1 s: its callback runs in this flush
    assert nested and nested[0] < 1, nested
    assert time.monotonic() - began < 4


def test_a_stop_that_leaves_records_reports_each_at_once_as_maybe_written_and_closes_the_producer():
    # Tried (a review): during an outage -- when clients tend to be closed -- the
    # flush gave up with a record still queued. Nothing polled after stop, so its
    # caller waited out its whole timeout (here 30 s), and the producer was never
    # closed: its handle and threads lived until a garbage collection.
    settings = {"bootstrap.servers": "127.0.0.1:1", "message.timeout.ms": 30_000, "log_level": 0}
    pump = ProducerPump(Producer(settings), "stop-leaves", settings)
    reports: list = []
    pump.produce("t", b"v", b"k", partition=0, on_delivery=lambda err, msg: reports.append(err))
    pump.stop(flush_timeout=1)
    assert len(reports) == 1 and reports[0].code() == KafkaError._MSG_TIMED_OUT, reports
    assert delivery_failure(reports[0], "a record").code == OUTCOME_UNKNOWN  # it may have been sent
    deadline = time.monotonic() + 10
    while True:  # closed on a thread of its own: then it refuses to poll
        try:
            pump.producer.poll(0)
        except RuntimeError:
            break
        assert time.monotonic() < deadline, "the producer was not closed"
        time.sleep(0.05)
