"""The one module that touches amqtt internals (written for amqtt 0.12.1, checked at start-up).

amqtt has no hook to persist a publish before PUBACK, nor one for per-session delivery, so
this module wraps a handful of Broker and BrokerProtocolHandler methods on the broker
instance the plugin is loaded into and on each connection's handler:

* ``BrokerProtocolHandler.init_from_connect`` (class-level): remembers the
  CONNECT's clean-session flag, which amqtt loses when it reuses a session object, and refuses
  (CONNACK 5), before amqtt touches anything, another user's CONNECT to a durable session, a
  will its user may not publish (topic ACL), and a CONNECT that fails authentication while
  amqtt holds a Session of its client id (amqtt would take its connection over and give it the
  CONNECT's will first), (CONNACK 3) a CONNECT that would create a durable session past
  ``max_durable_sessions``, and (CONNACK 2) a keep-alive ``max_keepalive`` does not allow; a
  CONNECT past ``max_packet_size`` is refused as amqtt's own errors are, so amqtt frees its
  listener slot;
* ``MQTTFixedHeader.from_stream`` (class-level): a first packet that is not a CONNECT, a first
  byte the server refuses (``_BAD_FIRST``: reserved type, server-only type, a second CONNECT,
  fixed header flags)
  and a packet past ``max_packet_size`` (readers without a limit: not checked) are refused
  before amqtt reads the body (CONNECT, and every packet on amqtt's own reader loop);
* ``PublishVariableHeader.from_stream`` (class-level): a PUBLISH topic no client may publish to
  ends the connection (amqtt skips a wildcard one and reads on out of step, and passes U+0000);
* ``Broker._authenticate``: a CONNECT already authenticated as it was read (see
  ``init_from_connect``) is not verified twice;
* ``Broker._create_server_instance``: a TCP or websocket listener is opened as amqtt opens it,
  with the ``listen_backlog`` setting as its listen backlog (amqtt's is asyncio's default, 100: in a
  reconnect storm of 1,000 clients the kernel dropped the SYNs of about half of them, which came
  back 1 and 2 s later; a much larger one slows the recovery from a connection flood), and a
  connection from an address with ``max_connections_per_address`` open is closed as it is
  accepted, on a TLS listener before its TLS handshake (``tcp_accepted``); a websocket
  listener's upgrade request from such an address is answered HTTP 503 (websockets'
  ``process_request``);
* ``Broker._client_connected``: every connection's socket is closed when it ends, whatever
  ended it (amqtt leaves the socket of a failed CONNECT to the garbage collector);
* ``Broker._initialize_client_session``: a connection gets ``connect_timeout`` seconds to send
  its whole CONNECT (and have it authenticated, when that is done as it is read); one closed
  then gets no CONNACK, and nothing of its CONNECT is acted on, even if its credentials pass later;
* ``BrokerProtocolHandler.handle_publish`` (per connection): route to durable sessions and
  wait for the group commit before PUBACK / PUBREC. A QoS 0/1 message goes to amqtt's own
  delivery when it has work (a clean-session subscriber, a plugin listening for messages), and the
  plugin sends PUBACK itself; a QoS 2 one is held in amqtt's Session (``inflight_in``) until its
  PUBREL, without amqtt's task waiting for it (``_await_pubrel``). A QoS 2 PUBLISH past
  ``max_awaiting_pubrel`` unreleased ones of the client (earlier connections' too) closes the
  connection (see ``AwaitingPubrel``);
* ``BrokerProtocolHandler.mqtt_connack_authorize``: create/wipe the stored session and set
  CONNACK's session-present from the store; refuse another user than the session's owner,
  and (CONNACK 3) any durable CONNECT while the store cannot write (a new durable session takes the
  place ``max_durable_sessions`` reserved for it as its CONNECT was read); a CONNECT refused by
  amqtt's own authentication leaves no Session in amqtt's table (``_forget_refused``);
* ``BrokerProtocolHandler.handle_puback`` / ``handle_pubrec`` / ``handle_pubcomp`` (per
  connection): acks of messages the pump sent are taken before amqtt's waiter lookup, and one
  nothing awaits is ignored with a WARNING at most once per ``drop_log_interval`` (amqtt's is per packet);
* ``BrokerProtocolHandler.handle_pubrel`` (per connection): the message held for it goes to
  amqtt's delivery in the task the reader makes of the PUBREL, or before a PUBLISH read after it
  is handled, whichever comes first (in the order they were read), a durable publisher's stored
  QoS 2 packet id is deleted before PUBCOMP, and a PUBREL with no message held still gets PUBCOMP;
* ``BrokerProtocolHandler.start`` / ``stop`` (per connection): a connection whose reader ended
  before amqtt's ``start`` made its disconnect waiter (a client that closed right after its
  CONNECT) still ends its message loop, and ``stop`` does not wait for a reader that never ran,
  nor, when amqtt takes the connection over for a newer durable CONNECT of its client id, for
  its client (a websocket's closing handshake: ``let_go``);
* ``BrokerProtocolHandler._retry_deliveries`` (per connection): the PUBRECs of a reconnecting
  publisher's QoS 2 publishes awaiting PUBREL are sent again, and nothing waits for the PUBRELs
  (amqtt waited up to 10 s in ``start``, see ``_retry_without_waiting_for_pubrel``);
* ``BrokerProtocolHandler.mqtt_deliver_next_message`` (per connection), with ``wait_disconnect``
  and ``stop``: the connection's end waits (bounded) until the message loop has taken what the
  client published (a QoS 2 message released with the DISCONNECT), and the loop's end hands what
  is left to the broker, a newer connection of the client id's loop waiting for that (see
  ``PublishedMessages``);
* ``BrokerProtocolHandler.handle_disconnect`` / ``wait_disconnect`` / ``handle_connection_closed``
  (per connection): a connection that sent DISCONNECT never has its will
  published (MQTT-3.14.4-3), however its DISCONNECT's handling and its message loop's wait for it
  fall, unless the server had already ended it (a protocol violation: then the will is published;
  see ``_keep_the_disconnect``);
* ``Broker._handle_disconnect``: the will published at a connection's abnormal end is the one
  its own CONNECT carried, not the one a later CONNECT of the client id gave the shared Session
  (see ``handle_disconnect``); amqtt's Session of a client id without a durable session (ended
  while connected) is removed then, and that of an expired one at its expiry (``forget_session``);
* ``Broker._delete_session``: a clean CONNECT of a client id whose connection is live ends that
  connection (MQTT-3.1.4-2; amqtt deleted its Session and left it open), without waiting for its
  client (a websocket's closing handshake: ``let_go``); what its client published and the broker
  acknowledged, still waiting for its message loop, is kept for that loop's end to hand over
  (amqtt emptied the queue), before what the new connection publishes (``PublishedMessages.follow``);
* ``ProtocolHandler._reader_loop`` (per TCP connection): a reader that handles QoS 0/1
  PUBLISH, acks and PINGREQ inline instead of amqtt's task per packet, and reads nothing more
  while the requests under way pass a bound (see ``FastReader``);
* ``BrokerProtocolHandler.handle_subscribe`` / ``handle_unsubscribe`` /
  ``get_next_pending_subscription`` / ``get_next_pending_unsubscription`` (per connection), with
  ``wait_disconnect`` and ``stop``: a connection's SUBSCRIBEs and UNSUBSCRIBEs share one queue
  (``SubscriptionChanges``), taken in arrival order by the message loop's subscription waiter
  (MQTT 3.1.1 section 4.6, 3.10.4), and the connection's end (DISCONNECT, EOF, reset, a
  take-over) waits until all are applied (see ``_one_queue_of_subscription_changes``);
* ``Broker._client_message_loop``: attach the session's delivery pump for the connection's
  lifetime, and end a connection whose client id a later CONNECT took (amqtt misses the case
  of two CONNECTs read at the same time);
* ``Broker.add_subscription`` / ``_handle_subscription`` / ``_handle_unsubscription``: durable
  sessions' subscriptions live in the store, not in amqtt's table, so amqtt never delivers to
  them itself; an UNSUBSCRIBE the shared queue hands to ``_handle_subscription`` is passed on
  to ``_handle_unsubscription``; a SUBSCRIBE or UNSUBSCRIBE of a durable session is stored by one commit for all
  its filters (amqtt's way, a commit per filter, made a packet of n filters cost n record writes);
  both kinds obey ``max_subscriptions_per_client``; a clean session's repeated SUBSCRIBE of a
  filter replaces the QoS of its entry in amqtt's table (amqtt kept the first, MQTT-3.8.4-3);
* ``Broker._del_subscription`` (with ``add_subscription``): keeps a trie mirror of amqtt's own
  table (clean sessions' filters), so that asking "does amqtt have a subscriber for this
  topic?" on every publish does not cost a match per filter;
* ``Broker._del_all_subscriptions``: removes the session's own filters (from the mirror)
  instead of trying every filter of the table, at every session's end;
* ``Broker._run_broadcast``: amqtt's delivery to its own subscribers, visiting only the filters
  the mirror says match instead of matching every filter of the table per message, with what
  waits to be sent to each connection bounded (``max_pending_clean``, see ``CleanSends``);
* ``Broker._publish_retained_messages_for_subscription``: retained messages go through the
  session queue, queued by ``add_subscription`` together with the subscription; a clean
  session gets those of its own filters only (amqtt sends, on every CONNECT, those matching
  any filter of its table), and only those it may receive (amqtt checks no RECEIVE there);
* ``Broker._retained_messages``: amqtt's retained table becomes a ``RetainedTable``, a mapping
  that keeps a trie of its topics in step with every change (whoever makes it), so that the
  retained messages of a filter are found by walking the matching branches instead of matching
  every retained message per filter (a SUBSCRIBE of 500 filters against 50,000 retained topics
  held the event loop for seconds);
* ``Broker._broadcast_message``: wills and broker-internal messages ($SYS) reach durable
  sessions too;
* ``Broker._cleanup_session`` (with ``shutdown``): amqtt's session monitor must not remove a
  session that reconnected after the monitor picked it;
* ``Session._init_states`` (class-level): every Session gets ``SessionStates``, the same three-state
  machine as amqtt's, in a few attribute assignments instead of a ``transitions.Machine`` built per
  Session (about 0.6 ms; amqtt builds one per CONNECT, even a reconnect whose cached Session it then
  uses: over 40% of the CPU of a reconnect storm's CONNECT handling, see bench/PROFILE-replay.md);
* ``Broker.retain_message``: nothing under ``_durable/`` (the SDK's control topics) is ever
  retained, not even a will; a publish's retain is stored by the engine with the publish
  (``route_publish(retain=...)``), and a will's (or a plugin's) here, so every retained message
  is in the store. amqtt's ``retained_messages`` table follows the store (``on_retained``) and
  is filled from it at start-up (``on_broker_pre_start``), after amqtt's start emptied it.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import contextvars
import dataclasses
import fcntl
import json
import logging
import math
import ssl
import termios
import time
from asyncio.sslproto import _SSLProtocolTransport
from collections import UserDict, deque
from collections.abc import Awaitable, Callable, Coroutine
from functools import partial
from http import HTTPStatus
from typing import Any, NoReturn

import amqtt
import websockets
from amqtt.adapters import BufferReader, StreamReaderAdapter, StreamWriterAdapter, WebSocketsWriter
from amqtt.broker import Broker, BrokerContext, RetainedApplicationMessage
from amqtt.codecs_amqtt import decode_packet_id, read_or_raise
from amqtt.contexts import Action, ListenerType
from amqtt.errors import AMQTTError, BrokerError, MQTTError, NoDataError, ProtocolHandlerError, ZeroLengthReadError
from amqtt.events import BrokerEvents, MQTTEvents
from amqtt.mqtt import packet_class
from amqtt.mqtt import subscribe as amqtt_subscribe
from amqtt.mqtt import unsubscribe as amqtt_unsubscribe
from amqtt.mqtt.connack import IDENTIFIER_REJECTED, NOT_AUTHORIZED, SERVER_UNAVAILABLE, ConnackPacket
from amqtt.mqtt.constants import QOS_1, QOS_2
from amqtt.mqtt.disconnect import DisconnectPacket
from amqtt.mqtt.packet import (
    CONNACK,
    CONNECT,
    DISCONNECT,
    PINGREQ,
    PINGRESP,
    PUBACK,
    PUBCOMP,
    PUBLISH,
    PUBREC,
    PUBREL,
    RESERVED_0,
    RESERVED_15,
    SUBACK,
    SUBSCRIBE,
    UNSUBACK,
    UNSUBSCRIBE,
    MQTTFixedHeader,
)
from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler, Subscription, UnSubscription
from amqtt.mqtt.publish import PublishPacket, PublishVariableHeader
from amqtt.plugins.base import BasePlugin
from amqtt.session import IncomingApplicationMessage, OutgoingApplicationMessage, Session
from transitions import MachineError
from websockets.exceptions import ConnectionClosed
from websockets.protocol import State as WebsocketState

from durable_protocol import CONTROL_PREFIX, filter_is_valid

from .admission import AddressConnections, KeepAliveLimit, LogBudget, Reservation
from .config import DurableConfig
from .control import ControlChannel
from .delivery import AckKind, AckRuns, ReadAccess
from .engine import DurableEngine, ExpiredSession, StoreHealth
from .errors import (
    BrokerNotStartedError,
    DurableError,
    InternalsMismatchError,
    NotPrimaryError,
    NotSessionOwnerError,
    PacketTooLargeError,
    ProtocolViolationError,
    SessionLimitError,
    StoreError,
    StoreUnavailableError,
    os_error_reason,
)
from .replication.commits import ReplicatedCommits
from .replication.etcd import EtcdCoordinator
from .replication.node import ReplicationNode
from .replication.primary import Primary
from .retained_acks import RetainedAcks
from .settings import socket_backlog
from .silence import SilenceWatch
from .stream_sender import StreamSender
from .subscription_changes import SubscriptionChanges
from .topics import SubscriptionIndex, TopicIndex, topic_problem
from .wire import PacketReader, encode_puback, encode_pubcomp, encode_pubrec, encode_pubrel

log = logging.getLogger("amqtt_durable")

AMQTT_VERSION = "0.12.1"
SYS_PREFIX = "$SYS/broker/durable/"
HEALTH_TOPIC = SYS_PREFIX + "store/health"
NOT_SERVING = "this broker is a replication backup (or stopped being the primary): connect to the primary"
_SUBSCRIBE_REFUSED = 0x80
PACKET_ID_0 = "its packet identifier is 0 (MQTT-2.3.1-1)"
TOPIC_PAST_END = "PUBLISH refused: its topic length runs past the packet's end (MQTT-1.5.3)"
CLOSE_GRACE = 5.0
"""Seconds a closed connection's unsent bytes (a refusing CONNACK) get before the socket is aborted."""
_BROKER_INTERNALS = (
    "_authenticate",
    "_client_connected",
    "_create_server_instance",
    "stream_connected",
    "ws_connected",
    "_initialize_client_session",
    "_client_message_loop",
    "_handle_subscription",
    "_handle_unsubscription",
    "_publish_retained_messages_for_subscription",
    "_broadcast_message",
    "_handle_disconnect",
    "_handle_message_delivery",
    "_delete_session",
    "_topic_filtering",
    "add_subscription",
    "retained_messages",
    "_retained_messages",
    "_subscriptions",
    "_del_all_subscriptions",
    "_del_subscription",
    "_run_broadcast",
    "_broadcast_queue",
    "_retain_broadcast_message",
    "_get_handler",
    "_cleanup_session",
    "_sessions",
    "shutdown",
    "retain_message",
)
_HANDLER_INTERNALS = (
    "init_from_connect",
    "handle_publish",
    "mqtt_connack_authorize",
    "mqtt_acknowledge_subscription",
    "mqtt_acknowledge_unsubscription",
    "handle_puback",
    "handle_pubrec",
    "handle_pubcomp",
    "handle_pubrel",
    "_send_packet",
    "mqtt_publish",
    "start",
    "stop",
    "_retry_deliveries",
    "_handle_message_flow",
    "handle_disconnect",
    "handle_connection_closed",
    "wait_disconnect",
    "handle_subscribe",
    "handle_unsubscribe",
    "get_next_pending_subscription",
    "get_next_pending_unsubscription",
)
_SESSION_INTERNALS = ("_init_states", "_on_enter_connected", "_on_enter_disconnected")

_ACK_KINDS: dict[int, AckKind] = {PUBACK: "puback", PUBREC: "pubrec", PUBCOMP: "pubcomp"}
READ_SIZE = 1 << 16
"""Bytes FastReader asks the socket for at a time."""
SILENT = "%s: nothing received for 1.5 keep-alive periods: disconnecting"
"""Logged (INFO) when MQTT-3.1.2-24 ends a connection, on either reader loop."""
PINGRESP_PACKET = bytes((PINGRESP << 4, 0))
"""A PINGRESP, which FastReader writes itself (with the acks) while the write side has room."""
MAX_UNDER_WAY = 256
"""Packets of one connection the plugin's reader hands to amqtt's handlers (a task each: SUBSCRIBE,
UNSUBSCRIBE, PUBREL, QoS 2 PUBLISH, a PINGREQ read while the write buffer is full, ...) not yet
done, or SUBSCRIBEs / UNSUBSCRIBEs waiting for the message loop, at which it reads nothing more
while its client reads its answers slower than they are written, until it reads or half that are
done (FastReader._room)."""
MAX_UNDER_WAY_READ = 4096
"""MAX_UNDER_WAY for a client that reads its answers, which is answered at the pace its requests
are handled: the bound only caps what they hold."""
UNREAD = (
    "%s: no answer read, no packet handled, no SUBSCRIBE/UNSUBSCRIBE applied for 1.5 keep-alive periods"
    " while its reader waits for it: disconnecting"
)
"""Logged (INFO) when FastReader._room ends a connection (the will is published)."""
PROGRESS_CHECKS = 8
"""Times in each 1.5 keep-alive periods a paused reader looks whether its connection got on (``_room``)."""
PAUSED = "reading from %s paused: %s%s"
"""Logged (INFO, at most once per ``drop_log_interval`` per connection) as FastReader waits."""
UNACKED = "%s: no %s for the message of packet id %d came within 5 s of its write: not awaited any more%s"
"""Logged (WARNING, at most once per ``drop_log_interval`` per connection) as ``RetainedAcks`` gives up a
wait, on amqtt's own reader loop only (on FastReader's a wait ends with its ack or the connection)."""
NO_ID = "%s: %d %s message(s) not sent (the first on %r): 65,535 messages to it await their acks%s"
"""Logged (WARNING, at most once per ``drop_log_interval`` per connection, with UNACKED): no packet id is free."""
_SETTLED_AT_EOF = frozenset((SUBSCRIBE, UNSUBSCRIBE, DISCONNECT))
"""Packet types whose handling a connection's end waits for (FastReader.run): they need nothing more
from the peer."""
_FIXED_FLAGS = {PUBREL: 0x02, SUBSCRIBE: 0x02, UNSUBSCRIBE: 0x02}
"""MQTT-2.2.2-1: the fixed header flags of every packet type but PUBLISH (0 where not listed);
any other value is malformed and the connection is closed (MQTT-2.2.2-2, MQTT-3.6.1-1,
MQTT-3.8.1-1, MQTT-3.10.1-1)."""


_CLIENT_BOUND = {CONNACK: "CONNACK", SUBACK: "SUBACK", UNSUBACK: "UNSUBACK", PINGRESP: "PINGRESP"}
"""Packet types only a server sends (MQTT 3.1.1 section 2.2.1): one sent to the server is a
protocol violation (section 4.8), and the connection is closed (amqtt ignored them)."""


def _refused_at_server(first: int) -> bool:
    """Whether the server refuses a packet of this first byte once the connection's CONNECT was
    read: a reserved type (0 or 15), a type only a server sends, a CONNECT (MQTT-3.1.0-2), or fixed
    header flags other than MQTT 3.1.1 gives its type (PUBLISH's are its own)."""
    packet_type = first >> 4
    if packet_type in (RESERVED_0, RESERVED_15, CONNECT) or packet_type in _CLIENT_BOUND:
        return True
    return packet_type != PUBLISH and first & 0x0F != _FIXED_FLAGS.get(packet_type, 0)


_BAD_FIRST = tuple(_refused_at_server(first) for first in range(256))
"""Indexed by the first byte of a packet sent to the server after its CONNECT: True where it is
refused (reserved type, server-only type, a second CONNECT, or fixed header flags). One tuple index
(5-25 ns) where computing the flags
check took 120-440 ns a packet (bench/bench_fixed_flags.py). Only for a broker connection's reader:
amqtt's own client in the same process reads CONNACK, SUBACK and PINGRESP through the same code."""


SECOND_CONNECT = "a second CONNECT on the connection (MQTT-3.1.0-2)"


def first_byte_refusal(first: int) -> ProtocolViolationError:
    """Why a packet whose first byte ``_BAD_FIRST`` marks is refused."""
    packet_type, flags = first >> 4, first & 0x0F
    if packet_type in (RESERVED_0, RESERVED_15):
        return ProtocolViolationError(f"packet type {packet_type} is reserved (MQTT 3.1.1 section 2.2.1)")
    if packet_type in _CLIENT_BOUND:
        name = _CLIENT_BOUND[packet_type]
        return ProtocolViolationError(
            f"packet type {packet_type} ({name}) is sent by servers only (MQTT 3.1.1 section 4.8)"
        )
    if packet_type == CONNECT and not flags:
        return ProtocolViolationError(SECOND_CONNECT)
    required = _FIXED_FLAGS.get(packet_type, 0)
    return ProtocolViolationError(
        f"packet type {packet_type} with fixed header flags {flags:#06b}, not {required:#06b} (MQTT-2.2.2-2)"
    )


_HANDLERS = {
    CONNACK: "handle_connack",
    SUBSCRIBE: "handle_subscribe",
    UNSUBSCRIBE: "handle_unsubscribe",
    SUBACK: "handle_suback",
    UNSUBACK: "handle_unsuback",
    PUBACK: "handle_puback",
    PUBREC: "handle_pubrec",
    PUBREL: "handle_pubrel",
    PUBCOMP: "handle_pubcomp",
    PINGREQ: "handle_pingreq",
    PINGRESP: "handle_pingresp",
    PUBLISH: "handle_publish",
    DISCONNECT: "handle_disconnect",
}


@dataclasses.dataclass(frozen=True)
class ConnectionWill:
    """The will of one connection's CONNECT (``topic`` None: none). amqtt keeps only the Session's,
    which a later CONNECT of the same client id overwrites (see ``handle_disconnect``)."""

    topic: str | None
    message: bytes | None
    qos: int | None
    retain: bool

    @classmethod
    def of(cls, session: Any) -> ConnectionWill:
        if not session.will_flag:
            return cls(None, None, None, retain=False)
        return cls(session.will_topic, session.will_message, session.will_qos, retain=bool(session.will_retain))


class RoutedPayload(bytes):
    """A payload already queued for durable sessions, so the broadcast does not queue it twice.
    ``qos``: its publish's QoS, the most amqtt's delivery may give a clean subscriber (MQTT-3.8.4-6;
    amqtt 0.12.1 sent every message at the subscription's QoS). Made by ``routed``."""

    __slots__ = ()
    qos = QOS_2


class _RoutedQos0(RoutedPayload):
    __slots__ = ()
    qos = 0


class _RoutedQos1(RoutedPayload):
    __slots__ = ()
    qos = QOS_1


_ROUTED: dict[int, type[RoutedPayload]] = {0: _RoutedQos0, QOS_1: _RoutedQos1, QOS_2: RoutedPayload}


def routed(payload: bytes | bytearray, qos: int) -> RoutedPayload:
    """``payload`` marked as queued for durable sessions, published at ``qos``."""
    return _ROUTED[qos](payload)


class SessionStates:
    """What amqtt's ``Session._init_states`` builds as ``session.transitions``, without the
    ``transitions`` library: the states new, connected and disconnected; ``connect()`` from new or
    disconnected (anything else raises MachineError, which amqtt's take-over relies on),
    ``disconnect()`` from any state, each entering its state through the Session's
    ``_on_enter_*`` callback (also disconnected -> disconnected, as a reflexive transition
    does); ``state`` and the ``is_<state>()`` checks. That is all amqtt 0.12.1 (broker and
    client) and this module use of it."""

    __slots__ = ("_session", "state")

    def __init__(self, session: Session) -> None:
        self._session = session
        self.state = "new"

    def connect(self) -> bool:
        if self.state == "connected":
            raise MachineError("Can't trigger event connect from state connected!")
        self.state = "connected"
        self._session._on_enter_connected()
        return True

    def disconnect(self) -> bool:
        self.state = "disconnected"
        self._session._on_enter_disconnected()
        return True

    def is_new(self) -> bool:
        return self.state == "new"

    def is_connected(self) -> bool:
        return self.state == "connected"

    def is_disconnected(self) -> bool:
        return self.state == "disconnected"


AMQTT_INIT_STATES = Session._init_states
"""amqtt's own, kept as the reference SessionStates must behave as (tests/unit/test_session_states.py)."""


def _init_session_states(session: Session) -> None:
    session.transitions = SessionStates(session)


def _install_session_states() -> None:
    """Every Session made from now on (each CONNECT makes one) gets SessionStates."""
    Session._init_states = _init_session_states


