"""`<ns>.members` records read as workers' announcements (threadlog/members.py), without a broker."""

from __future__ import annotations

import pytest

from threadlog.kernel.checkpoint_rules import MAX_LEASE_MS
from threadlog.members import parse_member

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
