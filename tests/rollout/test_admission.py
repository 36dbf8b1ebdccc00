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


def test_what_is_admitted_is_reserved_until_its_rollouts_are_counted():
    """Concurrent submissions decide on the queue count plus what was admitted and not yet
    created: the second of two that each fit alone is refused."""
    a = Admission(queue_timeout_s=60, max_queued=10)
    first = a.reserve(queued=0, adding=8, now=0)
    with pytest.raises(Overloaded):
        a.reserve(queued=0, adding=4, now=0)  # the queue count has not seen the first 8 yet
    assert a.reserved == 8
    first.release(3)  # three created: now in the queue count
    a.reserve(queued=3, adding=2, now=0).close()
    with first:
        pass  # a failed or finished submission gives back what is left
    assert a.reserved == 0
    a.reserve(queued=0, adding=10, now=0).close()


def test_a_cold_start_with_known_slots_admits_what_can_start_within_the_queue_limit():
    """8 slots, a 10 s wall clock, a 30 s queue limit: 8 start at once and 24 more within the
    limit (a sandbox held at most the wall clock), the 33rd is refused with a Retry-After."""
    a = Admission(queue_timeout_s=30, max_queued=10_000)
    held = a.reserve(queued=0, adding=4, now=0, slots=8, hold_s=10)
    for _ in range(7):
        a.reserve(queued=0, adding=4, now=0, slots=8, hold_s=10)
    assert a.reserved == 32
    with pytest.raises(Overloaded) as caught:
        a.reserve(queued=0, adding=4, now=0, slots=8, hold_s=10)
    assert caught.value.retry_after >= 1 and "8 sandbox slots" in caught.value.message
    held.close()
    a.reserve(queued=0, adding=4, now=0, slots=8, hold_s=10)  # four places given back


def test_an_empty_queue_takes_a_group_larger_than_the_estimate():
    """Refused on an empty queue, a large group would be refused forever: it is taken whole."""
    a = Admission(queue_timeout_s=30, max_queued=10_000)
    a.reserve(queued=0, adding=64, now=0, slots=8, hold_s=600)
    with pytest.raises(Overloaded):
        a.reserve(queued=0, adding=1, now=0, slots=8, hold_s=600)


def test_measured_sandbox_holds_replace_the_wall_clock_bound():
    a = Admission(queue_timeout_s=30, max_queued=10_000, window_s=60)
    for i in range(8):
        a.released_sandbox(2.0, now=float(i))
    assert a.hold_s(now=10) == pytest.approx(2.0)
    # 8 busy slots held 2 s each drain 4/s: 120 start within 30 s
    a.check(queued=100, adding=20, now=10, slots=8, running=8, hold_s=600)
    with pytest.raises(Overloaded):
        a.check(queued=100, adding=21, now=10, slots=8, running=8, hold_s=600)
    a.check(queued=100, adding=28, now=10, slots=8, running=0, hold_s=600)  # 8 free slots start at once
