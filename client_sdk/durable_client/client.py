"""DurableClient: the application's handle on a durable session of an amqtt-durable broker.

Threads. connect() starts one background thread, the network thread, which owns the
connection: it runs paho's loop, reconnects with backoff, and calls every listener and
callback (on_connected, on_live, ...), one at a time, in arrival order. Listeners should be
quick; they may call publish() (which then does not wait for the PUBACK: the PUBACK can only
arrive on this very thread), subscribe() and unsubscribe(). Application threads may call
every method; the ones that wait (connect, publish, subscribe, subscribe_stream, stream_info,
close) wait on events set by the network thread, each wait bounded by a timeout.

Each connection is set up the same way (docs/protocol.md): CONNECT, ``hello`` (which says
the session's epoch), then the subscriptions the broker may have lost, the streams, and
``ready`` if the application asked for it before. Only then is the client ``connected``.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Final, ParamSpec

from durable_protocol import (
    CONTROL_TOPIC,
    MAX_REQUEST_BYTES,
    MAX_STREAM_WINDOW,
    Marker,
    Reply,
    encode_request,
    shown_topic,
)

from ._commit import DEFAULT_FSYNC_BATCH, DEFAULT_FSYNC_DELAY_MS, open_group_committed
from ._options import (
    check_after,
    check_bool,
    check_callable,
    check_filter,
    check_options,
    check_qos,
    check_seconds,
    check_topic,
    check_window,
)
from ._paho import ConnAck, Inbound, PahoLink, PublishHandle, publish_size, topic_matches
from ._receiver import Handed, Outcome, Receiver
from ._registry import Registry, StreamSubscription, Subscription
from ._stream_acks import StreamAcks
from .backoff import Backoff
from .cache import LastValueCache
from .delivery_log import DeliveryLog, reconcile
from .errors import (
    ConnectFailed,
    ControlRequestFailed,
    DurableClientError,
    EventNotProcessedError,
    RequestTimeout,
    Unconnected,
    WrongTypeError,
)
from .events import ConnectionInfo, Listener, PersistenceLevel, Stats, StreamBounds

log = logging.getLogger("durable_client")

_P = ParamSpec("_P")

_LOOP_TIMEOUT: Final = 0.25
"""Longest the network thread sleeps in select(): bounds how late it notices a handshake deadline."""
_SHUTDOWN_FLUSH: Final = 1.0
"""How long the network thread tries to write DISCONNECT (and pending acks) when it stops."""
_REQUEST_TIMEOUT: Final = 10.0

Completion = tuple[int, int, int, tuple[str, int] | None]
"""A deferred event processed (or a duplicate passed): (connection generation, packet id, QoS, stream ack)."""


@dataclass(slots=True)
class _Waiter:
    req: int
    event: threading.Event = field(default_factory=threading.Event)
    reply: Reply | None = None
    lost: bool = False


@dataclass(slots=True)
class _FirstConnect:
    """connect()'s view of the first connection attempt."""

    done: threading.Event = field(default_factory=threading.Event)
    error: ConnectFailed | None = None
    problem: str = "no answer from the broker yet"


class _SendsDue:
    """Publishes whose ``send`` record waits for their PUBACK (PUBCOMP), by packet id: the network thread
    writes it as that comes, also after publish() gave up waiting (the broker has the message then). The
    lock is taken under paho's lock of outgoing messages (its PUBACK handling), never around it."""

    def __init__(self) -> None:
        self._due: dict[int, tuple[PublishHandle, str, bytes, int]] = {}
        self._lock = threading.Lock()

    def add(self, handle: PublishHandle, topic: str, data: bytes, qos: int) -> None:
        with self._lock:
            self._due[handle.mid] = (handle, topic, data, qos)

    def take(self, mid: int, info: Any) -> tuple[str, bytes, int] | None:
        """The record of the publish ``info`` is (none for a QoS 0 one, or one from a listener)."""
        if not self._due:  # every PUBACK and PUBCOMP comes here: no lock without a record due
            return None
        with self._lock:
            due = self._due.get(mid)
            if due is None or not due[0].is_for(info):
                return None
            del self._due[mid]
        return due[1:]

    def forget(self, handle: PublishHandle) -> None:
        """A publish dropped unsent (too large after a reconnect): no PUBACK will come."""
        with self._lock:
            due = self._due.get(handle.mid)
            if due is not None and due[0] is handle:
                del self._due[handle.mid]


