"""`threadlog gc` says when a sweep did not do all it was asked, and exits 1."""

from __future__ import annotations

import asyncio
import json

import pytest
from checkpoint_helpers import file_key
from confluent_kafka.admin import AdminClient
from support import within

from threadlog import ThreadLogError, blob_gc
from threadlog.cli import build_parser, cmd_gc
from threadlog.kernel.errors import unavailable
from threadlog.kernel.topics import Topics, ensure_topics
from threadlog.session import Session


@pytest.mark.parametrize("as_json", [False, True])
def test_gc_prints_a_failed_abandoned_step_and_exits_1(bootstrap, namespace, tmp_path, monkeypatch, capsys, as_json):
    """Tried (a review): the sweep's last step (reading <ns>.blobs for abandoned
    chunks) failing. `gc` printed a summary saying "abandoned puts reclaimed: 0"
    and exited 0, hiding it. The step's failure is injected where the blob GC
    test injects it (its read of the topic); the namespace and broker are real."""
    ensure_topics(AdminClient({"bootstrap.servers": bootstrap}), Topics(namespace), partitions=1, timeout=30)
    monkeypatch.delenv("THREADLOG_KAFKA_CONFIG", raising=False)

    def unreadable(_tl, _current):
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


async def test_gc_exits_1_when_a_sweep_leaves_collects_unsettled(tl, bootstrap, namespace, tmp_path, monkeypatch,
                                                                  capsys):
    """Tried (my last note's list): a sweep whose collect was written but its
    answer lost, and the seal that would settle it failing, so its fences stand
    (`unsettled` 1) and refuse appends naming the blob until a later sweep.
    `gc` printed that in its summary and exited 0, so a cron job saw success.
    The losses are injected at the client's `send` (as in test_blob_gc.py); the
    broker, namespace and judging are real."""
    await within(tl.blobs.put(file_key("u"), b"x"))
    monkeypatch.delenv("THREADLOG_KAFKA_CONFIG", raising=False)
    real_send = Session.send
    lost: list[str] = []

    async def send(self, type_name: str, key: str, payload: dict, timeout: float | None = None):
        if type_name == "threadlog.cmd.CollectBlob" and not lost:
            lost.append(payload["key"])
            await real_send(self, type_name, key, payload, timeout=timeout)  # judged; its answer is lost
            raise ThreadLogError("OUTCOME_UNKNOWN", "injected: the verdict was not learned")
        if type_name == "threadlog.cmd.ClaimBlobForGc" and payload["sweepId"].endswith(".seal"):
            raise ThreadLogError("UNAVAILABLE", "injected: the seal was not written")
        return await real_send(self, type_name, key, payload, timeout=timeout)

    monkeypatch.setattr(Session, "send", send)
    args = build_parser().parse_args(["gc", "--grace-ms", "0", "--bootstrap", bootstrap, "--namespace", namespace,
                                      "--state-dir", str(tmp_path / "cli")])
    status = await within(asyncio.to_thread(cmd_gc, args), 90)
    out = capsys.readouterr().out
    assert lost == [file_key("u")], out
    assert status == 1, out
    assert "  collects left unsettled: 1 (their fences stand" in out, out
