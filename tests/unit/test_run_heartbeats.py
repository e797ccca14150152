"""Judging run heartbeats (tl.runs.drive) as a pure function, without a broker.

A heartbeat is judged at its record's time, fenced by the run's driver epoch,
and keeps the reclaim indexes (`runD` detached, `runH` heartbeats) in step
with the record; judging the same log twice gives the same verdicts and state.
"""

from __future__ import annotations

import json

import pytest
from test_judging_rules import Log, judge_all
from threadlog.processors.handlers import rules_for
from threadlog.processors.judge import RULES
from threadlog.projections.folds import runs as state
from threadlog.projections.keys import dec_num
from threadlog.projections.store import Store

RUN, THREAD = "r", "t"


@pytest.fixture
def stores(tmp_path):
    opened = [Store(tmp_path / f"s{n}") for n in range(2)]
    yield opened
    for s in opened:
        s.close()


def create(log: Log, at: float = 1_000.0) -> None:
    log.propose("threadlog.cmd.CreateOrResumeRun", THREAD,
                {"runId": RUN, "threadId": THREAD, "startedAt": 1, "status": None}, at=at, seen=True)


def claim(log: Log, epoch: int, at: float, rules: int = 3) -> None:
    log.propose("threadlog.cmd.ClaimRun", THREAD, {"runId": RUN, "threadId": THREAD, "epoch": epoch}, at=at,
                rules=rules)


def beat(log: Log, epoch: int, at: float, detach: bool = False, run: str = RUN) -> None:
    log.propose("threadlog.cmd.HeartbeatRun", THREAD,
                {"runId": run, "threadId": THREAD, "epoch": epoch, "detach": detach}, at=at)


def record(store: Store) -> dict:
    raw = store.get(state.record_key(THREAD, RUN))
    assert raw is not None
    return json.loads(raw)


def index(store: Store) -> dict[bytes, list[float]]:
    """The reclaim index entries: tag -> times."""
    return {tag: [dec_num(k, len(tag))[0] for k, _ in store.scan(tag)]
            for tag in (state.RUN_DETACHED, state.RUN_HEARTBEAT)}


def test_heartbeats_are_judged_at_the_records_time_and_fenced_by_the_epoch(stores):
    log = Log()
    create(log)
    claim(log, 1, at=2_000)                 # 1: heartbeatAt := the claim's time
    beat(log, 1, at=3_000)                  # 2: the driver is alive
    beat(log, 1, at=2_500)                  # 3: a proposer clock behind: judged at 3 000 (time never runs back)
    claim(log, 2, at=4_000)                 # 4: another host claims
    beat(log, 1, at=4_500)                  # 5: the old driver: superseded
    beat(log, 3, at=4_600)                  # 6: an epoch never granted
    beat(log, 0, at=4_700)                  # 7: not an epoch
    beat(log, 2, at=5_000, run="nope")      # 8: unknown run
    verdicts = judge_all(stores[0], log.records)
    codes = [v.get("code") for v in verdicts]
    assert codes == [None, None, None, None, None, "RUN_CLAIM_LOST", "RUN_CLAIM_LOST", "INVALID_ARGUMENT",
                     "RUN_NOT_FOUND"]
    assert verdicts[2]["result"] == {"heartbeatAt": 3_000, "detached": False}
    assert verdicts[3]["result"]["heartbeatAt"] == 3_000
    assert "superseded" in verdicts[5]["message"] and "never granted" in verdicts[6]["message"]
    r = record(stores[0])
    # The refused heartbeats changed nothing: the claim of epoch 2 set the time last.
    assert r["driverEpoch"] == 2 and r["heartbeatAt"] == 4_000 and "detachedSince" not in r
    assert index(stores[0]) == {state.RUN_DETACHED: [], state.RUN_HEARTBEAT: [4_000]}
    # A rebuild (the same log judged again, from nothing) agrees on every verdict and every key.
    assert judge_all(stores[1], log.records) == verdicts
    assert dict(stores[0].scan(b"")) == dict(stores[1].scan(b""))


