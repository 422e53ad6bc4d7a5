"""``AsyncDurableClient``: the SDK for asyncio code, in the style of aiomqtt.

It is a DurableClient underneath (one protocol and state implementation: marks, dedup,
replay, cache, streams, persistence and reconnection are the threaded client's own); what
changes is who processes an event. The network thread does everything up to the listeners
(dedup, the cache) and hands the events to the event loop in batches, one
``call_soon_threadsafe`` per burst of messages read, and goes on reading. ``async for event in
client.events()`` takes them in order; when the loop body finishes an event (the iterator is
asked for the next one) the client records it as processed (its mark, written before the next
body starts, as the threaded client writes it before the next listener call) and its
acknowledgement goes back to the network thread with those of the events after it, in one
hand-over per run of events (the network thread sends them in order; with CPL-2 after the fsync
that covers their marks). A body that raises, or a loop left with an event unfinished, asks the
broker for that event again: the client drops the connection, the events handed over after it
are not processed, and the broker sends them all again. So exactly-once (CPL-1, and CPL-2 across
a process SIGKILL) holds as for the threaded client.

The replay marker travels in the same queue: ``live()`` (and ``on_live``, called on the event
loop) is signalled once every event before the marker was processed.

Blocking calls of the threaded client (connect, subscribe waiting for its SUBACK or its
``interest`` reply, publish waiting for its PUBACK, close) run in a worker thread (``asyncio.to_thread``), so the event
loop never blocks.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections import deque
from collections.abc import Callable
from types import TracebackType
from typing import Any, Final, Self

from durable_protocol import Marker

from ._options import check_bool, check_callable, check_seconds
from ._receiver import Handed, not_redeliverable
from .cache import LastValueCache
from .client import Completion, DurableClient, _safe
from .errors import DurableClientError, EventNotProcessedError, Unconnected
from .events import Event, PersistenceLevel, Stats, StreamBounds

log = logging.getLogger("durable_client")

REQUEST_TIMEOUT = 10.0
_BATCH: Final = 32
"""Events gathered on the network thread before they go to the loop while more keep arriving."""
_ACK_RUN: Final = 64
"""Events processed before their acknowledgements go to the network thread without waiting for the
loop to yield (with a body that never awaits, the loop yields only when it runs out of events)."""


class _Queue:
    """The event loop's side: events handed over, in order, and the completions going back.

    The event loop's own, but for ``inbox`` and ``idle``. The network thread appends each batch
    to ``inbox`` and wakes the loop (``call_soon_threadsafe(wake)``) only when ``idle`` says
    the loop would not look at the inbox on its own: while a body has an event or the iterator
    is running, the loop takes the batches that came meanwhile when it asks for the next event,
    without a wake-up (a thread switch) per batch.
    """

    def __init__(self, client: DurableClient, loop: asyncio.AbstractEventLoop) -> None:
        self._client = client
        self._receiver = client._receiver
        self._loop = loop
        self._items: deque[Handed] = deque()
        self.inbox: deque[list[Handed]] = deque()
        self.idle = True
        """Set by the loop when it will not take from ``inbox`` without being woken."""
        self._waiter: asyncio.Future[None] | None = None
        self._busy = False  # an event is with a loop body
        self._failed = -1  # the generation whose events are not processed any more (one failed)
        self._done: list[Completion] = []
        self._post_scheduled = False
        self.closed = False

    # ------------------------------------------------------------- from the network thread
    def wake(self) -> None:
        """Scheduled by the network thread: take the batches, pass what needs no body, wake ``next``."""
        self._take()
        self._settle()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        elif not self._busy:
            self.idle = True

    def _take(self) -> None:
        inbox = self.inbox
        while inbox:
            self._items.extend(inbox.popleft())

    # -------------------------------------------------------------------- for EventStream
    async def next(self) -> Handed:
        """The next event to process (raises StopAsyncIteration once the client is closed)."""
        receiver = self._receiver
        self.idle = False
        while True:
            self._take()
            items = self._items
            while items and not self.closed:
                item = items.popleft()
                event = item.event
                if event is None:
                    self._resolve(item)
                elif item.generation == self._failed:
                    continue  # after a failed event of its connection: the broker sends it again
                elif receiver.already_processed(event):  # a copy of one processed since it arrived
                    receiver.counters.late_duplicates_dropped += 1
                    self._ack(item)
                else:
                    self._busy = True
                    return item
            if self.closed:
                raise StopAsyncIteration
            self.post()
            self.idle = True
            if self.inbox:  # came before ``idle`` was set: the network thread did not wake the loop
                self.idle = False
                continue
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
                self.idle = False

    def finish(self, item: Handed, processed: bool) -> None:
        """A loop body is done with ``item``'s event: record and acknowledge it, or ask for it again."""
        self._busy = False
        self.idle = True  # the iterator may not ask for more (the loop was left): wake-ups are needed again
        if self.closed:  # close() came first: not recorded, it comes again
            return
        event = item.event
        assert event is not None
        if processed or not self._receiver.redeliverable(event):
            if not processed:
                log.error("the loop body failed on %s (%s)", event.topic, not_redeliverable(event))
            self._receiver.complete(event, late=True)
            self._ack(item)
        elif item.generation != self._failed:
            self._failed = item.generation
            self.post()  # the events before it first
            self._client._fail(item.generation, EventNotProcessedError(
                f"{event.topic} (seq {event.seq}): not processed by the async loop; it comes again"
            ))
        self._take()
        self._settle()

    def post(self) -> None:
        """Hand the completed acknowledgements to the network thread."""
        self._post_scheduled = False
        if self._done:
            done, self._done = self._done, []
            self._client._complete(done)

    def close(self) -> None:
        """No event is processed from now on; the acknowledgements of the processed ones go first."""
        self.post()
        self.closed = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # ------------------------------------------------------------------------- helpers
    def _ack(self, item: Handed) -> None:
        self._done.append((item.generation, item.mid, item.qos, item.stream_ack))
        if len(self._done) >= _ACK_RUN:
            self.post()
        elif not self._post_scheduled:
            self._post_scheduled = True
            self._loop.call_soon(self.post)  # as soon as the loop yields

    def _settle(self) -> None:
        """Markers and duplicates' acknowledgements at the head need no body: pass them now."""
        items = self._items
        while items and not self._busy and not self.closed and items[0].event is None:
            self._resolve(items.popleft())

    def _resolve(self, item: Handed) -> None:
        if item.generation == self._failed:
            return
        if item.marker is not None:
            self.post()
            self._client._marker_reached(item.marker)
        else:
            self._ack(item)


