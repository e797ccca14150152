"""A secured cluster: `threadlog broker start --sasl` (SASL_PLAINTEXT, SCRAM), end to end with credentials.

A broker of its own for this module (never the shared test broker): started
through the CLI with `--sasl` on free ports, its data under .state/, stopped at
the end whatever happens. Users are created with `threadlog.broker.create_scram_user`
over the PLAINTEXT listener; every client here talks to the SASL listener only.
No authorizer runs on this broker: an authenticated user may do everything.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from checkpoint_helpers import checkpoint
from delivery_support import chunk, collect
from support import within
from threadlog.broker.local import _port_free
from worker_support import WorkerProcess

import threadlog
from threadlog import ThreadLogError, broker

ROOT = Path(__file__).resolve().parent.parent
USER, PASSWORD = "threadlog-app", f"pw-{uuid.uuid4().hex[:12]}"
USER_512, PASSWORD_512 = "threadlog-512", f"pw512-{uuid.uuid4().hex[:12]}"
WRONG = f"wrong-{uuid.uuid4().hex[:12]}"
# Wrong credentials end `open` this fast (measured ~0.5 s: the broker answers a
# failed SCRAM exchange after ~350 ms), never after the request timeout (30 s).
AUTH_FAILURE_BOUND_S = 5.0


def _free_port_block(count: int) -> int:
    """A base port with `count` free consecutive ports, from 19692 up (never the shared 19092)."""
    for _ in range(200):
        base = random.randrange(19692, 29000, 4)
        if all(_port_free(p) for p in range(base, base + count)):
            return base
    raise RuntimeError("no block of free ports on 127.0.0.1")


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("THREADLOG_KAFKA_CONFIG", "THREADLOG_BOOTSTRAP")}


class Secured:
    def __init__(self, bootstrap: str, sasl_bootstrap: str, data_dir: Path) -> None:
        self.bootstrap = bootstrap  # PLAINTEXT, for admin work only
        self.sasl = sasl_bootstrap
        self.data_dir = data_dir

    @staticmethod
    def props(user: str = USER, password: str = PASSWORD, mechanism: str = "SCRAM-SHA-256") -> dict[str, str]:
        return {"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": mechanism,
                "sasl.username": user, "sasl.password": password}

    def properties_file(self, path: Path, password: str = PASSWORD) -> Path:
        """The credentials as a Java client.properties file, as Kafka users have them."""
        lines = [f"{k}={v}" for k, v in self.props(password=password).items()]
        path.write_text("# SCRAM client settings\n" + "\n".join(lines) + "\n")
        return path


@pytest.fixture(scope="module")
def secured() -> Iterator[Secured]:
    data_dir = ROOT / ".state" / f"sasl-test-{uuid.uuid4().hex[:8]}"
    port = _free_port_block(3)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "threadlog", "broker", "start", "--sasl", "--port", str(port),
             "--data-dir", str(data_dir)],
            capture_output=True, text=True, timeout=180, env={**_env(), "THREADLOG_BROKER_HEAP": "512M"})
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip().splitlines()[-1] == f"127.0.0.1:{port}"  # the last line stays PLAINTEXT
        assert f"sasl bootstrap 127.0.0.1:{port + 2} (SASL_PLAINTEXT, SCRAM-SHA-256, SCRAM-SHA-512" in proc.stderr
        st = broker.status(data_dir)
        assert isinstance(st, broker.BrokerState) and st.sasl_bootstrap == f"127.0.0.1:{port + 2}"
        broker.create_scram_user(st.bootstrap, USER, PASSWORD, "SCRAM-SHA-256")
        broker.create_scram_user(st.bootstrap, USER_512, PASSWORD_512, "SCRAM-SHA-512")
        yield Secured(st.bootstrap, st.sasl_bootstrap, data_dir)
    finally:
        broker.stop(data_dir, timeout=20)
        assert not any(n.alive for n in broker.nodes_status(data_dir))
        shutil.rmtree(data_dir, ignore_errors=True)


def test_status_names_the_sasl_listener(secured):
    proc = subprocess.run([sys.executable, "-m", "threadlog", "broker", "status", "--data-dir", str(secured.data_dir)],
                          capture_output=True, text=True, timeout=60, env=_env())
    assert proc.returncode == 0 and f"SASL_PLAINTEXT (SCRAM) at {secured.sasl}" in proc.stdout, proc


def test_a_broker_without_acls_is_not_reused_as_one_with_them(secured):
    """Tried (a review): `start --sasl --acls` on the data dir of a running broker
    started without --acls returned it: ACL tests would pass enforcing nothing."""
    with pytest.raises(broker.BrokerError, match="without --acls"):
        broker.start(data_dir=secured.data_dir, sasl=True, acls=True, log=lambda m: None)
    assert broker.start(data_dir=secured.data_dir, sasl=True, log=lambda m: None).acls is False


def test_sasl_needs_a_single_node(tmp_path):
    with pytest.raises(broker.BrokerError, match="single node"):
        broker.start(data_dir=tmp_path / "x", nodes=3, sasl=True, log=lambda m: None)


async def test_transcripts_checkpoints_runs_and_delivery_with_scram_credentials(secured, tmp_path):
    ns = f"sasl-{uuid.uuid4().hex[:8]}"
    async with await within(threadlog.open(secured.sasl, namespace=ns, state_dir=str(tmp_path / "a"),
                                           kafka=secured.props()), 60) as tl:
        await within(tl.messages.save_thread("t", [{"role": "user", "content": "hi"}]))
        assert await within(tl.messages.load_thread("t")) == [{"role": "user", "content": "hi"}]

        lease = await within(tl.checkpoints.acquire_writer("t"))
        assert await within(tl.checkpoints.append(checkpoint=checkpoint("c1", "t"), expected_head_id=None,
                                                  writer=lease)) == "c1"
        assert await within(tl.checkpoints.get_head("t")) == "c1"

        await within(tl.runs.create_or_resume(run_id="run-1", thread_id="t", started_at=1))
        epoch = await within(tl.runs.claim("run-1"))
        log = tl.delivery("run-1", epoch=epoch)
        offsets = await within(log.append([chunk(0), chunk(1)]))
        await within(log.close())
        assert [(o, c) for o, c in await collect(tl.delivery("run-1").read("-1"))] == \
            list(zip(offsets, [chunk(0), chunk(1)], strict=True))

    # Another host, the other mechanism: sees every write above.
    async with await within(threadlog.open(secured.sasl, namespace=ns, state_dir=str(tmp_path / "b"),
                                           kafka=secured.props(USER_512, PASSWORD_512, "SCRAM-SHA-512"),
                                           create_topics=False), 60) as other:
        assert await within(other.messages.load_thread("t")) == [{"role": "user", "content": "hi"}]
        assert await within(other.checkpoints.get_head("t")) == "c1"
        assert (await within(other.runs.get("run-1")))["driverEpoch"] == epoch

    # `threadlog replay --kafka-config`: the run's chunks, through the SASL listener.
    config = secured.properties_file(tmp_path / "client.properties")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "threadlog", "replay", "run-1", "--bootstrap", secured.sasl, "--namespace", ns,
        "--state-dir", str(tmp_path / "replay"), "--kafka-config", str(config),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=_env())
    out, err = await within(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    assert len(out.decode().splitlines()) == 2


async def test_a_thin_client_through_a_worker_with_a_kafka_config_file(secured, tmp_path):
    ns = f"sasl-thin-{uuid.uuid4().hex[:8]}"
    config = secured.properties_file(tmp_path / "client.properties")
    # The namespace first (a worker judges an existing one, or creates it: either way with credentials).
    async with await within(threadlog.open(secured.sasl, namespace=ns, state_dir=str(tmp_path / "seed"),
                                           kafka=secured.props()), 60):
        pass
    # --kafka-config wins over THREADLOG_KAFKA_CONFIG, were it set in this environment.
    worker = WorkerProcess(secured.sasl, ns, tmp_path / "worker", "sasl", "--kafka-config", str(config))
    try:
        await worker.start(90)
        async with await within(threadlog.open(secured.sasl, namespace=ns, state_dir=str(tmp_path / "thin"),
                                               processors="external", kafka=secured.props()), 60) as thin:
            await within(thin.messages.save_thread("t", ["via worker"]))
            assert await within(thin.messages.load_thread("t")) == ["via worker"]
    finally:
        await worker.stop()
    assert PASSWORD not in worker.stderr()


async def test_serve_with_a_kafka_config_file_answers_http(secured, tmp_path):
    ns = f"sasl-serve-{uuid.uuid4().hex[:8]}"
    async with await within(threadlog.open(secured.sasl, namespace=ns, state_dir=str(tmp_path / "seed"),
                                           kafka=secured.props()), 60) as tl:
        await within(tl.messages.save_thread("t", ["served"]))
    config = secured.properties_file(tmp_path / "client.properties")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "threadlog", "serve", "--bootstrap", secured.sasl, "--namespace", ns,
        "--port", "0", "--state-dir", str(tmp_path / "serve"), "--kafka-config", str(config),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=_env())
    try:
        line = (await within(proc.stdout.readline(), 90)).decode()
        assert "serving namespace" in line, (line, (await within(proc.stderr.read(), 10)).decode())
        base = line.split(" at ", 1)[1].strip().removesuffix("/api/chat")
        async with httpx.AsyncClient(timeout=30) as http:
            r = await http.get(f"{base}/api/chat", params={"threadId": "t"})
        assert r.status_code == 200 and r.json()["messages"] == ["served"], r.text
        proc.terminate()
        assert await within(proc.wait(), 30) == 0
        err = (await within(proc.stderr.read(), 10)).decode()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert PASSWORD not in err


async def test_a_wrong_password_fails_open_within_seconds_naming_the_authentication_failure(secured, tmp_path):
    for mechanism, user in (("SCRAM-SHA-256", USER), ("SCRAM-SHA-512", USER_512), ("SCRAM-SHA-256", "nobody")):
        started = time.monotonic()
        with pytest.raises(ThreadLogError) as err:
            await within(threadlog.open(secured.sasl, namespace="sasl-never", state_dir=str(tmp_path / "x"),
                                        kafka=secured.props(user, WRONG, mechanism)), 60)
        elapsed = time.monotonic() - started
        assert err.value.code == "UNAVAILABLE"
        message = str(err.value)
        assert "authentication failed" in message and "Authentication failed" in message, message
        assert mechanism in message and WRONG not in message
        assert elapsed < AUTH_FAILURE_BOUND_S, elapsed


def test_the_cli_prints_one_line_and_exits_non_zero_on_a_wrong_password(secured, tmp_path):
    config = secured.properties_file(tmp_path / "bad.properties", password=WRONG)
    state = ["--state-dir", str(tmp_path / "state")]
    for args in (["namespaces", "list"], ["serve", "--namespace", "sasl-never", "--port", "0", *state],
                 ["worker", "--namespace", "sasl-never", *state]):
        started = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "threadlog", *args, "--bootstrap", secured.sasl, "--kafka-config", str(config)],
            capture_output=True, text=True, timeout=60, env=_env())
        elapsed = time.monotonic() - started
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode != 0 and len(lines) == 1, (args, proc.stderr)
        assert lines[0].startswith("threadlog: UNAVAILABLE: authentication failed:"), lines
        assert "SCRAM-SHA-256" in lines[0] and WRONG not in proc.stderr + proc.stdout
        # The interpreter and imports take ~1-2 s here; the authentication failure well under a second.
        assert elapsed < AUTH_FAILURE_BOUND_S + 5, (args, elapsed)
