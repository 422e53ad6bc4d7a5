"""AsyncDurableClient's deferred completion, driven by hand on one thread against a recording link.

The test plays the network thread (``_handle_message``, the end of a burst, the end of a pass)
and the event loop in turn, so each rule is checked at a known point: an event is
acknowledged only after its body finished, in arrival order; its mark is recorded before the
next body starts; a failed body gets it and everything after it again; a copy that arrives
while the first still waits is processed once; the marker is reached after the events before it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from test_sdk_client import FakeLink, connect

from durable_client import AsyncDurableClient, Event, Marker
from durable_client._paho import Inbound
from durable_client.protocol import MARKER_TOPIC, encode_frame, encode_marker

pytestmark = pytest.mark.timeout(30)
EPOCH = 12


class Net:
    """The network thread's side of one AsyncDurableClient."""

    def __init__(self, client: AsyncDurableClient) -> None:
        self.client = client
        self.inner = client._client
        self.link = FakeLink()
        self.link.client = self.inner
        self.inner._link = self.link  # type: ignore[assignment]

    def connect(self) -> None:
        connect(self.inner, self.link, session_present=True, epoch=EPOCH)
        self.link.clear()

    def lose(self) -> None:
        self.inner._handle_lost("gone")
        self.link.clear()

    def events(self, *seq_mid: tuple[int, int]) -> None:
        """A burst of session events (seq, packet id), then the wait for more: they go to the loop as one batch."""
        for seq, mid in seq_mid:
            payload = encode_frame(0, EPOCH, seq, 1.0) + b"p%d" % seq
            self.inner._handle_message(Inbound("t", payload, 1, False, False, mid))
        self.inner._end_burst()
        self.inner._hand_flush(True)  # the network thread is about to wait for the socket

    def marker(self) -> None:
        self.inner._handle_message(Inbound(MARKER_TOPIC, encode_marker(Marker(EPOCH, 2, 1, 2, ())), 0, False, False, 0))
        self.inner._end_burst()
        self.inner._hand_flush(True)

    async def pass_(self) -> list[Any]:
        """Let the loop run what it scheduled, then a network pass: what was sent since the last one."""
        for _ in range(3):
            await asyncio.sleep(0)
        self.inner._after_pass(idle=True)
        sent = [item for item in self.link.sent if item[0] in ("ack", "drop")]
        self.link.clear()
        return sent


def run(body: Callable[[AsyncDurableClient, Net], Awaitable[None]], **options: Any) -> None:
    async def main() -> None:
        client = AsyncDurableClient("c1", **options)
        net = Net(client)
        client._bind()
        net.connect()
        try:
            await body(client, net)
        finally:
            client._queue.close()  # type: ignore[union-attr]
            client._client._closed = True

    asyncio.run(asyncio.wait_for(main(), 20))


def test_acknowledged_in_order_after_the_body_and_marked_before_the_next_body() -> None:
    async def body(client: AsyncDurableClient, net: Net) -> None:
        net.events((1, 101), (2, 102), (3, 103))
        assert await net.pass_() == [], "nothing acknowledged before a body finished"
        events = client.events()
        first = await anext(events)
        assert first.seq == 1 and net.inner._state.get_mark(EPOCH) == 0
        second = await anext(events)
        assert second.seq == 2 and net.inner._state.get_mark(EPOCH) == 1, "marked before the next body"
        assert await net.pass_() == [("ack", 101)]
        await events.__aexit__(None, None, None)  # leaving the loop normally: 2 is processed
        assert await net.pass_() == [("ack", 102)]
        assert client.stats.processed == 2

    run(body)


def test_a_failed_body_drops_the_connection_and_the_events_after_it_come_again() -> None:
    async def body(client: AsyncDurableClient, net: Net) -> None:
        net.events((1, 101), (2, 102), (3, 103))
        got: list[int] = []
        with pytest.raises(RuntimeError):
            async for event in client.events():
                if event.seq == 2:
                    raise RuntimeError("body failed")
                got.append(event.seq)
        assert await net.pass_() == [("ack", 101), ("drop",)]
        assert client.stats.redeliveries_requested == 1
        net.events((4, 104))  # read before the drop took effect: ignored, it comes again too
        net.lose()
        net.connect()
        net.events((2, 201), (3, 202), (4, 203))
        async with client.events() as events:
            async for event in events:
                got.append(event.seq)
                if event.seq == 4:
                    break
        assert got == [1, 2, 3, 4]
        assert await net.pass_() == [("ack", 201), ("ack", 202), ("ack", 203)]

    run(body)


def test_a_copy_arriving_while_the_first_waits_is_processed_once_and_acknowledged_in_order() -> None:
    async def body(client: AsyncDurableClient, net: Net) -> None:
        net.events((1, 101), (2, 102))
        events = client.events()
        assert (await anext(events)).seq == 1
        net.lose()  # 1 is with the body, 2 waits; the broker sends both again
        net.connect()
        net.events((1, 201), (2, 202), (3, 203))
        got = [(await anext(events)).seq, (await anext(events)).seq]
        await events.__aexit__(None, None, None)
        assert got == [2, 3], "the copies of 1 and 2 are dropped by their marks"
        assert await net.pass_() == [("ack", 201), ("ack", 202), ("ack", 203)], "only this connection's ids"
        assert client.stats.duplicates_dropped == 2

    run(body)


def test_the_marker_is_reached_after_the_events_before_it() -> None:
    lives: list[Marker] = []

    async def body(client: AsyncDurableClient, net: Net) -> None:
        net.events((1, 101), (2, 102))
        net.marker()
        live = asyncio.ensure_future(client.live())
        seen: list[Event] = []
        events = client.events()
        seen.append(await anext(events))
        await asyncio.sleep(0)
        assert not live.done() and lives == []
        seen.append(await anext(events))
        await asyncio.sleep(0)
        assert not live.done(), "2 is still with its body"
        await events.__aexit__(None, None, None)
        marker = await live
        assert marker.replayed == 2 and [e.seq for e in seen] == [1, 2] and lives == [marker]

    run(body, on_live=lives.append)


def test_a_marker_with_nothing_before_it_is_reached_without_a_loop_over_the_events() -> None:
    async def body(client: AsyncDurableClient, net: Net) -> None:
        net.marker()
        assert (await client.live()).epoch == EPOCH

    run(body)
