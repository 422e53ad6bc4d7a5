"""Two replication nodes, a real etcd, real stores and real TCP: failover and rejoin.

Not the broker yet (issue 12's first round): the nodes' stores are written the way the
wiring will write them (prepare, local write, committed), by this test.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from replication_helpers import bounded, commit, content, ops_for

from amqtt_durable.process import EtcdProcess, free_port
from amqtt_durable.replication.config import ReplicationConfig
from amqtt_durable.replication.coordinator import Leader
from amqtt_durable.replication.errors import ReplicationError
from amqtt_durable.replication.etcd import EtcdCoordinator
from amqtt_durable.replication.node import ReplicationNode
from amqtt_durable.replication.primary import Primary
from amqtt_durable.store import STORE_ID_KEY, open_store


class Broker:
    """What the broker will do on promotion and demotion, recorded."""

    def __init__(self, name: str, etcd: EtcdProcess, folder: Path) -> None:
        self.config = ReplicationConfig(
            name=name,
            coordinator=[etcd.url],
            listen=f"127.0.0.1:{free_port()}",
            lease_ttl=2,
            loop_wait=0.2,
            demote_margin=0.5,
        )
        self.coordinator = EtcdCoordinator([etcd.url], prefix=self.config.prefix, ttl=2, timeout=0.5)
        self.db = open_store(str(folder / name))
        self.published: list[frozenset[str]] = []
        """The synchronous sets this node published as primary (the coordinator took them)."""
        self.sync_published = asyncio.Event()
        publish = self.coordinator.publish_sync

        async def publish_sync(me: Leader, members: frozenset[str]) -> bool:
            taken = await publish(me, members)
            if taken:
                self.published.append(members)
                self.sync_published.set()
            return taken

        self.coordinator.publish_sync = publish_sync  # type: ignore[method-assign]
        self.promoted = asyncio.Event()
        self.demoted = asyncio.Event()
        self.node = ReplicationNode(
            self.db,
            self.config,
            coordinator=self.coordinator,
            on_promote=self._promoted,
            on_demote=lambda reason: self.demoted.set(),
        )

    def _promoted(self, primary: Primary) -> None:
        if self.db.get(STORE_ID_KEY) is None:  # a new cluster's first primary makes the store id
            self.db.put(STORE_ID_KEY, (0x5EED).to_bytes(8, "big"))
            primary.store_id = 0x5EED
        self.promoted.set()


def test_the_backup_takes_over_and_the_old_primary_rejoins_and_is_caught_up(etcd: EtcdProcess, tmp_path: Path) -> None:
    async def main() -> None:
        a, b = Broker("a", etcd, tmp_path), Broker("b", etcd, tmp_path)
        await a.node.start()
        await bounded(a.promoted.wait())  # a bootstraps the cluster
        await b.node.start()
        await bounded(b.node.backup.in_sync_event.wait())
        primary = a.node.primary
        assert primary is not None
        assert a.node.may_acknowledge()
        acked = [commit(primary, ops_for(n)) for n in range(1, 201)]
        await bounded(asyncio.gather(*acked))  # sync: b has every one of them
        assert b.node.backup.applied_seq == 200

        a.coordinator.endpoints = [f"http://127.0.0.1:{free_port()}"]  # a is cut off from etcd
        waiting = commit(primary, ops_for(201))  # b confirms it, or a's demotion fails it
        await bounded(b.promoted.wait())
        assert a.demoted.is_set()
        assert not a.node.may_acknowledge()
        assert b.node.may_acknowledge()
        with contextlib.suppress(ReplicationError):  # if so, not acknowledged: the publisher re-sends it
            await bounded(waiting)

        new_primary = b.node.primary
        assert new_primary is not None
        assert new_primary.store_id == primary.store_id  # the same store: clients see no change
        assert new_primary.log.head_seq >= 200  # numbering goes on from b's store
        a.coordinator.endpoints = [etcd.url]  # the partition heals: a rejoins as a backup
        await bounded(a.node.backup.in_sync_event.wait())
        assert a.node.primary is None
        more = [commit(new_primary, ops_for(n)) for n in range(1000, 1100)]
        await bounded(asyncio.gather(*more))
        await bounded(a.node.backup.wait_applied(new_primary.log.head_seq))
        assert content(a.db) == content(b.db)
        # The primary publishes its synchronous set to etcd once a is in sync, while the commits
        # go on; on a loaded machine the publication can still be under way here.
        while not b.published or b.published[-1] != frozenset({"a"}):
            b.sync_published.clear()
            await bounded(b.sync_published.wait())
        assert new_primary.sync_set == frozenset({"a"})
        assert await b.coordinator.sync_members() == frozenset({"a"})
        assert any(d.action == "follow" for d in a.node.decisions)
        await b.node.stop()
        await a.node.stop()

    asyncio.run(asyncio.wait_for(main(), 60))