def test_detach_sets_detached_since_and_a_heartbeat_attaches_again(stores):
    log = Log()
    create(log)
    claim(log, 1, at=2_000)
    beat(log, 1, at=3_000, detach=True)     # 2: detached at the judged time
    beat(log, 1, at=4_000)                  # 3: attached again: detachedSince cleared
    log.propose("threadlog.cmd.UpdateRun", THREAD,
                {"runId": RUN, "threadId": THREAD, "patch": '{"detachedSince": 4500}'}, at=4_500)  # 4: the app
    judge_all(stores[0], log.records[:3])
    r = record(stores[0])
    assert r["detachedSince"] == 3_000 and r["heartbeatAt"] == 3_000
    assert index(stores[0]) == {state.RUN_DETACHED: [3_000], state.RUN_HEARTBEAT: []}
    judge_all(stores[0], log.records[3:4])
    assert "detachedSince" not in record(stores[0]) and record(stores[0])["heartbeatAt"] == 4_000
    assert index(stores[0]) == {state.RUN_DETACHED: [], state.RUN_HEARTBEAT: [4_000]}
    # `update` still sets detachedSince; detached wins over the heartbeat in the indexes.
    judge_all(stores[0], log.records[4:])
    assert index(stores[0]) == {state.RUN_DETACHED: [4_500], state.RUN_HEARTBEAT: []}
    # A finished run leaves both indexes, and its heartbeats are refused.
    log.propose("threadlog.cmd.UpdateRun", THREAD,
                {"runId": RUN, "threadId": THREAD, "patch": '{"status": "completed"}'}, at=5_000)
    beat(log, 1, at=5_100)
    beat(log, 1, at=5_200, detach=True)
    verdicts = judge_all(stores[0], log.records[5:])
    assert [v.get("code") for v in verdicts] == [None, "RUN_TERMINAL", "RUN_TERMINAL"]
    assert index(stores[0]) == {state.RUN_DETACHED: [], state.RUN_HEARTBEAT: []}
    assert record(stores[0])["heartbeatAt"] == 4_000
    judge_all(stores[1], log.records)
    assert dict(stores[0].scan(b"")) == dict(stores[1].scan(b""))


def test_a_claim_judged_before_heartbeats_existed_sets_no_heartbeat_time(stores):
    # RunClaimed v1 (no `at`) as older judges wrote it: folded, it leaves the run
    # out of the heartbeat index, exactly as those judges left it.
    from threadlog.projections.fold import EventMeta, apply_event
    from threadlog.projections.view import View

    log = Log()
    create(log)
    judge_all(stores[0], log.records)
    view = View(stores[0])
    apply_event(view, EventMeta(THREAD, 0, 9.0, "x", "threadlog.evt.RunClaimed"),
                {"runId": RUN, "threadId": THREAD, "epoch": 1, "at": None})
    stores[0].apply(view.buffer, {})
    assert record(stores[0])["driverEpoch"] == 1 and "heartbeatAt" not in record(stores[0])
    assert index(stores[0]) == {state.RUN_DETACHED: [], state.RUN_HEARTBEAT: []}


def test_heartbeats_need_rules_3_and_claims_rules_6():
    assert RULES >= 6
    assert rules_for("threadlog.cmd.HeartbeatRun") == 3 and rules_for("threadlog.cmd.ClaimRun") == 6
    assert rules_for("threadlog.cmd.UpdateRun") == 2


