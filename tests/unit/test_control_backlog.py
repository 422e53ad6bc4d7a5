"""Control requests of a client that does not read its replies: they wait, in order, while the
connection is congested, and past max_pending_control_bytes of them the connection is ended."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from test_replay_marker import run
from test_streams import make_logs, passes, put
from test_streams import run as run_streams

from amqtt_durable.control import REQUEST_OVERHEAD, ControlChannel, LogBudget, PendingRequests
from amqtt_durable.engine import DurableEngine
from amqtt_durable.stream_sender import StreamSender
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


def stream_channel(transport: SlowReader, sender: StreamSender) -> ControlChannel:
    """A durable session's control channel for stream ops only (no engine), congested while
    ``transport`` says so, with room for 10,000 bytes of waiting requests."""
    return ControlChannel(
        None,  # type: ignore[arg-type]  # stream ops only
        transport,
        "dev",
        True,
        open_streams=lambda: sender,
        congested=lambda: transport.congested,
        max_pending_bytes=10_000,
    )


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
            max_pending_bytes=3 * (len(CONTROL_TOPIC) + len(request) + REQUEST_OVERHEAD),
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


def test_a_stream_ack_on_an_open_stream_is_handled_on_arrival_and_its_events_wait_for_the_reader(db: Any) -> None:
    """An ack has no reply: it does not wait behind requests held for a client that is behind,
    but the events it makes room for do; while a stream_unsubscribe of its topic waits, acks wait in order (an
    ack it closes the stream for is refused, as in order)."""
    logs, committer = make_logs(db)
    for _ in range(5):
        put(logs, committer, "s/a")

    async def body() -> None:
        transport = SlowReader()
        sender = StreamSender(logs, transport, default_window=2, ack_timeout=60.0)
        channel = stream_channel(transport, sender)
        channel.submit(CONTROL_TOPIC, encode_request("stream_subscribe", 1, filter="s/#"))
        await transport.wait_for(lambda ps: len(ps) == 3)  # the reply and a window of 2 events
        transport.congested = True
        channel.submit(CONTROL_TOPIC, b"not json")  # waits for the client to read
        channel.submit(CONTROL_TOPIC, encode_request("stream_ack", topic="s/a", id=2))
        assert sender.cursors["s/a"] == (3, 0), "the ack was not handled on arrival"
        await passes()
        assert len(transport.packets) == 3, "the next events must wait for the client to read"
        channel.submit(CONTROL_TOPIC, encode_request("stream_unsubscribe", 3, filter="s/#"))
        channel.submit(CONTROL_TOPIC, encode_request("stream_ack", 4, topic="s/a", id=4))
        transport.reads.set()
        packets = await transport.wait_for(lambda ps: sum(p.topic == "$durable/v1/reply" for p in ps) == 4)
        replies = [json.loads(p.payload) for p in packets if p.topic == "$durable/v1/reply"]
        assert [(r["req"], r["ok"]) for r in replies] == [(1, True), (None, False), (3, True), (4, False)], replies
        assert replies[-1]["error"]["code"] == "unknown_stream"
        sender.stop()

    run_streams(body)


def test_an_ack_taken_while_the_client_is_behind_holds_its_topic_until_the_client_reads(db: Any) -> None:
    """The ack without refill skipped only its own refill: the next append sent a window of new
    events to the client that had not read, and acks after each append poured the log out."""
    logs, committer = make_logs(db)
    for _ in range(3):
        put(logs, committer, "s/a")

    async def body() -> None:
        transport = SlowReader()
        sender = StreamSender(logs, transport, default_window=2, ack_timeout=60.0)
        await sender.subscribe("s/#")
        await transport.wait_for(lambda ps: len(ps) == 2)
        sender.ack("s/a", 10**9, refill=False)
        for _ in range(3):
            put(logs, committer, "s/a")
            await passes()
        assert len(transport.packets) == 2, "an append sent events to a topic held since an ack without refill"
        sender.refill("s/a")
        await transport.wait_for(lambda ps: len(ps) == 4)  # the next window once the client reads
        sender.stop()

    run_streams(body)


def test_only_a_waiting_stream_unsubscribe_makes_acks_wait_however_it_is_spelled(db: Any) -> None:
    """Any waiting request whose payload held a backslash counted as a possible unsubscribe, and
    json.dumps escapes every non-ASCII character: each ack on such a topic waited (and held the
    next ones back) until max_pending_control_bytes closed the connection. The op is parsed: an
    ack on a non-ASCII topic is handled on arrival while another request waits, a
    stream_unsubscribe spelled with escapes still holds acks back, and an ack naming another
    client id waits to be refused in its turn."""
    logs, committer = make_logs(db)
    for _ in range(6):
        put(logs, committer, "s/\u00e9")

    async def body() -> None:
        transport = SlowReader()
        sender = StreamSender(logs, transport, default_window=3, ack_timeout=60.0)
        channel = stream_channel(transport, sender)
        channel.submit(CONTROL_TOPIC, encode_request("stream_subscribe", 1, filter="s/#"))
        await transport.wait_for(lambda ps: len(ps) == 4)  # the reply and a window of 3 events
        transport.congested = True
        channel.submit(CONTROL_TOPIC, b"not json")  # waits its turn (then refused)
        ack = encode_request("stream_ack", topic="s/\u00e9", id=1)
        assert b"\\u00e9" in ack
        channel.submit(CONTROL_TOPIC, ack)
        assert sender.cursors["s/\u00e9"] == (4, 2), "an ack on a non-ASCII topic waited"
        channel.submit(CONTROL_TOPIC, encode_request("stream_ack", 3, client_id="other", topic="s/\u00e9", id=2))
        assert sender.cursors["s/\u00e9"] == (4, 2), "an ack naming another client id was handled on arrival"
        channel.submit(CONTROL_TOPIC, encode_request("stream_ack", topic="s/\u00e9", id=2))
        assert sender.cursors["s/\u00e9"] == (4, 1), "an ack waited behind one that is not an unsubscribe"
        escaped = b'{"v":1,"op":"stream_\\u0075nsubscribe","req":4,"filter":"s/#"}'
        channel.submit(CONTROL_TOPIC, escaped)
        channel.submit(CONTROL_TOPIC, encode_request("stream_ack", 5, topic="s/\u00e9", id=3))
        assert sender.cursors["s/\u00e9"] == (4, 1), "an ack was handled on arrival while an unsubscribe waited"
        transport.reads.set()
        packets = await transport.wait_for(lambda ps: sum(p.topic == "$durable/v1/reply" for p in ps) == 5)
        replies = [json.loads(p.payload) for p in packets if p.topic == "$durable/v1/reply"]
        expected = [(1, True), (None, False), (3, False), (4, True), (5, False)]
        assert [(r["req"], r["ok"]) for r in replies] == expected, replies
        sender.stop()

    run_streams(body)


def test_a_waiting_stream_unsubscribe_holds_back_only_the_acks_on_topics_its_filter_matches(db: Any) -> None:
    """Every ack waited behind any waiting stream_unsubscribe, counted: a consumer acking each event
    that unsubscribed one filter while behind was disconnected by max_pending_control_bytes (review
    160: 26,531 of 40,000 events). An unsubscribe changes only the topics its filter matches, so
    only acks on those wait for it."""
    logs, committer = make_logs(db)
    for topic in ("s/a", "s/b"):
        for _ in range(4):
            put(logs, committer, topic)

    async def body() -> None:
        transport = SlowReader()
        sender = StreamSender(logs, transport, default_window=2, ack_timeout=60.0)
        channel = stream_channel(transport, sender)
        channel.submit(CONTROL_TOPIC, encode_request("stream_subscribe", 1, filter="s/a"))
        channel.submit(CONTROL_TOPIC, encode_request("stream_subscribe", 4, filter="s/b"))
        await transport.wait_for(lambda ps: len(ps) == 6)  # two replies and a window of 2 on each topic
        transport.congested = True
        channel.submit(CONTROL_TOPIC, encode_request("stream_unsubscribe", 2, filter="s/b"))
        channel.submit(CONTROL_TOPIC, encode_request("stream_ack", topic="s/a", id=1))
        assert sender.cursors["s/a"] == (3, 1), "an ack on a topic the waiting unsubscribe does not match waited"
        channel.submit(CONTROL_TOPIC, encode_request("stream_ack", 3, topic="s/b", id=1))
        assert sender.cursors["s/b"] == (3, 2), "an ack on the topic the waiting unsubscribe closes was handled first"
        transport.reads.set()
        packets = await transport.wait_for(lambda ps: sum(p.topic == "$durable/v1/reply" for p in ps) == 4)
        replies = [json.loads(p.payload) for p in packets if p.topic == "$durable/v1/reply"]
        assert [(r["req"], r["ok"]) for r in replies] == [(1, True), (4, True), (2, True), (3, False)], replies
        sender.stop()

    run_streams(body)


class BrokenLink(SlowReader):
    """A connection whose wait for the client ends in an OSError other than ConnectionError."""

    async def drain(self) -> None:
        await self.reads.wait()
        self.congested = False
        raise TimeoutError(110, "Connection timed out")


def test_an_os_error_while_waiting_for_the_client_does_not_kill_the_worker(tmp_path: Path) -> None:
    """Only ConnectionError was suppressed: a drain that raised TimeoutError (or EHOSTUNREACH) ended
    the worker task with "Task exception was never retrieved" and the waiting requests with it."""

    async def body(engine: DurableEngine) -> None:
        await engine.connect("dev", clean_session=False)
        transport = BrokenLink()
        transport.congested = True
        channel = ControlChannel(
            engine,
            transport,
            "dev",
            False,
            open_streams=lambda: None,  # type: ignore[arg-type,return-value]
            congested=lambda: transport.congested,
            max_pending_bytes=10_000,
        )
        for req in (1, 2):
            channel.submit(CONTROL_TOPIC, encode_request("hello", req))
        transport.reads.set()
        packets = await transport.wait_for(lambda ps: len(ps) == 2)
        assert [json.loads(p.payload)["req"] for p in packets] == [1, 2]

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
