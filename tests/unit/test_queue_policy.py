"""QueueLimits: expanded limit while (and after) disconnected, 80 % revert, overflow decision."""

from __future__ import annotations

import pytest

from amqtt_durable.config import OverflowPolicy
from amqtt_durable.queue_policy import REVERT_FRACTION, Admission, QueueLimits


def test_revert_fraction_is_80_percent() -> None:
    assert REVERT_FRACTION == 0.8


def test_new_session_starts_with_the_expanded_limit() -> None:
    limits = QueueLimits(10, 100, "drop-oldest")
    assert limits.expanded is True
    assert limits.limit() == 100


def test_connect_with_small_backlog_reverts_at_once() -> None:
    limits = QueueLimits(10, 100, "drop-oldest")
    limits.on_connect(0)
    assert limits.expanded is False
    assert limits.limit() == 10


def test_connect_with_large_backlog_keeps_expanded_limit_until_80_percent() -> None:
    limits = QueueLimits(10, 100, "drop-newest")
    limits.on_connect(95)
    assert limits.limit() == 100
    limits.on_drained(81, connected=True)
    assert limits.limit() == 100, "81 > 80 % of 100: expanded limit must hold"
    limits.on_drained(80, connected=True)
    assert limits.limit() == 10, "80 == 80 % of 100: limit reverts"


def test_revert_boundary_is_inclusive_with_fractional_threshold() -> None:
    limits = QueueLimits(1, 7, "drop-oldest")  # 80 % of 7 = 5.6
    limits.on_connect(6)
    assert limits.expanded is True
    limits.on_drained(5, connected=True)
    assert limits.expanded is False


def test_draining_while_disconnected_never_reverts() -> None:
    limits = QueueLimits(10, 100, "drop-oldest")
    limits.on_drained(0, connected=False)
    assert limits.limit() == 100


def test_disconnect_expands_again() -> None:
    limits = QueueLimits(10, 100, "drop-oldest")
    limits.on_connect(0)
    assert limits.limit() == 10
    limits.on_disconnect()
    assert limits.limit() == 100
    assert limits.admit(50) is Admission.ACCEPT


def test_revert_never_purges_it_only_lowers_the_bar() -> None:
    limits = QueueLimits(10, 100, "drop-newest")
    limits.on_connect(50)  # 50 <= 80: reverts with 50 queued
    assert limits.limit() == 10
    assert limits.admit(50) is Admission.DROP_NEWEST
    assert limits.admit(9) is Admission.ACCEPT


@pytest.mark.parametrize(
    ("overflow", "full"),
    [("drop-oldest", Admission.DROP_OLDEST), ("drop-newest", Admission.DROP_NEWEST)],
)
def test_admit_below_at_and_above_the_limit(overflow: OverflowPolicy, full: Admission) -> None:
    limits = QueueLimits(3, 5, overflow)
    assert limits.admit(0) is Admission.ACCEPT
    assert limits.admit(4) is Admission.ACCEPT
    assert limits.admit(5) is full
    assert limits.admit(6) is full
    limits.on_connect(0)
    assert limits.admit(2) is Admission.ACCEPT
    assert limits.admit(3) is full


def test_equal_limits() -> None:
    limits = QueueLimits(5, 5, "drop-newest")
    limits.on_connect(5)
    assert limits.expanded is True  # 5 > 4.0
    assert limits.admit(5) is Admission.DROP_NEWEST
    limits.on_drained(4, connected=True)
    assert limits.expanded is False
    assert limits.limit() == 5


def test_admission_values_name_the_policies() -> None:
    assert Admission.DROP_OLDEST.value == "drop-oldest"
    assert Admission.DROP_NEWEST.value == "drop-newest"
    assert Admission.ACCEPT.value == "accept"
