"""durable_client.backoff: bounds, growth, reset."""

from __future__ import annotations

import random

import pytest

from durable_client.backoff import Backoff


def test_delays_stay_within_floor_and_growing_ceiling() -> None:
    backoff = Backoff(0.1, 30.0, random.Random(1))
    for attempt in range(200):
        ceiling = min(30.0, 0.1 * 2**attempt)
        assert backoff.ceiling() == pytest.approx(ceiling)
        delay = backoff.next_delay()
        assert 0.1 <= delay <= ceiling


def test_ceiling_reaches_the_cap_and_stays() -> None:
    backoff = Backoff(1.0, 8.0, random.Random(2))
    ceilings = []
    for _ in range(6):
        ceilings.append(backoff.ceiling())
        backoff.next_delay()
    assert ceilings == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]


def test_jitter_spreads_delays() -> None:
    backoff = Backoff(1.0, 100.0, random.Random(3))
    for _ in range(5):
        backoff.next_delay()
    delays = set()
    for _ in range(50):
        clone = Backoff(1.0, 100.0, random.Random(len(delays) + 10))
        for _ in range(5):
            clone.next_delay()
        delays.add(round(clone.next_delay(), 6))
    assert len(delays) > 40  # full jitter: not a fixed schedule


def test_reset_after_success_starts_small_again() -> None:
    backoff = Backoff(0.5, 60.0, random.Random(4))
    for _ in range(10):
        backoff.next_delay()
    assert backoff.attempt == 10 and backoff.ceiling() == 60.0
    backoff.reset()
    assert backoff.attempt == 0
    assert backoff.ceiling() == 0.5
    assert backoff.next_delay() == 0.5


def test_long_outage_does_not_overflow() -> None:
    backoff = Backoff(0.1, 30.0, random.Random(5))
    for _ in range(10_000):
        assert backoff.next_delay() <= 30.0


def test_equal_bounds_give_a_fixed_delay() -> None:
    backoff = Backoff(2.0, 2.0)
    assert {backoff.next_delay() for _ in range(5)} == {2.0}


@pytest.mark.parametrize(("low", "high"), [(2.0, 1.0)])
def test_bad_bounds_are_refused(low: float, high: float) -> None:
    """A minimum of 0 or less is refused by DurableClient, Backoff's one caller (test_sdk_client.py)."""
    with pytest.raises(ValueError, match="reconnect_"):
        Backoff(low, high)
