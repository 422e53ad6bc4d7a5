"""Blind tests of docs/protocol.md, docs/streams.md, docs/delivery-log.md and docs/pipeline.md,
written from the docs alone: a real broker (``amqtt-durable broker -c``), raw MQTT connections
speaking the control protocol, the SDK and the audit (its main() on the test session's Spark session)."""

from __future__ import annotations

import hashlib
import json
import re
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from raw_mqtt_helpers import STREAM_PREFIX, Raw, connect_packet, raw_subscribe, read_exactly

from conftest import SPARK_TIMEOUT, WAIT, Broker, Client, mqtt_packet, mqtt_string
from durable_client import DurableClient, Event

pytestmark = pytest.mark.timeout(120)

MARKER = "$durable/v1/marker"
FRAME = struct.Struct(">BBQQd")


def module_broker(folder: Path, **settings: Any) -> Iterator[Broker]:
    """A module fixture's broker with these plugin settings: started, yielded, stopped."""
    broker = Broker(folder, **settings).start()
    yield broker
    broker.stop()


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    """One broker for the module: a stream log on telemetry/#, max_session_expiry 1000, window 1."""
    yield from module_broker(
        tmp_path_factory.mktemp("blind13"),
        streams=[{"filter": "telemetry/#"}],
        max_session_expiry=1000,
        stream_window=1,
        stream_ack_timeout=30,
    )


@pytest.fixture
def raw(shared: Broker, raws: Callable[..., Raw], request: pytest.FixtureRequest) -> Raw:
    """A clean-session raw connection with a client id of its own."""
    return raws(shared.port, f"c-{request.node.name}"[:60], clean=True)


def error_of(reply: dict[str, Any]) -> tuple[str, Any, Any, str]:
    assert reply["ok"] is False, reply
    return reply["error"]["code"], reply["op"], reply["req"], reply["error"]["message"]


def sdk_session(port: int, raws: Callable[..., Raw], client_id: str) -> tuple[Raw, dict[str, Any]]:
    """A durable session that said hello: (its connection, the hello reply)."""
    conn = raws(port, client_id, clean=False)
    hello = conn.request({"v": 1, "op": "hello", "req": 1})
    assert hello["ok"] is True, hello
    return conn, hello


def frame(payload: bytes) -> tuple[int, int, int, int, float, bytes]:
    """(version, flags, epoch, seq, published, payload) of a framed message."""
    version, flags, epoch, seq, published = FRAME.unpack_from(payload)
    return version, flags, epoch, seq, published, payload[FRAME.size :]


# --- requests and their refusals (protocol.md "Requests", "Replies") ---------------------------


@pytest.mark.parametrize("version", ["absent", 2, "1", 1.0, True])
def test_v_other_than_integer_1_is_unsupported_version(raw: Raw, version: Any) -> None:
    request: dict[str, Any] = {"op": "hello", "req": 5}
    if version != "absent":
        request["v"] = version
    code, op, req, _ = error_of(raw.request(request))
    assert (code, op, req) == ("unsupported_version", "hello", 5)


def test_unknown_and_missing_op_are_unknown_op_with_op_null(raw: Raw) -> None:
    assert error_of(raw.request({"v": 1, "op": "fly", "req": 3}))[:3] == ("unknown_op", None, 3)
    assert error_of(raw.request({"v": 1, "req": 4}))[:3] == ("unknown_op", None, 4)


@pytest.mark.parametrize(
    ("body", "words"),
    [(b"[1]", "an array"), (b"null", "a JSON null"), (b"true", "a boolean"), (b"12", "a number"), (b'"x"', "a string")],
)
def test_not_an_object_says_what_it_is(raw: Raw, body: bytes, words: str) -> None:
    code, op, req, message = error_of(raw.request(body))
    assert (code, op, req) == ("malformed", None, None)
    assert message == f"request is not a JSON object but {words}"


def test_not_utf8_is_malformed_with_op_and_req_null(raw: Raw) -> None:
    body = b'{"v": 1, "op": "hello", "req": 9, "x": "\xff\xfe"}'
    assert error_of(raw.request(body))[:3] == ("malformed", None, None)


def test_request_of_65536_bytes_is_read_and_one_more_is_malformed(raw: Raw) -> None:
    def sized(size: int) -> bytes:
        head = b'{"v": 1, "op": "stream_info", "req": 2, "pad": "'
        body = head + b"x" * (size - len(head) - 2) + b'"}'
        assert len(body) == size
        return body

    assert raw.request(sized(65536))["ok"] is True
    assert error_of(raw.request(sized(65537)))[:3] == ("malformed", None, None)


@pytest.mark.parametrize("req", ['"7"', "1.5", "true"])
def test_req_not_an_integer_is_malformed_with_op_and_req_null(raw: Raw, req: str) -> None:
    body = f'{{"v": 1, "op": "stream_info", "req": {req}}}'.encode()
    assert error_of(raw.request(body))[:3] == ("malformed", None, None)


def test_req_null_counts_as_absent(raw: Raw) -> None:
    reply = raw.request(b'{"v": 1, "op": "stream_info", "req": null}')
    assert reply["ok"] is True, reply
    assert reply.get("req") is None


def test_integer_past_4300_digits_in_an_ignored_field_is_malformed(raw: Raw) -> None:
    ok = f'{{"v": 1, "op": "stream_info", "req": 1, "junk": {"9" * 4300}}}'.encode()
    assert raw.request(ok)["ok"] is True
    bad = f'{{"v": 1, "op": "stream_info", "req": 1, "junk": {"9" * 4301}}}'.encode()
    code, op, req, message = error_of(raw.request(bad))
    assert (code, op, req) == ("malformed", None, None)
    assert message == "request holds an integer of 4301 digits; the limit is 4300"


def test_other_durable_topic_is_unknown_topic_cut_to_100_and_never_routed(
    shared: Broker, raw: Raw, clients: Callable[..., Client]
) -> None:
    watcher = clients(shared.port, "watch-all", clean_session=True)
    watcher.subscribe("#", qos=1)
    topic = "_durable/v1/" + "z" * 300
    code, _op, _req, message = error_of(raw.request({"v": 1, "op": "ready"}, topic=topic))
    assert code == "unknown_topic"
    assert topic[:100] in message and topic[:101] not in message
    raw.publish("after/control", b"sentinel")
    assert watcher.wait_for(lambda ms: any(m.topic == "after/control" for m in ms))
    assert [m.topic for m in watcher.messages if not m.retain] == ["after/control"]


def test_hello_without_durable_session_has_null_fields(raw: Raw) -> None:
    reply = raw.request({"v": 1, "op": "hello", "req": 7})
    assert reply["ok"] is True and reply["op"] == "hello" and reply["req"] == 7
    assert reply["protocol"] == 1
    assert reply["epoch"] is None and reply["session_expiry"] is None and reply["subscriptions"] is None
    assert isinstance(reply["max_packet_size"], int)


@pytest.mark.parametrize("expiry", [b"-1", b'"10"', b"1e400", b"true"])
def test_hello_session_expiry_out_of_range_is_malformed(raw: Raw, expiry: bytes) -> None:
    body = b'{"v": 1, "op": "hello", "req": 1, "session_expiry": ' + expiry + b"}"
    code, op, req, _ = error_of(raw.request(body))
    assert (code, op, req) == ("malformed", "hello", 1)


def test_hello_expiry_is_capped_and_null_removes_override(shared: Broker, raws: Callable[..., Raw]) -> None:
    conn = raws(shared.port, "cap-1", clean=False)
    assert conn.request({"v": 1, "op": "hello", "session_expiry": 5000})["session_expiry"] == 1000
    assert conn.request({"v": 1, "op": "hello", "session_expiry": 60})["session_expiry"] == 60
    assert conn.request({"v": 1, "op": "hello", "session_expiry": None})["session_expiry"] is None


