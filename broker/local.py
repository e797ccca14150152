"""A local, single-node Apache Kafka (KRaft) resolved from Maven Central.

No Docker: `mvn dependency:copy-dependencies` fetches `kafka_2.13` and its
runtime jars into a cache dir once; `java -cp libs/* kafka.Kafka` runs one
combined broker+controller bound to 127.0.0.1. Everything the broker writes
(logs, KRaft metadata, topic data) stays under the data dir.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

KAFKA_VERSION = os.environ.get("THREADLOG_KAFKA_VERSION", "4.1.1")
LOG4J_VERSION = "2.24.3"
DEFAULT_PORT = 9092


class BrokerError(RuntimeError):
    """The local broker could not be resolved, started or reached."""


def cache_dir() -> Path:
    base = os.environ.get("THREADLOG_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "threadlog"
    )
    return Path(base) / f"kafka-{KAFKA_VERSION}"


def default_data_dir() -> Path:
    base = os.environ.get("THREADLOG_BROKER_DIR") or os.path.join(
        os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state"),
        "threadlog",
        "broker",
    )
    return Path(base)


def _require(tool: str, hint: str) -> str:
    path = shutil.which(tool)
    if not path:
        raise BrokerError(f"{tool} not found on PATH: {hint}")
    return path


def resolve_jars(log=print) -> Path:
    """Download Kafka and its runtime dependencies once; return the libs dir."""
    target = cache_dir()
    libs = target / "libs"
    marker = target / ".resolved"
    if marker.exists() and any(libs.glob("kafka_2.13-*.jar")):
        return libs
    mvn = _require("mvn", "install Maven (Debian: apt-get install maven)")
    target.mkdir(parents=True, exist_ok=True)
    pom = resources.files("threadlog.broker").joinpath("pom.xml").read_text()
    pom = pom.replace("@KAFKA_VERSION@", KAFKA_VERSION).replace("@LOG4J_VERSION@", LOG4J_VERSION)
    (target / "pom.xml").write_text(pom)
    log(f"resolving Apache Kafka {KAFKA_VERSION} from Maven Central into {libs} ...")
    proc = subprocess.run(
        [
            mvn,
            "-q",
            "-B",
            "dependency:copy-dependencies",
            f"-DoutputDirectory={libs}",
            "-DincludeScope=runtime",
        ],
        cwd=target,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise BrokerError(
            "maven could not resolve Kafka:\n" + (proc.stdout + proc.stderr)[-4000:]
        )
    marker.write_text(KAFKA_VERSION)
    return libs


@dataclass
class BrokerState:
    pid: int
    port: int
    controller_port: int
    data_dir: str

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"


def _state_file(data_dir: Path) -> Path:
    return data_dir / "broker.json"


def _read_state(data_dir: Path) -> BrokerState | None:
    try:
        raw = json.loads(_state_file(data_dir).read_text())
        return BrokerState(**raw)
    except (OSError, ValueError, TypeError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child still answers kill(0); check its state when we can.
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return True


def _answers(bootstrap: str, timeout: float = 2.0) -> bool:
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
    try:
        md = admin.list_topics(timeout=timeout)
        return bool(md.brokers)
    except Exception:
        return False


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        # Like the broker's own listener: TIME_WAIT sockets of a stopped broker do not count.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


SERVER_PROPERTIES = """\
# Written by `threadlog broker start`: one combined KRaft node on loopback.
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:{cport}
listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{cport}
advertised.listeners=PLAINTEXT://127.0.0.1:{port}
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
log.dirs={logs}
num.partitions=1
auto.create.topics.enable=false
# A single node can only replicate once.
offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
min.insync.replicas=1
# Few internal partitions: first use of a group or transaction is faster.
offsets.topic.num.partitions=4
transaction.state.log.num.partitions=4
# Otherwise every new consumer group waits 3 s for its first assignment.
group.initial.rebalance.delay.ms=0
# Blob chunks and large checkpoints: allow 16 MiB records.
message.max.bytes=16777216
replica.fetch.max.bytes=16777216
# Abort transactions of crashed producers quickly on a dev node.
transaction.abort.timed.out.transaction.cleanup.interval.ms=2000
"""


def status(data_dir: Path | None = None) -> BrokerState | None:
    data_dir = Path(data_dir or default_data_dir())
    st = _read_state(data_dir)
    if st and _alive(st.pid) and _answers(st.bootstrap):
        return st
    return None


def start(
    port: int = DEFAULT_PORT,
    data_dir: Path | None = None,
    timeout: float = 90.0,
    log=print,
) -> BrokerState:
    """Start (or reuse) the local broker; return its state once it answers."""
    data_dir = Path(data_dir or default_data_dir()).resolve()
    existing = _read_state(data_dir)
    if existing and _alive(existing.pid):
        if _answers(existing.bootstrap, timeout=10):
            return existing
        raise BrokerError(
            f"a broker process (pid {existing.pid}) for {data_dir} runs but does not answer;"
            " run `threadlog broker stop` first"
        )
    java = _require("java", "install a Java 17+ runtime (Debian: apt-get install openjdk-17-jre)")
    libs = resolve_jars(log=log)
    cport = port + 1
    for p in (port, cport):
        if not _port_free(p):
            raise BrokerError(f"port {p} on 127.0.0.1 is in use; pick another with --port")
    data_dir.mkdir(parents=True, exist_ok=True)
    logs = data_dir / "kraft"
    props = data_dir / "server.properties"
    props.write_text(SERVER_PROPERTIES.format(port=port, cport=cport, logs=logs))
    log4j = data_dir / "log4j2.properties"
    log4j.write_text(resources.files("threadlog.broker").joinpath("log4j2.properties").read_text())
    cp = f"{libs}/*"
    if not (logs / "meta.properties").exists():
        fmt = subprocess.run(
            [java, "-cp", cp, "kafka.tools.StorageTool", "format", "-t",
             uuid.uuid4().hex[:22], "-c", str(props), "-g"],
            capture_output=True,
            text=True,
        )
        if fmt.returncode != 0:
            raise BrokerError("kafka storage format failed:\n" + (fmt.stdout + fmt.stderr)[-4000:])
    server_log = data_dir / "server.log"
    out = open(data_dir / "stdout.log", "ab")  # noqa: SIM115 - handed to the broker process
    heap = os.environ.get("THREADLOG_BROKER_HEAP", "1G")
    proc = subprocess.Popen(
        [
            java,
            f"-Xmx{heap}",
            f"-Xms{heap}",
            "-XX:+UseG1GC",
            "-XX:MaxGCPauseMillis=20",
            "-XX:InitiatingHeapOccupancyPercent=35",
            "-Djava.awt.headless=true",
            f"-Dkafka.logs.dir={data_dir}",
            f"-Dlog4j2.configurationFile={log4j}",
            "-cp",
            cp,
            "kafka.Kafka",
            str(props),
        ],
        stdout=out,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # survives the CLI that started it
    )
    state = BrokerState(pid=proc.pid, port=port, controller_port=cport, data_dir=str(data_dir))
    _state_file(data_dir).write_text(json.dumps(state.__dict__))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        if _answers(state.bootstrap, timeout=1.0):
            _warm_up(state.bootstrap, deadline)
            return state
        time.sleep(0.2)
    if proc.poll() is None:
        proc.kill()
    tail = _tail(server_log) or _tail(data_dir / "stdout.log")
    raise BrokerError(f"broker did not start within {timeout:.0f}s; last log lines:\n{tail}")


def _warm_up(bootstrap: str, deadline: float) -> None:
    """Create and load the broker's internal topics now, not on a client's first call.

    `__transaction_state` and `__consumer_offsets` are created on first use and
    their coordinators then load for seconds ("Coordinator load in progress"):
    one transaction that also commits consumer offsets triggers both here.
    """
    from confluent_kafka import Consumer, Producer, TopicPartition
    from confluent_kafka.admin import AdminClient, NewTopic

    topic = "__threadlog_warmup"
    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
    for f in admin.create_topics([NewTopic(topic, 1, 1)]).values():
        try:
            f.result(30)
        except Exception:
            pass  # exists already
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "threadlog-warmup", "log_level": 0})
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": "threadlog-warmup", "log_level": 0})
    try:
        producer.init_transactions(max(1.0, deadline - time.monotonic()))
        producer.begin_transaction()
        producer.produce(topic, b"warm-up", partition=0)
        producer.send_offsets_to_transaction([TopicPartition(topic, 0, 0)], consumer.consumer_group_metadata(),
                                             max(1.0, deadline - time.monotonic()))
        producer.commit_transaction(max(1.0, deadline - time.monotonic()))
    finally:
        consumer.close()
        producer.flush(1)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def stop(data_dir: Path | None = None, timeout: float = 30.0) -> bool:
    """Stop the broker of `data_dir`; True if one was running."""
    data_dir = Path(data_dir or default_data_dir()).resolve()
    st = _read_state(data_dir)
    if not st or not _alive(st.pid):
        return False
    os.kill(st.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and _alive(st.pid):
        time.sleep(0.2)
    if _alive(st.pid):
        os.kill(st.pid, signal.SIGKILL)
    try:
        os.waitpid(st.pid, os.WNOHANG)
    except ChildProcessError:
        pass
    return True


if __name__ == "__main__":  # pragma: no cover - debugging aid
    print(start().bootstrap, file=sys.stdout)
