"""Control requests of a client that does not read its replies: they wait, in order, while the
connection is congested, and past max_pending_control_bytes of them the connection is ended."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from test_replay_marker import run

from amqtt_durable.control import ControlChannel, LogBudget, PendingRequests
from amqtt_durable.engine import DurableEngine
from durable_client.protocol import CONTROL_TOPIC, encode_request
from recording_transport import RecordingTransport


class SlowReader(RecordingTransport):
    """A connection whose client reads only when the test says so: congested until then, and
    ``drain`` waits for it."""

    def __init__(self) -> None:
        super().__init__()
        self.congested = False
        self.reads = asyncio.Event()

    async def drain(self) -> None:
        await self.reads.wait()
        self.congested = False


def test_pending_requests_count_bytes_and_always_admit_one() -> None:
    pending = PendingRequests("dev", 100)
    assert pending.admit(500), "one request fits whatever its size when none waits"
    assert not pending.admit(1), "past the limit: refused, nothing counted"
    assert (pending.count, pending.bytes) == (1, 500)
    pending.done(500)
    assert pending.admit(60) and pending.admit(40) and not pending.admit(1)
    pending.clear()
    assert (pending.count, pending.bytes) == (0, 0)
    unlimited = PendingRequests("dev", 0)
    assert all(unlimited.admit(65_536) for _ in range(1000))


def test_requests_wait_while_congested_and_are_handled_in_order_once_the_client_reads(tmp_path: Path) -> None:
    async def body(engine: DurableEngine) -> None:
        await engine.connect("dev", clean_session=False)
        transport = SlowReader()
        ended: list[bool] = []

        async def end() -> None:
            ended.append(True)

        channel = ControlChannel(
            engine,
            transport,
            "dev",
            False,
            open_streams=lambda: None,  # type: ignore[arg-type,return-value]
            congested=lambda: transport.congested,
            end_connection=end,
            max_pending_bytes=10_000,
        )
        channel.submit(CONTROL_TOPIC, encode_request("hello", 1))
        assert len(transport.packets) == 1, "not congested: handled at once"
        transport.congested = True
        for req in (2, 3, 4):
            channel.submit(CONTROL_TOPIC, encode_request("hello", req))
        channel.submit(CONTROL_TOPIC, b"not json")
        await asyncio.sleep(0)
        assert len(transport.packets) == 1, "congested: the requests wait for the client to read"
        transport.reads.set()
        packets = await transport.wait_for(lambda ps: len(ps) == 5)
        replies = [json.loads(p.payload) for p in packets]
        assert [r["req"] for r in replies] == [1, 2, 3, 4, None], replies
        assert replies[-1]["error"]["code"] == "malformed"
        assert not ended

    run(tmp_path, body)


def test_past_max_pending_control_bytes_the_connection_is_ended_and_nothing_more_is_handled(tmp_path: Path) -> None:
    async def body(engine: DurableEngine) -> None:
        await engine.connect("dev", clean_session=False)
        transport = SlowReader()
        transport.congested = True
        ended = asyncio.Event()

        async def end() -> None:
            ended.set()

        request = encode_request("hello", 1)
        channel = ControlChannel(
            engine,
            transport,
            "dev",
            False,
            open_streams=lambda: None,  # type: ignore[arg-type,return-value]
            congested=lambda: transport.congested,
            end_connection=end,
            max_pending_bytes=3 * len(request),
        )
        for _ in range(3):
            channel.submit(CONTROL_TOPIC, request)
        assert not ended.is_set()
        channel.submit(CONTROL_TOPIC, request)
        async with asyncio.timeout(5):
            await ended.wait()
        transport.reads.set()
        channel.submit(CONTROL_TOPIC, request)
        for _ in range(5):
            await asyncio.sleep(0)
        assert transport.packets == [], "nothing is handled once the connection is being ended"
        assert "dev" in engine.sessions, "the session is kept"

    run(tmp_path, body)


def test_log_budget_lets_one_line_through_per_interval_and_counts_the_rest() -> None:
    now = [100.0]
    budget = LogBudget(10.0, clock=lambda: now[0])
    assert budget.take() == 0
    assert [budget.take() for _ in range(5)] == [None] * 5
    now[0] += 10.0
    assert budget.take() == 5, "the next line says how many were left out"
    assert budget.take() is None
    every = LogBudget(0.0, clock=lambda: now[0])
    assert [every.take() for _ in range(3)] == [0, 0, 0], "0: every line"
