"""Queue limits (Diffusion's max-depth for disconnected sessions) and the overflow decision."""

from __future__ import annotations

import enum

from .config import OverflowPolicy

REVERT_FRACTION = 0.8
"""After reconnect the expanded limits hold until the queue drains to this share of them."""


class Admission(enum.Enum):
    """What to do with one new message for a session queue."""

    ACCEPT = "accept"
    DROP_OLDEST = "drop-oldest"
    """Older messages are dropped to make room, then the new one is accepted."""
    DROP_NEWEST = "drop-newest"
    """The new message is dropped (overflow drop-newest, or no room can be made for it)."""


class QueueLimits:
    """Per-session limit state: normal while connected, expanded while (and after) disconnected.

    A queue is limited in messages and, optionally, in payload bytes (0: no byte limit). The
    expanded limits survive the reconnect until the backlog drains to 80 % of them, so a
    returning device is not punished for the queue it built up while away; reverting never
    purges messages, it only lowers the bar for new ones.
    """

    def __init__(
        self,
        max_depth: int,
        max_depth_disconnected: int,
        overflow: OverflowPolicy,
        max_bytes: int = 0,
        max_bytes_disconnected: int = 0,
    ) -> None:
        self.max_depth = max_depth
        self.max_depth_disconnected = max_depth_disconnected
        self.max_bytes = max_bytes
        self.max_bytes_disconnected = max_bytes_disconnected
        self.overflow = overflow
        self.expanded = True

    def limit(self) -> int:
        return self.max_depth_disconnected if self.expanded else self.max_depth

    def byte_limit(self) -> int:
        """The payload-byte limit now; 0 for none."""
        return self.max_bytes_disconnected if self.expanded else self.max_bytes

    def describe(self) -> str:
        """The limits now, for the overflow warning."""
        byte_limit = self.byte_limit()
        return f"{self.limit()} messages" + (f" / {byte_limit} bytes" if byte_limit else "")

    def on_disconnect(self) -> None:
        self.expanded = True

    def on_drained(self, depth: int, connected: bool, queued_bytes: int = 0) -> None:
        """Call after the queue shrank; reverts the limits once a connected backlog is down to 80 %
        of the expanded ones (in messages, and in bytes when there is a byte limit)."""
        if not (connected and self.expanded) or depth > REVERT_FRACTION * self.max_depth_disconnected:
            return
        if not self.max_bytes_disconnected or queued_bytes <= REVERT_FRACTION * self.max_bytes_disconnected:
            self.expanded = False

    def on_connect(self, depth: int, queued_bytes: int = 0) -> None:
        self.on_drained(depth, True, queued_bytes)

    def admit(self, depth: int, queued_bytes: int = 0, size: int = 0) -> Admission:
        """Decide for a new message of ``size`` payload bytes, the queue holding ``depth`` messages of
        ``queued_bytes`` bytes. A message larger than the byte limit itself never fits: dropped."""
        expanded = self.expanded
        byte_limit = self.max_bytes_disconnected if expanded else self.max_bytes
        limit = self.max_depth_disconnected if expanded else self.max_depth
        if depth < limit and (not byte_limit or queued_bytes + size <= byte_limit):
            return Admission.ACCEPT  # the path of every message: no method calls
        if self.overflow == "drop-oldest" and not (byte_limit and size > byte_limit):
            return Admission.DROP_OLDEST
        return Admission.DROP_NEWEST

    def room_made(self, queued_bytes: int, size: int, freed: int) -> bool:
        """After drop-oldest removed messages of ``freed`` bytes: may the new one go in now?

        One message out makes room for one in; under a byte limit, also its bytes must fit or as
        many have gone. So a queue above a lowered limit (reverted after a reconnect) shrinks by
        less than one message more than it grows: no mass purge.
        """
        byte_limit = self.byte_limit()
        return not byte_limit or queued_bytes + size <= byte_limit or freed >= size