class _Batcher:
    """The network thread's side: gathers what it hands over and passes each burst as one batch."""

    def __init__(self, client: DurableClient) -> None:
        self._client = client
        self._batch: list[Handed] = []
        self.target: tuple[asyncio.AbstractEventLoop, _Queue] | None = None

    def hand(self, item: Handed) -> None:
        self._batch.append(item)

    def flush(self, all_: bool) -> None:
        """Pass the batch on: ``all_`` always (the network thread is about to wait), else once it holds
        ``_BATCH`` items (fewer wake-ups of the loop while messages keep coming)."""
        if not self._batch or (not all_ and len(self._batch) < _BATCH):
            return
        batch, self._batch = self._batch, []
        target = self.target
        if target is not None and not target[0].is_closed():
            loop, queue = target
            queue.inbox.append(batch)
            if not queue.idle:
                return  # the loop takes it when it asks for the next event
            queue.idle = False  # one wake-up is enough; the loop sets it again when it needs one
            try:
                loop.call_soon_threadsafe(queue.wake)
                return
            except RuntimeError:  # the loop closed meanwhile
                queue.inbox.clear()
        for item in batch:
            if item.event is not None:
                self._client._fail(item.generation, EventNotProcessedError(
                    "the event loop of this AsyncDurableClient is gone: the event comes again"
                ))
                return


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

    def __init__(self, queue: _Queue) -> None:
        self._queue = queue
        self._current: Handed | None = None
        # A plain ``async for`` left by break or an exception drops this object at once:
        # its unfinished event is then given back (not processed), so it comes again.
        self._released = weakref.finalize(self, _release, queue, self.__dict__)

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Event:
        self._finish(processed=True)
        item = await self._queue.next()
        self._current = item
        assert item.event is not None
        return item.event

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._finish(processed=kind is None)
        self._queue.post()

    def _finish(self, processed: bool) -> None:
        current, self._current = self._current, None
        if current is not None:
            self._queue.finish(current, processed)


def _release(queue: _Queue, state: dict[str, Any]) -> None:
    current = state.get("_current")
    if current is not None:
        queue.finish(current, processed=False)
        queue.post()


