"""Hold-until-ready, replay flags and the marker in the pump, over a real store, without a broker."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from amqtt_durable.config import DurableConfig
from amqtt_durable.engine import DurableEngine
from durable_client.protocol import MARKER_TOPIC, decode_frame, decode_marker
from recording_transport import RecordingTransport, Sent


def run(tmp_path: Path, body: Callable[[DurableEngine], Awaitable[None]], **settings: Any) -> None:
    async def main() -> None:
        engine = DurableEngine(DurableConfig(store=str(tmp_path / "store"), **settings))
        engine.open()
        try:
            await body(engine)
        finally:
            await engine.close()

    asyncio.run(main())


async def publish(engine: DurableEngine, topic: str, *payloads: bytes) -> None:
    for payload in payloads:
        stored = engine.route_publish(topic, payload, 1)
        assert stored is not None
        await stored


async def sdk_session(engine: DurableEngine, client_id: str, *filters: str) -> None:
    await engine.connect(client_id, clean_session=False)
    engine.hello(client_id, None)
    for topic_filter in filters:
        await engine.subscribe(client_id, topic_filter, 1)


def publishes(packets: list[Sent]) -> list[Sent]:
    return [p for p in packets if p.packet_type == 3]


def has_marker(packets: list[Sent]) -> bool:
    return any(p.topic == MARKER_TOPIC for p in packets)


async def settle(engine: DurableEngine) -> None:
    """Let the pump run every step it can: commits land, wake-ups are served."""
    await engine.committer.commit(urgent=True)
    for _ in range(20):
        await asyncio.sleep(0)


def test_nothing_goes_out_before_ready_then_replay_marker_live(tmp_path: Path) -> None:
    async def body(engine: DurableEngine) -> None:
        await sdk_session(engine, "d", "t")
        await publish(engine, "t", b"a", b"b")
        transport = RecordingTransport()
        await engine.attach("d", transport)
        await publish(engine, "t", b"c")
        await settle(engine)
        assert transport.packets == [], "an SDK session is held until ready"

        assert engine.ready("d", transport) is True
        assert engine.ready("d", transport) is False, "one marker per connection"
        packets = await transport.wait_for(has_marker)
        await publish(engine, "t", b"live")
        packets = await transport.wait_for(lambda ps: len(publishes(ps)) == 5)
        topics = [p.topic for p in packets]
        assert topics == ["t", "t", "t", MARKER_TOPIC, "t"]
        frames = [decode_frame(p.payload) for p in packets if p.topic == "t"]
        assert [payload for _, payload in frames] == [b"a", b"b", b"c", b"live"]
        assert [f.replayed for f, _ in frames] == [True, True, True, False]
        assert [f.seq for f, _ in frames] == [1, 2, 3, 4]
        assert {f.epoch for f, _ in frames} == {engine.sessions["d"].sid}
        marker = decode_marker(packets[3].payload)
        assert (marker.replayed, marker.first_seq, marker.last_seq) == (3, 1, 3)
        assert [s.filter for s in marker.live] == ["t"]

    run(tmp_path, body)


def test_the_marker_waits_for_a_full_window_to_make_room(tmp_path: Path) -> None:
    async def body(engine: DurableEngine) -> None:
        await sdk_session(engine, "d", "t")
        await publish(engine, "t", *[bytes([i]) for i in range(5)])
        transport = RecordingTransport()
        await engine.attach("d", transport)
        engine.ready("d", transport)
        packets = await transport.wait_for(lambda ps: len(publishes(ps)) == 2)
        await settle(engine)
        assert not has_marker(transport.packets), "three replayed messages are still to go"
        for sent in packets:
            assert sent.packet_id is not None
            transport.ack("puback", sent.packet_id)
        packets = await transport.wait_for(lambda ps: len(publishes(ps)) == 4)
        for sent in packets[2:]:
            assert sent.packet_id is not None
            transport.ack("puback", sent.packet_id)
        packets = await transport.wait_for(has_marker)
        assert [p.topic for p in packets] == ["t"] * 5 + [MARKER_TOPIC]
        assert decode_marker(packets[-1].payload).replayed == 5

    run(tmp_path, body, recovery_buffer=2)


def test_the_recovery_buffer_is_resent_first_flagged_redelivered_and_replayed(tmp_path: Path) -> None:
    async def body(engine: DurableEngine) -> None:
        await sdk_session(engine, "d", "t")
        first = RecordingTransport()
        await engine.attach("d", first)
        engine.ready("d", first)
        await publish(engine, "t", b"x", b"y")
        await first.wait_for(lambda ps: [p.topic for p in ps] == [MARKER_TOPIC, "t", "t"])
        await engine.detach("d", first)  # no PUBACK came back
        second = RecordingTransport()
        await engine.connect("d", clean_session=False)
        await engine.attach("d", second)
        engine.ready("d", second)
        packets = await second.wait_for(has_marker)
        resent = [p for p in packets if p.topic == "t"]
        assert [p.dup for p in resent] == [True, True]
        frames = [decode_frame(p.payload)[0] for p in resent]
        assert [(f.seq, f.redelivered, f.replayed) for f in frames] == [(1, True, True), (2, True, True)]

    run(tmp_path, body)


def test_hello_on_a_live_plain_connection_holds_what_comes_next(tmp_path: Path) -> None:
    async def body(engine: DurableEngine) -> None:
        await engine.connect("d", clean_session=False)
        await engine.subscribe("d", "t", 0)
        transport = RecordingTransport()
        await engine.attach("d", transport)
        await publish(engine, "t", b"plain")
        packets = await transport.wait_for(lambda ps: len(ps) == 1)
        assert packets[0].payload == b"plain", "a plain session gets the publisher's bytes"
        engine.hello("d", 60.0)
        await publish(engine, "t", b"held")
        await settle(engine)
        assert len(transport.packets) == 1
        engine.ready("d", transport)
        packets = await transport.wait_for(has_marker)
        assert decode_frame(packets[1].payload)[1] == b"held"
        assert engine.sessions["d"].expiry_seconds() == 60.0

    run(tmp_path, body)


def test_non_durable_subscriptions_end_with_the_connection(tmp_path: Path) -> None:
    async def body(engine: DurableEngine) -> None:
        await sdk_session(engine, "d", "keep")
        transport = RecordingTransport()
        engine.set_interest("d", "gone", False, transport)
        await engine.subscribe("d", "gone", 1)
        await engine.subscribe("d", "back", 1)
        engine.set_interest("d", "back", False, transport)
        engine.set_interest("d", "back", True, transport)
        await engine.attach("d", transport)
        session = engine.sessions["d"]
        assert {(s.filter, s.durable) for s in session.live_subscriptions()} == {
            ("keep", True),
            ("gone", False),
            ("back", True),
        }
        await engine.detach("d", transport)
        assert set(session.record.subscriptions) == {"keep", "back"}
        assert engine.index.route("gone") == {}
        assert session.record.non_durable == set()

    run(tmp_path, body)


async def older_then_newer(
    engine: DurableEngine, non_durable: str, *, closed_first: bool
) -> tuple[RecordingTransport, RecordingTransport, Any]:
    """Session "d": an older connection attached that made ``non_durable`` non-durable (closed
    or not, ``closed_first``), then a newer connection's CONNECT: (older, newer, session)."""
    older, newer = RecordingTransport(), RecordingTransport()
    assert await engine.connect("d", clean_session=False, transport=older) is True
    await engine.attach("d", older)
    engine.set_interest("d", non_durable, False, older)
    older.closed = closed_first
    assert await engine.connect("d", clean_session=False, transport=newer) is True
    return older, newer, engine.sessions["d"]


