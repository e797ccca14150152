"""When a tailing consumer counts as stuck (threadlog/kernel/stuck.py), without a broker.

The consumer here only answers the partitions' ends (a stand-in; the real
consumers are replaced on a real broker in tests/test_stuck_consumers.py and
tests/test_members.py). Time is the real monotonic clock, scaled down.
"""

from __future__ import annotations

import time

from confluent_kafka import KafkaError, KafkaException

from threadlog.kernel.stuck import Liveness


class Ends:
    def __init__(self, ends: dict[int, int]) -> None:
        self.ends = ends
        self.asked = 0
        self.down = False

    def get_watermark_offsets(self, tp, timeout):
        self.asked += 1
        if self.down:
            raise KafkaException(KafkaError(KafkaError._TRANSPORT))
        return 0, self.ends[tp.partition]


class Record:
    def __init__(self, partition: int) -> None:
        self._p = partition

    def error(self):
        return None

    def partition(self) -> int:
        return self._p


def _after(s: float) -> None:
    end = time.monotonic() + s
    while time.monotonic() < end:
        time.sleep(0.005)


def test_quiet_partitions_at_their_end_are_not_stuck_and_are_asked_once_per_period():
    live, ends = Liveness(0.05, 0.05), Ends({0: 5, 1: 9})
    assert live.stuck(ends, "t", [0, 1], {0: 5, 1: 9}, 1.0) is None and ends.asked == 0  # not due yet
    _after(0.06)
    assert live.stuck(ends, "t", [0, 1], {0: 5, 1: 9}, 1.0) is None and ends.asked == 2
    assert live.stuck(ends, "t", [0, 1], {0: 5, 1: 9}, 1.0) is None and ends.asked == 2  # not again at once


def test_a_record_read_between_the_two_checks_clears_the_suspicion():
    # A record landing on a quiet partition just before a check: behind once, then read.
    live, ends = Liveness(0.05, 0.05), Ends({0: 6})
    _after(0.06)
    assert live.stuck(ends, "t", [0], {0: 5}, 1.0) is None  # behind: suspected, not yet replaced
    live.saw([Record(0)])
    _after(0.06)
    assert live.stuck(ends, "t", [0], {0: 6}, 1.0) is None


def test_behind_at_two_checks_with_nothing_read_is_stuck():
    live, ends = Liveness(0.05, 0.05), Ends({0: 6, 1: 3})
    live.saw([Record(1)])
    _after(0.06)
    assert live.stuck(ends, "t", [0, 1], {0: 5, 1: 3}, 1.0) is None
    _after(0.06)
    why = live.stuck(ends, "t", [0, 1], {0: 5, 1: 3}, 1.0)
    assert why is not None and "t[0] ends at 6 and this consumer is at 5" in why
    live.restart()  # replaced: silence counts from now
    assert live.stuck(ends, "t", [0, 1], {0: 5, 1: 3}, 1.0) is None


def test_an_end_not_answered_twice_is_stuck_and_a_partition_no_longer_owned_is_forgotten():
    live, ends = Liveness(0.05, 0.05), Ends({0: 1})
    ends.down = True
    _after(0.06)
    assert live.stuck(ends, "t", [0], {0: 1}, 1.0) is None
    _after(0.06)
    assert "not answered" in (live.stuck(ends, "t", [0], {0: 1}, 1.0) or "")
    live2 = Liveness(0.05, 0.05)
    _after(0.06)
    assert live2.stuck(ends, "t", [0], {0: 1}, 1.0) is None  # suspected
    _after(0.06)
    assert live2.stuck(ends, "t", [], {}, 1.0) is None  # partition 0 moved away meanwhile


def test_a_full_batch_is_life_for_every_partition():
    # Tried (a review): a delivery index catching up on a backlog of partition 0 read
    # partition 1's record only after it; checked meanwhile, 1 looked behind, twice,
    # and a healthy consumer was replaced every 13 s. A full batch means more is
    # queued locally: nothing counts as silent while they come.
    live, ends = Liveness(0.05, 0.05), Ends({0: 10_000, 1: 1})
    for _ in range(3):
        _after(0.06)
        live.saw([Record(0)] * 4, full=True)
        assert live.stuck(ends, "t", [0, 1], {0: 500, 1: 0}, 1.0) is None
    assert ends.asked == 0


def test_a_check_stops_at_the_first_partition_behind_or_unanswered():
    # Each question may block the consumer's thread up to its timeout on a cluster
    # that does not answer (a review: 4 partitions x 5 s held a follower 20 s).
    live, ends = Liveness(0.05, 0.05), Ends({0: 1, 1: 1, 2: 1, 3: 1})
    ends.down = True
    _after(0.06)
    assert live.stuck(ends, "t", [0, 1, 2, 3], dict.fromkeys(range(4), 0), 1.0) is None
    assert ends.asked == 1


def test_a_partition_assigned_again_counts_its_silence_from_then():
    # A judge's partition given up and taken back (or restored) is behind its end
    # until its first fetch: silent since its last ownership, it was called stuck
    # at the first check. `fresh` on assignment: not due before `after_s` again.
    live, ends = Liveness(0.05, 0.01), Ends({0: 9})
    _after(0.06)
    live.fresh([0])
    assert live.stuck(ends, "t", [0], {0: 3}, 1.0) is None and ends.asked == 0
    _after(0.06)
    assert live.stuck(ends, "t", [0], {0: 3}, 1.0) is None and ends.asked == 1  # due now: suspected


def test_time_the_thread_did_not_poll_is_not_silence():
    # A worker resumed after SIGSTOP (or a thread busy between two polls) found every
    # partition silent and behind, and replaced a healthy consumer. A poll long
    # after the last one counts as life; the thread's own questions are no pause.
    live, ends = Liveness(0.05, 0.01, pause_s=0.2), Ends({0: 9})
    live.saw([])
    _after(0.25)  # not polled meanwhile
    live.saw([])
    assert live.stuck(ends, "t", [0], {0: 3}, 1.0) is None and ends.asked == 0
    _after(0.06)  # polled, and silent: due
    live.saw([])
    assert live.stuck(ends, "t", [0], {0: 3}, 1.0) is None and ends.asked == 1  # suspected


def test_a_slow_question_is_no_pause_of_polling():
    # An end not answered takes up to ASK_S; the poll after it must still confirm.
    class Slow(Ends):
        def get_watermark_offsets(self, tp, timeout):
            _after(0.25)
            return super().get_watermark_offsets(tp, timeout)

    live, ends = Liveness(0.05, 0.01, pause_s=0.2), Slow({0: 9})
    _after(0.06)
    live.saw([])
    assert live.stuck(ends, "t", [0], {0: 3}, 1.0) is None  # suspected, after a slow question
    live.saw([])
    _after(0.02)
    live.saw([])
    assert live.stuck(ends, "t", [0], {0: 3}, 1.0) is not None
