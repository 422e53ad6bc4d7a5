"""The control requests of one connection (protocol v1, docs/protocol.md), in arrival order.

The glue hands over every PUBLISH under ``_durable/``; nothing here imports amqtt. A request
acts only on the connection's own session, and only for the user that owns it; a refused one
changes nothing, and every reply (or error) goes back to this connection alone on
``$durable/v1/reply``.

Replies are not written faster than the client reads them: while the broker holds more unsent
for the connection than its socket's write buffer limit (``congested``), later requests wait in
order until the client reads, and past ``max_pending_control_bytes`` of waiting requests the
connection is closed (a request of 45 bytes can ask for a reply of a megabyte: ``hello`` lists
the session's subscriptions). A waiting request counts its topic, its payload and
``REQUEST_OVERHEAD`` (an empty request still takes memory to hold). A ``stream_ack`` on an open
stream, which has no reply, is handled on arrival instead of waiting (see ``submit``); the events
it makes room for wait for the client to read, as replies do.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol

from durable_protocol import (
    CONTROL_TOPIC,
    PROTOCOL_VERSION,
    REPLY_TOPIC,
    ProtocolError,
    Request,
    encode_error,
    encode_reply,
    filter_is_valid,
    parse_request,
    request_ids,
    shown_topic,
)

from .admission import LogBudget
from .delivery import Transport
from .engine import DurableEngine, DurableSession
from .topics import SubscriptionIndex
from .wire import encode_publish

log = logging.getLogger("amqtt_durable")

_REPLY_TOPIC = REPLY_TOPIC.encode()
_AWAITING_OPS = frozenset({"end_session", "stream_subscribe", "stream_info"})
REQUEST_OVERHEAD = 200
"""Bytes counted for each waiting request besides its topic and payload: what holding one costs
in memory (the queue entry, its tuple, str and bytes objects: some 150 bytes in CPython 3.12)."""


class StreamAgent(Protocol):
    """What the channel needs of a connection's stream sender (streams.StreamSender)."""

    async def subscribe(self, topic_filter: str, after: dict[str, int], window: int | None) -> dict[str, Any]: ...

    def ack(self, topic: str, event_id: int, refill: bool = True) -> None: ...

    def refill(self, topic: str) -> None: ...

    def is_open(self, topic: str) -> bool: ...

    def unsubscribe(self, topic_filter: str) -> bool: ...

    def stop(self) -> None: ...


class PendingRequests:
    """The bytes of one connection's control requests waiting to be handled, against
    ``max_pending_control_bytes`` (0: no limit)."""

    def __init__(self, client_id: str, limit: int) -> None:
        self.client_id = client_id
        self.limit = limit
        self.count = 0
        self.bytes = 0

    def admit(self, size: int) -> bool:
        """Count one more waiting request of ``size`` bytes; False (nothing counted) past the
        limit. One request always fits when none waits, whatever its size."""
        if self.limit and self.count and self.bytes + size > self.limit:
            return False
        self.count += 1
        self.bytes += size
        return True

    def done(self, size: int) -> None:
        self.count -= 1
        self.bytes -= size

    def clear(self) -> None:
        self.count = self.bytes = 0

    def warn(self) -> None:
        log.warning(
            "closing the connection of %s: %d control request(s) counted as %d bytes wait to be handled while "
            "the broker has not written earlier replies or stream events to the client (it reads slower than it "
            "sends requests), max_pending_control_bytes is %d (0 = no limit)",
            self.client_id,
            self.count,
            self.bytes,
            self.limit,
        )