def _install_connect_hooks() -> None:
    """Right after a CONNECT is read: keep its clean-session flag (amqtt reuses a cached Session on
    reconnect without updating it), and refuse, while amqtt has touched nothing yet, another user
    than the owner of the client id's durable session, a will the topic ACL does not let the
    user publish (amqtt would publish and retain it unchecked), and a CONNECT that fails
    authentication while amqtt holds a Session of its client id: amqtt would first give that
    Session the CONNECT's will (or delete it, clean) and take its connection over, and only then
    check the password (a CONNECT that would create a durable session is authenticated here too,
    before it reserves a place). The owner is checked again once the CONNECT's turn comes
    (``_take_connect_turn``), and by connack_authorize, authoritatively."""
    original = BrokerProtocolHandler.init_from_connect
    if getattr(original, "_durable_wrapped", False):
        return

    async def init_from_connect(reader: Any, writer: Any, plugins_manager: Any, *args: Any) -> tuple[Any, Any]:
        reader.durable_awaiting_connect = True  # the decoder checks refuse a first packet not a CONNECT
        reader.durable_server_side = True  # and first bytes a server refuses (not on a client's reader)
        try:
            handler, session = await original(reader, writer, plugins_manager, *args)
        except ProtocolViolationError as exc:  # as an MQTTError, so amqtt closes it and frees its listener slot
            # Not a CONNECT, too large, or fixed header flags MQTT does not allow: no client id yet,
            # so the address.
            log.warning("closing a connection from %s before its CONNECT was read: %s", _peer(writer), exc)
            raise MQTTError(str(exc)) from None
        except ConnectionError as exc:  # amqtt catches no OSError here: its listener slot would stay taken
            await close_socket(writer)
            raise MQTTError(f"the connection ended while its CONNECT was read: {exc!r}") from None
        handler.connect_clean_session = bool(session.clean_session)
        handler.durable_will = ConnectionWill.of(session)
        problem = _will_problem(session)
        if problem is not None:  # amqtt's caller logs it and closes the connection
            raise MQTTError(f"CONNECT of {session.client_id!r} refused: {problem}")
        plugin = next((p for p in plugins_manager._plugins if isinstance(p, DurableSessionsPlugin)), None)
        if plugin is not None and not plugin.engine.serving:
            log.debug("CONNECT of %r refused (CONNACK 3): %s", session.client_id, NOT_SERVING)  # routine on a backup
            _ROUTINE_REFUSAL.set(True)  # amqtt's own WARNINGs about this connection become DEBUG
            await _refuse_read_connect(writer, plugins_manager, SERVER_UNAVAILABLE)
            raise MQTTError(f"CONNECT of {session.client_id!r}: {NOT_SERVING}")
        if plugin is not None:
            await _check_keepalive(plugin.keepalive_limit, session, writer, plugins_manager)
        if plugin is None or not session.client_id:
            return handler, session
        try:
            checked = await _check_connect(plugin, session, writer, plugins_manager)
            await _take_connect_turn(plugin, session, writer, plugins_manager, checked=checked)
        except MQTTError:
            _end_connect_turn(writer)
            _release_reservation(plugin.engine, writer)  # a refused CONNECT's place is free at once
            raise
        return handler, session

    init_from_connect._durable_wrapped = True  # type: ignore[attr-defined]
    BrokerProtocolHandler.init_from_connect = staticmethod(init_from_connect)


async def _check_keepalive(limit: KeepAliveLimit, session: Any, writer: Any, plugins_manager: Any) -> None:
    """``max_keepalive``: a keep-alive it does not allow gets CONNACK 2 (identifier rejected, as
    Mosquitto 2 answers MQTT 3.1.1 clients), before amqtt touches anything; raises MQTTError."""
    if limit.admits(session.keep_alive):
        return
    _ROUTINE_REFUSAL.set(True)  # amqtt's own two WARNINGs become DEBUG: ours is rate-limited
    why = limit.refusal(session.client_id, session.keep_alive)
    if why is not None:
        log.warning("%s", why)
    await _refuse_read_connect(writer, plugins_manager, IDENTIFIER_REJECTED)
    raise MQTTError(f"CONNECT of {session.client_id!r}: keep-alive {session.keep_alive} s refused (max_keepalive)")


def _will_problem(session: Any) -> str | None:
    """What is wrong with the will of a CONNECT just read (its Session), or None: a topic no client
    may publish to, a will QoS of 3 (MQTT-3.1.2-14), or a will QoS or retain flag without a will
    (MQTT-3.1.2-13/15); amqtt took all three."""
    if not session.will_flag:
        if session.will_qos or session.will_retain:
            return "will QoS or retain flag set without a will flag (MQTT-3.1.2-13, MQTT-3.1.2-15)"
        return None
    if session.will_qos not in (0, 1, 2):
        return f"will QoS {session.will_qos} (MQTT-3.1.2-14)"
    problem = publish_topic_problem(session.will_topic or "")
    return None if problem is None else f"its will topic: {problem}"


async def _check_connect(plugin: DurableSessionsPlugin, session: Any, writer: Any, plugins_manager: Any) -> bool:
    """The checks of a CONNECT that must come before amqtt touches anything (see
    _install_connect_hooks): amqtt ends a live connection of the client id (a take-over, or our
    delete_session for a clean CONNECT) before the CONNACK, and MQTT 3.1.4 has that happen only
    for a CONNECT that is accepted. A refusal sends CONNACK 5 (CONNACK 3 while the store cannot
    write and the CONNECT needs a write, or when it would create a durable session past
    ``max_durable_sessions``, once its owner, will topic and credentials passed: a wrong password
    gets 5 then too, and tells nothing of the store; CONNACK 3 too when its credentials could not be
    checked, ``_credentials_pass``) and raises MQTTError. A CONNECT that would
    create a durable session is authenticated here (amqtt is told, ``_authenticated``), so one whose
    credentials are slow to check or fail holds no place meanwhile: the place is reserved after
    the last await. One whose connection was closed at ``connect_timeout`` meanwhile raises
    MQTTError after that await, with no CONNACK, whatever its credentials."""
    await _check_owner(plugin, session, writer, plugins_manager)
    unwritable: StoreUnavailableError | None = None
    try:
        plugin.engine.check_writable_for(session.client_id, bool(session.clean_session))
    except StoreUnavailableError as exc:
        unwritable = exc
    durable_new = not session.clean_session and unwritable is None and not plugin.engine.is_durable(session.client_id)
    broker = plugin.broker
    await _check_will_topic(broker, session, writer, plugins_manager)
    taken_over = session.client_id in broker._sessions
    checked = taken_over or unwritable is not None or durable_new
    authentic = not checked or await _credentials_pass(plugin, session, writer, plugins_manager)
    if _timed_out(writer):  # after the last await: nothing of a CONNECT closed at connect_timeout is acted on
        raise MQTTError(f"CONNECT of {session.client_id!r}: closed at connect_timeout while it was checked")
    if not authentic:
        await _refuse_unauthentic(session, writer, plugins_manager)
    if unwritable is not None:
        log.warning("%s: CONNECT refused with CONNACK 3 (server unavailable): %s", session.client_id, unwritable)
        await _refuse_read_connect(writer, plugins_manager, SERVER_UNAVAILABLE)
        raise MQTTError(f"CONNECT of {session.client_id!r}: {unwritable}")
    # Again after the awaits: another user's CONNECT of the client id may have created its session meanwhile.
    meanwhile = " (its session was created while this CONNECT was checked)"
    await _check_owner(plugin, session, writer, plugins_manager, meanwhile)
    if not session.clean_session:
        # After every await: the place is held from here until its CONNACK (or the connection's end).
        writer.durable_reservation = plugin.engine.reserve_session(session.client_id)
        if writer.durable_reservation is None:  # amqtt has created nothing for it (a Session it would keep for ever)
            _warn_session_limit(plugin.engine, session.client_id)
            await _refuse_read_connect(writer, plugins_manager, SERVER_UNAVAILABLE)
            raise MQTTError(str(SessionLimitError(session.client_id, plugin.config.max_durable_sessions)))
    if checked:
        _authenticated(session)
    return checked


async def _take_connect_turn(
    plugin: DurableSessionsPlugin, session: Any, writer: Any, plugins_manager: Any, *, checked: bool
) -> None:
    """After its checks (``checked``: authenticated as it was read), a CONNECT waits for its client
    id's turn (``ConnectTurns``), given back at its CONNACK or its connection's end. What is left
    from here (that wait, a take-over's wait for the older connection, the broker's store work for
    the CONNACK) is the broker's work, not the client's: it does not count against connect_timeout.
    The wait for the turn is bounded by connect_timeout of its own, from its start: then CONNACK 3.

    Any other CONNECT's credentials are checked before its turn too (not bounded by connect_timeout,
    as amqtt's own check after it was not): one slow to authenticate, or failing, never holds up
    another CONNECT of its client id, and one that fails never reaches amqtt's take-over of the
    connection an earlier CONNECT of its client id made meanwhile.

    In its turn the owner is checked again (CONNACK 5, the turn given back by the caller): a CONNECT
    of another user of the client id, answered while this one waited, may have created its durable
    session, and amqtt's take-over would end the owner's connection before the CONNACK's own check."""
    deadline = getattr(writer, "durable_connect_deadline", None)
    if deadline is not None:
        deadline.cancel()
    if not checked:
        if not await _credentials_pass(plugin, session, writer, plugins_manager):
            await _refuse_unauthentic(session, writer, plugins_manager)
        _authenticated(session)
    if plugin.connect_turns.busy(session.client_id):
        log.info("%s: CONNECT waits for the client id's earlier CONNECT to be answered", session.client_id)
    limit = plugin.engine.config.connect_timeout
    try:
        writer.durable_connect_turn = await plugin.connect_turns.take(session.client_id, limit)
    except TimeoutError:
        log.warning(
            "%s: CONNECT refused (CONNACK 3): the client id's earlier CONNECT was not answered within "
            "connect_timeout (%g s) of this one's checks",
            session.client_id,
            limit,
        )
        await _refuse_read_connect(writer, plugins_manager, SERVER_UNAVAILABLE)
        raise MQTTError(f"CONNECT of {session.client_id!r}: its turn did not come within connect_timeout") from None
    await _check_owner(plugin, session, writer, plugins_manager, " (its session was created while it waited its turn)")


async def _credentials_pass(plugin: DurableSessionsPlugin, session: Any, writer: Any, plugins_manager: Any) -> bool:
    """Whether a CONNECT's credentials pass the auth plugins (``check_credentials``). A check that
    raises (an auth plugin that cannot reach its service, or its own bug) gets CONNACK 3 (server
    unavailable): nothing of amqtt's was touched yet. The error is logged as an ERROR naming it,
    with its traceback, and MQTTError raised. Once the connection was closed at connect_timeout
    the error is raised as it is (no CONNACK: initialize_client_session logs it)."""
    try:
        return await plugin.hooks.check_credentials(session)
    except Exception as exc:
        if _timed_out(writer):
            raise
        log.error(
            "CONNECT of client id %r by user %r refused (CONNACK 3): its credentials could not be checked: %r",
            session.client_id,
            session.username,
            exc,
            exc_info=exc,
        )
        await _refuse_read_connect(writer, plugins_manager, SERVER_UNAVAILABLE)
        raise MQTTError(f"CONNECT of {session.client_id!r}: its credentials could not be checked: {exc!r}") from None


_VERIFIED: contextvars.ContextVar[tuple[str, str | None, str | None] | None] = contextvars.ContextVar(
    "durable_verified", default=None
)
"""Set in a connection's task to (client id, username, password) once its CONNECT's credentials
passed as it was read (``_authenticated``): amqtt's own check of that CONNECT, in the same task,
passes without asking the plugins again (``AmqttHooks.authenticate``). Per connection: another
CONNECT of the client id, whatever its credentials, neither sees nor takes it."""


def _authenticated(session: Any) -> None:
    """A CONNECT authenticated as it was read: amqtt's own check of it passes without asking again."""
    _VERIFIED.set((session.client_id, session.username, session.password))


async def _refuse_unauthentic(session: Any, writer: Any, plugins_manager: Any) -> NoReturn:
    """A CONNECT whose credentials failed as it was read: CONNACK 5, MQTTError."""
    log.warning(
        "CONNECT of client id %r by user %r refused (CONNACK 5): authentication failed",
        session.client_id,
        session.username,
    )
    await _refuse_read_connect(writer, plugins_manager)
    raise MQTTError(f"CONNECT of {session.client_id!r}: authentication failed")


async def _check_owner(
    plugin: DurableSessionsPlugin, session: Any, writer: Any, plugins_manager: Any, why: str = ""
) -> None:
    """A client id whose durable session another user owns: CONNACK 5, MQTTError (``why`` ends the WARNING).
    Suspends only to refuse: a CONNECT it lets through reaches its caller's next line in the same step."""
    try:
        plugin.engine.check_owner(session.client_id, session.username)
    except NotSessionOwnerError as exc:
        log.warning("%s%s", exc, why)
        await _refuse_read_connect(writer, plugins_manager)
        raise MQTTError(str(exc)) from None


async def _check_will_topic(broker: Any, session: Any, writer: Any, plugins_manager: Any) -> None:
    """A will topic the topic ACL says the CONNECT's user may not publish to: CONNACK 5, MQTTError."""
    if session.will_flag and not await broker._topic_filtering(session, session.will_topic, Action.PUBLISH):
        log.warning(
            "CONNECT of client id %r by user %r refused (CONNACK 5): the topic ACL says it may not publish "
            "its will to %r",
            session.client_id,
            session.username,
            session.will_topic,
        )
        await _refuse_read_connect(writer, plugins_manager)
        raise MQTTError(f"CONNECT of {session.client_id!r}: will topic not allowed")


def _raised_in_close(exc: BaseException, writer: Any) -> bool:
    """Whether ``exc`` was raised in the close of ``writer``'s TCP connection (``StreamWriterAdapter.close``,
    not another's, as a take-over's): amqtt's close after the CONNACK refusing a CONNECT (2, 4) raises
    a plain OSError (ENOTCONN, not a ConnectionError) when the client closed at once and its reset
    came meanwhile; no MQTTError is its context, as amqtt's CONNACK refusals are not made in its
    ``except MQTTError``."""
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code is StreamWriterAdapter.close.__code__ and frame.f_locals.get("self") is writer:
            return True
        tb = tb.tb_next
    return False


def _timed_out(writer: Any) -> bool:
    """Whether this connection was closed at ``connect_timeout`` (``end_silent``): its CONNECT, read
    or being checked, gets no CONNACK and nothing of it is acted on."""
    return bool(getattr(writer, "durable_timed_out", False))


def _release_reservation(engine: DurableEngine, writer: Any) -> None:
    """The place a durable CONNECT read on this connection held (``max_durable_sessions``) is
    free: it was refused, or its connection ended (nothing if its CONNACK already used it)."""
    reservation: Reservation | None = getattr(writer, "durable_reservation", None)
    if reservation is not None:
        engine.session_limit.release(reservation)


def _warn_session_limit(engine: DurableEngine, client_id: str) -> None:
    """A CONNECT refused by ``max_durable_sessions``: counted, and a WARNING at most once per
    ``drop_log_interval`` (an attacker cycling client ids makes one refusal per CONNECT). amqtt's
    own two WARNINGs about the refused connection are lowered to DEBUG (``_ROUTINE_REFUSAL``)."""
    _ROUTINE_REFUSAL.set(True)
    why = engine.session_limit.refuse(client_id)
    if why is not None:
        log.warning("%s", why)


async def _refuse_read_connect(writer: Any, plugins_manager: Any, return_code: int = NOT_AUTHORIZED) -> None:
    """CONNACK 5 (or ``return_code``) to a CONNECT just read, then close: nothing of amqtt's has been touched.

    A client gone meanwhile (reset; over a websocket, closed) makes the write or the close fail
    (the close with a plain OSError, ENOTCONN, not a ConnectionError): its socket is closed and MQTTError
    raised, which amqtt's caller handles by freeing the listener's connection slot (an
    OSError would escape it and hold the slot and the socket)."""
    connack = ConnackPacket.build(0, return_code)
    try:
        await plugins_manager.fire_event(MQTTEvents.PACKET_SENT, packet=connack)
        await connack.to_stream(writer)
        await writer.close()
    except (ConnectionClosed, OSError) as exc:  # its close: write_eof on a reset connection raises ENOTCONN
        await close_socket(writer)
        raise MQTTError(f"the connection from {_peer(writer)} ended while its CONNECT was refused: {exc!r}") from None


_ROUTINE_REFUSAL: contextvars.ContextVar[bool] = contextvars.ContextVar("durable_routine_refusal", default=False)
"""Set in a connection's task when its CONNECT was refused because this broker is a backup, or by
``max_durable_sessions`` or ``max_keepalive`` (whose own WARNINGs are rate-limited)."""
_CONNECTING: contextvars.ContextVar[Any] = contextvars.ContextVar("durable_connecting", default=None)
"""Set in a connection's task to its handler from the end of its CONNECT's read until its CONNACK
(``initialize_client_session`` to ``connack_authorize``): a ``stop()`` of another connection in
that time is amqtt's take-over of a client id whose (durable) Session it keeps (see
``_stop_waiting_for_a_reader_that_may_never_run``)."""
_TAKEN_OVER: contextvars.ContextVar[tuple[PublishedMessages, bool] | None] = contextvars.ContextVar(
    "durable_taken_over", default=None
)
"""Set in a clean CONNECT's task to the ``PublishedMessages`` of the live connection of its client id
it ended (``AmqttHooks.delete_session``) and whether amqtt was handling that connection's end before
(``_end_handled``), for the new connection to follow (``PublishedMessages.follow``)."""


class ConnectTurns:
    """One CONNECT of a client id at a time from the end of its checks (``_check_connect``) to its
    CONNACK, in the order their checks ended (MQTT-3.1.4-2: the newest connection wins, every
    older one is closed). amqtt ends only the connection its table holds for the client id (its
    take-over, or ``delete_session`` for a clean CONNECT) and puts a CONNECT's own there just before
    its CONNACK: two CONNECTs read while a take-over waited for the older connection (up to 5 s)
    each ended that one and neither ended the other, so both stayed connected (a durable one then
    got nothing, the clean one its messages). In turn, each finds the one before it in amqtt's
    table and ends it, and the engine sees their CONNECTs in the same order."""

    def __init__(self) -> None:
        self._queues: dict[str, tuple[asyncio.Lock, int]] = {}
        """Client id -> (its lock, the CONNECTs holding or waiting for it); no entry when none."""

    async def take(self, client_id: str, limit: float) -> Callable[[], None]:
        """Wait for the client id's turn; returns what gives it back (once, at the CONNACK or the end).
        TimeoutError when it has not come within ``limit`` seconds (the waiter holds a listener slot,
        a place of its address and, durable, one of ``max_durable_sessions``)."""
        lock, users = self._queues.get(client_id, (None, 0))
        if lock is None:
            lock = asyncio.Lock()
        self._queues[client_id] = (lock, users + 1)
        try:
            async with asyncio.timeout(limit):
                await lock.acquire()
        except BaseException:
            self._leave(client_id)
            raise
        given_back = False

        def give_back() -> None:
            nonlocal given_back
            if not given_back:
                given_back = True
                lock.release()
                self._leave(client_id)

        return give_back

    def busy(self, client_id: str) -> bool:
        """Does a CONNECT of the client id hold its turn (``take`` would wait)?"""
        return client_id in self._queues

    def _leave(self, client_id: str) -> None:
        lock, users = self._queues[client_id]
        if users == 1:
            del self._queues[client_id]
        else:
            self._queues[client_id] = (lock, users - 1)


def _end_connect_turn(writer: Any) -> None:
    """This connection's CONNECT gives its client id's turn back (``ConnectTurns``), if it holds it."""
    give_back: Callable[[], None] | None = getattr(writer, "durable_connect_turn", None)
    if give_back is not None:
        writer.durable_connect_turn = None
        give_back()


class _RoutineRefusalFilter(logging.Filter):
    """amqtt logs two WARNINGs for every CONNECT a plugin refuses; on a backup every client retry
    is one (our own line is at DEBUG), and past ``max_durable_sessions`` or ``max_keepalive`` every
    attempt of an attacker (our own line is rate-limited): in that connection's task they are
    lowered to DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.WARNING and _ROUTINE_REFUSAL.get():
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


def _install_refusal_filter() -> None:
    broker_log = logging.getLogger("amqtt.broker")
    if not any(isinstance(f, _RoutineRefusalFilter) for f in broker_log.filters):
        broker_log.addFilter(_RoutineRefusalFilter())


def _install_decoder_checks() -> None:
    """Six refusals in amqtt's decoders; a ProtocolViolationError ends amqtt's reader loop, which
    closes the connection (an MQTTError would make it skip the rest and read on, out of step).

    * A connection's first packet that is not a CONNECT (MQTT-3.1.0-1), on its fixed header (the
      reader is marked ``durable_awaiting_connect`` by ``init_from_connect``): amqtt read any
      first packet as a CONNECT body, waiting for bytes that might never come.
    * On a broker connection's reader (marked ``durable_server_side`` by ``init_from_connect``:
      the patch is the class's, process-wide, and amqtt's own client reads CONNACK, SUBACK and
      PINGRESP through it), a first byte the server refuses (``_BAD_FIRST``): a reserved packet type (amqtt logged it
      and read on), a type only servers send (amqtt ignored it), a second CONNECT (MQTT-3.1.0-2:
      amqtt logged it and read on, storing for durable subscribers what came after it, and a
      connection whose second CONNECT came with two PUBLISHes in one write stayed open until the
      client closed it), or fixed header flags MQTT 3.1.1 does not allow for the type (amqtt took a PUBREL, SUBSCRIBE or
      UNSUBSCRIBE whatever its flags).
    * A packet's remaining length past the connection's ``max_packet_size`` (set on its reader
      as ``durable_max_packet_size``; readers without one are not affected), before the body
      is read: amqtt would read a body of any size into memory.
    * A PUBLISH topic no client may publish to: amqtt refuses a wildcard half-way through the
      packet and reads its payload as packets, lets U+0000 through, and turns invalid UTF-8
      into ``str(bytes)``, whose longer length makes it read the payload out of step too. The
      variable header is read here instead (topic, then packet id if QoS > 0, as amqtt does).
    * A SUBSCRIBE or UNSUBSCRIBE topic filter that is not valid UTF-8 (MQTT-1.5.3-1): amqtt's
      ``decode_string`` turns it into ``str(bytes)``, a valid filter that a durable session would
      keep for ever. Those two modules get a strict one, which also refuses U+0000 (MQTT-1.5.3-2,
      which amqtt grants and a durable session would keep too).
    * A SUBSCRIBE without a topic filter (MQTT-3.8.3-3) or asking for a QoS other than 0, 1
      or 2 (MQTT-3.8.3-4), an UNSUBSCRIBE without a topic filter (MQTT-3.10.3-2): amqtt answers
      the first and the last with an empty SUBACK / an UNSUBACK and hands the second on; and a
      PUBLISH (QoS > 0), SUBSCRIBE or UNSUBSCRIBE whose packet identifier is 0 (MQTT-2.3.1-1):
      amqtt routed such a QoS 1 PUBLISH and never acknowledged it.
    """
    original_header = MQTTFixedHeader.from_stream
    if getattr(original_header, "_durable_wrapped", False):
        return

    async def header_from_stream(cls: type[MQTTFixedHeader], reader: Any) -> MQTTFixedHeader | None:
        header = await original_header.__func__(cls, reader)
        if header is not None:
            _check_header(reader, header)
        return header

    async def publish_from_stream(cls: type[PublishVariableHeader], reader: Any, fixed: Any) -> PublishVariableHeader:
        length = int.from_bytes(await read_or_raise(reader, 2), "big")
        has_packet_id = bool((fixed.flags >> 1) & 0x03)
        if 2 + length + (2 if has_packet_id else 0) > fixed.remaining_length:
            raise _refused(reader, ProtocolViolationError(TOPIC_PAST_END))
        try:
            topic = checked_publish_topic(await read_or_raise(reader, length) if length else b"")
        except ProtocolViolationError as exc:
            raise _refused(reader, exc) from None
        packet_id = await decode_packet_id(reader) if has_packet_id else None
        if packet_id == 0:
            raise _refused(reader, ProtocolViolationError(f"PUBLISH refused: {PACKET_ID_0}"))
        return cls(topic, packet_id)

    header_from_stream._durable_wrapped = True  # type: ignore[attr-defined]
    MQTTFixedHeader.from_stream = classmethod(header_from_stream)
    PublishVariableHeader.from_stream = classmethod(publish_from_stream)
    amqtt_subscribe.decode_string = _strict_filter_decoder("SUBSCRIBE")
    amqtt_unsubscribe.decode_string = _strict_filter_decoder("UNSUBSCRIBE")
    _install_subscribe_payload_check()


def _check_header(reader: Any, header: MQTTFixedHeader) -> None:
    """The fixed header checks of ``_install_decoder_checks``: first packet a CONNECT (with flags
    0000), every later one's first byte (no CONNECT), remaining length."""
    if getattr(reader, "durable_awaiting_connect", False):
        reader.durable_awaiting_connect = False
        if header.packet_type != CONNECT:
            packet_type = header.packet_type
            raise ProtocolViolationError(f"its first packet is of type {packet_type}, not CONNECT (MQTT-3.1.0-1)")
        if header.flags:
            raise first_byte_refusal((CONNECT << 4) | header.flags)
    elif getattr(reader, "durable_server_side", False) and _BAD_FIRST[first := header.packet_type << 4 | header.flags]:
        raise _refused(reader, first_byte_refusal(first))
    limit = getattr(reader, "durable_max_packet_size", None)
    if limit is not None and header.remaining_length > limit:
        raise _refused(reader, PacketTooLargeError(header.remaining_length, limit))


def _install_subscribe_payload_check() -> None:
    """A SUBSCRIBE without a topic filter or asking for a QoS other than 0, 1 or 2, and an
    UNSUBSCRIBE without a topic filter, are refused once their payload is read (see
    _install_decoder_checks)."""
    subscribe_payload, unsubscribe_payload = amqtt_subscribe.SubscribePayload, amqtt_unsubscribe.UnubscribePayload
    subscribe_payload.from_stream = _checked_payload(subscribe_payload.from_stream, "SUBSCRIBE", "MQTT-3.8.3-3")
    unsubscribe_payload.from_stream = _checked_payload(unsubscribe_payload.from_stream, "UNSUBSCRIBE", "MQTT-3.10.3-2")


def _checked_payload(original: Any, packet: str, empty_rule: str) -> Any:
    """amqtt's ``from_stream`` (a bound classmethod) of a SUBSCRIBE or UNSUBSCRIBE payload, wrapped
    to refuse packet identifier 0, a payload without a topic filter (``empty_rule``) and, in a
    SUBSCRIBE, a requested QoS other than 0, 1 or 2."""

    async def payload_from_stream(cls: type, reader: Any, fixed: Any, variable: Any) -> Any:
        payload = await original.__func__(cls, reader, fixed, variable)
        if variable.packet_id == 0:
            problem = PACKET_ID_0
        elif not payload.topics:
            problem = f"it holds no topic filter ({empty_rule})"
        elif packet == "SUBSCRIBE" and any(qos not in (0, 1, 2) for _, qos in payload.topics):
            problem = "a requested QoS is not 0, 1 or 2 (MQTT-3.8.3-4)"
        else:
            return payload
        raise _refused(reader, ProtocolViolationError(f"{packet} refused: {problem}"))

    return classmethod(payload_from_stream)