def test_rules_6_claims_remove_the_heartbeat_time(stores):
    """Rules 6 (what clients send now). Tried (a review): a driver heartbeats, then
    another host takes the run over with the SPEC's `claim`, which never
    heartbeats: the first driver's heartbeatAt stayed, and one TTL later
    list_reclaimable listed a run whose driver was streaming. The claim removes it
    (the run leaves the heartbeat index); the next driver's heartbeats list it again."""
    log = Log()
    create(log)
    claim(log, 1, at=2_000, rules=6)
    beat(log, 1, at=3_000)                  # 2: the first driver heartbeats
    claim(log, 2, at=4_000, rules=6)        # 3: taken over: no heartbeat time until its own
    beat(log, 2, at=5_000)                  # 4
    judge_all(stores[0], log.records[:3])
    assert record(stores[0])["heartbeatAt"] == 3_000 and index(stores[0])[state.RUN_HEARTBEAT] == [3_000]
    judge_all(stores[0], log.records[3:4])
    assert "heartbeatAt" not in record(stores[0]) and record(stores[0])["driverEpoch"] == 2
    assert index(stores[0]) == {state.RUN_DETACHED: [], state.RUN_HEARTBEAT: []}
    judge_all(stores[0], log.records[4:])
    assert index(stores[0])[state.RUN_HEARTBEAT] == [5_000]
    judge_all(stores[1], log.records)
    assert dict(stores[0].scan(b"")) == dict(stores[1].scan(b""))


def test_rules_4_claims_leave_heartbeat_time_alone_and_are_refused_on_a_finished_run(stores):
    """Rules 4 (what clients send now). A claim leaves heartbeatAt as it was: a host
    that claims (the SPEC's `claim`) and never heartbeats is not listed once the TTL
    passes (SPEC 6 lists detached runs), and a run whose `drive` died before its
    first heartbeat stays listed by the old one. A claim judged after the run
    finished (a race with the claimer's read, or a raw proposal) is refused."""
    log = Log()
    create(log)
    claim(log, 1, at=2_000, rules=4)        # 1: no heartbeatAt yet, none set
    beat(log, 1, at=3_000)                  # 2: the driver heartbeats
    claim(log, 2, at=4_000, rules=4)        # 3: a new driver: the last heartbeat time stays
    log.propose("threadlog.cmd.UpdateRun", THREAD,
                {"runId": RUN, "threadId": THREAD, "patch": '{"status": "completed"}'}, at=5_000)
    claim(log, 3, at=6_000, rules=4)        # 5: finished: refused
    claim(log, 3, at=6_000, rules=3)        # 6: naming older rules on a partition past rules 4: refused too
    judge_all(stores[0], log.records[:2])
    assert "heartbeatAt" not in record(stores[0]) and index(stores[0])[state.RUN_HEARTBEAT] == []
    judge_all(stores[0], log.records[2:4])
    assert record(stores[0])["heartbeatAt"] == 3_000 and record(stores[0])["driverEpoch"] == 2
    verdicts = judge_all(stores[0], log.records[4:])
    assert [v.get("code") for v in verdicts] == [None, "RUN_TERMINAL", "RUN_TERMINAL"]
    assert record(stores[0])["driverEpoch"] == 2 and record(stores[0])["status"] == "completed"
    assert rules_for("threadlog.cmd.ClaimRun") == 6 <= RULES  # rules 4 named by the proposals here
    judge_all(stores[1], log.records)
    assert dict(stores[0].scan(b"")) == dict(stores[1].scan(b""))


def test_an_older_log_of_rules_3_claims_is_judged_as_its_clients_were_told(stores):
    # No proposal of rules 4 on the partition: a claim after the run finished is
    # accepted, as the judges of rules 3 accepted it (a rebuild must agree).
    log = Log()
    create(log)
    claim(log, 1, at=2_000, rules=3)
    log.propose("threadlog.cmd.UpdateRun", THREAD,
                {"runId": RUN, "threadId": THREAD, "patch": '{"status": "completed"}'}, at=5_000)
    claim(log, 2, at=6_000, rules=3)
    assert [v.get("code") for v in judge_all(stores[0], log.records)] == [None, None, None, None]
    assert record(stores[0])["driverEpoch"] == 2 and record(stores[0])["heartbeatAt"] == 6_000