class DurableClient:
    """A durable-session client: events survive disconnects and restarts, processed exactly once.

    Subscriptions, streams and ``ready_for_events()`` are remembered and replayed on every
    reconnect, so the application sets them up once. See the module docstring for threads.
    """

    def __init__(
        self,
        client_id: str,
        host: str = "127.0.0.1",
        port: int = 1883,
        *,
        keepalive: int = 30,
        username: str | None = None,
        password: str | bytes | None = None,
        session_expiry: float | None = None,
        persistence: PersistenceLevel = "memory",
        state_dir: str | os.PathLike[str] | None = None,
        durable_session: bool = True,
        reconnect_min_delay: float = 0.1,
        reconnect_max_delay: float = 30.0,
        on_connected: Callable[[ConnectionInfo], None] | None = None,
        on_disconnected: Callable[[str], None] | None = None,
        on_session_lost: Callable[[], None] | None = None,
        on_live: Callable[[Marker], None] | None = None,
        on_persistence_fallback: Callable[[OSError], None] | None = None,
        delivery_log: str | os.PathLike[str] | None = None,
        fsync_batch: int = DEFAULT_FSYNC_BATCH,
        fsync_delay_ms: float = DEFAULT_FSYNC_DELAY_MS,
        failover: Iterable[tuple[str, int]] = (),
    ) -> None:
        """Nothing touches the network until connect().

        ``failover=[(host, port), ...]``: the other brokers of a replication group (docs/
        replication.md). A connection that fails, or a CONNACK 3 (a backup refuses clients; so
        does a primary whose store cannot write, or one holding ``max_durable_sessions`` to a
        new session), moves the client on to the next address, round the list from
        ``host:port``; the session, its epoch and sequence ids are the same on whichever broker
        is primary.

        ``session_expiry`` asks the broker to keep this session that many seconds after a
        disconnect (capped by the broker). ``persistence="disk"`` keeps processed marks under
        ``state_dir/<client_id>/`` so exactly-once survives a restart; an I/O error there
        falls back to memory (``on_persistence_fallback``) rather than stopping delivery.
        ``durable_session=False`` makes a stateless client: no session on the broker, raw
        messages, only streams resume (from the positions this client keeps).
        ``delivery_log=PATH`` appends a JSON line per send, processed event, subscription,
        connection and marker (docs/delivery-log.md), for ``durable-pipeline audit``. With
        ``persistence="disk"`` its ``receive`` records also count as processed: on start the
        client advances its marks to what the log's tail shows processed, so a process killed
        between an event's record and its mark does not process (nor log) that event again.

        With ``persistence="disk"`` the marks are fsynced once per group of events (group
        commit, ``_commit.py``), and an event is acknowledged to the broker only after the
        fsync that covers its mark: a group ends after ``fsync_batch`` events (default 64),
        when the connection has nothing more to read, or ``fsync_delay_ms`` (default 5) after
        its first event, whichever comes first. ``fsync_batch=1`` is an fsync per event. A
        SIGKILL loses no mark (each is written to the OS at once); a power loss makes at most
        the last group's events, none of them acknowledged, come again.
        """
        checked = check_options(
            client_id=client_id, host=host, port=port, keepalive=keepalive, session_expiry=session_expiry,
            username=username, password=password, durable_session=durable_session,
            reconnect_min_delay=reconnect_min_delay, reconnect_max_delay=reconnect_max_delay,
            delivery_log=delivery_log, state_dir=state_dir, failover=failover,
            on_connected=on_connected, on_disconnected=on_disconnected, on_session_lost=on_session_lost,
            on_live=on_live, on_persistence_fallback=on_persistence_fallback,
        )
        self.client_id = client_id
        self.host: str = checked["host"]
        self.port: int = checked["port"]
        self._addresses, self._address_index = [(self.host, self.port), *checked["failover"]], 0
        self._keepalive: int = checked["keepalive"]
        self._username: str | None = checked["username"]
        self._password: str | bytes | None = checked["password"]
        self._session_expiry: float | None = checked["session_expiry"]
        self._durable = durable_session
        self._backoff = Backoff(checked["reconnect_min_delay"], checked["reconnect_max_delay"])
        self._on_connected = on_connected
        self._on_disconnected = on_disconnected
        self._on_session_lost = on_session_lost
        self._on_live = on_live
        self._on_persistence_fallback = on_persistence_fallback

        self.cache = LastValueCache()
        """Newest value per topic (GemFire client-cache rules); readable while disconnected."""
        # _gate (CPL-2): acknowledgements held until their marks are fsynced. None for CPL-1: acks go at once.
        self._state, self._gate = open_group_committed(
            persistence, client_id, state_dir, self._persistence_fell_back, self._send_ack,
            fsync_batch=fsync_batch, fsync_delay_ms=fsync_delay_ms,
        )
        self._stream_acks = StreamAcks(self._send_stream_ack)
        self._registry = Registry()
        if delivery_log is not None:
            reconcile(self._state, delivery_log, client_id)  # before the log is opened (and maybe created)
        self._delivery_log = DeliveryLog(delivery_log, client_id) if delivery_log is not None else None
        self._sends_due = _SendsDue()
        """docs/delivery-log.md: what was sent and processed, for ``durable-pipeline audit``."""
        self._receiver = Receiver(
            framed=durable_session,
            state=self._state,
            cache=self.cache,
            registry=self._registry,
            on_reply=self._handle_reply,
            on_marker=self._handle_marker,
            on_processed=self._delivery_log.receive if self._delivery_log is not None else None,
        )

        # Connection state: changed under _lock, by the network thread except where noted.
        self._lock = threading.RLock()
        self._link: PahoLink | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._first: _FirstConnect | None = None
        self._closed = False  # set by close()
        self._connected = False
        self._handshake_timeout = _REQUEST_TIMEOUT
        self._handshake_deadline: float | None = None  # set while CONNECT/hello await their answers
        self._hello_req: int | None = None
        self._interests_undone: list[Subscription] = []
        """Those whose ``interest durable: true`` went before the last CONNACK's hello, or a durable one that took
        one's place (_take_over): emptied at the hello reply, kept when the connection is lost first, until the
        next CONNACK (see _undo_interests)."""
        self._session_present = False
        self._max_packet_size: int | None = None
        """The broker's max_packet_size from its hello reply (None: not said): publish() refuses larger."""
        self._had_session = False  # a durable session was set up in this process
        self._ready_requested = False  # set by ready_for_events()
        self._ready_sent = False  # on the current connection (or waiting for its set-up's acks: _ready_deferred)
        self._ready_deferred = False  # `ready` goes out once this connection's (UN)SUBACKs are in
        self._redelivering = False  # a listener failed; nothing processed since
        self._connections = 0
        self._init_requests_and_acks()

    def _init_requests_and_acks(self) -> None:
        self._waiters: dict[int, _Waiter] = {}
        self._req_ids = itertools.count(1)
        # PUBACKs gathered on the network thread and written as one packet per burst of messages
        # (_flush_acks); _generation tells the packet ids of one connection from the next.
        self._acks: list[int] = []
        self._acks_lock, self._generation = threading.Lock(), 0
        # Deferred processing (_defer_to, the asyncio client): events go to another thread, which
        # completes them (marks) and hands the acknowledgements back through _completions.
        self._hand: Callable[[Handed], None] | None = None
        self._hand_flush: Callable[[bool], None] = _nothing
        self._completions: deque[Completion | tuple[int, EventNotProcessedError]] = deque()
        self._completions_lock = threading.Lock()  # one drain at a time (close() drains too): order kept
        self._wake_sent = False

    # ================================================================ lifecycle
    def connect(self, timeout: float = 10.0) -> None:
        """Start the network thread; return once the first session is set up.

        Raises ConnectFailed when the broker refuses the client or answers ``hello`` with an
        error (at once), or when no session is set up within ``timeout`` (broker down, or
        without the amqtt-durable plugin). The thread has then stopped. Later connection
        losses are repaired in the background: see ``on_disconnected``/``on_connected``.
        """
        if self._closed:
            raise Unconnected("this client was closed; create a new DurableClient to connect again")
        if self._thread is not None:
            raise DurableClientError("connect() was called already: the client reconnects on its own")
        timeout = check_seconds("timeout", timeout, low=0)
        first = _FirstConnect()
        self._first = first
        self._handshake_timeout = timeout
        self._stop.clear()
        self._backoff.reset()
        if self._link is None:
            self._link = PahoLink(
                self.client_id,
                self.host,
                self.port,
                keepalive=self._keepalive,
                clean_session=not self._durable,
                username=self._username,
                password=self._password,
                connect_timeout=min(timeout, 10.0),
                on_connack=self._handle_connack,
                on_message=self._handle_message,
                on_lost=self._handle_lost,
                on_subscribed=self._handle_subscribed,
                on_unsubscribed=self._handle_unsubscribed,
                on_published=self._handle_published,
                on_burst=self._end_burst,
            )
        thread = threading.Thread(target=self._run, name=f"durable-client-{self.client_id}", daemon=True)
        self._thread = thread
        thread.start()
        started = time.monotonic()
        if first.done.wait(timeout) and first.error is None:
            # Subscriptions made before connect() are part of setting the session up: a client
            # that closes right away must not leave one half-made (it would be sent again).
            self._registry.wait_settled(max(0.0, timeout - (time.monotonic() - started)))
            return
        error = first.error or ConnectFailed(
            f"no durable session with {self.host}:{self.port} within {timeout} s ({first.problem}). Is the broker "
            "running, and does it run the amqtt-durable plugin?"
        )
        self._stop_thread(timeout)
        raise error

    def _stop_thread(self, timeout: float) -> None:
        """After a failed connect(): stop the network thread so connect() may be called again."""
        thread = self._thread
        self._stop.set()
        if self._link is not None and self._link.socket_open:
            self._link.disconnect()
        if thread is None:
            return
        # The thread blocks at most for a TCP connect (<= 10 s), a loop pass and the flush.
        thread.join(min(timeout, 10.0) + _LOOP_TIMEOUT + _SHUTDOWN_FLUSH + 1.0)
        if thread.is_alive():
            log.warning("the network thread did not stop in time; it stops in the background")
        else:
            self._thread = None

    def close(self, keep_session: bool = True, timeout: float = 10.0) -> None:
        """Disconnect for good; idempotent.

        ``keep_session=True`` leaves the durable session on the broker: it keeps queueing
        until this client id connects again or the session expires. ``keep_session=False``
        first deletes it (``end_session``, waiting up to ``timeout`` for the reply). The
        client is closed either way; if the session could not be ended, ControlRequestFailed
        (or Unconnected, while disconnected) is raised afterwards: the broker then drops the
        session only when it expires. RequestTimeout (no reply within ``timeout``) or
        Unconnected (the connection lost before the reply) is raised afterwards too: the
        session may or may not have been ended.

        The event being processed finishes (each of its listeners) and is acknowledged before
        the DISCONNECT; no later event is processed. From another thread this waits up to
        ``timeout`` for that; from a listener it returns at once (the acknowledgement and the
        DISCONNECT follow when the listener returns: ``on_disconnected`` says when).
        """
        check_bool("keep_session", keep_session)
        timeout = check_seconds("timeout", timeout, low=0)
        if self._closed:
            return
        on_network_thread = self._on_network_thread()
        error: DurableClientError | None = None
        if not keep_session and self._durable:
            try:
                self._end_session(timeout, wait=not on_network_thread)
                if self._delivery_log is not None:
                    self._delivery_log.session_end()
            except DurableClientError as exc:
                error = exc
        with self._lock:
            self._closed = True
        thread = self._thread
        self._stop.set()
        # No listener runs for what arrives from now on: the broker sends it again to the session's next
        # connection, which must not find it processed already (without CPL-2 marks, twice).
        self._receiver.fail()
        with self._registry.lock:
            self._registry.changed.notify_all()  # a subscribe() waiting for its SUBACK stops waiting
        self._release_held()  # before the DISCONNECT
        if thread is not None and not on_network_thread:
            if self._link is not None and self._link.socket_open:
                # The network thread ends its pass (a listener running finishes), sends the PUBACKs gathered
                # and then the DISCONNECT (_run's end): a PUBACK after the DISCONNECT would be lost.
                self._link.wake()
            thread.join(timeout)
        if thread is None or not thread.is_alive():
            self._close_files()
        elif not on_network_thread:
            log.warning("the network thread did not stop within %s s; it stops in the background", timeout)
        # Otherwise (called from a listener) the network thread closes the state as it ends.
        if error is not None:
            raise error

    def _end_session(self, timeout: float, *, wait: bool) -> None:
        with self._lock:
            if not self._connected:
                raise Unconnected(
                    "not connected, so the durable session was not ended: the broker drops it when it expires"
                )
            waiter = self._send_request("end_session", wait=wait)
        if waiter is not None:
            reply = self._await(waiter, timeout, "end_session")
            if not reply.ok:
                raise ControlRequestFailed("end_session", reply.error_code or "?", reply.error_message or "")
            log.info("durable session ended: %s queued messages dropped", reply.fields.get("messages_dropped"))
        with self._receiver.marks_lock:
            self._state.reset()

    def __enter__(self) -> DurableClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close(keep_session=True)

    # ================================================================ state
    @property
    def connected(self) -> bool:
        """True from the end of a connection's set-up (subscriptions replayed) until it is lost."""
        return self._connected

    @property
    def persistence_level(self) -> PersistenceLevel:
        """``disk`` until an I/O error makes the client fall back to ``memory``."""
        return self._state.level

    @property
    def stats(self) -> Stats:
        return self._receiver.counters.snapshot(max(0, self._connections - 1))

    # ================================================================ operations
    def subscribe(
        self,
        topic_filter: str,
        qos: int = 1,
        *,
        durable: bool = True,
        listener: Listener | None = None,
        timeout: float = _REQUEST_TIMEOUT,
    ) -> None:
        """Subscribe (or change an existing subscription's QoS, durability or listener).

        ``durable=False`` is GemFire's non-durable interest: the broker drops the subscription
        when the connection ends (the client subscribes it again after reconnecting), so
        nothing is queued for it while away. Without a listener the events only feed the cache.
        QoS 2 is requested as QoS 1 on a durable session: the SDK's marks already give
        exactly-once, and paho cannot complete a QoS 2 exchange it did not start (after a
        restart). Called while disconnected, the subscription is sent on the next connect (one
        made durable again then is said to be, before that connection's hello, so an older
        connection's end the broker runs late does not drop it);
        when connected, it returns once the broker has confirmed it (its SUBACK; for a change of
        durability only, its ``interest`` reply; both for a change to durable at a new QoS, and for a
        durable one at a new QoS while an earlier change to durable of it awaits its reply: it sends
        no ``interest`` of its own, that reply is its), or
        raises RequestTimeout after ``timeout`` seconds without it (the subscription stays
        registered and is sent again on reconnect; a connection lost first is no confirmation: it
        waits for the one of the reconnect, the SUBACK of the SUBSCRIBE it sends again, or the hello
        reply that lists a durable filter the broker's session kept). A filter whose packets would
        be larger than the broker's max_packet_size (once a hello reply said it) is a ValueError, also
        when a reconnect's hello reply drops it while this call waits. Unconnected when the
        client is closed while it waits; it returns when another thread unsubscribes the filter
        meanwhile, or replaces it by another subscribe(). A change of durability the broker refuses
        (its ``interest`` reply is an error) returns without raising, with a WARNING; one to
        ``durable=True`` stays registered as durable, held non-durable by the broker, so a later
        ``subscribe(durable=True)`` of it (any QoS) and the reconnect send it again (refused at the
        reconnect, with the WARNING, it stays so: the reconnect subscribes it non-durable, and its
        SUBACK logs ``durable: false``, also after a ``subscribe(durable=True)`` of it, any QoS, or an
        unsubscribe() and subscribe() of it, made before that reconnect's hello reply, before or after
        the refusal came). A ``subscribe(durable=False)`` of it sends no ``interest`` unless such a retry
        still awaits its reply, and clears the refusal (at another QoS its SUBACK logs ``durable:
        false``); made before that hello reply, a later ``subscribe(durable=True)`` there sends the
        change again, after the hello reply, with its SUBSCRIBE. Called from a
        listener, or by a stateless client changing only the durability (it sends no ``interest``), it
        returns without waiting.
        """
        self._check_open()
        check_filter(topic_filter)
        qos = check_qos(qos)
        check_bool("durable", durable)
        check_callable("listener", listener)
        timeout = check_seconds("timeout", timeout, low=0)
        self._check_filter_size(topic_filter, request=self._durable)
        if not self._subscribe(topic_filter, qos, durable, listener) or self._on_network_thread():
            return
        answered = self._registry.wait_answered(topic_filter, timeout, self._stop.is_set)
        if self._closed or self._stop.is_set():
            raise Unconnected(
                f"the client was closed while waiting for the SUBACK (or interest reply) of "
                f"{shown_topic(topic_filter)!r}; the broker's durable session may hold the subscription"
            )
        if not answered:
            raise RequestTimeout(
                f"no SUBACK (or interest reply) for {shown_topic(topic_filter)!r} within {timeout} s; it is sent "
                "again on reconnect"
            )
        if self._registry.get(topic_filter) is None:  # unsubscribed meanwhile, or dropped at a hello reply
            self._check_filter_size(topic_filter, request=self._durable, outcome="the subscription was dropped")

    def _subscribe(self, topic_filter: str, qos: int, durable: bool, listener: Listener | None) -> bool:
        """Record the subscription and send what the broker must hear; True when a SUBSCRIBE went out."""
        with self._lock:
            # One unsubscribe() removed after its interest went before a hello whose reply has not come (this
            # connection's, or one lost since) counts too: this subscribe drops that UNSUBSCRIBE, not sent yet, so
            # the broker holds the filter as that interest left it.
            previous = self._registry.get(topic_filter) or next(
                (s for s in self._interests_undone if s.filter == topic_filter), None
            )
            subscription = Subscription(topic_filter, qos, durable, listener)
            with self._registry.lock:
                self._registry.put(subscription)
                if previous is not None:
                    self._take_over(previous, subscription)
                if not self._connected:
                    subscription.undo_interest = (
                        durable and previous is not None and (previous.undo_interest or not previous.durable)
                    )
                    # Logged when the reconnect's hello reply or SUBACK confirms it (_replay_subscriptions).
                    subscription.interest_due = subscription.undo_interest
                    return False
                # A new durable subscription is durable by default; anything else is said.
                # A retry of a refused change awaiting its reply may be applied: the broker may hold it durable.
                held_durable = (
                    previous.durable and (not previous.refused or previous.interest_req is not None)
                    if previous is not None
                    else True
                )
                changed = held_durable != durable
                # The audit's window closes as durable: false is sent (expecting less is safe: the broker
                # may apply it before any SUBACK comes, or the connection ends first) and opens at the
                # broker's reply to durable: true (_interest_replied).
                # Not for a filter whose SUBACK refused it (0x80) and not sent again since: the broker holds nothing.
                held = previous is not None and (previous.confirmed or previous.mid is not None)
                lowered = self._durable and not durable and held and held_durable
                if lowered and self._delivery_log is not None:
                    self._delivery_log.subscribe(topic_filter, qos, False)
                if self._durable and changed:
                    req = next(self._req_ids)
                    if previous is not None and previous.qos == qos:
                        # No SUBSCRIBE, so no SUBACK: subscribe() waits for the interest reply.
                        subscription.interest_req, subscription.interest_due = req, True
                    elif durable:  # sent before the SUBSCRIBE: its reply, first, says whether the SUBACK writes true
                        subscription.interest_req, subscription.interest_due = req, True  # or writes it, after
                    self._send_request("interest", req=req, filter=topic_filter, durable=durable)
                if previous is None or previous.qos != qos:
                    self._send_subscribe(subscription)
                    subscription.false_logged = lowered and subscription.mid is not None
                    return True
                if lowered:
                    subscription.false_logged = subscription.mid is not None  # an earlier SUBSCRIBE's SUBACK
                return self._durable and changed and subscription.interest_due  # a listener alone: at once

    def _take_over(self, previous: Subscription, subscription: Subscription) -> None:
        """(Holding _lock and the registry's.) What ``subscription`` keeps of the one it replaces: its SUBACK
        still due (at the same QoS), and, whatever the QoS, the ``interest`` still awaiting its reply (the
        broker may apply it: the reply must find the subscription that now stands for the filter) and the
        refusal of durable: true."""
        if previous.qos == subscription.qos:
            subscription.confirmed, subscription.mid = previous.confirmed, previous.mid
            subscription.answered, subscription.false_logged = previous.answered, previous.false_logged
        undone = any(s is previous for s in self._interests_undone)
        if not subscription.durable and (undone or previous.qos != subscription.qos):
            # Its interest went before the hello, and the broker holds the filter as that left it: the replaced
            # one keeps its place there (and gets the reply); a later durable one sends its own at the hello.
            # At a new QoS (connected) a non-durable one returns at its SUBACK: no earlier reply is its own.
            return
        subscription.interest_req, subscription.interest_due = previous.interest_req, previous.interest_due
        # The broker refused durable: true earlier and holds it non-durable.
        subscription.refused = subscription.durable and previous.refused
        if undone:
            # The broker applies it as this one (_interest_replied, _replay_subscriptions): no interest of its own.
            self._interests_undone = [subscription if s is previous else s for s in self._interests_undone]

    def unsubscribe(self, topic_filter: str) -> None:
        """Remove a subscription or a stream subscription on ``topic_filter``.

        A durable session's subscription may have been made by an earlier run of this client id
        (the broker keeps it and says so in its hello reply): that one is removed too, now or on
        connecting, by the same call when the filter is also a stream subscription of this run.
        Otherwise a no-op if neither (a broker whose hello lists nothing gets the UNSUBSCRIBE).
        A filter ``subscribe()`` would refuse is refused here too (ValueError): no session holds it."""
        self._check_open()
        check_filter(topic_filter)
        self._check_filter_size(topic_filter, request=self._registry.has_stream(topic_filter))
        if self._delivery_log is not None:
            self._delivery_log.unsubscribe(topic_filter)
        with self._lock:
            stream = self._registry.remove_stream(topic_filter) is not None
            if stream and self._connected:
                self._send_request("stream_unsubscribe", filter=topic_filter)
            subscription = self._registry.remove(topic_filter)
            broker_held = self._registry.broker_held
            if not self._connected:
                held = True  # deferred: the next hello says what the broker's session holds
            elif broker_held is not None:
                held = topic_filter in broker_held  # what it said at this connection's hello
            else:
                held = not stream  # a broker that did not say: a stream's filter is taken for a stream only
            inherited = self._durable and held
            tell_broker = subscription is not None or inherited
            if tell_broker and self._connected:
                self._send_unsubscribe(topic_filter)
                if broker_held is not None:
                    broker_held.discard(topic_filter)
            elif tell_broker and self._durable:
                self._registry.unsubscribe_later(topic_filter)

    def ready_for_events(self) -> None:
        """Say the listeners are in place: the broker then replays what it queued, then a marker.

        Until then a durable session is held (GemFire's readyForEvents). Remembered: every
        reconnect sends it again, after the subscriptions. It goes out once the connection's
        SUBSCRIBEs and UNSUBSCRIBEs are confirmed, so the marker lists them. A no-op on a
        stateless client.
        """
        self._check_open()
        if not self._durable:
            return
        with self._lock:
            self._ready_requested = True
            if self._connected and not self._ready_sent:
                self._send_ready()

    def _send_ready(self) -> None:
        """(Holding _lock.) Send ``ready`` on this connection once the broker has acknowledged every
        SUBSCRIBE and UNSUBSCRIBE still open: the broker handles a SUBSCRIBE after control requests
        that arrived before it (protocol.md), so a ``ready`` sent along with them would get a marker
        whose ``live`` list, and replay, do not include them yet."""
        self._ready_sent = True
        self._ready_deferred = not self._registry.settled()
        if not self._ready_deferred:
            self._send_request("ready")

    def _send_deferred_ready(self) -> None:
        """A SUBACK or UNSUBACK arrived (network thread): the deferred ``ready`` goes out once none is open."""
        with self._lock:
            if self._ready_deferred and self._connected and self._registry.settled():
                self._ready_deferred = False
                self._send_request("ready")

    def subscribe_stream(
        self,
        topic_filter: str,
        listener: Listener,
        *,
        window: int | None = None,
        after: dict[str, int] | None = None,
        timeout: float = _REQUEST_TIMEOUT,
    ) -> None:
        """Open the stream logs matching ``topic_filter`` from this client's own positions.

        Stateless resume: the broker keeps no position for a stream subscription; the client
        presents the last id it processed per topic, so it resumes there after a reconnect
        (and after a restart with persistence="disk"). ``window`` caps unacknowledged events
        per topic. When connected, waits for the broker's answer and raises
        ControlRequestFailed if it refuses (e.g. ``unknown_stream``); otherwise it is opened
        on the next connect.

        ``after`` ({topic: last id already processed}) replaces this client's positions for
        those topics, for readers that keep their offsets elsewhere (a Spark checkpoint) and
        must start exactly there. They become the client's positions, so a reconnect resumes
        from them like from any other. ``{topic: 0}`` starts at id 1: when retention trimmed
        it, the broker reports the gap (logged) instead of starting silently further on. A
        topic that a stream subscription this client holds already matches (open, or to open at
        the next connect) cannot be moved (ValueError): the broker keeps one cursor per topic
        and connection.
        """
        self._check_open()
        check_filter(topic_filter)
        check_callable("listener", listener, optional=False)
        timeout = check_seconds("timeout", timeout, low=0)
        window = check_window(window)
        positions = check_after(topic_filter, after)
        self._check_filter_size(topic_filter, request=True)
        with self._lock:
            for stream in self._registry.streams():
                moved = sorted(topic for topic in positions if topic_matches(stream.filter, topic))
                if moved:
                    raise ValueError(
                        f"after: the stream subscription {stream.filter!r} already reads {', '.join(moved)}, which "
                        "'after' cannot move; unsubscribe it first"
                    )
            held = self._state.positions()
            replaced: dict[str, int | None] = {topic: held.get(topic) for topic in positions}
            for topic, last_id in positions.items():
                self._state.record_stream(topic, last_id)
            previous = self._registry.put_stream(StreamSubscription(topic_filter, listener, window))
            if previous is not None or not self._connected:
                return
            waiter = self._open_stream(topic_filter, window, wait=not self._on_network_thread())
        if waiter is None:
            return
        reply = self._await(waiter, timeout, "stream_subscribe")
        if not reply.ok:  # nothing kept: neither the stream nor its ``after`` positions
            with self._lock:
                self._registry.remove_stream(topic_filter)
                if replaced:
                    self._state.restore_streams(replaced, if_at=positions)
            raise ControlRequestFailed("stream_subscribe", reply.error_code or "?", reply.error_message or "")

    def stream_info(self, topic_filter: str = "#", *, timeout: float = _REQUEST_TIMEOUT) -> StreamBounds:
        """The stream logs matching ``topic_filter`` now: {topic: (first retained id, last id)}.

        What a reader needs to plan a range before opening anything: retention moves the
        first id up, publishes move the last one. A log retention emptied reads
        ``(last + 1, last)``. A filter that no configured stream covers is refused
        (ControlRequestFailed, ``unknown_stream``). ``.store`` is the broker store's id: ids
        of two stores are not comparable. Needs a connection (else
        Unconnected); waits up to ``timeout`` for the reply (RequestTimeout), and cannot be
        called from a listener, whose thread is the one the reply arrives on.
        """
        self._check_open()
        check_filter(topic_filter)
        timeout = check_seconds("timeout", timeout, low=0)
        self._check_filter_size(topic_filter, request=True)
        if self._on_network_thread():
            raise DurableClientError(
                "stream_info() cannot wait for its reply on the network thread (called from a listener or callback)"
            )
        with self._lock:
            if not self._connected:
                raise Unconnected(f"not connected to {self.host}:{self.port} (reconnecting): stream_info was not sent")
            waiter = self._send_request("stream_info", wait=True, filter=topic_filter)
        assert waiter is not None
        reply = self._await(waiter, timeout, "stream_info")
        if not reply.ok:
            raise ControlRequestFailed("stream_info", reply.error_code or "?", reply.error_message or "")
        topics = reply.fields.get("topics")
        store = reply.fields.get("store")
        try:
            return StreamBounds(
                {str(topic): (int(bounds["first"]), int(bounds["last"])) for topic, bounds in (topics or {}).items()},
                store=int(store) if store is not None else None,
            )
        except (AttributeError, KeyError, TypeError, ValueError):
            raise ControlRequestFailed(
                "stream_info", "malformed", f"the reply's 'topics' is not {{topic: {{first, last}}}}: {topics!r}"
            ) from None

    def publish(
        self, topic: str, payload: bytes | str, qos: int = 1, retain: bool = False, *, timeout: float = 10.0
    ) -> None:
        """Publish; at QoS 1/2 wait (up to ``timeout``) until the broker has it.

        Raises Unconnected while disconnected (nothing is queued: GemFire's updates are not
        allowed while disconnected either), and when the connection is lost as the message is
        handed to paho (at QoS 1/2 paho keeps it and sends it after the reconnect);
        RequestTimeout when the PUBACK is late (the message may still arrive; a delivery log gets its
        ``send`` when the PUBACK comes). At QoS 0 and from
        a listener it returns once paho has queued the message, without waiting. ValueError
        (``payload``) for a PUBLISH larger than the broker's max_packet_size (its hello reply
        says it), also when an unacknowledged one is found larger at a reconnect's hello reply:
        it is dropped then, with an ERROR, not sent again (it may have been delivered: the
        broker may have had it before the connection was lost), and no ``send`` is logged.
        DurableClientError (``paho refused the message``) for a QoS 1/2 message paho does not take:
        its packet id is still an unacknowledged publish's (65535 packet ids given out since, by
        publishes at any QoS, control requests and SUBSCRIBE/UNSUBSCRIBE alike): nothing was published or
        logged, and that earlier publish still gets its ``send`` when its PUBACK comes.
        """
        self._check_open()
        data = _publishable(topic, payload)
        qos = check_qos(qos)
        check_bool("retain", retain)
        timeout = check_seconds("timeout", timeout, low=0)
        if not self._connected:
            raise Unconnected(f"not connected to {self.host}:{self.port} (reconnecting): nothing was published")
        self._check_packet_size(topic, data, qos)
        on_network_thread = self._on_network_thread()
        logged_at_ack = qos > 0 and not on_network_thread and self._delivery_log is not None

        def send_due(handle: PublishHandle) -> None:  # its PUBACK (PUBCOMP) writes the ``send`` record
            self._sends_due.add(handle, topic, data, qos)

        handle = self._link_or_raise().publish(topic, data, qos, retain, send_due if logged_at_ack else None)
        if handle.refused:
            raise DurableClientError(
                f"paho refused the message: packet id {handle.mid} is still an unacknowledged publish's (or its "
                "queue is full); nothing was published"
            )
        if not handle.queued:
            if qos == 0:
                raise Unconnected(f"the connection to {self.host}:{self.port} was just lost: nothing was published")
            raise Unconnected(
                f"the connection to {self.host}:{self.port} was lost as the message was handed over: paho keeps "
                "it and sends it after the reconnect, so it may still arrive, but its PUBACK cannot be awaited"
            )
        if qos == 0 or on_network_thread:
            self._log_send(topic, data, qos)
            return
        try:
            self._await_puback(handle, topic, timeout)  # the record is written when it returns
        finally:
            if handle.too_large:  # dropped unsent: no PUBACK will write it
                self._sends_due.forget(handle)

    def _check_packet_size(self, topic: str, data: bytes, qos: int) -> None:
        """Refuse a PUBLISH the broker would close the connection for (its hello reply's
        ``max_packet_size``): paho would send it again after every reconnect, for ever."""
        limit = self._max_packet_size
        if limit is None:
            return
        size = publish_size(topic, len(data), qos)
        if size > limit:
            parts = "topic, packet id" if qos else "topic"  # a QoS 0 PUBLISH has no packet id
            raise ValueError(
                f"payload: a PUBLISH of {size} bytes ({parts} and {len(data)} bytes of payload) is larger "
                f"than the broker's max_packet_size ({limit} bytes), which would close the connection; nothing "
                "was published"
            )

    def _check_filter_size(self, topic_filter: str, *, request: bool, outcome: str = "nothing was changed") -> None:
        """Refuse a filter whose SUBSCRIBE (or, with ``request``, control request) the broker would
        close the connection for (its last hello reply's ``max_packet_size``): it would be sent
        again after every reconnect, for ever."""
        limit = self._max_packet_size
        if limit is None:  # no hello reply said it: nothing to measure against (the request is not encoded)
            return
        size = _filter_packet_size(topic_filter, request=request)  # exact: the message says it
        if size > limit:
            raise ValueError(
                f"topic_filter: {shown_topic(topic_filter)!r} ({len(topic_filter.encode('utf-8'))} bytes) needs a "
                f"packet of {size} bytes, more than the broker's max_packet_size ({limit} bytes), which would close "
                f"the connection; {outcome}"
            )

    def _await_puback(self, handle: PublishHandle, topic: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not handle.wait(min(0.5, max(0.0, deadline - time.monotonic()))):
            if self._closed:
                raise Unconnected("the client was closed while waiting for the PUBACK; the message may not arrive")
            if time.monotonic() >= deadline:
                raise RequestTimeout(
                    f"no PUBACK for the publish to {topic} within {timeout} s; it stays queued and is re-sent "
                    "after a reconnect, so it may still arrive"
                )
        if handle.too_large:
            raise ValueError(
                f"payload: the broker's max_packet_size ({self._max_packet_size} bytes) after a reconnect is less "
                "than this PUBLISH, which would close every connection: it was dropped, not sent again; it may have "
                "been delivered (the broker may have had it before the connection was lost)"
            )

    def _close_files(self) -> None:
        self._state.close()
        if self._delivery_log is not None:
            self._delivery_log.close()

    def _log_send(self, topic: str, data: bytes, qos: int) -> None:
        if self._delivery_log is not None:
            self._delivery_log.send(topic, data, qos)

    def _handle_published(self, mid: int, info: Any) -> None:
        """(Network thread: a PUBACK or PUBCOMP.) The ``send``
        record of a publish() waiting for it, or one that stopped waiting: the broker has it."""
        due = self._sends_due.take(mid, info)
        if due is not None:
            self._log_send(*due)

    # ================================================================ network thread
    def _run(self) -> None:
        link = self._link
        assert link is not None
        gate = self._gate
        attempts = 0
        try:
            while not self._stop.is_set():
                if not link.socket_open:
                    if attempts and self._stop.wait(self._backoff.next_delay()):
                        break
                    attempts += 1
                    try:
                        link.open()
                    except Exception as exc:  # OSError mostly; anything else must not end reconnection
                        self._problem(f"cannot reach {self.host}:{self.port}: {exc}")
                        self._next_address()
                        continue
                    with self._lock:
                        self._handshake_deadline = time.monotonic() + self._handshake_timeout
                received = self._receiver.counters.received
                if self._completions:
                    self._take_completions()
                acks_pending = (gate is not None and gate.pending) or self._stream_acks.pending or self._completions
                if not acks_pending:
                    self._hand_flush(True)  # about to wait: what was read goes to the processing side now
                try:
                    link.loop(0.0 if acks_pending else _LOOP_TIMEOUT)
                except Exception:
                    log.exception("unexpected error in the network loop; reconnecting")
                    self._receiver.fail()
                    link.drop()
                self._after_pass(idle=self._receiver.counters.received == received)
                deadline = self._handshake_deadline
                if deadline is not None and time.monotonic() > deadline:
                    self._problem(f"no CONNACK or hello reply within {self._handshake_timeout} s")
                    with self._lock:
                        self._handshake_deadline = None
                    link.drop()
            self._release_held()
            link.shutdown(_SHUTDOWN_FLUSH)
        finally:
            if self._closed:
                self._close_files()

    def _after_pass(self, *, idle: bool) -> None:
        """After a network pass (``idle``: it read no message): completions, then a group's end, then acks."""
        if idle:
            self._hand_flush(True)
        if self._completions:
            self._take_completions()
        gate = self._gate
        if gate is not None and gate.due(idle=idle):
            gate.flush()
        if idle:
            self._stream_acks.flush()
        self._flush_acks()

    def _problem(self, text: str) -> None:
        first = self._first
        if first is not None and not first.done.is_set():
            first.problem = text
            log.debug("connect: %s", text)
        else:
            log.info("reconnect: %s; retrying", text)

    def _fail_first(self, text: str) -> bool:
        """A refusal while connect() waits: it fails at once. False when connect() returned already."""
        first = self._first
        if first is None or first.done.is_set():
            return False
        first.error = ConnectFailed(text)
        self._stop.set()
        first.done.set()
        return True

    def _next_address(self) -> None:
        """On to the next broker of the group (a no-op with one address)."""
        if len(self._addresses) > 1:
            self._address_index = (self._address_index + 1) % len(self._addresses)
            self.host, self.port = self._addresses[self._address_index]
            self._link_or_raise().retarget(self.host, self.port)

    def _handle_connack(self, ack: ConnAck) -> None:
        if not ack.accepted:
            text = f"the broker at {self.host}:{self.port} refused the connection: {ack.reason}"
            if ack.unavailable and len(self._addresses) > 1:
                self._problem(
                    f"{text} (a backup, its store cannot write, or it holds max_durable_sessions): "
                    "trying the next broker"
                )
                self._next_address()
            elif not self._fail_first(text):
                log.warning("%s; retrying", text)
            return
        if self._stop.is_set():
            return  # closed meanwhile: no event is processed any more (close() failed the receiver)
        self._receiver.new_connection()
        self._stream_acks.drop()
        if self._gate is not None:
            self._gate.drop()  # nothing held may be acknowledged on a new connection
        self._new_generation()
        with self._lock:
            self._session_present = ack.session_present
            self._ready_sent = self._ready_deferred = False
            self._hello_req = req = next(self._req_ids)
            payload = encode_request("hello", req, session_expiry=self._session_expiry)
            undone = self._undo_interests() if self._durable else []
        link = self._link_or_raise()
        for request in undone:  # before the hello: its list then shows what this connection keeps
            link.publish(CONTROL_TOPIC, request, 0)
        link.publish(CONTROL_TOPIC, payload, 0)

    def _undo_interests(self) -> list[bytes]:
        """(Holding _lock, at CONNACK.) ``interest durable: true`` for each subscription made
        durable again while not connected (``undo_interest``): the broker applies it before the
        hello, so a filter an older connection made non-durable is either kept, durable, or ended
        (its connection ended first) and then missing from the hello's list, which subscribes it
        again. Cleared at the hello reply (_replay_subscriptions): a connection lost before it sends
        it again."""
        with self._registry.lock:
            due = [s for s in self._registry.subscriptions() if s.undo_interest]
            self._interests_undone = due
            requests = []
            for s in due:  # its reply says whether the broker refused it (refused: logged false, not true)
                s.interest_req = req = next(self._req_ids)
                requests.append(encode_request("interest", req, filter=s.filter, durable=True))
            return requests

    def _handle_reply(self, reply: Reply) -> None:
        if reply.req is not None and reply.req == self._hello_req:
            self._hello_req = None
            self._finish_handshake(reply)
            return
        warned = reply.op == "interest" and self._interest_replied(reply)
        if reply.op == "interest":
            log.debug("the broker answered 'interest' (req %s): %s", reply.req, reply.error_code or "applied")
        if reply.ok and reply.op == "stream_subscribe":
            for topic, (first, last) in (reply.fields.get("gaps") or {}).items():
                log.warning(
                    "stream %s: ids %s to %s were trimmed by the broker's retention before this client read them",
                    shown_topic(topic), first, last,
                )
            for topic, last in (reply.fields.get("ahead") or {}).items():
                log.warning(
                    "stream %s: this client has processed ids past the log's last id %s (was the broker's store "
                    "wiped or replaced?); nothing is delivered on it until the log passes this client's position",
                    shown_topic(topic), last,
                )
        with self._lock:
            waiter = self._waiters.pop(reply.req, None) if isinstance(reply.req, int) else None
        if waiter is not None:
            waiter.reply = reply
            waiter.event.set()
        elif not reply.ok and not warned:
            _warn_refused_reply(reply)

    def _interest_replied(self, reply: Reply) -> bool:
        """The broker applied (or refused) a change of durability (its ``interest``): the delivery-log
        record of a change to durable: true sent without a SUBSCRIBE is written now, not when it was sent, so
        a connection lost in between leaves no record of a change the broker never made (one to
        durable: false was written as sent). A refused one writes none (the broker holds the filter
        as before, non-durable: ``refused`` until a change to durable: true it applies). Whether it
        logged the refusal's WARNING: before subscribe() is woken, so it is logged when that returns."""
        with self._registry.lock:
            # One sent before the hello stands for the filter also once unsubscribed: a subscribe() takes it over.
            subscription = next(
                (s for s in [*self._registry.subscriptions(), *self._interests_undone] if s.interest_req == reply.req),
                None,
            )
            if subscription is None:
                return False
            subscription.interest_req = None
            if not reply.ok:
                _warn_refused_reply(reply)
            # Refused: the broker keeps the filter non-durable, as it was, until a change to durable: true it
            # applies; until then a SUBACK writes false and a subscribe(durable=True) sends the change again.
            subscription.refused = not reply.ok and subscription.durable
            if any(s is subscription for s in self._interests_undone):
                # Sent before the hello. Applied: the hello reply (_log_undone) or its SUBACK logs it. Refused: the
                # hello reply subscribes it non-durable, and subscribe() waits for that SUBACK (interest_due kept).
                return not reply.ok
            due, subscription.interest_due = subscription.interest_due, False
            # A change to durable: false was logged as it was sent.
            logged = due and reply.ok and subscription.durable and subscription.confirmed and subscription.mid is None
            if logged and self._delivery_log is not None:  # before subscribe() returns
                self._delivery_log.subscribe(subscription.filter, subscription.qos, True)
            self._registry.changed.notify_all()  # subscribe() waits for it
        return not reply.ok

    def _finish_handshake(self, reply: Reply) -> None:
        if not reply.ok:
            text = (
                f"the broker answered hello with {reply.error_code}: {reply.error_message} (does it run a compatible "
                "amqtt-durable plugin?)"
            )
            if not self._fail_first(text):
                log.error("%s; reconnecting", text)
                self._link_or_raise().drop()
            return
        epoch = reply.fields.get("epoch")
        epoch = epoch if isinstance(epoch, int) else None
        limit = reply.fields.get("max_packet_size")  # absent from older brokers: nothing is checked
        self._max_packet_size = limit = limit if isinstance(limit, int) and not isinstance(limit, bool) else None
        for topic, size in self._link_or_raise().release_resends(limit):
            log.error(
                "dropping the unacknowledged publish to %s: its %d bytes are more than the broker's max_packet_size "
                "(%s bytes), which would close every connection; it is not sent again, and may have been delivered "
                "(the broker may have had it before the connection was lost)",
                shown_topic(topic), size, limit,
            )
        expiry = reply.fields.get("session_expiry")
        info = ConnectionInfo(self._session_present, epoch, float(expiry) if isinstance(expiry, int | float) else None)
        lost = self._durable and _session_lost(
            expected=self._had_session or self._state.epoch is not None,
            session_present=self._session_present,
            recorded_epoch=self._state.epoch,
            epoch=epoch,
        )
        if lost:
            log.warning(
                "durable session lost (expired or ended while away): events queued for it are gone; "
                "subscribing again"
            )
            with self._receiver.marks_lock:
                self._state.reset()
            _safe(self._on_session_lost)
        if self._durable and epoch is not None and self._state.epoch != epoch:
            with self._receiver.marks_lock:
                self._state.record(epoch, 0)
        with self._lock:
            if self._stop.is_set():
                return
            held = reply.fields.get("subscriptions")
            self._replay_subscriptions(
                resend_durable=lost or not self._session_present,
                broker_has=held if isinstance(held, dict) else None,
            )
            self._handshake_deadline = None
            self._connected = True
            self._had_session = self._durable
            self._connections += 1
            reconnect = self._connections > 1
        self.cache._set_stale(False)
        if not self._redelivering:  # a listener that keeps failing retries ever more slowly
            self._backoff.reset()
        if self._first is not None:
            self._first.done.set()
        log.info(
            "%s to %s:%s (session present: %s, epoch %s)",
            "reconnected" if reconnect else "connected", self.host, self.port, info.session_present, info.epoch,
        )
        if self._delivery_log is not None:
            self._delivery_log.connect(info.session_present)
        _safe(self._on_connected, info)

    def _replay_subscriptions(self, *, resend_durable: bool, broker_has: dict[str, Any] | None = None) -> None:
        """What this connection needs from the registry (holding _lock).

        ``broker_has`` ({filter: qos}, from the hello reply) is what the broker's session
        holds: a durable subscription it already has is not sent again, even by a client that
        just started and never saw its SUBACK (a repeated SUBSCRIBE re-queues retained values).
        The UNSUBSCRIBEs still due go first (the broker applies them in order): the filters they
        free count no more against ``max_subscriptions_per_client`` when the SUBSCRIBEs arrive.
        """
        with self._registry.lock:
            pending = self._registry.take_unsubscribed()  # before session_lost(), which drops them
            pending = self._drop_oversized(pending)
            if resend_durable:
                self._registry.session_lost()
            # What the broker's session holds now, whenever its hello says (a new or lost session too).
            self._registry.broker_held = set(broker_has) if broker_has is not None else None
            for topic_filter in pending:  # never a filter of the registry: subscribing it drops it here
                # A list decides; without one, a lost session holds nothing.
                if (topic_filter in broker_has) if broker_has is not None else not resend_durable:
                    self._send_unsubscribe(topic_filter)
                    if self._registry.broker_held is not None:
                        self._registry.broker_held.discard(topic_filter)
            undone, self._interests_undone = self._interests_undone, []
            for subscription in undone:  # the broker applied them before the hello
                subscription.undo_interest = False
            for subscription in self._registry.subscriptions():
                self._replay_subscription(subscription, resend_durable, broker_has)
            self._log_undone(undone)
            self._registry.changed.notify_all()  # subscribe() waits: one the broker holds is confirmed now
        for stream in self._registry.streams():
            self._open_stream(stream.filter, stream.window, wait=False)
        if self._durable and self._ready_requested:
            self._send_ready()

    def _log_undone(self, undone: list[Subscription]) -> None:
        """(Holding the registry's lock, at the hello reply.) The delivery-log records of the
        subscriptions made durable again by an ``interest`` before this hello that the broker's
        session holds (no SUBSCRIBE: no SUBACK to log them at): the broker answered that interest
        before this hello reply. Those it did not hold, or refused, are logged at their SUBACK."""
        for subscription in undone:
            if self._registry.get(subscription.filter) is not subscription:
                continue  # unsubscribed, or replaced by another subscribe(), since the CONNACK
            if subscription.interest_due and subscription.confirmed and subscription.mid is None:
                subscription.interest_due = False
                if self._delivery_log is not None:
                    self._delivery_log.subscribe(subscription.filter, subscription.qos, True)

    def _drop_oversized(self, unsubscribes: list[str]) -> list[str]:
        """(Holding the registry's lock, at the hello reply.) Drop, with an ERROR each, the
        subscriptions, streams and due UNSUBSCRIBEs (``unsubscribes``, taken from the registry)
        whose packets are larger than the broker's max_packet_size (made before it was known, or
        when a broker with a larger one answered): the broker would close every connection they
        are sent on. Returns the UNSUBSCRIBEs that fit."""
        limit = self._max_packet_size
        if limit is None:
            return unsubscribes

        def fits(kind: str, topic_filter: str, *, request: bool) -> bool:
            if _filter_packet_size(topic_filter, request=request) <= limit:
                return True
            log.error(
                "dropping the %s of %s (%d bytes): its packet is larger than the broker's max_packet_size (%d bytes), "
                "which would close every connection; it is not sent",
                kind, shown_topic(topic_filter), len(topic_filter.encode("utf-8")), limit,
            )
            return False

        for subscription in self._registry.subscriptions():
            if not fits("subscription", subscription.filter, request=self._durable):
                self._registry.remove(subscription.filter)
        for stream in self._registry.streams():
            if not fits("stream subscription", stream.filter, request=True):
                self._registry.remove_stream(stream.filter)
        return [topic_filter for topic_filter in unsubscribes if fits("unsubscribe", topic_filter, request=False)]

    def _send_unsubscribe(self, topic_filter: str) -> None:
        """UNSUBSCRIBE; a durable session's whose UNSUBACK has not arrived when the connection is
        lost is sent again after the reconnect if the broker's session still holds the filter
        (see _replay_subscriptions; the broker would otherwise keep the subscription, and queue for
        it, for ever)."""
        with self._registry.lock:  # the UNSUBACK (network thread) waits until the mid is recorded
            mid = self._link_or_raise().unsubscribe(topic_filter)
            if not self._durable:
                return
            if mid is None:  # the connection just went: the broker must still hear it
                self._registry.unsubscribe_later(topic_filter)
            else:
                self._registry.unsubscribing(mid, topic_filter)

    def _replay_subscription(
        self, subscription: Subscription, resend_durable: bool, broker_has: dict[str, Any] | None
    ) -> None:
        if not self._durable:
            self._send_subscribe(subscription)  # a clean session keeps nothing
        elif not subscription.durable or subscription.refused:
            # Refused: made durable again before this hello, and the broker refused it: it keeps the filter
            # non-durable, as it held it (a SUBSCRIBE alone would make it durable, and the older connection's
            # end may still drop one its hello lists).
            self._send_request("interest", filter=subscription.filter, durable=False)
            self._send_subscribe(subscription)
        elif subscription.undo_interest:  # made durable again after this connection's CONNACK
            subscription.undo_interest = False
            # Its reply, before the SUBACK, says whether that SUBACK writes true (_interest_replied).
            subscription.interest_req = req = next(self._req_ids)
            self._send_request("interest", req=req, filter=subscription.filter, durable=True)
            self._send_subscribe(subscription)  # the hello's list may show what an older connection's end drops
        elif broker_has is not None and not resend_durable:
            if broker_has.get(subscription.filter) == min(subscription.qos, 1):
                # A SUBSCRIBE whose SUBACK was lost with its connection: the broker has it, the hello
                # reply confirms it (a change of durability still due is _log_undone's to write).
                logged = subscription.confirmed or subscription.interest_due
                if not logged and self._delivery_log is not None:
                    self._delivery_log.subscribe(subscription.filter, subscription.qos, True)
                subscription.confirmed = True
            else:
                self._send_subscribe(subscription)
        elif resend_durable or not (subscription.confirmed or subscription.mid is not None):
            # session_present: the broker kept the confirmed ones; sending them again
            # would queue their retained messages again.
            self._send_subscribe(subscription)

    def _handle_message(self, message: Inbound) -> None:
        try:
            outcome = self._receiver.handle(message)
        except Exception:
            log.exception(
                "internal error handling a message on %s; reconnecting to get it again", shown_topic(message.topic)
            )
            self._receiver.fail()
            outcome = Outcome(reconnect=True)
        if outcome.reconnect:
            self._redelivering = True
            self._flush_acks()  # the events before it (their acknowledgements go first, if the link can)
            self._link_or_raise().drop()
            return
        if not (outcome.ack or outcome.stream_ack is not None):
            return
        qos = message.qos if outcome.ack else 0
        hand = self._hand
        if hand is not None and (outcome.defer is not None or qos or outcome.stream_ack is not None):
            # Deferred: the event, or the acknowledgement of a duplicate, joins the queue of events
            # being processed, so acknowledgements keep the arrival order.
            hand(Handed(outcome.defer, None, message.mid, qos, outcome.stream_ack, self._generation))
            return
        self._redelivering = False
        self._acknowledge(message.mid, qos, outcome.stream_ack)

    def _acknowledge(self, mid: int, qos: int, stream_ack: tuple[str, int] | None) -> None:
        if self._gate is not None:
            self._gate.submit(mid, qos, stream_ack)  # CPL-2: after the fsync of the mark
        else:
            self._send_ack(mid, qos, stream_ack)

    def _release_held(self) -> None:
        """Sync (CPL-2) and send the acknowledgements held (at close: before the DISCONNECT)."""
        self._take_completions()
        if self._gate is not None:
            self._gate.flush()
        if self._link is not None and self._link.socket_open:
            self._flush_acks()
            self._stream_acks.flush()

    def _send_ack(self, mid: int, qos: int, stream_ack: tuple[str, int] | None) -> None:
        """PUBACK/PUBCOMP (nothing for QoS 0) of one processed message; its stream_ack joins the
        cumulative one of its topic (_stream_acks.py). PUBACKs wait for the end of the burst of
        messages being read (_flush_acks): one write for all of them."""
        if qos == 1:
            with self._acks_lock:
                self._acks.append(mid)
        elif qos:
            self._flush_acks()  # PUBCOMP after the PUBACKs before it
            self._link_or_raise().ack(mid, qos)
        if stream_ack is not None:
            self._stream_acks.add(*stream_ack)

    def _flush_acks(self) -> None:
        """Write the gathered PUBACKs, in order, as one packet."""
        if not self._acks:
            return
        with self._acks_lock:  # held while queueing: a flush from close() cannot overtake the network thread's
            mids, self._acks = self._acks, []
            self._link_or_raise().ack_many(mids)

    def _end_burst(self) -> None:
        """A burst of messages was parsed (network thread): send their PUBACKs, pass on deferred events
        (once enough of them are gathered; before the thread waits for the socket, all of them)."""
        self._hand_flush(False)
        self._flush_acks()

    def _new_generation(self) -> None:
        """A connection began or ended: acknowledgements gathered or completed for the last one are void."""
        with self._acks_lock:
            self._acks = []
            self._generation += 1

    # ------------------------------------------------------------ deferred processing
    def _defer_to(self, hand: Callable[[Handed], None], flush: Callable[[bool], None]) -> None:
        """Process events elsewhere (the asyncio client): ``hand`` gets each event, duplicate ack and
        marker in arrival order (network thread); ``flush(all)`` passes the batch on (``all``
        False: only once it is large enough, the network thread reading on). The
        processing side calls ``_receiver.complete`` per event, then ``_complete`` or ``_fail``."""
        self._hand, self._hand_flush = hand, flush
        self._receiver.deferred = True

    def _complete(self, completions: list[Completion]) -> None:
        """(Any thread.) Events processed, in order: acknowledge them on the network thread."""
        self._completions.extend(completions)
        self._wake()

    def _fail(self, generation: int, error: EventNotProcessedError) -> None:
        """(Any thread.) A deferred event was not processed: the broker must send it, and everything
        after it, again (the same as a listener raising)."""
        self._completions.append((generation, error))
        self._wake()

    def _wake(self) -> None:
        if not self._wake_sent and self._link is not None:
            self._wake_sent = True
            self._link.wake()

    def _take_completions(self) -> None:
        """Network thread: acknowledge what the processing side completed (this connection's only)."""
        self._wake_sent = False
        completions = self._completions
        with self._completions_lock:
            while completions:
                item = completions.popleft()
                if item[0] != self._generation:
                    continue  # packet ids of a connection gone
                if len(item) == 2:
                    self._redelivery_asked(item[1])
                else:
                    self._redelivering = False
                    self._acknowledge(item[1], item[2], item[3])

    def _redelivery_asked(self, error: EventNotProcessedError) -> None:
        closing = self._stop.is_set()
        if self._receiver.failed and not closing:
            return  # asked already on this connection
        # Named by its type: sdk.md says the client logs an EventNotProcessedError here, at INFO
        # (also when close() came first and stopped the processing: the event comes again all the same).
        log.info("%s: %s; %s", type(error).__name__, error,
                 "the client is closing: not acknowledged (a kept session's next connection gets it)" if closing
                 else "reconnecting so the broker sends it again, and every event after it")
        if closing:
            return
        self._receiver.fail()
        self._receiver.counters.redeliveries_requested += 1
        self._redelivering = True
        self._flush_acks()
        self._link_or_raise().drop()

    def _send_stream_ack(self, topic: str, event_id: int) -> None:
        self._link_or_raise().publish(CONTROL_TOPIC, encode_request("stream_ack", None, topic=topic, id=event_id), 0)

    def _handle_marker(self, marker: Marker) -> None:
        if self._hand is not None:  # after the events before it are processed
            self._hand(Handed(None, marker, 0, 0, None, self._generation))
            return
        self._marker_reached(marker)

    def _marker_reached(self, marker: Marker) -> None:
        """Every event before the marker was processed (deferred mode: called by the processing side)."""
        if self._delivery_log is not None:
            self._delivery_log.live(marker)
        _safe(self._on_live, marker)

    def _handle_unsubscribed(self, mid: int) -> None:
        self._registry.unsubscribed(mid)
        self._send_deferred_ready()

    def _handle_subscribed(self, mid: int, ok: bool) -> None:
        self._registry.subscribed(mid, ok, self._log_subscribed if ok else self._warn_refused)
        self._send_deferred_ready()  # last: it raises Unconnected when the connection was just lost

    @staticmethod
    def _warn_refused(subscription: Subscription) -> None:
        """(At a SUBACK that refuses it, before subscribe() returns: the WARNING is there when it does.)"""
        log.warning(
            "the broker refused the subscription to %s (SUBACK 0x80: its topic ACL, its max_subscriptions_per_client "
            "or max_subscription_bytes_per_client, its store cannot write, or it is no longer the primary); it is "
            "tried again on reconnect",
            shown_topic(subscription.filter),
        )

    def _log_subscribed(self, subscription: Subscription) -> None:
        """(Holding the registry's lock, at a granted SUBACK, before subscribe() returns.) From the
        SUBACK on, the broker routes to it: what the audit may expect. A change to durable: true sent
        after its SUBSCRIBE is not applied yet: logged non-durable here, durable at its reply; one the
        broker refused (``refused``) is logged non-durable until a change it applies. A change
        to durable: false made while it waited was written as sent: no second record here."""
        durable = (
            subscription.durable and self._durable and subscription.interest_req is None and not subscription.refused
        )
        repeated, subscription.false_logged = subscription.false_logged and not durable, False
        if self._delivery_log is not None and not repeated:
            self._delivery_log.subscribe(subscription.filter, subscription.qos, durable)

    def _handle_lost(self, reason: str) -> None:
        self._stream_acks.drop()
        if self._gate is not None:
            self._gate.drop()  # their packet ids were of this connection; the broker sends the events again
        self._new_generation()
        with self._lock:
            was_connected = self._connected
            self._connected = False
            self._ready_deferred = False
            self._hello_req = None
            self._handshake_deadline = None
            waiters = list(self._waiters.values())
            self._waiters.clear()
            with self._registry.lock:
                self._registry.connection_lost()  # UNSUBSCRIBEs without their UNSUBACK: sent again
                for subscription in self._registry.subscriptions():
                    subscription.mid = None  # its SUBACK will not come
                    subscription.false_logged = False  # the reconnect's SUBACK writes its record
                    subscription.interest_req = None  # nor its interest reply
                    if subscription.durable and (subscription.interest_due or subscription.refused):
                        # The broker may not have applied it (nor will it log), or refused it and ends the
                        # filter with the connection: said again before the next hello, logged once confirmed.
                        subscription.undo_interest, subscription.interest_due = True, True
                    subscription.refused = False
                    if not (self._durable and subscription.durable):
                        subscription.confirmed = False  # the broker drops it with the connection
                self._registry.changed.notify_all()
        self.cache._set_stale(True)
        for waiter in waiters:
            waiter.lost = True
            waiter.event.set()
        if was_connected:
            if not self._stop.is_set():
                log.warning("connection to %s:%s lost (%s); reconnecting", self.host, self.port, reason)
            _safe(self._on_disconnected, reason)

    # ================================================================ helpers
    def _persistence_fell_back(self, exc: OSError) -> None:
        _safe(self._on_persistence_fallback, exc)

    def _on_network_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def _check_open(self) -> None:
        if self._closed:
            raise Unconnected("this client was closed; create a new DurableClient")

    def _link_or_raise(self) -> PahoLink:
        if self._link is None:
            raise Unconnected("connect() was not called yet")
        return self._link

    def _send_subscribe(self, subscription: Subscription) -> None:
        qos = min(subscription.qos, 1) if self._durable else subscription.qos
        subscription.confirmed = subscription.answered = False
        subscription.mid = self._link_or_raise().subscribe(subscription.filter, qos)

    def _open_stream(self, topic_filter: str, window: int | None, *, wait: bool) -> _Waiter | None:
        positions = self._state.positions().items()
        after = {topic: event_id for topic, event_id in positions if topic_matches(topic_filter, topic)}
        after = _fitting_positions(topic_filter, after, window, self._max_packet_size)
        return self._send_request(
            "stream_subscribe", wait=wait, filter=topic_filter, after=after or None, window=window
        )

    def _send_request(self, op: str, *, wait: bool = False, req: int | None = None, **fields: Any) -> _Waiter | None:
        """Publish a control request (QoS 0); with ``wait``, a waiter its reply will be handed to."""
        req = next(self._req_ids) if req is None else req
        waiter = None
        if wait:
            waiter = _Waiter(req)
            with self._lock:
                self._waiters[req] = waiter
        handle = self._link_or_raise().publish(CONTROL_TOPIC, encode_request(op, req, **fields), 0)
        if not handle.queued:
            with self._lock:
                self._waiters.pop(req, None)
            raise Unconnected(f"the connection to {self.host}:{self.port} was just lost: '{op}' was not sent")
        return waiter

    def _await(self, waiter: _Waiter, timeout: float, op: str) -> Reply:
        if not waiter.event.wait(timeout):
            with self._lock:
                self._waiters.pop(waiter.req, None)
            raise RequestTimeout(f"no reply to '{op}' within {timeout} s; it may or may not have taken effect")
        if waiter.lost or waiter.reply is None:
            raise Unconnected(
                f"the connection was lost before the reply to '{op}'; it may or may not have taken effect"
            )
        return waiter.reply


def _nothing(_all: bool) -> None:
    return None


def _session_lost(*, expected: bool, session_present: bool, recorded_epoch: int | None, epoch: int | None) -> bool:
    """Did the broker drop the session this client had? (Then its queued events are gone.)"""
    if not expected:
        return False
    if not session_present:
        return True
    return recorded_epoch is not None and epoch is not None and epoch != recorded_epoch


def _filter_packet_size(topic_filter: str, *, request: bool) -> int:
    """The remaining length of the largest packet naming ``topic_filter`` the SDK sends: its
    SUBSCRIBE (packet id, filter, QoS; an UNSUBSCRIBE is a byte less) and, with ``request``, its
    largest control request (a stream_subscribe without positions, as a QoS 0 PUBLISH)."""
    size = 5 + len(topic_filter.encode("utf-8"))
    if request:
        payload = encode_request("stream_subscribe", 2**53, filter=topic_filter, after=None, window=MAX_STREAM_WINDOW)
        size = max(size, publish_size(CONTROL_TOPIC, len(payload), 0))
    return size


_REQUEST_SPARE = 64
"""Bytes of a stream_subscribe request left for its ``req`` and the JSON around ``after``."""


def _fitting_positions(
    topic_filter: str, after: dict[str, int], window: int | None, packet_limit: int | None = None
) -> dict[str, int]:
    """The positions of ``after`` that fit one stream_subscribe request (MAX_REQUEST_BYTES, and
    the broker's ``packet_limit``: its max_packet_size, when its hello reply says it).

    Past about 2,000 topics they do not: the broker would refuse the request (``malformed``) and
    the stream would never open again. The highest ids are presented (the longest logs to read
    again); the broker sends the other topics from their first retained event, and the client's
    marks drop (and acknowledge) what it processed already, so each event is still processed once.
    """
    size = len(encode_request("stream_subscribe", 0, filter=topic_filter, after={}, window=window))
    limit = MAX_REQUEST_BYTES
    if packet_limit is not None:  # the payload of a QoS 0 PUBLISH to the control topic
        limit = min(limit, packet_limit - publish_size(CONTROL_TOPIC, 0, 0))
    costs = {topic: len(json.dumps(topic)) + len(str(event_id)) + 2 for topic, event_id in after.items()}  # "topic":id,
    budget = limit - size - _REQUEST_SPARE
    if sum(costs.values()) <= budget:
        return after
    kept: dict[str, int] = {}
    for topic, event_id in sorted(after.items(), key=lambda item: (-item[1], item[0])):
        if costs[topic] <= budget:
            kept[topic] = event_id
            budget -= costs[topic]
    log.warning(
        "stream %s: %d of %d positions fit the %d-byte stream_subscribe request; the broker sends the other "
        "topics from their first retained event and this client's marks drop what it processed already",
        shown_topic(topic_filter), len(kept), len(after), limit,
    )
    return kept


def _safe(callback: Callable[_P, None] | None, *args: _P.args, **kwargs: _P.kwargs) -> None:
    """Run an application callback; its exception is logged, never allowed to stop the network thread."""
    if callback is None:
        return
    try:
        callback(*args, **kwargs)
    except Exception:
        log.exception("the application callback %s raised", getattr(callback, "__qualname__", callback))


def _publishable(topic: str, payload: bytes | str) -> bytes:
    """The payload's bytes; ValueError for a topic one cannot publish to, WrongTypeError (a TypeError
    and a ValueError) for a payload neither bytes nor str."""
    check_topic(topic)
    if isinstance(payload, str):
        try:
            return payload.encode()
        except UnicodeEncodeError:  # a lone surrogate: a ValueError that names the argument, as every other
            raise ValueError(
                f"payload must be bytes or a str valid in UTF-8 (a lone surrogate is not), got {payload[:40]!r}"
            ) from None
    if isinstance(payload, bytes | bytearray | memoryview):
        return bytes(payload)
    raise WrongTypeError(f"payload must be bytes or str, got {type(payload).__name__}")


def _warn_refused_reply(reply: Reply) -> None:
    log.warning(
        "the broker refused '%s' (req %s) with %s: %s", reply.op, reply.req, reply.error_code, reply.error_message
    )
