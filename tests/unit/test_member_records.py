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
def test_a_lease_setting_no_worker_could_start_with_refuses_the_record(lease):
    # open() and `threadlog worker` refuse these settings, so such a record was
    # not written by a worker: refused whole, like any other malformed field.
    with pytest.raises(ValueError, match="lease setting"):
        parse_member("w", {**BASE, **lease})
