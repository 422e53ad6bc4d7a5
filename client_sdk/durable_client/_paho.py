"""The one module that touches paho-mqtt: a small link object with our own types.

Why an adapter: paho's API carries callback-version shims and threading modes; the client
needs a dozen operations. Keeping paho here means a paho upgrade is checked in one file.

Threading: one thread (the client's network thread) calls ``open()`` and ``loop()``; paho
runs every callback on it. ``publish``, ``subscribe``, ``unsubscribe``, ``ack``, ``ack_many``,
``wake`` and ``disconnect`` may be called from any thread: they only queue a packet and wake the
network thread, which does every socket write. (Registering a socket-write callback is paho's
way for an external loop to say so; without it paho writes from the calling thread, racing the
loop.)

Speed (issue 13). paho reads a packet with three ``recv()`` calls (type, length, body) and one
packet per ``loop()``, each behind a ``select()``; it writes each PUBACK as a packet of its own,
with a wake-up byte through its socket pair. The link reads the socket in blocks of up to
``_READ_SIZE`` bytes instead (``_Reader``, installed as paho's ``_sock_recv``), parses every
packet a block holds in one ``loop()`` call, and ``ack_many`` queues a run of PUBACKs as one
write. These use paho internals (``_sock_recv``, ``_sock``, ``_packet_queue``, and
``_sockpairW`` for ``wake``), checked when the link is made: without them it falls back to
paho's own per-packet path.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

import paho.mqtt
import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode, MQTTProtocolVersion

from .errors import DurableClientError

log = logging.getLogger("durable_client")
_SERVER_UNAVAILABLE = 136
"""paho's reason code for MQTT 3.1.1's CONNACK return code 3."""
_READ_SIZE: Final = 65_536
"""Bytes asked of the socket per ``recv()``: every packet they hold is parsed before the next select()."""
_BURST: Final = 32
"""Packets parsed between two calls of ``on_burst`` (the client then sends its batched acknowledgements)."""
_MAX_PER_LOOP: Final = 1024
"""Packets parsed per ``loop()`` at most, so the caller's timers run between bursts of a fast sender."""
_PUBACK: Final = 0x40
_HELD: Final = mqtt.mqtt_ms_invalid
"""The state of a QoS 1/2 publish paho would re-send at CONNACK, held until the hello reply
(PahoLink.release_resends): paho's resend loop and its reconnect reset leave it alone or make it
``mqtt_ms_publish`` again."""
_IN_FLIGHT: Final = frozenset({
    mqtt.mqtt_ms_wait_for_puback, mqtt.mqtt_ms_wait_for_pubrec, mqtt.mqtt_ms_wait_for_pubcomp,
    mqtt.mqtt_ms_resend_pubrel,
})
"""The states paho counts in its in-flight number (a PUBLISH sent, or a PUBREL due, unacknowledged)."""
_PUBACK_BASE: Final = 0x4002_0000
"""A PUBACK is 4 bytes: 0x40, remaining length 2, the packet id (big-endian): one u32 per acknowledgement."""


PAHO_WRITTEN_FOR: Final = "paho-mqtt>=2.1.0,<2.3"
"""The releases whose internals below the link was written for (pyproject pins the same range)."""
_CLIENT_INTERNALS: Final = (
    "_out_message_mutex",
    "_out_messages",
    "_do_on_publish",
    "_check_clean_session",
    "_inflight_messages",
    "_max_inflight_messages",
    "_send_publish",
    "_update_inflight",
)
"""What ``open``, ``_hold_resends`` and ``release_resends`` use of a paho client: without them a re-sent
publish could overtake the hello reply or a PUBREL turn into a second PUBLISH, so there is no fallback."""


_FAST_PATH_INTERNALS: Final = ("_sock_recv", "_sock", "_packet_queue", "_sockpairW", "loop_read", "loop_misc")
"""What ``_Reader`` and ``wake`` use: without them the link falls back to paho's per-packet path."""


def check_paho(client: mqtt.Client) -> None:
    """Refuse, naming what is missing, a paho whose client lacks what the link needs: at ``connect()``,
    not at the first reconnect that would misbehave."""
    missing = [name for name in _CLIENT_INTERNALS if not hasattr(client, name)]
    if not hasattr(mqtt.MQTTMessageInfo, "_set_as_published"):
        missing.append("MQTTMessageInfo._set_as_published")
    if missing:
        version = getattr(paho.mqtt, "__version__", "of unknown version")
        raise DurableClientError(
            f"durable_client was written for {PAHO_WRITTEN_FOR}; the installed paho-mqtt {version} lacks "
            f"{', '.join(missing)}. Install it with pip install '{PAHO_WRITTEN_FOR}'."
        )


