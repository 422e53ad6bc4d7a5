"""An attach dropped because a newer CONNECT of the client id was accepted meanwhile (review 301),
without a broker: a real engine and LevelDB store, in-memory transports; the newer CONNECT comes
inside the attach's await (its commit, or the stop of the pump of the connection attached until
then), which makes the interleaving certain."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from amqtt_durable.config import DurableConfig
from amqtt_durable.engine import DurableEngine
from recording_transport import RecordingTransport


def test_a_new_session_whose_attach_is_dropped_expires_when_the_newer_connection_never_attaches(
    tmp_path: Path,
) -> None:
    """The first connection's CONNECT creates the session; a newer CONNECT is accepted while its
    attach's commit is written, so the attach is dropped, and the newer connection neither attaches
    nor ends. Before the fix the session had no expiry deadline (there was no earlier disconnect to
    restore): it never expired. It now expires like any disconnected session, once the newer
    CONNECT's grace is over."""

    async def main() -> None:
        engine = DurableEngine(DurableConfig(store=str(tmp_path / "store"), session_expiry=0))
        engine.open()
        try:
            older, newer = RecordingTransport(), RecordingTransport()
            assert await engine.connect("dev", clean_session=False, transport=older) is False
            real = engine.committer.commit

            def commit_with_a_newer_connect(*args: Any, **kwargs: Any) -> asyncio.Future[None]:
                engine.committer.commit = real  # type: ignore[method-assign]  # this commit only
                written = real(*args, **kwargs)

                async def meanwhile() -> None:
                    assert await engine.connect("dev", clean_session=False, transport=newer) is True
                    await written

                return asyncio.ensure_future(meanwhile())

            engine.committer.commit = commit_with_a_newer_connect  # type: ignore[method-assign]
            assert await engine.attach("dev", older) is None, "dropped: a newer CONNECT was accepted"
            session = engine.sessions["dev"]
            assert session.transport is None and session.newest is newer
            assert engine.expiry.deadline("dev") is not None, "no expiry deadline"
            session.connecting_until = 0.0  # CONNECT_GRACE has run out: the newer one never attached
            await engine._expire_due()
            assert "dev" not in engine.sessions, "outlived its deadline"
        finally:
            await engine.close()

    asyncio.run(main())


def test_an_attach_dropped_after_stopping_the_live_connection_s_pump_has_that_connection_ended(
    tmp_path: Path,
) -> None:
    """A connection is attached; a newer CONNECT (middle) attaches, stopping its pump, and while the
    pump stops the newest CONNECT is accepted: middle's attach is dropped. Before the fix the
    attached connection stayed the session's, its pump stopped: connected, sent nothing until the
    next attach. Its attach now returns it (the glue ends it: a newer CONNECT was accepted)."""

    async def main() -> None:
        engine = DurableEngine(DurableConfig(store=str(tmp_path / "store")))
        engine.open()
        try:
            live, middle, newest = RecordingTransport(), RecordingTransport(), RecordingTransport()
            await engine.connect("dev", clean_session=False, transport=live)
            assert await engine.attach("dev", live) is None
            session = engine.sessions["dev"]
            assert session.transport is live and session.pump is not None
            assert await engine.connect("dev", clean_session=False, transport=middle) is True
            pump = session.pump
            real_stop = pump.stop

            async def stop_with_a_newer_connect() -> None:
                assert await engine.connect("dev", clean_session=False, transport=newest) is True
                await real_stop()

            pump.stop = stop_with_a_newer_connect  # type: ignore[method-assign]
            assert await engine.attach("dev", middle) is live, "the connection whose pump stopped is not ended"
            assert await engine.attach("dev", newest) is live  # the newest one takes the session, as ever
            assert session.transport is newest and session.pump is not None
        finally:
            await engine.close()

    asyncio.run(main())


def test_with_session_expiry_0_a_session_ends_with_its_last_connection_after_a_newer_connect_closed_unattached(
    tmp_path: Path,
) -> None:
    """Review: the older connection is attached, a newer CONNECT accepted, and the newer connection
    closes before it attaches (the broker now takes the older one over before the newer CONNACK;
    this was reachable through it when two CONNECTs were read at the same time). The newer one's
    end left its CONNECT's grace (CONNECT_GRACE, 30 s) on the session while the older stayed
    attached, so with session_expiry 0 the session outlived its last connection by up to 30 s. It
    expires when the older one ends."""

    async def main() -> None:
        engine = DurableEngine(DurableConfig(store=str(tmp_path / "store"), session_expiry=0))
        engine.open()
        try:
            older, newer = RecordingTransport(), RecordingTransport()
            await engine.connect("dev", clean_session=False, transport=older)
            assert await engine.attach("dev", older) is None
            assert await engine.connect("dev", clean_session=False, transport=newer) is True
            await engine.detach("dev", newer)  # closed before it attached
            session = engine.sessions["dev"]
            assert session.transport is older and session.connecting_until == 0.0
            await engine.detach("dev", older)  # the session's last connection
            await engine._expire_due()
            assert "dev" not in engine.sessions, "the session outlived its last connection with session_expiry 0"
        finally:
            await engine.close()

    asyncio.run(main())
