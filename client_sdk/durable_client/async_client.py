"""``AsyncDurableClient``: the SDK for asyncio code, in the style of aiomqtt.

It is a DurableClient underneath (one protocol and state implementation: marks, dedup,
replay, cache, streams, persistence and reconnection are the threaded client's own); what
changes is who processes an event. The network thread hands each event to the event loop
and waits: ``async for event in client.events()`` gets it, and when the loop body finishes
(the iterator is asked for the next event) the client records the event as processed and
acknowledges it, exactly as a threaded listener returning. A body that raises, or a loop
left with an event unfinished, asks the broker for that event again. So exactly-once
(CPL-1, and CPL-2 across a process SIGKILL) holds as for the threaded client.

Blocking calls of the threaded client (connect, subscribe waiting for its SUBACK, publish
waiting for its PUBACK, close) run in a worker thread (``asyncio.to_thread``), so the event
loop never blocks.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from types import TracebackType
from typing import Any, Self

from durable_protocol import Marker

from .cache import LastValueCache
from .client import DurableClient
from .errors import DurableClientError, EventNotProcessedError, Unconnected
from .events import Event, PersistenceLevel, Stats, StreamBounds

REQUEST_TIMEOUT = 10.0


class _HandOff:
    """One event on its way from the network thread to the event loop, and the verdict back."""

    __slots__ = ("done", "event", "processed")

    def __init__(self, event: Event) -> None:
        self.event = event
        self.done = threading.Event()
        self.processed = False

    def finish(self, processed: bool) -> None:
        self.processed = processed
        self.done.set()


class EventStream:
    """``client.events()``: an async iterator of events, and an async context manager.

    An event is acknowledged (processed, its mark recorded) when the loop asks for the next
    one, that is when its body finished. Leaving the loop with an event unfinished does not
    acknowledge it: the broker sends it again. Inside ``async with client.events() as
    events:``, leaving without an exception (``break``, ``return``) acknowledges the event the
    body was on, and an exception does not::

        async with client.events() as events:
            async for event in events:
                handle(event)
                if event.payload == b"stop":
                    break        # "stop" is processed, and not sent again
    """

    def __init__(self, inbox: asyncio.Queue[_HandOff]) -> None:
        self._inbox = inbox
        self._current: _HandOff | None = None
        # A plain ``async for`` left by break or an exception drops this object at once:
        # its unfinished event is then released, so the network thread goes on.
        self._released = weakref.finalize(self, _release, self.__dict__)

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Event:
        self._finish(processed=True)
        while True:
            hand_off = await self._inbox.get()
            if not hand_off.done.is_set():  # released by close(): not acknowledged, it comes again
                self._current = hand_off
                return hand_off.event

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._finish(processed=kind is None)

    def _finish(self, processed: bool) -> None:
        current, self._current = self._current, None
        if current is not None:
            current.finish(processed)


def _release(state: dict[str, Any]) -> None:
    current = state.get("_current")
    if current is not None:
        current.finish(processed=False)


class AsyncDurableClient:
    """asyncio face of ``DurableClient``: ``async with AsyncDurableClient(...) as client``.

    ``options`` are DurableClient's keyword options (``persistence``, ``state_dir``,
    ``session_expiry``, ``failover``, ``reconnect_*``, ``delivery_log``, the callbacks, ...);
    callbacks other than ``on_live`` still run on the network thread. ``request_timeout``
    bounds each blocking step (connect, a SUBACK, a PUBACK, close) as the threaded client's
    ``timeout`` arguments do; wrap a call in ``asyncio.timeout`` to give up on it sooner.
    """

    def __init__(
        self,
        client_id: str,
        host: str = "127.0.0.1",
        port: int = 1883,
        *,
        request_timeout: float = REQUEST_TIMEOUT,
        **options: Any,
    ) -> None:
        if not request_timeout > 0:
            raise ValueError(f"request_timeout must be more than 0 seconds, got {request_timeout!r}")
        self._timeout = request_timeout
        self._user_on_live = options.pop("on_live", None)
        self._client = DurableClient(client_id, host, port, on_live=self._on_live, **options)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inbox: asyncio.Queue[_HandOff] | None = None
        self._live: asyncio.Event | None = None
        self._marker: Marker | None = None
        self._pending: set[_HandOff] = set()
        self._pending_lock = threading.Lock()

    # ------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> Self:
        await self.connect()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        await self.close()

    async def connect(self) -> None:
        """Set the session up (see DurableClient.connect); events go to this event loop."""
        self._bind()
        await asyncio.to_thread(self._client.connect, self._timeout)

    async def close(self, keep_session: bool = True) -> None:
        """Disconnect for good (see DurableClient.close); an event handed over but not finished
        is not acknowledged, so the broker sends it again to the next connection."""
        self._release_pending()
        await asyncio.to_thread(self._client.close, keep_session, self._timeout)
        self._release_pending()

    # ------------------------------------------------------------------ operations
    async def subscribe(self, topic_filter: str, qos: int = 1, *, durable: bool = True) -> None:
        """Subscribe; its events arrive through ``events()`` (see DurableClient.subscribe)."""
        self._bind()
        await asyncio.to_thread(
            self._client.subscribe, topic_filter, qos, durable=durable, listener=self._hand_over, timeout=self._timeout
        )

    async def subscribe_stream(
        self,
        topic_filter: str,
        *,
        window: int | None = None,
        after: dict[str, int] | None = None,
    ) -> None:
        """Open stream logs; their events arrive through ``events()`` (see DurableClient.subscribe_stream)."""
        self._bind()
        await asyncio.to_thread(
            self._client.subscribe_stream, topic_filter, self._hand_over, window=window, after=after,
            timeout=self._timeout,
        )

    async def unsubscribe(self, topic_filter: str) -> None:
        await asyncio.to_thread(self._client.unsubscribe, topic_filter)

    async def ready_for_events(self) -> None:
        """The loop is ready: the broker replays what it queued, then the marker (``live()``)."""
        self._client.ready_for_events()

    async def live(self) -> Marker:
        """Wait for the replay marker: every queued event came before it, live ones follow."""
        self._bind()
        assert self._live is not None
        await self._live.wait()
        assert self._marker is not None
        return self._marker

    async def publish(self, topic: str, payload: bytes | str, qos: int = 1, retain: bool = False) -> None:
        """Publish; at QoS 1/2 returns once the broker has it (see DurableClient.publish)."""
        await asyncio.to_thread(self._client.publish, topic, payload, qos, retain, timeout=self._timeout)

    async def stream_info(self, topic_filter: str = "#") -> StreamBounds:
        return await asyncio.to_thread(self._client.stream_info, topic_filter, timeout=self._timeout)

    def events(self) -> EventStream:
        """Every event, in arrival order (one stream at a time); see EventStream for when an
        event counts as processed."""
        return EventStream(self._bind())

    # ------------------------------------------------------------------ state
    @property
    def cache(self) -> LastValueCache:
        return self._client.cache

    @property
    def connected(self) -> bool:
        return self._client.connected

    @property
    def persistence_level(self) -> PersistenceLevel:
        return self._client.persistence_level

    @property
    def stats(self) -> Stats:
        return self._client.stats

    # ------------------------------------------------------------------ the network thread's side
    def _bind(self) -> asyncio.Queue[_HandOff]:
        """Tie the client to the running event loop (the first coroutine called decides)."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop, self._inbox, self._live = loop, asyncio.Queue(), asyncio.Event()
        elif self._loop is not loop:
            raise DurableClientError("an AsyncDurableClient is used from one event loop only")
        assert self._inbox is not None
        return self._inbox

    def _hand_over(self, event: Event) -> None:
        """The listener of every subscription (network thread): wait for the loop's verdict."""
        loop, inbox = self._loop, self._inbox
        if loop is None or inbox is None or loop.is_closed():
            raise Unconnected("the event loop of this AsyncDurableClient is gone: the event comes again")
        hand_off = _HandOff(event)
        with self._pending_lock:
            self._pending.add(hand_off)
        try:
            loop.call_soon_threadsafe(inbox.put_nowait, hand_off)
            hand_off.done.wait()
        finally:
            with self._pending_lock:
                self._pending.discard(hand_off)
        if not hand_off.processed:
            raise EventNotProcessedError(
                f"{event.topic} (seq {event.seq}): not processed by the async loop; it comes again"
            )

    def _release_pending(self) -> None:
        with self._pending_lock:
            pending = list(self._pending)
        for hand_off in pending:
            hand_off.finish(processed=False)

    def _on_live(self, marker: Marker) -> None:
        self._marker = marker
        if self._loop is not None and self._live is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._live.set)
        if self._user_on_live is not None:
            self._user_on_live(marker)
