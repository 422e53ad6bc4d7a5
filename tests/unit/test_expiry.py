"""ExpiryTracker: a lazy-deletion heap of session deadlines."""

from __future__ import annotations

from amqtt_durable.expiry import ExpiryTracker


def test_empty_tracker() -> None:
    tracker = ExpiryTracker()
    assert tracker.next_deadline() is None
    assert tracker.pop_expired(1e12) == []
    assert tracker.deadline("x") is None


def test_pop_expired_earliest_first_and_inclusive() -> None:
    tracker = ExpiryTracker()
    tracker.schedule("c", 30.0)
    tracker.schedule("a", 10.0)
    tracker.schedule("b", 20.0)
    assert tracker.next_deadline() == 10.0
    assert tracker.pop_expired(9.999) == []
    assert tracker.pop_expired(20.0) == ["a", "b"]  # deadline == now expires
    assert tracker.deadline("a") is None
    assert tracker.deadline("c") == 30.0
    assert tracker.next_deadline() == 30.0
    assert tracker.pop_expired(100.0) == ["c"]
    assert tracker.next_deadline() is None


def test_cancel_removes_a_deadline() -> None:
    tracker = ExpiryTracker()
    tracker.schedule("a", 10.0)
    tracker.schedule("b", 20.0)
    tracker.cancel("a")
    assert tracker.deadline("a") is None
    assert tracker.next_deadline() == 20.0
    assert tracker.pop_expired(50.0) == ["b"]


def test_cancel_unknown_is_harmless() -> None:
    tracker = ExpiryTracker()
    tracker.cancel("nobody")
    tracker.schedule("a", 1.0)
    tracker.cancel("nobody")
    assert tracker.pop_expired(1.0) == ["a"]


def test_reschedule_later_replaces_earlier_deadline() -> None:
    tracker = ExpiryTracker()
    tracker.schedule("a", 10.0)
    tracker.schedule("a", 50.0)
    assert tracker.deadline("a") == 50.0
    assert tracker.next_deadline() == 50.0
    assert tracker.pop_expired(20.0) == []
    assert tracker.pop_expired(50.0) == ["a"]
    assert tracker.pop_expired(100.0) == []


def test_reschedule_earlier_replaces_later_deadline() -> None:
    tracker = ExpiryTracker()
    tracker.schedule("a", 50.0)
    tracker.schedule("a", 10.0)
    assert tracker.pop_expired(10.0) == ["a"]
    assert tracker.next_deadline() is None
    assert tracker.pop_expired(100.0) == [], "the stale 50.0 entry must not expire 'a' twice"


def test_cancel_then_schedule_again_same_deadline() -> None:
    tracker = ExpiryTracker()
    tracker.schedule("a", 10.0)
    tracker.cancel("a")
    tracker.schedule("a", 10.0)
    assert tracker.pop_expired(10.0) == ["a"]
    assert tracker.pop_expired(10.0) == []


def test_reconnect_cancel_then_new_disconnect_deadline() -> None:
    tracker = ExpiryTracker()
    tracker.schedule("a", 10.0)
    tracker.cancel("a")  # reconnected
    tracker.schedule("a", 40.0)  # disconnected again
    tracker.schedule("b", 20.0)
    assert tracker.next_deadline() == 20.0
    assert tracker.pop_expired(30.0) == ["b"]
    assert tracker.pop_expired(40.0) == ["a"]


def test_many_sessions_expire_in_deadline_order() -> None:
    tracker = ExpiryTracker()
    deadlines = {f"c{i}": float((i * 7919) % 1000) for i in range(1000)}
    for client_id, deadline in deadlines.items():
        tracker.schedule(client_id, deadline)
    for i in range(0, 1000, 3):
        tracker.cancel(f"c{i}")
    expired = tracker.pop_expired(499.0)
    expected = sorted((d, c) for c, d in deadlines.items() if d <= 499.0 and int(c[1:]) % 3 != 0)
    assert expired == [c for _, c in expected]
    rest = tracker.pop_expired(1e9)
    assert set(expired) | set(rest) == {c for c in deadlines if int(c[1:]) % 3 != 0}
    assert not set(expired) & set(rest)


def test_cancelled_deadlines_do_not_pile_up_in_the_heap() -> None:
    tracker = ExpiryTracker()
    tracker.schedule("stays", 5.0)
    for i in range(10_000):
        tracker.schedule(f"c{i}", 100.0 + i)
        tracker.cancel(f"c{i}")
    assert len(tracker._heap) <= 2 * 1 + 64 + 1
    assert tracker.pop_expired(10_000_000.0) == ["stays"]
