"""max_durable_sessions and max_connections_per_address: the counting and policy (admission.py),
and the engine's exact session count over a real store, without a broker."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from test_replay_marker import publish, run

from amqtt_durable.admission import AddressConnections, KeepAliveLimit, SessionLimit
from amqtt_durable.engine import DurableEngine
from amqtt_durable.errors import SessionLimitError


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_session_limit_admits_below_the_limit_only_and_zero_is_no_limit() -> None:
    limit = SessionLimit(3, 10.0)
    assert [limit.admits(held) for held in range(5)] == [True, True, True, False, False]
    unlimited = SessionLimit(0, 10.0)
    assert all(unlimited.admits(held) for held in (0, 1, 10**9))


def test_every_session_refusal_is_counted_and_logged_at_most_once_per_interval_naming_the_limit() -> None:
    clock = Clock()
    limit = SessionLimit(7, 10.0, clock)
    first = limit.refuse("attacker-1")
    assert first is not None and "'attacker-1'" in first and "max_durable_sessions (7)" in first
    assert "CONNACK 3" in first and "more such" not in first
    assert [limit.refuse(f"attacker-{i}") for i in range(2, 5)] == [None, None, None]
    clock.now += 10.0
    later = limit.refuse("attacker-5")
    assert later is not None and "'attacker-5'" in later and "(3 more such refusal(s) since the last line)" in later
    assert limit.refused == 5


def test_address_connections_counts_per_address_refuses_past_the_limit_and_forgets_closed_addresses() -> None:
    clock = Clock()
    table = AddressConnections(2, 10.0, clock)
    assert table.open("10.0.0.1") and table.open("10.0.0.1")
    assert not table.open("10.0.0.1"), "a third from one address"
    assert table.open("10.0.0.2"), "another address has its own count"
    assert table.refused == 1 and table.open_by_address == {"10.0.0.1": 2, "10.0.0.2": 1}
    line = table.refusal("10.0.0.1")
    assert line is not None and "10.0.0.1" in line and "max_connections_per_address (2)" in line
    assert not table.open("10.0.0.1")
    assert table.refusal("10.0.0.1") is None, "rate-limited"
    table.close("10.0.0.1")
    assert table.open("10.0.0.1"), "a closed connection frees its place"
    for _ in range(2):
        table.close("10.0.0.1")
    table.close("10.0.0.2")
    assert table.open_by_address == {}, "an address without open connections is forgotten"
    assert table.refused == 2
    clock.now += 10.0
    line = table.refusal("10.0.0.3")
    assert line is not None and "(1 more such refusal(s) since the last line)" in line


def test_no_limit_on_connections_per_address_by_default() -> None:
    table = AddressConnections(0, 10.0)
    assert all(table.open("10.0.0.1") for _ in range(10_000))
    assert table.refused == 0


def test_the_engine_creates_no_durable_session_past_the_limit_but_takes_back_existing_and_clean_ones(
    tmp_path: Path,
) -> None:
    async def body(engine: DurableEngine) -> None:
        for client_id in ("a", "b"):
            assert await engine.connect(client_id, clean_session=False) is False
        await engine.subscribe("a", "t", 1)
        await publish(engine, "t", b"kept")
        with pytest.raises(SessionLimitError, match=r"'c' refused: the store holds max_durable_sessions \(2\)"):
            await engine.connect("c", clean_session=False)
        assert set(engine.sessions) == {"a", "b"}, "nothing of the refused CONNECT is kept"
        assert await engine.connect("a", clean_session=False) is True, "an existing session reconnects"
        assert engine.sessions["a"].depth == 1
        assert await engine.connect("c", clean_session=True) is False, "a clean session is not counted"
        await engine.connect("b", clean_session=True)  # ends b's durable session: a slot is free
        assert await engine.connect("c", clean_session=False) is False
        assert set(engine.sessions) == {"a", "c"}

    run(tmp_path, body, max_durable_sessions=2)


def test_connects_handled_at_once_create_exactly_as_many_sessions_as_there_are_free_slots(tmp_path: Path) -> None:
    async def body(engine: DurableEngine) -> None:
        await engine.connect("held", clean_session=False)
        results = await asyncio.gather(
            *(engine.connect(f"new-{i}", clean_session=False) for i in range(20)), return_exceptions=True
        )
        refused = [r for r in results if isinstance(r, SessionLimitError)]
        assert len(refused) == 15 and results.count(False) == 5, results
        assert len(engine.sessions) == 6

    run(tmp_path, body, max_durable_sessions=6)


def test_the_count_after_a_reopen_is_the_stores_and_ended_sessions_free_their_slot(tmp_path: Path) -> None:
    async def fill(engine: DurableEngine) -> None:
        for client_id in ("a", "b", "c"):
            await engine.connect(client_id, clean_session=False)

    run(tmp_path, fill, max_durable_sessions=3)

    async def reopened(engine: DurableEngine) -> None:
        assert len(engine.sessions) == 3
        with pytest.raises(SessionLimitError):
            await engine.connect("d", clean_session=False)
        assert engine.session_limit.refused == 0, "the engine raises; the glue counts the refusal it sends"
        await engine.delete_session(engine.sessions["a"])  # end_session, or expiry
        assert await engine.connect("d", clean_session=False) is False
        with pytest.raises(SessionLimitError):
            await engine.connect("e", clean_session=False)

    run(tmp_path, reopened, max_durable_sessions=3)

    async def lowered(engine: DurableEngine) -> None:
        assert set(engine.sessions) == {"b", "c", "d"}, "a lower limit deletes nothing"
        assert await engine.connect("b", clean_session=False) is True
        with pytest.raises(SessionLimitError):
            await engine.connect("e", clean_session=False)

    run(tmp_path, lowered, max_durable_sessions=1)


def test_keepalive_limit_refuses_zero_and_above_the_maximum_and_zero_is_no_limit() -> None:
    clock = Clock()
    limit = KeepAliveLimit(60, 10.0, clock)
    assert [limit.admits(k) for k in (0, 1, 60, 61, 65535)] == [False, True, True, False, False]
    unlimited = KeepAliveLimit(0, 10.0, clock)
    assert all(unlimited.admits(k) for k in (0, 1, 65535))
    line = limit.refusal("dev", 0)
    assert line is not None and "'dev'" in line and "keep-alive is 0 s" in line and "max_keepalive (60)" in line
    assert "CONNACK 2" in line
    assert limit.refusal("dev", 61) is None, "rate-limited"
    clock.now += 10.0
    line = limit.refusal("dev", 61)
    assert line is not None and "(1 more such refusal(s) since the last line)" in line