def test_ready_without_durable_session_is_no_session(raw: Raw) -> None:
    assert error_of(raw.request({"v": 1, "op": "ready", "req": 8}))[:3] == ("no_session", "ready", 8)


def test_interest_needs_filter(shared: Broker, raws: Callable[..., Raw]) -> None:
    conn, _ = sdk_session(shared.port, raws, "interest-1")
    for request in ({"v": 1, "op": "interest"}, {"v": 1, "op": "interest", "filter": None}):
        code, op, _req, message = error_of(conn.request(request))
        assert (code, op) == ("malformed", "interest")
        assert "interest needs 'filter'" in message
    assert error_of(conn.request({"v": 1, "op": "interest", "filter": ""}))[0] == "malformed"


def test_client_id_field(shared: Broker, raws: Callable[..., Raw]) -> None:
    conn, _ = sdk_session(shared.port, raws, "cid-1")
    assert error_of(conn.request({"v": 1, "op": "ready", "client_id": "cid-2"}))[0] == "not_your_session"
    assert error_of(conn.request({"v": 1, "op": "ready", "client_id": ""}))[0] == "malformed"
    assert conn.request({"v": 1, "op": "ready", "client_id": None})["ok"] is True


def test_second_ready_is_already(shared: Broker, raws: Callable[..., Raw]) -> None:
    conn, _ = sdk_session(shared.port, raws, "ready-2")
    first = conn.request({"v": 1, "op": "ready"})
    assert first["ok"] is True and first["already"] is False
    conn.take(lambda topic, _p: topic == MARKER)
    assert conn.request({"v": 1, "op": "ready"})["already"] is True


# --- the marker and frames (protocol.md "Frames", "The marker") -------------------------------


def test_brand_new_session_marker(shared: Broker, raws: Callable[..., Raw]) -> None:
    conn, hello = sdk_session(shared.port, raws, "marker-new")
    assert raw_subscribe(conn.sock, "sensors/new/#", 1) == 1
    reply = conn.request({"v": 1, "op": "interest", "filter": "sensors/new/#", "durable": False})
    assert (reply["ok"], reply["filter"], reply["durable"]) == (True, "sensors/new/#", False)
    conn.send({"v": 1, "op": "ready"})
    _t, payload = conn.take(lambda topic, _p: topic == MARKER)
    marker = json.loads(payload)
    assert marker["v"] == 1 and marker["epoch"] == hello["epoch"]
    assert (marker["replayed"], marker["first_seq"], marker["last_seq"]) == (0, None, None)
    assert marker["live"] == [{"filter": "sensors/new/#", "qos": 1, "durable": False}]


def test_replay_is_framed_and_counted_by_the_marker_then_live(
    shared: Broker, raws: Callable[..., Raw], clients: Callable[..., Client]
) -> None:
    conn, hello = sdk_session(shared.port, raws, "replay-1")
    assert raw_subscribe(conn.sock, "sensors/r/#", 1) == 1
    conn.close()
    plain = clients(shared.port, "plain-r", clean_session=True)
    plain.subscribe("sensors/r/#", qos=1)
    pub = clients(shared.port, "pub-r", clean_session=True)
    before = time.time()
    pub.publish("sensors/r/1", [b"a", b"b", b"c"])
    conn, hello2 = sdk_session(shared.port, raws, "replay-1")
    assert hello2["epoch"] == hello["epoch"] and hello2["subscriptions"] == {"sensors/r/#": 1}
    conn.send({"v": 1, "op": "ready"})
    framed = [conn.take(lambda topic, _p: topic == "sensors/r/1")[1] for _ in range(3)]
    _t, marker_payload = conn.take(lambda topic, _p: topic == MARKER)
    parsed = [frame(p) for p in framed]
    assert [p[5] for p in parsed] == [b"a", b"b", b"c"]
    assert all(p[0] == 1 and p[1] == 0x01 and p[2] == hello["epoch"] for p in parsed)
    seqs = [p[3] for p in parsed]
    assert seqs == sorted(seqs) and len(set(seqs)) == 3
    assert all(before - 1 <= p[4] <= time.time() + 1 for p in parsed)
    marker = json.loads(marker_payload)
    assert (marker["replayed"], marker["first_seq"], marker["last_seq"]) == (3, seqs[0], seqs[-1])
    assert marker["live"] == [{"filter": "sensors/r/#", "qos": 1, "durable": True}]
    pub.publish("sensors/r/1", [b"live"])
    live = frame(conn.take(lambda topic, _p: topic == "sensors/r/1")[1])
    assert live[1] == 0 and live[5] == b"live" and live[3] > seqs[-1]
    assert plain.wait_for(lambda ms: len(ms) == 4)
    assert [m.payload for m in plain.messages] == [b"a", b"b", b"c", b"live"]


def test_retained_queued_with_a_subscribe_is_flagged_replayed_and_retained(
    shared: Broker, raws: Callable[..., Raw], clients: Callable[..., Client]
) -> None:
    pub = clients(shared.port, "pub-ret", clean_session=True)
    pub.publish("sensors/ret/1", [b"kept"], retain=True)
    conn, _ = sdk_session(shared.port, raws, "ret-1")
    assert raw_subscribe(conn.sock, "sensors/ret/#", 1) == 1
    conn.send({"v": 1, "op": "ready"})
    flags = frame(conn.take(lambda topic, _p: topic == "sensors/ret/1")[1])[1]
    assert flags == 0x03
    marker = json.loads(conn.take(lambda topic, _p: topic == MARKER)[1])
    assert marker["replayed"] == 1


def test_end_session_reports_messages_dropped(
    shared: Broker, raws: Callable[..., Raw], clients: Callable[..., Client]
) -> None:
    conn, _ = sdk_session(shared.port, raws, "end-1")
    assert raw_subscribe(conn.sock, "sensors/end/#", 1) == 1
    conn.close()
    clients(shared.port, "pub-end", clean_session=True).publish("sensors/end/x", [b"1", b"2", b"3"])
    conn, _ = sdk_session(shared.port, raws, "end-1")
    reply = conn.request({"v": 1, "op": "end_session", "req": 4})
    assert reply["ok"] is True and reply["messages_dropped"] == 3
    conn.close()
    _again, hello = sdk_session(shared.port, raws, "end-1")
    assert hello["subscriptions"] == {}


# --- streams (protocol.md "Streams", streams.md) -----------------------------------------------


def test_stream_info_lists_first_last_count_and_store(shared: Broker, raw: Raw, clients: Callable[..., Client]) -> None:
    clients(shared.port, "pub-info", clean_session=True).publish("telemetry/info", [b"1", b"2", b"3"])
    reply = raw.request({"v": 1, "op": "stream_info", "req": 1})
    assert reply["filter"] == "#"
    assert reply["topics"]["telemetry/info"] == {"first": 1, "last": 3, "count": 3}
    assert isinstance(reply["store"], int)
    narrow = raw.request({"v": 1, "op": "stream_info", "filter": "telemetry/info"})
    assert narrow["filter"] == "telemetry/info" and list(narrow["topics"]) == ["telemetry/info"]
    assert error_of(raw.request({"v": 1, "op": "stream_info", "filter": "other/#"}))[0] == "unknown_stream"


@pytest.mark.parametrize("window", [0, 1001, 1.5, True, "5"])
def test_stream_window_out_of_range_is_malformed(raw: Raw, window: Any) -> None:
    request = {"v": 1, "op": "stream_subscribe", "filter": "telemetry/#", "window": window, "req": 2}
    assert error_of(raw.request(request))[:3] == ("malformed", "stream_subscribe", 2)


@pytest.mark.parametrize("key", ["telemetry/+", "telemetry/#", "", "telemetry/\u0000"])
def test_stream_after_bad_topic_is_malformed(raw: Raw, key: str) -> None:
    request = {"v": 1, "op": "stream_subscribe", "filter": "telemetry/#", "after": {key: 1}}
    assert error_of(raw.request(request))[0] == "malformed"


