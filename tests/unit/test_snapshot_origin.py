"""Which snapshot manifests a worker may restore (`projections/snapshots.py` `_from_origin`), no broker."""

from __future__ import annotations

from threadlog.projections import snapshots


def test_a_manifest_naming_partition_true_is_not_partition_ones():
    # Tried (a review): JSON's `true` equals 1 in Python, so a manifest naming
    # partition `true` passed the check for partition 1. Refused before anything
    # is asked of the broker (no consumer here).
    usable = snapshots._from_origin(None, snapshots.Origin("ns.events", "id"), 1, 5.0)  # type: ignore[arg-type]
    manifest = {"snapshotId": "s", "topic": "ns.events", "topicId": "id", "position": 3}
    assert usable({**manifest, "partition": True}) is False
    assert usable({**manifest, "partition": 1.0}) is False
    assert usable({**manifest, "partition": 0}) is False
