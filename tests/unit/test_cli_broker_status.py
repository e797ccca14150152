"""`threadlog broker status` of a broker process that runs but does not answer."""

from __future__ import annotations

import json
import socket
import subprocess
import sys


def test_status_says_alive_not_answering_for_a_silent_broker_process(tmp_path):
    """Tried (a review): the broker's JVM SIGSTOPped (a long GC pause, a wedged
    broker): `status` said "not running" while `start` refused to start another
    over it. Stand-in for the JVM: a process whose command line is the broker's
    of this data dir (what `status` checks) with nothing on its port."""
    props = tmp_path / "server.properties"
    props.write_text("# the broker's\n")
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    silent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "kafka.Kafka", str(props)])
    try:
        (tmp_path / "broker.json").write_text(json.dumps(
            {"pid": silent.pid, "port": port, "controller_port": port + 1, "data_dir": str(tmp_path)}))
        out = subprocess.run([sys.executable, "-m", "threadlog", "broker", "status", "--data-dir", str(tmp_path)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 1, out
        assert out.stdout.startswith(f"alive (pid {silent.pid}), not answering"), out
        assert silent.poll() is None  # only looked at
    finally:
        silent.kill()
        silent.wait()
    gone = subprocess.run([sys.executable, "-m", "threadlog", "broker", "status", "--data-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert (gone.returncode, gone.stdout.strip()) == (1, "not running"), gone


def test_status_of_a_data_dir_whose_cluster_json_lacks_a_key_is_not_running(tmp_path):
    # Tried (a review): a cluster.json without "port" -> `INTERNAL: KeyError: 'port'`, exit 1.
    (tmp_path / "node-1").mkdir()
    for layout in ({"nodes": 2, "cluster_id": "abc"}, {"nodes": 2, "port": 29092}, {"nodes": 2, "port": "x"}):
        (tmp_path / "cluster.json").write_text(json.dumps(layout))
        out = subprocess.run([sys.executable, "-m", "threadlog", "broker", "status", "--data-dir", str(tmp_path)],
                             capture_output=True, text=True, timeout=60)
        assert (out.returncode, out.stdout.strip()) == (1, "not running"), (layout, out)
        assert "INTERNAL" not in out.stderr, out
