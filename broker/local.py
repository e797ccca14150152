"""A local Apache Kafka (KRaft) resolved from Maven Central: one node, or a small cluster.

No Docker: `mvn dependency:copy-dependencies` fetches `kafka_2.13` and its
runtime jars into a cache dir once; `java -cp libs/* kafka.Kafka` runs one
combined broker+controller bound to 127.0.0.1. Everything the broker writes
(logs, KRaft metadata, topic data) stays under the data dir.

`start(nodes=N)` with N > 1 runs N such combined nodes from the same jars, one
KRaft quorum of all N, each node in its own `node-<id>/` under the data dir with
its own port pair; `cluster.json` there records the layout so `stop`, `status`
and the node helpers (`kill_node`, `stop_node`, `restart_node`) find it again.

`start(sasl=True)` (one node) adds a SASL_PLAINTEXT listener on port+2 with
SCRAM-SHA-256 and SCRAM-SHA-512 next to the PLAINTEXT one; the controller and
inter-broker listeners stay PLAINTEXT, so the broker itself needs no
credentials. `create_scram_user` adds a user (KRaft keeps SCRAM credentials in
its metadata log). No authorizer is configured: any authenticated user may do
everything, and the PLAINTEXT listener stays open - a development setup.
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
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

KAFKA_VERSION = os.environ.get("THREADLOG_KAFKA_VERSION", "4.1.1")
LOG4J_VERSION = "2.24.3"
DEFAULT_PORT = 9092
# Per-node heap when THREADLOG_BROKER_HEAP is unset: one node keeps its 1G;
# several nodes share a dev machine and a test cluster needs far less each.
DEFAULT_HEAP = "1G"
DEFAULT_CLUSTER_HEAP = "512M"

Log = Callable[[str], object]


class BrokerError(RuntimeError):
    """The local broker could not be resolved, started or reached."""


class BrokerFlagsError(BrokerError):
    """Options that cannot go together (or a data dir holding another node count):
    the caller's mistake, found before anything starts (the CLI: INVALID_ARGUMENT)."""


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


def resolve_jars(log: Log = print) -> Path:
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


SCRAM_MECHANISMS = ("SCRAM-SHA-256", "SCRAM-SHA-512")


@dataclass
class BrokerState:
    pid: int
    port: int
    controller_port: int
    data_dir: str
    # The SASL_PLAINTEXT (SCRAM) listener of `start(sasl=True)`, else None.
    sasl_port: int | None = None
    acls: bool = False  # `start(acls=True)`: the authorizer runs

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def sasl_bootstrap(self) -> str | None:
        return f"127.0.0.1:{self.sasl_port}" if self.sasl_port is not None else None


@dataclass
class ClusterState:
    """A running local cluster: node `i` (its KRaft node.id) is `nodes[i - 1]`."""

    cluster_id: str
    data_dir: str
    nodes: list[BrokerState]

    @property
    def bootstrap(self) -> str:
        # Every node, so a client still bootstraps while any one of them is down.
        return ",".join(n.bootstrap for n in self.nodes)


@dataclass
class NodeStatus:
    """One node of a data dir as `status` sees it; pid is None if it never started."""

    node_id: int
    pid: int | None
    port: int
    controller_port: int
    data_dir: str
    alive: bool
    answers: bool

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


def _running(st: BrokerState) -> bool:
    """Does the broker `st` describes still run? Not just "is its pid alive": the
    state file outlives the process (a crash, a reboot, a kill), and its pid is
    then reused by anything -- `stop` signalled whatever process had it. So the
    pid must be a JVM running `kafka.Kafka` with this node's server.properties."""
    return _alive(st.pid) and _is_broker_of(st.pid, Path(st.data_dir) / "server.properties")


