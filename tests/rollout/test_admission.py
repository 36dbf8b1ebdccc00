"""Admission control: work the queue could not start within its limit is refused up front."""

from __future__ import annotations

import pytest

from arena_core.errors import Overloaded
from arena_rollout.admission import Admission


def test_a_cold_start_admits_up_to_the_queue_cap():
    a = Admission(queue_timeout_s=60, max_queued=100)
    a.check(queued=0, adding=100, now=0)
    with pytest.raises(Overloaded) as caught:
        a.check(queued=90, adding=20, now=0)
    assert caught.value.status == 429 and caught.value.retry_after >= 1


def test_a_group_larger_than_the_queue_is_refused_with_advice():
    with pytest.raises(Overloaded, match="smaller groups"):
        Admission(queue_timeout_s=60, max_queued=10).check(queued=0, adding=11, now=0)


def test_the_drain_rate_bounds_how_much_may_wait():
    a = Admission(queue_timeout_s=30, max_queued=10_000, window_s=60)
    for i in range(20):  # 2 per second leave the queue
        a.left_queue(now=i * 0.5)
    assert a.drain_rate(now=10) == pytest.approx(2.0)
    a.check(queued=50, adding=10, now=10)  # 30 s of work: starts in time
    with pytest.raises(Overloaded) as caught:
        a.check(queued=60, adding=10, now=10)  # 35 s: would expire in the queue
    assert caught.value.retry_after == 5


def test_old_samples_leave_the_window():
    a = Admission(queue_timeout_s=30, max_queued=1000, window_s=60)
    for i in range(10):
        a.left_queue(now=i)
    assert a.drain_rate(now=200) is None
    a.check(queued=500, adding=1, now=200)  # no estimate: the cap alone
