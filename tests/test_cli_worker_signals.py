"""A signal to `threadlog worker` while it is still starting stops it promptly."""

from __future__ import annotations

import asyncio
import signal
import sys
import time

import pytest

# threadlog.cli.START_ABANDON_S (3 s: how long a stopped start is waited for) and slack for 2 loaded cores;
# the request timeout it used to wait for is 60 s here.
BOUND_S = 10.0


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
async def test_a_signal_during_worker_startup_exits_within_seconds(tmp_path, sig, status):
    """Tried (a review): Ctrl-C / SIGTERM to a worker whose bootstrap does not
    answer was ignored until the request timeout (13.7 s of 15 s), then exit 2
    UNAVAILABLE. Now it exits 128 + signal within BOUND_S, far inside the 60 s
    request timeout. No broker: 127.0.0.1:1 refuses."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "threadlog", "-v", "worker", "--bootstrap", "127.0.0.1:1", "--namespace", "wk",
        "--state-dir", str(tmp_path), "--request-timeout-ms", "60000",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        assert proc.stderr is not None
        # Logged (-v) once its signal handlers are in place, or librdkafka's first
        # refused connect (rt.start is under way, so they are): no sleep to guess when.
        seen: list[str] = []
        while not any("worker starting: namespace wk" in line or "Connection refused" in line for line in seen):
            line = await asyncio.wait_for(proc.stderr.readline(), 30)
            assert line, seen  # it exited before saying it starts
            seen.append(line.decode(errors="replace"))
        sent = time.monotonic()
        proc.send_signal(sig)
        out, err = await asyncio.wait_for(proc.communicate(), 90)  # beyond the request timeout
        elapsed = time.monotonic() - sent
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == status, (proc.returncode, out, err)
    assert elapsed < BOUND_S, elapsed
    assert "worker stopping: signalled while starting" in out.decode() and b"threadlog: UNAVAILABLE" not in err, \
        (out, err)
