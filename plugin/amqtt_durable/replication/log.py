"""The primary's retained batch log and catch-up planning (pure logic, no I/O).

A backup that reconnects after a short absence is caught up from the batches the primary
still holds in memory (XAP's redo log, GemFire's queue); one that is too far behind, never
replicated, replicates another store, or diverged (it is a former primary whose last batches
never reached the new one) gets a snapshot first (XAP's snapshot phase, GemFire's initial
image), never a gap. The log is bounded by a count and a byte size; the oldest batches leave
first, always keeping the newest one so an idle primary can still check a backup's position.

A backup being caught up *pins* its position: the batches after it stay, past the count and
byte bounds, up to ``pin_max_bytes``, so a snapshot streamed while the primary keeps
committing is followed by the batches since (XAP's completion phase) instead of starting
over. Past ``pin_max_bytes`` the pin is dropped and that backup gets a new snapshot.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class Retained:
    seq: int
    crc: int
    data: bytes
    """The encoded batch, as shipped."""


class RetainedLog:
    """The newest batches of the primary, by number, bounded by ``max_batches`` and ``max_bytes``."""

    def __init__(
        self,
        *,
        max_batches: int,
        max_bytes: int,
        last_seq: int = 0,
        last_crc: int = 0,
        pin_max_bytes: int | None = None,
    ) -> None:
        self.max_batches = max_batches
        self.max_bytes = max_bytes
        self.pin_max_bytes = 4 * max_bytes if pin_max_bytes is None else pin_max_bytes
        self._pins: dict[object, int] = {}
        self._items: deque[Retained] = deque()
        self._bytes = 0
        self.base_seq = last_seq
        """Number of the newest batch that left the log (or the store's position at start)."""
        self.base_crc = last_crc
        self._changed: asyncio.Event | None = None
        """Set by the next append for whoever waits in ``wait_beyond`` (made only when one waits:
        ``append`` runs once per commit)."""

    @property
    def head_seq(self) -> int:
        """Number of the newest batch (the store's position)."""
        return self._items[-1].seq if self._items else self.base_seq

    @property
    def head_crc(self) -> int:
        return self._items[-1].crc if self._items else self.base_crc

    @property
    def first_seq(self) -> int:
        """Number of the oldest batch still held; head_seq + 1 when empty."""
        return self._items[0].seq if self._items else self.base_seq + 1

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)

    def append(self, seq: int, crc: int, data: bytes) -> None:
        if seq != self.head_seq + 1:
            raise ValueError(f"batch {seq} appended after batch {self.head_seq}")
        self._items.append(Retained(seq, crc, data))
        self._bytes += len(data)
        while len(self._items) > 1 and (len(self._items) > self.max_batches or self._bytes > self.max_bytes):
            if self._pins and self._items[0].seq > min(self._pins.values()):
                if self._bytes <= self.pin_max_bytes:
                    break
                self._pins.clear()  # their backups find themselves behind the log: new snapshots
            gone = self._items.popleft()
            self._bytes -= len(gone.data)
            self.base_seq, self.base_crc = gone.seq, gone.crc
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def pin(self, owner: object, seq: int | None) -> None:
        """Keep the batches after ``seq`` for ``owner`` (None: release)."""
        if seq is None:
            self._pins.pop(owner, None)
        else:
            self._pins[owner] = seq

    def crc_of(self, seq: int) -> int | None:
        """Checksum of batch ``seq`` if the log can tell it (held, or the last one that left)."""
        if seq == self.base_seq:
            return self.base_crc
        index = seq - self.first_seq
        if 0 <= index < len(self._items):
            return self._items[index].crc
        return None

    def since(self, seq: int) -> Iterator[Retained]:
        """Batches after ``seq`` held now, in order (stops early if they leave meanwhile)."""
        while True:
            index = seq + 1 - self.first_seq
            if index < 0 or index >= len(self._items):
                return
            item = self._items[index]
            yield item
            seq = item.seq

    async def wait_beyond(self, seq: int) -> None:
        """Return once a batch after ``seq`` is in the log."""
        while self.head_seq <= seq:
            if self._changed is None:
                self._changed = asyncio.Event()
            await self._changed.wait()


PlanKind = Literal["log", "snapshot"]


@dataclass(frozen=True, slots=True)
class CatchUpPlan:
    """How to bring one backup up to date, and why (logged, and shown by inspect)."""

    kind: PlanKind
    from_seq: int
    """For "log": the backup's position (batches after it are sent). For "snapshot": 0."""
    reason: str


def plan_catch_up(
    log: RetainedLog, store_id: int, backup_store_id: int, backup_seq: int | None, backup_crc: int
) -> CatchUpPlan:
    """Decide between the retained log and a snapshot for a backup at (store, seq, crc).

    ``backup_seq`` None means the backup's store is half way through a snapshot.
    """
    head = log.head_seq
    if backup_seq is None:
        return CatchUpPlan("snapshot", 0, "the backup's store holds a half-applied snapshot")
    if backup_store_id != store_id:
        return CatchUpPlan(
            "snapshot", 0, f"the backup holds store {backup_store_id:#x}, not this primary's {store_id:#x}"
        )
    if backup_seq == 0:
        return CatchUpPlan("snapshot", 0, "the backup has never applied a batch")
    if backup_seq > head:
        return CatchUpPlan(
            "snapshot", 0, f"the backup is at batch {backup_seq}, past this primary's {head}: its history diverged"
        )
    known = log.crc_of(backup_seq)
    if known is None:
        return CatchUpPlan(
            "snapshot",
            0,
            f"the backup is at batch {backup_seq}, too far behind: the retained log starts at {log.first_seq}",
        )
    if known != backup_crc:
        return CatchUpPlan(
            "snapshot", 0, f"the backup's batch {backup_seq} differs from this primary's: its history diverged"
        )
    if backup_seq == head:
        return CatchUpPlan("log", backup_seq, f"the backup is up to date at batch {head}")
    return CatchUpPlan("log", backup_seq, f"the backup is {head - backup_seq} batches behind; sent from the log")
