"""The Spark source's bulk stream reader (durable_pipeline.bulk) against real brokers and real sockets:
exact ranges with a window smaller than the range, the same rows as the SDK's stream listener,
trimmed ids, a refused stream, a dead first address, a broker that stays away.

No Spark: ``read_range`` and the reader are plain Python (pyarrow only).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from conftest import Broker, Client, free_port
from durable_client import DurableClient, Event
from durable_pipeline.bulk import BulkRangeReader, _publish_qos0
from durable_pipeline.errors import SourceError
from durable_pipeline.source import IdRange, Options, read_range
from durable_protocol import FRAME, FRAME_VERSION, REPLY_TOPIC, STREAM_TOPIC_PREFIX, encode_reply

FILTER = "telemetry/#"
WAIT = 30.0


def publish(client: Client, topic: str, first: int, last: int, qos: int = 1) -> None:
    client.publish(topic, [f"{topic}:{i}".encode() for i in range(first, last + 1)], qos=qos)


def rows_of(opts: Options, topic: str, start: int, end: int) -> tuple[list[dict[str, Any]], list[int]]:
    rows: list[dict[str, Any]] = []
    sizes: list[int] = []
    for batch in read_range(opts, IdRange(topic, start, end)):
        rows.extend(batch.to_pylist())
        sizes.append(batch.num_rows)
    return rows, sizes


@pytest.fixture
def stream_broker(broker_factory: Callable[..., Broker]) -> Broker:
    return broker_factory(streams=[{"filter": FILTER, "max_count": 100_000}])


@pytest.fixture
def publisher(stream_broker: Broker, clients: Callable[..., Client]) -> Client:
    return clients(stream_broker.port, "publisher", clean_session=True)


def test_a_range_inside_the_log_is_read_exactly_with_a_small_window(stream_broker: Broker, publisher: Client) -> None:
    """The window runs ahead of the range's end: ids past it are never taken (the next range has them)."""
    publish(publisher, "telemetry/a", 1, 300)
    opts = Options(port=stream_broker.port, filter=FILTER, window=7)
    for start, end in [(0, 50), (50, 100), (13, 299), (299, 300)]:
        rows, _ = rows_of(opts, "telemetry/a", start, end)  # a batch is not bounded by the window: it
        # stays open while more is readable, and what the reader acked meanwhile is refilled (14 rows once)
        assert [r["id"] for r in rows] == list(range(start + 1, end + 1))
        assert [r["payload"] for r in rows] == [f"telemetry/a:{i}".encode() for i in range(start + 1, end + 1)]
        assert {r["topic"] for r in rows} == {"telemetry/a"}


def test_rows_equal_what_the_sdk_listener_gets(stream_broker: Broker, publisher: Client) -> None:
    """id, payload, qos and publish time (to the microsecond) as the SDK decodes the same events."""
    publish(publisher, "telemetry/q", 1, 40, qos=0)
    publish(publisher, "telemetry/q", 41, 80, qos=1)
    publish(publisher, "telemetry/q", 81, 120, qos=2)
    got: list[Event] = []
    done = threading.Event()

    def listener(event: Event) -> None:
        got.append(event)
        if len(got) >= 120:
            done.set()

    sdk = DurableClient("sdk-reader", "127.0.0.1", stream_broker.port, durable_session=False)
    sdk.connect(timeout=WAIT)
    try:
        sdk.subscribe_stream("telemetry/q", listener, timeout=WAIT)
        assert done.wait(WAIT)
    finally:
        sdk.close(timeout=5.0)
    rows, _sizes = rows_of(Options(port=stream_broker.port, filter=FILTER), "telemetry/q", 0, 120)
    assert [(r["id"], r["payload"], r["qos"]) for r in rows] == [(e.seq, e.payload, e.qos) for e in got[:120]]
    assert [r["qos"] for r in rows] == [0] * 40 + [1] * 40 + [2] * 40
    micros = [round(e.published_at * 1_000_000) for e in got[:120]]
    assert [round(r["published_at"].timestamp() * 1_000_000) for r in rows] == micros