class AsyncDurableClient:
    """asyncio face of ``DurableClient``: ``async with AsyncDurableClient(...) as client``.

    ``options`` are DurableClient's keyword options (``persistence``, ``state_dir``,
    ``session_expiry``, ``failover``, ``reconnect_*``, ``delivery_log``, the callbacks, ...);
    ``on_live`` is called on the event loop, the other callbacks on the network thread.
    ``request_timeout`` bounds each blocking step (connect, a SUBACK, a PUBACK, close) as the
    threaded client's ``timeout`` arguments do; wrap a call in ``asyncio.timeout`` to give up on
    it sooner.
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
        self._timeout = check_seconds("request_timeout", request_timeout, low=0)
        self._user_on_live: Callable[[Marker], None] | None = options.pop("on_live", None)
        check_callable("on_live", self._user_on_live)
        self._client = DurableClient(client_id, host, port, on_live=self._on_live, **options)
        self._batcher = _Batcher(self._client)
        self._client._defer_to(self._batcher.hand, self._batcher.flush)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: _Queue | None = None
        self._live: asyncio.Event | None = None
        self._marker: Marker | None = None
        self._closed = False

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
        is not acknowledged, so the broker sends it again to the next connection. An ``async for``
        over ``events()`` ends. Any loop may close the client (a program can always clean up),
        even once its own loop has ended. A ``keep_session`` other than True or False is refused
        before anything is closed."""
        check_bool("keep_session", keep_session)
        self._closed = True
        try:
            self._close_queue()
        finally:
            await asyncio.to_thread(self._client.close, keep_session, self._timeout)

    # ------------------------------------------------------------------ operations
    async def subscribe(self, topic_filter: str, qos: int = 1, *, durable: bool = True) -> None:
        """Subscribe; its events arrive through ``events()`` (see DurableClient.subscribe)."""
        self._bind()
        await asyncio.to_thread(self._client.subscribe, topic_filter, qos, durable=durable, timeout=self._timeout)

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
            self._client.subscribe_stream, topic_filter, _through_events, window=window, after=after,
            timeout=self._timeout,
        )

    async def unsubscribe(self, topic_filter: str) -> None:
        self._bind()
        await asyncio.to_thread(self._client.unsubscribe, topic_filter)

    async def ready_for_events(self) -> None:
        """The loop is ready: the broker replays what it queued, then the marker (``live()``)."""
        self._bind()
        self._client.ready_for_events()

    async def live(self) -> Marker:
        """Wait for the replay marker: every queued event came before it, live ones follow.
        Unconnected when the client is closed before it came (also while waiting): none will."""
        self._bind()
        assert self._live is not None
        if self._marker is None and not self._closed:
            await self._live.wait()  # set by the marker, or by close()
        if self._marker is None:
            raise Unconnected("this client was closed before its replay marker came")
        return self._marker

    async def publish(self, topic: str, payload: bytes | str, qos: int = 1, retain: bool = False) -> None:
        """Publish; at QoS 1/2 returns once the broker has it (see DurableClient.publish)."""
        self._bind()
        await asyncio.to_thread(self._client.publish, topic, payload, qos, retain, timeout=self._timeout)

    async def stream_info(self, topic_filter: str = "#") -> StreamBounds:
        self._bind()
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

    # ------------------------------------------------------------------ helpers
    def _bind(self) -> _Queue:
        """Tie the client to the running event loop (the first coroutine called decides, whichever it
        is); DurableClientError from any other loop."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop, self._live = loop, asyncio.Event()
            self._queue = _Queue(self._client, loop)
            self._queue.closed = self._closed  # closed before any coroutine bound it: events() ends at once
            self._batcher.target = (loop, self._queue)
        elif self._loop is not loop:
            raise DurableClientError("an AsyncDurableClient is used from one event loop only")
        assert self._queue is not None
        return self._queue

    def _close_queue(self) -> None:
        """The queue belongs to its loop: closed there (an ``async for`` waiting in it ends, and so
        does a ``live()`` still waiting for its marker), or at once when that loop is closed and
        nothing can wait in it any more."""
        queue, home, live = self._queue, self._loop, self._live
        if queue is None or home is None or live is None:
            return

        def close_at_home() -> None:
            queue.close()
            live.set()

        if home is asyncio.get_running_loop():
            close_at_home()
            return
        try:
            home.call_soon_threadsafe(close_at_home)
        except RuntimeError:  # the home loop is closed
            queue.closed = True
            queue.post()

    def _on_live(self, marker: Marker) -> None:
        """The marker was reached (on the event loop: every event before it was processed)."""
        self._marker = marker
        if self._live is not None:
            self._live.set()
        _safe(self._user_on_live, marker)


def _through_events(_event: Event) -> None:
    """The listener of the asyncio client's stream subscriptions: never called (events go to ``events()``)."""
    raise AssertionError("an AsyncDurableClient's events are processed by events(), not by a listener")
