"""WriteStall, the primary's clock for replication.catch_up_timeout: only a wait to write with no
byte taken by the connection counts; any progress, and the end of the wait, start it again."""

from __future__ import annotations

from amqtt_durable.replication.primary import WriteStall


def test_a_wait_without_progress_counts_from_its_start() -> None:
    stall = WriteStall()
    stall.blocked(100.0, mark=5000)
    assert stall.stalled(100.5, 5000) == 0.5
    assert stall.stalled(161.0, 5000) == 61.0


def test_progress_during_a_long_wait_restarts_the_clock() -> None:
    """A slow link: one wait lasts 10 s, but the connection takes bytes every second."""
    stall = WriteStall()
    stall.blocked(0.0, mark=0)
    for second in range(1, 11):
        assert stall.stalled(float(second), second * 1000) == 0.0
    assert stall.stalled(10.5, 10_000) == 0.5  # no byte since the last look


def test_a_mark_going_down_is_progress_too() -> None:
    """Without TCP_INFO the mark is the write buffer's size negated: it rises as the buffer empties;
    with it, a new connection's count starts low. Any change is progress."""
    stall = WriteStall()
    stall.blocked(0.0, mark=-1_048_576)
    assert stall.stalled(3.0, -700_000) == 0.0
    assert stall.stalled(4.0, -700_001) == 0.0


def test_not_waiting_is_never_stalled_and_each_wait_starts_afresh() -> None:
    stall = WriteStall()
    assert stall.stalled(1000.0, 0) == 0.0
    stall.blocked(0.0, mark=7)
    stall.unblocked()
    assert stall.stalled(1000.0, 7) == 0.0
    stall.blocked(1000.0, mark=7)
    assert stall.stalled(1001.0, 7) == 1.0
