"""Backup ends across leader changes and shutdown: a worker-thread write the backup's task was
cancelled during is finished before the next backup end reads the store, however many times the
leader changed meanwhile, and before stop() returns; a store closed under a cancelled apply leaves
the cancellation a cancellation (review 180)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
from replication_helpers import HOST, bounded, commit, new_backup, ops_for, started_primary
from test_replication_channel import cancel_during_a_threaded_write, content, hold_threaded_writes, in_sync_at

from amqtt_durable.process import free_port
from amqtt_durable.replication.backup import Backup
from amqtt_durable.replication.config import ReplicationConfig
from amqtt_durable.replication.coordinator import Leader
from amqtt_durable.replication.node import ReplicationNode
from amqtt_durable.replication.primary import Primary
from amqtt_durable.store import open_store


def test_two_leader_changes_during_a_threaded_write_stop_waits_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backup end (T0) writes a catch-up group in a worker thread; the leader changes twice
    (node.follow A, then B) before T0 ended. _stop_following promises 'the backup end's last
    write is finished' and _follow promises the next end starts after it: neither holds, since
    the middle task (T1) is cancelled while it waits for T0 and T2 waits only for T1."""
    started, release = hold_threaded_writes(monkeypatch)

    async def main() -> None:
        primary = await started_primary(tmp_path / "p", log_max_batches=100_000, log_max_bytes=1 << 30)
        bdb = open_store(str(tmp_path / "b"))
        await in_sync_at(primary, [Backup(bdb, name="b", sync=False)], 2)
        for n in range(3, 41):
            commit(primary, ops_for(n))
        started.clear()
        release.clear()
        config = ReplicationConfig(
            name="b", role="backup", primary=f"{HOST}:{primary.port}", listen=f"{HOST}:{free_port()}"
        )
        node = ReplicationNode(bdb, config, fsync=False)
        await node.start()
        t0 = node._follow_task
        assert t0 is not None
        try:
            await bounded(asyncio.to_thread(started.wait, 30))  # T0's catch-up write is in its thread
            node.follow(Leader("a", f"{HOST}:{free_port()}"))
            node.follow(Leader("b", f"{HOST}:{free_port()}"))
            stopping = asyncio.create_task(node.stop())
            await asyncio.wait({stopping}, timeout=3)  # bounded: a fixed stop waits for the held write
            t0_running_after_stop = stopping.done() and not t0.done()
        finally:
            release.set()
            await bounded(asyncio.wait({t0}))
            await bounded(stopping)
            await primary.close()
        assert not t0_running_after_stop, "node.stop() returned while the backup end's write was still in its thread"

    asyncio.run(main())


def test_two_leader_changes_during_a_threaded_write_new_primary_gets_a_stale_hello(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The commit's own scenario (B2 and B at P1's batch 5; B catches up 6..40 in a thread) but
    the leader changes twice before that write ended (A, which never answers, then P2 = B2):
    the end that follows P2 reads the store before T0's write finished, so its HELLO says
    batch 5 and P2 sends only its own batch 6; B keeps P1's rows that P2 never had."""
    started, release = hold_threaded_writes(monkeypatch)

    async def main() -> None:
        events: list[str] = []
        changed = asyncio.Event()

        async def event_with(text: str) -> None:
            for _ in range(1000):  # bounded
                if any(text in e for e in events):
                    return
                changed.clear()
                await changed.wait()

        p1 = await started_primary(tmp_path / "p1", log_max_batches=100_000, log_max_bytes=1 << 30)
        store_id = p1.store_id
        b2 = new_backup(tmp_path, "b2", sync=False)
        bdb = open_store(str(tmp_path / "b"))
        await in_sync_at(p1, [b2, Backup(bdb, name="b", sync=False)], 5)
        for n in range(6, 41):
            commit(p1, ops_for(n))
        started.clear()
        release.clear()
        config = ReplicationConfig(name="b", role="backup", primary=f"{HOST}:{p1.port}", listen=f"{HOST}:{free_port()}")
        node = ReplicationNode(bdb, config, fsync=False)
        await node.start()
        t0 = node._follow_task
        assert t0 is not None
        p2 = None
        try:
            await bounded(asyncio.to_thread(started.wait, 30))
            await p1.close()
            p2 = Primary(
                b2.db,
                store_id=store_id,
                log_max_batches=100_000,
                log_max_bytes=1 << 30,
                on_change=lambda _, e: (events.append(e), changed.set()),
            )
            await p2.start(HOST, 0)
            commit(p2, [(b"p2-own", b"1")])
            node.follow(Leader("a", f"{HOST}:{free_port()}"))
            node.follow(Leader("p2", f"{HOST}:{p2.port}"))
            # On the buggy code P2 is connected while T0's write is held; with a fix T2 waits for
            # T0, so the write is released after a bounded wait for that connection.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(3):
                    await event_with("connected at batch")
            release.set()
            await bounded(event_with("connected at batch"))
            planned = list(events)
            await bounded(asyncio.wait({t0}))
            await bounded(event_with("in sync at batch 6"))
        finally:
            release.set()
            await node.stop()
            if p2 is not None:
                await p2.close()
        extra = set(content(bdb)) - set(content(b2.db))
        assert not extra, f"B holds {len(extra)} keys P2 never had; P2 planned {planned}"
        assert any("diverged" in e for e in planned), planned

    asyncio.run(main())


def test_a_cancelled_apply_on_a_closed_store_still_ends_cancelled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The store is closed while the cancelled task's thread write is held (what the broker did
    after a stop() that returned early): reading the position back in the cancellation handler
    fails ('Database is closed'), and the task still ends cancelled (the error replaced the
    CancelledError before). The thread's own write fails the same way: that error is logged, not
    left in its task for asyncio's "Task exception was never retrieved" on stderr (it was)."""
    started, release = hold_threaded_writes(monkeypatch)

    async def main() -> None:
        primary = await started_primary(tmp_path / "p", log_max_batches=100_000, log_max_bytes=1 << 30)
        backup = new_backup(tmp_path, "b", sync=False)
        await in_sync_at(primary, [backup], 2)
        try:
            task = await cancel_during_a_threaded_write(
                backup, primary, 40, started, release, while_held=backup.db.close
            )
        finally:
            await primary.close()
        assert task.cancelled(), repr(task.exception())

    asyncio.run(main())
    assert "in a worker thread failed after its task was cancelled: RuntimeError('Database is closed')" in caplog.text