def _is_broker_of(pid: int, props: Path) -> bool:
    if not os.path.isdir("/proc/self"):
        return True  # no /proc here (not Linux): the pid is all there is to go by
    proc = Path(f"/proc/{pid}")
    try:
        args = (proc / "cmdline").read_bytes().split(b"\0")
    except FileNotFoundError:
        return False  # gone
    except OSError:
        return True  # not ours to read (another user's process): the pid is all there is
    if b"kafka.Kafka" not in args:
        return False
    for arg in args:
        if arg.endswith(b"server.properties"):
            path = Path(os.fsdecode(arg))
            try:
                if os.path.samefile(path if path.is_absolute() else proc / "cwd" / path, props):
                    return True
            except OSError:
                continue
    return False


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


def live_brokers(bootstrap: str, timeout: float = 2.0) -> set[int]:
    """Node ids of the brokers the cluster's metadata lists (empty if it does not answer).

    KRaft lists registered, unfenced brokers: a killed node stays listed until the
    controller fences it (broker.session.timeout.ms, 9 s by default).
    """
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
    try:
        return set(admin.list_topics(timeout=timeout).brokers)
    except Exception:
        return set()


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

# `start(sasl=True)`: the SCRAM listener next to PLAINTEXT. Clients authenticate
# there; the controller and inter-broker traffic stay on PLAINTEXT listeners, so
# the broker needs no credentials of its own (the JAAS entries name none).
SASL_PROPERTIES = """\
# --sasl: clients authenticate with SCRAM on SASL_PLAINTEXT://127.0.0.1:{sport}.
# Credentials live in the KRaft metadata log (create_scram_user / kafka-configs).
# No authorizer: any authenticated user may do everything. PLAINTEXT stays open.
listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{cport},SASL_PLAINTEXT://127.0.0.1:{sport}
advertised.listeners=PLAINTEXT://127.0.0.1:{port},SASL_PLAINTEXT://127.0.0.1:{sport}
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT
sasl.enabled.mechanisms={mechanisms}
listener.name.sasl_plaintext.scram-sha-256.sasl.jaas.config=\
org.apache.kafka.common.security.scram.ScramLoginModule required;
listener.name.sasl_plaintext.scram-sha-512.sasl.jaas.config=\
org.apache.kafka.common.security.scram.ScramLoginModule required;
"""


# `start(sasl=True, acls=True)`: Kafka's KRaft authorizer, denying whatever no
# ACL allows. The PLAINTEXT listeners (principal ANONYMOUS) stay the operator's:
# inter-broker and controller traffic, creating users and ACLs.
ACL_PROPERTIES = """\
# --acls: SASL users may do only what ACLs allow (create them over PLAINTEXT).
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
super.users=User:ANONYMOUS
allow.everyone.if.no.acl.found=false
"""


def _single_properties(port: int, cport: int, logs: Path, sasl: bool, acls: bool = False) -> str:
    text = SERVER_PROPERTIES.format(port=port, cport=cport, logs=logs)
    if not sasl:
        return text
    extra = SASL_PROPERTIES.format(port=port, cport=cport, sport=port + 2, mechanisms=",".join(SCRAM_MECHANISMS))
    # The SASL block redefines the listener lines; drop the PLAINTEXT-only ones.
    redefined = ("listeners=", "advertised.listeners=", "listener.security.protocol.map=")
    kept = [line for line in text.splitlines() if not line.startswith(redefined)]
    return "\n".join(kept) + "\n" + extra + (ACL_PROPERTIES if acls else "")