def test_stream_events_frames_after_and_ahead(shared: Broker, raw: Raw, clients: Callable[..., Client]) -> None:
    pub = clients(shared.port, "pub-frames", clean_session=True)
    pub.publish("telemetry/fr", [b"one"], qos=1)
    pub.publish("telemetry/fr", [b"two"], qos=2)
    pub.publish("telemetry/ahead", [b"x"])
    reply = raw.request(
        {
            "v": 1,
            "op": "stream_subscribe",
            "filter": "telemetry/fr",
            "window": 1000,
            "after": {"telemetry/fr": 0, "elsewhere/t": 5},
        }
    )
    assert reply["ok"] is True and reply["filter"] == "telemetry/fr"
    assert reply["topics"] == {"telemetry/fr": {"first": 1, "last": 2}}
    assert reply["gaps"] == {} and reply["ahead"] == {}
    events = [raw.take(lambda t, _p: t == STREAM_PREFIX + "telemetry/fr")[1] for _ in range(2)]
    parsed = [frame(e) for e in events]
    assert [(p[0], p[2], p[3], p[5]) for p in parsed] == [(1, 0, 1, b"one"), (1, 0, 2, b"two")]
    assert [p[1] & 0x18 for p in parsed] == [0x08, 0x10]
    ahead = raw.request(
        {"v": 1, "op": "stream_subscribe", "filter": "telemetry/ahead", "after": {"telemetry/ahead": 50}}
    )
    assert ahead["ahead"] == {"telemetry/ahead": 1}


def test_stream_ack_past_last_sent_skips_nothing(shared: Broker, raw: Raw, clients: Callable[..., Client]) -> None:
    clients(shared.port, "pub-cum", clean_session=True).publish("telemetry/cum", [b"1", b"2", b"3"])
    raw.request({"v": 1, "op": "stream_subscribe", "filter": "telemetry/cum", "window": 1})
    assert raw.stream_events("telemetry/cum", 1) == [(0x08, 1, b"1")]
    raw.send({"v": 1, "op": "stream_ack", "topic": "telemetry/cum", "id": 100})
    assert [e[1] for e in raw.stream_events("telemetry/cum", 1)] == [2]
    raw.send({"v": 1, "op": "stream_ack", "topic": "telemetry/cum", "id": 2})
    assert [e[1] for e in raw.stream_events("telemetry/cum", 1)] == [3]


def test_stream_ack_refusals_and_unsubscribe_of_a_filter_not_open(raw: Raw) -> None:
    assert error_of(raw.request({"v": 1, "op": "stream_ack", "topic": "telemetry/q", "id": 0}))[0] == "malformed"
    assert error_of(raw.request({"v": 1, "op": "stream_ack", "topic": "telemetry/q", "id": 3}))[0] == "unknown_stream"
    reply = raw.request({"v": 1, "op": "stream_unsubscribe", "filter": "telemetry/never", "req": 6})
    assert reply["ok"] is True and reply["filter"] == "telemetry/never" and reply["req"] == 6


def test_stream_unsubscribe_then_ack_is_unknown_stream(
    shared: Broker, raw: Raw, clients: Callable[..., Client]
) -> None:
    clients(shared.port, "pub-unsub", clean_session=True).publish("telemetry/uns", [b"1"])
    raw.request({"v": 1, "op": "stream_subscribe", "filter": "telemetry/uns"})
    assert raw.stream_events("telemetry/uns", 1)[0][1] == 1
    assert raw.request({"v": 1, "op": "stream_unsubscribe", "filter": "telemetry/uns"})["ok"] is True
    assert error_of(raw.request({"v": 1, "op": "stream_ack", "topic": "telemetry/uns", "id": 1}))[0] == "unknown_stream"


# --- delivery logs (delivery-log.md) ------------------------------------------------------------


