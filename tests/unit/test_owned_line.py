"""A worker's ownership line on stdout is printed when what it owns changes."""

from __future__ import annotations

from threadlog.cli import OwnedLine


def test_the_same_partitions_again_print_no_new_line(capsys):
    """Tried (a review): a rebalance that gave a worker back the partitions it
    had printed `worker owns partitions [...]` again, read as a move."""
    say = OwnedLine()
    for owned in ([0, 1], [0, 1], [], [], [2], [0, 1], [0, 1]):
        say(owned)
    assert capsys.readouterr().out.splitlines() == [
        "worker owns partitions [0, 1]", "worker owns partitions []", "worker owns partitions [2]",
        "worker owns partitions [0, 1]"]