def test_trimmed_ids_raise_or_are_counted(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    broker = broker_factory(streams=[{"filter": FILTER, "max_count": 5}])
    publish(clients(broker.port, "publisher", clean_session=True), "telemetry/a", 1, 20)  # the log keeps 16..20
    lost: list[tuple[int, int, int]] = []

    def count(first: int, last: int, log_first: int) -> int:
        lost.append((first, last, log_first))
        return last + 1

    reader = BulkRangeReader(
        [("127.0.0.1", broker.port)], "telemetry/a", 4, 18, window=3, timeout=WAIT, client_id="bulk-gap",
        on_lost=count, describe=f"127.0.0.1:{broker.port}",
    )
    assert [i for cols in reader.batches(100, 0.5) for i in cols.ids] == [16, 17, 18]
    assert lost == [(4, 15, 16)]
    strict = Options(port=broker.port, filter=FILTER)
    with pytest.raises(SourceError, match=r"telemetry/a .*ids 4 to 15 \(12 events\).*failOnDataLoss=false"):
        rows_of(strict, "telemetry/a", 3, 18)
    lenient = Options(port=broker.port, filter=FILTER, fail_on_data_loss=False)
    assert [r["id"] for r in rows_of(lenient, "telemetry/a", 3, 18)[0]] == [16, 17, 18]


def test_a_dead_first_address_is_passed_over(stream_broker: Broker, publisher: Client) -> None:
    publish(publisher, "telemetry/a", 1, 30)
    dead = free_port()
    reader = BulkRangeReader(
        [("127.0.0.1", dead), ("127.0.0.1", stream_broker.port)], "telemetry/a", 1, 30, window=10, timeout=WAIT,
        client_id="bulk-failover", on_lost=lambda *a: pytest.fail(f"nothing is trimmed: {a}"), describe="two",
    )
    assert [i for cols in reader.batches(100, 0.5) for i in cols.ids] == list(range(1, 31))
    assert reader.connections == 1


def test_a_broker_killed_mid_read_and_restarted_is_read_on(stream_broker: Broker, publisher: Client) -> None:
    publish(publisher, "telemetry/a", 1, 500)
    batches = read_range(Options(port=stream_broker.port, filter=FILTER, window=20), IdRange("telemetry/a", 100, 400))
    seen = [row["id"] for row in next(batches).to_pylist()]
    assert 0 < len(seen) <= 20
    stream_broker.kill()
    stream_broker.start()
    for batch in batches:
        seen.extend(row["id"] for row in batch.to_pylist())
    assert seen == list(range(101, 401))


def test_a_broker_that_stays_away_is_a_timeout_naming_the_last_id(stream_broker: Broker, publisher: Client) -> None:
    publish(publisher, "telemetry/a", 1, 100)
    batches = read_range(Options(port=stream_broker.port, filter=FILTER, window=10, timeout=1.0),
                         IdRange("telemetry/a", 0, 100))
    seen = [row["id"] for row in next(batches).to_pylist()]
    stream_broker.kill()
    t0 = time.monotonic()
    with pytest.raises(SourceError, match=r"telemetry/a at 127\.0\.0\.1:\d+: no event after id \d+ within 1 s") as err:
        for batch in batches:  # what the window had sent before the kill, then nothing
            seen.extend(row["id"] for row in batch.to_pylist())
    assert time.monotonic() - t0 < 10.0
    assert seen == list(range(1, len(seen) + 1))
    assert f"no event after id {seen[-1]} within" in str(err.value)


def test_a_range_on_a_topic_no_stream_covers_is_refused(stream_broker: Broker) -> None:
    with pytest.raises(SourceError, match="refused the stream other/a"):
        rows_of(Options(port=stream_broker.port, filter=FILTER), "other/a", 0, 5)


def test_an_unreachable_broker_is_named() -> None:
    port = free_port()
    with pytest.raises(SourceError, match=rf"cannot reach the amqtt-durable broker at 127\.0\.0\.1:{port} within"):
        rows_of(Options(port=port, filter=FILTER, timeout=0.5), "telemetry/a", 0, 5)


BOUNDS = {"t": {"first": 1, "last": 100, "count": 100}}


def reply(op: str, req: int, topics: dict[str, Any]) -> bytes:
    return _publish_qos0(REPLY_TOPIC.encode(), encode_reply(op, req, filter="t", topics=topics, store=1))


def answering_but_sending_no_event(server: socket.socket, stop: threading.Event) -> None:
    """A broker that takes the connection and answers every request (stream_subscribe, stream_info,
    PINGREQ) but never sends an event: say its reads of the stream log keep failing."""
    conn, _ = server.accept()
    conn.settimeout(0.2)
    data = b""
    with conn:
        while not stop.is_set():
            try:
                chunk = conn.recv(65536)
            except TimeoutError:
                continue
            except ConnectionResetError:  # the reader gave up and closed with unread bytes: its end
                return
            if not chunk:
                return
            data += chunk
            while len(data) >= 2 and len(data) >= 2 + data[1]:  # the reader's packets are short
                head, body, data = data[0], data[2:2 + data[1]], data[2 + data[1]:]
                if head >> 4 == 1:
                    conn.sendall(b"\x20\x02\x00\x00")  # CONNACK, accepted
                elif head >> 4 == 12:
                    conn.sendall(b"\xd0\x00")  # PINGRESP
                elif head >> 4 == 3:
                    request = json.loads(body[2 + int.from_bytes(body[:2], "big"):])
                    if request["op"] in ("stream_subscribe", "stream_info"):
                        conn.sendall(reply(request["op"], request["req"], BOUNDS))


def test_replies_without_events_are_no_progress_the_read_times_out() -> None:
    """Review of the bulk reader: any bytes read renewed the deadline, so a broker answering the
    stalled read's stream_info every half second kept a task with no event waiting forever."""
    stop = threading.Event()
    with socket.create_server(("127.0.0.1", 0)) as server:
        serving = threading.Thread(target=answering_but_sending_no_event, args=(server, stop), daemon=True)
        serving.start()
        reader = BulkRangeReader([("127.0.0.1", server.getsockname()[1])], "t", 1, 100, window=10, timeout=1.5,
                                 client_id="c", on_lost=lambda first, last, log_first: last + 1, describe="x")
        outcome: list[BaseException] = []

        def read() -> None:
            try:
                list(reader.batches(4096, 0.3))
            except SourceError as exc:
                outcome.append(exc)

        reading = threading.Thread(target=read, daemon=True)
        reading.start()
        reading.join(WAIT)  # the old reader was still waiting here, its deadline renewed by every reply
        stop.set()
        serving.join(WAIT)
        assert outcome, f"no SourceError {WAIT:g} s into a read with a 1.5 s timeout"
        assert "no event after id 0 within 1.5 s" in str(outcome[0])


def event(seq: int) -> bytes:
    return _publish_qos0((STREAM_TOPIC_PREFIX + "t").encode(), FRAME.pack(FRAME_VERSION, 0, 0, seq, time.time()) + b"x")


def test_events_and_the_stream_info_reply_in_one_read_are_no_loss() -> None:
    """Review of the bulk reader: the stalled read asked stream_info; ids 1-3 came, retention then
    trimmed them, and the reply (first 4) came in the same read: it was compared with the ids
    taken before that read, so ids 1-3, taken, were reported lost."""
    lost: list[tuple[int, int]] = []

    def on_lost(first_missing: int, last_missing: int, log_first: int) -> int:
        lost.append((first_missing, last_missing))
        raise SourceError("lost")  # failOnDataLoss

    reader = BulkRangeReader([("127.0.0.1", 1)], "t", 1, 100, window=10, timeout=1, client_id="c",
                             on_lost=on_lost, describe="x")
    reader._info_req = 7
    reader._data = event(1) + event(2) + event(3) + reply("stream_info", 7, {"t": {"first": 4, "last": 50}})
    reader._parse()
    assert reader._cols.ids == [1, 2, 3]
    assert lost == []
    assert reader.expected == 4
