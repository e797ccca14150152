"""`threadlog worker`: a judge of the namespace in its own process, with its own store.

It judges every proposal as the clients' own judges do, stops cleanly on
SIGTERM (exit 0), and a restart resumes at the position stored with its state.
"""

from __future__ import annotations

import signal

from support import within
from test_checkpoints_faults import worker_verdicts
from threadlog.processors.judge import all_verdicts
from worker_support import WorkerProcess


async def test_a_worker_judges_alike_and_resumes_where_it_stopped(bootstrap, namespace, tmp_path, open_client):
    state = tmp_path / "worker"
    worker = WorkerProcess(bootstrap, namespace, state, "w1")
    restarted = WorkerProcess(bootstrap, namespace, state, "w1")
    try:
        await worker.start()
        # The first worker of a namespace is alone by design: a thin client's warning
        # that no worker is registered is not for it (every worker start logged it).
        assert "no query worker registered" not in worker.stderr()
        # An embedded client: a second judge whose verdicts are compared with the worker's.
        client = await open_client()
        await within(client.messages.save_thread("t", ["one"]))
        worker.signal(signal.SIGTERM)
        assert await worker.wait_exit(30) == 0
        await within(client.messages.save_thread("t", ["one", "two"]))
        await within(client.runs.create_or_resume(run_id="r", thread_id="t", started_at=1))
        await restarted.start()
        await within(client.messages.save_thread("t", ["one", "two", "three"]))
        assert await within(client.messages.load_thread("t")) == ["one", "two", "three"]
        await client.read_barrier(None)
        # Read through the worker: it answers once it owns every partition and judged past the end.
        thin = await open_client(processors="external", own_worker=True)
        await within(thin.read_barrier(None))
        restarted.signal(signal.SIGTERM)
        assert await restarted.wait_exit(30) == 0
        partitions = client.runtime.layout.events
        theirs = worker_verdicts(state, namespace, partitions)
        ours = {p: all_verdicts(client.runtime.store, p) for p in range(partitions)}
        assert theirs == ours
        assert sum(len(v) for v in ours.values()) == 4 + partitions  # and each partition's rules floor marker
    finally:
        await worker.stop()
        await restarted.stop()


async def test_a_worker_listening_on_every_interface_announces_the_host_it_is_told(bootstrap, namespace, tmp_path,
                                                                                   open_client):
    # Bound to 0.0.0.0 it announced "0.0.0.0:PORT", which a client on another host
    # reads as its own loopback: --advertise names the host clients reach it at.
    worker = WorkerProcess(bootstrap, namespace, tmp_path / "w", "w1", "--listen", "0.0.0.0:0",
                           "--advertise", "127.0.0.1")
    try:
        await worker.start()
        assert worker.address is not None and worker.address.startswith("127.0.0.1:")
        thin = await open_client(processors="external", own_worker=True)
        await within(thin.messages.save_thread("t", ["through the advertised address"]))
        assert await within(thin.messages.load_thread("t")) == ["through the advertised address"]
        members = thin.runtime.query.members.live()
        assert [m.address for m in members] == [worker.address]
    finally:
        await worker.stop()


async def test_a_worker_listening_on_every_interface_without_advertise_warns(bootstrap, namespace, tmp_path):
    # Tried (a review): --listen 0.0.0.0:PORT with no --advertise was accepted
    # silently, and clients on other hosts connected to their own loopback.
    worker = WorkerProcess(bootstrap, namespace, tmp_path / "w", "w1", "--listen", "0.0.0.0:0")
    try:
        await worker.start()
        assert "without --advertise" in worker.stderr() and worker.address.startswith("0.0.0.0:")
    finally:
        await worker.stop()


async def test_a_worker_on_ipv6_announces_a_bracketed_address_thin_clients_reach(bootstrap, namespace, tmp_path,
                                                                                   open_client):
    # --advertise took no IPv6 address (a colon was refused as a port). Now it
    # does, and the address is announced with the host in brackets, as URLs and
    # Kafka's listeners write one.
    worker = WorkerProcess(bootstrap, namespace, tmp_path / "w", "w1", "--listen", "[::]:0", "--advertise", "::1")
    try:
        await worker.start()
        assert worker.address is not None and worker.address.startswith("[::1]:"), worker.address
        thin = await open_client(processors="external", own_worker=True)
        await within(thin.messages.save_thread("t", ["over IPv6"]))
        assert await within(thin.messages.load_thread("t")) == ["over IPv6"]
        assert [m.address for m in thin.runtime.query.members.live()] == [worker.address]
    finally:
        await worker.stop()


def test_a_bad_advertise_host_is_refused_before_anything_starts(bootstrap, namespace):
    import subprocess
    import sys

    for bad in ("", "host:1", "a b", "[::1]:7000", "fe80::zz"):
        proc = subprocess.run([sys.executable, "-m", "threadlog", "worker", "--bootstrap", bootstrap, "--namespace",
                               namespace, "--advertise", bad], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and "--advertise must be a host" in proc.stderr, (bad, proc.stderr)
