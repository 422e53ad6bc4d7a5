"""Session owners, read access in the pump and expiry after reconnects, over a real store, without a broker."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from test_replay_marker import publish, publishes, run

from amqtt_durable.control import ControlChannel
from amqtt_durable.delivery import ReadAccess
from amqtt_durable.engine import DurableEngine
from amqtt_durable.errors import NotSessionOwnerError
from durable_client.protocol import CONTROL_TOPIC, REPLY_TOPIC, encode_request
from recording_transport import RecordingTransport


def test_owner_only_refuses_any_other_user_and_keeps_the_session(tmp_path: Path) -> None:
    async def body(engine: DurableEngine) -> None:
        assert await engine.connect("dev", clean_session=False, username="alice") is False
        await engine.subscribe("dev", "secret/#", 1)
        await publish(engine, "secret/plans", b"s1")
        for username, clean in (("bob", False), ("bob", True), (None, False)):
            with pytest.raises(NotSessionOwnerError, match=r"'dev' by user .* belongs to user 'alice'"):
                await engine.connect("dev", clean_session=clean, username=username)
        session = engine.sessions["dev"]
        assert session.depth == 1 and session.record.subscriptions == {"secret/#": 1}
        assert session.record.username == "alice"
        assert await engine.connect("dev", clean_session=False, username="alice") is True

    run(tmp_path, body)


def test_any_user_takes_the_session_without_the_subscriptions_it_may_not_make(tmp_path: Path) -> None:
    async def body(engine: DurableEngine) -> None:
        await engine.connect("dev", clean_session=False, username="alice")
        await engine.subscribe("dev", "secret/#", 1)
        await engine.subscribe("dev", "shared/#", 1)
        assert await engine.connect("dev", clean_session=False, username="bob", revoke=["secret/#"]) is True
        record = engine.sessions["dev"].record
        assert record.username == "bob" and record.subscriptions == {"shared/#": 1}
        assert engine.index.route("secret/plans") == {}
        assert engine.index.route("shared/news") == {"dev": 1}

    run(tmp_path, body, session_takeover="any-user")

    async def reopened(engine: DurableEngine) -> None:
        record = engine.sessions["dev"].record
        assert record.username == "bob" and record.subscriptions == {"shared/#": 1}, "the new owner is stored"

    run(tmp_path, reopened)


def test_the_pump_drops_and_counts_what_the_user_may_not_read_asking_once_per_topic(tmp_path: Path) -> None:
    asked: list[str] = []

    async def decide(topic: str) -> bool:
        asked.append(topic)
        return not topic.startswith("secret/")

    async def body(engine: DurableEngine) -> None:
        await engine.connect("dev", clean_session=False, username="bob")
        await engine.subscribe("dev", "#", 1)
        for topic, payload in (("a/1", b"x"), ("secret/1", b"s"), ("a/2", b"y"), ("secret/1", b"t"), ("a/1", b"z")):
            await publish(engine, topic, payload)
        transport = RecordingTransport()
        await engine.attach("dev", transport, ReadAccess(decide))
        sent = publishes(await transport.wait_for(lambda ps: len(publishes(ps)) >= 3))
        assert [(p.topic, p.payload) for p in sent] == [("a/1", b"x"), ("a/2", b"y"), ("a/1", b"z")]
        for packet in sent:
            assert packet.packet_id is not None
            transport.ack("puback", packet.packet_id)
        session = engine.sessions["dev"]
        assert session.dropped == 2 and engine.dropped_total == 2
        assert session.depth == 0, "dropped and acknowledged entries all leave the queue"
        assert asked == ["a/1", "secret/1", "a/2"], "each topic is decided once per connection"

    run(tmp_path, body)


def test_control_requests_of_another_user_than_the_owner_are_refused(tmp_path: Path) -> None:
    async def body(engine: DurableEngine) -> None:
        await engine.connect("dev", clean_session=False, username="alice")
        await engine.subscribe("dev", "secret/#", 1)
        transport = RecordingTransport()
        channel = ControlChannel(engine, transport, "dev", False, username="bob", open_streams=lambda: None)
        channel.submit(CONTROL_TOPIC, encode_request("hello", 1))
        channel.submit(CONTROL_TOPIC, encode_request("end_session", 2))
        packets = await transport.wait_for(lambda ps: len(ps) >= 2)
        replies = [json.loads(p.payload) for p in packets if p.topic == REPLY_TOPIC]
        assert [r["error"]["code"] for r in replies] == ["not_your_session"] * 2, replies
        assert "secret/#" not in str(replies), "nothing of the session leaks"
        assert engine.sessions["dev"].record.subscriptions == {"secret/#": 1}

    run(tmp_path, body)


def test_expiry_counts_from_the_last_disconnect_after_a_take_over(tmp_path: Path) -> None:
    async def body(engine: DurableEngine) -> None:
        first, second = RecordingTransport(), RecordingTransport()
        await engine.connect("dev", clean_session=False, transport=first)
        await engine.attach("dev", first)
        assert await engine.connect("dev", clean_session=False, transport=second) is True
        assert await engine.attach("dev", second) is first
        await engine.detach("dev", first)  # the taken-over connection ends: nothing changes
        await engine.detach("dev", second)
        await engine._expire_due()
        assert "dev" not in engine.sessions, "session_expiry 0: gone at the last disconnect"

    run(tmp_path, body, session_expiry=0.0)


def test_read_access_forgets_its_decisions_past_its_limit() -> None:
    async def main() -> None:
        asked: list[str] = []

        async def decide(topic: str) -> bool:
            asked.append(topic)
            return True

        access = ReadAccess(decide)
        for i in range(10_001):
            assert await access.allows(f"t/{i}")
        assert await access.allows("t/0")
        assert asked.count("t/0") == 2 and len(access._known) <= 10_000

    asyncio.run(main())
