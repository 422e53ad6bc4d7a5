"""GroupCommitter on a replication primary: numbered batches written with their position, sync
acknowledgement after the backups, the sent mark's local wait, and a halt that acknowledges
nothing more. A real store and a real Primary (no backup connected unless a test adds one)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from amqtt_durable.errors import NotPrimaryError
from amqtt_durable.replication.commits import ReplicatedCommits
from amqtt_durable.replication.config import ReplicationConfig
from amqtt_durable.replication.node import ReplicationNode
from amqtt_durable.replication.position import read_position
from amqtt_durable.replication.primary import PreparedBatch, Primary, Shipped
from amqtt_durable.store import GroupCommitter

BOUND = 5.0


class HeldShipping(ReplicatedCommits):
    """The real commit step, except that shipping resolves when the test says (a backup's ack)."""

    def __init__(self, primary: Primary, mode: Any = "sync") -> None:
        super().__init__(primary, mode, lambda: self.acknowledging)
        self.acknowledging = True
        self.shipped: list[asyncio.Future[None]] = []
        self.shipping = asyncio.Event()

    def committed(self, batch: PreparedBatch, then: Shipped) -> bool:
        if not super().committed(batch, lambda _: None):  # shipped for real; the outcome is the test's
            return False
        held: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        held.add_done_callback(lambda done: then(done.exception()))
        self.shipped.append(held)
        self.shipping.set()
        return True


def run(db: Any, test: Callable[[GroupCommitter, HeldShipping], Awaitable[None]]) -> None:
    async def main() -> None:
        primary = Primary(db, store_id=7, log_max_batches=100, log_max_bytes=1 << 20)
        committer = GroupCommitter(db, sync=False, batch_size=5000, batch_delay_ms=0.0, pending_threshold=1)
        committer.replication = HeldShipping(primary)
        try:
            await asyncio.wait_for(test(committer, committer.replication), BOUND)
        finally:
            await primary.close()

    asyncio.run(main())


def test_a_sync_commit_is_acknowledged_and_delivered_only_once_shipped(db: Any) -> None:
    async def test(committer: GroupCommitter, shipping: HeldShipping) -> None:
        delivered: list[str] = []
        committer.put(b"k1", b"v1")
        stored = committer.commit(lambda: delivered.append("k1"))
        await shipping.shipping.wait()
        position = read_position(db)
        assert db.get(b"k1") == b"v1" and position is not None and position[0] == 1, "written, numbered"
        await asyncio.sleep(0)  # a loop pass in which nothing may complete it
        assert not stored.done() and delivered == [], "the backups have not confirmed it yet"
        shipping.shipped[0].set_result(None)
        await stored
        assert delivered == ["k1"]

    run(db, test)


def test_the_sent_mark_waits_for_the_local_write_only(db: Any) -> None:
    async def test(committer: GroupCommitter, shipping: HeldShipping) -> None:
        committer.put(b"mark", b"1")
        local = committer.commit(urgent=True, local=True)
        publish = committer.commit()
        await local
        assert db.get(b"mark") == b"1"
        assert not publish.done(), "a publish of the same batch still waits for the backups"
        shipping.shipped[0].set_result(None)
        await publish

    run(db, test)


@pytest.mark.parametrize("why", ["shipping failed", "lease ending"])
def test_a_primary_that_may_no_longer_acknowledge_halts(db: Any, why: str) -> None:
    async def test(committer: GroupCommitter, shipping: HeldShipping) -> None:
        committer.put(b"k", b"v")
        stored = committer.commit()
        await shipping.shipping.wait()
        if why == "shipping failed":
            shipping.shipped[0].set_exception(ConnectionResetError("the primary was closed"))
        else:
            shipping.acknowledging = False
            shipping.shipped[0].set_result(None)
        with pytest.raises(NotPrimaryError):
            await stored
        assert committer.halted is None, "only the demotion halts (it also ends the clients)"
        committer.halt("demoted")
        committer.put(b"after", b"x")
        with pytest.raises(NotPrimaryError):
            await committer.commit()
        assert db.get(b"after") is None, "a halted committer writes nothing more"

    run(db, test)


def test_async_mode_acknowledges_after_the_local_write(db: Any) -> None:
    async def test(committer: GroupCommitter, shipping: HeldShipping) -> None:
        shipping.mode = "async"
        committer.put(b"k", b"v")
        await committer.commit()
        assert shipping.shipped == [] and db.get(b"k") == b"v"

    run(db, test)


@pytest.mark.parametrize("deleted", [True, False])
def test_async_mode_with_a_coordinator_holds_acknowledgements_until_the_earlier_sync_set_is_deleted(
    db: Any, deleted: bool
) -> None:
    """Review 246: a node in async mode deleted the synchronous set when it took the lease, so a
    failed promotion left no set and a backup outside it took over. Now the primary end deletes it
    once the promotion succeeded (``delete_earlier_sync_set``) and acknowledges nothing before
    (the way a sync-mode primary publishes its set first); closed before that: the publish fails."""

    async def main() -> None:
        deleting, answer = asyncio.Event(), asyncio.Event()

        async def delete() -> None:
            deleting.set()
            await answer.wait()

        primary = Primary(db, store_id=7, log_max_batches=100, log_max_bytes=1 << 20, delete_sync_set=delete)
        committer = GroupCommitter(db, sync=False, batch_size=5000, batch_delay_ms=0.0, pending_threshold=1)
        committer.replication = ReplicatedCommits(primary, "async", lambda: True)
        try:
            committer.put(b"k", b"v")
            stored = committer.commit()
            primary.delete_earlier_sync_set()
            await asyncio.wait_for(deleting.wait(), BOUND)
            assert db.get(b"k") == b"v" and not stored.done(), "written, not acknowledged before the deletion"
            if deleted:
                answer.set()
                await asyncio.wait_for(stored, BOUND)
                await asyncio.wait_for(committer.commit(), BOUND)  # from then on at once
            else:
                await primary.close("demoted")
                with pytest.raises(NotPrimaryError):
                    await asyncio.wait_for(stored, BOUND)
        finally:
            await primary.close()

    asyncio.run(main())


@pytest.mark.parametrize("fsync", [True, False])
def test_a_backup_fsyncs_what_it_applies_as_the_broker_fsyncs_its_commits(db: Any, fsync: bool) -> None:
    async def main() -> None:
        node = ReplicationNode(db, ReplicationConfig(role="backup", primary="127.0.0.1:1"), fsync=fsync)
        assert node.backup.sync is fsync
        node.demote("a test")  # a demoted primary's new backup end keeps the setting
        assert node.backup.sync is fsync
        await node.stop()

    asyncio.run(main())
