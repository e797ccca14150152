"""A slot's state is deleted whole or not at all, whenever the process dies,
and what a death leaves beside or inside a slot is swept when it is next held.

Real RocksDB stores in a temp dir; the death is a child process exiting at once
(`os._exit`, as SIGKILL: no cleanup runs) at the step named.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from threadlog.projections.partition_stores import claim_slot, hold_slot
from threadlog.projections.store import Store


def make_slot(base: Path) -> Path:
    slot = claim_slot(base)
    try:
        (slot.path / "topics.json").write_text('{"events": "old-id"}')
        store = Store(slot.path / "events-0")
        store.apply({b"state": b"of the old life"}, {("ns.events", 0): 3})
        store.close()
        return slot.path
    finally:
        slot.release()


def die_in(code: str) -> None:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 137, proc.stderr


def test_a_slot_dropped_by_a_process_killed_midway_is_gone_not_half_there(tmp_path):
    # Tried (a review): SIGKILL during `rebuild`'s delete. Deleted in place, the
    # slot lost its incarnation marker first and kept old partitions' state, which
    # the next open took as it was: a namespace created again was served the old
    # one's state. Now the slot is renamed away first: killed at the first file
    # deleted, the slot is already gone (its next user folds from offset 0).
    slot = make_slot(tmp_path)
    die_in(f"""
        import os
        def killed(*args, **kwargs):
            os._exit(137)
        os.unlink = killed
        from threadlog.projections.partition_stores import PartitionStores
        PartitionStores({str(slot)!r}, "ns.events").destroy()
    """)
    assert not slot.exists()
    assert [p.name for p in tmp_path.iterdir() if ".dropped-" in p.name]  # what the kill left
    held = hold_slot(slot)
    assert held is not None
    try:
        assert not [p.name for p in tmp_path.iterdir() if ".dropped-" in p.name]  # swept once held
    finally:
        held.release()


def test_a_snapshot_checkpoint_left_by_a_killed_process_is_swept_when_the_slot_is_next_held(tmp_path):
    # Tried (a review): SIGKILL while a snapshot read its RocksDB checkpoint
    # (hard links beside the store) left it for good: nothing but a rebuild
    # deleted it, and it doubled the store's disk once the store compacted.
    slot = make_slot(tmp_path)
    die_in(f"""
        import os
        from threadlog.projections.store import Store
        store = Store({str(slot / "events-0")!r})
        items = store.snapshot_items()
        next(items)  # the checkpoint is taken and being read
        os._exit(137)
    """)
    assert [p.name for p in slot.iterdir() if ".snapshot-" in p.name]
    claimed = claim_slot(tmp_path)
    try:
        assert claimed.path == slot
        assert not [p.name for p in slot.iterdir() if ".snapshot-" in p.name]
        store = Store(slot / "events-0")
        assert store.get(b"state") == b"of the old life"  # the store itself is kept
        store.close()
    finally:
        claimed.release()


def test_a_symlinked_slot_is_emptied_in_place_marker_last_and_its_link_kept(tmp_path):
    # Tried (a review): renamed away, a slot that is a symlink (to a bigger disk)
    # lost its link and kept its contents; one that is a mount point could not be
    # renamed at all (EBUSY) and `rebuild` failed INTERNAL. Such a slot is
    # emptied in place: each entry moved into a hidden folder inside it, the
    # incarnation marker last -- killed midway, the marker is still there with
    # fewer stores, never stores without their marker -- then deleted.
    target = make_slot(tmp_path / "disk")
    extra = Store(target / "events-1")
    extra.apply({b"more": b"state"}, {("ns.events", 1): 2})
    extra.close()
    base = tmp_path / "state"
    base.mkdir()
    link = base / "slot-0"
    link.symlink_to(target, target_is_directory=True)
    die_in(f"""
        import os
        rename, calls = os.rename, []
        def killed_at_the_second(*args, **kwargs):
            calls.append(args)
            if len(calls) == 2:
                os._exit(137)
            return rename(*args, **kwargs)
        os.rename = killed_at_the_second
        from threadlog.projections.partition_stores import PartitionStores
        PartitionStores({str(link)!r}, "ns.events").destroy()
    """)
    assert link.is_symlink()
    left = sorted(p.name for p in target.iterdir() if not p.name.startswith("."))
    assert len(left) == 2 and "topics.json" in left, left  # one store moved out, the marker still there
    (kept,) = [name for name in left if name != "topics.json"]
    store = Store(target / kept)
    assert store.get(b"more" if kept == "events-1" else b"state") is not None  # what is left is whole
    store.close()
    held = hold_slot(link)
    assert held is not None
    try:
        assert not [p.name for p in target.iterdir() if p.name.startswith(".")]  # the hidden folder swept
    finally:
        held.release()
    from threadlog.projections.partition_stores import PartitionStores

    PartitionStores(link, "ns.events").destroy()
    assert link.is_symlink() and list(target.iterdir()) == []
