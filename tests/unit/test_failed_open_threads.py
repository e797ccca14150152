"""A failed open leaves no librdkafka threads behind (no broker: port 1 refuses, `.invalid` never resolves).

Found by an operator review: each `threadlog.open(...)` that failed with
UNAVAILABLE left the admin client it had built alive -- its traceback held the
client in a reference cycle -- so its librdkafka threads (native, not in
`threading`) lived until the garbage collector ran, and a process retrying
open() in a loop gathered them.

Each case runs in a process of its own, with the garbage collector disabled:
what must be shown is that nothing waits for it. The threads are counted in
/proc/self/task (every thread of the process, librdkafka's included).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

RETRY = """
import asyncio, gc, logging, os, sys, time
import threadlog

gc.disable()
# Silenced as the CLI silences it: the logger's repeat filter starts a timer
# thread (gone after its 30 s window) per client that logged a repeated line,
# which would hide what is counted here.
logging.getLogger("threadlog.rdkafka").setLevel(logging.CRITICAL + 1)


def threads():
    return len(os.listdir("/proc/self/task"))


async def main(bootstrap, attempts, state_dir):
    baseline = threads()
    for attempt in range(attempts):
        try:
            await threadlog.open(bootstrap, "never", state_dir=state_dir, request_timeout_ms=500)
        except threadlog.ThreadLogError as exc:
            code = exc.code
        else:
            raise AssertionError("opened an unreachable cluster")
        # The open's own thread ends just after handing over its error: a bounded wait.
        deadline = time.monotonic() + 10
        while threads() != baseline and time.monotonic() < deadline:
            time.sleep(0.02)
        print(attempt, code, threads() - baseline, flush=True)
        if threads() != baseline:
            return


asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
"""


@pytest.mark.parametrize(("bootstrap", "attempts"), [("127.0.0.1:1", 5), ("nosuchhost.invalid:9092", 2)],
                         ids=["refused", "unresolvable"])
def test_a_failed_open_leaves_no_kafka_threads(bootstrap, attempts, tmp_path):
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(RETRY), bootstrap, str(attempts), str(tmp_path)],
                          capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-2000:]
    # Per attempt: its number, its error code, and the threads left over the baseline.
    assert done.stdout.splitlines() == [f"{n} UNAVAILABLE 0" for n in range(attempts)], \
        done.stdout + done.stderr[-2000:]


FLOOR = """
import gc, logging, os, sys, time
from threadlog.producers import rules_floor
from threadlog.schemas import default_codec

gc.disable()
logging.getLogger("threadlog.rdkafka").setLevel(logging.CRITICAL + 1)
rules_floor.MIN_TIMEOUT = 0.5  # the markers of an unreachable cluster time out at once


def threads():
    return len(os.listdir("/proc/self/task"))


codec = default_codec()
baseline = threads()
kept = []  # the errors, kept as an open's future keeps its error (and so its traceback's frames)
for attempt in range(3):
    try:
        rules_floor.write_floor_markers("127.0.0.1:1", "never.events", 2, codec, "never", None, 0.5)
    except Exception as exc:
        kept.append(exc)
        code = getattr(exc, "code", type(exc).__name__)
        assert "not acknowledged in" in str(exc), exc  # the timeout, not the purge's own reports
    deadline = time.monotonic() + 10
    while threads() != baseline and time.monotonic() < deadline:
        time.sleep(0.02)
    print(attempt, code, threads() - baseline, flush=True)
"""


def test_floor_markers_that_time_out_leave_no_kafka_threads():
    """The same for the rules floor markers a new namespace gets: their producer
    lived as long as the error did (its traceback holds the writing frame), and
    the error of a failed open lives in a cycle until gc (a review)."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(FLOOR)], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [f"{n} UNAVAILABLE 0" for n in range(3)], done.stdout + done.stderr[-2000:]
