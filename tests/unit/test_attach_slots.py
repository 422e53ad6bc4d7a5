"""Attach slots (``attach_limit``, docs/guarantees.md "Reconnect storms"), without a broker: a real
engine and LevelDB store, in-memory transports. The one slot (attach_limit: 1) is held by another
session's attach whose commit waits until the test lets it go."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from amqtt_durable.config import DurableConfig
from amqtt_durable.engine import DurableEngine
from recording_transport import RecordingTransport

LIMIT = 10.0


@asynccontextmanager
async def slot_held(engine: DurableEngine) -> AsyncIterator[asyncio.Task[Any]]:
    """Session "holder" attaches and keeps the only slot: its commit is held until the block ends."""
    await engine.connect("holder", clean_session=False, transport=(holder := RecordingTransport()))
    real, holding, release = engine.committer.commit, asyncio.Event(), asyncio.Event()

    def held_commit(*args: Any, **kwargs: Any) -> asyncio.Future[None]:
        engine.committer.commit = real  # type: ignore[method-assign]  # this commit only
        written = real(*args, **kwargs)

        async def when_released() -> None:
            holding.set()
            await release.wait()
            await written

        return asyncio.ensure_future(when_released())

    engine.committer.commit = held_commit  # type: ignore[method-assign]
    attaching = asyncio.get_running_loop().create_task(engine.attach("holder", holder))
    try:
        await asyncio.wait_for(holding.wait(), LIMIT)
        assert engine.attach_slots.locked()
        yield attaching
    finally:
        release.set()
        await asyncio.wait_for(attaching, LIMIT)


async def _session_with_a_message(engine: DurableEngine, client_id: str) -> None:
    await engine.connect(client_id, clean_session=False)
    await engine.subscribe(client_id, "t/" + client_id, 1)
    engine.route_publish("t/" + client_id, b"kept", 1)
    await engine.written_so_far()


def test_a_session_does_not_expire_while_its_client_waits_for_an_attach_slot(tmp_path: Path) -> None:
    """A returning session past its expiry is spared from CONNECT for CONNECT_GRACE (30 s); in a storm
    its connection can wait longer than that for a slot. Before the fix expiry deleted it while
    its client was connected and waiting, and the attach then found no session: no queue."""

    async def main() -> None:
        engine = DurableEngine(DurableConfig(store=str(tmp_path / "store"), attach_limit=1))
        engine.open()
        try:
            await _session_with_a_message(engine, "dev")
            session = engine.sessions["dev"]
            session.record.expires_at = 1.0  # long past, as if it had been disconnected
            engine.expiry.schedule("dev", 1.0)
            device = RecordingTransport()
            assert await engine.connect("dev", clean_session=False, transport=device) is True  # CONNACK
            async with slot_held(engine):
                attaching = asyncio.get_running_loop().create_task(engine.attach("dev", device))
                await asyncio.sleep(0)  # one pass: it asks for the slot and waits
                assert not attaching.done()
                session.connecting_until = 0.0  # CONNECT_GRACE has run out while it waited
                await engine._expire_due()
                assert "dev" in engine.sessions, "expired while its client waited for an attach slot"
                assert engine.expiry.deadline("dev") is not None, "looked at again later"
            assert await asyncio.wait_for(attaching, LIMIT) is None
            assert engine.sessions.get("dev") is session and session.transport is device
            assert engine.expiry.deadline("dev") is None, "attached: no deadline"
            sent = await device.wait_for(lambda packets: len(packets) >= 1, LIMIT)
            assert [packet.payload for packet in sent] == [b"kept"]
            assert session.attach_waiters == 0
            await engine._expire_due()
            assert "dev" in engine.sessions
        finally:
            await engine.close()

    asyncio.run(main())


def test_a_connection_closed_while_waiting_for_its_slot_is_not_attached(tmp_path: Path) -> None:
    """It stays queued and, when its turn comes, hands the slot on at once: no commit, no pump for a
    connection that is gone (its session disconnected, its queue kept; the glue's detach then starts
    its expiry clock, see the next test). Before, it took its turn: the commit, a pump started on
    the closed connection (the glue's detach then stopped it)."""

    async def main() -> None:
        engine = DurableEngine(DurableConfig(store=str(tmp_path / "store"), attach_limit=1))
        engine.open()
        try:
            await _session_with_a_message(engine, "gone")
            session = engine.sessions["gone"]
            device = RecordingTransport()
            await engine.connect("gone", clean_session=False, transport=device)
            async with slot_held(engine):
                attaching = asyncio.get_running_loop().create_task(engine.attach("gone", device))
                await asyncio.sleep(0)  # one pass: it asks for the slot and waits
                assert not attaching.done()
                device.closed = True
            assert await asyncio.wait_for(attaching, LIMIT) is None
            assert session.pump is None and session.transport is None, "a closed connection was attached"
            assert not engine.attach_slots.locked(), "the slot is free again"
            await engine.detach("gone", device)  # as the glue does when the connection ends
            assert engine.sessions["gone"] is session and session.depth == 1
            assert session.pump is None and session.transport is None
        finally:
            await engine.close()

    asyncio.run(main())


@pytest.mark.parametrize(
    ("expiry", "left"),
    [(600.0, 10.0), (600.0, -100.0), (0.0, -100.0)],
    ids=["deadline ahead", "deadline passed during the wait", "session_expiry 0"],
)
def test_a_connection_closed_while_waiting_for_its_slot_restarts_its_session_expiry(
    tmp_path: Path, expiry: float, left: float
) -> None:
    """docs/guarantees.md: a disconnected session's time counts from its last disconnect. A client
    that got CONNACK (session_present=1) and whose connection closed while it waited for its slot
    never attached; before the fix its detach did nothing, so the session kept the deadline of the
    disconnect before that CONNECT and could be deleted CONNECT_GRACE (30 s) after it, or at once
    after its wait ended, before its detach. Its non-durable subscriptions end with it.

    With ``session_expiry: 0`` it is deleted at its detach: before the second fix the CONNECT_GRACE
    its closed connection had set when its wait ended still spared it for up to 30 s, past its
    stored deadline (a returning client got session_present=1)."""

    async def main() -> None:
        engine = DurableEngine(DurableConfig(store=str(tmp_path / "store"), attach_limit=1, session_expiry=expiry))
        engine.open()
        try:
            await _session_with_a_message(engine, "gone")
            session = engine.sessions["gone"]
            await engine.subscribe("gone", "n/gone", 1)
            # Disconnected long ago: ``left`` seconds of its ``expiry`` left (< 0: it passed while its client waited).
            session.record.disconnected_at = time.time() - expiry + left
            session.record.expires_at = old_deadline = time.time() + left
            engine.expiry.schedule("gone", old_deadline)
            device = RecordingTransport()
            assert await engine.connect("gone", clean_session=False, transport=device) is True  # CONNACK
            async with slot_held(engine):
                attaching = asyncio.get_running_loop().create_task(engine.attach("gone", device))
                await asyncio.sleep(0)  # one pass: it asks for the slot and waits
                assert not attaching.done()
                engine.set_interest("gone", "n/gone", False, device)  # its SDK's interest, read meanwhile
                session.connecting_until = 0.0  # CONNECT_GRACE has run out while it waited
                device.closed = True
            assert await asyncio.wait_for(attaching, LIMIT) is None
            assert session.transport is None, "a closed connection was attached"
            await engine._expire_due()  # between its attach's end and its detach (the glue awaits in between)
            assert engine.sessions.get("gone") is session, "expired before its detach"
            before = time.time()
            await engine.detach("gone", device)  # as the glue does when the connection ends
            after = time.time()
            expires_at = session.record.expires_at
            assert expires_at is not None and before + expiry <= expires_at <= after + expiry, (
                f"the expiry clock did not restart at this disconnect: {expires_at - after:.0f} s left"
                if expires_at is not None
                else "no deadline"
            )
            assert session.record.disconnected_at is not None and before <= session.record.disconnected_at <= after
            assert engine.expiry.deadline("gone") == expires_at
            assert list(session.record.subscriptions) == ["t/gone"], "its non-durable subscription ends with it"
            await engine._expire_due()
            if expiry:
                assert engine.sessions.get("gone") is session and session.depth == 1
            else:
                assert "gone" not in engine.sessions, "outlived its deadline (session_expiry 0)"
        finally:
            await engine.close()

    asyncio.run(main())
