"""librdkafka's repeated lines (a broker down: a `FAIL` per reconnect) reach the log once per window."""

from __future__ import annotations

import contextlib
import logging
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

from confluent_kafka import Producer

from threadlog.kernel import kafka_config


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []
        self.said = threading.Event()  # set by every line

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
        self.said.set()


@contextlib.contextmanager
def filtered(name: str, window: float) -> Iterator[tuple[logging.Logger, Lines]]:
    """A logger of its own behind a repeat filter of its own, its lines caught."""
    log = logging.getLogger(name)
    lines = Lines()
    repeats = kafka_config._RepeatFilter(window=window)
    log.addFilter(repeats)
    log.addHandler(lines)
    log.propagate = False
    try:
        yield log, lines
    finally:
        log.removeHandler(lines)
        log.removeFilter(repeats)


def own_refusals(lines: Lines) -> list[str]:
    # Only this test's client: the repeat filter is the process's, and another
    # test's client left reconnecting to port 1 (a consumer pool's, seen in CI)
    # had its own dropped lines said by the same `say_dropped`.
    return [line for line in lines.lines if "Connection refused" in line and "[repeats-test#" in line]


def test_a_refused_broker_is_logged_once_not_per_reconnect():
    # Tried (running an example with the broker down): ~1 000 identical
    # "Connect to ... failed: Connection refused" lines in the 30 s before its
    # one-line error. No broker is needed: nothing listens on port 1.
    log = logging.getLogger("threadlog.rdkafka")
    lines, level = Lines(), log.level
    log.addHandler(lines)
    log.setLevel(logging.DEBUG)
    producer = Producer(kafka_config.producer("127.0.0.1:1", "repeats-test"))
    try:
        producer.produce("t", b"x")
        deadline = time.monotonic() + 3  # the interval observed, not a wait for an event
        while time.monotonic() < deadline:
            producer.poll(0.1)
        refused = own_refusals(lines)
        # librdkafka retries every 50 ms .. 2 s here: several attempts in 3 s, one line.
        assert len(refused) == 1, refused
        kafka_config.say_dropped()  # what exit says (not left for this test process's exit)
        refused = own_refusals(lines)
        assert len(refused) == 2 and re.search(r"\(\d+ more like it in the last \ds\)$", refused[1]), refused
    finally:
        log.removeHandler(lines)
        log.setLevel(level)
        producer.purge()
        producer.flush(0)


def test_a_repeat_after_the_window_says_how_many_were_dropped():
    repeats = kafka_config._RepeatFilter(window=0.0)
    quiet = kafka_config._RepeatFilter(window=60.0)

    def record(ms: int) -> logging.LogRecord:
        return logging.LogRecord("threadlog.rdkafka", logging.ERROR, __file__, 1,
                                 "FAIL [c] failed: Connection refused (after %sms in state CONNECT)", (ms,), None)

    assert [quiet.filter(record(ms)) for ms in (0, 3, 12)] == [True, False, False]
    assert quiet.filter(logging.LogRecord("threadlog.rdkafka", logging.ERROR, __file__, 1,
                                          "another broker's line", None, None))
    assert repeats.filter(record(0)) and repeats.filter(record(1))  # past the window: every one passes
    quiet.window = 0.0
    late = record(40)
    assert quiet.filter(late) and late.getMessage().endswith("(2 more like it in the last 0s)")


def test_repeats_that_stop_are_still_counted_when_the_window_ends():
    # Tried: a broker down for 10 s, then back. The reconnect failures stopped,
    # no line of their kind came after the window, and the log showed one
    # failure where there had been dozens.
    with filtered("threadlog.rdkafka.repeats-test", window=0.3) as (log, lines):
        log.error("FAIL [c] failed: Connection refused (after %sms in state CONNECT)", 1)
        lines.said.clear()  # before the repeats: a slow machine may reach the window's end meanwhile
        for ms in (2, 3):
            log.error("FAIL [c] failed: Connection refused (after %sms in state CONNECT)", ms)
        assert lines.said.wait(5), "the window ended and its two dropped lines were never counted"
        assert lines.lines[1].startswith("FAIL [c] failed: Connection refused (after 3ms in state CONNECT) (2 more")
        log.error("FAIL [c] failed: Connection refused (after %sms in state CONNECT)", 4)
        assert lines.lines[2] == "FAIL [c] failed: Connection refused (after 4ms in state CONNECT)"  # a new window


def test_repeats_still_counted_when_the_process_exits_within_the_window():
    # Tried (a review): a process exiting before the window ended never said
    # how many lines it dropped (its timer is a daemon).
    script = (
        "import logging, sys\n"
        "from threadlog.kernel import kafka_config\n"
        "log = logging.getLogger('threadlog.rdkafka.exit-test')\n"
        "log.addHandler(logging.StreamHandler(sys.stdout))\n"
        "log.propagate = False\n"
        "log.addFilter(kafka_config._repeats)\n"
        "for ms in (1, 2, 3):\n"
        "    log.error('FAIL [c] failed: Connection refused (after %sms in state CONNECT)', ms)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    lines = out.stdout.splitlines()
    assert out.returncode == 0 and len(lines) == 2, out
    assert lines[1].startswith("FAIL [c] failed: Connection refused (after 3ms in state CONNECT) (2 more"), out


def test_many_clients_repeating_at_once_cost_one_thread_and_are_each_counted():
    """Tried (a review): each window with a dropped line started a timer thread
    of its own, alive for the whole window (30 s), so a process retrying open()
    against a cluster that is down gathered one more thread per client."""
    before = threading.active_count()
    with filtered("threadlog.rdkafka.repeats-many", window=0.5) as (log, lines):
        for client in range(20):
            for ms in (1, 2, 3):
                log.error("FAIL [c%s] failed: Connection refused (after %sms in state CONNECT)", client, ms)
        assert threading.active_count() <= before + 1  # one thread says every window's count
        deadline = time.monotonic() + 10
        while len(lines.lines) < 40 and time.monotonic() < deadline:
            lines.said.clear()
            lines.said.wait(1)
        counted = [line for line in lines.lines if "(after 3ms in state CONNECT) (2 more like it" in line]
        assert sorted(int(re.search(r"\[c(\d+)\]", line).group(1)) for line in counted) == list(range(20)), \
            lines.lines
