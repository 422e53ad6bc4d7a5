"""One broker's replication: which end of the channel runs, switched by the HA loop.

``ReplicationNode`` is the HA loop's hooks (ha.HaHooks) over a store: as a backup it runs the
backup end towards the leader's address; promoted, it stops that end (its last write
finished) and serves backups as primary, numbering on from the store's position; demoted, it
stops acknowledging at once, fails the batches still waiting for backups, and becomes a
backup again (its store is then checked against the new primary's history, and replaced by a
snapshot if it diverged). Without a coordinator the role is fixed by the configuration and
``promote`` is the operator's decision.

The broker (not yet wired) gives two callbacks: ``on_promote(primary)`` (load the store, accept
clients, commit through ``primary.prepare``/``committed``) and ``on_demote(reason)`` (close
client connections; acknowledgements already stopped: ``may_acknowledge`` is false).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from .backup import Backup
from .config import ReplicationConfig
from .coordinator import Coordinator, Leader
from .errors import CoordinatorError
from .ha import Decision, HaNode
from .position import read_store_id
from .primary import Primary

log = logging.getLogger("amqtt_durable.replication")


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


class ReplicationNode:
    """The replication side of one broker over its open store ``db``."""

    def __init__(
        self,
        db: Any,
        config: ReplicationConfig,
        *,
        coordinator: Coordinator | None = None,
        on_promote: Callable[[Primary], None] | None = None,
        on_demote: Callable[[str], None] | None = None,
    ) -> None:
        self.db = db
        self.config = config
        self.on_promote = on_promote
        self.on_demote = on_demote
        self.primary: Primary | None = None
        self.backup = Backup(db, name=config.name or "backup")
        self.ha = (
            HaNode(
                coordinator,
                self,
                name=config.name,
                address=config.advertised,
                loop_wait=config.loop_wait,
                demote_margin=config.demote_margin,
            )
            if coordinator is not None
            else None
        )
        self.decisions: list[Decision] = []
        self._following: str | None = None
        self._follow_stop = asyncio.Event()
        self._follow_task: asyncio.Task[None] | None = None
        self._ha_stop = asyncio.Event()
        self._ha_task: asyncio.Task[None] | None = None
        self._closing: set[asyncio.Task[None]] = set()

    def may_acknowledge(self) -> bool:
        """Whether a publish may be acknowledged now (before sync mode's wait for backups)."""
        if self.primary is None:
            return False
        return self.ha is None or self.ha.may_acknowledge()

    async def start(self) -> None:
        if self.ha is not None:
            self._ha_task = asyncio.get_running_loop().create_task(self.ha.run(self._ha_stop, self._decided))
        elif self.config.role == "primary":
            await self.promote()
        else:
            host, port = split_address(self.config.primary)
            self.follow(Leader("primary", f"{host}:{port}"))

    async def stop(self) -> None:
        self._ha_stop.set()
        if self._ha_task is not None:
            await self._ha_task  # a primary releases its lease on the way out
        await self._stop_following()
        if self.primary is not None:
            await self.primary.close("the broker stops")
            self.primary = None
        for task in list(self._closing):
            await task

    def _decided(self, decision: Decision) -> None:
        self.decisions.append(decision)

    # --- ha.HaHooks -------------------------------------------------------------------------

    def caught_up(self) -> bool:
        return self.primary is None and self.backup.caught_up

    def follow(self, leader: Leader) -> None:
        if self._following == leader.address and self._follow_task is not None and not self._follow_task.done():
            return
        previous = self._follow_task
        if previous is not None:
            self._follow_stop.set()
            previous.cancel()
        self._following = leader.address
        self._follow_stop = asyncio.Event()
        host, port = split_address(leader.address)
        self._follow_task = asyncio.get_running_loop().create_task(
            self._follow(previous, host, port, self._follow_stop)
        )

    async def _follow(self, previous: asyncio.Task[None] | None, host: str, port: int, stop: asyncio.Event) -> None:
        if previous is not None:
            await _ended(previous)
        await self.backup.follow(host, port, stop, retry=min(0.5, self.config.loop_wait))

    async def _stop_following(self) -> None:
        task, self._follow_task, self._following = self._follow_task, None, None
        if task is not None:
            self._follow_stop.set()
            task.cancel()
            await _ended(task)  # the backup end's last write is finished

    async def promote(self) -> None:
        await self._stop_following()
        host, port = split_address(self.config.listen)
        primary = Primary(
            self.db,
            store_id=read_store_id(self.db),
            log_max_batches=self.config.retained_batches,
            log_max_bytes=self.config.retained_bytes,
            ack_timeout=self.config.ack_timeout,
            chunk_bytes=self.config.snapshot_chunk_bytes,
            publish_sync_set=self._publish_sync_set if self.ha is not None and self.config.mode == "sync" else None,
        )
        await primary.start(host, port)
        self.primary = primary
        log.warning("replication: %s is primary from batch %d", self.config.name, primary.log.head_seq)
        if self.on_promote is not None:
            self.on_promote(primary)

    async def _publish_sync_set(self, members: frozenset[str]) -> None:
        assert self.ha is not None
        async with asyncio.timeout(self.config.ack_timeout):
            if not await self.ha.coordinator.publish_sync(self.ha.me, members):
                raise CoordinatorError(", ".join(self.config.coordinator), "this node no longer holds the lease")

    def demote(self, reason: str) -> None:
        primary, self.primary = self.primary, None  # may_acknowledge is false from here on
        log.warning("replication: %s: %s", self.config.name, reason)
        if self.on_demote is not None:
            self.on_demote(reason)
        if primary is not None:
            task = asyncio.get_running_loop().create_task(primary.close(reason))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        self.backup = Backup(self.db, name=self.config.name or "backup")


async def _ended(task: asyncio.Task[None]) -> None:
    """Wait for a cancelled backup end; a failure it ended with is logged, not raised again."""
    await asyncio.wait({task})  # our own cancellation still propagates
    if not task.cancelled() and (failure := task.exception()) is not None:
        log.error("replication: the backup end failed: %r", failure)
