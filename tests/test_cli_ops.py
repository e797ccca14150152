"""Operating the `threadlog` command: one-line errors, read-only commands, namespaces, --version."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import uuid

import pytest
from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient
from support import within

import threadlog
from threadlog.kernel.topics import Topics, ensure_topics


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60,
        cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    # The caller's own THREADLOG_KAFKA_CONFIG must not leak into these runs.
    inherited = {k: v for k, v in os.environ.items() if k != "THREADLOG_KAFKA_CONFIG"}
    full_env = {**inherited, **(env or {})}
    return subprocess.run([sys.executable, "-m", "threadlog", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=cwd)


def one_error_line(proc: subprocess.CompletedProcess, code: str) -> str:
    lines = proc.stderr.splitlines()
    assert proc.returncode != 0, proc
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"threadlog: {code}: "), proc.stderr
    return lines[0]


def topics_of(bootstrap: str, namespace: str) -> set[str]:
    md = AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=10)
    return {t for t in md.topics if t.startswith(namespace + ".")}


def test_version():
    proc = cli("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"threadlog {threadlog.__version__}"


@pytest.mark.parametrize("command", [["replay", "run-x"], ["rebuild"], ["reclaim", "--ttl-ms", "0"]])
def test_read_only_commands_never_create_a_namespace(bootstrap, namespace, tmp_path, command):
    assert topics_of(bootstrap, namespace) == set()
    proc = cli(*command, "--bootstrap", bootstrap, "--namespace", namespace, "--state-dir", str(tmp_path))
    line = one_error_line(proc, "NAMESPACE_NOT_FOUND")
    assert proc.returncode == 2 and namespace in line
    assert topics_of(bootstrap, namespace) == set()


def test_unreachable_bootstrap_is_one_line_naming_the_cause_and_v_shows_the_traceback():
    args = ["namespaces", "list", "--bootstrap", "127.0.0.1:1", "--request-timeout-ms", "3000"]
    line = one_error_line(cli(*args), "UNAVAILABLE")
    assert "Connection refused" in line
    verbose = cli("-v", *args)
    assert verbose.returncode == 2 and "Traceback" in verbose.stderr
    assert verbose.stderr.splitlines()[-1].startswith("threadlog: UNAVAILABLE: ")
    # With -v librdkafka's lines show, each repeated reconnect failure once per
    # window: how many were dropped is said before the one coded line, not never
    # (the window outlived the process) nor after it (said at exit).
    assert re.search(r"Connection refused .*\(\d+ more like it in the last \d+s\)", verbose.stderr), verbose.stderr


def test_kafka_config_file_and_env_refusals_name_the_property_and_hide_secrets(bootstrap, tmp_path):
    secret = f"pw-{uuid.uuid4().hex[:8]}"
    forbidden = tmp_path / "forbidden.properties"
    forbidden.write_text(f"# ops\nsasl.password={secret}\nacks=1\n", encoding="utf-8")
    proc = cli("namespaces", "list", "--bootstrap", bootstrap, "--kafka-config", str(forbidden))
    line = one_error_line(proc, "INVALID_ARGUMENT")
    assert "'acks'" in line and secret not in proc.stderr + proc.stdout
    invalid = tmp_path / "invalid.properties"
    invalid.write_text(f"sasl.password={secret}\nsecurity.protocol={secret}\n", encoding="utf-8")
    proc = cli("namespaces", "list", "--bootstrap", bootstrap, env={"THREADLOG_KAFKA_CONFIG": str(invalid)})
    line = one_error_line(proc, "INVALID_ARGUMENT")
    assert "'security.protocol'" in line and secret not in proc.stderr + proc.stdout
    good = tmp_path / "good.properties"
    good.write_text("client.rack=r1\n", encoding="utf-8")
    proc = cli("namespaces", "list", "--bootstrap", bootstrap, env={"THREADLOG_KAFKA_CONFIG": str(good)})
    assert proc.returncode == 0, proc.stderr


async def test_namespaces_list_and_delete(bootstrap, namespace, tl):
    await within(tl.messages.save_thread("t", ["m"]))
    listed = cli("namespaces", "list", "--bootstrap", bootstrap)
    assert listed.returncode == 0 and namespace in listed.stdout.splitlines()
    refused = cli("namespaces", "delete", namespace, "--bootstrap", bootstrap)
    assert "--yes" in one_error_line(refused, "INVALID_ARGUMENT")
    assert topics_of(bootstrap, namespace) == set(Topics(namespace).all())
    deleted = cli("namespaces", "delete", namespace, "--yes", "--bootstrap", bootstrap)
    assert deleted.returncode == 0, deleted.stderr
    assert namespace not in cli("namespaces", "list", "--bootstrap", bootstrap).stdout.splitlines()
    gone = cli("namespaces", "delete", namespace, "--yes", "--bootstrap", bootstrap)
    one_error_line(gone, "NAMESPACE_NOT_FOUND")


def test_an_unexpected_exception_is_internal_in_one_line(bootstrap, namespace, tmp_path):
    # A namespace that exists, and a store path that cannot be a directory: not a ThreadLogError.
    admin = AdminClient({"bootstrap.servers": bootstrap})
    from threadlog.kernel.topics import ensure_topics

    ensure_topics(admin, Topics(namespace), partitions=1, timeout=30)
    blocker = tmp_path / "file"
    blocker.write_text("", encoding="utf-8")
    proc = cli("rebuild", "--bootstrap", bootstrap, "--namespace", namespace, "--store", str(blocker / "store"))
    assert proc.returncode == 1
    one_error_line(proc, "INTERNAL")


def test_demo_removes_its_namespace_unless_kept(bootstrap, namespace, tmp_path):
    proc = cli("demo", "--bootstrap", bootstrap, "--namespace", namespace, "--state-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "demo ok" in proc.stdout and topics_of(bootstrap, namespace) == set()
    # THREADLOG_BOOTSTRAP, as for every command that connects: no local broker is started.
    proc = cli("demo", "--namespace", f"{namespace}-env", "--state-dir", str(tmp_path / "env"), "--port", "70000",
               env={"THREADLOG_BOOTSTRAP": bootstrap})
    assert proc.returncode == 0, proc.stderr
    assert "demo ok" in proc.stdout and "local Kafka" not in proc.stdout
    # An existing namespace (THREADLOG_BOOTSTRAP may name a real cluster) is never the demo's to delete.
    ensure_topics(AdminClient({"bootstrap.servers": bootstrap}), Topics(namespace), partitions=1, timeout=30)
    proc = cli("demo", "--namespace", namespace, "--state-dir", str(tmp_path / "existing"), "--port", "70000",
               env={"THREADLOG_BOOTSTRAP": bootstrap})
    assert "already exists" in one_error_line(proc, "INVALID_ARGUMENT")
    assert topics_of(bootstrap, namespace) == set(Topics(namespace).all())


def test_demo_interrupted_during_its_open_removes_what_it_created(bootstrap, namespace, tmp_path):
    """Tried (a review): Ctrl-C while the demo's first open ran (its topics created,
    the open not returned yet) left the namespace and its local state behind, and
    the same --namespace then failed "already exists". Interrupted as soon as its
    events topic shows; the open still has its floor markers and judge to start.
    A try whose open returned first proves nothing here: tried again, a few times.
    The open is held open for seconds after its topics exist: its producers linger
    3 s (`--kafka-config`), so its rules floor markers wait that long. Without it,
    two loaded CI runs saw every try's open return before its Ctrl-C."""
    import signal
    import time

    env = {k: v for k, v in os.environ.items() if k != "THREADLOG_KAFKA_CONFIG"}
    slow = tmp_path / "slow.properties"
    slow.write_text("linger.ms=3000\n", encoding="utf-8")
    admin = AdminClient({"bootstrap.servers": bootstrap})  # one, connected: each poll is one round trip
    tries = []
    for attempt in range(8):
        ns = f"{namespace}-{attempt}"
        proc = subprocess.Popen([sys.executable, "-m", "threadlog", "demo", "--bootstrap", bootstrap, "--namespace",
                                 ns, "--state-dir", str(tmp_path / ns), "--kafka-config", str(slow)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            deadline = time.monotonic() + 60
            while Topics(ns).events not in admin.list_topics(timeout=10).topics:
                assert proc.poll() is None and time.monotonic() < deadline, "the demo never created its topics"
                time.sleep(0.005)  # polling the cluster's metadata: there is no event to await
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode in (0, 130), (out, err)  # 0: it had finished first
        # Deleted once the demo exits (a broker's metadata may lag a moment behind).
        deadline = time.monotonic() + 15
        while topics_of(bootstrap, ns):
            assert time.monotonic() < deadline, (ns, out, err)
            time.sleep(0.1)
        tries.append("[client A] opened" in out)
        if not tries[-1]:
            break  # interrupted during the open: the case under test
    if all(tries):
        # The race this test needs was lost every time: two loaded CI runs on
        # 2026-12-04 saw every open return before its Ctrl-C even with the 3 s
        # linger. Nothing was tested then, and saying so beats a red run over
        # timing; every try above still checked that an interrupted demo exits
        # 0/130 and leaves no namespace behind.
        pytest.skip(f"every try's open returned before its Ctrl-C ({len(tries)} tries): the case was not reached")


@pytest.mark.parametrize("args, says", [
    (["worker", "--listen", "bad"], "--listen must be HOST:PORT"),
    (["worker", "--snapshot-every", "0"], "--snapshot-every and --snapshot-interval must be positive"),
    (["worker", "--resume-gap", "0"], "--resume-gap must be a number of records >= 1"),
    (["worker", "--stop-snapshot-timeout", "-1"], "--stop-snapshot-timeout must be a number of seconds >= 0"),
    (["worker", "--stop-snapshot-timeout", "nan"], "--stop-snapshot-timeout must be a number of seconds >= 0"),
    (["worker", "--drain-timeout", "-1"], "--drain-timeout must be >= 0"),
    (["worker", "--stall-after", "nan"], "--stall-after must be a finite number of seconds > 0"),
    (["serve", "--stall-after", "0"], "--stall-after must be a finite number of seconds > 0"),
    (["serve", "--path", "/metrics", "--port", "0"], "--path: path '/metrics' is taken by the server's own route"),
    (["replay", "r", "--records", "--follow"], "cannot --follow"),
    (["namespaces", "list", "--request-timeout-ms", "-5"], "request_timeout_ms must be a positive int"),
    (["namespaces", "list", "--request-timeout-ms", "0"], "request_timeout_ms must be a positive int"),
    (["broker", "start", "--nodes", "0"], "--nodes must be at least 1"),
    (["broker", "start", "--acls"], "--acls needs --sasl"),
])
def test_bad_flags_are_one_coded_line_and_exit_2(bootstrap, tmp_path, args, says):
    """Tried (a review): these printed lines of their own without a code (and
    `broker start --nodes 0` exited 1, kept for INTERNAL), unlike every other
    user error; under --log-format json they were not JSON either."""
    proc = cli(*args, "--bootstrap", bootstrap) if args[0] != "broker" else \
        cli(*args, "--data-dir", str(tmp_path / "broker"))
    assert says in one_error_line(proc, "INVALID_ARGUMENT")
    assert proc.returncode == 2


@pytest.mark.parametrize("args, says", [
    (["namespaces", "list", "ns1"], "namespaces list takes no namespace, --yes or --partial; got a namespace ('ns1')"),
    (["namespaces", "list", "--yes"], "got --yes"),
])
def test_namespaces_list_refuses_what_only_delete_takes(args, says):
    """Tried (a review): `namespaces list ns1` listed every namespace, ignoring
    its argument, which reads as "ns1 exists". Refused before connecting."""
    proc = cli(*args, "--bootstrap", "127.0.0.1:1")
    assert says in one_error_line(proc, "INVALID_ARGUMENT")
    assert proc.returncode == 2


@pytest.mark.parametrize("log_format", ["text", "json"])
@pytest.mark.parametrize("args, says", [
    (["worker", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["broker", "begin"], "argument action: invalid choice: 'begin'"),
    (["reclaim"], "the following arguments are required: --ttl-ms"),
    (["--log-format", "xml", "gc"], "argument --log-format: invalid choice: 'xml'"),
])
def test_usage_errors_are_one_coded_line_json_under_json(log_format, args, says):
    """Tried (a review): argparse's usage and `error:` lines were printed as text
    under --log-format json too (unparseable for a JSON log reader), with no
    stable code. Now INVALID_ARGUMENT, exit 2, as every other user error; JSON
    under --log-format json wherever the flag stands."""
    flags = ["--log-format", "json"] if log_format == "json" else []
    proc = cli(*args[:1], *flags, *args[1:]) if args[0] != "--log-format" else cli(*flags, *args)
    assert proc.returncode == 2, proc
    if log_format == "json":
        lines = [json.loads(ln) for ln in proc.stderr.splitlines()]  # every line one JSON object
        assert len(lines) == 1, proc.stderr
        assert lines[0]["level"] == "ERROR" and lines[0]["message"].startswith("threadlog: INVALID_ARGUMENT: ")
        assert says in lines[0]["message"], lines
    else:
        last = proc.stderr.splitlines()[-1]
        assert proc.stderr.startswith("usage: threadlog"), proc.stderr  # what was meant, above the line
        assert last.startswith("threadlog: INVALID_ARGUMENT: ") and says in last, proc.stderr


def test_broker_start_on_another_port_than_the_running_one_is_refused(bootstrap, tmp_path):
    """Tried (a review): `broker start --port P` where the data dir's broker runs
    on port Q printed Q's bootstrap without a word, as if it had started on P.
    Stand-in for that broker: a process whose command line is the broker's of
    this data dir, with the test broker's port in its state file (`_answers`)."""
    port = int(bootstrap.split(",")[0].rpartition(":")[2])
    props = tmp_path / "server.properties"
    props.write_text("# the broker's\n")
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "kafka.Kafka", str(props)])
    try:
        (tmp_path / "broker.json").write_text(json.dumps(
            {"pid": stand_in.pid, "port": port, "controller_port": port + 1, "data_dir": str(tmp_path)}))
        other = cli("broker", "start", "--port", str(port + 7), "--data-dir", str(tmp_path))
        assert other.returncode == 1, other
        assert f"runs at 127.0.0.1:{port}, not port {port + 7}" in other.stderr, other.stderr
        assert other.stdout == ""  # no bootstrap for a script's `tail -n 1` to take
        for same in (["--port", str(port)], []):  # its own port, or none: reused, as before
            proc = cli("broker", "start", *same, "--data-dir", str(tmp_path))
            assert (proc.returncode, proc.stdout.splitlines()[-1]) == (0, f"127.0.0.1:{port}"), proc
        # The demo's broker is the default data dir's: the same rule for its --port.
        demo = cli("demo", "--port", str(port + 7), env={"THREADLOG_BOOTSTRAP": "",
                                                        "THREADLOG_BROKER_DIR": str(tmp_path)})
        assert demo.returncode == 1 and f"runs at 127.0.0.1:{port}, not port {port + 7}" in demo.stderr, demo
        assert stand_in.poll() is None  # only looked at
    finally:
        stand_in.kill()
        stand_in.wait()


@pytest.mark.parametrize("args", [["namespaces", "list"], ["namespaces", "delete", "x", "--yes"], ["gc"]])
def test_an_empty_bootstrap_is_refused_at_once(args):
    """Tried (a review): `namespaces list --bootstrap ''` waited out its request
    timeout, then failed UNAVAILABLE (`gc` and `open` refused it at once)."""
    proc = cli(*args, "--bootstrap", "", "--request-timeout-ms", "20000")
    assert "bootstrap_servers must be a non-empty string" in one_error_line(proc, "INVALID_ARGUMENT")
    assert proc.returncode == 2


def test_demo_keeps_a_state_dir_that_was_there_before_it(bootstrap, namespace, tmp_path):
    """State dirs are keyed by namespace alone: one already there under the demo's
    --namespace may be another cluster's namespace of that name (a review: the
    demo's cleanup removed it). The demo removes only a state dir it made."""
    root = tmp_path / "root"
    marker = root / namespace / "another-cluster.txt"
    marker.parent.mkdir(parents=True)
    marker.write_text("not the demo's", encoding="utf-8")
    proc = cli("demo", "--bootstrap", bootstrap, "--namespace", namespace, env={"THREADLOG_STATE_DIR": str(root)})
    assert proc.returncode == 0, proc.stderr
    assert marker.read_text(encoding="utf-8") == "not the demo's"
    assert topics_of(bootstrap, namespace) == set()  # its topics, which it made, are gone
    fresh = f"{namespace}-fresh"
    proc = cli("demo", "--bootstrap", bootstrap, "--namespace", fresh, env={"THREADLOG_STATE_DIR": str(root)})
    assert proc.returncode == 0, proc.stderr
    assert not (root / fresh).exists()  # the state it made, removed


def test_every_flag_has_help_and_says_its_default():
    import argparse

    from threadlog.cli import build_parser
    from threadlog.http import Limits

    parser = build_parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    missing = []
    for name, command in [("threadlog", parser), *sub.choices.items()]:
        text = command.format_help()
        for action in command._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            flag = action.option_strings[-1] if action.option_strings else action.dest
            if not action.help:
                missing.append(f"{name} {flag}: no help")
            elif action.default not in (None, False, argparse.SUPPRESS) and action.option_strings \
                    and "default" not in action.help and f"(default: {action.default})" not in " ".join(text.split()):
                missing.append(f"{name} {flag}: default {action.default!r} not shown")
    assert not missing, missing
    serve = build_parser().parse_args(["serve"])
    assert (serve.max_id_bytes, serve.max_body_bytes, serve.max_streams) == \
        (Limits().max_id_bytes, Limits().max_body_bytes, Limits().max_streams)


def test_the_store_path_is_the_same_from_the_env_or_the_flag(tmp_path, monkeypatch):
    from threadlog.config import Options

    monkeypatch.setenv("THREADLOG_STATE_DIR", str(tmp_path))
    from_env = Options(bootstrap_servers="x:1", namespace="ns1").namespace_state
    from_flag = Options(bootstrap_servers="x:1", namespace="ns1", state_dir=str(tmp_path)).namespace_state
    assert from_env == from_flag == tmp_path / "ns1"  # was <dir>/ns1/ns1 from the env


async def test_a_client_keeps_its_stores_under_root_namespace_slot_whichever_way_the_root_came(
        bootstrap, namespace, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("THREADLOG_STATE_DIR", str(tmp_path / "env"))
    old = tmp_path / "env" / namespace / namespace / "slot-0"  # where the default used to put it
    old.mkdir(parents=True)
    async with threadlog.open(bootstrap, namespace=namespace, partitions=1) as tl:
        assert tl.runtime.slot.path == tmp_path / "env" / namespace / "slot-0"
    assert any("older layout" in r.getMessage() and str(old.parent) in r.getMessage() for r in caplog.records)
    assert old.is_dir()  # warned about, never deleted by threadlog
    async with threadlog.open(bootstrap, namespace=namespace, state_dir=str(tmp_path / "flag")) as tl:
        assert tl.runtime.slot.path == tmp_path / "flag" / namespace / "slot-0"


async def test_rebuild_of_a_store_a_live_process_holds_says_so_in_one_line(bootstrap, namespace, tmp_path):
    async with threadlog.open(bootstrap, namespace=namespace, partitions=1, state_dir=str(tmp_path)) as tl:
        await within(tl.messages.save_thread("t", [{"role": "user", "content": "kept"}]))
        store = tl.runtime.slot.path
        before = sorted(p.name for p in store.iterdir())
        proc = cli("rebuild", "--bootstrap", bootstrap, "--namespace", namespace, "--state-dir", str(tmp_path))
        line = one_error_line(proc, "STORE_IN_USE")
        assert proc.returncode == 2
        assert str(store) in line and f"pid {os.getpid()}" in line, line
        assert sorted(p.name for p in store.iterdir()) == before  # nothing touched
        assert await within(tl.messages.load_thread("t")) == [{"role": "user", "content": "kept"}]
    # Once the process is gone, the same rebuild runs.
    proc = cli("rebuild", "--bootstrap", bootstrap, "--namespace", namespace, "--state-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1].startswith(f"rebuilt {store}: ")


async def test_rebuild_through_a_symlink_or_dot_rebuilds_the_slot_itself(bootstrap, namespace, tmp_path):
    """Tried (a review): `--store` a symlink to a slot, and `--store .` run inside
    one. The slot's lock was looked for beside the name given, so a live holder
    went unseen (INTERNAL from RocksDB's own lock; INVALID_ARGUMENT for ".", which
    planted `./.lock` in the store and refused every later rebuild of it), and a
    symlink was never dropped: the "rebuild" resumed from the stored state."""
    from threadlog.projections.store import Store

    rebuild = ["rebuild", "--bootstrap", bootstrap, "--namespace", namespace, "--store"]
    async with threadlog.open(bootstrap, namespace=namespace, partitions=1, state_dir=str(tmp_path)) as tl:
        await within(tl.messages.save_thread("t", [{"role": "user", "content": "kept"}]))
        slot = tl.runtime.slot.path
        link = tmp_path / "link"
        link.symlink_to(slot, target_is_directory=True)
        for store, cwd in ((str(link), None), (".", slot)):
            line = one_error_line(cli(*rebuild, store, cwd=cwd), "STORE_IN_USE")
            assert f"pid {os.getpid()}" in line, line
        assert not (slot / ".lock").exists()
    planted = Store(slot / "events-0")  # a key no proposal wrote: a rebuild drops it
    planted.apply({b"planted": b"x"}, {})
    planted.close()
    for store, cwd in ((str(link), None), (".", slot)):
        proc = cli(*rebuild, store, cwd=cwd)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.splitlines()[-1].startswith(f"rebuilt {slot}: "), proc.stdout
        assert link.is_symlink() and not (slot / ".lock").exists()
        rebuilt = Store(slot / "events-0")
        try:
            assert rebuilt.get(b"planted") is None
        finally:
            rebuilt.close()
    async with threadlog.open(bootstrap, namespace=namespace, partitions=1, state_dir=str(tmp_path)) as tl:
        assert tl.runtime.slot.path == slot
        assert await within(tl.messages.load_thread("t")) == [{"role": "user", "content": "kept"}]


async def test_rebuild_sees_a_live_holder_of_a_slot_whose_name_is_a_symlink(bootstrap, namespace, tmp_path):
    """Tried (a review of the resolve above): a slot that is itself a symlink (to
    a bigger disk) is held by a live process under its name (`slot-0.lock`);
    resolved only, the rebuild asked the target's lock, saw no holder, and dropped
    the slot under the running process."""
    disk = tmp_path / "disk" / "ns-slot"
    disk.mkdir(parents=True)
    base = tmp_path / "state" / namespace
    base.mkdir(parents=True)
    (base / "slot-0").symlink_to(disk, target_is_directory=True)
    async with threadlog.open(bootstrap, namespace=namespace, partitions=1,
                              state_dir=str(tmp_path / "state")) as tl:
        assert tl.runtime.slot.path == base / "slot-0"
        await within(tl.messages.save_thread("t", [{"role": "user", "content": "kept"}]))
        before = sorted(p.name for p in disk.iterdir())
        for store in ([], ["--store", str(disk)], ["--store", str(base / "slot-0")]):
            proc = cli("rebuild", "--bootstrap", bootstrap, "--namespace", namespace, "--state-dir",
                       str(tmp_path / "state"), *store)
            assert f"pid {os.getpid()}" in one_error_line(proc, "STORE_IN_USE"), store
        assert sorted(p.name for p in disk.iterdir()) == before
        assert await within(tl.messages.load_thread("t")) == [{"role": "user", "content": "kept"}]
    proc = cli("rebuild", "--bootstrap", bootstrap, "--namespace", namespace, "--state-dir", str(tmp_path / "state"))
    assert proc.returncode == 0, proc.stderr
    assert (base / "slot-0").is_symlink() and proc.stdout.splitlines()[-1].startswith(f"rebuilt {disk}: ")


async def test_rebuild_refuses_a_path_that_is_not_a_store_or_a_log_cut_short(bootstrap, namespace, tmp_path):
    """A rebuild deletes its store first. Tried: --store naming a folder of other
    files, the namespace's folder (holding a live slot and its lock), and a log
    whose first records were deleted (retention, delete_records). Each is refused
    in one line before anything is deleted."""
    async with threadlog.open(bootstrap, namespace=namespace, partitions=1, state_dir=str(tmp_path)) as tl:
        await within(tl.messages.save_thread("t", [{"role": "user", "content": "kept"}]))
        await within(tl.messages.save_thread("t", [{"role": "user", "content": "kept twice"}]))
        slot = tl.runtime.slot.path
        victim = tmp_path / "victim"
        victim.mkdir()
        (victim / "important.txt").write_text("not a store")
        for store in (victim, slot.parent):
            proc = cli("rebuild", "--bootstrap", bootstrap, "--namespace", namespace, "--store", str(store))
            assert "not a threadlog store" in one_error_line(proc, "INVALID_ARGUMENT")
        assert (victim / "important.txt").read_text() == "not a store"
        assert await within(tl.messages.load_thread("t")) == [{"role": "user", "content": "kept twice"}]
    # Tried (a review): the slot of this namespace rebuilt under another
    # namespace's name was emptied and filled with that one's state.
    before = sorted(p.name for p in slot.iterdir())
    proc = cli("rebuild", "--bootstrap", bootstrap, "--namespace", f"{namespace}-other", "--store", str(slot))
    line = one_error_line(proc, "INVALID_ARGUMENT")
    assert f"holds the state of namespace {namespace!r}, not {namespace + '-other'!r}" in line, line
    assert sorted(p.name for p in slot.iterdir()) == before
    admin = AdminClient({"bootstrap.servers": bootstrap})
    topic = f"{namespace}.events"
    for fut in admin.delete_records([TopicPartition(topic, 0, 1)], request_timeout=30).values():
        fut.result(timeout=30)
    before = sorted(p.name for p in slot.iterdir())
    proc = cli("rebuild", "--bootstrap", bootstrap, "--namespace", namespace, "--store", str(slot))
    assert "no longer starts at offset 0" in one_error_line(proc, "UNAVAILABLE")
    assert sorted(p.name for p in slot.iterdir()) == before and (slot / "events-0" / "CURRENT").exists()


def _locks(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.lock"))


def test_a_refused_rebuild_leaves_no_lock_file_behind(bootstrap, namespace, tmp_path):
    """Tried (a review): a rebuild refused as INVALID_ARGUMENT (a folder that is
    not a store, a file) or NAMESPACE_NOT_FOUND left `<store>.lock` next to the
    store it was told to leave alone (and the store's folder, made to hold it):
    the slot lock was taken before anything was checked."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "important.txt").write_text("not a store")
    afile = tmp_path / "afile"
    afile.write_text("not a store either")
    admin = AdminClient({"bootstrap.servers": bootstrap})
    ensure_topics(admin, Topics(namespace), partitions=1, timeout=30)
    for store, says in ((victim, "not a threadlog store"), (afile, "is not a directory")):
        proc = cli("rebuild", "--bootstrap", bootstrap, "--namespace", namespace, "--store", str(store))
        assert says in one_error_line(proc, "INVALID_ARGUMENT")
        assert proc.returncode == 2
    unknown = tmp_path / "new" / "slot-0"
    for args in (["--store", str(unknown)], ["--state-dir", str(tmp_path / "state")]):
        proc = cli("rebuild", "--bootstrap", bootstrap, "--namespace", f"{namespace}-none", *args)
        assert f"{namespace}-none" in one_error_line(proc, "NAMESPACE_NOT_FOUND")
        assert proc.returncode == 2
    assert _locks(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "victim"]  # no folder made either
    assert (victim / "important.txt").read_text() == "not a store" and afile.read_text() == "not a store either"
    # Not refused: the rebuild holds its slot as before.
    proc = cli("rebuild", "--bootstrap", bootstrap, "--namespace", namespace, "--store", str(unknown))
    assert proc.returncode == 0, proc.stderr
    assert _locks(tmp_path) == ["new/slot-0.lock"]


def test_serve_refuses_a_bad_token_file_or_limit_in_one_line(tmp_path):
    proc = cli("serve", "--token-file", str(tmp_path / "missing"), "--bootstrap", "127.0.0.1:1")
    assert "--token-file" in one_error_line(proc, "INVALID_ARGUMENT")
    (tmp_path / "empty").write_text("# none yet\n")
    proc = cli("serve", "--token-file", str(tmp_path / "empty"), "--bootstrap", "127.0.0.1:1")
    assert "no token" in one_error_line(proc, "INVALID_ARGUMENT")
    proc = cli("serve", "--max-streams", "0", "--bootstrap", "127.0.0.1:1")
    assert "--max-streams" in one_error_line(proc, "INVALID_ARGUMENT")


def test_serve_and_worker_on_a_busy_port_fail_in_one_line_before_connecting():
    """Tried: `serve --port P` and `worker --listen`/`--http` on a port another
    socket listens on, with no cluster to reach (so nothing past the check runs):
    one line, UNAVAILABLE, exit 2 -- not uvicorn's traceback and exit 3."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for args, flag in ((("serve", "--port", str(port)), "--host/--port"),
                           (("worker", "--listen", f"127.0.0.1:{port}"), "--listen"),
                           (("worker", "--http", f"127.0.0.1:{port}"), "--http")):
            proc = cli(*args, "--bootstrap", "127.0.0.1:1", "--namespace", "busy")
            line = one_error_line(proc, "UNAVAILABLE")
            assert proc.returncode == 2 and f"cannot listen on 127.0.0.1:{port} ({flag})" in line, line


@pytest.mark.parametrize("args, flag", [
    (("serve", "--host", "{host}", "--port", "0"), "--host/--port"),
    (("worker", "--listen", "{host}:0"), "--listen"),
    (("worker", "--http", "{host}:0"), "--http"),
])
@pytest.mark.parametrize("host", ["192.0.2.1", "no-such-host.invalid"])  # not this machine's; no name
def test_serve_and_worker_on_a_host_not_theirs_fail_in_one_line_and_create_nothing(bootstrap, namespace, args,
                                                                                     flag, host):
    """Tried (a review): port 0 skipped the check, so a host that is no address
    of this machine (or no name) got uvicorn's traceback and exit 3 from `serve`,
    and `INTERNAL` from a worker -- after it had created the namespace."""
    proc = cli(*(a.format(host=host) for a in args), "--bootstrap", bootstrap, "--namespace", namespace)
    line = one_error_line(proc, "UNAVAILABLE")
    assert proc.returncode == 2 and f"cannot listen on {host}:0 ({flag})" in line, line
    assert topics_of(bootstrap, namespace) == set()


@pytest.mark.parametrize("name", ["..", ".", "my ns"])
def test_demo_refuses_a_bad_namespace_before_anything_and_deletes_nothing(bootstrap, tmp_path, name):
    """Tried (a review): `demo --namespace ..` / `.` with the default state root:
    open refused the name, then the cleanup removed <root>/.. (the root's parent:
    the broker's data next to it) or the root itself, and printed "removed
    namespace" for a name never created. Refused up front now, nothing removed."""
    home = tmp_path / "threadlog"
    (home / "state" / "other-ns" / "slot-0").mkdir(parents=True)
    (home / "state" / "other-ns" / "slot-0" / "CURRENT").write_text("another namespace's store")
    (home / "broker").mkdir()
    (home / "broker" / "broker.json").write_text("precious")
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    proc = cli("demo", "--namespace", name, "--request-timeout-ms", "10000",
               env={"THREADLOG_BOOTSTRAP": bootstrap, "THREADLOG_STATE_DIR": str(home / "state")})
    line = one_error_line(proc, "INVALID_ARGUMENT")
    assert proc.returncode == 2 and repr(name) in line, line
    assert "removed namespace" not in proc.stdout, proc.stdout
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before


def test_the_demo_state_cleanup_removes_only_a_direct_child_of_the_root(tmp_path):
    from threadlog.cli import _remove_state

    root = tmp_path / "root"
    (root / "ns").mkdir(parents=True)
    (root / "ns" / "f").write_text("demo state")
    (tmp_path / "outside").mkdir()
    (root / "link").symlink_to(tmp_path / "outside")
    for bad in ("..", ".", "link", "missing", "ns/.."):
        assert _remove_state(root, bad) is False, bad
    assert (tmp_path / "outside").is_dir() and (root / "ns" / "f").exists()
    assert _remove_state(root, "ns") is True and not (root / "ns").exists() and root.is_dir()


def test_namespaces_delete_refuses_what_list_does_not_call_a_namespace(bootstrap, namespace):
    """Tried (a review): an application's topic `<x>.events`, alone. `namespaces
    list` does not list `x` (not the full set), yet `delete x --yes` deleted the
    topic. Now delete applies list's rule: NAMESPACE_NOT_FOUND naming what
    exists; `--partial` deletes it when the operator says it is what is left of one."""
    from confluent_kafka.admin import NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    for fut in admin.create_topics([NewTopic(f"{namespace}.events", 1, 1)]).values():
        fut.result(30)
    assert namespace not in cli("namespaces", "list", "--bootstrap", bootstrap).stdout.splitlines()
    refused = cli("namespaces", "delete", namespace, "--yes", "--bootstrap", bootstrap)
    line = one_error_line(refused, "NAMESPACE_NOT_FOUND")
    assert refused.returncode == 2 and f"{namespace}.events" in line and "--partial" in line, line
    assert topics_of(bootstrap, namespace) == {f"{namespace}.events"}
    deleted = cli("namespaces", "delete", namespace, "--yes", "--partial", "--bootstrap", bootstrap)
    assert deleted.returncode == 0 and "(events)" in deleted.stdout, deleted
    assert topics_of(bootstrap, namespace) == set()


@pytest.mark.parametrize("args", [
    ("serve", "--port", "99999"), ("serve", "--port", "-1"), ("serve", "--path", "api/chat"),
    ("broker", "start", "--port", "65535"), ("broker", "start", "--port", "65534", "--sasl"),
    ("broker", "start", "--port", "0"), ("broker", "start", "--port", "65531", "--nodes", "3"),
    ("demo", "--bootstrap", "", "--port", "70000"),
])
def test_bad_ports_and_paths_are_invalid_argument_before_anything_binds(tmp_path, args):
    """Tried (a review): ports past 65535 (the broker's controller is port+1) and a
    route path without its '/' were an INTERNAL (OverflowError, AssertionError),
    some after connecting. Now one INVALID_ARGUMENT line, exit 2, nothing started."""
    extra = ["--data-dir", str(tmp_path / "b")] if args[0] == "broker" else \
        ["--bootstrap", "127.0.0.1:1", "--request-timeout-ms", "3000"] if args[0] == "serve" else []
    # The demo's broker would live in THREADLOG_BROKER_DIR: never the default one here.
    env = {"THREADLOG_BOOTSTRAP": "", "THREADLOG_BROKER_DIR": str(tmp_path / "b")} if args[0] == "demo" else None
    proc = cli(*args, *extra, env=env)
    line = one_error_line(proc, "INVALID_ARGUMENT")
    assert proc.returncode == 2 and ("--port" in line or "--path" in line), line
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("interval", ["nan", "inf", "-inf", "0"])
def test_worker_refuses_a_snapshot_interval_that_is_not_a_finite_positive_number(interval):
    # NaN passed `<= 0`: every partition that moved was snapshotted every second.
    proc = cli("worker", f"--snapshot-interval={interval}", "--bootstrap", "127.0.0.1:1",
               "--request-timeout-ms", "3000")
    assert proc.returncode == 2 and "--snapshot-interval must be positive" in proc.stderr, proc


async def test_a_reader_that_stops_reading_is_a_quiet_exit_141(bootstrap, namespace, tl, tmp_path):
    """Tried (a review): `threadlog inspect ... | head -1` printed `threadlog:
    INTERNAL: BrokenPipeError` and exited 1. The pipe's reader is closed before
    the command writes, so every write fails: exit 141 (128 + SIGPIPE), no line."""
    await within(tl.messages.save_thread("t", [{"n": 0}]))
    await within(tl.messages.save_thread("t", [{"n": 1}]))
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        inherited = {k: v for k, v in os.environ.items() if k != "THREADLOG_KAFKA_CONFIG"}
        proc = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "threadlog", "inspect", "events", "--thread", "t", "--bootstrap",
                             bootstrap, "--namespace", namespace, "--state-dir", str(tmp_path)],
            stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=90, env=inherited)
    finally:
        os.close(write_end)
    assert (proc.returncode, proc.stderr) == (141, ""), proc


def test_a_state_dir_that_is_a_file_is_invalid_argument_not_unavailable(bootstrap, namespace, tmp_path):
    """Tried (a review of the README): `--state-dir` naming a file was
    `UNAVAILABLE: cannot open namespace ...: Not a directory`, a code callers retry."""
    afile = tmp_path / "afile"
    afile.write_text("", encoding="utf-8")
    proc = cli("replay", "r", "--bootstrap", bootstrap, "--namespace", namespace, "--state-dir", str(afile))
    assert "is not a directory" in one_error_line(proc, "INVALID_ARGUMENT")
