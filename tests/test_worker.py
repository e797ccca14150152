"""`threadlog worker` runs the processors standalone for clients with external processors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from support import within


def start_worker(bootstrap: str, namespace: str, state_dir: str, instance: str = "w1") -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "threadlog", "worker", "--bootstrap", bootstrap, "--namespace", namespace,
         "--state-dir", state_dir, "--instance-id", instance],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if "deciding" in line:
            return proc
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"worker did not start: {proc.stdout.read()}")


async def test_external_clients_are_served_by_a_worker_process(bootstrap, namespace, tmp_path, open_client):
    worker = start_worker(bootstrap, namespace, str(tmp_path / "worker"))
    try:
        client = await open_client(processors="external")
        await within(client.messages.save_thread("t", ["via worker"]))
        assert await within(client.messages.load_thread("t")) == ["via worker"]
        other = await open_client(processors="external")
        assert await within(other.messages.load_thread("t")) == ["via worker"]
    finally:
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(30) == 0


async def test_a_restarted_worker_takes_over_without_losing_commands(bootstrap, namespace, tmp_path, open_client):
    state = str(tmp_path / "worker")
    worker = start_worker(bootstrap, namespace, state)
    client = await open_client(processors="external")
    await within(client.messages.save_thread("t", [1]))
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait(10)
    # Commands sent while no decider runs wait in their topic ...
    pending = client.messages.save_thread("t", [1, 2])
    worker = start_worker(bootstrap, namespace, state)
    try:
        # ... and are decided once a worker is back (same instance id: it fences
        # the dead one's transactional ids and takes its partitions at once).
        await within(pending, 60)
        assert await within(client.messages.load_thread("t")) == [1, 2]
    finally:
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(30) == 0
