"""The group commit's replication step on a primary (store.CommitReplication).

Each commit is numbered by the primary, written locally with its position op, then shipped.
In sync mode the commit's publishes are acknowledged (and its messages delivered) once every
in-sync backup confirmed it; in async mode at once, the batch following right after.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from .config import Mode
from .framing import Op
from .primary import PreparedBatch, Primary


class ReplicatedCommits:
    """``store.CommitReplication`` over one ``Primary``."""

    def __init__(self, primary: Primary, mode: Mode, may_acknowledge: Callable[[], bool]) -> None:
        self.primary = primary
        self.mode = mode
        self.may_acknowledge = may_acknowledge

    def prepare(self, ops: list[Op]) -> PreparedBatch:
        return self.primary.prepare(ops)

    def withdraw(self, batch: PreparedBatch) -> None:
        self.primary.withdraw(batch)

    def committed(self, batch: PreparedBatch) -> asyncio.Future[None] | None:
        shipped = self.primary.committed(batch)
        if self.mode == "sync":
            return shipped
        shipped.add_done_callback(_retrieve)  # async: nobody waits; a demotion fails it quietly
        return None


def _retrieve(future: asyncio.Future[None]) -> None:
    if not future.cancelled():
        future.exception()
