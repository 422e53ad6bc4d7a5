"""durable_client: the thin SDK for amqtt-durable brokers (see README, "The SDK").

Hold-until-ready, the replay marker, broker sequence ids, a last-value cache, exactly-once
through client-side persistence, and stateless resume from stream logs, over paho-mqtt.
The wire protocol is docs/protocol.md (``durable_protocol``, re-exported as ``durable_client.protocol``).
"""

from durable_protocol import LiveSubscription, Marker

from .async_client import AsyncDurableClient, EventStream
from .cache import CacheEntry, EntryState, LastValueCache
from .client import DurableClient
from .errors import (
    ConnectFailed,
    ControlRequestFailed,
    DurableClientError,
    EventNotProcessedError,
    PersistenceError,
    RequestTimeout,
    Unconnected,
    WrongTypeError,
)
from .events import ConnectionInfo, Event, Listener, PersistenceLevel, Stats, StreamBounds

__all__ = [
    "AsyncDurableClient",
    "CacheEntry",
    "ConnectFailed",
    "ConnectionInfo",
    "ControlRequestFailed",
    "DurableClient",
    "DurableClientError",
    "EntryState",
    "Event",
    "EventNotProcessedError",
    "EventStream",
    "LastValueCache",
    "Listener",
    "LiveSubscription",
    "Marker",
    "PersistenceError",
    "PersistenceLevel",
    "RequestTimeout",
    "Stats",
    "StreamBounds",
    "Unconnected",
    "WrongTypeError",
]
