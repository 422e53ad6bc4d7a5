"""What listeners and callbacks receive: plain frozen values, safe to keep and share across threads."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, TypeAlias

PersistenceLevel: TypeAlias = Literal["memory", "disk"]
"""Where the client keeps what it has processed (the stateless-client seed's CPL-1 / CPL-2).

``memory`` (CPL-1): exactly-once while the process lives; after a restart events processed
shortly before it may be delivered again. ``disk`` (CPL-2): exactly-once across restarts, the
marks fsynced once per group of events (docs/sdk.md, "CPL-2: group commit").
"""


@dataclass(frozen=True, slots=True)
class Event:
    """One message as a listener sees it.

    ``seq`` with ``epoch`` identifies a session event for good: a listener that keeps its own
    store can deduplicate on them. Raw events of a stateless connection have neither (0, 0).
    """

    topic: str
    payload: bytes
    """Byte for byte as published (the SDK frame is already removed)."""
    qos: int
    seq: int
    """Session queue position within ``epoch``, or the stream log id; 0 on a stateless connection."""
    epoch: int
    """The durable session's id (it changes when the session is lost); 0 for stream and raw events."""
    published_at: float
    """Unix time the broker received the publish (receipt time here for raw events)."""
    replayed: bool
    """Queued while the client was away or not yet ready: may be old news, so the cache skips it."""
    retained: bool
    """An initial value sent with a new subscription, not a new publish."""
    redelivered: bool
    """Sent before. Processed events are dropped by the marks, so a listener sees one again only when it
    was not processed (a listener raised) or the marks were lost (restart with persistence="memory")."""
    stream: bool
    """From a stream subscription (stateless resume) rather than the session queue."""


Listener: TypeAlias = Callable[[Event], None]
"""Called on the client's network thread, in arrival order. Raising asks for redelivery."""


class StreamBounds(dict[str, tuple[int, int]]):
    """stream_info's answer: {topic: (first retained id, last id)}, and the broker store's id."""

    def __init__(self, bounds: dict[str, tuple[int, int]], store: int | None) -> None:
        super().__init__(bounds)
        self.store = store
        """Random, made with the broker's store: a different one means another store (wiped or
        replaced), whose ids are not comparable with the ones seen before."""


@dataclass(frozen=True, slots=True)
class ConnectionInfo:
    """What the broker said when a connection (and its session) was set up."""

    session_present: bool
    """The broker still had this client's session: nothing was lost while away."""
    epoch: int | None
    """The durable session's id; None on a stateless connection."""
    session_expiry: float | None
    """Seconds the session outlives a disconnect, as granted; None for the broker's default."""


@dataclass(frozen=True, slots=True)
class Stats:
    """Counters since the client was created (a snapshot: read ``client.stats`` again for new values)."""

    received: int = 0
    """Events received (session, stream and raw), duplicates included."""
    processed: int = 0
    """Events whose listeners all returned."""
    duplicates_dropped: int = 0
    """Events at or below the processed mark: acknowledged without calling listeners."""
    redeliveries_requested: int = 0
    """Listener failures that made the client reconnect to get the event again."""
    reconnects: int = 0
    """Connections set up after the first one."""