def _strict_filter_decoder(packet: str) -> Callable[[Any], Awaitable[str]]:
    """amqtt's ``decode_string`` for the topic filters of ``packet``, refusing invalid UTF-8 and U+0000."""

    async def decode_filter(reader: Any) -> str:
        length_bytes = await read_or_raise(reader, 2)
        if not length_bytes:
            raise ZeroLengthReadError
        length = int.from_bytes(length_bytes, "big")
        raw = await read_or_raise(reader, length) if length else b""
        try:
            topic_filter = raw.decode("utf-8")
        except UnicodeDecodeError:
            error = ProtocolViolationError(f"{packet} refused: a topic filter is not valid UTF-8 (MQTT-1.5.3-1)")
            raise _refused(reader, error) from None
        if "\x00" in topic_filter:
            error = ProtocolViolationError(f"{packet} refused: a topic filter contains U+0000 (MQTT-1.5.3-2)")
            raise _refused(reader, error)
        return topic_filter

    return decode_filter


def _refused(reader: Any, error: ProtocolViolationError) -> ProtocolViolationError:
    """Log why amqtt's reader loop is about to end a connection (its own line names no client).
    Before CONNECT the reader has no client id yet: ``init_from_connect``'s wrapper logs."""
    client_id = getattr(reader, "durable_client_id", None)
    if client_id is not None:
        log.warning("closing the connection of %s: %s", client_id, error)
    return error


def checked_publish_topic(raw: bytes) -> str:
    """A PUBLISH's topic bytes as a topic a client may publish to, or ProtocolViolationError."""
    try:
        topic = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ProtocolViolationError("PUBLISH refused: the topic is not valid UTF-8 (MQTT-1.5.3-1)") from None
    problem = publish_topic_problem(topic)
    if problem is not None:
        raise ProtocolViolationError(f"PUBLISH refused: {problem}")
    return topic


def publish_topic_problem(topic: str) -> str | None:
    """Why a client may not publish to ``topic`` (None: it may): MQTT's rules, and amqtt's refusal
    of ``$`` topics, which are the broker's own."""
    problem = topic_problem(topic)
    if problem is None and topic.startswith("$"):
        return "the topic starts with $, which is reserved for the broker (MQTT-4.7.2-1)"
    return problem


async def close_socket(writer: Any) -> None:
    """Close a TCP connection's socket now, unsent bytes first (for at most CLOSE_GRACE).

    amqtt closes some ended connections and leaves others to the garbage collector, which may
    not run for a long time: a flood of connections that never finish a CONNECT would hold
    every descriptor. Websocket connections are closed by the websockets server itself.
    """
    if not isinstance(writer, StreamWriterAdapter):
        return
    writer.is_closed = True
    transport = writer._writer.transport
    if not transport.is_closing():  # asyncio's TLS transport, closed twice, drops its SSL protocol
        transport.close()
    tcp = _tcp_transport(transport)
    if tcp is not None and tcp.get_write_buffer_size():
        asyncio.get_running_loop().call_later(CLOSE_GRACE, tcp.abort)


def _tcp_transport(transport: Any) -> Any:
    """The TCP transport a stream's transport writes to: itself, or on a TLS listener the one under
    asyncio's SSL transport (None once that connection is lost). asyncio offers no public way to it
    (CPython's ``_SSLProtocolTransport._ssl_protocol._transport``)."""
    if not isinstance(transport, _SSLProtocolTransport):
        return transport
    return getattr(getattr(transport, "_ssl_protocol", None), "_transport", None)


AMQTT_START_FAILED = "Broker instance can't be started"
"""The text of the BrokerError amqtt wraps every start-up error in (it names nothing to fix)."""


async def start_broker(config: dict[str, Any]) -> Broker:
    """amqtt's broker for ``config``, started; BrokerNotStartedError says why it did not start."""
    try:
        broker = Broker(config)
        await broker.start()
    except Exception as exc:
        raise BrokerNotStartedError(str(_start_error_reason(exc))) from exc
    return broker


def _start_error_reason(exc: BaseException) -> BaseException:
    """amqtt wraps plugin errors in PluginInitError(<class>); the user needs the innermost one,
    except under an amqtt BrokerError of its own (e.g. "Invalid port value in bind value: ...",
    whose cause is a bare int() error): that one names what to fix."""
    seen = exc
    named: BaseException | None = None
    while not isinstance(seen, DurableError) and (below := _reason_below(seen)) is not None:
        if isinstance(seen, BrokerError) and not str(seen).startswith(AMQTT_START_FAILED):
            named = seen
        seen = below
    return seen if named is None or isinstance(seen, DurableError) else named


def _reason_below(exc: BaseException) -> BaseException | None:
    """The exception ``exc`` was raised from, or during; not one it suppressed (``raise ... from
    None``: asyncio's "error while attempting to bind on address (...)" names the address, the
    bare socket error under it does not)."""
    return exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)


def start_failure(broker: Broker) -> str | None:
    """Why the durable plugin of a started ``broker`` could not start its part (its
    replication.listen address in use, ...), or None. amqtt does not see it (see _start_failed)."""
    plugin = next((p for p in broker.plugins_manager.plugins if isinstance(p, DurableSessionsPlugin)), None)
    return None if plugin is None else plugin.start_failure


def check_internals(broker: Any) -> None:
    """Fail at start-up, naming what is missing, rather than misbehave with another amqtt."""
    missing = [name for name in _BROKER_INTERNALS if not hasattr(broker, name)]
    missing += [f"BrokerProtocolHandler.{n}" for n in _HANDLER_INTERNALS if not hasattr(BrokerProtocolHandler, n)]
    missing += [f"Session.{n}" for n in _SESSION_INTERNALS if not hasattr(Session, n)]
    if missing or amqtt.__version__ != AMQTT_VERSION:
        raise InternalsMismatchError(
            f"amqtt_durable was written for amqtt {AMQTT_VERSION}; installed is {amqtt.__version__}"
            + (f" and it lacks {', '.join(missing)}" if missing else "")
            + f". Install amqtt=={AMQTT_VERSION} (pip install 'amqtt=={AMQTT_VERSION}')."
        )


RETAINED_RUN = 256
"""Retained messages a SUBSCRIBE's filter brings that are written before the event loop serves
others: a write whose socket takes it does not yield, so a `#` over 66,000 held another client's
PINGREQ 1.7 s on a quiet machine, 6.5 s in a loaded CI."""


class RetainedTable(UserDict[str, RetainedApplicationMessage]):
    """amqtt's retained table (topic -> message) with a trie of its topics kept in step.

    Every change goes through ``__setitem__`` / ``__delitem__`` / ``clear`` (the mapping methods
    amqtt, its persistence plugin and this plugin use all lead there), so the trie is never out
    of step with the table, whoever changes it: the plugin's retains (``apply_retained``), the
    load at start-up and promotion (``_fill_retained``), amqtt's clearing at start and shutdown.
    """

    def __init__(self) -> None:
        self.topics = TopicIndex()
        super().__init__()

    def __setitem__(self, topic: str, message: RetainedApplicationMessage) -> None:
        if topic not in self.data:
            self.topics.add(topic)
        self.data[topic] = message

    def __delitem__(self, topic: str) -> None:
        del self.data[topic]
        self.topics.discard(topic)

    def clear(self) -> None:
        self.data.clear()
        self.topics.clear()

    def __ior__(  # type: ignore[override,misc]  # UserDict's would change ``data`` behind the trie
        self, other: Any
    ) -> RetainedTable:
        self.update(other)
        return self

    def matching(self, topic_filter: str) -> list[tuple[str, RetainedApplicationMessage]]:
        """(topic, message) of every retained topic ``topic_filter`` matches (``topics.matches``),
        in the table's order."""
        data = self.data
        return [(topic, data[topic]) for topic in self.topics.matching(topic_filter)]


WS_HIGH_WATER = 65_536
"""Bytes written to a websocket connection in one loop pass past which it counts as congested."""


def _kernel_send_queue(transport: Any) -> int:
    """Bytes in the kernel's send queue (TIOCOUTQ) of the transport's socket."""
    sock = transport.get_extra_info("socket")
    queued = array.array("i", [0])
    if sock is not None:
        with contextlib.suppress(OSError, ValueError):  # closed, or a platform without the request
            fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, queued)
    return queued[0]


class HandlerTransport:
    """A pump's view of one client connection: raw writes, and acks taken before amqtt sees them.

    Acks are matched here rather than through amqtt's waiter futures, which amqtt cancels on
    take-over while PUBACKs it has already read are still being handled.
    """

    def __init__(self, handler: Any) -> None:
        self._handler = handler  # its writer is attached after CONNECT is read
        self._expected: dict[AckKind, dict[int, Callable[[], None]]] = {"puback": {}, "pubrec": {}, "pubcomp": {}}
        """Per kind of ack, by packet id (no key tuple to build and hash per ack)."""
        self.ack_runs: AckRuns | None = None
        """The pump of this connection, told where a run of acks (take_acks) begins and ends."""
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def closed(self) -> bool:
        """The connection is closed, or its close has begun. amqtt's StreamWriterAdapter sets
        ``is_closed`` only in its own close: a TCP connection asyncio lost (a reset read, a write
        that failed) is told by its transport, closing, which takes no more writes (each logged
        asyncio's "socket.send() raised exception."). amqtt's WebSocketsWriter has no ``is_closed``
        that its close sets (only ``_abort`` sets one): its websocket's state tells (a connection
        that sent DISCONNECT counted as open for ever)."""
        writer = self._handler.writer
        if writer is None or getattr(writer, "is_closed", False):
            return True
        if isinstance(writer, StreamWriterAdapter):
            transport = writer._writer.transport
            tcp = _tcp_transport(transport)  # on TLS it is told first (its SSL transport a loop pass later)
            return bool(transport.is_closing()) or tcp is None or bool(tcp.is_closing())
        return isinstance(writer, WebSocketsWriter) and writer._protocol.state is not WebsocketState.OPEN

    def write(self, data: bytes) -> None:
        """Queue bytes for one socket write at the end of this loop pass (many acks, one syscall)."""
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.append(data)
        self._pending_bytes += len(data)

    @property
    def unsent(self) -> bool:
        """Bytes written here wait for this loop pass's end to go to the socket."""
        return bool(self._pending)

    @property
    def unsent_bytes(self) -> int:
        """Bytes written to the client it has not acknowledged (fewer once it reads some:
        FastReader._room): here, in asyncio's buffer and in the kernel's send queue (TIOCOUTQ),
        which can hold megabytes and takes no more from asyncio until a third of it is free. On a
        websocket (FastReader, which asks, runs on TCP only) only those here are known."""
        writer = self._handler.writer
        if not isinstance(writer, StreamWriterAdapter):
            return self._pending_bytes
        transport = writer._writer.transport
        return self._pending_bytes + int(transport.get_write_buffer_size()) + _kernel_send_queue(transport)

    @property
    def congested(self) -> bool:
        """More is unsent to the client than its socket's write buffer limit (asyncio's high-water
        mark: 64 KiB on TCP; on TLS the SSL transport's own, 512 KiB, the TCP buffer under it not
        counted): it does not read as fast as it is written to, and ``drain`` would wait."""
        writer = self._handler.writer
        if isinstance(writer, StreamWriterAdapter):
            transport = writer._writer.transport
            high: int = transport.get_write_buffer_limits()[1]
            return self._pending_bytes + int(transport.get_write_buffer_size()) > high
        return bool(self._tasks) or self._pending_bytes > WS_HIGH_WATER  # a websocket write is done once drained

    def _flush(self) -> None:
        data, self._pending = b"".join(self._pending), []
        self._pending_bytes = 0
        if not data or self.closed:
            return
        writer = self._handler.writer
        if isinstance(writer, StreamWriterAdapter):
            writer.write(data)
        else:  # a websocket writer only buffers until drained, under amqtt's write lock
            task = asyncio.get_running_loop().create_task(self._write_locked(data))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _write_locked(self, data: bytes) -> None:
        async with self._handler._write_lock:
            if not self.closed:
                self._handler.writer.write(data)
                await self._handler.writer.drain()

    async def drain(self) -> None:
        self._flush()
        writer = self._handler.writer
        if isinstance(writer, StreamWriterAdapter) and not self.closed:
            await writer.drain()
        elif self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def expect_ack(self, kind: AckKind, packet_id: int, on_ack: Callable[[], None]) -> None:
        self._expected[kind][packet_id] = on_ack

    def forget_ack(self, kind: AckKind, packet_id: int) -> None:
        """The ack is not awaited any more (its wait ended: ``RetainedAcks``)."""
        self._expected[kind].pop(packet_id, None)

    async def end(self) -> None:
        """End this connection as amqtt's own take-over does (MQTT-3.1.4-2): its message loop sees
        the connection closed and runs amqtt's disconnect (the will, unless a DISCONNECT was read
        before the close), and the connection is let go once its changes are applied (a websocket
        aborted, not waited for)."""
        await take_over(self._handler)

    async def fail(self) -> None:
        """End this connection on the server's decision (a publish that could not be stored:
        ``OrderedAcks``), not as a take-over: ``end_connection`` (its will published whatever it
        sends after, nothing it sends after is handled), then ``stop()``: the message loop, which
        stops the connection once it sees the end, may be stuck writing to a client that reads
        nothing (a clean session's retained messages), and the reader, which stops it after its
        next read, waits for bytes the client may never send: the connection stayed open, its will
        unpublished, until the client's keep-alive ran out. ``stop()`` closes it within its bound
        (the changes read before and the unsent bytes: the longer of CLOSE_GRACE and
        ``connection_end_wait`` from its start)."""
        await end_connection(self._handler)
        await self._handler.stop()

    def take_ack(self, kind: AckKind, packet_id: int) -> bool:
        """True when the ack was for a message the pump sent (and it has been handled)."""
        if kind == "puback" and self.ack_runs is not None:
            return not self.take_acks(kind, [packet_id])
        on_ack = self._expected[kind].pop(packet_id, None)
        if on_ack is None:
            return False
        on_ack()
        return True

    def take_acks(self, kind: AckKind, packet_ids: list[int]) -> list[int]:
        """take_ack for a run of acks read together, handled by the pump as one run (one removal of
        their entries); returns the packet ids that were not for a message the pump sent, in order.
        PUBACKs go to the pump's ``take_pubacks`` (no callback per QoS 1 message), then, those it did
        not take, to the callbacks registered here."""
        expected = self._expected[kind]
        others: list[int] = []
        runs = self.ack_runs
        if runs is not None:
            runs.begin_ack_run()
        try:
            if runs is not None and kind == "puback":
                packet_ids = runs.take_pubacks(packet_ids)
                if not expected:
                    return packet_ids
            for packet_id in packet_ids:
                on_ack = expected.pop(packet_id, None)
                if on_ack is None:
                    others.append(packet_id)
                else:
                    on_ack()
        finally:
            if runs is not None:
                runs.end_ack_run()
        return others


class DurableSessionsPlugin(BasePlugin[BrokerContext]):  # type: ignore[misc]  # amqtt ships no type info
    """amqtt plugin: crash-proof durable sessions for every clean_session=false client."""

    Config = DurableConfig

    def __init__(self, context: BrokerContext) -> None:
        super().__init__(context)
        config: DurableConfig = self.config
        broker: Broker = context._broker_instance
        try:
            check_internals(broker)
            self.engine = DurableEngine(config, on_expired=self._on_expired, on_store_health=self._on_store_health)
            if config.replication is None:
                self.engine.open()
            else:  # loaded once this broker is the primary; a backup's store is written by replication
                self.engine.open_store()
        except DurableError as exc:
            log.error("%s", exc)
            raise
        self.broker = broker
        self.replication: ReplicationNode | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._metrics_task: asyncio.Task[None] | None = None
        self._health_order = asyncio.Lock()
        self.start_failure: str | None = None
        """Why the plugin's part of the start failed (see _start_failed); None: it did not."""
        self.keepalive_limit = KeepAliveLimit(config.max_keepalive, config.drop_log_interval)
        self.connect_turns = ConnectTurns()
        _install_session_states()
        _install_connect_hooks()
        _install_decoder_checks()
        _install_refusal_filter()
        self.hooks = AmqttHooks(broker, self.engine)
        self.hooks.install()

    async def on_broker_pre_start(self) -> None:
        # Broker.start() has just emptied amqtt's table; the listeners are not open yet.
        if self.engine.loaded:
            self._fill_retained()

    def _fill_retained(self) -> None:
        """amqtt's retained table from the store (its "$" entries are the broker's own state)."""
        table = self.broker.retained_messages
        for topic in [topic for topic in table if not topic.startswith("$")]:
            del table[topic]
        for message in self.engine.retained.take_loaded():
            table[message.topic] = RetainedApplicationMessage(None, message.topic, message.payload, message.qos)

    async def on_broker_post_start(self) -> None:
        """The timers, the metrics task and replication; whatever fails is reported (_start_failed)."""
        stage = "timers and metrics task start"
        try:
            if self.engine.loaded:
                self.engine.start_timers()
            if self.config.metrics_interval > 0:
                self._metrics_task = asyncio.get_running_loop().create_task(self._publish_metrics())
            settings = self.config.replication
            if settings is None:
                return
            stage = "replication start"
            coordinator = (
                EtcdCoordinator(settings.coordinator, prefix=settings.prefix, ttl=settings.lease_ttl)
                if settings.coordinator
                else None
            )
            # Reads the secret (file or variable) and the TLS files: a ConfigError if they went.
            self.replication = ReplicationNode(
                self.engine.db, settings, coordinator=coordinator, on_promote=self._promoted,
                on_demote=self._demoted, fsync=self.config.sync,
                listen_backlog=socket_backlog(self.config.listen_backlog),
            )
            self.engine.on_store_reopened = self.replication.use_db
            await self.replication.start()
        except DurableError as exc:
            # ReplicationListenError: "replication.listen <address>: <why>" (in use, no such
            # host); a primary that cannot serve its store (replication.node._promote); a
            # secret or TLS file that cannot be read any more (ConfigError).
            self._start_failed(str(exc))
        except Exception as exc:  # anything else (LevelDB's own error in a promotion, say)
            self._start_failed(f"{stage}: {exc!r}", unexpected=True)

    def _start_failed(self, reason: str, *, unexpected: bool = False) -> None:
        """amqtt runs on_broker_post_start as a task whose exception nobody reads (its listeners
        are open by then): the broker would stay up answering CONNACK 3. The reason is logged (an
        ``unexpected`` one with its traceback) and kept for ``start_failure``, which
        ``amqtt-durable broker`` asks after the start."""
        log.error("broker not started: %s", reason, exc_info=unexpected)
        self.start_failure = reason

    async def _promoted(self, primary: Primary) -> None:
        """This broker became the primary: load the store replication wrote and serve clients.

        amqtt's Session objects outlive a term (amqtt keeps them per client id): their in-flight
        maps name QoS 2 publishes of an earlier term, which this term's store may not hold, and
        amqtt would answer a new PUBLISH reusing such a packet id with PUBREC without it being
        stored. They are emptied; the store's own QoS 2 records (``pubrel_due``) say what this
        term has. A load that fails (a damaged store) closes and reopens the store for the
        backup end and raises: the node stays a backup (see replication.node)."""
        node = self.replication
        assert node is not None and self.config.replication is not None
        try:
            await self.engine.serve(ReplicatedCommits(primary, self.config.replication.mode, node.may_acknowledge))
        except DurableError:
            if self.engine.db is None or self.engine.db.closed:
                self.engine.open_store()
                node.use_db(self.engine.db)
            raise
        if node.primary is not primary:  # demoted while the store loaded: serve nothing of this term
            self.engine.committer.halt("demoted while it was being promoted")
            return
        for session, _ in list(self.broker._sessions.values()):
            session.inflight_in.clear()
            session.inflight_out.clear()
            session.clear_queues()
        self._fill_retained()
        self.engine.start_timers()

    def _demoted(self, reason: str) -> asyncio.Task[None] | None:
        """No longer the primary: acknowledge nothing more (at once, before any await), end every
        client connection, TCP and websocket (they reconnect to the new primary), and stop the
        engine's work. Returns that stop: the node follows the new primary once it is over."""
        if not self.engine.loaded:  # a backup that was never primary has nothing to stop
            return None
        self.engine.committer.halt(reason)
        for _, handler in list(self.broker._sessions.values()):
            _abort(getattr(handler, "writer", None))
        stopping = asyncio.get_running_loop().create_task(self.engine.stop_serving(reason))
        self._tasks.add(stopping)
        stopping.add_done_callback(self._tasks.discard)
        return stopping

    async def close(self) -> None:
        if self._metrics_task is not None:
            self._metrics_task.cancel()
            await asyncio.gather(self._metrics_task, return_exceptions=True)
        try:
            if self.replication is not None and self.engine.serving:
                # A clean stop of the primary (amqtt ended the connections): the last batches
                # (acks, session records of the closed connections) are written, then shipped
                # to the backups, before the replication end closes; nothing is written after.
                try:
                    await self.engine.finish_writes()
                    await self.replication.drain()
                finally:  # a last write that fails (a full disk) must not keep the lease renewed
                    self.engine.committer.halt("the broker stops")
        finally:
            if self.replication is not None:
                await self.replication.stop()
            await self.engine.close()

    def _on_expired(self, expired: ExpiredSession) -> None:
        payload = json.dumps(
            {
                "client_id": expired.client_id,
                "messages_dropped": expired.messages_dropped,
                "disconnected_at": expired.disconnected_at,
            }
        ).encode()
        self._spawn(self.broker._broadcast_message(None, SYS_PREFIX + "expired", payload, 1))
        self._spawn(self.hooks.forget_session(expired.client_id))

    def _on_store_health(self, health: StoreHealth) -> None:
        self._spawn(self._publish_health(json.dumps(dataclasses.asdict(health)).encode()))

    async def _publish_health(self, payload: bytes) -> None:
        """Retained, so a monitor that subscribes later sees the current state; in order of change."""
        async with self._health_order:
            await self.broker.retain_message(None, HEALTH_TOPIC, payload, 1)
            await self.broker._broadcast_message(None, HEALTH_TOPIC, payload, 1)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _publish_metrics(self) -> None:
        while True:
            await asyncio.sleep(self.config.metrics_interval)
            metrics: dict[str, object] = {}
            if self.engine.serving:
                metrics.update(self.engine.metrics())
                metrics["connections/refused"] = self.hooks.addresses.refused
            if self.replication is not None:
                metrics.update(self.replication.metrics())
            for name, value in metrics.items():
                await self.broker._broadcast_message(None, SYS_PREFIX + name, str(value).encode(), 0)


@dataclasses.dataclass
class Unsent:
    """What amqtt still has to send one clean-session connection (see CleanSends)."""

    count: int = 0
    bytes: int = 0
    dropped: int = 0
    """Dropped since the last warning of this connection."""
    warned: float = -math.inf


