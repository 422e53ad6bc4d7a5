"""AsyncDurableClient against a real broker: the threaded client's behaviour through ``async for``
(replay, marker, live; the cache; redelivery of an event whose body raised; exactly-once across
a broker SIGKILL and an SDK process SIGKILL; close without keeping the session)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import WAIT, Broker, Client, payloads
from durable_client import AsyncDurableClient, Event

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[1]
CHILD = ROOT / "tests" / "sdk_async_child.py"


def run(coro: object) -> None:
    asyncio.run(asyncio.wait_for(coro, 2 * WAIT))  # type: ignore[arg-type]


async def collect(client: AsyncDurableClient, count: int, into: list[Event]) -> None:
    """Process events until ``into`` holds ``count``; leaving the loop acknowledges the last one."""
    async with client.events() as events:
        async for event in events:
            into.append(event)
            if len(into) >= count:
                return


async def queue_backlog(port: int, client_id: str, topic_filter: str) -> None:
    async with AsyncDurableClient(client_id, port=port) as first:
        await first.subscribe(topic_filter)


def test_replay_then_marker_then_live_in_order_and_the_cache_takes_only_live_values(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    publisher = clients(broker.port, "pub", clean_session=True)

    async def main() -> None:
        await queue_backlog(broker.port, "async-order", "feed/#")
        publisher.publish("feed/a", payloads(200))
        got: list[Event] = []
        async with AsyncDurableClient("async-order", port=broker.port, reconnect_max_delay=0.5) as client:
            await client.subscribe("feed/#")
            await client.ready_for_events()
            await collect(client, 200, got)
            marker = await client.live()
            await asyncio.to_thread(publisher.publish, "feed/a", [b"live"])
            await collect(client, 201, got)
            assert client.cache.get("feed/a") == b"live", "a live event feeds the cache"
        assert [e.payload for e in got] == [*payloads(200), b"live"]
        assert [e.replayed for e in got] == [True] * 200 + [False]
        assert marker.replayed == 200 and (marker.first_seq, marker.last_seq) == (got[0].seq, got[199].seq)

    run(main())


def test_an_event_whose_loop_body_raises_comes_again_and_is_processed_once(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    publisher = clients(broker.port, "pub", clean_session=True)

    async def main() -> None:
        processed: list[bytes] = []
        async with AsyncDurableClient("async-retry", port=broker.port, reconnect_max_delay=0.5) as client:
            await client.subscribe("r")
            await client.ready_for_events()
            await asyncio.to_thread(publisher.publish, "r", payloads(10))
            with pytest.raises(RuntimeError, match="on purpose"):
                async for event in client.events():
                    if event.payload == payloads(10)[3]:
                        raise RuntimeError("body failed (on purpose)")
                    processed.append(event.payload)
            redelivered: list[Event] = []
            await collect(client, 7, redelivered)  # order 3 again, then the rest
            processed += [event.payload for event in redelivered]
            assert client.stats.redeliveries_requested == 1
        assert processed == payloads(10), "each processed once, in order"

    run(main())


def test_close_from_the_loop_body_leaves_the_event_the_body_is_on_unacknowledged(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    """sdk.md: ``await client.close()`` called while a body is on an event "leaves that event
    unacknowledged: the session's next connection gets it again"; leaving ``async with
    client.events()`` with ``break`` first acknowledges it."""
    publisher = clients(broker.port, "pub", clean_session=True)

    async def main() -> None:
        await queue_backlog(broker.port, "async-stop", "c/#")
        await asyncio.to_thread(publisher.publish, "c/x", [b"a", b"stop", b"after"])
        got: list[bytes] = []
        client = AsyncDurableClient("async-stop", port=broker.port, reconnect_max_delay=0.5)
        await client.connect()
        await client.subscribe("c/#")
        await client.ready_for_events()
        async for event in client.events():
            got.append(event.payload)
            if event.payload == b"stop":
                await client.close()
        assert got == [b"a", b"stop"], "the loop ends at close()"
        rest: list[Event] = []
        async with AsyncDurableClient("async-stop", port=broker.port, reconnect_max_delay=0.5) as later:
            await later.subscribe("c/#")
            await later.ready_for_events()
            await collect(later, 2, rest)
        assert [e.payload for e in rest] == [b"stop", b"after"]

    run(main())


@pytest.mark.slow
def test_exactly_once_across_a_broker_sigkill(broker: Broker, clients: Callable[..., Client]) -> None:
    total = 2000

    async def main() -> None:
        await queue_backlog(broker.port, "async-crash", "c")
        await asyncio.to_thread(clients(broker.port, "pub", clean_session=True).publish, "c", payloads(total))
        got: list[Event] = []
        async with AsyncDurableClient("async-crash", port=broker.port, reconnect_max_delay=0.5) as client:
            await client.subscribe("c")
            await client.ready_for_events()
            async with client.events() as events:
                async for event in events:
                    got.append(event)
                    if len(got) == total // 3:
                        await asyncio.to_thread(broker.restart, True)
                    if len(got) == total:
                        break
            assert client.stats.reconnects >= 1
        assert [e.payload for e in got] == payloads(total), "nothing lost, nothing twice, in order"

    run(main())


def test_close_without_keep_session_removes_the_session(broker: Broker, clients: Callable[..., Client]) -> None:
    async def main() -> None:
        await queue_backlog(broker.port, "async-bye", "b")
        client = AsyncDurableClient("async-bye", port=broker.port)
        await client.connect()
        await client.close(keep_session=False)

    run(main())
    assert clients(broker.port, "async-bye").session_present is False


@pytest.mark.slow
def test_exactly_once_across_an_sdk_process_sigkill_with_disk_persistence(
    broker: Broker, clients: Callable[..., Client], tmp_path: Path
) -> None:
    total = 300
    state, out = tmp_path / "state", tmp_path / "processed.txt"

    def child(*extra: str) -> subprocess.CompletedProcess[str]:
        args = [sys.executable, str(CHILD), str(broker.port), "async-cpl2", str(state), str(out), str(total)]
        return subprocess.run([*args, *extra], capture_output=True, text=True, timeout=4 * WAIT, check=False)

    started = child("--only-subscribe")
    assert started.returncode == 0, started.stderr
    clients(broker.port, "pub", clean_session=True).publish("work", payloads(total))
    crashed = child(payloads(total)[120].decode())
    assert crashed.returncode == -9, crashed.stderr
    assert out.read_bytes().splitlines() == payloads(total)[:120], "processed up to the crash"
    finished = child()
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert out.read_bytes().splitlines() == payloads(total), "each event processed once across the SIGKILL"


def test_stream_events_through_the_loop_resume_after_the_last_processed_id_and_a_failed_body_comes_again(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], tmp_path: Path
) -> None:
    broker = broker_factory(streams=[{"filter": "log/#", "max_count": 1000}])
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("log/a", payloads(300, "first"))
    options = {"durable_session": False, "persistence": "disk", "state_dir": tmp_path / "state"}

    async def read(count: int, *, fail_at: bytes | None = None) -> list[Event]:
        got: list[Event] = []
        async with AsyncDurableClient("stream-reader", port=broker.port, reconnect_max_delay=0.5, **options) as client:
            await client.subscribe_stream("log/#")
            failed = False
            while len(got) < count:
                try:
                    async with client.events() as events:
                        async for event in events:
                            if event.payload == fail_at and not failed:
                                failed = True
                                raise RuntimeError("body failed (on purpose)")
                            got.append(event)
                            if len(got) >= count:
                                break
                except RuntimeError:
                    assert failed
            assert client.stats.redeliveries_requested == (1 if fail_at else 0)
        return got

    first: list[Event] = []

    async def main() -> None:
        first.extend(await read(300, fail_at=payloads(300, "first")[150]))
        await asyncio.to_thread(publisher.publish, "log/a", payloads(3, "second"))
        second = await read(3)
        assert [e.payload for e in second] == payloads(3, "second") and [e.seq for e in second] == [301, 302, 303]

    run(main())
    assert [e.payload for e in first] == payloads(300, "first"), "each once, in order, the failed one again"
    assert [e.seq for e in first] == list(range(1, 301)) and all(e.stream for e in first)


def test_close_from_another_thread_s_loop_ends_the_async_for_waiting_in_the_client_s_own_loop(
    broker: Broker,
) -> None:
    """sdk.md: any loop may close the client. The waiting ``async for`` is its own loop's: closing
    it from another thread resolved that loop's future from the wrong thread, and the loop, never
    woken, waited for ever."""
    client = AsyncDurableClient("close-across-threads", port=broker.port, reconnect_max_delay=0.5)
    waiting = threading.Event()
    ended: list[str] = []

    async def home() -> None:
        await client.connect()
        await client.subscribe("across/#")
        await client.ready_for_events()
        async with client.events() as events:
            waiting.set()
            async for _ in events:
                pass
        ended.append("the async for ended")

    # debug=True: asyncio then refuses a call on the loop from another thread instead of leaving
    # the loop unwoken until something else happens to wake it (here, often the network thread)
    home_run = asyncio.wait_for(home(), 2 * WAIT)
    thread = threading.Thread(target=asyncio.run, args=(home_run,), kwargs={"debug": True}, daemon=True)
    thread.start()
    assert waiting.wait(WAIT)
    run(client.close(keep_session=False))
    thread.join(WAIT)
    assert not thread.is_alive() and ended == ["the async for ended"]
    assert not client.connected


def test_close_after_the_client_s_own_loop_was_closed_with_a_consumer_waiting_still_disconnects(
    broker: Broker,
) -> None:
    """The loop a program used is gone (closed with a consumer still waiting): close() from a new
    loop raised 'Event loop is closed' before it reached the network client, which went on
    reconnecting."""
    client = AsyncDurableClient("close-after-its-loop", port=broker.port, reconnect_max_delay=0.5)
    home = asyncio.new_event_loop()
    waiting = asyncio.Event()

    async def consume() -> None:
        async with client.events() as events:
            waiting.set()
            async for _ in events:
                pass

    try:
        home.run_until_complete(client.connect())
        home.run_until_complete(client.ready_for_events())
        consumer = home.create_task(consume())
        # A task of a closed loop can never run again, so it stays pending for good: asyncio's
        # "Task was destroyed but it is pending!" when it is collected would only report the
        # scenario itself (asyncio's run_until_complete turns it off the same way for its task).
        consumer._log_destroy_pending = False  # type: ignore[attr-defined]
        home.run_until_complete(asyncio.wait_for(waiting.wait(), WAIT))
        assert not consumer.done()
    finally:
        home.close()  # the consumer task is left waiting, as a program that ended its loop leaves it
    run(client.close(keep_session=False))
    assert not client.connected
