"""`<ns>.members` records read as workers' announcements (threadlog/members.py), without a broker."""

from __future__ import annotations

import pytest

from threadlog.kernel.checkpoint_rules import MAX_LEASE_MS
from threadlog.members import LIVE_AFTER_S, parse_member, received

BASE = {"address": "127.0.0.1:1", "startedAt": 1, "heartbeatAt": 2, "partitions": [0, 2]}


def test_an_announcement_carries_the_lease_setting_its_worker_grants():
    member = parse_member("w", {**BASE, "leaseDurationMs": 5_000, "renewAfterMs": 1_000})
    assert (member.address, member.partitions, member.lease) == ("127.0.0.1:1", (0, 2), (5_000, 1_000))
    assert parse_member("w", BASE).lease is None  # a worker from before: the proposer's own setting


@pytest.mark.parametrize("lease", [
    {"leaseDurationMs": 5_000},  # half of a setting
    {"renewAfterMs": 1_000},
    {"leaseDurationMs": 5_000, "renewAfterMs": 5_000},  # renewed no earlier than it ends
    {"leaseDurationMs": 5_000, "renewAfterMs": 0},
    {"leaseDurationMs": MAX_LEASE_MS + 1, "renewAfterMs": 1},  # longer than open() allows
    {"leaseDurationMs": True, "renewAfterMs": 0},  # not ints
    {"leaseDurationMs": 5_000.0, "renewAfterMs": 1_000},
    {"leaseDurationMs": "5000", "renewAfterMs": "1000"},
])
def test_a_lease_setting_this_version_would_not_start_with_is_ignored_not_the_member(lease):
    # open() and `threadlog worker` refuse these settings here; a later version
    # may not, and its workers must stay reachable: the member is kept, its
    # lease setting ignored (proposers use their own).
    member = parse_member("w", {**BASE, **lease})
    assert (member.address, member.partitions, member.lease) == ("127.0.0.1:1", (0, 2), None)


def test_a_heartbeat_from_a_clock_ahead_expires_as_one_received_now():
    """Tried (a review's suspicion, my last notes): a worker whose clock ran an hour
    ahead announced heartbeats an hour in the future; once dead it stayed live,
    and first in the newest-first order, for that hour. Received now, a heartbeat
    counts as sent no later than now."""
    now = 1_700_000_000_000.0
    ahead = parse_member("w", {**BASE, "heartbeatAt": now + 3_600_000})
    taken = received(ahead, now)
    assert taken.heartbeat_at == now and taken.live(now + 1_000)
    assert not taken.live(now + LIVE_AFTER_S * 1000 + 1)
    assert ahead.live(now + LIVE_AFTER_S * 1000 + 1)  # as the announcement alone said
    on_time = parse_member("w", {**BASE, "heartbeatAt": now - 500})
    assert received(on_time, now) is on_time
