"""An open its caller gave up on, against an unreachable cluster (no broker: port 1 refuses).

Tried (a new-user review): `ThreadLogSaver(address, timeout=5)` raised
UNAVAILABLE at 5 s as documented, but the script then took ~32 s to exit (the
open went on in the loop's default executor, whose threads are joined at
exit), and its cleanup, asked after the executor shut down, failed; in a
long-running process the failed open surfaced ~25 s later as asyncio's "Task
exception was never retrieved" traceback.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

OPEN = """
import gc, threading, time
from threadlog.integrations.langgraph import ThreadLogSaver
try:
    ThreadLogSaver("127.0.0.1:1", "never", timeout=1, request_timeout_ms={ms})
except Exception as exc:
    print("raised", getattr(exc, "code", None), flush=True)
"""

# The process lives on until the abandoned open ended (its loop thread stops).
WAIT = """
deadline = time.monotonic() + 30
while any(t.name.startswith("threadlog-langgraph") for t in threading.enumerate()):
    assert time.monotonic() < deadline, "the abandoned open never ended"
    time.sleep(0.05)
gc.collect()  # a task dropped with its exception says so when collected
print("ended", flush=True)
"""


def _run(script: str) -> tuple[float, str, str]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=90)
    return time.monotonic() - started, done.stdout, done.stderr


def test_a_script_whose_open_timed_out_exits_without_waiting_for_it():
    took, out, err = _run(OPEN.format(ms=40_000))
    assert out.splitlines() == ["raised UNAVAILABLE"], err[-2000:]
    assert took < 20, f"exit took {took:.1f} s (the abandoned open may try for 40 s)"
    assert "cannot schedule new futures" not in err and "Traceback" not in err, err[-2000:]


def test_an_abandoned_open_that_fails_later_leaves_no_unretrieved_task_error():
    _, out, err = _run(OPEN.format(ms=2_000) + WAIT)
    assert out.splitlines() == ["raised UNAVAILABLE", "ended"], err[-2000:]
    assert "never retrieved" not in err and "Traceback" not in err, err[-2000:]
