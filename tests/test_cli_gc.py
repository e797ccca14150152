"""`threadlog gc` says when its abandoned-chunk step failed, and exits 1."""

from __future__ import annotations

import json

import pytest
from confluent_kafka.admin import AdminClient

from threadlog import blob_gc
from threadlog.cli import build_parser, cmd_gc
from threadlog.kernel.errors import unavailable
from threadlog.kernel.topics import Topics, ensure_topics


@pytest.mark.parametrize("as_json", [False, True])
def test_gc_prints_a_failed_abandoned_step_and_exits_1(bootstrap, namespace, tmp_path, monkeypatch, capsys, as_json):
    """Tried (a review): the sweep's last step (reading <ns>.blobs for abandoned
    chunks) failing. `gc` printed a summary saying "abandoned puts reclaimed: 0"
    and exited 0, hiding it. The step's failure is injected where the blob GC
    test injects it (its read of the topic); the namespace and broker are real."""
    ensure_topics(AdminClient({"bootstrap.servers": bootstrap}), Topics(namespace), partitions=1, timeout=30)
    monkeypatch.delenv("THREADLOG_KAFKA_CONFIG", raising=False)

    def unreadable(_tl):
        raise unavailable("injected: the blobs topic could not be read")

    monkeypatch.setattr(blob_gc, "_scan_chunks", unreadable)
    args = build_parser().parse_args(["gc", "--grace-ms", "0", "--bootstrap", bootstrap, "--namespace", namespace,
                                      "--state-dir", str(tmp_path), *(["--json"] if as_json else [])])
    status = cmd_gc(args)
    out = capsys.readouterr().out
    assert status == 1, out
    if as_json:
        assert json.loads(out)["abandoned_error"] == "UNAVAILABLE: injected: the blobs topic could not be read"
    else:
        assert "  abandoned puts: NOT reclaimed (UNAVAILABLE: injected: the blobs topic could not be read)" \
            in out.splitlines(), out