CLUSTER_PROPERTIES = """\
# Written by `threadlog broker start --nodes {nodes}`: node {node_id} of a local KRaft cluster,
# every node a combined broker+controller on loopback, all {nodes} in one static quorum.
process.roles=broker,controller
node.id={node_id}
controller.quorum.voters={voters}
listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{cport}
advertised.listeners=PLAINTEXT://127.0.0.1:{port}
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
log.dirs={logs}
num.partitions=1
auto.create.topics.enable=false
# Production-like durability, capped by the node count: 3 copies, 2 in sync for acks=all.
default.replication.factor={rf}
min.insync.replicas={isr}
offsets.topic.replication.factor={rf}
transaction.state.log.replication.factor={rf}
transaction.state.log.min.isr={isr}
share.coordinator.state.topic.replication.factor={rf}
share.coordinator.state.topic.min.isr={isr}
# Few internal partitions: first use of a group or transaction is faster.
offsets.topic.num.partitions=4
transaction.state.log.num.partitions=4
# Otherwise every new consumer group waits 3 s for its first assignment.
group.initial.rebalance.delay.ms=0
# Blob chunks and large checkpoints: allow 16 MiB records.
message.max.bytes=16777216
replica.fetch.max.bytes=16777216
# Abort transactions of crashed producers quickly on a dev cluster.
transaction.abort.timed.out.transaction.cleanup.interval.ms=2000
"""


def _cluster_file(data_dir: Path) -> Path:
    return data_dir / "cluster.json"


def _read_cluster(data_dir: Path) -> dict | None:
    """The cluster layout `data_dir` records, or None (none, or not readable as one).
    Every key the callers read is checked here: a cluster.json without "port"
    made `broker status` fail INTERNAL (KeyError) where a broken broker.json
    reads as "not running" (a review)."""
    try:
        raw = json.loads(_cluster_file(data_dir).read_text())
        if not isinstance(raw, dict) or int(raw.get("nodes", 0)) <= 1:
            return None
        int(raw["port"])
        if not isinstance(raw["cluster_id"], str):
            return None
        return raw
    except (OSError, ValueError, TypeError, KeyError):
        return None


def node_count(data_dir: Path | None = None) -> int:
    """How many nodes `data_dir` holds: 0 if none yet, 1 for a single broker, N for a cluster."""
    data_dir = Path(data_dir or default_data_dir())
    cluster = _read_cluster(data_dir)
    if cluster:
        return int(cluster["nodes"])
    if _state_file(data_dir).exists() or (data_dir / "kraft" / "meta.properties").exists():
        return 1
    return 0


def _node_dirs(data_dir: Path) -> list[tuple[int, Path]]:
    """(node id, node dir) of every node `data_dir` holds; a single broker is node 1 in the dir itself."""
    n = node_count(data_dir)
    if n == 1:
        return [(1, data_dir)]
    return [(i, data_dir / f"node-{i}") for i in range(1, n + 1)]  # none for an empty dir


def _node_dir(data_dir: Path, node_id: int) -> Path:
    for i, d in _node_dirs(data_dir):
        if i == node_id:
            return d
    raise BrokerError(f"{data_dir} holds no node {node_id}")


def _format_command(java: str, cp: str, props: Path, cluster_id: str) -> list[str]:
    return [java, "-cp", cp, "kafka.tools.StorageTool", "format", "-t",
            cluster_id, "-c", str(props), "-g"]