@pytest.mark.parametrize("closed_first", [True, False], ids=["closed-before-the-connect", "open-at-the-connect"])
def test_a_non_durable_subscription_ends_with_its_connection_when_a_newer_one_attaches_first(
    tmp_path: Path, closed_first: bool
) -> None:
    """The newer connection's CONNECT and attach come before the older connection's detach (its end
    handled late). Its non-durable subscription ends at the newer CONNECT when it is closed by then
    (it never reaches the newer connection), else at its detach; the newer connection's own stays
    until that one ends. Before, neither the attach nor the older connection's detach (the session
    no longer its) dropped it, and a detach of the session's connection dropped every connection's."""

    async def body(engine: DurableEngine) -> None:
        await sdk_session(engine, "d", "keep", "older")
        older, newer, session = await older_then_newer(engine, "older", closed_first=closed_first)
        assert ("older" in session.record.subscriptions) is not closed_first
        await engine.attach("d", newer)
        await engine.subscribe("d", "newer", 1)
        engine.set_interest("d", "newer", False, newer)
        older.closed = True
        await engine.detach("d", older)
        assert set(session.record.subscriptions) == {"keep", "newer"}
        assert session.record.non_durable == {"newer"}
        assert engine.index.route("older") == {}
        await engine.detach("d", newer)
        assert set(session.record.subscriptions) == {"keep"}
        assert session.record.non_durable == set()

    run(tmp_path, body)


