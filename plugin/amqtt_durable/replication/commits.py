"""The group commit's replication step on a primary (store.CommitReplication).

Each commit is numbered by the primary, written locally with its position op, then shipped.
In sync mode the commit's publishes are acknowledged (and its messages delivered) once every
in-sync backup confirmed it; in async mode at once, the batch following right after (with a
coordinator, once the new primary deleted the synchronous set an earlier one published).
"""

from __future__ import annotations

from collections.abc import Callable

from .config import Mode
from .framing import Op
from .primary import PreparedBatch, Primary, Shipped


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

    def committed(self, batch: PreparedBatch, then: Shipped) -> bool:
        """Ship the batch. Sync mode: True, and ``then`` gets the outcome once every in-sync backup
        has it (or never will); async mode: False, acknowledged now, the batch following right
        after (a demotion that fails it is nobody's concern), or True while the primary holds
        acknowledgements (``Primary.hold``)."""
        if self.mode == "sync":
            self.primary.ship(batch, then)
            return True
        self.primary.ship(batch, None)
        return self.primary.hold(then)
