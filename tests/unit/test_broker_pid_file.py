"""A local broker's state file outlives its process (a crash, a reboot), and its
pid is then reused by anything. `threadlog broker stop` signalled whatever
process held that pid; it must only ever signal the broker of that data dir."""

from __future__ import annotations

import json
import subprocess
import sys

from threadlog.broker import local


def test_stop_never_signals_a_process_that_took_a_dead_brokers_pid(tmp_path):
    # Tried: broker.json naming the pid of an unrelated process (a sleep), as after
    # the broker died and its pid was reused; then `stop` and `status`, by the API and the CLI.
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        (tmp_path / "broker.json").write_text(json.dumps(
            {"pid": bystander.pid, "port": 45678, "controller_port": 45679, "data_dir": str(tmp_path)}))
        assert local.stop(tmp_path, timeout=2) is False
        assert local.status(tmp_path) is None
        out = subprocess.run([sys.executable, "-m", "threadlog", "broker", "stop", "--data-dir", str(tmp_path)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and out.stdout.strip() == "not running", out
        assert bystander.poll() is None  # never signalled
    finally:
        bystander.kill()
        bystander.wait()