def test_delivery_log_folders_made_and_file_created_at_construction(shared: Broker, tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "log.jsonl"
    client = DurableClient("dlog-made", port=shared.port, delivery_log=str(path))
    try:
        assert path.is_file() and path.read_bytes() == b""
    finally:
        client.close()
    with pytest.raises(OSError):
        DurableClient("dlog-folder", port=shared.port, delivery_log=str(tmp_path))


def test_delivery_log_records_of_a_run(shared: Broker, tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    got: list[Event] = []
    second = threading.Event()

    def listener(event: Event) -> None:
        got.append(event)
        if event.payload == b"second":
            second.set()

    client = DurableClient("dlog-run", port=shared.port, delivery_log=str(path))
    try:
        client.subscribe("sensors/dl/#", qos=1, listener=listener)
        client.connect()
        client.ready_for_events()
        client.publish("sensors/dl/1", b"hello", qos=1)
        client.publish("sensors/dl/1", b"second", qos=1)
        assert second.wait(WAIT)  # the first one's receive record is written: events run in order
    finally:
        client.close(keep_session=False)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    kinds = [r["kind"] for r in records]
    assert kinds[0] == "connect" and records[0]["session_present"] is False
    assert {"subscribe", "live", "send", "receive", "session_end"} <= set(kinds)
    assert all(r["device"] == "dlog-run" and isinstance(r["time"], float) for r in records)
    sub = next(r for r in records if r["kind"] == "subscribe")
    assert (sub["topic"], sub["qos"], sub["durable"]) == ("sensors/dl/#", 1, True)
    message_id = hashlib.sha256(b"sensors/dl/1\x00hello").hexdigest()[:32]
    send = next(r for r in records if r["kind"] == "send")
    receive = next(r for r in records if r["kind"] == "receive")
    assert send["id"] == receive["id"] == message_id
    assert receive["replayed"] is False and receive["redelivered"] is False
    assert receive["seq"] >= 1 and receive["epoch"] >= 1
    live = next(r for r in records if r["kind"] == "live")
    assert live["replayed_count"] == 0
    assert kinds[-1] == "session_end"


# --- the audit (delivery-log.md, pipeline.md) -------------------------------------------------------------


def write_jsonl(path: Path, records: list[dict[str, Any]], prefix: bytes = b"") -> None:
    path.write_bytes(prefix + b"".join(json.dumps(r).encode() + b"\n" for r in records))


def msg_id(topic: str, payload: bytes) -> str:
    return hashlib.sha256(topic.encode() + b"\x00" + payload).hexdigest()[:32]


class Run:
    """Delivery-log records of a hand-written run (delivery-log.md's columns)."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def sub(self, device: str, at: float, topic_filter: str, qos: int = 1, durable: bool = True) -> None:
        self.records.append(
            {"kind": "subscribe", "device": device, "time": at, "topic": topic_filter, "qos": qos, "durable": durable}
        )

    def send(self, at: float, topic: str, payload: bytes) -> None:
        self.records.append(
            {"kind": "send", "device": "pub", "time": at, "topic": topic, "id": msg_id(topic, payload), "qos": 1}
        )

    def recv(self, device: str, at: float, topic: str, payload: bytes, seq: int, *, replayed: bool = False) -> None:
        self.records.append(
            {
                "kind": "receive",
                "device": device,
                "time": at,
                "topic": topic,
                "id": msg_id(topic, payload),
                "qos": 1,
                "replayed": replayed,
                "redelivered": False,
                "seq": seq,
                "epoch": 1,
                "published_at": at - 0.5,
            }
        )

    def mark(self, kind: str, device: str, at: float, **fields: Any) -> None:
        self.records.append({"kind": kind, "device": device, "time": at, **fields})


@pytest.mark.slow
@pytest.mark.timeout(SPARK_TIMEOUT)  # the file's 120 s would leave no room for the JVM's start (conftest)
def test_audit_of_a_bom_txt_log_counts_loss_replay_and_drain(
    spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """delivery-log.md "What the audit computes": ON, OFF, ON received as OFF, ON is the first ON lost,
    nothing out of order; replay latency (receive minus send of replayed receives) and time to drain (a
    ``connect`` to the following ``live``), per device and overall; exit status 1 when the guarantee does not
    hold. The log is a .txt file in a folder, starting with a UTF-8 BOM and blank lines, read as JSON lines
    (pipeline.md). The audit's main() in this process, on the test session's Spark session."""
    from durable_pipeline.cli import main  # noqa: PLC0415 - pyspark loads only for Spark tests

    run = Run()
    run.sub("d5", 1.0, "e/#")
    for at, payload in ((2.0, b"ON"), (2.1, b"OFF"), (2.2, b"ON")):
        run.send(at, "e/1", payload)
    run.recv("d5", 3.0, "e/1", b"OFF", 2)
    run.recv("d5", 3.1, "e/1", b"ON", 3)
    run.sub("d11", 1.0, "k/#")  # replay latency 3.5 s, drain 1 s
    run.send(2.0, "k/1", b"r")
    run.mark("connect", "d11", 5.0, session_present=True)
    run.recv("d11", 5.5, "k/1", b"r", 1, replayed=True)
    run.mark("live", "d11", 6.0, replayed_count=1)
    logs = tmp_path / "logs"
    logs.mkdir()
    write_jsonl(logs / "run.txt", run.records, prefix=b"\xef\xbb\xbf\n\n")
    out = tmp_path / "audit"
    status = main(["audit", str(logs), "--out", str(out), "--expect", "exactly-once"])
    assert status == 1, capsys.readouterr().err[-2000:]
    assert (out / "report.html").is_file()
    import pandas as pd  # noqa: PLC0415 - the pipeline extra

    summary = pd.read_parquet(out / "summary.parquet").set_index("device")
    columns = ["expected", "received", "lost", "duplicated", "out_of_order", "unknown"]
    got = {str(device): tuple(int(v) for v in row) for device, row in summary[columns].iterrows()}
    assert got == {"d5": (3, 2, 1, 0, 0, 0), "d11": (1, 1, 0, 0, 0, 0), "ALL": (4, 3, 1, 0, 0, 0)}
    d11 = summary.loc["d11"]
    assert (d11["replay_p50_ms"], d11["drain_max_s"]) == (3500, 1.0)


# --- edges: null fields, bools as numbers, retention, limits, logs ------------------------------


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    """Retention by count (2) on telemetry/# (3 on telemetry/three/#), 2 stream entries per connection,
    resends after 1 s, 1 subscription per client, packets of at most 200000 bytes."""
    yield from module_broker(
        tmp_path_factory.mktemp("blind13-limited"),
        streams=[{"filter": "telemetry/#", "max_count": 2}, {"filter": "telemetry/three/#", "max_count": 3}],
        max_stream_entries_per_client=2,
        drop_log_interval=0.5,
        stream_ack_timeout=1,
        max_subscriptions_per_client=1,
        max_packet_size=200000,
    )


def test_null_v_and_null_op(raw: Raw) -> None:
    assert error_of(raw.request({"v": None, "op": "hello", "req": 1}))[0] == "unsupported_version"
    assert error_of(raw.request({"v": 1, "op": None, "req": 1}))[:3] == ("unknown_op", None, 1)


def test_interest_durable_null_is_true_and_needs_a_session(shared: Broker, raw: Raw, raws: Callable[..., Raw]) -> None:
    assert error_of(raw.request({"v": 1, "op": "interest", "filter": "a/b"}))[0] == "no_session"
    conn, _ = sdk_session(shared.port, raws, "interest-null")
    reply = conn.request({"v": 1, "op": "interest", "filter": "a/b", "durable": None})
    assert (reply["ok"], reply["durable"]) == (True, True)
    assert error_of(conn.request({"v": 1, "op": "interest", "filter": "a/b", "durable": 1}))[0] == "malformed"


def test_hello_expiry_of_401_digits_is_not_finite(raw: Raw) -> None:
    body = b'{"v": 1, "op": "hello", "req": 3, "session_expiry": 1' + b"0" * 400 + b"}"
    assert error_of(raw.request(body))[:3] == ("malformed", "hello", 3)


def test_hello_expiry_zero_is_granted(shared: Broker, raws: Callable[..., Raw]) -> None:
    conn = raws(shared.port, "expiry-zero", clean=False)
    assert conn.request({"v": 1, "op": "hello", "session_expiry": 0})["session_expiry"] == 0


@pytest.mark.parametrize(
    "request_",
    [
        {"v": 1, "op": "stream_ack", "topic": "telemetry/b", "id": True},
        {"v": 1, "op": "stream_ack", "topic": "telemetry/b", "id": 1.5},
        {"v": 1, "op": "stream_ack", "topic": "", "id": 1},
        {"v": 1, "op": "stream_ack", "topic": "telemetry/b"},
        {"v": 1, "op": "stream_subscribe", "filter": "telemetry/#", "after": {"telemetry/b": True}},
        {"v": 1, "op": "stream_subscribe", "filter": "telemetry/#", "after": {"telemetry/b": -1}},
        {"v": 1, "op": "stream_subscribe", "filter": "telemetry/#", "after": {"telemetry/b": None}},
        {"v": 1, "op": "stream_subscribe", "filter": "telemetry/#", "after": [1]},
        {"v": 1, "op": "stream_subscribe", "filter": ""},
    ],
)
def test_stream_fields_of_the_wrong_type_are_malformed(raw: Raw, request_: dict[str, Any]) -> None:
    assert error_of(raw.request(request_))[0] == "malformed"


def test_after_key_with_a_lone_surrogate_is_malformed(raw: Raw) -> None:
    body = b'{"v": 1, "op": "stream_subscribe", "filter": "telemetry/#", "after": {"telemetry/\\ud800": 1}}'
    assert error_of(raw.request(body))[0] == "malformed"


def test_after_null_lists_no_topic(shared: Broker, raw: Raw, clients: Callable[..., Client]) -> None:
    clients(shared.port, "pub-anull", clean_session=True).publish("telemetry/anull", [b"1"])
    reply = raw.request({"v": 1, "op": "stream_subscribe", "filter": "telemetry/anull", "after": None})
    assert reply["ok"] is True
    assert raw.stream_events("telemetry/anull", 1)[0][1] == 1


def test_never_hello_session_gets_the_marker_and_unframed_events(
    shared: Broker, raws: Callable[..., Raw], clients: Callable[..., Client]
) -> None:
    conn = raws(shared.port, "no-hello", clean=False)
    assert raw_subscribe(conn.sock, "sensors/nh", 1) == 1
    assert conn.request({"v": 1, "op": "ready"})["ok"] is True
    marker = json.loads(conn.take(lambda topic, _p: topic == MARKER)[1])
    assert marker["replayed"] == 0 and marker["live"] == [{"filter": "sensors/nh", "qos": 1, "durable": True}]
    clients(shared.port, "pub-nh", clean_session=True).publish("sensors/nh", [b"plain"])
    assert conn.take(lambda topic, _p: topic == "sensors/nh")[1] == b"plain"


def test_qos0_stream_event_has_qos_bits_zero(shared: Broker, raw: Raw, clients: Callable[..., Client]) -> None:
    clients(shared.port, "pub-q0", clean_session=True).publish("telemetry/q0", [b"z"], qos=0)
    raw.request({"v": 1, "op": "stream_subscribe", "filter": "telemetry/q0"})
    assert raw.stream_events("telemetry/q0", 1) == [(0x00, 1, b"z")]


def test_control_request_at_qos1_is_acknowledged_and_answered(raw: Raw) -> None:
    raw.publish("_durable/v1/ctl", json.dumps({"v": 1, "op": "stream_info", "req": 11}).encode(), qos=1)
    assert raw.reply()["req"] == 11


def test_stream_topic_of_65516_bytes_opens_and_65517_stays_closed(
    shared: Broker, raw: Raw, raws: Callable[..., Raw]
) -> None:
    fits = "telemetry/" + "f" * (65516 - len("telemetry/"))
    too_long = "telemetry/" + "g" * (65517 - len("telemetry/"))
    pub = raws(shared.port, "pub-long", clean=True)
    pub.publish(fits, b"fits")
    pub.publish(too_long, b"long")
    info = raw.request({"v": 1, "op": "stream_info"})
    assert info["topics"][too_long]["count"] == 1
    # a request naming either topic would pass 65,536 bytes: a wildcard opens both
    reply = raw.request({"v": 1, "op": "stream_subscribe", "filter": "telemetry/#", "window": 1000})
    assert reply["ok"] is True, reply
    assert too_long not in reply["topics"] and fits in reply["topics"]
    assert raw.stream_events(fits, 1) == [(0x08, 1, b"fits")]
    assert raw.alive()
    assert raw.kept_stream_events(too_long) == []
    assert "topic too long for the $durable/v1/stream/ prefix" in shared.log()
    assert too_long[:100] in shared.log() and too_long[:101] not in shared.log()


def test_gaps_for_positions_retention_trimmed(limited: Broker, raws: Callable[..., Raw]) -> None:
    conn = raws(limited.port, "gaps-1", clean=True)
    for payload in (b"1", b"2", b"3", b"4", b"5"):
        conn.publish("telemetry/gap", payload)
    reply = conn.request({"v": 1, "op": "stream_subscribe", "filter": "telemetry/gap", "after": {"telemetry/gap": 0}})
    assert reply["topics"] == {"telemetry/gap": {"first": 4, "last": 5}}
    assert reply["gaps"] == {"telemetry/gap": [1, 3]}
    assert [e[1] for e in conn.stream_events("telemetry/gap", 1)] == [4]


def test_stream_entries_past_the_limit_are_malformed_and_change_nothing(
    limited: Broker, raws: Callable[..., Raw]
) -> None:
    conn = raws(limited.port, "entries-1", clean=True)
    conn.publish("telemetry/e1", b"1")
    assert conn.request({"v": 1, "op": "stream_subscribe", "filter": "telemetry/e1"})["ok"] is True
    assert conn.request({"v": 1, "op": "stream_subscribe", "filter": "telemetry/e2"})["ok"] is True
    assert error_of(conn.request({"v": 1, "op": "stream_subscribe", "filter": "telemetry/e3"}))[0] == "malformed"
    assert conn.stream_events("telemetry/e1", 1)[0][1] == 1
    assert conn.alive()


def test_refusal_log_lines_count_what_they_left_out(limited: Broker, raws: Callable[..., Raw]) -> None:
    conn = raws(limited.port, "refuse-log", clean=True)
    pattern = "refuse-log: control request refused (unknown_op): "
    sent = 0
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline and limited.log().count(pattern) < 2:
        error_of(conn.request({"v": 1, "op": "nope"}))
        sent += 1
    lines = [line for line in limited.log().splitlines() if pattern in line]
    assert len(lines) >= 2, limited.log()[-2000:]
    assert "more refused since the last such line" not in lines[0]
    assert "(0 more" not in limited.log()
    # requests were sent without pause between the two lines, half a second apart: some were left out
    left_out = re.search(r" \((\d+) more refused since the last such line\)$", lines[1])
    assert left_out is not None, lines[1]
    assert 1 <= int(left_out.group(1)) <= sent - 2


def test_delivery_log_cut_last_line_is_ended_by_the_constructor(shared: Broker, tmp_path: Path) -> None:
    path = tmp_path / "cut.jsonl"
    path.write_bytes(b'{"kind": "connect", "device": "x", "time": 1.0}\n{"kind": "sen')
    client = DurableClient("dlog-cut", port=shared.port, delivery_log=str(path))
    try:
        assert path.read_bytes().endswith(b'{"kind": "sen\n')
    finally:
        client.close()


def test_unknown_topic_refusal_echoes_req_and_known_op(raw: Raw) -> None:
    reply = raw.request({"v": 1, "op": "stream_info", "req": 21}, topic="_durable/v2/ctl")
    assert error_of(reply)[:3] == ("unknown_topic", "stream_info", 21)


def test_empty_request_is_malformed(raw: Raw) -> None:
    assert error_of(raw.request(b""))[:3] == ("malformed", None, None)


@pytest.mark.parametrize("wrap", [False, True])
def test_json_nested_too_deeply_is_malformed_with_op_and_req_null(raw: Raw, wrap: bool) -> None:
    deep = b"[" * 5000 + b"]" * 5000
    body = b'{"v": 1, "op": "stream_info", "req": 4, "x": ' + deep + b"}" if wrap else deep
    assert error_of(raw.request(body))[:3] == ("malformed", None, None)


def test_negative_integer_digits_counted_without_sign(raw: Raw) -> None:
    ok = f'{{"v": 1, "op": "stream_info", "junk": -{"9" * 4300}}}'.encode()
    assert raw.request(ok)["ok"] is True
    bad = f'{{"v": 1, "op": "stream_info", "junk": [{{"a": -{"9" * 4301}}}]}}'.encode()
    assert error_of(raw.request(bad))[3] == "request holds an integer of 4301 digits; the limit is 4300"


def test_stream_filters_bad_and_wide(raw: Raw) -> None:
    assert error_of(raw.request({"v": 1, "op": "stream_info", "filter": "telemetry/#/x"}))[0] == "bad_filter"
    assert error_of(raw.request({"v": 1, "op": "stream_subscribe", "filter": "tele#"}))[0] == "bad_filter"
    assert error_of(raw.request({"v": 1, "op": "stream_subscribe", "filter": "other/+"}))[0] == "unknown_stream"
    assert raw.request({"v": 1, "op": "stream_subscribe", "filter": "+/nothing-yet"})["ok"] is True
    assert raw.request({"v": 1, "op": "stream_info", "filter": None})["filter"] == "#"
    assert error_of(raw.request({"v": 1, "op": "stream_unsubscribe", "filter": ""}))[0] == "malformed"


def test_open_topic_keeps_its_position_and_is_never_ahead(
    shared: Broker, raw: Raw, clients: Callable[..., Client]
) -> None:
    clients(shared.port, "pub-keep", clean_session=True).publish("telemetry/keep", [b"1", b"2"])
    raw.request({"v": 1, "op": "stream_subscribe", "filter": "telemetry/keep", "window": 1})
    assert raw.stream_events("telemetry/keep", 1)[0][1] == 1
    again = raw.request({"v": 1, "op": "stream_subscribe", "filter": "telemetry/+", "after": {"telemetry/keep": 999}})
    assert again["ok"] is True and "telemetry/keep" not in again["ahead"]
    raw.send({"v": 1, "op": "stream_ack", "topic": "telemetry/keep", "id": 1})
    assert raw.stream_events("telemetry/keep", 1)[0][1] == 2


def test_position_of_a_topic_without_a_log_is_kept_until_it_appears(
    shared: Broker, raw: Raw, clients: Callable[..., Client]
) -> None:
    reply = raw.request(
        {"v": 1, "op": "stream_subscribe", "filter": "telemetry/later/#", "after": {"telemetry/later/x": 2}}
    )
    assert reply["ok"] is True and reply["topics"] == {}
    clients(shared.port, "pub-later", clean_session=True).publish("telemetry/later/x", [b"1", b"2", b"3"])
    assert raw.stream_events("telemetry/later/x", 1) == [(0x08, 3, b"3")]


def test_unacknowledged_stream_event_is_resent_flagged_redelivered(limited: Broker, raws: Callable[..., Raw]) -> None:
    conn = raws(limited.port, "resend-1", clean=True)
    conn.publish("telemetry/resend", b"r")
    conn.request({"v": 1, "op": "stream_subscribe", "filter": "telemetry/resend", "window": 1})
    first = conn.stream_events("telemetry/resend", 1)
    again = conn.stream_events("telemetry/resend", 1)
    assert first == [(0x08, 1, b"r")]
    assert again == [(0x08 | 0x04, 1, b"r")]


def test_sdk_stream_info_and_subscribe_stream_argument_checks(shared: Broker, clients: Callable[..., Client]) -> None:
    clients(shared.port, "pub-sdk-info", clean_session=True).publish("telemetry/sdkinfo", [b"1", b"2"])
    client = DurableClient("sdk-info", port=shared.port, durable_session=False)
    try:
        client.connect()
        info = client.stream_info("telemetry/sdkinfo")
        assert info == {"telemetry/sdkinfo": (1, 2)}
        assert isinstance(info.store, int)  # type: ignore[attr-defined]
        for window in (0, 1001, 2.5, True):
            with pytest.raises(ValueError):
                client.subscribe_stream("telemetry/#", lambda e: None, window=window)
        with pytest.raises(TypeError):
            client.subscribe_stream("telemetry/#", lambda e: None, after=[("telemetry/a", 1)])  # type: ignore[arg-type]
        for after in ({"telemetry/+": 1}, {"other/a": 1}, {"telemetry/a": -1}, {"telemetry/a": 10**4300}):
            with pytest.raises(ValueError):
                client.subscribe_stream("telemetry/#", lambda e: None, after=after)
        from durable_client import ControlRequestFailed  # noqa: PLC0415

        with pytest.raises(ControlRequestFailed) as refused:
            client.stream_info("other/#")
        assert refused.value.code == "unknown_stream"
    finally:
        client.close()


def run_session(
    port: int, client_id: str, state: Path, log: Path, *, publish: list[bytes] | None = None
) -> tuple[list[bytes], int]:
    """One run of a CPL-2 client with a delivery log: connect, ready, wait for the marker, publish
    ``publish`` and wait for them; (payloads the listener got, the marker's replayed count)."""
    got: list[bytes] = []
    live = threading.Event()
    done = threading.Event()
    replayed: list[int] = []
    wanted = len(publish or [])

    def listener(event: Event) -> None:
        got.append(event.payload)
        if publish and event.payload == publish[-1]:
            done.set()

    def on_live(marker: Any) -> None:
        replayed.append(marker.replayed)
        live.set()

    client = DurableClient(
        client_id, port=port, persistence="disk", state_dir=str(state), delivery_log=str(log), on_live=on_live
    )
    try:
        client.subscribe("sensors/mark/#", qos=1, listener=listener)
        client.connect()
        client.ready_for_events()
        assert live.wait(WAIT)
        for payload in publish or []:
            client.publish("sensors/mark/1", payload, qos=1)
        if wanted:
            assert done.wait(WAIT)
    finally:
        client.close()
    return got, replayed[0]


@pytest.mark.parametrize("same_epoch", [True, False])
def test_cpl2_log_tail_receive_beyond_the_mark_advances_it(
    shared: Broker, tmp_path: Path, clients: Callable[..., Client], same_epoch: bool
) -> None:
    """delivery-log.md: a CPL-2 client reads its log's tail; a `receive` of the current epoch past
    the session mark (a process killed between the record and the mark) becomes the mark, so the
    events up to it are not processed again. A record of another epoch moves nothing."""
    cid = f"cpl2-tail-{same_epoch}"
    state, log = tmp_path / "state", tmp_path / "d.jsonl"
    got, _ = run_session(shared.port, cid, state, log, publish=[b"first"])
    assert got == [b"first"]
    receive = next(json.loads(line) for line in log.read_text().splitlines() if '"receive"' in line)
    clients(shared.port, f"pub-{cid}", clean_session=True).publish("sensors/mark/1", [b"second", b"third"])
    forged = {**receive, "seq": receive["seq"] + 1000, "time": time.time(), "id": msg_id("sensors/mark/1", b"x")}
    if not same_epoch:
        forged["epoch"] = receive["epoch"] + 1
    other = {**forged, "device": "someone-else", "seq": receive["seq"] + 5000}
    with log.open("a") as out:
        out.write(json.dumps(forged) + "\n" + json.dumps(other) + "\n")
    got, replayed = run_session(shared.port, cid, state, log)
    assert replayed == 2
    assert got == ([] if same_epoch else [b"second", b"third"])


def stream_run(port: int, state: Path, log: Path, topic: str, publish: bytes) -> list[bytes]:
    """A stateless CPL-2 reader of ``topic`` with a delivery log: publishes ``publish`` once its
    stream is open and returns what its listener got up to that event."""
    got: list[bytes] = []
    done = threading.Event()

    def listener(event: Event) -> None:
        got.append(event.payload)
        if event.payload == publish:
            done.set()

    client = DurableClient(
        "cpl2-stream", port=port, durable_session=False, persistence="disk", state_dir=str(state), delivery_log=str(log)
    )
    try:
        client.connect()
        client.subscribe_stream(topic, listener)
        client.publish(topic, publish, qos=1)
        assert done.wait(WAIT)
    finally:
        client.close()
    return got


@pytest.mark.parametrize("later_record", [None, "raw", "session"])
def test_cpl2_log_tail_last_stream_receive_moves_its_position(
    shared: Broker, tmp_path: Path, clients: Callable[..., Client], later_record: str | None
) -> None:
    """delivery-log.md: the device's very last `receive`, when a stream event, moves that topic's
    position forward; a `receive` after it (a raw or a session event) shows its mark was written."""
    topic = f"telemetry/cpl2/{later_record}"
    state, log = tmp_path / "state", tmp_path / "s.jsonl"
    assert stream_run(shared.port, state, log, topic, b"1") == [b"1"]
    receive = next(json.loads(line) for line in log.read_text().splitlines() if '"receive"' in line)
    assert (receive["seq"], receive["epoch"]) == (1, 0)
    clients(shared.port, f"pub-s-{later_record}", clean_session=True).publish(topic, [b"2", b"3"])
    records = [{**receive, "seq": 3, "id": msg_id(topic, b"3"), "time": time.time()}]
    if later_record is not None:
        seq, epoch = (0, 0) if later_record == "raw" else (7, 99)
        records.append({**receive, "topic": "sensors/else", "seq": seq, "epoch": epoch, "time": time.time()})
    with log.open("a") as out:
        out.write("".join(json.dumps(r) + "\n" for r in records))
    got = stream_run(shared.port, state, log, topic, b"4")
    assert got == ([b"4"] if later_record is None else [b"2", b"3", b"4"])


def test_hello_after_ready_holds_nothing_and_frames_what_follows(
    shared: Broker, raws: Callable[..., Raw], clients: Callable[..., Client]
) -> None:
    conn = raws(shared.port, "late-hello", clean=False)
    assert raw_subscribe(conn.sock, "sensors/lh", 1) == 1
    assert conn.request({"v": 1, "op": "ready"})["ok"] is True
    conn.take(lambda topic, _p: topic == MARKER)
    assert conn.request({"v": 1, "op": "hello"})["ok"] is True
    clients(shared.port, "pub-lh", clean_session=True).publish("sensors/lh", [b"now"])
    version, flags, _epoch, _seq, _t, payload = frame(conn.take(lambda topic, _p: topic == "sensors/lh")[1])
    assert (version, flags, payload) == (1, 0, b"now")


def test_interest_before_subscribe_applies(shared: Broker, raws: Callable[..., Raw]) -> None:
    conn, _ = sdk_session(shared.port, raws, "interest-first")
    assert conn.request({"v": 1, "op": "interest", "filter": "sensors/if", "durable": False})["ok"] is True
    assert raw_subscribe(conn.sock, "sensors/if", 1) == 1
    conn.send({"v": 1, "op": "ready"})
    marker = json.loads(conn.take(lambda topic, _p: topic == MARKER)[1])
    assert marker["live"] == [{"filter": "sensors/if", "qos": 1, "durable": False}]


def test_end_session_needs_a_session_and_a_new_session_gets_a_new_epoch(
    shared: Broker, raw: Raw, raws: Callable[..., Raw]
) -> None:
    assert error_of(raw.request({"v": 1, "op": "end_session", "req": 2}))[:3] == ("no_session", "end_session", 2)
    conn, first = sdk_session(shared.port, raws, "epochs")
    assert first["epoch"] >= 1
    assert conn.request({"v": 1, "op": "end_session"})["messages_dropped"] == 0
    conn.close()
    conn, second = sdk_session(shared.port, raws, "epochs")
    assert second["epoch"] != first["epoch"]
    conn.close()
    raws(shared.port, "epochs", clean=True).close()
    _conn, third = sdk_session(shared.port, raws, "epochs")
    assert third["epoch"] not in (first["epoch"], second["epoch"])


def test_stream_ack_has_no_reply(shared: Broker, raw: Raw, clients: Callable[..., Client]) -> None:
    clients(shared.port, "pub-noreply", clean_session=True).publish("telemetry/noreply", [b"1"])
    raw.request({"v": 1, "op": "stream_subscribe", "filter": "telemetry/noreply"})
    raw.stream_events("telemetry/noreply", 1)
    raw.send({"v": 1, "op": "stream_ack", "topic": "telemetry/noreply", "id": 1, "req": 40})
    assert raw.request({"v": 1, "op": "stream_info", "req": 41})["req"] == 41


def test_retained_initial_value_carries_its_queue_time(
    shared: Broker, raws: Callable[..., Raw], clients: Callable[..., Client]
) -> None:
    clients(shared.port, "pub-rt", clean_session=True).publish("sensors/rt/1", [b"v"], retain=True)
    conn, _ = sdk_session(shared.port, raws, "rt-time")
    before = time.time()
    assert raw_subscribe(conn.sock, "sensors/rt/#", 1) == 1
    conn.send({"v": 1, "op": "ready"})
    published = frame(conn.take(lambda topic, _p: topic == "sensors/rt/1")[1])[4]
    assert published >= before


def test_replies_markers_and_stream_events_reach_no_subscriber(
    shared: Broker, raw: Raw, raws: Callable[..., Raw], clients: Callable[..., Client]
) -> None:
    spy = clients(shared.port, "spy", clean_session=True)
    for topic_filter in ("$durable/v1/reply", "$durable/v1/marker", "$durable/v1/stream/#", "#"):
        spy.subscribe(topic_filter, qos=1)
    clients(shared.port, "pub-spy", clean_session=True).publish("telemetry/spy", [b"1"])
    raw.request({"v": 1, "op": "stream_subscribe", "filter": "telemetry/spy"})
    raw.stream_events("telemetry/spy", 1)
    conn, _ = sdk_session(shared.port, raws, "spied")
    conn.request({"v": 1, "op": "ready"})
    conn.take(lambda topic, _p: topic == MARKER)
    raw.publish("spy/done", b"sentinel")
    assert spy.wait_for(lambda ms: any(m.topic == "spy/done" for m in ms))
    assert [m.topic for m in spy.messages if not m.retain] == ["telemetry/spy", "spy/done"]


def test_unacknowledged_session_message_comes_again_replayed_and_redelivered(
    shared: Broker, clients: Callable[..., Client]
) -> None:
    def sdk_paho(ready: bool) -> Client:
        client = clients(shared.port, "redeliver-1", clean_session=False, manual_ack=True)
        client.paho.publish("_durable/v1/ctl", json.dumps({"v": 1, "op": "hello"}))
        assert client.wait_for(lambda ms: any(m.topic == "$durable/v1/reply" for m in ms))
        if ready:
            client.paho.publish("_durable/v1/ctl", json.dumps({"v": 1, "op": "ready"}))
        return client

    first = sdk_paho(ready=False)
    first.subscribe("sensors/rd", qos=1)
    first.paho.publish("_durable/v1/ctl", json.dumps({"v": 1, "op": "ready"}))
    assert first.wait_for(lambda ms: any(m.topic == MARKER for m in ms))
    clients(shared.port, "pub-rd", clean_session=True).publish("sensors/rd", [b"once"])
    assert first.wait_for(lambda ms: any(m.topic == "sensors/rd" for m in ms))
    first.drop()  # never acknowledged
    second = sdk_paho(ready=True)
    assert second.wait_for(lambda ms: any(m.topic == MARKER for m in ms))
    message = next(m for m in second.messages if m.topic == "sensors/rd")
    flags, payload = frame(message.payload)[1], frame(message.payload)[5]
    assert (flags, payload) == (0x01 | 0x04, b"once")
    assert json.loads(next(m for m in second.messages if m.topic == MARKER).payload)["replayed"] == 1


def test_topic_of_two_entries_is_logged_under_the_first(limited: Broker, raws: Callable[..., Raw]) -> None:
    conn = raws(limited.port, "two-entries", clean=True)
    for payload in (b"1", b"2", b"3", b"4"):
        conn.publish("telemetry/three/x", payload)
    info = conn.request({"v": 1, "op": "stream_info", "filter": "telemetry/three/#"})
    assert info["topics"] == {"telemetry/three/x": {"first": 3, "last": 4, "count": 2}}


def log_records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_delivery_log_durability_changes_are_written_before_subscribe_returns(shared: Broker, tmp_path: Path) -> None:
    path = tmp_path / "changes.jsonl"
    client = DurableClient("dlog-changes", port=shared.port, delivery_log=str(path))
    try:
        client.connect()
        client.subscribe("sensors/ch", qos=1)
        client.subscribe("sensors/ch", qos=1, durable=False)
        assert [(r["topic"], r["durable"]) for r in log_records(path) if r["kind"] == "subscribe"] == [
            ("sensors/ch", True),
            ("sensors/ch", False),
        ]
        client.subscribe("sensors/ch", qos=1, durable=True)
        assert [r["durable"] for r in log_records(path) if r["kind"] == "subscribe"] == [True, False, True]
        client.publish("sensors/q0", b"zero", qos=0)
        client.unsubscribe("sensors/ch")
        sends = [r for r in log_records(path) if r["kind"] == "send"]
        assert [(s["topic"], s["qos"], s["id"]) for s in sends] == [("sensors/q0", 0, msg_id("sensors/q0", b"zero"))]
        assert [r["topic"] for r in log_records(path) if r["kind"] == "unsubscribe"] == ["sensors/ch"]
    finally:
        client.close(keep_session=False)
    assert log_records(path)[-1]["kind"] == "session_end"


def test_delivery_log_of_a_stateless_client_and_its_stream(shared: Broker, tmp_path: Path) -> None:
    path = tmp_path / "stateless.jsonl"
    client = DurableClient("dlog-stateless", port=shared.port, durable_session=False, delivery_log=str(path))
    try:
        client.connect()
        client.subscribe("sensors/sl", qos=1)
        client.subscribe_stream("telemetry/sl/#", lambda e: None)
        client.unsubscribe("telemetry/sl/#")
        records = log_records(path)
        subs = [(r["topic"], r["qos"], r["durable"]) for r in records if r["kind"] == "subscribe"]
        assert subs == [("sensors/sl", 1, False)]
        assert [r["topic"] for r in records if r["kind"] == "unsubscribe"] == ["telemetry/sl/#"]
        connect = next(r for r in records if r["kind"] == "connect")
        assert connect["session_present"] is False
    finally:
        client.close()


def test_delivery_log_path_under_a_file_raises_oserror(shared: Broker, tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(OSError):
        DurableClient("dlog-under", port=shared.port, delivery_log=str(a_file / "log.jsonl"))


def test_delivery_log_refused_subscribe_writes_nothing(limited: Broker, tmp_path: Path) -> None:
    path = tmp_path / "refused.jsonl"
    client = DurableClient("dlog-refused", port=limited.port, delivery_log=str(path))
    try:
        client.connect()
        client.subscribe("sensors/one", qos=1)
        client.subscribe("sensors/two", qos=1)
        assert [r["topic"] for r in log_records(path) if r["kind"] == "subscribe"] == ["sensors/one"]
    finally:
        client.close(keep_session=False)


def test_another_users_connect_of_a_session_is_refused_before_any_request(
    shared: Broker, raws: Callable[..., Raw]
) -> None:
    """protocol.md: a request acting on another user's session is `not_your_session`; with the
    default `session_takeover: owner-only` such a connection never gets that far: CONNACK 5."""
    owner = raws(shared.port, "owned-1", clean=False, username="alice")
    assert owner.request({"v": 1, "op": "hello"})["ok"] is True
    owner.close()
    with socket.create_connection(("127.0.0.1", shared.port), timeout=WAIT) as sock:
        sock.sendall(connect_packet("owned-1", clean=False, username="bob"))
        assert read_exactly(sock, 4) == b"\x20\x02\x00\x05"


def test_hello_reports_the_brokers_max_packet_size(limited: Broker, raws: Callable[..., Raw]) -> None:
    assert raws(limited.port, "mps", clean=True).request({"v": 1, "op": "hello"})["max_packet_size"] == 200000


def test_positions_of_topics_without_a_log_count_against_the_entry_limit(
    limited: Broker, raws: Callable[..., Raw]
) -> None:
    conn = raws(limited.port, "entries-2", clean=True)
    after = {"telemetry/pp/a": 1, "telemetry/pp/b": 1}
    request = {"v": 1, "op": "stream_subscribe", "filter": "telemetry/pp/#", "after": after}
    assert error_of(conn.request(request))[0] == "malformed"
    request["after"] = {"telemetry/pp/a": 1}
    assert conn.request(request)["ok"] is True


def test_a_later_position_for_a_topic_without_a_log_replaces_the_kept_one(
    shared: Broker, raw: Raw, clients: Callable[..., Client]
) -> None:
    first = {"v": 1, "op": "stream_subscribe", "filter": "telemetry/rep/#", "after": {"telemetry/rep/x": 2}}
    assert raw.request(first)["ok"] is True
    second = {"v": 1, "op": "stream_subscribe", "filter": "telemetry/rep/+", "after": {"telemetry/rep/x": 1}}
    assert raw.request(second)["ok"] is True
    clients(shared.port, "pub-rep", clean_session=True).publish("telemetry/rep/x", [b"1", b"2", b"3"])
    assert raw.stream_events("telemetry/rep/x", 1) == [(0x08, 2, b"2")]


def test_later_log_opens_with_the_window_last_given_to_the_earliest_filter(
    shared: Broker, raw: Raw, clients: Callable[..., Client]
) -> None:
    for topic_filter, window in (("telemetry/win/#", 1), ("telemetry/win/#", 3), ("telemetry/win/+", 1)):
        assert raw.request({"v": 1, "op": "stream_subscribe", "filter": topic_filter, "window": window})["ok"]
    clients(shared.port, "pub-win", clean_session=True).publish("telemetry/win/x", [b"1", b"2", b"3"])
    assert [e[1] for e in raw.stream_events("telemetry/win/x", 3)] == [1, 2, 3]  # no ack sent


@pytest.mark.parametrize("after_forged", ["64k-of-others", "cut-line"])
def test_cpl2_log_tail_is_its_last_64_kib_and_ignores_a_cut_line(
    shared: Broker, tmp_path: Path, clients: Callable[..., Client], after_forged: str
) -> None:
    cid = f"cpl2-64k-{after_forged}"
    state, log = tmp_path / "state", tmp_path / "d.jsonl"
    assert run_session(shared.port, cid, state, log, publish=[b"first"])[0] == [b"first"]
    receive = next(json.loads(line) for line in log.read_text().splitlines() if '"receive"' in line)
    clients(shared.port, f"pub-{cid}", clean_session=True).publish("sensors/mark/1", [b"second", b"third"])
    forged = {**receive, "seq": receive["seq"] + 1000, "time": time.time()}
    with log.open("a") as out:
        out.write(json.dumps(forged) + "\n")
        if after_forged == "cut-line":
            out.write('{"kind": "receive", "device": "' + cid + '", "seq": 99999')
        else:
            other = json.dumps({"kind": "connect", "device": "another", "time": 1.0, "session_present": False})
            out.write((other + "\n") * (65536 // len(other) + 2))
    got, _ = run_session(shared.port, cid, state, log)
    assert got == ([] if after_forged == "cut-line" else [b"second", b"third"])


def test_replies_markers_and_stream_events_travel_at_qos0(
    shared: Broker, raws: Callable[..., Raw], clients: Callable[..., Client]
) -> None:
    clients(shared.port, "pub-qos0", clean_session=True).publish("telemetry/qos0", [b"1"], qos=2)
    conn, _ = sdk_session(shared.port, raws, "qos0-all")
    conn.send({"v": 1, "op": "stream_subscribe", "filter": "telemetry/qos0"})
    conn.send({"v": 1, "op": "ready"})
    wanted = {"$durable/v1/reply", MARKER, STREAM_PREFIX + "telemetry/qos0"}
    for _ in range(50):  # each look reads up to a PINGRESP, keeping the PUBLISHes that came before it
        if wanted <= {topic for topic, _first, _payload in conn.publishes}:
            break
        assert conn.alive()
    firsts = {topic: first for topic, first, _payload in conn.publishes}
    assert firsts == dict.fromkeys(wanted, 0x30)


def test_stream_ack_naming_another_client_is_not_your_session(
    shared: Broker, raw: Raw, clients: Callable[..., Client]
) -> None:
    clients(shared.port, "pub-ackcid", clean_session=True).publish("telemetry/ackcid", [b"1"])
    raw.request({"v": 1, "op": "stream_subscribe", "filter": "telemetry/ackcid"})
    raw.stream_events("telemetry/ackcid", 1)
    ack = {"v": 1, "op": "stream_ack", "topic": "telemetry/ackcid", "id": 1, "client_id": "someone", "req": 9}
    assert error_of(raw.request(ack))[:3] == ("not_your_session", "stream_ack", 9)


def test_delivery_log_raw_event_of_a_stateless_client(shared: Broker, tmp_path: Path) -> None:
    """delivery-log.md: `seq` and `epoch` both 0 for raw events; `published_at` their receive time."""
    path = tmp_path / "raw.jsonl"
    second = threading.Event()
    client = DurableClient("dlog-raw", port=shared.port, durable_session=False, delivery_log=str(path))
    try:
        client.subscribe("sensors/rawev", qos=1, listener=lambda e: second.set() if e.payload == b"2" else None)
        client.connect()
        before = time.time()
        client.publish("sensors/rawev", b"1", qos=1)
        client.publish("sensors/rawev", b"2", qos=1)
        assert second.wait(WAIT)
    finally:
        client.close()
    receive = next(r for r in log_records(path) if r["kind"] == "receive")
    assert (receive["seq"], receive["epoch"], receive["replayed"]) == (0, 0, False)
    assert before <= receive["published_at"] <= receive["time"]


def test_a_retained_control_publish_is_not_retained(shared: Broker, raw: Raw, clients: Callable[..., Client]) -> None:
    body = json.dumps({"v": 1, "op": "stream_info", "req": 77}).encode()
    raw.sock.sendall(mqtt_packet(0x31, mqtt_string("_durable/v1/ctl") + body))
    assert raw.reply()["req"] == 77
    raw.sock.sendall(mqtt_packet(0x31, mqtt_string("_durable/v1/elsewhere") + body))
    assert error_of(raw.reply())[0] == "unknown_topic"
    clients(shared.port, "pub-sentinel", clean_session=True).publish("zz/sentinel", [b"s"], retain=True)
    late = clients(shared.port, "late-sub", clean_session=True)
    late.subscribe("#", qos=1)
    assert late.wait_for(lambda ms: any(m.topic == "zz/sentinel" for m in ms))
    assert not [m.topic for m in late.messages if m.topic.startswith("_durable/")]
