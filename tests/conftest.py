"""Shared fixtures: one real Kafka broker per test session, a fresh namespace per test.

Broker, in this order: `THREADLOG_BOOTSTRAP` if set; testcontainers' Kafka if
a Docker engine answers; else the local KRaft broker from Maven jars, started
once for the session (and stopped after it, if this session started it).
Nothing here skips when Kafka is missing: a test without a broker fails.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient
from worker_support import WorkerProcess

import threadlog
from threadlog.kernel.topics import Topics, delete_topics

ROOT = Path(__file__).resolve().parent.parent


def _docker_answers() -> bool:
    if not shutil.which("docker"):
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=10).returncode == 0
    except Exception:
        return False


@pytest.fixture(scope="session")
def bootstrap():
    env = os.environ.get("THREADLOG_BOOTSTRAP")
    if env:
        yield env
        return
    if _docker_answers():
        from testcontainers.kafka import KafkaContainer

        with KafkaContainer("apache/kafka:4.1.1").with_kraft() as kafka:
            yield kafka.get_bootstrap_server()
        return
    from threadlog import broker

    data_dir = ROOT / ".state" / "test-broker"
    port = int(os.environ.get("THREADLOG_TEST_PORT", "19092"))
    running = broker.status(data_dir)
    st = running or broker.start(port=port, data_dir=data_dir)
    yield st.bootstrap
    if running is None:
        broker.stop(data_dir)


@pytest.fixture
def namespace(request, bootstrap):
    name = re.sub(r"[^A-Za-z0-9]+", "-", request.node.name)[:40].strip("-")
    ns = f"t-{name}-{uuid.uuid4().hex[:8]}"
    yield ns
    admin = AdminClient({"bootstrap.servers": bootstrap})
    delete_topics(admin, Topics(ns), timeout=10)


@pytest.fixture
async def open_client(bootstrap, namespace, tmp_path):
    """Factory: `await open_client(**options)` opens a client, closed after the test.

    A thin client (`processors="external"`) needs a worker: the first one of a
    test starts a `threadlog worker` process for the test's namespace (unless
    the test runs its own, `own_worker=True`), stopped after the test."""
    opened: list[threadlog.ThreadLog] = []
    workers: list[WorkerProcess] = []
    slots = iter(range(1000))

    async def factory(own_worker: bool = False, **kwargs) -> threadlog.ThreadLog:
        if kwargs.get("processors") == "external" and not own_worker and not workers:
            ns = kwargs.get("namespace", namespace)
            workers.append(await WorkerProcess(bootstrap, ns, tmp_path / "fixture-worker", "fixture").start())
        kwargs.setdefault("namespace", namespace)
        # A state dir per client: two clients of a test are two hosts.
        kwargs.setdefault("state_dir", str(tmp_path / f"state-{next(slots)}"))
        tl = await asyncio.wait_for(threadlog.open(bootstrap, **kwargs), 60)
        opened.append(tl)
        return tl

    yield factory
    for client in reversed(opened):
        await client.close()
    for worker in workers:
        await worker.stop()


@pytest.fixture
async def tl(open_client):
    return await open_client()