class CleanSends:
    """amqtt's sends to its own (clean-session) subscribers, bounded per connection, their acks
    awaited as the retained messages' are (``_send_acked``).

    amqtt 0.12.1 starts a task per message and subscriber, with no bound: a subscriber that does
    not read (its socket full) made the broker hold every later message for it, and its first
    stuck task kept every later task of every connection in the broadcast loop's deque, which
    frees finished tasks from its front only. Here a connection with ``max_pending_clean``
    messages (or ``max_pending_bytes_clean`` payload bytes) not yet sent (QoS 1/2: not yet
    acknowledged) gets no more until it takes some: a new one is dropped, counted, and logged at
    most once per ``drop_log_interval``. The tasks live in a set of their own, each gone when done.
    """

    def __init__(self, engine: DurableEngine) -> None:
        self.engine = engine
        self.tasks: set[asyncio.Task[Any]] = set()
        self.stopping = False

    def send(self, handler: Any, client_id: str, topic: str, data: bytes, qos: int) -> None:
        unsent: Unsent | None = getattr(handler, "durable_unsent", None)
        if unsent is None:
            unsent = handler.durable_unsent = Unsent()
        config = self.engine.config
        size = len(data or b"")
        if (config.max_pending_clean and unsent.count >= config.max_pending_clean) or (
            config.max_pending_bytes_clean and unsent.count and unsent.bytes + size > config.max_pending_bytes_clean
        ):
            self._drop(unsent, client_id, topic)
            return
        unsent.count += 1
        unsent.bytes += size
        finished = partial(self._sent, unsent, size)
        task = asyncio.ensure_future(_send_acked(handler, topic, data, qos, retain=False, finished=finished))
        self.tasks.add(task)
        task.add_done_callback(partial(self._done, handler, client_id, topic))

    @staticmethod
    def _sent(unsent: Unsent, size: int) -> None:
        """Its last ack came, or its wait ended (``RetainedAcks``), or, QoS 0, it was written."""
        unsent.count -= 1
        unsent.bytes -= size

    def _done(self, handler: Any, client_id: str, topic: str, task: asyncio.Task[bool]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is None and not task.result():
            _log_retained(handler, NO_ID, client_id, 1, "live", topic)

    def _drop(self, unsent: Unsent, client_id: str, topic: str) -> None:
        self.engine.clean_dropped_total += 1
        unsent.dropped += 1
        now = time.monotonic()
        if now - unsent.warned < self.engine.config.drop_log_interval:
            return
        config = self.engine.config
        log.warning(
            "%s: %d message(s) dropped (the last on %r): %d message(s) of %d payload bytes wait to be sent to "
            "this clean-session connection, the limit is max_pending_clean %d / max_pending_bytes_clean %d "
            "(0 = none). The client does not read (or acknowledge) as fast as messages arrive",
            client_id,
            unsent.dropped,
            topic,
            unsent.count,
            unsent.bytes,
            config.max_pending_clean,
            config.max_pending_bytes_clean,
        )
        unsent.warned = now
        unsent.dropped = 0

    async def stop(self) -> None:
        self.stopping = True
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


class AmqttHooks:
    """The wrappers of the broker instance's internals listed in the module docstring: one method
    per internal, the originals kept to call through."""

    def __init__(self, broker: Any, engine: DurableEngine) -> None:
        self.broker = broker
        self.engine = engine
        self._original_authenticate = broker._authenticate
        self._original_client_connected = broker._client_connected
        self._original_initialize = broker._initialize_client_session
        self._original_message_loop = broker._client_message_loop
        self._original_add_subscription = broker.add_subscription
        self._original_subscription = broker._handle_subscription
        self._original_unsubscription = broker._handle_unsubscription
        self._original_del_subscription = broker._del_subscription
        self._original_broadcast = broker._broadcast_message
        self._original_handle_disconnect = broker._handle_disconnect
        self._original_message_delivery = broker._handle_message_delivery
        self._original_delete_session = broker._delete_session
        self._original_cleanup = broker._cleanup_session
        self._original_shutdown = broker.shutdown
        self.shutting_down = False
        self.event_tasks: set[asyncio.Task[None]] = set()
        # amqtt's table (filter -> [(session, qos)]) as a trie: who holds which filter, matched per level.
        self.amqtt_index = SubscriptionIndex()
        self.limit = engine.config.max_subscriptions_per_client
        self.limit_warned: dict[str, float] = {}
        self.acl_sessions: dict[str, Session] = {}
        self.closing: set[asyncio.Task[None]] = set()
        self.retained = RetainedTable()
        self.clean_sends = CleanSends(engine)
        self.addresses = AddressConnections(engine.config.max_connections_per_address, engine.config.drop_log_interval)
        self.latest: dict[str, tuple[PublishedMessages, bool | None]] = {}
        """Client id -> its latest connection's messages, until all are handed over
        (``PublishedMessages.succeed``), and None; or, passed on by a connection refused at its
        CONNACK, the messages of the one it followed and whether it followed them only until their
        bound (``PublishedMessages.refused``)."""

    def install(self) -> None:
        broker = self.broker
        self.retained.update(broker._retained_messages)
        broker._retained_messages = self.retained
        self.engine.on_retained = self.apply_retained
        broker._authenticate = self.authenticate
        broker._client_connected = self.client_connected
        broker._initialize_client_session = self.initialize_client_session
        broker._client_message_loop = self.client_message_loop
        broker.add_subscription = self.add_subscription
        broker._handle_subscription = self.handle_subscription
        broker._handle_unsubscription = self.handle_unsubscription
        broker._del_subscription = self.del_subscription
        broker._del_all_subscriptions = self.del_all_subscriptions
        broker._run_broadcast = self.run_broadcast
        broker._publish_retained_messages_for_subscription = self.publish_retained_for_subscription
        broker._broadcast_message = self.broadcast_message
        broker._handle_disconnect = self.handle_disconnect
        broker._handle_message_delivery = self.handle_message_delivery
        broker._delete_session = self.delete_session
        broker._cleanup_session = self.cleanup_session
        broker.shutdown = self.shutdown
        broker.retain_message = self.retain_message
        broker._create_server_instance = self.create_server_instance

    def amqtt_wants(self, topic: str) -> bool:
        """Does amqtt's own publish path have work: a clean subscriber, a message listener? (A retain
        is not its work: the engine stores it and updates amqtt's table, see apply_retained.)"""
        callbacks = self.broker.plugins_manager._event_plugin_callbacks
        if BrokerEvents.MESSAGE_RECEIVED in callbacks or BrokerEvents.MESSAGE_BROADCAST in callbacks:
            return True
        return self.amqtt_index.matches_any(topic)

    def over_limit(self, index: SubscriptionIndex, client_id: str, topic_filter: str) -> bool:
        """True (and a WARNING, at most one per client per ``drop_log_interval``) when the filter would pass a limit."""
        byte_limit = self.engine.config.max_subscription_bytes_per_client
        if not index.admits(client_id, topic_filter, self.limit):
            held, key, limit = f"{index.count(client_id)} topic filters", "max_subscriptions_per_client", self.limit
        elif not index.admits_bytes(client_id, topic_filter, byte_limit):
            held = f"topic filters of {index.filter_bytes(client_id)} bytes (this one: {len(topic_filter.encode())})"
            key, limit = "max_subscription_bytes_per_client", byte_limit
        else:
            return False
        now = time.monotonic()
        if now - self.limit_warned.get(client_id, -math.inf) >= self.engine.config.drop_log_interval:
            if len(self.limit_warned) > 10_000:  # bounded: forget clients warned long ago
                self.limit_warned.clear()
            self.limit_warned[client_id] = now
            log.warning(
                "%s: SUBSCRIBE to %r refused (return code 0x80): the client holds %s, %s is %d. The client "
                "must unsubscribe from some first, or the operator raise %s (0 = no limit)",
                client_id,
                topic_filter[:200],
                held,
                key,
                limit,
                key,
            )
        return True


    async def receivers(self, topic: str) -> dict[str, int] | None:
        """With topic ACL plugins loaded, the durable sessions they let receive ``topic`` (None: all).

        A disconnected session has no amqtt Session, so the ACL sees a stand-in with the
        client id and the username of its last CONNECT.
        """
        if not self.broker.plugins_manager._topic_plugins:
            return None
        if len(self.acl_sessions) > 2 * len(self.engine.sessions) + 64:  # forget stand-ins of deleted sessions
            for gone in [cid for cid in self.acl_sessions if cid not in self.engine.sessions]:
                del self.acl_sessions[gone]
        allowed: dict[str, int] = {}
        for client_id, qos in self.engine.index.route(topic).items():
            durable = self.engine.sessions.get(client_id)
            if durable is None:
                continue  # deleted while an earlier check awaited
            stand_in = self.acl_sessions.get(client_id)
            if stand_in is None:
                stand_in = self.acl_sessions[client_id] = Session()
                stand_in.client_id = client_id
            stand_in.username = durable.record.username
            if await self.broker._topic_filtering(stand_in, topic, Action.RECEIVE):
                allowed[client_id] = qos
        return allowed

    async def check_credentials(self, session: Any) -> bool:
        """A CONNECT's credentials checked as it is read (amqtt's own check, by the auth plugins)."""
        return bool(await self._original_authenticate(session, None))

    async def authenticate(self, session: Any, listener: Any) -> bool:
        if _VERIFIED.get() == (session.client_id, session.username, session.password):
            _VERIFIED.set(None)
            return True  # this connection's CONNECT was checked as it was read, with these very credentials
        authentic = bool(await self._original_authenticate(session, listener))
        if not authentic:  # amqtt next puts this CONNECT's Session over the client id's entry (_forget_refused)
            session.durable_entry_before = self.broker._sessions.get(session.client_id)
        return authentic


    async def create_server_instance(
        self, listener_name: str, listener_type: Any, address: str | None, port: int, ssl_context: Any
    ) -> Any:
        """amqtt's TCP and websocket listeners (it calls this for no other type: an ``external`` one opens
        no server) with the ``listen_backlog`` setting: a TCP one's
        connections counted as they are accepted (``tcp_accepted``, which does a TLS listener's
        handshake); a websocket one's as amqtt opens them, its upgrade requests checked by
        ``websocket_upgrade`` (amqtt's own serve, with the backlog: websockets passes it to asyncio)."""
        backlog = socket_backlog(self.engine.config.listen_backlog)  # the kernel caps it lower
        try:
            if listener_type == ListenerType.WS:
                return await websockets.serve(
                    partial(self.broker.ws_connected, listener_name=listener_name),
                    address,
                    port,
                    ssl=ssl_context,
                    subprotocols=[websockets.Subprotocol("mqtt")],
                    process_request=self.websocket_upgrade,  # called for each upgrade request it reads
                    backlog=backlog,
                )
            return await asyncio.start_server(
                partial(self.tcp_accepted, listener_name=listener_name, ssl_context=ssl_context),
                address,
                port,
                reuse_address=True,
                backlog=backlog,
            )
        except OSError as exc:  # name the listener and its address, as replication.listen's errors do
            raise OSError(f"listener '{listener_name}' {address}:{port}: {os_error_reason(exc)}") from None

    async def tcp_accepted(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        listener_name: str,
        ssl_context: ssl.SSLContext | None,
    ) -> None:
        """A TCP listener's connection, as it is accepted: one from an address that has
        ``max_connections_per_address`` open is closed at once, before anything else: on a TLS
        listener before its TLS handshake (asyncio's TLS server did the handshake first, a refused
        connection cost the broker a handshake's cryptography), and before amqtt takes one of its
        listener's ``max_connections`` slots or reads a byte (no CONNACK: nothing was read). Any
        other counts from here until its end, whatever ends it (a failed handshake included).

        Its task, cancelled as the broker stops (a connection in its TLS handshake or waiting for
        its CONNECT), ends without the cancellation: asyncio's ``start_server`` logged a cancelled
        one as an ERROR with a CancelledError traceback, one per such connection. Its connection is
        closed by then (by ``start_tls`` when cancelled, by ``client_connected`` after it)."""
        peer = writer.get_extra_info("peername")
        address = None if not peer else str(peer[0])  # None: amqtt closes it itself
        if address is not None and not self.addresses.open(address):
            why = self.addresses.refusal(address)
            if why is not None:
                log.warning("%s", why)
            writer.transport.abort()
            return
        try:
            if ssl_context is not None:
                try:
                    await writer.start_tls(ssl_context)  # asyncio closes the connection if it fails
                except OSError as exc:  # ssl.SSLError, a reset, asyncio's handshake timeout (60 s)
                    log.debug("TLS handshake with %s on listener '%s' failed: %r", address, listener_name, exc)
                    return
            await self.broker.stream_connected(reader, writer, listener_name)
        except asyncio.CancelledError:
            log.debug("connection from %s on listener '%s' ended: the broker is stopping", address, listener_name)
        finally:
            if address is not None:
                self.addresses.close(address)

    def websocket_upgrade(self, connection: Any, request: Any) -> Any:
        """A websocket listener's upgrade request, read: one from an address that has
        ``max_connections_per_address`` open is answered HTTP 503 instead of the upgrade (websockets
        then closes it); any other counts from here until its connection's task ends, whatever
        ends it (a failed handshake included)."""
        del request
        address = str(connection.remote_address[0])
        if not self.addresses.open(address):
            why = self.addresses.refusal(address, websocket=True)
            if why is not None:
                log.warning("%s", why)
            return connection.respond(HTTPStatus.SERVICE_UNAVAILABLE, "Too many connections from this address.\n")
        task = asyncio.current_task()
        assert task is not None  # websockets calls it in the connection's handler task
        task.add_done_callback(lambda _: self.addresses.close(address))
        return None

    async def client_connected(self, listener_name: str, reader: Any, writer: Any) -> None:
        """Every connection amqtt handles (a TCP one was counted by ``tcp_accepted``, a websocket one
        by ``websocket_upgrade``): its socket is closed at its end, whatever ended it, and the place
        its durable CONNECT reserved is given back."""
        reader.durable_max_packet_size = self.engine.config.max_packet_size
        try:
            await self._original_client_connected(listener_name, reader, writer)
        finally:
            handler = getattr(writer, "durable_handler", None)
            if handler is not None:  # its message loop, if it ever ran, handed its messages over
                writer.durable_handler = None
                handler.durable_published.connection_ended()
            _end_connect_turn(writer)
            await close_socket(writer)
            _release_reservation(self.engine, writer)

    def end_silent(self, writer: Any) -> None:
        writer.durable_timed_out = True  # a CONNECT still being checked stops at its next step (_timed_out)
        log.warning(
            "closing the connection from %s: no complete CONNECT within connect_timeout (%g s)",
            _peer(writer),
            self.engine.config.connect_timeout,
        )
        if isinstance(writer, StreamWriterAdapter):
            writer.is_closed = True
            writer._writer.transport.abort()  # amqtt's read of the CONNECT then ends with no data
        else:
            task = asyncio.get_running_loop().create_task(writer.close())
            self.closing.add(task)
            task.add_done_callback(self.closing.discard)

    async def initialize_client_session(self, reader: Any, writer: Any, *args: Any) -> tuple[Any, Any]:
        deadline = asyncio.get_running_loop().call_later(self.engine.config.connect_timeout, self.end_silent, writer)
        writer.durable_connect_deadline = deadline  # cancelled once its checks passed (_take_connect_turn)
        try:
            handler, session = await self._original_initialize(reader, writer, *args)
        except (AMQTTError, MQTTError, NoDataError):
            raise  # amqtt's own: its caller logs one line and gives the connection's place back
        except Exception as exc:
            # Anything else escaped amqtt's caller: an "Unhandled exception" traceback, and the
            # connection's place among its listener's max_connections never given back (a listener
            # refused everyone after max_connections of them). As an MQTTError amqtt logs one line
            # and gives the place back (client_connected closes the connection). amqtt closes a
            # connection whose CONNECT it refused (drain, write_eof) in its ``except MQTTError``: a
            # peer that reset it meanwhile makes that close raise an OSError whose context is that
            # MQTTError, named so, as is one raised by amqtt's close of this connection after its own
            # CONNACK refusal (2, 4) in init_from_connect (_raised_in_close). Any other error (an auth
            # plugin's raised once its connection was closed at connect_timeout, _credentials_pass; a
            # take-over's) is logged as what it is, with its traceback.
            if isinstance(exc, OSError) and (isinstance(exc.__context__, MQTTError) or _raised_in_close(exc, writer)):
                raise MQTTError(f"the connection ended while its CONNECT was refused: {exc!r}") from None
            log.error("the handling of a CONNECT from %s failed: %r", _peer(writer), exc, exc_info=exc)
            raise MQTTError(f"the handling of its CONNECT failed: {exc!r}") from None
        finally:
            deadline.cancel()
        _CONNECTING.set(handler)  # until its CONNACK: amqtt may take a live connection of the client id over
        reader.durable_client_id = session.client_id  # for the decoder checks' log lines
        session.clean_session = handler.connect_clean_session
        handler.durable_connack_sent = False  # until its CONNACK accepted it: no broadcast (run_broadcast)
        handler.durable_transport = HandlerTransport(handler)
        handler.durable_acks = OrderedAcks(handler.durable_transport, session.client_id)
        handler.durable_control = _control_channel(self.broker, self.engine, handler, session)
        handler.durable_publishes = InboundPublishes(
            self.engine,
            partial(_put_published, handler),
            handler.durable_acks,
            handler.durable_control,
            self.amqtt_wants,
        )
        _wrap_handler(
            self.broker, self.engine, handler, session, amqtt_wants=self.amqtt_wants, receivers=self.receivers
        )
        handler._reader_loop = FastReader(self.broker, self.engine, handler, session).run
        taken_over: tuple[PublishedMessages, bool] | None = _TAKEN_OVER.get()
        if taken_over is not None:
            older, ended = taken_over
            handler.durable_published.follow(older, until_released=ended)
            _TAKEN_OVER.set(None)
        handler.durable_published.succeed(self.latest, session.client_id)
        writer.durable_handler = handler  # for the connection's end (``client_connected``)
        return handler, session

    async def handle_message_delivery(self, session: Any, handler: Any, wait_deliver: asyncio.Future[Any]) -> bool:
        """amqtt's delivery of a message its client published: the message loop's is handled, not
        left in hand (``PublishedMessages.in_hand``)."""
        published: PublishedMessages | None = getattr(handler, "durable_published", None)
        if published is not None:
            published.handled()
        return bool(await self._original_message_delivery(session, handler, wait_deliver))

    async def handle_disconnect(self, session: Any, handler: Any, disconnect_waiter: asyncio.Future[Any]) -> None:
        """The end of a connection's message loop: its will is published unless it sent DISCONNECT,
        and it is the will of its own CONNECT (``ConnectionWill``), not the Session's: on a
        take-over amqtt gives the shared Session the new CONNECT's will before it ends the old
        connection, whose end then published the new client's will (even one that sent DISCONNECT
        later), and the old client's own was never published (MQTT-3.1.2-8, MQTT-3.14.4-3). amqtt
        does the rest (CLIENT_DISCONNECTED included), told the will's decision is made."""
        will: ConnectionWill | None = getattr(handler, "durable_will", None)
        handler.durable_disconnected = True
        handler.durable_published.start_bound()  # before its loop may check a message it still holds
        if will is None:  # not read through init_from_connect
            await self._original_handle_disconnect(session, handler, disconnect_waiter)
            _keep_the_newer_connection_connected(self.broker, session, handler)
            await self.forget_session(session.client_id)
            return
        if will.topic is not None and not isinstance(disconnect_waiter.result(), DisconnectPacket):
            log.debug("%s disconnected abnormally: publishing its will", session.client_id)
            await self.broker._broadcast_message(session, will.topic, will.message, will.qos)
            if will.retain:
                await self.broker.retain_message(session, will.topic, will.message, will.qos)
        decided: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        decided.set_result(DisconnectPacket())
        await self._original_handle_disconnect(session, handler, decided)
        _keep_the_newer_connection_connected(self.broker, session, handler)
        await self.forget_session(session.client_id)  # its durable session ended while it was connected

    async def forget_session(self, client_id: str) -> None:
        """amqtt's Session of ``client_id`` goes once the client id has neither a connection nor a
        durable session (its session expired, or ended by end_session while connected): amqtt's
        session monitor removes only anonymous and clean ones, so with a password plugin every
        durable client id stayed in its table for ever (a client cycling fresh client ids grew
        the broker's memory by its sessions every session_expiry). A clean CONNECT's deletion is
        amqtt's own (``delete_session``)."""
        entry = self.broker._sessions.get(client_id)
        if entry is None or entry[0].transitions.state != "disconnected" or self.engine.is_durable(client_id):
            return
        await self.cleanup_session(client_id)

    async def delete_session(self, client_id: str) -> None:
        """A clean CONNECT of a client id whose connection is live: amqtt deleted the Session and
        left that connection open (its take-over runs only for a Session it keeps). MQTT-3.1.4-2:
        the existing client is disconnected, as amqtt's take-over does (``take_over``: its will is
        published, unless it sent DISCONNECT before it was closed), without waiting for it once its
        SUBSCRIBEs and UNSUBSCRIBEs are applied (``durable_let_go``): the CONNECT waited, with its
        ``connect_timeout`` running, for the closing handshake of a websocket client that does not answer it (10 s),
        was closed at connect_timeout with no CONNACK, and so was every reconnect until then.

        amqtt then empties the Session's queues, the messages its client published among them: those
        the broker had acknowledged (PUBACK, PUBCOMP) and that connection's message loop had not yet
        handed to the broker (a loop slow on a topic plugin's check) were lost. They are kept for that
        loop, whose end hands them over (``hand_over_what_is_left``); the new connection's messages
        go after them (``PublishedMessages.follow``)."""
        session, handler = self.broker._sessions.get(client_id, (None, None))
        taken_over = session is not None and handler is not None and session.transitions.is_connected()
        ended = taken_over and _end_handled(handler)  # before the take-over makes its loop handle it
        if taken_over:
            log.info("%s: a clean CONNECT takes the client id over: ending the live connection", client_id)
            await take_over(handler)
            await handler.stop()
        await _keeping_what_was_published(session, self._original_delete_session, client_id)
        # An ended one (its end handled before the take-over) is followed until its bound; a live one until all are
        # handed (``follow``).
        published = getattr(handler, "durable_published", None) if taken_over else None
        _TAKEN_OVER.set(None if published is None else (published, ended))

    async def client_message_loop(self, session: Any, handler: Any) -> None:
        # By what this connection's CONNECT asked for: a clean connection must never drive the
        # durable session of the same client id that another connection created meanwhile.
        durable = not handler.connect_clean_session and self.engine.is_durable(session.client_id)
        transport: HandlerTransport = handler.durable_transport
        read_access = _read_access(self.broker, session)
        handler.durable_loop_task = asyncio.current_task()
        displaced = await self.engine.attach(session.client_id, transport, read_access) if durable else None
        try:
            # MQTT-3.1.4-2: the connection whose CONNECT came last has the session; an older one is
            # ended. amqtt does it only when both share its Session, not when their CONNECTs were read
            # at the same time (after a restart, say); left open, it would be connected, sent nothing.
            if isinstance(displaced, HandlerTransport) and not displaced.closed:
                log.info("%s: a newer connection took the durable session: ending the older one", session.client_id)
                await displaced.end()
            if durable and self.engine.superseded(session.client_id, transport):
                log.info("%s: a newer connection has the durable session: ending this one", session.client_id)
                await handler.handle_connection_closed()  # as a take-over (``take_over``)
            await self._original_message_loop(session, handler)
        finally:
            handler.durable_published.end()
            handler.durable_control.stop()
            _drop_waiting_changes(handler.durable_changes, session.client_id)
            # amqtt leaves the connection open when its loop ends on a bad PUBLISH topic.
            await handler.stop()
            if durable:
                await self.engine.detach(session.client_id, transport, broker_stopping=self.shutting_down)
            try:  # last: nothing is read any more, and nothing above is skipped if it fails
                await hand_over_what_is_left(self.broker, session, handler)
            except Exception as exc:  # as amqtt's loop would have ended on it
                log.warning("%s: a message it published was not delivered: %r", session.client_id, exc)

    async def add_subscription(self, subscription: tuple[str, int], session: Any) -> int:
        topic_filter, qos = subscription
        if not filter_is_valid(topic_filter) or qos not in (0, 1, 2):
            return _SUBSCRIBE_REFUSED  # as a durable session's; amqtt alone granted an empty filter
        if not self.engine.is_durable(session.client_id):
            return await self._add_clean_subscription(subscription, session)
        if self.engine.committer.failure is not None:
            log.warning("%s: SUBSCRIBE %s refused: the store cannot write now", session.client_id, topic_filter)
            return _SUBSCRIBE_REFUSED
        if self.over_limit(self.engine.index, session.client_id, topic_filter):
            return _SUBSCRIBE_REFUSED
        if not await self.broker._topic_filtering(session, topic_filter, Action.SUBSCRIBE):
            return _SUBSCRIBE_REFUSED
        # The QoS asked is granted: amqtt 0.12.1's config has no max-qos (BrokerConfig refuses it).
        # Retained messages are queued with the subscription, before any live message can be.
        retained = [
            (topic, bytes(message.data), qos if message.qos is None else min(qos, message.qos))
            for topic, message in self.retained.matching(topic_filter)
        ]
        if self.broker.plugins_manager._topic_plugins:  # what the user may not read is not even queued
            retained = [item for item in retained if await _may_read(self.broker, session, item[0])]
        self.engine.add_subscription(session.client_id, topic_filter, qos, retained)  # stored by the SUBSCRIBE
        return qos

    async def _add_clean_subscription(self, subscription: tuple[str, int], session: Any) -> int:
        """amqtt's, mirrored in ``amqtt_index``, a repeated SUBSCRIBE replacing the QoS it holds."""
        topic_filter, _ = subscription
        if self.over_limit(self.amqtt_index, session.client_id, topic_filter):
            return _SUBSCRIBE_REFUSED
        granted = int(await self._original_add_subscription(subscription, session))
        if granted != _SUBSCRIBE_REFUSED:
            self.amqtt_index.add(session.client_id, topic_filter, granted)
            # amqtt 0.12.1 keeps an entry the session already holds, QoS and all: a repeated
            # SUBSCRIBE replaces the subscription, its QoS the one granted (MQTT-3.8.4-3).
            # Only for the client id's current session: a late SUBSCRIBE of a connection taken over
            # must not point the entry back at the old, dead session.
            if self.broker._sessions.get(session.client_id, (None,))[0] is session:
                entries = self.broker._subscriptions[topic_filter]
                for position, (target, _) in enumerate(entries):
                    if target.client_id == session.client_id:
                        entries[position] = (session, granted)
        return granted

    async def handle_subscription(self, session: Any, handler: Any, waiter: Any) -> None:
        """The loop's next SUBSCRIBE or UNSUBSCRIBE, in arrival order (one queue for both, see
        ``_one_queue_of_subscription_changes``), taken off the queue once applied; not applied
        if the queue was closed (the connection's end stopped waiting) since it was taken."""
        change = waiter.result()
        changes: SubscriptionChanges[Any] | None = getattr(handler, "durable_changes", None)
        if changes is not None and not changes.start(change):
            return
        try:
            if isinstance(change, UnSubscription):
                await self.handle_unsubscription(session, handler, waiter)
            else:
                await self._handle_subscribe(session, handler, waiter)
        finally:
            if changes is not None:
                changes.done(change)

    async def _handle_subscribe(self, session: Any, handler: Any, waiter: Any) -> None:
        """amqtt's, for a durable session with one commit before the SUBACK for all the filters."""
        if not self.engine.is_durable(session.client_id):
            await self._original_subscription(session, handler, waiter)
            return
        subscriptions = waiter.result()
        codes = [await self.add_subscription(subscription, session) for subscription in subscriptions.topics]
        # A SUBSCRIBE refused whole stored nothing, so its SUBACK waits for no commit: while the
        # store cannot write, its 0x80 comes at once, not once the store writes again.
        try:
            if any(code != _SUBSCRIBE_REFUSED for code in codes):
                await self.engine.committer.commit(urgent=True)
        except NotPrimaryError as exc:  # demoted meanwhile: the demotion ends this connection
            log.info("%s: SUBSCRIBE refused: %s", session.client_id, exc)
            codes = [_SUBSCRIBE_REFUSED] * len(codes)
        await handler.mqtt_acknowledge_subscription(subscriptions.packet_id, codes)
        for (topic_filter, qos), code in zip(subscriptions.topics, codes, strict=True):
            if code != _SUBSCRIBE_REFUSED:  # retained messages were queued with the subscription
                await self.broker.plugins_manager.fire_event(
                    BrokerEvents.CLIENT_SUBSCRIBED, client_id=session.client_id, topic=topic_filter, qos=qos
                )

    async def handle_unsubscription(self, session: Any, handler: Any, waiter: Any) -> None:
        if not self.engine.is_durable(session.client_id):
            await self._original_unsubscription(session, handler, waiter)
            return
        unsubscription = waiter.result()
        for topic_filter in unsubscription.topics:
            self.engine.remove_subscription(session.client_id, topic_filter)
        try:
            await self.engine.committer.commit(urgent=True)
        except NotPrimaryError as exc:  # demoted meanwhile: no UNSUBACK for what is not stored
            _abort(handler.writer)
            filters = ", ".join(unsubscription.topics)
            raise MQTTError(f"{session.client_id}: UNSUBSCRIBE {filters} not stored: {exc}") from None
        for topic_filter in unsubscription.topics:
            await self.broker.plugins_manager.fire_event(
                BrokerEvents.CLIENT_UNSUBSCRIBED, client_id=session.client_id, topic=topic_filter
            )
        await handler.mqtt_acknowledge_unsubscription(unsubscription.packet_id)

    def del_subscription(self, topic_filter: str, session: Any) -> int:
        # amqtt's one way out of its table (UNSUBSCRIBE, session deletion, clean-up all call it).
        deleted = int(self._original_del_subscription(topic_filter, session))
        if deleted:
            self.amqtt_index.remove(session.client_id, topic_filter)
        return deleted

    async def del_all_subscriptions(self, session: Any) -> None:
        # amqtt 0.12.1's, over the session's own filters instead of every filter of the table.
        for topic_filter in self.amqtt_index.filters_of(session.client_id):
            if self.del_subscription(topic_filter, session) and not self.broker._subscriptions.get(topic_filter, True):
                del self.broker._subscriptions[topic_filter]

    async def run_broadcast(self, running_tasks: deque[asyncio.Task[Any]]) -> None:
        # amqtt 0.12.1's _run_broadcast, step for step, but over the matching filters only, and its
        # sends bounded per connection (CleanSends) instead of appended to ``running_tasks``; and
        # none to a connection whose CONNACK is not written yet (MQTT-3.2.0-1: CONNACK comes first).
        # amqtt's take-over puts the newer connection in its table before its CONNACK, and the
        # messages of the older connection's clean session went to it first: that session ended
        # with the older connection (a durable CONNECT's session holds none of its filters, and a
        # clean CONNECT's new Session none before it SUBSCRIBEs).
        broadcast = await self.broker._broadcast_queue.get()
        topic = broadcast["topic"]
        if topic is None:
            return
        data = broadcast["data"]
        # Never more than the message's own QoS (MQTT-3.8.4-6): a publish's, or the one forced (wills,
        # $SYS); amqtt 0.12.1 gave every subscriber its subscription's QoS, or the forced one.
        most = data.qos if isinstance(data, RoutedPayload) else broadcast.get("qos", QOS_2)
        for topic_filter in list(self.amqtt_index.matching_filters(topic)):
            for target, sub_qos in list(self.broker._subscriptions.get(topic_filter, ())):
                qos = min(most, sub_qos)
                if not await self.broker._topic_filtering(target, topic=topic, action=Action.RECEIVE):
                    continue
                connected = target.transitions.state == "connected"
                if not connected and not target.clean_session and qos in (QOS_1, QOS_2) and not target.is_anonymous:
                    await self.broker._retain_broadcast_message(broadcast, qos, target)
                    continue
                handler = self.broker._get_handler(target) if connected else None
                if handler and getattr(handler, "durable_connack_sent", False):  # create_offline_session sets none
                    self.clean_sends.send(handler, target.client_id, topic, data, qos)

    async def publish_retained_for_subscription(self, subscription: tuple[str, int], session: Any) -> None:
        """Retained messages for a subscription the session holds, and only those it may receive.
        Durable sessions got theirs queued with the subscription (add_subscription), and none on a
        mere reconnect (MQTT-3.3.1-6). amqtt also calls this at every CONNECT with every filter of
        its table, whoever holds it, and checks no RECEIVE: a client could read retained messages
        of topics it may neither subscribe to nor receive."""
        topic_filter, qos = subscription
        if self.engine.is_durable(session.client_id) or not self.amqtt_index.holds(session.client_id, topic_filter):
            return
        handler = self.broker._get_handler(session)
        if handler is None:
            return
        retained = self.retained.matching(topic_filter)
        if self.broker.plugins_manager._topic_plugins:
            retained = [
                item for item in retained
                if await self.broker._topic_filtering(session, item[0], Action.RECEIVE)
            ]
        await handler.durable_retained_acks.room()
        no_id: list[str] = []
        for sent, (topic, message) in enumerate(retained, 1):  # each at most its own QoS, as durable sessions get it
            if handler.durable_transport.closed:  # reset, say: the rest would each log a failed write
                break  # (a `#` over 30,000 by a client that reset: 28,000 lines, 2.1 MB of log)
            if sent % RETAINED_RUN == 0:
                await asyncio.sleep(0)  # a write that need not wait does not yield: others' turn
            if (message := self.retained.get(topic)) is None:  # the current value: a newer one may
                continue  # have gone out live meanwhile, and the client must end with it (deleted: none)
            sent_qos = qos if message.qos is None else min(qos, message.qos)
            if not (sent_qos and no_id) and await _send_acked(handler, topic, message.data, sent_qos, retain=True):
                continue
            no_id.append(topic)  # once one found no packet id, the rest at QoS 1/2 are not tried
        if no_id:
            _log_retained(handler, NO_ID, session.client_id, len(no_id), "retained", no_id[0])

    async def broadcast_message(
        self,
        session: Any, topic: str | None, data: bytes | bytearray | None, force_qos: int | None = None
    ) -> None:
        if topic is not None and topic.startswith(CONTROL_PREFIX):
            return  # control traffic (a QoS 2 request, a will) never reaches subscribers
        if self.engine.serving and not isinstance(data, RoutedPayload) and topic is not None and data is not None:
            # No QoS given means "the subscription's", as amqtt's own broadcast does.
            qos = 2 if force_qos is None else force_qos
            try:
                self.engine.route_publish(topic, bytes(data), qos, await self.receivers(topic))
            except StoreUnavailableError:
                log.info("%s not queued for durable sessions: the store cannot write now", topic)
        await self._original_broadcast(session, topic, data, force_qos)

    async def cleanup_session(self, client_id: str) -> None:
        # amqtt's session monitor picks disconnected anonymous sessions, then cleans them up one
        # by one with awaits in between: a client that reconnected meanwhile would lose its new
        # connection. Only shutdown cleans up connected sessions.
        entry = self.broker._sessions.get(client_id)
        if not self.shutting_down and entry is not None and entry[0].transitions.state == "connected":
            return
        # A connection's end (a clean session's, a take-over's) cleans up before its message loop's
        # end hands over what its client published: kept (``_keeping_what_was_published``).
        await _keeping_what_was_published(None if entry is None else entry[0], self._original_cleanup, client_id)

    def apply_retained(self, topic: str, payload: bytes, qos: int) -> None:
        """The engine stored (empty payload: deleted) a retained message: amqtt's table does the same,
        in the same order, and amqtt's retained-message event fires as amqtt's own retain would."""
        table = self.broker.retained_messages
        if payload:
            message = table[topic] = RetainedApplicationMessage(None, topic, payload, qos)
        else:
            message = table.pop(topic, None)
            if message is None:
                return
            message.data = b""
        plugins = self.broker.plugins_manager
        if BrokerEvents.RETAINED_MESSAGE in plugins._event_plugin_callbacks:
            fired = asyncio.get_running_loop().create_task(
                plugins.fire_event(BrokerEvents.RETAINED_MESSAGE, client_id=None, retained_message=message)
            )
            self.event_tasks.add(fired)
            fired.add_done_callback(self.event_tasks.discard)


    async def retain_message(self, session: Any, topic: str, data: Any, qos: int | None = None) -> None:
        # A publish's retain (its payload a RoutedPayload) was stored and applied with the publish.
        if topic.startswith(CONTROL_PREFIX) or isinstance(data, RoutedPayload):
            return
        if topic.startswith("$"):  # the broker's own state ($SYS store health): memory only, never stale
            self.apply_retained(topic, bytes(data or b""), qos or 0)
            return
        if not self.engine.serving:
            log.warning("the retained message of %s is not stored: %s", topic, NOT_SERVING)
            return
        try:
            await self.engine.retain(topic, bytes(data or b""), qos or 0)  # a will's (or a plugin's)
        except StoreError as exc:
            log.error("the retained message of %s is not stored (it is lost at the next restart): %s", topic, exc)

    async def shutdown(self) -> None:
        self.shutting_down = True
        await self._original_shutdown()
        await self.clean_sends.stop()  # as amqtt cancels its broadcast tasks


async def _keeping_what_was_published(
    session: Any, remove: Callable[[str], Awaitable[None]], client_id: str
) -> None:
    """amqtt's deletion (a clean CONNECT's) or clean-up (a connection's end) of ``client_id``'s
    Session, which empties its queues, but the messages its client published are kept: those the
    broker had acknowledged (PUBACK, PUBCOMP) and the connection's message loop had not yet handed
    to the broker (a loop slow on a topic plugin's check, a connection that took over waiting for
    the older one, ``PublishedMessages.follow``) were lost. That loop's end hands them over
    (``hand_over_what_is_left``). The queue itself stays in place (a message read meanwhile goes to it)."""
    if session is None:
        await remove(client_id)
        return
    session.durable_keeping = getattr(session, "durable_keeping", 0) + 1
    session.clear_queues = partial(_clear_retained_only, session)
    try:
        await remove(client_id)
    finally:
        session.durable_keeping -= 1
        if not session.durable_keeping:
            del session.clear_queues  # amqtt's own again


def _clear_retained_only(session: Any) -> None:
    """amqtt's ``clear_queues`` without the queue of what the client published."""
    while not session.retained_messages.empty():
        session.retained_messages.get_nowait()


def _abort(writer: Any) -> None:
    """End a connection at once, without a write more: TCP and websocket (whose writer amqtt
    would otherwise keep writing PUBACKs to until its handler notices)."""
    if writer is None:
        return
    writer.is_closed = True  # HandlerTransport writes nothing more to it
    if isinstance(writer, StreamWriterAdapter):
        writer._writer.transport.abort()
        return
    transport = getattr(getattr(writer, "_protocol", None), "transport", None)  # amqtt's WebSocketsWriter
    if transport is not None:
        transport.abort()


async def let_go(writer: Any) -> None:
    """Close a connection without waiting for its client: a TCP one as ``close_socket`` does (its
    unsent bytes still go, for at most CLOSE_GRACE), a websocket one at once (``_abort``), without
    the closing handshake, for whose answer websockets waits up to its close_timeout, 10 s."""
    if isinstance(writer, StreamWriterAdapter):
        await close_socket(writer)
    else:
        _abort(writer)


def _peer(writer: Any) -> str:
    peer = writer.get_peer_info()
    return "an unknown address" if peer is None else f"{peer[0]}:{peer[1]}"


def _malformed_publish(packet: Any) -> str | None:
    """What amqtt's decoder lets through: QoS 3. The topic is checked while it is decoded, so the
    parts add up to the packet's remaining length (see _install_decoder_checks)."""
    if packet.topic_name is None or packet.data is None:
        return "the PUBLISH has no topic or payload"
    if packet.qos not in (0, 1, 2, None):
        return "QoS 3 is reserved (MQTT-3.3.1-4)"
    return None


def _intercept_acks(handler: Any, unexpected: LogBudget) -> None:
    """The connection's PUBACK, PUBREC and PUBCOMP handlers, wrapped (``_ack_interceptor``), sharing
    one budget of log lines for the acks nothing awaits."""
    handler.handle_puback = _ack_interceptor(handler, "puback", handler.handle_puback, unexpected)
    handler.handle_pubrec = _ack_interceptor(handler, "pubrec", handler.handle_pubrec, unexpected)
    handler.handle_pubcomp = _ack_interceptor(handler, "pubcomp", handler.handle_pubcomp, unexpected)


def _ack_interceptor(
    handler: Any, kind: AckKind, original: Callable[[Any], Awaitable[None]], unexpected: LogBudget
) -> Callable[[Any], Awaitable[None]]:
    """Acks of pump-sent messages go to the pump; one amqtt waits for to its waiter. Any other is
    ignored with a WARNING at most once per ``drop_log_interval`` (``unexpected``, the connection's):
    amqtt logged one per packet, so a client sending 4-byte acks of ids nothing awaits wrote some
    100 bytes of log for each."""

    async def handle_ack(packet: Any) -> None:
        packet_id = packet.variable_header.packet_id if kind == "puback" else packet.packet_id
        if handler.durable_transport.take_ack(kind, packet_id):
            return
        waiter = getattr(handler, f"_{kind}_waiters").get(packet_id)
        if waiter is not None and not waiter.done():
            await original(packet)
            return
        left_out = unexpected.take()
        if left_out is not None:
            also = f" ({left_out} more such ack(s) since the last line)" if left_out else ""
            log.warning(
                "%s: %s of packet id %d ignored: no message sent to this connection awaits it%s",
                handler.session.client_id,
                kind.upper(),
                packet_id,
                also,
            )

    return handle_ack


class AwaitingPubrel:
    """The QoS 2 publishes of one client between their PUBLISH and their PUBREL, bounded by
    ``max_awaiting_pubrel``: amqtt holds each in memory (its Session's ``inflight_in``) until its
    PUBREL, for as long as it keeps the Session, so also those an earlier connection of a durable
    session left awaiting (carried over to the next connection). Counted by packet id (a re-send
    of one that awaits, carried over or not, counts once), from the moment its handling starts:
    handlers start in arrival order, so a burst read at once is counted before any of it is stored.
    A PUBREL frees the place of its id, carried over or not. A client holding the limit or more
    already (two connections of its client id adding at once) can still re-send and release those;
    only new ids are refused until it is below the limit."""

    def __init__(
        self, client_id: str, limit: int, held: dict[int, Any], releases: dict[int, int] | None = None
    ) -> None:
        self.client_id = client_id
        self.limit = limit
        self.held = held
        """The Session's publishes awaiting their PUBREL (amqtt's ``inflight_in``), by packet id."""
        self.releases: dict[int, int] = {} if releases is None else releases
        """The Session's (shared by its connections): packet id -> PUBRELs of it handled so far. A
        handler of a PUBLISH (a DUP re-send on one connection during a take-over) that a PUBREL of
        its id (read on the other) overtook does not hold the message again (``_await_pubrel``):
        ``open`` is this connection's only."""
        self.open: dict[int, int] = {}
        """packet id -> handlers of it under way (a re-send's and the first copy's), not yet in ``held``."""
        self._after: dict[int, list[Callable[[], None]]] = {}
        """packet id -> what waits for its handlers to end (a PUBREL read while they run)."""
        self.handling: set[asyncio.Future[None]] = set()
        """The handlings under way (``_bounded_qos2``), held until they end."""

    def count(self) -> int:
        return len(self.held) + sum(1 for packet_id in self.open if packet_id not in self.held)

    def admit(self, packet_id: int) -> bool:
        new = packet_id not in self.open and packet_id not in self.held
        if new and self.limit and self.count() >= self.limit:
            log.warning(
                "closing the connection of %s: a QoS 2 PUBLISH (packet id %d) while %d QoS 2 publishes of this "
                "client await their PUBREL (this connection's and those an earlier one left), max_awaiting_pubrel "
                "is %d. The client does not answer PUBREC with PUBREL; if it is only slow, the operator can raise "
                "max_awaiting_pubrel (0 = no limit)",
                self.client_id,
                packet_id,
                self.count(),
                self.limit,
            )
            return False
        self.open[packet_id] = self.open.get(packet_id, 0) + 1
        return True

    def done(self, packet_id: int) -> None:
        left = self.open[packet_id] - 1
        if left:
            self.open[packet_id] = left
            return
        del self.open[packet_id]
        for then in self._after.pop(packet_id, ()):
            then()

    def released(self, packet_id: int) -> None:
        """A PUBREL of ``packet_id`` has been handled (its message, if held, has left ``held``)."""
        self.releases[packet_id] = self.releases.get(packet_id, 0) + 1

    def releases_of(self, packet_id: int) -> int:
        return self.releases.get(packet_id, 0)

    def after(self, packet_id: int, then: Callable[[], None]) -> None:
        """Runs ``then`` once the handlers of ``packet_id`` under way (``open``) have ended."""
        self._after.setdefault(packet_id, []).append(then)


async def _bounded_qos2(
    broker: Any,
    engine: DurableEngine,
    handler: Any,
    session: Any,
    packet: Any,
    *,
    awaiting: AwaitingPubrel,
    receivers: Callable[[str], Awaitable[dict[str, int] | None]],
) -> None:
    """A QoS 2 PUBLISH (control request or message), counted in ``awaiting`` until its PUBREL.

    Its handling goes on when the reader's task for it is cancelled (both readers cancel the tasks
    under way at the connection's end): a PUBREL read right behind it waits for that handling
    (``AwaitingPubrel.after``) and the connection's end waits for that PUBREL (bounded,
    ``PublishedMessages.handed_over``). Cancelled, a PUBLISH and its PUBREL sent with a DISCONNECT
    or right before an EOF got a PUBCOMP without a PUBREC, the message never stored or delivered."""
    packet_id = packet.variable_header.packet_id  # amqtt's decoder reads one for QoS 1 and 2
    if not awaiting.admit(packet_id):
        await end_connection(handler)
        return

    releases = awaiting.releases_of(packet_id)

    def not_released() -> bool:
        """No PUBREL of this id was handled since this handling began."""
        return awaiting.releases_of(packet_id) == releases

    async def handle() -> None:
        try:
            if packet.topic_name.startswith(CONTROL_PREFIX):
                _control_qos2(handler, session, packet)
            else:
                await _publish_qos2(broker, engine, handler, session, packet, receivers=receivers, hold=not_released)
        finally:
            awaiting.done(packet_id)  # from here on counted in the Session's inflight_in, if it got PUBREC

    task = asyncio.ensure_future(handle())
    awaiting.handling.add(task)
    task.add_done_callback(awaiting.handling.discard)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        task.add_done_callback(partial(_failure_logged, session.client_id))
        raise


def _failure_logged(client_id: str, task: asyncio.Future[None]) -> None:
    """A QoS 2 PUBLISH's handling no one awaits any more (the reader's task was cancelled) has
    ended: its error, if any, is logged."""
    if not task.cancelled() and task.exception() is not None:
        log.warning("%s: a QoS 2 PUBLISH's handling failed: %r", client_id, task.exception())


def _wrap_handler(
    broker: Any,
    engine: DurableEngine,
    handler: Any,
    session: Any,
    *,
    amqtt_wants: Callable[[str], bool],
    receivers: Callable[[str], Awaitable[dict[str, int] | None]],
) -> None:
    """Per-connection wrappers: persist before acknowledging, and the stored session-present."""
    original_connack = handler.mqtt_connack_authorize
    ordering = asyncio.Lock()
    handler.durable_ordering = ordering
    awaiting = AwaitingPubrel(
        session.client_id,
        engine.config.max_awaiting_pubrel,
        session.inflight_in,
        session.__dict__.setdefault("durable_pubrels_handled", {}),
    )

    async def handle_publish(packet: Any) -> None:
        topic = packet.topic_name
        data = packet.data
        problem = _malformed_publish(packet)
        if problem is not None:  # before anything is stored, routed or acknowledged
            log.warning("closing the connection of %s: PUBLISH refused: %s", session.client_id, problem)
            await end_connection(handler)
            return
        qos = packet.qos or 0
        packet_id = packet.variable_header.packet_id if packet.variable_header else None
        control = topic.startswith(CONTROL_PREFIX)
        if qos == 2:
            await _bounded_qos2(
                broker,
                engine,
                handler,
                session,
                packet,
                awaiting=awaiting,
                receivers=receivers,
            )
            return
        publishes: InboundPublishes = handler.durable_publishes
        retain = bool(packet.retain_flag)
        async with ordering:  # FIFO per connection even when topic ACL checks yield
            if control:
                publishes.control(topic, bytes(data), qos, packet_id)
            elif await broker._topic_filtering(session, topic, Action.PUBLISH):
                targets = await receivers(topic)
                publishes.route(topic, bytes(data), qos, packet_id, retain=retain, targets=targets)
            else:  # refused by the topic ACL: not stored; amqtt's own delivery decides as it would
                publishes.hand_over(topic, bytes(data), qos, packet_id, retain=retain, stored=None)

    async def connack_authorize(authorize: bool) -> None:
        _CONNECTING.set(None)  # amqtt's take-over, if any, is done
        _connected_for_its_connack(session, authorize)
        if not authorize:  # amqtt's own authentication failed: it would keep this Session for ever
            _forget_refused(broker, engine, handler, session)
            handler.durable_published.refused()  # before its CONNACK gives the client id's turn back
        if authorize and not engine.serving:  # demoted since its CONNECT was read (checked there too)
            why = f"{session.client_id}: CONNECT refused with CONNACK 3 (server unavailable): {NOT_SERVING}"
            await _refuse_connect(handler, session, SERVER_UNAVAILABLE, why)
        if authorize and session.client_id:
            await _connect_durable(broker, engine, handler, session)
        await _send_connack(handler, session, original_connack, authorize)

    handler.handle_publish = handle_publish
    handler.mqtt_connack_authorize = connack_authorize
    _intercept_acks(handler, LogBudget(engine.config.drop_log_interval))
    handler.durable_retained_log = LogBudget(engine.config.drop_log_interval)
    handler.durable_retained_acks = RetainedAcks(partial(_retained_ack_expired, handler, session))
    handler.handle_pubrel = _pubrel_handler(engine, handler, session, awaiting)
    # The changes' queue first: _keep_the_disconnect's wait_disconnect then answers once the changes
    # are applied, so a DISCONNECT read meanwhile (during a take-over's wait) discards the will.
    _one_queue_of_subscription_changes(handler, engine.config.connection_end_wait)
    _keep_the_disconnect(handler)
    handler.start = _end_a_connection_closed_during_start(handler, handler.start)
    handler.stop = _stop_waiting_for_a_reader_that_may_never_run(
        handler, handler.stop, engine.config.connection_end_wait
    )
    handler._retry_deliveries = _retry_without_waiting_for_pubrel(handler)


async def _send_connack(
    handler: Any, session: Any, original_connack: Callable[[bool], Awaitable[None]], authorize: bool
) -> None:
    """amqtt's CONNACK. A client that closed before it: amqtt's write catches only a reset, so over
    a websocket websockets' ConnectionClosed escaped its connection handling (an ERROR "connection
    handler failed") and nothing after ran: no attach, no detach, so a new durable session never
    expired (and held its place of max_durable_sessions), and amqtt kept its Session "connected"
    for ever. The connection now ends as any other: its loop runs, finds it closed (attach does
    nothing) and its end starts the session's expiry clock; amqtt forgets a clean one's Session."""
    try:
        await original_connack(authorize)
        handler.durable_connack_sent = authorize
    except (ConnectionClosed, OSError) as exc:
        log.debug("%s: the connection closed before its CONNACK: %r", session.client_id, exc)
        handler.writer.is_closed = True  # HandlerTransport.closed: nothing more is written to it
        await handler.handle_connection_closed()
    finally:
        _end_connect_turn(handler.writer)  # the client id's next CONNECT takes this connection over


def _forget_refused(broker: Any, engine: DurableEngine, handler: Any, session: Any) -> None:
    """A CONNECT that failed amqtt's authentication: amqtt has put its Session in its table, marked
    connected, and never removes it (its session monitor skips connected Sessions, and
    ``forget_session`` disconnected ones), so every failed login with a fresh client id (a
    generated one too) grew the broker's memory for ever. The entry it replaced (noted by
    ``authenticate`` as the check failed: a connection of the same client id that connected while
    this one was checked, which then got nothing) is put back; with none, the entry goes, unless a
    durable session has the client id (bounded by ``max_durable_sessions``). Nothing changes if
    another connection's Session replaced it since."""
    client_id = session.client_id
    entry = broker._sessions.get(client_id)
    if entry is None or entry[1] is not handler:
        return
    before = getattr(session, "durable_entry_before", None)
    if before is not None:
        broker._sessions[client_id] = before
    elif not engine.is_durable(client_id):
        del broker._sessions[client_id]


def _end_a_connection_closed_during_start(
    handler: Any, original: Callable[[], Awaitable[None]]
) -> Callable[[], Awaitable[None]]:
    """amqtt's ``start()`` starts the reader task, waits for it to be ready, and only then makes
    the disconnect waiter its message loop waits on. A client that closed right after its CONNECT
    leaves an EOF the reader reads at once: it ends (signalling the disconnect to no waiter)
    before that waiter exists, and nothing resolved it: the message loop waited for ever, holding
    its listener slot, and a durable session never detached, so it never expired. The end is
    signalled again once the waiter exists, with the DISCONNECT the reader read, if any (so no will
    is published for it, see ``_keep_the_disconnect``)."""

    async def start() -> None:
        await original()
        task = handler._reader_task
        if task is not None and task.done():
            await handler.handle_disconnect(handler.durable_disconnect)

    return start


def _retry_without_waiting_for_pubrel(handler: Any) -> Callable[[], Awaitable[None]]:
    """amqtt's ``start()`` ends with ``_retry_deliveries`` (MQTT-4.4.0-1), which also re-ran the flow
    of each inbound QoS 2 publish of a reconnecting durable publisher still awaiting its PUBREL (no
    crash between: after one amqtt remembers none): PUBREC again, then up to 10 s for the PUBREL.
    ``start()`` waited for it, and with it the connection's message loop: a client that did not
    send that PUBREL at once (one whose process restarted, or that subscribed first) got its SUBACK
    and PUBCOMP 10 s late; then the flow was cancelled, so its message never reached clean
    subscribers. Here the PUBREC of each goes again and nothing waits: its PUBREL, whenever it is
    read, releases the message (``_pubrel_handler``); one read before this ran (in the same write as
    the CONNECT) released it already, so no PUBREC goes for it. amqtt's retry of outbound messages
    (clean sessions only: the pump sends durable ones) is as it was."""

    async def retry_deliveries() -> None:
        session = handler.session
        for packet_id in list(session.inflight_in):
            handler.durable_transport.write(encode_pubrec(packet_id))
        outbound = [
            asyncio.create_task(asyncio.wait_for(handler._handle_message_flow(message), 10))
            for message in list(session.inflight_out.values())
        ]
        if outbound:
            await asyncio.wait(outbound)

    return retry_deliveries


def _keep_the_newer_connection_connected(broker: Any, session: Any, handler: Any) -> None:
    """amqtt's take-over (a durable CONNECT of a connected client id) gives the new connection the
    old one's Session, and the old connection's end (amqtt's ``_handle_disconnect``) then marks that
    shared Session disconnected while the new one is live. amqtt's session monitor (once a second)
    removes a disconnected anonymous Session and stops the connection its table holds: the new one,
    closed right after its CONNACK (MQTT-3.1.4-2: the newest connection must win). The Session is
    marked connected again right after that mark, with no await between; it used to be at the end
    of the old connection's message loop, after its handler's stop and the store's detach, and a
    monitor pass in between closed the newest connection (rapid durable take-overs of four client
    ids for 9 s: in 7 runs of 8). Not when the connection in amqtt's table ended too
    (``durable_disconnected``): a Session marked connected with no connection would never be
    removed. A new connection not yet in the table when the old one ended marks it connected at its
    CONNACK (``_connected_for_its_connack``)."""
    current_session, current = broker._sessions.get(session.client_id, (None, None))
    if (
        current_session is session
        and current is not None
        and current is not handler
        and not _end_handled(current)
        and session.transitions.state == "disconnected"
    ):
        session.transitions.connect()


def _end_handled(handler: Any) -> bool:
    """Whether amqtt handles (or has handled) the end of ``handler``'s connection (``handle_disconnect``).
    Read before a take-over of it acts: the take-over ends it, and its loop then handles that end
    (``PublishedMessages.follow``)."""
    return bool(getattr(handler, "durable_disconnected", False))


def _connected_for_its_connack(session: Any, authorize: bool) -> None:
    """A CONNECT that took over a connection whose end (amqtt's ``_handle_disconnect``) marked their
    shared Session disconnected while the take-over waited for it, before this one was in amqtt's
    table (``_keep_the_newer_connection_connected`` then left it so): connected again as its CONNACK
    is due, with no await since amqtt put it in its table."""
    if authorize and session.transitions.state == "disconnected":
        session.transitions.connect()


async def take_over(handler: Any) -> None:
    """End the connection of a client id a newer CONNECT takes over (MQTT-3.1.4-2), as amqtt's own
    take-over does (the handler's ``durable_ended_by_take_over``: its end waits for the reader, see
    ``_applied_with_what_was_read``): its message loop sees it closed and runs amqtt's disconnect, whose will is
    published unless the connection sent DISCONNECT before it was closed (MQTT-3.14.4-3: read
    while the take-over waited for its SUBSCRIBEs and UNSUBSCRIBEs, it discards the will, as on
    amqtt's take-over; a clean CONNECT's published it); it is let go once those are applied
    (``durable_let_go``: a websocket aborted, not waited for)."""
    handler.durable_ended_by_take_over = True
    await handler.handle_connection_closed()
    await handler.durable_let_go()


async def end_connection(handler: Any) -> None:
    """End a connection on the server's decision: a protocol violation (a malformed PUBLISH, a QoS 2
    PUBLISH past ``max_awaiting_pubrel``), a keep-alive passed without any bytes (``FastReader``), a
    publish that could not be stored (``HandlerTransport.fail``). Its will is published
    (MQTT-3.1.2-8), whatever the client sends after (see ``_keep_the_disconnect``), and the plugin's
    reader handles nothing it reads after (``FastReader``). A take-over is ``take_over``."""
    handler.durable_ended = True
    await handler.handle_connection_closed()


def _keep_the_disconnect(handler: Any) -> None:
    """MQTT-3.14.4-3: a connection that sent DISCONNECT has its will discarded. amqtt hands the
    DISCONNECT to a one-shot disconnect waiter and then drops the waiter; its message loop asks for
    the waiter's result only when it starts, and the end of the connection signals None to
    whatever waiter is left. When the DISCONNECT was read before the loop asked (while the durable
    attach waited for a store commit, or in the same read as CONNECT), the loop found no waiter, or
    a fresh one the connection's end resolved with None, took the None for an abnormal end and
    published the will. The DISCONNECT is now remembered on the handler as it is handed over (when
    the reader calls ``handle_disconnect``, before the task that handles it runs: amqtt's own reader,
    at the connection's end, cancels the handler tasks it started that have not finished), and
    ``wait_disconnect`` answers it whenever amqtt's answer is None.

    Once the server has ended the connection (``durable_ended``), a DISCONNECT read after counts
    for nothing: the plugin's reader handles nothing after it (``FastReader._dispatch_all``), but
    amqtt's own reader goes on handling what it reads until the connection is stopped, and the will
    of a connection ended for a protocol violation is published (MQTT-3.1.2-8). The server's ends
    are ``end_connection``'s callers and whatever the reader task itself ends (a packet the decoder
    checks or ``_BAD_FIRST`` refuse, a second CONNECT among them; at EOF nothing is read after). Not any None: a
    write that fails (amqtt's ``_send_packet``) may come before a DISCONNECT the reader has yet to
    read."""
    original_handle = handler.handle_disconnect
    original_wait = handler.wait_disconnect
    original_closed = handler.handle_connection_closed
    handler.durable_disconnect = None
    handler.durable_ended = False

    def handle_disconnect(disconnect: DisconnectPacket | None) -> Awaitable[None]:
        if handler.durable_ended:
            disconnect = None
        elif isinstance(disconnect, DisconnectPacket):
            handler.durable_disconnect = disconnect
        return original_handle(disconnect)  # type: ignore[no-any-return]

    async def wait_disconnect() -> DisconnectPacket | None:
        result = await original_wait()
        if handler.durable_ended and handler.durable_disconnect is None:
            return None
        return handler.durable_disconnect if result is None else result

    def handle_connection_closed() -> Awaitable[None]:
        task = handler._reader_task
        if task is not None and task is asyncio.current_task():
            handler.durable_ended = True
        return original_closed()  # type: ignore[no-any-return]

    handler.handle_disconnect = handle_disconnect
    handler.wait_disconnect = wait_disconnect
    handler.handle_connection_closed = handle_connection_closed


def _stop_waiting_for_a_reader_that_may_never_run(
    handler: Any, original: Callable[[], Awaitable[None]], end_wait: float
) -> Callable[[], Awaitable[None]]:
    """amqtt's ``stop()`` cancels the connection's reader task, then waits for ``_reader_stopped``,
    which the reader sets as it ends. A task cancelled before its first step never runs its body,
    so nothing set it and ``stop()`` waited for ever: a connection closed right after its CONNECT
    (a device giving up) whose client id connected again at once was taken over inside amqtt's
    CONNECT handling before its reader ran, and the new connection never got its CONNACK. Once
    the task has ended, however it ended, the events are set (``_reader_ready`` too: the old
    connection's set-up then goes on, and its message loop ends as a superseded connection's does).

    Its ``writer.close()`` then waits for the unsent bytes to drain: for a client that does not
    read (its socket full), for ever, and the connection kept its listener slot, its handler and
    every unsent byte. A TCP connection still open the longer of CLOSE_GRACE and ``end_wait``
    (``connection_end_wait``) after ``stop()`` began is aborted, which ends that wait; a websocket
    one too (``_abort``): its close waited for the closing handshake as well (websockets'
    close_timeout, 10 s more). This wraps the ``stop()`` of ``_one_queue_of_subscription_changes``,
    which first waits up to ``end_wait`` for the connection's SUBSCRIBEs and UNSUBSCRIBEs to be
    applied: the abort counts from before that wait, one bound for both (a take-over of a
    connection whose client reads nothing and whose changes wait behind a SUBSCRIBE it cannot
    complete was CONNACKed 10 s later, when the newer connection's ``connect_timeout`` had closed
    it), never shorter than that wait (at CLOSE_GRACE alone, a ``connection_end_wait`` of 12 s
    aborted a closed socket at 5 s, its changes still waiting: their SUBACKs were never written).

    amqtt's take-over of a client id whose Session it keeps (a durable CONNECT of a connected client
    id, MQTT-3.1.4-2) stops the old connection in the new CONNECT's task before its CONNACK
    (``_CONNECTING``): that connection is let go first (``durable_let_go``: once the changes it sent
    are applied), as ``delete_session`` does for a clean CONNECT's; ``stop()`` waited for a
    websocket client's answer to the closing handshake (websockets' close_timeout, 10 s), and the
    new CONNACK with it. The durable session loses
    nothing: its queue and the messages in flight on the old connection are in the store, sent
    again (DUP) on the new one."""

    def reader_ended(_task: Any) -> None:
        handler._reader_ready.set()
        handler._reader_stopped.set()

    async def stop() -> None:
        task = handler._reader_task
        if task is not None and not task.done():
            task.add_done_callback(reader_ended)
        writer = handler.writer
        connecting = _CONNECTING.get()
        if connecting not in (None, handler):  # a newer CONNECT of its client id takes it over
            connecting.durable_published.follow(handler.durable_published, until_released=_end_handled(handler))
            await handler.durable_let_go()
        abort = None
        grace = max(CLOSE_GRACE, end_wait)
        if isinstance(writer, StreamWriterAdapter):
            abort = asyncio.get_running_loop().call_later(grace, writer._writer.transport.abort)
        elif writer is not None:  # a websocket: amqtt's close() waits for the closing handshake too
            abort = asyncio.get_running_loop().call_later(grace, _abort, writer)
        try:
            await original()
        finally:
            if abort is not None:
                abort.cancel()

    return stop


class EndDeadline:
    """The one deadline of a connection's end: ``connection_end_wait`` from its first wait, for all of them. A
    take-over waits twice (``let_go_once_applied``, then ``stop()``), and each wait ran its own
    ``connection_end_wait``: with the connection's message loop stuck (a topic plugin's slow check of what
    the client published), the new CONNACK came after 10 s."""

    def __init__(self, end_wait: float) -> None:
        self._end_wait = end_wait
        self._at: float | None = None

    def timeout(self) -> asyncio.Timeout:
        """A timeout at the end's deadline, set by the first call."""
        if self._at is None:
            self._at = asyncio.get_running_loop().time() + self._end_wait
        return asyncio.timeout_at(self._at)


def _one_queue_of_subscription_changes(handler: Any, end_wait: float) -> None:
    """A connection's SUBSCRIBEs and UNSUBSCRIBEs are applied in the order they arrived, their
    SUBACKs and UNSUBACKs sent in that order (MQTT 3.1.1 section 4.6, 3.10.4), and none the
    connection's reader has handed over is lost at its end. amqtt 0.12.1 queued the two kinds apart
    and its message loop applied a waiting SUBSCRIBE before a waiting UNSUBSCRIBE (``UNSUBSCRIBE f``
    then ``SUBSCRIBE f`` sent back to back left no subscription although the SUBACK granted it);
    once it had a DISCONNECT (or the connection's close) it applied at most one more of each, and
    ``stop()`` emptied both queues (two UNSUBSCRIBEs and a DISCONNECT in one write: a durable
    session kept the second's filter for ever).

    Here both kinds go to one ``SubscriptionChanges`` (``handle_subscribe`` / ``handle_unsubscribe``,
    called by either reader in arrival order, queue the change as they are called, not in the task
    the reader makes of what they return: both readers cancel the tasks that have not run when the
    connection ends, which dropped a change the plugin's reader read right before a protocol
    violation while amqtt's applied it), the loop's subscription waiter takes them one at a
    time (``AmqttHooks.handle_subscription`` passes an UNSUBSCRIBE on) and its unsubscription waiter
    waits until the loop cancels it. The end waits until every change has been applied (at most
    ``connection_end_wait`` from its first wait, one deadline for all its waits; as it begins, the
    retained room opens for good, ``RetainedAcks.ending``: the loop, which applies the changes, would
    wait there for acks that may never come): ``wait_disconnect`` returns the end to the loop only
    then, and ``stop()`` (the reader's at a DISCONNECT, EOF or
    reset, a take-over's, any but the loop's own: the loop cannot apply while it waits there) stops
    the connection only then (so a take-over's CONNACK waits for the older connection's changes,
    and in a reconnect storm for that connection's loop to get its ``attach_limit`` slot first:
    nothing else applies them); that ``stop()`` first cancels the handler's PUBACK/PUBREC/PUBCOMP
    waiters, as amqtt's ``stop()`` does first
    (``_stop_outgoing_waiters``; a clean session's loop writes the retained messages of a
    SUBSCRIBE and goes on: their acks are awaited as entries of ``durable_retained_acks``, which
    every ``stop()``, the loop's own too, ends (``_send_acked``, ``RetainedAcks``). The waiters
    of what amqtt sends after are cancelled as they are added, ``_CancelledAsAdded``: nothing sent
    after that ``stop()`` is waited for).
    The same wait covers what the client published (``PublishedMessages``: the loop hands it to
    the broker, a QoS 2 message released by a PUBREL read with the DISCONNECT among them).
    When a wait runs out, the queue is closed: what still waits is dropped (WARNING with the exact
    count: the change being applied completes, nothing after it is handed out); the published
    messages are not dropped (the loop's end hands them over). Once the loop has ended
    (``close()``) nothing is waited for."""
    changes: SubscriptionChanges[Subscription | UnSubscription] = SubscriptionChanges()
    handler.durable_changes = changes
    handler.durable_loop_task = None
    published = PublishedMessages(handler, end_wait)
    handler.durable_published = published
    original_wait = handler.wait_disconnect
    original_stop = handler.stop

    def handle_subscribe(packet: Any) -> Awaitable[None]:
        changes.add(Subscription(*_packet_id_and_payload(packet, "SUBSCRIBE")))
        return _nothing()

    def handle_unsubscribe(packet: Any) -> Awaitable[None]:
        changes.add(UnSubscription(*_packet_id_and_payload(packet, "UNSUBSCRIBE")))
        return _nothing()

    async def no_unsubscription() -> None:
        await asyncio.get_running_loop().create_future()  # every UNSUBSCRIBE comes as a "subscription"

    end = EndDeadline(end_wait)

    async def applied(*, drain: bool = True) -> None:
        try:
            async with end.timeout():
                await _applied_with_what_was_read(handler, changes)
                await published.handed_over(drain=drain)
        except TimeoutError:  # none is handed out any more: none is applied after the end
            _drop_waiting_changes(changes, handler.session.client_id if handler.session else None)

    async def wait_disconnect() -> DisconnectPacket | None:
        result = await original_wait()
        handler.durable_retained_acks.ending()  # the loop applies the changes, not waiting for acks
        await applied()
        return result

    async def stop() -> None:
        handler.durable_retained_acks.ending()  # amqtt's shutdown signals no end before its stop()
        if asyncio.current_task() is not handler.durable_loop_task:
            _stop_outgoing_waiters(handler)  # nothing sent awaits its ack past the end
            await applied()
        _stop_retained_acks(handler)
        await original_stop()

    async def let_go_once_applied() -> None:
        """A take-over ends the connection without waiting for its client (``let_go``), but only
        once the changes it sent are applied: their SUBACKs and UNSUBACKs go out before the close.
        Every take-over calls ``handle_connection_closed`` first, so ``wait_disconnect`` opens the
        retained room (``RetainedAcks.ending``) for the changes waited for here."""
        _stop_outgoing_waiters(handler)
        await applied(drain=False)  # the replaced client sends its PUBRELs again on the new connection
        await let_go(handler.writer)

    handler.handle_subscribe = handle_subscribe
    handler.handle_unsubscribe = handle_unsubscribe
    handler.get_next_pending_subscription = changes.next
    handler.get_next_pending_unsubscription = no_unsubscription
    handler.wait_disconnect = wait_disconnect
    handler.stop = stop
    handler.durable_let_go = let_go_once_applied
    handler.mqtt_acknowledge_subscription = _unless_lost(handler, handler.mqtt_acknowledge_subscription)
    handler.mqtt_acknowledge_unsubscription = _unless_lost(handler, handler.mqtt_acknowledge_unsubscription)
    _mark_a_take_over(handler)


def _unless_lost(handler: Any, answer: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
    """A SUBACK or UNSUBACK of a change the message loop still applies once the connection is lost
    (its end waits for them) is not written: each write to a TCP connection asyncio lost logged its
    WARNING "socket.send() raised exception." (a client that pipelined 5,000 SUBSCRIBEs, reset its
    connection while 4,096 waited: 3,659 lines, for each such connection)."""

    async def answer_unless_lost(*args: Any) -> None:
        if not handler.durable_transport.closed:
            await answer(*args)

    return answer_unless_lost


def _mark_a_take_over(handler: Any) -> None:
    """The handler's ``durable_ended_by_take_over``: its connection's end is a take-over
    (``_applied_with_what_was_read``), set before its message loop learns of the end (not the
    ``_TAKEN_OVER`` context variable of the newer CONNECT's task). ``take_over`` sets it; amqtt's own
    take-over calls ``handle_connection_closed`` in the newer CONNECT's task (``_CONNECTING``), then
    ``stop()``."""
    handler.durable_ended_by_take_over = False
    original_closed = handler.handle_connection_closed

    def handle_connection_closed() -> Awaitable[None]:
        if _CONNECTING.get() not in (None, handler):
            handler.durable_ended_by_take_over = True
        return original_closed()  # type: ignore[no-any-return]

    handler.handle_connection_closed = handle_connection_closed


async def _applied_with_what_was_read(handler: Any, changes: SubscriptionChanges[Any]) -> None:
    """Waits until every change queued has been applied and, on a take-over
    (``durable_ended_by_take_over``), every change in what the broker had read from the socket as
    that wait ended (``_reader_handles_what_was_read``), then until those are applied too. A reader
    hands a packet over a loop pass or more after the transport read it (amqtt's, a ``wait_for``
    task per packet: of a hundred UNSUBSCRIBEs read in one go, the first alone, or none, was queued
    as the take-over came); the queue, empty before the next was queued, counted as drained, the
    take-over stopped the reader (cancelled) and the UNSUBSCRIBEs still in its stream were never
    applied nor acknowledged. The caller bounds the wait (the end's deadline). A websocket
    connection's reader is not waited for (what websockets holds is not handed over)."""
    await changes.drained()
    if handler.durable_ended_by_take_over and not _reader_caught_up(handler):
        await _reader_handles_what_was_read(handler)
        await changes.drained()


def _reader_caught_up(handler: Any) -> bool:
    """True unless the connection's reader, reading a TCP stream, holds bytes the transport read
    that it has not handled: it is then neither ended nor waiting for more (the stream's waiter is
    gone as soon as bytes come, before the reader goes on). A reader whose loop has ended
    (``_reader_stopped``: at its EOF, or on an error) has handed over all it will, though its task
    goes on with the connection's ``stop()``."""
    task = handler._reader_task
    reader = handler.reader
    if task is None or task.done() or task is asyncio.current_task() or not isinstance(reader, StreamReaderAdapter):
        return True
    return reader._reader._waiter is not None or handler._reader_stopped.is_set()


async def _reader_handles_what_was_read(handler: Any) -> None:
    """Waits until the connection's reader has handled what its stream holds: the transport reads
    nothing more from the socket meanwhile (a client sending on and on would keep the reader busy),
    then reads on (the reader goes on while the take-over waits: a DISCONNECT, a PUBREL read then
    count). The reader is done once it waits for bytes not yet read, or its loop has ended
    (``_reader_stopped``, set before its task goes on with the connection's ``stop()``: that of a
    half-closed client that reads nothing waits for its full socket to drain, and the take-over's
    CONNACK waited with it, until the 5 s bound), or its task ends; the stream's own
    ``_wait_for_data`` is wrapped, once, to say so."""
    stream = handler.reader._reader
    waiting: list[asyncio.Future[None]] | None = getattr(stream, "durable_waiting", None)
    if waiting is None:
        waiting = stream.durable_waiting = []
        original = stream._wait_for_data

        async def wait_for_data(func_name: str) -> None:
            for future in waiting:
                if not future.done():
                    future.set_result(None)
            waiting.clear()
            await original(func_name)

        stream._wait_for_data = wait_for_data
    future = asyncio.get_running_loop().create_future()
    waiting.append(future)
    transport = stream._transport
    paused = transport is not None and transport.is_reading()  # not when the stream paused it (full)
    if paused:
        transport.pause_reading()
    stopped = asyncio.ensure_future(handler._reader_stopped.wait())
    try:
        await asyncio.wait({future, stopped, handler._reader_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if paused:
            transport.resume_reading()


class PublishedMessages:
    """What the client published waits in its Session's ``delivered_message_queue`` (a QoS 0/1
    message as it is read, a QoS 2 one at its PUBREL) until the connection's message loop hands it
    to the broker (amqtt's ``_handle_message_delivery``: clean subscribers, retain, events), one per
    loop pass. amqtt's loop stopped taking from the queue once it had the connection's end: the
    messages read with a DISCONNECT or right before an EOF stayed there, never delivered.
    ``handed_over`` waits until the loop has taken every one (or has ended: then
    ``AmqttHooks.client_message_loop`` hands the rest over, ``hand_over_what_is_left``), and until
    the PUBCOMPs that wait for the deletion of a durable publisher's packet id are written
    (``pubcomp_once_written``). The PUBCOMPs written once the end began (or as it begins, still
    waiting for the loop pass's write) are drained before the close: a client that shut its socket
    for writing right after its PUBREL still reads them. A take-over drains nothing (the replaced
    client sends its PUBREL again on the new connection): an old connection whose client reads
    nothing, its socket full, held the new CONNACK for the whole close grace."""

    def __init__(self, handler: Any, end_wait: float) -> None:
        self._handler = handler
        self._end_wait = end_wait
        self._taken = asyncio.Event()
        self.loop_ended = False
        self._erasing: set[asyncio.Future[None]] = set()
        self._deferred: set[asyncio.Future[None]] = set()
        self._in_turn: dict[int, Callable[[], None]] = {}
        """PUBRELs read, not yet handled, in the order they were read (by a running count)."""
        self._read = 0
        self._ending = False
        self._wrote_at_end = False
        self._broker: Any = None
        """Set once the loop's end handed the rest over (``hand_over_what_is_left``)."""
        self._late: set[asyncio.Task[None]] = set()
        self._handed = asyncio.Event()
        """Set once the loop's end handed the rest over, or the connection ended without a loop."""
        self._handing_later = False
        self._released = asyncio.Event()
        """Set once a connection made after this one ended waits for it no more (``succeed``): all
        handed over, or this connection's bound passed (``start_bound``)."""
        self._bound: asyncio.TimerHandle | None = None
        self._deadline: float | None = None
        self._latest: tuple[dict[str, tuple[PublishedMessages, bool | None]], str] | None = None
        self._older: PublishedMessages | None = None
        """The connection this one follows, one whose messages were not all handed over as it began to
        (``follow``): the one it took over, or an ended one before it (``succeed``), or the one a
        connection refused at its CONNACK followed (``refused``)."""
        self._until_released = False
        """Whether this connection waits for ``_older`` only until that one's bound, not till all are
        handed: an ended one it followed (``succeed``) or took over (its end handled before the
        take-over), or one a refused connection followed so (``refused``)."""
        self._in_hand: list[Any] = []
        """The message the loop took from the queue and has not handed to the broker: amqtt's loop
        drops it when the connection's end comes in the same pass (five QoS 1 PUBLISHes and a
        DISCONNECT in one write: the third was acknowledged, never delivered to clean subscribers)."""
        original = handler.mqtt_deliver_next_message

        async def next_message() -> Any:
            await self.after_the_older()
            message = await original()
            # None: what amqtt's call answers when the loop's end cancels it (at the end of every
            # connection): no message to hand over later (handed over, it fired MESSAGE_RECEIVED
            # with no message, and a plugin reading message.topic raised)
            self._in_hand = [] if message is None else [message]
            self._taken.set()
            return message

        handler.mqtt_deliver_next_message = next_message

    def put(self, message: Any) -> None:
        """``message`` to amqtt's delivery: into the Session's queue, or, once the loop's end handed
        over what was left, to the broker directly (a PUBLISH's handling the reader cancelled at a
        DISCONNECT still stores, acknowledges and hands over its message: it was left in the queue,
        never delivered to clean subscribers)."""
        if self._broker is None:
            self._handler.session.delivered_message_queue.put_nowait(message)
            return
        self.later(_deliver_late(self._broker, self._handler, message))

    def handled(self) -> None:
        """The message the loop took is being handed to the broker."""
        self._in_hand = []

    def in_hand(self) -> list[Any]:
        """The message the loop took and never handed to the broker (none or one); it is now."""
        taken, self._in_hand = self._in_hand, []
        return taken

    def left_over_handed(self, broker: Any) -> None:
        """The loop's end handed what was left over: what comes later goes to ``broker`` directly."""
        self._broker = broker
        self._all_handed()

    def connection_ended(self) -> None:
        """The connection's handling ended: a loop that never ran hands nothing over (one that
        ran has, or hands over later: ``hand_over_later``)."""
        if not self._handing_later:
            # With no loop (its CONNECT refused at its CONNACK), the client id's next connection
            # follows the one this one would have followed.
            self._all_handed(self._older if self._broker is None and self.follows() else None)

    def refused(self) -> None:
        """Its CONNECT was refused at its CONNACK: the client id's next connection, which may take the
        turn as the refusal's CONNACK is written, follows the one this one would have followed, as
        this one would have (until its bound, or until all are handed over: ``succeed``), whether
        or not that one's end is handled by then (a take-over of a live connection stuck on a topic
        plugin's check ended it, and its loop handles that end only once the check is done)."""
        self._all_handed(self._older if self.follows() else None)

    def start_bound(self) -> float:
        """The connection has ended: its bound, ``connection_end_wait`` from the first call, starts (amqtt's
        handling of its end, ``AmqttHooks.handle_disconnect``, or, with none, its message loop's end,
        ``hand_over_what_is_left``). amqtt's loop handles the end only once ``wait_disconnect`` has
        returned (after the end's wait, ``applied``: up to ``connection_end_wait``) and the pass it is in is
        done (a topic plugin's check of a message or of a SUBSCRIBE): the bound may start that much
        later than the end. Returns it: what the connection published waits for the
        connection it took over until then, and so does a connection made after this one ended
        (``succeed``). amqtt's loop may go on to check a message it took as the end came (a topic
        plugin's slow check): the bound runs meanwhile."""
        loop = asyncio.get_running_loop()
        if self._deadline is None:
            self._deadline = loop.time() + self._end_wait
            if not self._released.is_set():
                self._bound = loop.call_at(self._deadline, self._released.set)
        return self._deadline

    def _all_handed(self, instead: PublishedMessages | None = None) -> None:
        """Every message handed over: the client id's latest connection is ``instead`` (followed as
        this one followed it: ``succeed``), or none."""
        self._handed.set()
        self._released.set()
        if self._bound is not None:
            self._bound.cancel()
        if self._latest is not None:
            latest, client_id = self._latest
            entry = latest.get(client_id)
            if entry is not None and entry[0] is self:
                if instead is None:
                    del latest[client_id]
                else:
                    latest[client_id] = (instead, self._until_released)

    def succeed(self, latest: dict[str, tuple[PublishedMessages, bool | None]], client_id: str) -> None:
        """This connection is the latest of ``client_id`` (in ``latest`` until its messages are all
        handed over). It follows the one before it, until that one's bound (``start_bound``), if that
        one has ended (amqtt's handling of its end began) and has not handed all of its messages over
        (its loop stuck on a topic plugin's check, or waiting for the connection it took over,
        ``hand_over_later``), and is not the one this connection takes over (``follow``, until all
        are handed over). Unfollowed, what this connection published reached clean subscribers
        before what the ended one still held; followed with no bound, it waited for as long as that
        one's own check of a message it published took. One a connection refused at its CONNACK
        passed on (``refused``) it follows as that one did, its end handled or not: unfollowed, what
        this connection published went before what a live connection that one took over still held."""
        entry = latest.get(client_id)
        if entry is not None and entry[0] is not self._older:  # not the one it takes over (``follow``)
            previous, passed_on = entry
            if passed_on is not None:
                self.follow(previous, until_released=passed_on)
            elif _end_handled(previous._handler):
                self.follow(previous, until_released=True)
        latest[client_id] = (self, None)
        self._latest = (latest, client_id)

    def follow(self, older: PublishedMessages, *, until_released: bool) -> None:
        """A take-over of the connection whose messages are ``older``: this connection's go to the
        broker only once the older connection's loop has handed all of its own over, or, with
        ``until_released``, once its bound passed: for one whose end amqtt had handled before this
        connection followed it (``succeed``; a take-over reads ``_end_handled`` before it ends the
        older one, whose loop then handles that end: a take-over of a live connection follows it
        until all are handed). Followed until all were handed, a connection whose end was handled
        (in its close, say) held a newer one for as long as its loop's check of a message took. Its
        loop may still be in the middle of one (a topic plugin's slow check): amqtt's take-over of
        a Session it keeps gave the new connection's loop the messages waiting behind it, which
        reached subscribers first."""
        if older is not self and not older._handed.is_set():
            self._older = older
            self._until_released = until_released

    def follows(self) -> bool:
        """Whether this connection's messages still wait for those of the connection it follows (``follow``)."""
        return self._older is not None and not self._waited_for(self._older).is_set()

    def _waited_for(self, older: PublishedMessages) -> asyncio.Event:
        return older._released if self._until_released else older._handed

    def hand_over_later(self, coroutine: Coroutine[Any, Any, None]) -> None:
        """The loop's end hands over in ``coroutine``, after the connection's handling ended."""
        self._handing_later = True
        self.later(coroutine)

    def later(self, coroutine: Coroutine[Any, Any, None]) -> None:
        """Runs ``coroutine`` in a task of its own, kept until it ends."""
        task = asyncio.ensure_future(coroutine)
        self._late.add(task)
        task.add_done_callback(self._late.discard)

    async def after_the_older(self) -> None:
        """Returns once the connection this one follows no longer holds it (``follow``)."""
        older = self._older
        if older is not None:
            await self._waited_for(older).wait()
            self._older = None

    def end(self) -> None:
        """The connection's message loop has ended: nothing waits for it any more."""
        self.loop_ended = True
        self._taken.set()

    def pubcomp_once_written(self, erasing: asyncio.Future[None], client_id: str, packet_id: int) -> None:
        """PUBCOMP once the packet id's deletion (``erasing``) is written; none when it could not be
        (the client sends the PUBREL again on its next connection)."""
        self._erasing.add(erasing)
        erasing.add_done_callback(self._erasing.discard)
        erasing.add_done_callback(partial(_pubcomp_if_written, self.pubcomp, client_id, packet_id))

    def pubcomp(self, packet_id: int) -> None:
        """Writes the PUBCOMP of ``packet_id``; one written once the end began is drained before the close."""
        self._handler.durable_transport.write(encode_pubcomp(packet_id))
        if self._ending:
            self._wrote_at_end = True

    def release_in_turn(self, release: Callable[[], None]) -> Awaitable[None]:
        """A PUBREL as it is read: ``release`` runs in the task the reader makes of what this returns
        (after the packets read before it have started), or at the connection's end if that task
        never runs (``release_all_read``), whichever comes first; in the order they were read."""
        self._read += 1
        self._in_turn[self._read] = release
        return self._release_up_to(self._read)

    async def _release_up_to(self, turn: int) -> None:
        self.release_all_read(turn)

    def release_all_read(self, up_to: int | None = None) -> None:
        """Handles the PUBRELs read and not yet handled (those read up to ``up_to``), in order. Called
        for every QoS 0/1 PUBLISH the plugin's reader routes: with none pending, nothing is built."""
        if not self._in_turn:
            return
        for turn in list(self._in_turn):
            if up_to is not None and turn > up_to:
                return
            self._in_turn.pop(turn)()

    def deferred(self, release: Callable[[], None]) -> Callable[[], None]:
        """``release`` (a PUBREL waiting for its PUBLISH's handling), to be run later: waited for by
        ``handed_over``, whether it is run or dropped."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._deferred.add(done)
        done.add_done_callback(self._deferred.discard)

        def run() -> None:
            try:
                release()
            finally:
                if not done.done():
                    done.set_result(None)

        return run

    async def handed_over(self, *, drain: bool) -> None:
        """Returns once the PUBRELs read are handled (``release_in_turn``) and those waiting for their
        PUBLISH's handling are done, the loop has taken every message waiting in the queue (or has
        ended), and the PUBCOMPs waiting for a write are written (and, with ``drain``, those written
        since this began have left the buffer). Unbounded: the caller bounds it (``connection_end_wait``)."""
        self._ending = True
        self._wrote_at_end = self._handler.durable_transport.unsent  # a PUBCOMP written in this loop pass
        self.release_all_read()
        if self._deferred:
            await asyncio.wait(list(self._deferred))
        queue = self._handler.session.delivered_message_queue
        # A connection that follows another hands over nothing before that one has (``follow``):
        # its loop's end hands its messages over after those (``hand_over_what_is_left``).
        while not queue.empty() and not self.loop_ended and self._older is None:
            self._taken.clear()
            await self._taken.wait()
        if self._erasing:
            await asyncio.wait(list(self._erasing))
        if drain and self._wrote_at_end:
            with contextlib.suppress(OSError):  # gone already: nothing to write to
                await self._handler.durable_transport.drain()  # the PUBCOMPs, before the connection is closed


async def hand_over_what_is_left(broker: Any, session: Any, handler: Any) -> None:
    """After the connection's message loop ended: the messages its client published still waiting
    in the Session's queue go to the broker as the loop would have handed them (as many as wait
    now: on a Session a newer connection took over, that connection's loop takes what comes after),
    the one the loop took and dropped first (``PublishedMessages.in_hand``), once the connection
    this one follows has handed its own over (``PublishedMessages.follow``); what the connection
    hands over after this goes to the broker directly (``PublishedMessages.put``).

    A connection waiting for the older one's (its loop stuck on a topic plugin's check) waits in a
    task of its own, until its bound (``PublishedMessages.start_bound``, ``connection_end_wait`` from its
    end) at most: waiting here held the connection's task, which frees
    its places (``max_connections``, ``max_connections_per_address``) as it ends, for as long as that
    check took (for ever: every connection of a take-over chain kept its places). Then its messages
    go without waiting any more: none is lost, but they go before what the older one still holds."""
    published: PublishedMessages = handler.durable_published
    published.start_bound()
    published.release_all_read()
    if published.follows():
        published.hand_over_later(_hand_over_after_the_older(broker, session, handler))
        return
    await _hand_over(broker, session, handler)


async def _hand_over_after_the_older(broker: Any, session: Any, handler: Any) -> None:
    """``hand_over_what_is_left`` of a connection that took over: once the older connection has
    handed its messages over, or at this connection's bound (``PublishedMessages.start_bound``)."""
    try:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout_at(handler.durable_published.start_bound()):
                await handler.durable_published.after_the_older()
        await _hand_over(broker, session, handler)
    except Exception as exc:  # as amqtt's loop would have ended on it
        log.warning("%s: a message it published was not delivered: %r", session.client_id, exc)
    finally:  # cancelled (the broker's shutdown): a newer connection waits no more
        handler.durable_published.left_over_handed(broker)


async def _hand_over(broker: Any, session: Any, handler: Any) -> None:
    """What ``hand_over_what_is_left`` hands over, the older connection's messages handed over or not waited for."""
    published: PublishedMessages = handler.durable_published
    queue = session.delivered_message_queue
    try:
        for message in published.in_hand():
            await _deliver_late(broker, handler, message)
        for _ in range(queue.qsize()):
            if queue.empty():  # a newer connection's loop took it
                return
            taken: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            taken.set_result(queue.get_nowait())
            await broker._handle_message_delivery(session, handler, taken)
    finally:
        published.left_over_handed(broker)


def _put_published(handler: Any, message: Any) -> None:
    """``message``, published by the handler's client, to amqtt's delivery (``PublishedMessages.put``)."""
    published: PublishedMessages = handler.durable_published
    published.put(message)


async def _deliver_late(broker: Any, handler: Any, message: Any) -> None:
    """A message its publisher's connection handed over after its loop's end: to the broker as
    the loop would have (``PublishedMessages.put``)."""
    taken: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    taken.set_result(message)
    try:
        await broker._handle_message_delivery(handler.session, handler, taken)
    except Exception as exc:  # as amqtt's loop would have ended on it
        log.warning("%s: a message it published was not delivered: %r", handler.session.client_id, exc)


class _CancelledAsAdded(dict[int, "asyncio.Future[Any]"]):
    """A handler's waiters for the acks of one kind once its connection's end stopped waiting for
    them (``_stop_outgoing_waiters``): one amqtt adds after is cancelled as it is added."""

    def __setitem__(self, packet_id: int, waiter: asyncio.Future[Any]) -> None:
        super().__setitem__(packet_id, waiter)
        waiter.cancel()


def _stop_outgoing_waiters(handler: Any) -> None:
    """Cancels the handler's waits for the PUBACKs, PUBRECs and PUBCOMPs of what it sent, as
    amqtt 0.12.1's ``_stop_waiters`` does, and of what it sends after (``_CancelledAsAdded``): a
    clean client that shut its socket right after its SUBSCRIBE had the retained QoS 1 or 2
    message its message loop sent while the end waited for that SUBSCRIBE waited for (amqtt's
    5 s for a PUBACK), and the close with it, until the end's bound (5 s). Nothing waits for the
    PUBRELs of the client's own QoS 2 PUBLISHes (``_await_pubrel``): a PUBREL read while the
    connection's end waits for its changes still gets the message delivered (``_pubrel_handler``)."""
    for name in ("_puback_waiters", "_pubrec_waiters", "_pubcomp_waiters"):
        waiters = getattr(handler, name)
        for waiter in waiters.values():
            waiter.cancel()
        if not isinstance(waiters, _CancelledAsAdded):
            setattr(handler, name, _CancelledAsAdded(waiters))


async def _nothing() -> None:
    """The task a reader makes of a SUBSCRIBE or UNSUBSCRIBE: the change was queued by the call."""


def _drop_waiting_changes(changes: SubscriptionChanges[Any], client_id: str | None) -> None:
    """Closes the connection's queue of changes (none is handed out any more), with a WARNING naming
    the client and how many waiting were dropped (the one being applied is not: it completes)."""
    dropped = changes.close()
    if dropped:
        log.warning(
            "%s: %d SUBSCRIBE/UNSUBSCRIBE read before the connection ended not applied: dropped", client_id, dropped
        )


def _packet_id_and_payload(packet: Any, kind: str) -> tuple[int, Any]:
    """A decoded SUBSCRIBE's or UNSUBSCRIBE's packet id and its topics, checked as amqtt's handlers do."""
    if packet.variable_header is None or packet.payload is None:
        raise MQTTError(f"{kind} packet: variable header or payload not initialized.")
    return packet.variable_header.packet_id, packet.payload.topics


def _pubrel_handler(
    engine: DurableEngine, handler: Any, session: Any, awaiting: AwaitingPubrel
) -> Callable[[Any], Awaitable[None]]:
    """PUBREL of an inbound QoS 2 publish: the message awaiting it (``_await_pubrel``), if amqtt's
    Session holds one, goes to amqtt's own delivery (clean subscribers, retain, events) and leaves
    ``inflight_in``; a durable publisher's stored packet id is deleted; PUBCOMP follows (once that
    deletion is written). All of it but the PUBCOMP's write is done as the reader hands the PUBREL
    over, in the task it makes of what this returns, after the packets read before it have started
    (a QoS 2 PUBLISH, a re-send with its packet id: PUBREC, then PUBCOMP), or at the connection's end,
    whichever comes first (``PublishedMessages.release_in_turn``): both readers cancel the tasks
    that have not run when the connection ends, and amqtt's flow, ended by the connection's end,
    queued the message after the connection's message loop had stopped taking from the queue. So a PUBREL and a
    DISCONNECT (or EOF) in one write lost the message for clean subscribers though PUBCOMP came; the
    end of the connection waits (bounded) for what was released to be handed to the broker
    (``_one_queue_of_subscription_changes``, ``AmqttHooks.client_message_loop``).

    MQTT-4.3.3 wants a PUBCOMP for every PUBREL, also one amqtt has no message for (after a restart,
    once amqtt dropped an anonymous session, or a PUBREL sent again: the message went with the first,
    once); a repeated one waits for the same deletion (``DurableEngine.pubrel_released``). A PUBREL
    read while a PUBLISH with its packet id is still being handled (sent without waiting for the
    PUBREC) is done once that handling has ended (``AwaitingPubrel.after``): its PUBCOMP follows
    that PUBREC, and it releases the message that PUBLISH brought, not nothing.
    """

    def release(packet: Any) -> None:
        packet_id = packet.packet_id
        erasing = None if handler.connect_clean_session else engine.pubrel_released(session.client_id, packet_id)
        message = session.inflight_in.pop(packet_id, None)
        awaiting.released(packet_id)
        if message is not None:
            message.pubrel_packet = packet
            handler.durable_published.put(message)
        if erasing is None:
            handler.durable_published.pubcomp(packet_id)
        else:
            handler.durable_published.pubcomp_once_written(erasing, session.client_id, packet_id)

    def release_after_its_publish(packet: Any) -> None:
        if packet.packet_id in awaiting.open:  # its PUBLISH is still being handled: released after it
            published: PublishedMessages = handler.durable_published
            awaiting.after(packet.packet_id, published.deferred(partial(release, packet)))
        else:
            release(packet)

    def handle_pubrel(packet: Any) -> Awaitable[None]:
        published: PublishedMessages = handler.durable_published
        return published.release_in_turn(partial(release_after_its_publish, packet))

    return handle_pubrel


def _pubcomp_if_written(
    pubcomp: Callable[[int], None], client_id: str, packet_id: int, erasing: asyncio.Future[None]
) -> None:
    """PUBCOMP, the packet id's deletion (``erasing``) done: none if it could not be written."""
    error = None if erasing.cancelled() else erasing.exception()
    if erasing.cancelled() or error is not None:
        log.warning("%s: no PUBCOMP for packet id %d: its deletion was not written (%r)", client_id, packet_id, error)
        return
    pubcomp(packet_id)


def _await_pubrel(handler: Any, session: Any, packet: Any, *, hold: bool = True) -> None:
    """amqtt's inbound QoS 2 flow up to PUBREC, without a task waiting for the PUBREL: the message
    is held in the Session's ``inflight_in`` until its PUBREL (``_pubrel_handler``), across
    connections while amqtt keeps the Session, and PUBREC goes. A re-send of an id held keeps the
    first copy (the same message, MQTT-4.3.3-2); one whose id a PUBREL released while it was
    handled (``hold`` False: on the other connection of a take-over) holds nothing again."""
    packet_id = packet.variable_header.packet_id
    if hold and packet_id not in session.inflight_in:
        message = IncomingApplicationMessage(
            packet_id, packet.topic_name, QOS_2, routed(packet.data, QOS_2), packet.retain_flag
        )
        message.publish_packet = packet
        session.inflight_in[packet_id] = message
    handler.durable_transport.write(encode_pubrec(packet_id))


async def _publish_qos2(
    broker: Any,
    engine: DurableEngine,
    handler: Any,
    session: Any,
    packet: Any,
    *,
    receivers: Callable[[str], Awaitable[dict[str, int] | None]],
    hold: Callable[[], bool],
) -> None:
    """PUBREC, and the message held for its PUBREL (``_await_pubrel``, if ``hold()``), once the message and its
    packet id are durable (never on a broker that is not the primary: the connection is closed
    instead, as for QoS 1)."""
    if not engine.serving:
        handler.durable_acks.refuse(NotPrimaryError(NOT_SERVING))
        return
    try:
        stored = await _route_qos2(broker, engine, handler, session, packet, receivers=receivers)
        if stored is not None:
            await stored
    except StoreUnavailableError as exc:
        handler.durable_acks.refuse(exc)
        return
    _await_pubrel(handler, session, packet, hold=hold())


async def _route_qos2(
    broker: Any,
    engine: DurableEngine,
    handler: Any,
    session: Any,
    packet: Any,
    *,
    receivers: Callable[[str], Awaitable[dict[str, int] | None]],
) -> asyncio.Future[None] | None:
    """Route a QoS 2 PUBLISH once per packet id until its PUBREL; resolves when PUBREC may go.

    A durable publisher's packet id is stored in the message's own write batch, so a re-send
    after a crash is known too (MQTT-4.3.3-2: PUBREC again, never routed again).
    """
    topic, packet_id = packet.topic_name, packet.variable_header.packet_id
    durable = not handler.connect_clean_session and engine.is_durable(session.client_id)
    async with handler.durable_ordering:  # a copy arriving meanwhile sees the packet id recorded
        if durable and engine.pubrel_due(session.client_id, packet_id):
            return engine.written_so_far()  # the first copy may still be in its commit
        if packet_id in session.inflight_in:
            return None  # amqtt's record of a copy it took (a clean publisher's, or one that stored nothing)
        if not await broker._topic_filtering(session, topic, Action.PUBLISH):
            return None
        retain = bool(packet.retain_flag)
        stored = engine.route_publish(topic, bytes(packet.data), 2, await receivers(topic), retain=retain)
        if durable and stored is not None:
            engine.expect_pubrel(session.client_id, packet_id)
        return stored


async def _refuse_connect(handler: Any, session: Any, return_code: int, why: str) -> NoReturn:
    """Refuse a CONNECT when its CONNACK is due, then end the connection: amqtt would go on serving
    it whatever the CONNACK said, so its connection handling is ended by the error raised here
    (amqtt logs and drops it)."""
    log.warning("%s", why)
    session.parent = 0  # MQTT-3.2.2-4: no session present with a refusal
    connack = ConnackPacket.build(0, return_code)
    # Not amqtt's _send_packet: on a websocket the client had closed, it logged the routine
    # ConnectionClosed as a WARNING "Unhandled exception: received 1005 ..." (and let it escape).
    handler.durable_published.refused()
    try:  # as amqtt's _send_packet: under its write lock, if it has a writer; PACKET_SENT either way
        if handler.writer:
            async with handler._write_lock:
                await connack.to_stream(handler.writer)
        await handler.plugins_manager.fire_event(MQTTEvents.PACKET_SENT, packet=connack, session=session)
    except (ConnectionClosed, OSError) as exc:
        log.debug("%s: the connection closed before its refusal: %r", session.client_id, exc)
    handler.durable_disconnected = True  # _keep_the_newer_connection_connected
    session.transitions.disconnect()
    if handler.writer:
        with contextlib.suppress(ConnectionClosed, OSError):
            await handler.writer.close()
    raise AMQTTError(f"{session.client_id}: CONNECT refused when its CONNACK was due")


def _control_channel(broker: Any, engine: DurableEngine, handler: Any, session: Any) -> ControlChannel:
    """The connection's control channel; with topic ACL plugins, streams obey them as subscriptions do."""
    config = engine.config
    acl = bool(broker.plugins_manager._topic_plugins)

    async def may_subscribe(topic_filter: str) -> bool:
        return bool(await broker._topic_filtering(session, topic_filter, Action.SUBSCRIBE))

    async def may_receive(topic: str) -> bool:
        return bool(await broker._topic_filtering(session, topic, Action.RECEIVE))

    def open_streams() -> StreamSender:
        return StreamSender(
            engine.streams,
            handler.durable_transport,
            default_window=config.stream_window,
            ack_timeout=config.stream_ack_timeout,
            may_receive=may_receive if acl else None,
            max_entries=config.max_stream_entries_per_client,
            client_id=session.client_id,
            log_interval=config.drop_log_interval,
        )

    return ControlChannel(
        engine,
        handler.durable_transport,
        session.client_id,
        handler.connect_clean_session,
        username=session.username,
        open_streams=open_streams,
        may_subscribe=may_subscribe if acl else None,
        may_receive=may_receive if acl else None,
        congested=lambda: bool(handler.durable_transport.congested),
        end_connection=partial(end_connection, handler),
        max_pending_bytes=config.max_pending_control_bytes,
        log_interval=config.drop_log_interval,
    )


async def _connect_durable(broker: Any, engine: DurableEngine, handler: Any, session: Any) -> None:
    """CONNACK is due: create, wipe or take the stored session and set session-present from the
    store. Refuses the CONNECT (raises) with CONNACK 5 when the session belongs to another user,
    and with CONNACK 3 while the store cannot write when the CONNECT needs a write. A new durable
    session has the place reserved for it as its CONNECT was read (``max_durable_sessions``)."""
    stored = engine.sessions.get(session.client_id)
    passes = stored is not None and stored.record.username != session.username
    try:
        engine.check_owner(session.client_id, session.username)
        revoke = await _refused_subscriptions(broker, engine, session)
        present = await engine.connect(
            session.client_id,
            bool(session.clean_session),
            session.username,
            handler.durable_transport,
            revoke,
            reservation=getattr(handler.writer, "durable_reservation", None),  # taken as it was read
        )
    except NotSessionOwnerError as exc:  # created by a CONNECT read at the same time as this one
        await _refuse_connect(handler, session, NOT_AUTHORIZED, str(exc))
    except StoreUnavailableError as exc:
        why = f"{session.client_id}: CONNECT refused with CONNACK 3 (server unavailable): {exc}"
        await _refuse_connect(handler, session, SERVER_UNAVAILABLE, why)
    except SessionLimitError as exc:  # its place is reserved as it is read: not expected, refused as there
        await _refuse_connect(handler, session, SERVER_UNAVAILABLE, str(exc))
    if not session.clean_session:
        session.parent = 1 if present else 0
        # A Session amqtt cached from an earlier clean connection may still hold amqtt-level
        # subscriptions; they would deliver beside the pump, with clashing packet ids. Its
        # ``delivered_message_queue`` is kept: what it holds the client published (released by
        # an earlier connection taken over just now), still to be handed to the broker.
        await broker._del_all_subscriptions(session)
        _clear_retained_only(session)
        if passes:  # the previous user's QoS 2 publishes awaiting PUBREL, as the engine forgot them
            session.inflight_in.clear()


async def _refused_subscriptions(broker: Any, engine: DurableEngine, session: Any) -> list[str]:
    """Subscriptions of another user's session (session_takeover: any-user) that the topic ACL would
    refuse this CONNECT's user: they do not pass to it."""
    durable = engine.sessions.get(session.client_id)
    if durable is None or durable.record.username == session.username or not broker.plugins_manager._topic_plugins:
        return []
    return [
        topic_filter
        for topic_filter in sorted(durable.record.subscriptions)
        if not await broker._topic_filtering(session, topic_filter, Action.SUBSCRIBE)
    ]


async def _may_read(broker: Any, session: Any, topic: str) -> bool:
    """Read access as amqtt's topic ACL plugins decide it: RECEIVE of the topic and SUBSCRIBE to a
    filter naming just it (amqtt's shipped ACL plugin can only be given the latter)."""
    return bool(await broker._topic_filtering(session, topic, Action.RECEIVE)) and bool(
        await broker._topic_filtering(session, topic, Action.SUBSCRIBE)
    )


def _read_access(broker: Any, session: Any) -> ReadAccess | None:
    """The read check of one connection's deliveries; None (no check at all) without topic ACL plugins."""
    if not broker.plugins_manager._topic_plugins:
        return None
    return ReadAccess(partial(_may_read, broker, session))


def _control_qos2(handler: Any, session: Any, packet: Any) -> None:
    """A control request at QoS 2: never routed; the exchange completes as a message's does, and
    the broadcast wrapper drops the message released."""
    handler.durable_control.submit(packet.topic_name, bytes(packet.data))
    packet.fixed_header.flags &= ~0x01  # never retained
    _await_pubrel(handler, session, packet)


class InboundPublishes:
    """The one path of a QoS 0/1 PUBLISH after its checks, whichever reader read it (amqtt's, or
    FastReader's inline one): a control request goes to the control channel; any other message is
    queued for the durable sessions, handed to amqtt's own delivery, and acknowledged in PUBLISH
    order once it is stored (OrderedAcks)."""

    def __init__(
        self,
        engine: DurableEngine,
        deliver: Callable[[Any], None],
        acks: OrderedAcks,
        control: ControlChannel,
        amqtt_wants: Callable[[str], bool],
    ) -> None:
        self._engine = engine
        self._deliver = deliver
        """Hands a message to amqtt's delivery (``PublishedMessages.put``)."""
        self._acks = acks
        self._control = control
        self._amqtt_wants = amqtt_wants

    def control(self, topic: str, payload: bytes, qos: int, packet_id: int | None) -> None:
        """A request on the control channel: never routed; acknowledged at once."""
        if self._refused_here(qos):
            return
        self._control.submit(topic, payload)
        if qos == 1 and packet_id:
            self._acks.add(None, packet_id)

    def route(
        self,
        topic: str,
        payload: bytes,
        qos: int,
        packet_id: int | None,
        *,
        retain: bool,
        targets: dict[str, int] | None,
    ) -> None:
        """Queue for the durable sessions (``targets``: those the topic ACL lets receive it, None: all).

        On a broker that is not the primary (demoted while this connection was open) nothing is
        routed or acknowledged: the connection is closed (after the PUBACKs due before it), so
        the client re-sends to the new primary; a QoS 0 message is dropped."""
        if self._refused_here(qos):
            return
        try:
            stored = self._engine.route_publish(topic, payload, qos, targets, retain=retain)
        except StoreUnavailableError as exc:
            if qos:
                self._acks.refuse(exc)
                return
            stored = None  # QoS 0 is at most once: amqtt's own subscribers still get it
        self.hand_over(topic, payload, qos, packet_id, retain=retain, stored=stored)

    def hand_over(
        self,
        topic: str,
        payload: bytes,
        qos: int,
        packet_id: int | None,
        *,
        retain: bool,
        stored: asyncio.Future[None] | None,
    ) -> None:
        """To amqtt's own delivery, if it wants the topic; then the PUBACK, once ``stored`` is durable."""
        if self._refused_here(qos):
            return
        if self._amqtt_wants(topic):
            self._deliver(amqtt_message(topic, payload, qos, packet_id=packet_id or None, retain=retain))
        if qos == 1 and packet_id:
            self._acks.add(stored, packet_id)


    def _refused_here(self, qos: int) -> bool:
        """True on a broker that is not (or no longer) the primary; a QoS 1/2 publish then closes
        the connection after the PUBACKs due before it."""
        if self._engine.serving:
            return False
        if qos:
            self._acks.refuse(NotPrimaryError(NOT_SERVING))
        return True


def amqtt_message(topic: str, payload: bytes, qos: int, *, packet_id: int | None, retain: bool) -> Any:
    """An already-queued publish as amqtt's QoS 0/1 flow gives it to its own delivery (clean
    subscribers, retain, events), without its PUBACK: the plugin acknowledges in order itself."""
    message = IncomingApplicationMessage(packet_id, topic, qos, routed(payload, qos), retain)
    message.publish_packet = PublishPacket.build(topic, payload, packet_id, False, qos, retain)
    return message


class OrderedAcks:
    """PUBACKs of one connection, written in the order the PUBLISHes arrived (MQTT-4.6.0-2),
    each only once its message is durable.

    A publish that could not be stored gets none: once the PUBACKs before it are written, the
    connection is closed, so the publisher learns it and re-sends after reconnecting; nothing
    is acknowledged on that connection after it.
    """

    def __init__(self, transport: HandlerTransport, client_id: str | None) -> None:
        self._transport = transport
        self._client_id = client_id
        self._queue: deque[tuple[asyncio.Future[None] | None, int]] = deque()
        self._closing: asyncio.Task[None] | None = None

    def add(self, stored: asyncio.Future[None] | None, packet_id: int) -> None:
        if self._closing is not None:
            return
        self._queue.append((stored, packet_id))
        if stored is None:
            self._release()
        else:
            stored.add_done_callback(self._on_stored)

    def refuse(self, error: StoreUnavailableError) -> None:
        """A publish that cannot be stored: close the connection after the PUBACKs due before it."""
        if self._closing is not None:
            return
        refused: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        refused.set_exception(error)
        self.add(refused, 0)

    def _on_stored(self, stored: asyncio.Future[None]) -> None:
        self._release()

    def _release(self) -> None:
        queue = self._queue
        while queue and (queue[0][0] is None or queue[0][0].done()):
            stored, packet_id = queue.popleft()
            if stored is not None and (stored.cancelled() or stored.exception() is not None):
                self._close(None if stored.cancelled() else stored.exception())
                return
            self._transport.write(encode_puback(packet_id))

    def _close(self, error: BaseException | None) -> None:
        log.warning(
            "%s: a publish could not be stored, so it is not acknowledged: closing the connection so the "
            "client re-sends it (%s)",
            self._client_id,
            error,
        )
        self._queue.clear()
        self._closing = asyncio.get_running_loop().create_task(self._end())

    async def _end(self) -> None:
        # The PUBACKs of the publishes stored before it, for at most CLOSE_GRACE: a client that
        # reads nothing held the connection open for ever. Gone already: ending it is all that is left.
        with contextlib.suppress(OSError, TimeoutError):
            async with asyncio.timeout(CLOSE_GRACE):
                await self._transport.drain()
        await self._transport.fail()


async def _read_some(stream: asyncio.StreamReader, idle: float | None) -> bytes | None:
    """Whatever the socket has received, up to READ_SIZE (b"": EOF); every packet it completes is
    handled before the next read, so a replay's PUBACKs, arriving back to back, make one run.
    Waiting for bytes not yet received is bounded by ``idle``: None when it passed without any."""
    if idle is None or stream._buffer:  # type: ignore[attr-defined]
        return await stream.read(READ_SIZE)
    try:
        # Not wait_for: on Python 3.11 it can swallow a cancellation that comes as the read
        # completes, and the connection's reader, stopped by amqtt, read on (a broker stop then
        # waited for that client's keep-alive).
        async with asyncio.timeout(idle):
            return await stream.read(READ_SIZE)
    except TimeoutError:
        return None


async def _send_acked(
    handler: Any,
    topic: str,
    data: bytes | bytearray,
    qos: int,
    *,
    retain: bool,
    finished: Callable[[], None] | None = None,
) -> bool:
    """One message to a clean session: a retained one for its SUBSCRIBE, written by the message loop
    itself (in order, before the next SUBACK), or a live one (``CleanSends``). Its acks are awaited
    as entries of the connection's ``RetainedAcks`` and the transport's ack table (``_retained_ack``),
    not by amqtt's flow in a task (about 3 KB each, given up 5 s after the write: behind a paused
    reader, or from a client reading late, a QoS 2 message got no PUBREL). Its packet id, from the
    table's ``PacketIds`` (one id looked at per message: amqtt's ``next_packet_id`` scanned up to all
    65,535, with the event loop held; ids the client uses are its own, MQTT 3.1.1 section 2.3.1),
    stays in the session's ``inflight_out`` until the last ack, so amqtt's own sends take another.
    False, unsent, when no packet id is free. ``finished`` is called once, when its wait ends (or
    unawaited: QoS 0, the connection's end, once written). As
    amqtt's ``gather(return_exceptions=True)``: a send that fails stops no other (amqtt logged why)."""
    session = handler.session
    acks: RetainedAcks = handler.durable_retained_acks
    kind: AckKind = "puback" if qos == 1 else "pubrec"
    packet_id = None
    if qos:
        packet_id = acks.send(kind, retain, finished, session.inflight_out)
        if packet_id is None:  # no id free, or the connection's end: not sent
            if finished is not None:
                finished()
            return acks.stopped
        # before the write: its ack may be read while the write drains
        session.inflight_out[packet_id] = message = OutgoingApplicationMessage(packet_id, topic, qos, data, retain)
        handler.durable_transport.expect_ack(kind, packet_id, partial(_retained_ack, handler, session, packet_id))
    else:
        message = OutgoingApplicationMessage(None, topic, qos, data, retain)
    try:
        await handler._send_packet(message.build_publish_packet())
        if packet_id is not None and acks.expires and acks.awaits(packet_id, kind):
            acks.wait(packet_id, kind)  # amqtt's loop: its 5 s run from the write done, not the wait for the lock
    except Exception:
        if packet_id is not None:
            _forget_retained(handler, session, packet_id, kind)
        task = asyncio.current_task()
        if task is not None and task.cancelling():  # amqtt turns a cancel into ProtocolHandlerError
            raise
    finally:
        if packet_id is None and finished is not None:
            finished()
    return True


def _retained_ack(handler: Any, session: Any, packet_id: int) -> None:
    """The PUBACK, PUBREC or PUBCOMP of a message ``_send_acked`` sent, taken by the
    transport: a PUBREC is answered with its PUBREL (with the acks), and the PUBCOMP then awaited."""
    acks: RetainedAcks = handler.durable_retained_acks
    if acks.awaits(packet_id, "pubrec") and acks.wait(packet_id, "pubcomp"):
        handler.durable_transport.expect_ack("pubcomp", packet_id, partial(_retained_ack, handler, session, packet_id))
        handler.durable_transport.write(encode_pubrel(packet_id))
        return
    session.inflight_out.pop(packet_id, None)
    acks.done(packet_id)


def _retained_ack_expired(handler: Any, session: Any, packet_id: int, kind: AckKind) -> None:
    """``RetainedAcks`` gave a wait up, ACK_TIMEOUT after the write (amqtt's own loop only)."""
    _forget_retained(handler, session, packet_id, kind)
    _log_retained(handler, UNACKED, session.client_id, kind.upper(), packet_id)


def _log_retained(handler: Any, line: str, *args: object) -> None:
    """A WARNING about a connection's retained messages, at most once per ``drop_log_interval``."""
    left_out = handler.durable_retained_log.take()
    if left_out is not None:
        log.warning(line, *args, f" ({left_out} more such line(s) left out)" if left_out else "")


def _stop_retained_acks(handler: Any) -> None:
    """At the connection's end no message awaits its ack: their packet ids are freed."""
    for packet_id, kind in handler.durable_retained_acks.stop():
        _forget_retained(handler, handler.session, packet_id, kind)


def _forget_retained(handler: Any, session: Any, packet_id: int, kind: AckKind) -> None:
    """A message's wait is over without its ack: its packet id is free again."""
    handler.durable_transport.forget_ack(kind, packet_id)
    session.inflight_out.pop(packet_id, None)
    handler.durable_retained_acks.done(packet_id)


def _cancelled_by_the_end(client_id: str, task: asyncio.Task[None]) -> None:
    """A handler cancelled at its connection's end (FastReader.run): amqtt turns the cancel of one
    waiting to write (a PINGREQ's read while the client read nothing) into ProtocolHandlerError,
    which is no failure here and was logged as a task exception never retrieved; any other error
    is logged."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None and not isinstance(exc, ProtocolHandlerError):
        log.warning("%s: a handler cancelled at the connection's end failed: %r", client_id, exc)


class FastReader:
    """A reader loop for TCP connections that handles the message path without a task per packet.

    amqtt's loop wraps every read in ``wait_for`` and every packet in a task. This one reads
    whole packets from the socket buffer; QoS 0/1 PUBLISH, the acks of pump-sent messages and
    PINGREQ are handled inline (a QoS 1 one goes amqtt's way while a QoS 2 one is being routed), everything
    else is decoded by amqtt's packet classes and dispatched as amqtt does, but at EOF the handlers
    of SUBSCRIBE, UNSUBSCRIBE and DISCONNECT under way are waited for (``_settling``), not
    cancelled. It reads nothing more while the requests under way pass a bound, lower while its
    client reads its answers slower than they are written (``_room``): a PINGREQ is answered
    inline only while the broker holds no more unsent for the client than its socket's write
    buffer limit, else by amqtt's task, which waits to write. It steps aside (runs amqtt's loop)
    for non-TCP connections and when plugins listen to raw packets or filter topics, which the
    inline path would skip.
    """

    def __init__(self, broker: Any, engine: DurableEngine, handler: Any, session: Any) -> None:
        self._broker = broker
        self._handler = handler
        self._session = session
        self._original_loop = handler._reader_loop
        self._transport: HandlerTransport = handler.durable_transport
        self._publishes: InboundPublishes = handler.durable_publishes
        self._published: PublishedMessages = handler.durable_published
        self._running: set[asyncio.Task[None]] = set()
        """Handlers under way (a set, each gone when done: a list freed from its front only kept every
        later packet's task behind one QoS 2 publish awaiting its PUBREL)."""
        self._settling: set[asyncio.Task[None]] = set()
        """Handlers of SUBSCRIBE, UNSUBSCRIBE and DISCONNECT not yet done: at EOF they are waited for
        (see ``run``). A QoS 2 PUBLISH's is not: it ends at PUBREC, and its handling goes on once
        its task is cancelled (``_bounded_qos2``; the connection's end waits for a PUBREL read
        behind it, ``PublishedMessages.handed_over``)."""
        self._max_packet_size = engine.config.max_packet_size
        self._changes: SubscriptionChanges[Any] = handler.durable_changes
        self._retained_acks: RetainedAcks = handler.durable_retained_acks
        self._paused = LogBudget(engine.config.drop_log_interval)
        self._room_made = asyncio.Event()
        """Set once at most ``_resume_at`` handlers are under way (``_room`` waits for it)."""
        self._resume_at = MAX_UNDER_WAY // 2
        """Half the bound the last pause passed (``_room``)."""
        self._handlers_done = 0
        """Handlers done so far: one done is progress for a paused connection (``_progress``)."""

    def _publish_inline(self, flags: int, body: bytes) -> bool:
        """Queue a QoS 0/1 PUBLISH; False sends it down amqtt's path (QoS 2 or 3, busy ACLs).

        A PUBLISH of any QoS whose topic no client may publish to raises ProtocolViolationError:
        the connection is closed before anything is stored, routed or acknowledged.
        """
        qos = (flags >> 1) & 0x03
        topic_len = int.from_bytes(body[:2], "big")
        start = 2 + topic_len + (2 if qos else 0)
        if len(body) < start:
            raise ProtocolViolationError(TOPIC_PAST_END)
        topic = checked_publish_topic(body[2 : 2 + topic_len])
        if qos > 1 or self._handler.durable_ordering.locked():
            return False
        packet_id = int.from_bytes(body[2 + topic_len : start], "big") if qos else 0
        if qos and not packet_id:
            return False
        payload = body[start:]
        self._published.release_all_read()  # a message released by a PUBREL read before it goes first
        if topic.startswith(CONTROL_PREFIX):
            self._publishes.control(topic, payload, qos, packet_id)
        else:  # no topic ACL plugin (run() stepped aside otherwise): every session may receive it
            self._publishes.route(topic, payload, qos, packet_id, retain=bool(flags & 0x01), targets=None)
        return True

    async def _dispatch(self, first: int, body: bytes) -> None:
        """One packet the ack runs of _dispatch_all do not take. A first byte ``_BAD_FIRST`` refuses
        (reserved type, server-only type, a second CONNECT, fixed header flags MQTT does not allow) raises
        ProtocolViolationError (run() logs it and ends the connection); PUBLISH's flags are its
        own, and an ack in a run has its flags 0, so neither fast path looks them up."""
        packet_type, flags = first >> 4, first & 0x0F
        if packet_type == PUBLISH:
            if self._publish_inline(flags, body):
                return
        elif _BAD_FIRST[first]:
            raise first_byte_refusal(first)
        elif packet_type == PINGREQ and not body and not self._transport.congested:
            self._transport.write(PINGRESP_PACKET)  # with the acks; else amqtt's task, bounded by _room
            return
        kind = _ACK_KINDS.get(packet_type)
        if kind is not None and len(body) == 2 and self._transport.take_ack(kind, int.from_bytes(body, "big")):
            return
        await self._to_amqtt(packet_type, flags, body)

    def _log_pause(self, cause: str) -> None:
        """PAUSED, at most once per ``drop_log_interval``; the next line says how many were left out."""
        left_out = self._paused.take()
        if left_out is not None:
            also = f" ({left_out} more pause(s) since the last line)" if left_out else ""
            log.info(PAUSED, self._session.client_id, cause, also)

    async def _dispatch_all(self, packets: list[tuple[int, bytes]]) -> None:
        """The packets of one read, in order; runs of acks of one kind go to the pump together.
        None after one that made the server end the connection (``durable_ended``: see
        ``end_connection``) or was refused (run() ends the connection): the connection is over. ``ack_first``
        is -1, a first byte no packet has, while no run is open: 0 would take a reserved type 0
        with a 2-byte body for an ack."""
        acks: list[int] = []
        ack_first = -1
        for first, body in packets:
            if self._handler.durable_ended:
                break
            if first == ack_first and len(body) == 2:
                acks.append((body[0] << 8) | body[1])
                continue
            if acks:
                await self._take_acks(ack_first, acks)
                acks = []
            kind = _ACK_KINDS.get(first >> 4)
            if kind is not None and not first & 0x0F and len(body) == 2:  # flags as MQTT-2.2.2-1 has them
                ack_first = first
                acks.append((body[0] << 8) | body[1])
                continue
            ack_first = -1
            try:
                await self._dispatch(first, body)
            except (MQTTError, AMQTTError) as exc:
                log.warning("%s: packet discarded: %s", self._session.client_id, exc)
        if acks:
            await self._take_acks(ack_first, acks)

    async def _take_acks(self, first: int, packet_ids: list[int]) -> None:
        """A run of acks of one kind (``first`` their first byte); those not for the pump go to amqtt."""
        for packet_id in self._transport.take_acks(_ACK_KINDS[first >> 4], packet_ids):
            try:
                await self._to_amqtt(first >> 4, first & 0x0F, packet_id.to_bytes(2, "big"))
            except (MQTTError, AMQTTError) as exc:
                log.warning("%s: packet discarded: %s", self._session.client_id, exc)

    async def _to_amqtt(self, packet_type: int, flags: int, body: bytes) -> None:
        """A packet the inline paths do not take: decoded by amqtt's classes and handled as amqtt does."""
        handler = self._handler
        fixed = MQTTFixedHeader(packet_type, flags, len(body))
        packet = await packet_class(fixed).from_stream(BufferReader(body), fixed_header=fixed)
        method = _HANDLERS.get(packet_type)
        if method is not None:
            await self._room()
            if handler.durable_ended:
                return  # ended while the reader waited (UNREAD)
            task = asyncio.create_task(getattr(handler, method)(packet))
            self._running.add(task)
            task.add_done_callback(self._handled)
            if packet_type in _SETTLED_AT_EOF:
                self._settling.add(task)
                task.add_done_callback(self._settling.discard)

    async def _room(self) -> None:
        """Waits while ``MAX_UNDER_WAY`` of the connection's packets are being handled or as many
        SUBSCRIBEs and UNSUBSCRIBEs wait for the message loop and the client reads its answers
        slower than they are written (``congested``), until it reads (the write side drained) or
        half that are done (a wake-up per task done cost more than the task); ``MAX_UNDER_WAY_READ``
        of them whatever the client reads, until half that are. Each task (a PINGREQ's or a
        PUBREL's waits to write its answer while the client reads nothing) and each change holds
        memory, and a client that sends without reading its answers was read on without end
        (400,000 SUBSCRIBEs in a second: 140 MB); reading nothing more, the socket fills and the
        client's sends wait. A connection paused (at either bound) that gets nowhere for 1.5 keep-alive periods
        (``_waited_with_progress``) is ended (UNREAD): a half-open one sends nothing either, but
        its reader would not see it. The bound is far higher for a client that reads: it is answered at
        the pace its requests are handled. Nothing the reader waits for here waits for a packet
        behind the paused read: a clean session's message loop goes on once a SUBSCRIBE's
        retained messages are written, not acknowledged (``_send_acked``; when it awaited their
        PUBACKs, behind the client's later SUBSCRIBEs, 4,300 pipelined got 12 SUBACKs in 60 s),
        and while the reader waits here it does not wait for their acks either
        (``RetainedAcks.reader_paused``; when it did, at ``MAX_RETAINED_ACKS``, 2,200 of 8,600
        retained QoS 2 messages timed out); their waits do not time out (``never_expire``)."""
        congested = self._transport.congested
        bound = MAX_UNDER_WAY if congested else MAX_UNDER_WAY_READ
        tasks, changes = len(self._running), len(self._changes)
        if tasks < bound and changes < bound:
            return
        why = "it reads its answers slower than they are written" if congested else "whatever it reads"
        self._log_pause(f"{tasks} of its packets are being handled, {changes} SUBSCRIBE/UNSUBSCRIBE(s) wait ({why})")
        self._resume_at = bound // 2
        waits = [asyncio.ensure_future(self._fewer_under_way())]
        if congested:
            waits.append(asyncio.ensure_future(self._drained()))
        limit = 1.5 * self._session.keep_alive if self._session.keep_alive > 0 else None
        self._retained_acks.reader_paused(True)
        try:
            if not await self._waited_with_progress(waits, limit):
                # MQTT-3.1.2-24 could not see the silence of a half-open client: the reader waited
                log.info(UNREAD, self._session.client_id)
                await end_connection(self._handler)
        finally:
            self._retained_acks.reader_paused(False)
            for wait in waits:
                wait.cancel()

    def _progress(self) -> tuple[int, int, int]:
        """What moves while a paused connection gets on: unsent bytes (fewer once its client
        reads some), handlers done, changes waiting (fewer once the message loop applies some)."""
        return self._transport.unsent_bytes, self._handlers_done, len(self._changes)

    async def _waited_with_progress(self, waits: list[asyncio.Task[None]], limit: float | None) -> bool:
        """Waits for the first of ``waits``; False once nothing got on (``_progress``: fewer bytes
        unsent, a handler done, fewer changes waiting) for ``limit`` seconds, looked at
        ``PROGRESS_CHECKS`` times in each: a client reading slowly but steadily is not ended."""
        if limit is None:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            return True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit
        last = self._progress()
        while True:
            done, _ = await asyncio.wait(waits, timeout=limit / PROGRESS_CHECKS, return_when=asyncio.FIRST_COMPLETED)
            if done:
                return True
            now = self._progress()
            if now[0] < last[0] or now[1] > last[1] or now[2] < last[2]:
                deadline = loop.time() + limit
            elif loop.time() >= deadline:
                return False
            last = now

    async def _fewer_under_way(self) -> None:
        """At most ``_resume_at`` handlers under way and fewer changes waiting (``_room``)."""
        if len(self._running) > self._resume_at:
            self._room_made.clear()
            await self._room_made.wait()
        await self._changes.fewer_than(self._resume_at)

    async def _drained(self) -> None:
        """The client read what was unsent past its write buffer's low-water mark (or the connection
        ended: the reader then reads its EOF)."""
        with contextlib.suppress(OSError):  # ConnectionError, TimeoutError, EHOSTUNREACH...
            await self._transport.drain()

    def _handled(self, task: asyncio.Task[None]) -> None:
        """A handler is done: at ``_resume_at`` under way, ``_room`` lets the reader on."""
        self._running.discard(task)
        self._handlers_done += 1
        if len(self._running) <= self._resume_at:
            self._room_made.set()

    def _watch_silence(self) -> SilenceWatch | None:
        """MQTT-3.1.2-24 on amqtt's own loop, which never ends a silent connection (see silence.py):
        every chunk a TCP connection receives, and every message a websocket one receives (a
        websocket ping is not one), counts as heard; 1.5 keep-alive periods without one
        end the connection as the server's decision (the will is published)."""
        if self._session.keep_alive <= 0:
            return None
        handler = self._handler
        client_id = self._session.client_id

        def silent() -> None:
            log.info(SILENT, client_id)
            task = asyncio.get_running_loop().create_task(end_connection(handler))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

        watch = SilenceWatch(1.5 * self._session.keep_alive, silent)
        reader = handler.reader
        if isinstance(reader, StreamReaderAdapter):
            stream = reader._reader
            feed_data = stream.feed_data

            def feed(data: bytes) -> None:
                watch.heard()
                feed_data(data)

            stream.feed_data = feed
        else:  # a websocket connection: every websocket message received (the adapter's read(n)
            # waits for n bytes over as many messages as it takes: a PUBLISH sent in slow pieces)
            protocol = reader._protocol
            recv = protocol.recv

            async def recv_heard(*args: Any, **kwargs: Any) -> Any:
                message = await recv(*args, **kwargs)
                watch.heard()
                return message

            protocol.recv = recv_heard
        watch.start()
        return watch

    async def _read_loop(self, stream: asyncio.StreamReader, keepalive: float | None) -> None:
        """Read and handle packets until EOF or ``keepalive`` seconds of silence."""
        framing = PacketReader(self._max_packet_size)
        try:
            while True:
                data = await _read_some(stream, keepalive)
                if data is None:
                    log.info(SILENT, self._session.client_id)
                    return
                if not data:
                    return  # EOF
                packets = framing.feed(data)
                if packets:
                    await self._dispatch_all(packets)
                if self._handler.durable_ended:
                    return  # the server ended the connection: nothing read after is handled
        finally:
            # No ack can come any more: the message loop does not wait for room (a client that
            # shut its socket for writing still gets every SUBSCRIBE it sent answered).
            self._retained_acks.ending()

    async def run(self) -> None:
        handler = self._handler
        plugins = self._broker.plugins_manager
        if (
            not isinstance(handler.reader, StreamReaderAdapter)
            or MQTTEvents.PACKET_RECEIVED in plugins._event_plugin_callbacks
            or plugins._topic_plugins
        ):
            watch = self._watch_silence()
            try:
                await self._original_loop()
            finally:
                if watch is not None:
                    watch.stop()
            return
        stream = handler.reader._reader
        self._retained_acks.never_expire()
        # MQTT-3.1.2-24: silent for 1.5 keep-alive periods means gone (amqtt only logs it, which
        # would leave a half-open device's session "connected" forever, its queue stalled).
        keepalive = 1.5 * self._session.keep_alive if self._session.keep_alive > 0 else None
        running = self._running
        handler._reader_ready.set()
        ended_by_peer = False
        try:
            await self._read_loop(stream, keepalive)
            ended_by_peer = True  # EOF or keep-alive silence
        except (asyncio.IncompleteReadError, ConnectionError):
            ended_by_peer = True  # EOF or reset: the connection is over
        except asyncio.CancelledError:
            pass  # stop() (a take-over, after what it read as its wait ended; the broker stopping): the rest is dropped
        except ProtocolViolationError as exc:
            log.warning("closing the connection of %s: %s", self._session.client_id, exc)
        except Exception as exc:  # amqtt's loop also ends the connection on anything unexpected
            log.warning("%s: reader stopped: %r", self._session.client_id, exc)
        if self._settling and ended_by_peer:
            # Unlike amqtt's own reader, which cancels them: a DISCONNECT's handler signals the end
            # to the message loop. SUBSCRIBEs and UNSUBSCRIBEs were queued as they were read (their
            # tasks do nothing more), and ``stop()`` below waits until the loop has applied every
            # queued change (see ``_one_queue_of_subscription_changes``). This takes a loop pass
            # (CLOSE_GRACE bounds it); a cancel meanwhile (stop()) ends the wait; the connection's
            # end follows all the same.
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait(list(self._settling), timeout=CLOSE_GRACE)
        for task in list(running):
            task.cancel()
            task.add_done_callback(partial(_cancelled_by_the_end, self._session.client_id))
        await handler.handle_connection_closed()
        handler._reader_stopped.set()
        await handler.stop()