def _launch(java: str, cp: str, node_dir: Path, props: Path, log4j: Path, heap: str) -> subprocess.Popen:
    out = open(node_dir / "stdout.log", "ab")  # noqa: SIM115 - handed to the broker process
    try:
        return subprocess.Popen(
            [
                java,
                f"-Xmx{heap}",
                f"-Xms{heap}",
                "-XX:+UseG1GC",
                "-XX:MaxGCPauseMillis=20",
                "-XX:InitiatingHeapOccupancyPercent=35",
                "-Djava.awt.headless=true",
                f"-Dkafka.logs.dir={node_dir}",
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
    finally:
        out.close()  # the broker holds its own copy


def _write_log4j(node_dir: Path) -> Path:
    log4j = node_dir / "log4j2.properties"
    log4j.write_text(resources.files("threadlog.broker").joinpath("log4j2.properties").read_text())
    return log4j


def _cluster_state(data_dir: Path, cluster: dict) -> ClusterState | None:
    nodes = [_read_state(d) for _, d in _node_dirs(data_dir)]
    if any(n is None for n in nodes):
        return None
    return ClusterState(cluster_id=cluster["cluster_id"], data_dir=str(data_dir),
                        nodes=[n for n in nodes if n is not None])


def nodes_status(data_dir: Path | None = None) -> list[NodeStatus]:
    """Every node `data_dir` holds, running or not (empty if it holds none)."""
    data_dir = Path(data_dir or default_data_dir()).resolve()
    cluster = _read_cluster(data_dir)
    out = []
    for node_id, node_dir in _node_dirs(data_dir):
        st = _read_state(node_dir)
        if st is None:
            # Never launched: report the ports it would get.
            base = int(cluster["port"]) if cluster else DEFAULT_PORT
            port = base + 2 * (node_id - 1)
            out.append(NodeStatus(node_id, None, port, port + 1, str(node_dir), False, False))
            continue
        alive = _running(st)
        out.append(NodeStatus(node_id, st.pid, st.port, st.controller_port, st.data_dir,
                              alive, alive and _answers(st.bootstrap)))
    return out


def status(data_dir: Path | None = None) -> BrokerState | ClusterState | None:
    """The running broker (one node) or cluster (every node up and answering) of `data_dir`, else None."""
    data_dir = Path(data_dir or default_data_dir())
    cluster = _read_cluster(data_dir)
    if cluster:
        nodes = nodes_status(data_dir)
        if nodes and all(n.answers for n in nodes):
            return _cluster_state(data_dir.resolve(), cluster)
        return None
    st = _read_state(data_dir)
    if st and _running(st) and _answers(st.bootstrap):
        return st
    return None


def start(
    port: int | None = None,
    data_dir: Path | None = None,
    timeout: float = 90.0,
    log: Log = print,
    nodes: int | None = None,
    sasl: bool = False,
    acls: bool = False,
) -> BrokerState | ClusterState:
    """Start (or reuse) the local broker or cluster; return its state once it answers.

    `nodes` defaults to what `data_dir` already holds (1 for a new one); asking
    for another count than a data dir holds is an error, not a silent reshape.
    One node returns a `BrokerState`, several a `ClusterState`; both have `.bootstrap`.
    `sasl` (one node only) adds the SCRAM listener on port+2: `BrokerState.sasl_bootstrap`;
    `acls` (with `sasl`) runs the authorizer: SASL users may do only what ACLs allow.
    """
    data_dir = Path(data_dir or default_data_dir()).resolve()
    held = node_count(data_dir)
    if nodes is None:
        nodes = held or 1
    if nodes < 1:
        raise BrokerFlagsError(f"--nodes must be at least 1, not {nodes}")
    if held and held != nodes:
        raise BrokerFlagsError(
            f"{data_dir} holds a {held}-node {'cluster' if held > 1 else 'broker'}, not {nodes};"
            " stop it and pick another --data-dir (or delete this one)"
        )
    if sasl and nodes > 1:
        raise BrokerFlagsError("--sasl runs on a single node; drop --nodes or --sasl")
    if acls and not sasl:
        raise BrokerFlagsError("--acls needs --sasl (the users ACLs name authenticate there)")
    if nodes == 1:
        return _start_single(port, data_dir, timeout, log, sasl, acls)
    return _start_cluster(nodes, port, data_dir, timeout, log)


def _start_single(port: int | None, data_dir: Path, timeout: float, log: Log, sasl: bool = False,
                  acls: bool = False) -> BrokerState:
    existing = _read_state(data_dir)
    if existing and _running(existing):
        if _answers(existing.bootstrap, timeout=10):
            if port is not None and port != existing.port:
                # Reused silently, `broker start --port P` printed another port's
                # bootstrap as if it had started on P (a review); a cluster refuses
                # the same way.
                raise BrokerError(
                    f"the broker of {data_dir} (pid {existing.pid}) runs at {existing.bootstrap}, not port {port};"
                    " omit --port to reuse it, run `threadlog broker stop` first, or pick another --data-dir"
                )
            if sasl and existing.sasl_port is None:
                raise BrokerError(
                    f"the broker of {data_dir} (pid {existing.pid}) runs without --sasl;"
                    " run `threadlog broker stop` first"
                )
            # Reused without its authorizer, a test of ACLs would pass enforcing none (a review).
            if acls and not existing.acls:
                raise BrokerError(
                    f"the broker of {data_dir} (pid {existing.pid}) runs without --acls;"
                    " run `threadlog broker stop` first"
                )
            return existing
        raise BrokerError(
            f"a broker process (pid {existing.pid}) for {data_dir} runs but does not answer;"
            " run `threadlog broker stop` first"
        )
    if port is None:
        port = DEFAULT_PORT
    java = _require("java", "install a Java 17+ runtime (Debian: apt-get install openjdk-17-jre)")
    libs = resolve_jars(log=log)
    cport = port + 1
    sport = port + 2 if sasl else None
    for p in (port, cport, sport):
        if p is not None and not _port_free(p):
            raise BrokerError(f"port {p} on 127.0.0.1 is in use; pick another with --port")
    data_dir.mkdir(parents=True, exist_ok=True)
    logs = data_dir / "kraft"
    props = data_dir / "server.properties"
    props.write_text(_single_properties(port, cport, logs, sasl, acls))
    log4j = _write_log4j(data_dir)
    cp = f"{libs}/*"
    if not (logs / "meta.properties").exists():
        fmt = subprocess.run(_format_command(java, cp, props, uuid.uuid4().hex[:22]), capture_output=True, text=True)
        if fmt.returncode != 0:
            raise BrokerError("kafka storage format failed:\n" + (fmt.stdout + fmt.stderr)[-4000:])
    server_log = data_dir / "server.log"
    heap = os.environ.get("THREADLOG_BROKER_HEAP", DEFAULT_HEAP)
    proc = _launch(java, cp, data_dir, props, log4j, heap)
    state = BrokerState(pid=proc.pid, port=port, controller_port=cport, data_dir=str(data_dir), sasl_port=sport,
                        acls=acls)
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


def _start_cluster(nodes: int, port: int | None, data_dir: Path, timeout: float, log: Log) -> ClusterState:
    deadline = time.monotonic() + timeout
    cluster = _read_cluster(data_dir)
    if cluster and port is not None and port != int(cluster["port"]):
        # The quorum's voter addresses were formatted with these ports.
        raise BrokerError(
            f"the cluster in {data_dir} uses ports from {cluster['port']}; omit --port or pick another --data-dir"
        )
    base = int(cluster["port"]) if cluster else (DEFAULT_PORT if port is None else port)
    cluster_id = cluster["cluster_id"] if cluster else uuid.uuid4().hex[:22]
    ports = {i: (base + 2 * (i - 1), base + 2 * (i - 1) + 1) for i in range(1, nodes + 1)}

    # Reuse what runs; start only the nodes that do not (a whole new cluster, or a partial restart).
    down: list[int] = []
    for i in ports:
        st = _read_state(data_dir / f"node-{i}") if cluster else None
        if st and _running(st):
            if not _answers(st.bootstrap, timeout=10):
                raise BrokerError(
                    f"node {i} (pid {st.pid}) of {data_dir} runs but does not answer;"
                    " run `threadlog broker stop` first"
                )
        else:
            down.append(i)
    if not down:
        state = _cluster_state(data_dir, cluster) if cluster else None
        if state is not None:
            _wait_cluster(state, {}, nodes, deadline, timeout)
            return state

    java = _require("java", "install a Java 17+ runtime (Debian: apt-get install openjdk-17-jre)")
    libs = resolve_jars(log=log)
    for i in down:
        for p in ports[i]:
            if not _port_free(p):
                raise BrokerError(f"port {p} on 127.0.0.1 (node {i}) is in use; pick another base with --port")
    data_dir.mkdir(parents=True, exist_ok=True)
    if not cluster:
        _cluster_file(data_dir).write_text(json.dumps({"nodes": nodes, "port": base, "cluster_id": cluster_id}))
    voters = ",".join(f"{i}@127.0.0.1:{c}" for i, (_, c) in ports.items())
    rf, isr = min(3, nodes), min(2, nodes)
    cp = f"{libs}/*"
    formats: dict[int, subprocess.Popen] = {}
    for i in down:
        node_dir = data_dir / f"node-{i}"
        node_dir.mkdir(exist_ok=True)
        logs = node_dir / "kraft"
        props = node_dir / "server.properties"
        props.write_text(CLUSTER_PROPERTIES.format(
            nodes=nodes, node_id=i, voters=voters, port=ports[i][0], cport=ports[i][1], logs=logs, rf=rf, isr=isr,
        ))
        _write_log4j(node_dir)
        if not (logs / "meta.properties").exists():
            # One JVM each: format them side by side, it halves a cold start.
            formats[i] = subprocess.Popen(_format_command(java, cp, props, cluster_id),
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for i, fmt in formats.items():
        try:
            out, _ = fmt.communicate(timeout=max(5.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            fmt.kill()
            raise BrokerError(f"kafka storage format of node {i} did not finish within {timeout:.0f}s")
        if fmt.returncode != 0:
            raise BrokerError(f"kafka storage format of node {i} failed:\n" + out[-4000:])

    heap = os.environ.get("THREADLOG_BROKER_HEAP", DEFAULT_CLUSTER_HEAP)
    procs: dict[int, subprocess.Popen] = {}
    for i in down:
        node_dir = data_dir / f"node-{i}"
        proc = _launch(java, cp, node_dir, node_dir / "server.properties", node_dir / "log4j2.properties", heap)
        procs[i] = proc
        _state_file(node_dir).write_text(json.dumps(
            BrokerState(pid=proc.pid, port=ports[i][0], controller_port=ports[i][1], data_dir=str(node_dir)).__dict__
        ))
    state = _cluster_state(data_dir, {"cluster_id": cluster_id})
    assert state is not None  # every node has its broker.json now
    try:
        _wait_cluster(state, procs, nodes, deadline, timeout)
        _warm_up(state.bootstrap, deadline, replication=rf)
    except BaseException:
        # A half-started cluster would make the next `start` refuse to run; take down what this call started.
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
        raise
    return state


def _wait_cluster(state: ClusterState, procs: dict[int, subprocess.Popen], nodes: int, deadline: float,
                  timeout: float) -> None:
    """Until every node answers on its own port and the metadata lists all `nodes` brokers."""
    want = set(range(1, nodes + 1))
    while time.monotonic() < deadline:
        for i, proc in procs.items():
            if proc.poll() is not None:
                node_dir = Path(state.nodes[i - 1].data_dir)
                tail = _tail(node_dir / "server.log") or _tail(node_dir / "stdout.log")
                raise BrokerError(f"node {i} exited with {proc.returncode} while starting; last log lines:\n{tail}")
        if all(_answers(n.bootstrap, timeout=1.0) for n in state.nodes) and live_brokers(state.bootstrap) == want:
            return
        time.sleep(0.3)
    tails = "\n".join(f"--- node {i}:\n{_tail(Path(n.data_dir) / 'server.log', 10)}"
                      for i, n in enumerate(state.nodes, 1))
    raise BrokerError(f"the {nodes}-node cluster did not form within {timeout:.0f}s; last log lines:\n{tails}")


def _warm_up(bootstrap: str, deadline: float, replication: int = 1) -> None:
    """Create and load the broker's internal topics now, not on a client's first call.

    `__transaction_state` and `__consumer_offsets` are created on first use and
    their coordinators then load for seconds ("Coordinator load in progress"):
    one transaction that also commits consumer offsets triggers both here.
    """
    from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition
    from confluent_kafka.admin import AdminClient, NewTopic

    topic = "__threadlog_warmup"
    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
    for f in admin.create_topics([NewTopic(topic, 1, replication)]).values():
        try:
            f.result(30)
        except Exception:
            pass  # exists already
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "threadlog-warmup", "log_level": 0})
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": "threadlog-warmup", "log_level": 0})
    try:
        while True:
            try:
                producer.init_transactions(max(1.0, deadline - time.monotonic()))
                break
            except KafkaException as exc:
                # A transaction coordinator still loading its partition answers
                # COORDINATOR_LOAD_IN_PROGRESS, retriable: seen on a 3-node start on busy cores.
                if not exc.args[0].retriable() or time.monotonic() >= deadline:
                    raise
                time.sleep(0.5)
        producer.begin_transaction()
        producer.produce(topic, b"warm-up", partition=0)
        producer.send_offsets_to_transaction([TopicPartition(topic, 0, 0)], consumer.consumer_group_metadata(),
                                             max(1.0, deadline - time.monotonic()))
        producer.commit_transaction(max(1.0, deadline - time.monotonic()))
    finally:
        consumer.close()
        producer.flush(1)


def create_scram_user(
    bootstrap: str,
    user: str,
    password: str,
    mechanism: str = "SCRAM-SHA-256",
    *,
    iterations: int = 8192,
    timeout: float = 30.0,
    kafka: dict | None = None,
) -> None:
    """Create (or update) a SCRAM user; return once the broker lists the credential.

    Through the admin API (AlterUserScramCredentials, Kafka >= 3.5 in KRaft mode,
    where credentials live in the metadata log), normally over the broker's
    PLAINTEXT listener (`kafka`: extra client properties, e.g. to go through an
    authenticated listener). The password never appears in an error.
    """
    from confluent_kafka.admin import (
        AdminClient,
        ScramCredentialInfo,
        ScramMechanism,
        UserScramCredentialUpsertion,
    )

    mechs = {"SCRAM-SHA-256": ScramMechanism.SCRAM_SHA_256, "SCRAM-SHA-512": ScramMechanism.SCRAM_SHA_512}
    if mechanism not in mechs:
        raise BrokerError(f"unknown SCRAM mechanism {mechanism!r}; use one of {', '.join(mechs)}")
    admin = AdminClient({**(kafka or {}), "bootstrap.servers": bootstrap, "log_level": 0})
    deadline = time.monotonic() + timeout
    upsert = UserScramCredentialUpsertion(user, ScramCredentialInfo(mechs[mechanism], iterations),
                                          password.encode())
    try:
        admin.alter_user_scram_credentials([upsert], request_timeout=timeout)[user].result(timeout)
    except Exception as exc:
        text = f"cannot create SCRAM user {user!r} ({mechanism}): {exc}"
        raise BrokerError(text.replace(password, "[redacted]") if password else text) from None
    # The credential is a metadata record: wait until the broker has applied it,
    # so a client authenticating right after this returns is not refused.
    while True:
        try:
            futures = admin.describe_user_scram_credentials([user], request_timeout=5)
            assert isinstance(futures, dict)  # one future per user when users are named
            described = futures[user].result(5)
            if any(c.mechanism == mechs[mechanism] for c in described.scram_credential_infos):
                return
        except Exception:
            pass  # not there yet (RESOURCE_NOT_FOUND) or a retriable error
        if time.monotonic() >= deadline:
            raise BrokerError(f"SCRAM user {user!r} ({mechanism}) not visible within {timeout:g}s")
        time.sleep(0.1)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _terminate(pids: list[int], timeout: float) -> None:
    """SIGTERM all at once (a cluster shuts down in parallel), SIGKILL whatever outlives `timeout`."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    for pid in pids:
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    _reap(pids, 5.0)


def _reap(pids: list[int], timeout: float) -> None:
    # Our own children (the test process started them) stay zombies until waited for.
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass


def stop(data_dir: Path | None = None, timeout: float = 30.0) -> bool:
    """Stop the broker, or every node of the cluster, of `data_dir`; True if any was running."""
    data_dir = Path(data_dir or default_data_dir()).resolve()
    states = [_read_state(d) for _, d in _node_dirs(data_dir)]
    pids = [st.pid for st in states if st and _running(st)]
    if not pids:
        return False
    _terminate(pids, timeout)
    return True


def _running_node(data_dir: Path | None, node_id: int) -> BrokerState:
    data_dir = Path(data_dir or default_data_dir()).resolve()
    st = _read_state(_node_dir(data_dir, node_id))
    if st is None or not _running(st):
        raise BrokerError(f"node {node_id} of {data_dir} is not running")
    return st


def kill_node(data_dir: Path | None, node_id: int) -> int:
    """SIGKILL one node (a crash: no controlled shutdown, no flush); return its pid once it is gone."""
    st = _running_node(data_dir, node_id)
    os.kill(st.pid, signal.SIGKILL)
    _reap([st.pid], 10.0)
    if _alive(st.pid):
        raise BrokerError(f"node {node_id} (pid {st.pid}) survived SIGKILL")
    return st.pid


def stop_node(data_dir: Path | None, node_id: int, timeout: float = 30.0) -> int:
    """Stop one node cleanly (SIGTERM, SIGKILL after `timeout`); return its pid."""
    st = _running_node(data_dir, node_id)
    _terminate([st.pid], timeout)
    return st.pid


def restart_node(data_dir: Path | None, node_id: int, timeout: float = 60.0) -> BrokerState:
    """Start one stopped or killed node again with its own config and data; return it once it is back.

    Back means it answers on its own port and the metadata lists it as a broker
    again. A node that still runs is returned as is.
    """
    data_dir = Path(data_dir or default_data_dir()).resolve()
    node_dir = _node_dir(data_dir, node_id)
    old = _read_state(node_dir)
    if old is None:
        raise BrokerError(f"node {node_id} of {data_dir} was never started; use start")
    if _running(old):
        return old
    for p in (old.port, old.controller_port):
        if not _port_free(p):
            raise BrokerError(f"port {p} of node {node_id} on 127.0.0.1 is in use")
    java = _require("java", "install a Java 17+ runtime (Debian: apt-get install openjdk-17-jre)")
    cp = f"{resolve_jars()}/*"
    default_heap = DEFAULT_CLUSTER_HEAP if node_count(data_dir) > 1 else DEFAULT_HEAP
    heap = os.environ.get("THREADLOG_BROKER_HEAP", default_heap)
    proc = _launch(java, cp, node_dir, node_dir / "server.properties", node_dir / "log4j2.properties", heap)
    state = BrokerState(pid=proc.pid, port=old.port, controller_port=old.controller_port, data_dir=str(node_dir),
                        sasl_port=old.sasl_port)
    _state_file(node_dir).write_text(json.dumps(state.__dict__))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = _tail(node_dir / "server.log") or _tail(node_dir / "stdout.log")
            raise BrokerError(f"node {node_id} exited with {proc.returncode} on restart; last log lines:\n{tail}")
        if _answers(state.bootstrap, timeout=1.0) and node_id in live_brokers(state.bootstrap):
            return state
        time.sleep(0.3)
    proc.kill()
    tail = _tail(node_dir / "server.log")
    raise BrokerError(f"node {node_id} did not come back within {timeout:.0f}s; last log lines:\n{tail}")


if __name__ == "__main__":  # pragma: no cover - debugging aid
    print(start().bootstrap, file=sys.stdout)
