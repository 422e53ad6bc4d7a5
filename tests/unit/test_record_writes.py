"""A change of a session record alone (no queue write with it) reaches the store.

Records are encoded once per commit (``Routing._before_flush``), so a change only asks for a
flush; the committer must write when that is all it was asked (review of 8eb5754: it skipped
the flush, and an idle broker kept a reconnect's cleared expiry in memory only, so a crash then
a restart expired the session that was connected at the crash, queue and all).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

from unit.recording_transport import RecordingTransport

from amqtt_durable.config import DurableConfig
from amqtt_durable.engine import DurableEngine
from amqtt_durable.store import SessionRecord, iter_sessions

BOUND = 10.0


def stored(engine: DurableEngine, client_id: str) -> SessionRecord:
    return next(record for record in iter_sessions(engine.db) if record.client_id == client_id)


async def stored_soon(engine: DurableEngine, holds: Callable[[SessionRecord], bool]) -> SessionRecord:
    """The stored record of "dev" once ``holds`` is true of it (AssertionError after BOUND s)."""
    deadline = time.monotonic() + BOUND
    while not holds(record := stored(engine, "dev")):
        assert time.monotonic() < deadline, f"the store still holds {record}"
        await asyncio.sleep(0.01)
    return record


def test_a_reconnect_alone_is_stored_and_the_session_survives_a_crash_past_its_old_deadline(tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    expiry = 0.3

    async def before_crash() -> float:
        engine = DurableEngine(DurableConfig(store=store, session_expiry=expiry))
        engine.open()
        await engine.connect("dev", clean_session=False)
        await engine.subscribe("dev", "cmd/#", 1)
        first = RecordingTransport()
        await engine.attach("dev", first)
        await engine.detach("dev", first)  # the device drops off: its deadline is stored
        deadline = (await stored_soon(engine, lambda r: r.expires_at is not None)).expires_at
        assert deadline is not None
        await engine.connect("dev", clean_session=False)
        await engine.attach("dev", RecordingTransport())  # back at once, and nothing else is written
        await stored_soon(engine, lambda r: r.expires_at is None)
        for session in engine.sessions.values():
            if session.pump is not None:
                await session.pump.stop()
        engine.db.close()  # a crash: no drain
        return deadline

    old_deadline = asyncio.run(before_crash())
    while time.time() <= old_deadline + 0.05:  # the restart comes after the old deadline (bounded: 0.3 s)
        time.sleep(0.01)

    async def after_restart() -> list[str]:
        engine = DurableEngine(DurableConfig(store=store, session_expiry=300.0))
        engine.open()
        await engine._expire_due()  # what the expiry timer runs: every deadline passed is due now
        alive = list(engine.sessions)
        await engine.close()
        return alive

    assert asyncio.run(after_restart()) == ["dev"]


def test_hello_interest_and_disconnect_are_stored_without_other_writes(tmp_path: Path) -> None:
    async def main() -> None:
        engine = DurableEngine(DurableConfig(store=str(tmp_path / "store")))
        engine.open()
        try:
            await engine.connect("dev", clean_session=False)
            await engine.subscribe("dev", "a/#", 1)
            engine.hello("dev", 3600.0)
            await stored_soon(engine, lambda r: r.expiry == 3600.0 and r.sdk)
            transport = RecordingTransport()
            engine.set_interest("dev", "a/#", False, transport)
            await stored_soon(engine, lambda r: r.non_durable == {"a/#"})
            await engine.attach("dev", transport)
            await stored_soon(engine, lambda r: r.expires_at is None)
            await engine.detach("dev", transport)
            await stored_soon(engine, lambda r: r.expires_at is not None)
        finally:
            await engine.close()

    asyncio.run(main())
