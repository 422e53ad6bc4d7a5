"""Queue limits (Diffusion's max-depth for disconnected sessions) and the overflow decision."""

from __future__ import annotations

import enum

from .config import OverflowPolicy

REVERT_FRACTION = 0.8
"""After reconnect the expanded limit holds until the queue drains to this share of it."""


class Admission(enum.Enum):
    """What to do with one new message for a session queue."""

    ACCEPT = "accept"
    DROP_OLDEST_THEN_ACCEPT = "drop-oldest"
    REJECT = "drop-newest"


class QueueLimits:
    """Per-session limit state: normal while connected, expanded while (and after) disconnected.

    The expanded limit survives the reconnect until the backlog drains to 80 % of it, so a
    returning device is not punished for the queue it built up while away; reverting never
    purges messages, it only lowers the bar for new ones.
    """

    def __init__(self, max_depth: int, max_depth_disconnected: int, overflow: OverflowPolicy) -> None:
        self.max_depth = max_depth
        self.max_depth_disconnected = max_depth_disconnected
        self.overflow = overflow
        self.expanded = True

    def limit(self) -> int:
        return self.max_depth_disconnected if self.expanded else self.max_depth

    def on_disconnect(self) -> None:
        self.expanded = True

    def on_drained(self, depth: int, connected: bool) -> None:
        """Call after the queue shrank; reverts the limit once a connected backlog is down to 80 %."""
        if connected and self.expanded and depth <= REVERT_FRACTION * self.max_depth_disconnected:
            self.expanded = False

    def on_connect(self, depth: int) -> None:
        self.on_drained(depth, connected=True)

    def admit(self, depth: int) -> Admission:
        if depth < self.limit():
            return Admission.ACCEPT
        if self.overflow == "drop-oldest":
            return Admission.DROP_OLDEST_THEN_ACCEPT
        return Admission.REJECT