class ControlChannel:
    """Handles one connection's requests; ops that wait (session deletion, ACL checks) keep the order."""

    def __init__(
        self,
        engine: DurableEngine,
        transport: Transport,
        client_id: str,
        clean_session: bool,
        *,
        username: str | None = None,
        open_streams: Callable[[], StreamAgent],
        may_subscribe: Callable[[str], Awaitable[bool]] | None = None,
        may_receive: Callable[[str], Awaitable[bool]] | None = None,
        congested: Callable[[], bool] = lambda: False,
        end_connection: Callable[[], Coroutine[Any, Any, None]] | None = None,
        max_pending_bytes: int = 0,
        log_interval: float = 0.0,
    ) -> None:
        self._engine = engine
        self._transport = transport
        self._client_id = client_id
        self._clean_session = clean_session
        self._username = username
        self._open_streams = open_streams
        self._may_subscribe = may_subscribe
        self._may_receive = may_receive
        self._streams: StreamAgent | None = None
        self._congested = congested
        self._end_connection = end_connection
        self._waiting: deque[tuple[str, bytes, int, str | None]] = deque()
        """Requests that wait: (topic, payload, bytes counted, the filter of a stream_unsubscribe)."""
        self._unsubscribes_waiting: Counter[str] = Counter()
        """Filters of the waiting stream_unsubscribe requests: an ack on a topic one of them matches
        waits too, so an ack it would refuse is refused; acks on other topics do not wait for it."""
        self._unsubscribe_index = SubscriptionIndex()
        """The same filters, indexed: an ack looks up its topic's levels, not every waiting filter
        (a client that does not read could queue thousands, each matched against every ack)."""
        self._to_refill: set[str] = set()
        """Stream topics acked on arrival while congested: their next events wait for the client."""
        self._refiller: asyncio.Task[None] | None = None
        self._pending = PendingRequests(client_id, max_pending_bytes)
        self._log_budget = LogBudget(log_interval)
        self._worker: asyncio.Task[None] | None = None
        self._ending: asyncio.Task[None] | None = None
        self._stopped = False

    def submit(self, topic: str, payload: bytes) -> None:
        """One PUBLISH under ``_durable/``. Ops that need no wait are done before this returns, so
        a hello holds the session's delivery before the SUBSCRIBE that follows it is handled;
        while a request that waits is under way, or the client does not read what the broker
        sends it (``congested``), requests wait their turn in order, bounded in bytes (topic,
        payload and ``REQUEST_OVERHEAD`` each). Except a ``stream_ack`` on a stream open on
        this connection, naming no other client_id, while no waiting ``stream_unsubscribe``'s
        filter matches its topic (an ack that is not one of those waits in order, counted): it
        has no reply and no waiting request changes what it does, so it is handled on arrival (a
        consumer reading events as
        fast as they come, acking each, would otherwise fill the limit with acks). While the
        client is behind, the events such an ack makes room for are sent once it has read (an ack
        for ids not yet read must not pour the log into the broker's memory)."""
        if self._stopped:
            return
        unsubscribe: str | None = None
        if self._worker is None and not self._congested():
            request = self._parse(topic, payload)
            if request is None:
                return
            if request.op not in _AWAITING_OPS:
                self._run(request)
                return
        elif topic == CONTROL_TOPIC:
            handled, unsubscribe = self._ack_at_once(payload)
            if handled:
                return
        self._wait(topic, payload, unsubscribe)

    def _wait(self, topic: str, payload: bytes, unsubscribe: str | None) -> None:
        """Queue a request for its turn (``unsubscribe``: the filter of a stream_unsubscribe), or
        close the connection past ``max_pending_control_bytes``."""
        size = len(topic) + len(payload) + REQUEST_OVERHEAD  # the topic as sent, though kept cut
        if topic != CONTROL_TOPIC:
            topic = shown_topic(topic)
        if not self._pending.admit(size):
            self._overflow()
            return
        self._waiting.append((topic, payload, size, unsubscribe))
        if unsubscribe is not None:
            self._unsubscribes_waiting[unsubscribe] += 1
            self._unsubscribe_index.add("", unsubscribe, 0)
        if self._worker is None:
            self._worker = asyncio.get_running_loop().create_task(self._work())

    def _ack_at_once(self, payload: bytes) -> tuple[bool, str | None]:
        """(handled, the filter of a stream_unsubscribe) of a request to the control topic that
        would wait: handled once a ``stream_ack`` on an open stream is done (it writes no reply);
        else the filter of a valid ``stream_unsubscribe`` (while it waits, it holds back the acks
        on topics it matches)."""
        try:
            request = parse_request(payload)
        except ProtocolError:
            return False, None  # refused in its turn, with its reply
        if request.op == "stream_unsubscribe":
            try:
                return False, self._filter(request)
            except ProtocolError:
                return False, None  # refused in its turn: it changes nothing
        if (
            request.op != "stream_ack"
            or self._streams is None
            or request.client_id not in (None, self._client_id)  # refused in its turn
            or request.topic is None
            or not self._streams.is_open(request.topic)
            or self._unsubscribe_index.matches_any(request.topic)
        ):
            return False, None
        if not self._congested():
            self._run(request)
            return True, None
        assert request.id is not None  # parse_request requires it
        try:
            self._streams.ack(request.topic, request.id, refill=False)
        except Exception:  # as in _run: the reader loop must survive any one request
            log.exception("%s: control request stream_ack failed", self._client_id)
            return True, None
        self._to_refill.add(request.topic)
        if self._refiller is None:
            self._refiller = asyncio.get_running_loop().create_task(self._refill())
        return True, None

    async def _refill(self) -> None:
        """Once the client has read, send the events the acks taken on arrival made room for."""
        try:
            while self._to_refill and not self._stopped:
                with contextlib.suppress(OSError):
                    await self._transport.drain()
                if self._stopped or self._transport.closed or self._streams is None:
                    break
                topics, self._to_refill = self._to_refill, set()
                for topic in sorted(topics):
                    try:
                        self._streams.refill(topic)
                    except Exception:  # one topic's failure must not leave the others held for good
                        log.exception(
                            "%s: sending stream events of %r after acks failed", self._client_id, shown_topic(topic)
                        )
        except Exception:
            log.exception("%s: sending stream events after acks failed", self._client_id)
        finally:
            self._refiller = None

    def _parse(self, topic: str, payload: bytes) -> Request | None:
        """The request, or None once refused (with a reply)."""
        try:
            if topic != CONTROL_TOPIC:
                op, req = request_ids(payload)
                message = f"{shown_topic(topic)!r} is not a control topic; send to {CONTROL_TOPIC}"
                raise ProtocolError("unknown_topic", message, req=req, op=op)
            return parse_request(payload)
        except ProtocolError as exc:
            self._refuse(None, exc)
            return None

    def _overflow(self) -> None:
        """Too many bytes of requests wait: the client sends requests and does not read the
        replies. Its connection is closed; the requests handled before stay done."""
        self._pending.warn()
        self._drop_waiting()
        if self._end_connection is not None and self._ending is None:
            self._ending = asyncio.get_running_loop().create_task(self._end_connection())

    def stop(self) -> None:
        """The connection ended: stream positions are forgotten (the client holds them). A request
        being handled finishes (a session deletion half done would leave its queue behind); the
        requests still waiting are dropped unhandled (a QoS 1 or 2 request among them was
        acknowledged on arrival: the acknowledgement says received, not handled)."""
        self._drop_waiting()
        self._to_refill.clear()
        if self._streams is not None:
            self._streams.stop()
            self._streams = None

    def _drop_waiting(self) -> None:
        """No request is handled any more on this connection: forget the waiting ones."""
        self._stopped = True
        self._waiting.clear()
        self._pending.clear()
        self._unsubscribes_waiting.clear()
        self._unsubscribe_index = SubscriptionIndex()

    async def _work(self) -> None:
        try:
            while self._waiting and not self._stopped:
                if self._congested():  # the client reads slower than replies come: wait for it
                    with contextlib.suppress(OSError):  # ConnectionError, TimeoutError, EHOSTUNREACH...
                        await self._transport.drain()
                    if self._stopped or self._transport.closed:
                        break
                topic, payload, size, unsubscribe = self._waiting.popleft()
                self._pending.done(size)
                if unsubscribe is not None:
                    self._unsubscribes_waiting[unsubscribe] -= 1
                    if not self._unsubscribes_waiting[unsubscribe]:
                        del self._unsubscribes_waiting[unsubscribe]
                        self._unsubscribe_index.remove("", unsubscribe)
                request = self._parse(topic, payload)
                if request is None:
                    continue
                if request.op in _AWAITING_OPS:
                    await self._run_awaiting(request)
                else:
                    self._run(request)
        finally:
            self._worker = None

    def _run(self, request: Request) -> None:
        try:
            self._check_caller(request)
            handler = _IMMEDIATE[request.op]
            fields = handler(self, request)
        except ProtocolError as exc:
            self._refuse(request, exc)
            return
        except Exception:  # the reader loop, hence the connection, must survive any one request
            log.exception("%s: control request %s failed", self._client_id, request.op)
            self._refuse(request, ProtocolError("internal", f"{request.op} failed inside the broker; see its log"))
            return
        if fields is not None:
            self._reply(request, fields)

    async def _run_awaiting(self, request: Request) -> None:
        try:
            self._check_caller(request)
            if request.op == "end_session":
                fields = await self._end_session(request)
            elif request.op == "stream_info":
                fields = await self._stream_info(request)
            else:
                fields = await self._stream_subscribe(request)
        except ProtocolError as exc:
            self._refuse(request, exc)
            return
        except Exception:  # the session must stay usable whatever one request does
            log.exception("%s: control request %s failed", self._client_id, request.op)
            self._refuse(request, ProtocolError("internal", f"{request.op} failed inside the broker; see its log"))
            return
        self._reply(request, fields)

    # ------------------------------------------------------------------- checks
    def _check_caller(self, request: Request) -> None:
        if request.client_id is not None and request.client_id != self._client_id:
            raise ProtocolError(
                "not_your_session",
                f"this connection is client {self._client_id!r}; it cannot act on {request.client_id!r}",
            )

    def _session(self) -> DurableSession | None:
        """This connection's durable session (None: it has none); another user's is refused."""
        if self._clean_session:
            return None
        session = self._engine.sessions.get(self._client_id)
        if session is not None and session.record.username != self._username:
            raise ProtocolError(
                "not_your_session",
                f"the durable session of client {self._client_id!r} belongs to another user than {self._username!r}",
            )
        return session

    def _own_session(self, request: Request) -> DurableSession:
        session = self._session()
        if session is None:
            raise ProtocolError(
                "no_session",
                f"{request.op} needs a durable session: connect with clean_session=false and a client id",
            )
        return session

    @staticmethod
    def _filter(request: Request) -> str:
        topic_filter = request.filter or "#"
        if not filter_is_valid(topic_filter):
            raise ProtocolError("bad_filter", f"{topic_filter!r} is not a valid MQTT topic filter")
        return topic_filter

    def _stream_agent(self) -> StreamAgent:
        if self._stopped:
            raise ProtocolError("unknown_stream", "the connection has ended")
        if self._streams is None:
            self._streams = self._open_streams()
        return self._streams

    # ---------------------------------------------------------------------- ops
    def _hello(self, request: Request) -> dict[str, Any]:
        # max_packet_size: a client that sends a larger packet has its connection closed, so an SDK
        # refuses such a publish instead of sending it again after every reconnect.
        limit = self._engine.config.max_packet_size
        session = self._session()
        if session is None:
            return {"protocol": PROTOCOL_VERSION, "epoch": None, "session_expiry": None, "subscriptions": None,
                    "max_packet_size": limit}
        epoch, granted = self._engine.hello(self._client_id, request.session_expiry)
        subscriptions = dict(sorted(session.record.subscriptions.items()))
        return {"protocol": PROTOCOL_VERSION, "epoch": epoch, "session_expiry": granted, "subscriptions": subscriptions,
                "max_packet_size": limit}

    def _interest(self, request: Request) -> dict[str, Any]:
        self._own_session(request)
        self._engine.set_interest(self._client_id, self._filter(request), request.durable, self._transport)
        return {"filter": request.filter, "durable": request.durable}

    def _ready(self, request: Request) -> dict[str, Any]:
        self._own_session(request)
        first = self._engine.ready(self._client_id, self._transport)
        return {"already": not first}

    async def _end_session(self, request: Request) -> dict[str, Any]:
        session = self._own_session(request)
        dropped = await self._engine.delete_session(session)
        log.info("durable session %s ended by its client: %d queued message(s) dropped", self._client_id, dropped)
        return {"messages_dropped": dropped}

    async def _stream_subscribe(self, request: Request) -> dict[str, Any]:
        topic_filter = self._filter(request)
        if self._may_subscribe is not None and not await self._may_subscribe(topic_filter):
            raise ProtocolError("not_authorized", f"the broker's topic ACL refuses a subscription to {topic_filter!r}")
        fields = await self._stream_agent().subscribe(topic_filter, request.after, request.window)
        return {"filter": topic_filter, **fields}

    def _stream_ack(self, request: Request) -> None:
        assert request.topic is not None and request.id is not None  # parse_request requires them
        self._stream_agent().ack(request.topic, request.id)

    def _stream_unsubscribe(self, request: Request) -> dict[str, Any]:
        topic_filter = self._filter(request)
        if self._streams is not None:
            self._streams.unsubscribe(topic_filter)
        return {"filter": topic_filter}

    async def _stream_info(self, request: Request) -> dict[str, Any]:
        """The logs matching the filter, as stream_subscribe would open them: with topic ACL
        plugins, a filter the user may not subscribe to is refused and a log the user may not
        receive is left out (its topic name and size are not the user's to see)."""
        topic_filter = self._filter(request)
        if self._may_subscribe is not None and not await self._may_subscribe(topic_filter):
            raise ProtocolError("not_authorized", f"the broker's topic ACL refuses a subscription to {topic_filter!r}")
        if not self._engine.streams.covers_filter(topic_filter):
            raise ProtocolError("unknown_stream", f"{topic_filter!r} matches no configured stream")
        bounds = sorted(self._engine.streams.topics(topic_filter).items())
        if self._may_receive is not None and bounds:
            allowed = await asyncio.gather(*(self._readable(topic) for topic, _ in bounds))
            bounds = [bound for bound, ok in zip(bounds, allowed, strict=True) if ok]
        topics = {topic: {"first": first, "last": last, "count": last - first + 1} for topic, (first, last) in bounds}
        return {"filter": topic_filter, "topics": topics, "store": self._engine.store_id}

    async def _readable(self, topic: str) -> bool:
        assert self._may_receive is not None
        try:
            return bool(await self._may_receive(topic))
        except Exception:
            log.exception("stream %s: the topic check failed; stream_info leaves it out", shown_topic(topic))
            return False

    # ------------------------------------------------------------------ replies
    def _reply(self, request: Request, fields: dict[str, Any]) -> None:
        self._write(encode_reply(request.op, request.req, **fields))

    def _refuse(self, request: Request | None, error: ProtocolError) -> None:
        op = request.op if request is not None else error.op
        req = request.req if request is not None else error.req
        left_out = self._log_budget.take()
        if left_out is not None:
            also = f" ({left_out} more refused since the last such line)" if left_out else ""
            log.info("%s: control request refused (%s): %s%s", self._client_id, error.code, error.message, also)
        self._write(encode_error(op, req, error))

    def _write(self, body: bytes) -> None:
        if not self._transport.closed:
            self._transport.write(encode_publish(_REPLY_TOPIC, body, 0, 0, dup=False, retain=False))


_IMMEDIATE: dict[str, Callable[[ControlChannel, Request], dict[str, Any] | None]] = {
    "hello": ControlChannel._hello,
    "interest": ControlChannel._interest,
    "ready": ControlChannel._ready,
    "stream_ack": ControlChannel._stream_ack,
    "stream_unsubscribe": ControlChannel._stream_unsubscribe,
}
