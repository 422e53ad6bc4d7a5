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


def test_session_limit_has_a_place_below_the_limit_or_for_an_existing_session_and_zero_is_no_limit() -> None:
    limit = SessionLimit(3, 10.0)
    assert [limit.has_place("new", {f"s{i}" for i in range(held)}) for held in range(5)] == [True] * 3 + [False] * 2
    assert limit.has_place("s0", {"s0", "s1", "s2"}), "an existing session takes no new place"
    unlimited = SessionLimit(0, 10.0)
    assert unlimited.has_place("new", {f"s{i}" for i in range(1000)})
    assert unlimited.reserve("new", {f"s{i}" for i in range(1000)}) is not None


def test_a_reservation_holds_a_place_until_it_is_used_or_released_once() -> None:
    limit = SessionLimit(2, 10.0)
    held = limit.reserve("b", {"a"})
    assert held is not None and limit.reserve("c", {"a"}) is None, "b's CONNECT holds the last place"
    assert limit.use(held) is True and limit.reservations == 0
    assert limit.use(held) is False, "used once"
    assert limit.reserve("c", {"a", "b"}) is None, "b's place is now its session"
    other = limit.reserve("c", {"a"})  # b's session gone
    assert other is not None
    limit.release(other)
    limit.release(other)  # its connection's end after a refusal: nothing more
    assert limit.reservations == 0 and limit.reserve("c", {"a"}) is not None


def test_two_connects_of_one_client_id_hold_one_place() -> None:
    limit = SessionLimit(3, 10.0)
    first, second = limit.reserve("b", {"a"}), limit.reserve("b", {"a"})
    assert first is not None and second is not None
    assert limit.reserve("c", {"a"}) is not None, "a, b and c: three places"
    assert limit.reserve("d", {"a"}) is None
    limit.release(first)
    assert limit.reserve("d", {"a"}) is None, "the other CONNECT of b still holds b's place"
    limit.release(second)
    assert limit.reserve("d", {"a"}) is not None


def test_a_reserved_client_id_is_counted_once_whether_its_session_exists_or_not() -> None:
    limit = SessionLimit(2, 10.0)
    held = limit.reserve("a", {"a", "b"})
    assert held is not None, "a CONNECT of an existing session always gets its reservation"
    assert limit.reserve("c", {"a", "b"}) is None
    assert limit.reserve("c", {"b"}) is None, "a's session ended before its CONNACK: its CONNECT keeps the place"
    limit.use(held)
    assert limit.reserve("c", {"b"}) is not None
    late = limit.reserve("d", {"b"})
    assert late is None, "b's session and c's reservation (2 of 2)"
    again = limit.reserve("c", {"b", "c"})
    assert again is not None and limit.reserve("d", {"b", "c"}) is None, "c: its session and a reservation, one place"


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


def test_a_connect_with_its_reservation_gets_the_place_held_for_it(tmp_path: Path) -> None:
    async def body(engine: DurableEngine) -> None:
        await engine.connect("a", clean_session=False)
        await engine.connect("b", clean_session=False)
        held = engine.reserve_session("a")
        assert held is not None
        await engine.delete_session(engine.sessions["a"])  # expiry or end_session before a's CONNACK
        assert engine.reserve_session("c") is None, "a's CONNECT keeps a's place"
        with pytest.raises(SessionLimitError):
            await engine.connect("c", clean_session=False)
        assert await engine.connect("a", clean_session=False, reservation=held) is False
        assert set(engine.sessions) == {"a", "b"} and engine.session_limit.reservations == 0
        await engine.delete_session(engine.sessions["b"])
        newcomer = engine.reserve_session("c")
        assert newcomer is not None and engine.reserve_session("d") is None
        refused = await asyncio.gather(engine.connect("d", clean_session=False), return_exceptions=True)
        assert isinstance(refused[0], SessionLimitError), "without a reservation: the place is c's"
        assert await engine.connect("c", clean_session=False, reservation=newcomer) is False
        assert set(engine.sessions) == {"a", "c"}

    run(tmp_path, body, max_durable_sessions=2)


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