def topic_matches(topic_filter: str, topic: str) -> bool:
    """MQTT filter matching (``+``, ``#``), paho's implementation."""
    return mqtt.topic_matches_sub(topic_filter, topic)


class Inbound(NamedTuple):
    """One PUBLISH received (a named tuple: one is made per message)."""

    topic: str
    payload: bytes
    qos: int
    retain: bool
    dup: bool
    mid: int


@dataclass(frozen=True, slots=True)
class ConnAck:
    accepted: bool
    session_present: bool
    reason: str
    unavailable: bool = False
    """CONNACK 3, server unavailable: a replication backup (or a broker whose store cannot write,
    or that holds ``max_durable_sessions`` sessions and was asked for a new one)."""


class PublishHandle:
    """Completion of one publish: done when sent (QoS 0) or acknowledged (QoS 1/2)."""

    def __init__(self, info: mqtt.MQTTMessageInfo) -> None:
        self._info = info

    @property
    def queued(self) -> bool:
        """Whether paho took it over a live connection (MQTT_ERR_SUCCESS). False when it refused it
        (``refused``: nothing will send it), or the connection was down as it was handed over (at
        QoS 0 it is dropped; at QoS 1/2 paho keeps it and sends it after the reconnect)."""
        return self._info.rc == MQTTErrorCode.MQTT_ERR_SUCCESS

    @property
    def refused(self) -> bool:
        """paho did not keep it: its queue is full (max_queued_messages), or its packet id is still an
        unacknowledged publish's (65535 packet ids given out since: publishes at any QoS, control
        requests and SUBSCRIBE/UNSUBSCRIBE each take one); nothing will send it."""
        return self._info.rc == MQTTErrorCode.MQTT_ERR_QUEUE_SIZE

    @property
    def mid(self) -> int:
        return self._info.mid

    def is_for(self, info: mqtt.MQTTMessageInfo | None) -> bool:
        """Whether ``info`` is this publish's (a packet id is reused once its publish is done)."""
        return info is self._info

    @property
    def too_large(self) -> bool:
        """Dropped unsent after a reconnect: larger than the broker's max_packet_size (release_resends)."""
        return self._info.rc == MQTTErrorCode.MQTT_ERR_PAYLOAD_SIZE

    def wait(self, timeout: float) -> bool:
        """True once done (acknowledged, or dropped as ``too_large``); False after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        try:
            while not self._info.is_published():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._info.wait_for_publish(remaining)
        except RuntimeError:  # paho's word for a message with an error code
            if not self.too_large:
                raise
        return True


def publish_size(topic: str, payload_bytes: int, qos: int) -> int:
    """A PUBLISH's remaining length (what a broker's max_packet_size bounds): topic, packet id, payload."""
    return 2 + len(topic.encode("utf-8")) + (2 if qos else 0) + payload_bytes


class PahoLink:
    """A paho client driven by the caller's thread; reconnection is the caller's."""

    def __init__(
        self,
        client_id: str,
        host: str,
        port: int,
        *,
        keepalive: int,
        clean_session: bool,
        username: str | None,
        password: str | bytes | None,
        connect_timeout: float,
        on_connack: Callable[[ConnAck], None],
        on_message: Callable[[Inbound], None],
        on_lost: Callable[[str], None],
        on_subscribed: Callable[[int, bool], None],
        on_unsubscribed: Callable[[int], None] = lambda _mid: None,
        on_published: Callable[[int, mqtt.MQTTMessageInfo | None], None] = lambda _mid, _info: None,
        on_burst: Callable[[], None] = lambda: None,
    ) -> None:
        self._client = mqtt.Client(
            callback_api_version=CallbackAPIVersion.VERSION2,
            client_id=client_id,
            clean_session=clean_session,
            protocol=MQTTProtocolVersion.MQTTv311,
            reconnect_on_failure=False,  # paho must not reconnect (nor downgrade to 3.1) on its own
            manual_ack=True,
        )
        check_paho(self._client)
        self._client.manual_ack_set(True)
        # paho reports every lost socket as an ERROR; losing connections is routine here and the
        # client says so itself (a WARNING per loss), so paho's own lines go to DEBUG.
        paho_log = logging.getLogger("durable_client.paho")
        if paho_log.isEnabledFor(logging.DEBUG):  # paho formats a line per packet: only when asked for
            self._client.on_log = lambda _client, _userdata, _level, text: paho_log.debug("%s", text)
        self._client.connect_timeout = connect_timeout
        if username is not None:
            self._client.username_pw_set(username, password)  # type: ignore[arg-type]  # bytes sent as they are
        self._keepalive = keepalive
        self._client.connect_async(host, port, keepalive)
        self._client.on_socket_register_write = _noop_socket_callback
        self._client.on_socket_unregister_write = _noop_socket_callback
        self._on_burst = on_burst
        self._reader = _Reader(self._client)
        self._fast = self._reader.install()
        self._client.on_socket_open = self._socket_opened

        def connect_cb(_c: mqtt.Client, _u: Any, flags: mqtt.ConnectFlags, reason: Any, _p: Any) -> None:
            unavailable = reason.value == _SERVER_UNAVAILABLE
            if not reason.is_failure:
                self._hold_resends()
            on_connack(ConnAck(not reason.is_failure, bool(flags.session_present), str(reason), unavailable))

        def message_cb(_c: mqtt.Client, _u: Any, message: mqtt.MQTTMessage) -> None:
            try:
                topic = message.topic
            except UnicodeDecodeError:
                log.error("dropping a message whose topic is not UTF-8 (mid %d)", message.mid)
                self.ack(message.mid, message.qos)
                return
            payload = bytes(message.payload)  # paho gives bytes: not a copy
            on_message(Inbound(topic, payload, message.qos, bool(message.retain), bool(message.dup), message.mid))

        def disconnect_cb(_c: mqtt.Client, _u: Any, _flags: Any, reason: Any, _p: Any) -> None:
            on_lost(str(reason))

        def subscribe_cb(_c: mqtt.Client, _u: Any, mid: int, reasons: list[Any], _p: Any) -> None:
            on_subscribed(mid, not any(r.is_failure for r in reasons))

        def unsubscribe_cb(_c: mqtt.Client, _u: Any, mid: int, _reasons: Any, _p: Any) -> None:
            on_unsubscribed(mid)

        self._client.on_connect = connect_cb
        self._client.on_message = message_cb
        self._client.on_disconnect = disconnect_cb
        self._client.on_subscribe = subscribe_cb
        self._client.on_unsubscribe = unsubscribe_cb
        self._on_published = on_published
        self._acknowledge = self._client._do_on_publish
        self._client._do_on_publish = self._published  # type: ignore[method-assign,assignment]

    def _published(self, mid: int, reason: Any, properties: Any) -> MQTTErrorCode:
        """paho's handling of a PUBACK or PUBCOMP of a message it holds (under its lock of outgoing
        messages), told with the message's info first. Not paho's on_publish: that one it also calls
        at every QoS 0 write, which then cost twice the CPU (review 319)."""
        message = self._client._out_messages.get(mid)  # still there: paho pops it in _do_on_publish
        self._on_published(mid, message.info if message is not None else None)
        return self._acknowledge(mid, reason, properties)

    # ------------------------------------------------- network thread only
    def open(self) -> None:
        """Open the TCP connection and send CONNECT; OSError when the broker cannot be reached.

        A QoS 2 publish whose PUBREC came (the broker has it) stays one to send PUBREL for:
        paho resets its outgoing messages at every ``reconnect()``, refused attempts included,
        and its second reset turns "send PUBREL again" into "send the PUBLISH again" (which
        ``release_resends`` could then drop for its size though the broker has it).
        """
        client = self._client
        with client._out_message_mutex:
            released = [
                m for m in client._out_messages.values()
                if m.qos == 2 and m.state in (mqtt.mqtt_ms_wait_for_pubcomp, mqtt.mqtt_ms_resend_pubrel)
            ]
        try:
            client.reconnect()
        finally:
            if not client._check_clean_session():
                with client._out_message_mutex:
                    for message in released:
                        message.state = mqtt.mqtt_ms_resend_pubrel

    def retarget(self, host: str, port: int) -> None:
        """The next ``open`` connects to host:port (another broker of a replication group)."""
        self._client.connect_async(host, port, self._keepalive)

    def loop(self, timeout: float) -> None:
        """Wait up to ``timeout`` for traffic and process it (paho calls the callbacks here).

        Every packet already read from the socket is parsed in this call (up to
        ``_MAX_PER_LOOP``), with ``on_burst()`` after every ``_BURST`` of them and at the end.
        """
        client, reader = self._client, self._reader
        if reader.buffered:  # left over by the last call: no select(), the data is here
            rc = client.loop_read()
            client.loop_misc()
        else:
            rc = client.loop(timeout)
        count = 1
        while rc == MQTTErrorCode.MQTT_ERR_SUCCESS and count < _MAX_PER_LOOP:
            if reader.buffered:
                rc = client.loop_read()
            else:  # one more recv() costs less than a pass of the caller's loop and a select()
                reads = reader.reads
                rc = client.loop_read()
                if reader.reads == reads:
                    break  # nothing more to read now
            count += 1
            if not count % _BURST:
                self._on_burst()
        self._on_burst()
        if rc == MQTTErrorCode.MQTT_ERR_SUCCESS and client.want_write():
            rc = client.loop_write()
        if rc not in (MQTTErrorCode.MQTT_ERR_SUCCESS, MQTTErrorCode.MQTT_ERR_NO_CONN) and self.socket_open:
            # A few select() failures return an error without paho's connection-lost path:
            # make sure it runs, so on_lost fires and the caller reconnects.
            log.debug("paho loop returned %s with the socket open: dropping the connection", rc)
            self.drop()

    @property
    def socket_open(self) -> bool:
        return self._client.socket() is not None

    def _socket_opened(self, _client: mqtt.Client, _userdata: Any, sock: Any) -> None:
        self._reader.reset()
        _no_delay(sock)

    def _hold_resends(self) -> None:
        """(At CONNACK, before paho re-sends.) Hold the QoS 1/2 publishes paho would re-send now
        until the hello reply says the broker's max_packet_size: one larger than a broker restarted
        (or failed over) with a smaller limit would close every new connection, for ever."""
        client = self._client
        with client._out_message_mutex:
            for message in client._out_messages.values():
                if message.qos and message.state == mqtt.mqtt_ms_publish:
                    message.state = _HELD
            # A publish() landing before the hello reply must not overtake them: paho queues
            # it (unsent) while its in-flight count is at its maximum, until release_resends.
            client._inflight_messages = max(client._inflight_messages, client._max_inflight_messages)

    def release_resends(self, limit: int | None) -> list[tuple[str, int]]:
        """(Network thread, at the hello reply.) Send the held publishes again, in order, then those
        queued since (as far as paho's in-flight maximum allows); drop, and return as (topic, size),
        those held or queued larger than ``limit`` (None: none is)."""
        dropped: list[tuple[str, int]] = []
        client = self._client
        with client._out_message_mutex:
            client._inflight_messages = sum(
                1 for m in client._out_messages.values() if m.qos and m.state in _IN_FLIGHT
            )
            for message in list(client._out_messages.values()):
                held = message.state == _HELD
                if not (held or message.state == mqtt.mqtt_ms_queued):
                    continue
                size = publish_size(message.topic, len(message.payload), message.qos)
                if limit is not None and size > limit:
                    del client._out_messages[message.mid]
                    message.info.rc = MQTTErrorCode.MQTT_ERR_PAYLOAD_SIZE
                    message.info._set_as_published()  # wakes a publish() waiting for it: too_large
                    dropped.append((message.topic, size))
                elif held:
                    client._inflight_messages += 1
                    message.state = mqtt.mqtt_ms_wait_for_puback if message.qos == 1 else mqtt.mqtt_ms_wait_for_pubrec
                    client._send_publish(
                        message.mid, message.topic.encode("utf-8"), message.payload, message.qos, message.retain,
                        message.dup, properties=message.properties,
                    )
            client._update_inflight()  # paho's own step: the queued ones while in-flight room is left
        return dropped

    # ------------------------------------------------------ any thread
    def publish(
        self,
        topic: str,
        payload: bytes,
        qos: int,
        retain: bool = False,
        registered: Callable[[PublishHandle], None] | None = None,
    ) -> PublishHandle:
        """Hand the message to paho; ``registered(handle)`` runs before its PUBACK can be handled
        (under paho's lock of outgoing messages, which on_published's call holds too), unless paho
        ``refused`` it (a refused one's packet id may be a waiting publish's, whose record it would replace)."""
        if registered is None:
            return PublishHandle(self._client.publish(topic, payload, qos, retain))
        with self._client._out_message_mutex:
            handle = PublishHandle(self._client.publish(topic, payload, qos, retain))
            if not handle.refused:
                registered(handle)
        return handle

    def subscribe(self, topic_filter: str, qos: int) -> int | None:
        """The SUBSCRIBE's mid, or None when not connected."""
        rc, mid = self._client.subscribe(topic_filter, qos)
        return mid if rc == MQTTErrorCode.MQTT_ERR_SUCCESS else None

    def unsubscribe(self, topic_filter: str) -> int | None:
        """The UNSUBSCRIBE's mid, or None when not connected."""
        rc, mid = self._client.unsubscribe(topic_filter)
        return mid if rc == MQTTErrorCode.MQTT_ERR_SUCCESS else None

    def ack(self, mid: int, qos: int) -> None:
        if qos > 0:
            self._client.ack(mid, qos)

    def ack_many(self, mids: list[int]) -> None:
        """PUBACK each of ``mids`` (QoS 1), in order, as one write."""
        if not mids:
            return
        if not self._fast:
            for mid in mids:
                self._client.ack(mid, 1)
            return
        packet = struct.pack(f"!{len(mids)}I", *[_PUBACK_BASE | mid for mid in mids])
        self._client._packet_queue(_PUBACK, packet, 0, 0)

    def wake(self) -> None:
        """Make the network thread's ``loop()`` return now (another thread has work for it)."""
        pair = getattr(self._client, "_sockpairW", None)
        if pair is not None:
            with contextlib.suppress(OSError):
                pair.send(b"\0")

    def disconnect(self) -> None:
        """Send DISCONNECT (the broker keeps a durable session); the socket closes once it is written."""
        self._client.disconnect()

    def shutdown(self, timeout: float) -> None:
        """DISCONNECT, written within ``timeout`` if the link allows, then the socket is closed."""
        if not self.socket_open:
            return
        self._client.disconnect()
        deadline = time.monotonic() + timeout
        while self.socket_open and time.monotonic() < deadline:
            self.loop(0.05)
        if self.socket_open:
            self.drop()
            self.loop(0.0)  # paho reads end-of-stream and closes the socket

    def drop(self) -> None:
        """End the connection abruptly, without DISCONNECT: the broker re-sends what is unacknowledged.

        A shutdown (not a close) so paho's next read sees end-of-stream and takes its usual
        connection-lost path, calling ``on_lost`` on the network thread.
        """
        sock = self._client.socket()
        if not isinstance(sock, socket.socket):  # None, or a websocket wrapper (not used here)
            return
        with contextlib.suppress(OSError):  # already gone: paho notices on its own
            sock.shutdown(socket.SHUT_RDWR)


def _noop_socket_callback(_client: mqtt.Client, _userdata: Any, _sock: Any) -> None:
    return None


class _Reader:
    """paho's ``_sock_recv`` served from blocks of ``_READ_SIZE`` bytes (one ``recv()`` per block)."""

    __slots__ = ("_buf", "_client", "_pos", "reads")

    def __init__(self, client: mqtt.Client) -> None:
        self._client = client
        self._buf = b""
        self._pos = 0
        self.reads = 0
        """Blocks read from the socket (it changes when a ``recv()`` returned data or end of stream)."""

    def install(self) -> bool:
        """Take over paho's socket reads; False when this paho has not the internals needed."""
        if not all(hasattr(self._client, name) for name in _FAST_PATH_INTERNALS):
            log.warning("this paho-mqtt lacks the internals of the fast path: paho reads and acknowledges per packet")
            return False
        self._client._sock_recv = self.recv  # type: ignore[method-assign, assignment]
        return True

    @property
    def buffered(self) -> int:
        return len(self._buf) - self._pos

    def reset(self) -> None:
        """A new socket: what the old one left is not for it."""
        self._buf, self._pos = b"", 0

    def recv(self, size: int) -> bytes:
        buf, pos = self._buf, self._pos
        if pos >= len(buf):
            sock = self._client._sock
            if sock is None:
                raise ConnectionError("the socket is closed")
            buf = sock.recv(_READ_SIZE)  # BlockingIOError, OSError: paho's own handling; b"": end of stream
            self._buf, pos = buf, 0
            self.reads += 1
        end = pos + size
        if end >= len(buf):  # the rest of the block (paho asks again for what is missing)
            self._pos = len(buf)
            return buf[pos:] if pos else buf
        self._pos = end
        return buf[pos:end]


def _no_delay(sock: Any) -> None:
    """TCP_NODELAY: acknowledgements go out at once, not held back by Nagle's algorithm.

    Acknowledgements leave in small writes one after the other (a burst's PUBACKs, then a
    ``stream_ack``, or the next burst's); with Nagle the second and later wait for the TCP ACK
    of the first, which the broker's host may delay (40 ms on Linux): a stall per group with
    CPL-2, whose acknowledgements go after each group's fsync.
    """
    if isinstance(sock, socket.socket) and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
