"""Incoming messages -> listeners, cache and marks; says what to acknowledge. No network here.

The exactly-once rule (docs/protocol.md, "Frames"): session events carry (epoch, seq) and
arrive in seq order within an epoch. An event at or below the processed mark was processed
before (a redelivery after a reconnect or a restart): acknowledge it, skip the listeners.
Otherwise call the listeners; when they all return, record the mark, then acknowledge. The
order matters: a crash between the two leaves an unacknowledged event the broker re-sends
and the mark recognises. (With CPL-2 the client then holds the acknowledgement until the mark
is fsynced: ``_commit.py``.)

When a listener raises, the event is neither recorded nor acknowledged, and nothing after it
on this connection is processed: the client drops the connection, and the broker re-sends
everything unacknowledged (with DUP), starting at the failed event. Acknowledging later
events would lose the failed one (an MQTT acknowledgement cannot skip a message).

Stream events work the same with a (topic, log id) mark, acknowledged by ``stream_ack``.

Deferred processing (the asyncio client). With ``deferred`` set, the receiver does everything
up to the listeners (dedup, the event, the cache) and returns the event in ``Outcome.defer``
instead of calling them: another thread processes it later and then calls ``complete(event)``,
which is the second half of the same rule (the processed record, then the mark), before the
acknowledgement is sent. ``already_processed(event)`` is the dedup check again, for a copy
that arrived (after a reconnect) while the first was still waiting to be processed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from durable_protocol import FLAG_QOS_SHIFT as _QOS_SHIFT
from durable_protocol import FLAG_REDELIVERED as _REDELIVERED
from durable_protocol import FLAG_REPLAYED as _REPLAYED
from durable_protocol import FLAG_RETAINED as _RETAINED
from durable_protocol import (
    MARKER_TOPIC,
    REPLY_TOPIC,
    STREAM_TOPIC_PREFIX,
    Marker,
    ProtocolError,
    Reply,
    decode_frame_fields,
    decode_marker,
    decode_reply,
)

from ._paho import Inbound
from ._registry import Registry
from .cache import LastValueCache
from .errors import EventNotProcessedError
from .events import Event, Listener, Stats
from .persistence import SessionState

log = logging.getLogger("durable_client")

_SDK_PREFIX = "$durable/"


@dataclass(frozen=True, slots=True)
class Outcome:
    """What the caller sends back for one message."""

    ack: bool = False
    """Acknowledge the MQTT message (PUBACK/PUBCOMP; nothing for QoS 0): at once with CPL-1, once the
    mark is fsynced with CPL-2 (``_commit.py``)."""
    stream_ack: tuple[str, int] | None = None
    """Send ``stream_ack`` for (topic, id)."""
    reconnect: bool = False
    """Drop the connection so the broker re-sends what is unacknowledged."""
    defer: Event | None = None
    """Deferred mode: process this event elsewhere, ``complete()`` it, then send the acknowledgement."""


_IGNORE = Outcome()
_ACK = Outcome(ack=True)


class Handed(NamedTuple):
    """Deferred mode: one event (or duplicate's acknowledgement, or marker) for the processing side, in
    arrival order. ``event`` None and ``marker`` None: only acknowledge; ``marker``: the replay marker."""

    event: Event | None
    marker: Marker | None
    mid: int
    qos: int
    stream_ack: tuple[str, int] | None
    generation: int
    """The client's connection generation when it arrived: its acknowledgement is void on another."""


@dataclass(slots=True)
class Counters:
    received: int = 0
    processed: int = 0
    duplicates_dropped: int = 0
    redeliveries_requested: int = 0
    late_duplicates_dropped: int = 0
    """Copies the asyncio client's loop drops (processed since they arrived): counted apart,
    because ``duplicates_dropped`` is the network thread's and ``+=`` is not atomic across threads."""

    def snapshot(self, reconnects: int) -> Stats:
        dropped = self.duplicates_dropped + self.late_duplicates_dropped
        return Stats(self.received, self.processed, dropped, self.redeliveries_requested, reconnects)


class Receiver:
    """Handles one connection's messages in arrival order, on one thread."""

    def __init__(
        self,
        *,
        framed: bool,
        state: SessionState,
        cache: LastValueCache,
        registry: Registry,
        on_reply: Callable[[Reply], None],
        on_marker: Callable[[Marker], None],
        on_processed: Callable[[Event], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.framed = framed
        """Durable SDK session: every ordinary message carries a frame. False: stateless, raw messages."""
        self.counters = Counters()
        self._state = state
        self._cache = cache
        self._registry = registry
        self._on_reply = on_reply
        self._on_marker = on_marker
        self._on_processed = on_processed
        """Called once the listeners returned, before the mark and the ack (the delivery log)."""
        self._clock = clock
        self._failed = False
        self.deferred = False
        """Hand events back in ``Outcome.defer`` instead of calling the listeners (module docstring)."""
        self.marks_lock = threading.Lock()
        """Held while a mark is recorded, and by whoever resets the marks (a session lost or ended), so
        a late completion of an event of the old session does not bring its epoch back."""

    @property
    def failed(self) -> bool:
        """A listener raised on this connection: everything after it is ignored until the next one."""
        return self._failed

    def new_connection(self) -> None:
        self._failed = False

    def fail(self) -> None:
        """Stop processing this connection's messages (the caller drops it)."""
        self._failed = True

    def handle(self, message: Inbound) -> Outcome:
        if self._failed:
            return _IGNORE
        topic = message.topic
        if topic.startswith(_SDK_PREFIX):
            if topic == REPLY_TOPIC:
                return self._reply(message)
            if topic == MARKER_TOPIC:
                return self._marker(message)
            if topic.startswith(STREAM_TOPIC_PREFIX):
                return self._stream_event(message, topic[len(STREAM_TOPIC_PREFIX) :])
            log.warning("ignoring a message on %s: not a topic of protocol version 1", topic)
            return _ACK
        if self.framed:
            return self._session_event(message)
        return self._raw_event(message)

    # ---------------------------------------------------------- control
    def _reply(self, message: Inbound) -> Outcome:
        try:
            reply = decode_reply(message.payload)
        except ProtocolError as exc:
            log.error("ignoring a malformed reply from the broker: %s", exc.message)
            return _ACK
        self._on_reply(reply)
        return _ACK

    def _marker(self, message: Inbound) -> Outcome:
        try:
            marker = decode_marker(message.payload)
        except ProtocolError as exc:
            log.error("ignoring a malformed marker from the broker: %s", exc.message)
            return _ACK
        log.debug("marker: epoch %d, %d replayed (seq %s..%s)", marker.epoch, marker.replayed, marker.first_seq,
                  marker.last_seq)
        self._cache.marker()
        self._on_marker(marker)
        return _ACK

    # ----------------------------------------------------------- events
    def _session_event(self, message: Inbound) -> Outcome:
        try:
            flags, epoch, seq, published_at, payload = decode_frame_fields(message.payload)
        except ProtocolError as exc:
            # Not framed: the session was a plain one before this connection's hello took effect
            # (docs/protocol.md, "Without a hello ..."). Delivered raw rather than lost.
            log.warning(
                "a message on %s has no SDK frame (%s): delivered as it is, without duplicate check",
                message.topic, exc.message,
            )
            return self._raw_event(message)
        self.counters.received += 1
        if seq <= self._state.get_mark(epoch):
            self.counters.duplicates_dropped += 1
            return _ACK
        event = Event(
            message.topic, payload, message.qos, seq, epoch, published_at, bool(flags & _REPLAYED),
            bool(flags & _RETAINED), bool(flags & _REDELIVERED) or message.dup, False,
        )
        self._cache.apply(event)
        if self.deferred:
            return Outcome(ack=True, defer=event)
        if not self._deliver(event, self._registry.listeners(event.topic)):
            return Outcome(reconnect=True)
        self.complete(event)
        return _ACK

    def _stream_event(self, message: Inbound, topic: str) -> Outcome:
        try:
            flags, _epoch, seq, published_at, payload = decode_frame_fields(message.payload)
        except ProtocolError as exc:
            log.error("dropping a stream event on %s that has no valid SDK frame: %s", topic, exc.message)
            return _ACK
        self.counters.received += 1
        if seq <= self._state.position(topic):
            self.counters.duplicates_dropped += 1
            return Outcome(ack=True, stream_ack=(topic, seq))
        event = Event(
            topic, payload, (flags >> _QOS_SHIFT) & 0x03, seq, 0, published_at, bool(flags & _REPLAYED),
            bool(flags & _RETAINED), bool(flags & _REDELIVERED) or message.dup, True,
        )
        self._cache.apply(event)
        if self.deferred:
            return Outcome(ack=True, stream_ack=(topic, seq), defer=event)
        if not self._deliver(event, self._registry.stream_listeners(topic)):
            return Outcome(reconnect=True)
        self.complete(event)
        return Outcome(ack=True, stream_ack=(topic, seq))

    def _raw_event(self, message: Inbound) -> Outcome:
        """Stateless connection: no frame, no mark, no redelivery to ask for."""
        self.counters.received += 1
        event = Event(
            message.topic, message.payload, message.qos, 0, 0, self._clock(),
            False, message.retain, message.dup, False,
        )
        self._cache.apply(event)
        if self.deferred:
            return Outcome(ack=True, defer=event)
        self._deliver_once(event, self._registry.listeners(event.topic))
        self.complete(event)
        return _ACK

    @staticmethod
    def _deliver_once(event: Event, listeners: list[Listener]) -> None:
        """An event that cannot come again: every listener runs; one that raises is logged."""
        for listener in listeners:
            try:
                listener(event)
            except Exception:
                log.exception("a listener raised on %s (%s)", event.topic, not_redeliverable(event))

    # ------------------------------------------------------ processed
    def complete(self, event: Event, *, late: bool = False) -> None:
        """``event``'s listeners (or its deferred processing) finished: record it, then its mark.

        ``late``: deferred mode, called by the thread that processed the event, maybe after the
        network thread set up a new session; then a session event of another epoch than the
        state's (that session is gone) leaves the marks alone.
        """
        if self._on_processed is not None:
            self._on_processed(event)
        if event.stream:
            self._state.record_stream(event.topic, event.seq)
        elif not event.seq:  # a raw event has no mark
            pass
        elif not late:
            self._state.record(event.epoch, event.seq)
        else:
            with self.marks_lock:
                epoch = self._state.epoch
                if epoch is None or epoch == event.epoch:
                    self._state.record(event.epoch, event.seq)
        self.counters.processed += 1

    def already_processed(self, event: Event) -> bool:
        """The dedup rule again, for a deferred event about to be processed (any thread)."""
        if event.stream:
            return event.seq <= self._state.position(event.topic)
        return bool(event.seq) and event.seq <= self._state.get_mark(event.epoch)

    @staticmethod
    def redeliverable(event: Event) -> bool:
        """False for a raw event of a stateless connection, and for a session event delivered at
        QoS 0 (gone once sent, docs/sdk.md): a failure cannot get it again, so dropping the
        connection for it would only lose the QoS 0 events sent while the client reconnects."""
        return event.stream or (bool(event.seq) and event.qos > 0)

    def _deliver(self, event: Event, listeners: list[Listener]) -> bool:
        if not self.redeliverable(event):
            self._deliver_once(event, listeners)
            return True
        for listener in listeners:
            try:
                listener(event)
            except Exception as exc:
                self._failed = True
                self.counters.redeliveries_requested += 1
                if isinstance(exc, EventNotProcessedError):  # the async loop's verdict: expected, no traceback
                    log.info("%s: %s; reconnecting so the broker sends it again, and every event after it",
                             type(exc).__name__, exc)
                else:
                    log.exception(
                        "a listener raised on %s (seq %d, epoch %d): not acknowledged; reconnecting so the broker "
                        "sends it again, and every event after it",
                        event.topic, event.seq, event.epoch,
                    )
                return False
        return True


def not_redeliverable(event: Event) -> str:
    """Why a failed ``event`` is not asked for again (Receiver.redeliverable is False), for a log line."""
    if not event.seq:
        return "stateless connection: the event cannot be redelivered"
    return f"seq {event.seq}, epoch {event.epoch}, delivered at QoS 0: the event cannot be redelivered"