@pytest.mark.parametrize("newer_says", [False, True], ids=["non-durable-again", "durable-again"])
def test_a_filter_the_newer_connection_marks_again_outlives_the_older_connections_late_end(
    tmp_path: Path, newer_says: bool
) -> None:
    """A filter the older connection made non-durable, which the newer connection (its CONNECT and
    attach before the older one's detach, the older one open at that CONNECT) marks again, as the
    SDK does on connecting: ``durable: false`` again (its subscription replayed) or ``durable:
    true`` (made durable while disconnected, sent before its hello). It is the newer connection's
    from then on: the older connection's end keeps it; the newer one's end drops it only if it said
    non-durable."""

    async def body(engine: DurableEngine) -> None:
        await sdk_session(engine, "d", "f")
        older, newer, session = await older_then_newer(engine, "f", closed_first=False)
        await engine.attach("d", newer)
        engine.set_interest("d", "f", newer_says, newer)
        older.closed = True
        await engine.detach("d", older)
        assert set(session.record.subscriptions) == {"f"}, "ended with the older connection"
        assert session.record.non_durable == (set() if newer_says else {"f"})
        newer.closed = True
        await engine.detach("d", newer)
        assert set(session.record.subscriptions) == ({"f"} if newer_says else set())

    run(tmp_path, body)


def test_hello_caps_the_expiry_the_client_asks_for(tmp_path: Path) -> None:
    async def body(engine: DurableEngine) -> None:
        await engine.connect("d", clean_session=False)
        assert engine.hello("d", 10_000.0)[1] == 100.0
        assert engine.sessions["d"].expiry_seconds() == 100.0
        assert engine.hello("d", None)[1] is None
        assert engine.sessions["d"].expiry_seconds() == 300.0

    run(tmp_path, body, max_session_expiry=100.0, session_expiry=300.0)


def test_a_ready_that_comes_before_the_pump_is_applied_when_it_starts(tmp_path: Path) -> None:
    async def body(engine: DurableEngine) -> None:
        await sdk_session(engine, "d", "t")
        await publish(engine, "t", b"queued")
        transport = RecordingTransport()
        # amqtt reads the connection's packets while attach still awaits its commits
        assert engine.ready("d", transport) is True
        assert engine.ready("d", transport) is False
        await engine.attach("d", transport)
        packets = await transport.wait_for(has_marker)
        assert [p.topic for p in packets] == ["t", MARKER_TOPIC]
        assert decode_frame(packets[0].payload)[0].replayed

    run(tmp_path, body)


def test_an_unsubscribed_filter_subscribed_again_is_durable(tmp_path: Path) -> None:
    async def body(engine: DurableEngine) -> None:
        await sdk_session(engine, "d")
        transport = RecordingTransport()
        engine.set_interest("d", "f", False, transport)
        await engine.subscribe("d", "f", 1)
        await engine.unsubscribe("d", "f")
        await engine.subscribe("d", "f", 1)
        await engine.attach("d", transport)
        await engine.detach("d", transport)
        assert "f" in engine.sessions["d"].record.subscriptions

    run(tmp_path, body)


def test_a_session_id_is_never_reused_even_after_its_session_and_keys_are_gone(tmp_path: Path) -> None:
    """The id is an SDK client's epoch: reusing it would make the client drop new events as seen."""
    sids = []

    async def create_and_delete(engine: DurableEngine) -> None:
        await engine.connect("d", clean_session=False)
        sids.append(engine.sessions["d"].sid)
        await engine.delete_session(engine.sessions["d"])

    run(tmp_path, create_and_delete)
    run(tmp_path, create_and_delete)
    assert sids[1] > sids[0]
