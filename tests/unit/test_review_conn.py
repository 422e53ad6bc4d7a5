"""Issue 10 review of the connection-level points, over a real store, without a broker."""

from __future__ import annotations

from pathlib import Path

from test_replay_marker import run

from amqtt_durable.engine import DurableEngine
from amqtt_durable.store import iter_pubrel_due


def test_a_session_passing_to_another_user_forgets_the_previous_user_s_qos2_packet_ids(tmp_path: Path) -> None:
    """Packet ids are the publisher's own: the new user's PUBLISH with one of them is a new message."""

    async def body(engine: DurableEngine) -> None:
        await engine.connect("dev", clean_session=False, username="alice")
        await engine.connect("sub", clean_session=False)
        await engine.subscribe("sub", "q/#", 2)
        for packet_id in (7, 9):
            stored = engine.route_publish("q/a", b"alice's", 2)
            engine.expect_pubrel("dev", packet_id)
            assert stored is not None
            await stored
        assert engine.pubrel_due("dev", 7) and engine.pubrel_due("dev", 9)
        assert await engine.connect("dev", clean_session=False, username="alice") is True
        assert engine.pubrel_due("dev", 7), "the owner's own reconnect keeps them (a re-send is no new message)"
        assert await engine.connect("dev", clean_session=False, username="bob") is True
        assert not engine.pubrel_due("dev", 7) and not engine.pubrel_due("dev", 9)
        await engine.written_so_far()
        assert list(iter_pubrel_due(engine.db)) == [], "forgotten in the store too"

    run(tmp_path, body, session_takeover="any-user")
