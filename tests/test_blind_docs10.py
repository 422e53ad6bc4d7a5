"""A tenth pass of black-box tests written from README.md, docs/protocol.md and docs/delivery-log.md alone,
aimed at promises earlier rounds left open: the exact JSON types the control protocol accepts (a JSON
``true`` or ``1.0`` is no integer, only UTF-8 is read), the replies of a connection without a durable session,
the frame and marker of a retained message queued with a SUBSCRIBE before ``ready``, epochs of sessions
made anew, what an explicit subscription to the broker's ``$durable/`` topics and a retained QoS 2 control
request do, the delivery log's columns for a stateless client and when a listener's publish is logged, and
what the SDK does with a frame of another version and with a plain session's messages sent before its
``hello`` takes effect (a relay between the SDK and the broker rewrites or holds packets). Real broker
processes on 127.0.0.1, raw sockets, paho and SDK clients; each test quotes the promise it checks.
"""

from __future__ import annotations

import json
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from packet_relay import Packet, PacketRelay
from raw_mqtt_helpers import CTL, REPLY, Raw, read_packet

from conftest import WAIT, Broker, Client, mqtt_packet, mqtt_string, refused
from durable_client import DurableClient, Event

pytestmark = pytest.mark.timeout(60)

MARKER = "$durable/v1/marker"
MAX_SESSION_EXPIRY = 100
FRAME = struct.Struct(">BBQQd")


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    """One broker for the module's protocol tests (each uses client ids and topics of its own): a stream on
    telemetry/#, and a ``max_session_expiry`` low enough to see a ``hello`` capped by it."""
    broker = Broker(
        tmp_path_factory.mktemp("blind10"),
        streams=[{"filter": "telemetry/#", "max_count": 100, "max_age": 0}],
        max_session_expiry=MAX_SESSION_EXPIRY,
    ).start()
    yield broker
    broker.stop()


def subscribe_raw(raw: Raw, filters: list[tuple[str, int]], packet_id: int = 5) -> bytes:
    """SUBSCRIBE ``filters`` in one packet; its SUBACK's return codes (other packets read meanwhile are kept)."""
    pid = packet_id.to_bytes(2, "big")
    raw.sock.sendall(mqtt_packet(0x82, pid + b"".join(mqtt_string(f) + bytes((q,)) for f, q in filters)))
    for _ in range(1000):
        first, body = read_packet(raw.sock)
        if first == 0x90 and body[:2] == pid:
            return body[2:]
        raw._keep(first, body)
    raise AssertionError("no SUBACK")


# ------------------------------------------------------------------------------------ protocol.md: Requests


@pytest.mark.parametrize("version", [2, "1", 1.0, True, None, 0])
def test_a_v_other_than_the_integer_1_is_unsupported_version_echoing_op_and_req(
    shared: Broker, raws: Callable[..., Raw], version: Any
) -> None:
    """protocol.md: "`v` (required): the protocol version, the integer 1. A request without it, or with any
    other value (`2`, `"1"`, `1.0`, `true`), is refused with `unsupported_version`"; "A field given as JSON
    `null` counts as absent"; "a refusal echoes `req`, and `op` when it names a known op"; "A refused request
    changes nothing: the connection stays up" (a JSON ``true`` equals 1 in Python, ``1.0`` too)."""
    raw = raws(shared.port, f"v-{json.dumps(version)}")
    code, op, req = refused(raw.request({"v": version, "op": "ready", "req": 41}))
    assert (code, op, req) == ("unsupported_version", "ready", 41)
    reply = raw.request({"v": 1, "op": "ready", "req": 42})  # the refused ready changed nothing
    assert reply["ok"] is True and reply["already"] is False, reply


@pytest.mark.parametrize("req", [True, 7.0, "7", [7], {"n": 7}])
def test_a_req_that_is_not_a_json_integer_is_malformed_with_op_and_req_null(
    shared: Broker, raws: Callable[..., Raw], req: Any
) -> None:
    """protocol.md: "`req` (optional integer)"; `malformed` for "`req` neither an integer nor absent"; "A
    request ... whose `req` is not an integer is answered with `op` and `req` null (they could not be read)"
    (``true`` and ``7.0`` are no JSON integers)."""
    raw = raws(shared.port, f"req-{type(req).__name__}")
    assert refused(raw.request({"v": 1, "op": "stream_info", "req": req})) == ("malformed", None, None)


@pytest.mark.parametrize(
    ("request_", "named"),
    [
        ({"v": 1, "op": "hello", "session_expiry": True}, "session_expiry"),
        ({"v": 1, "op": "hello", "session_expiry": "60"}, "session_expiry"),
        ({"v": 1, "op": "stream_subscribe", "filter": "telemetry/#", "window": True}, "window"),
        ({"v": 1, "op": "stream_subscribe", "filter": "telemetry/#", "window": 5.5}, "window"),
        ({"v": 1, "op": "stream_subscribe", "filter": "telemetry/#", "after": {"telemetry/b": True}}, "after"),
        ({"v": 1, "op": "stream_subscribe", "filter": "telemetry/#", "after": {"telemetry/b": 1.5}}, "after"),
        ({"v": 1, "op": "stream_ack", "topic": "telemetry/b", "id": True}, "id"),
        ({"v": 1, "op": "interest", "filter": "b/#", "durable": 1}, "durable"),
    ],
    ids=[
        "expiry-true",
        "expiry-string",
        "window-true",
        "window-5.5",
        "after-true",
        "after-1.5",
        "id-true",
        "durable-1",
    ],
)
def test_a_json_boolean_is_no_number_and_a_number_no_boolean(
    shared: Broker, raws: Callable[..., Raw], request_: dict[str, Any], named: str
) -> None:
    """protocol.md: `malformed` for "a field of the wrong type or out of its range: `session_expiry` a number of
    seconds, 0 or more; `window` a whole number from 1 to 1000; `after` keys topics ... and its ids whole
    numbers, 0 or more; `id` a whole number, 1 or more"; `interest`'s "`durable` (bool, default true)". The
    refusal echoes the known op, and its message names the field."""
    raw = raws(shared.port, f"types-{named}")
    reply = raw.request({**request_, "req": 3})
    assert refused(reply) == ("malformed", request_["op"], 3)
    assert named in reply["error"]["message"], reply
    assert raw.alive()


@pytest.mark.parametrize("encoding", ["utf-16", "utf-32", "latin-1"])
def test_a_request_in_another_encoding_is_not_read(shared: Broker, raws: Callable[..., Raw], encoding: str) -> None:
    """protocol.md: "A request is a JSON object in UTF-8 (no other encoding is read)"; `malformed` for a request
    "not UTF-8 JSON", "answered with `op` and `req` null" (UTF-16 and UTF-32 with their byte order marks,
    which some JSON readers detect, and Latin-1 bytes past ASCII)."""
    raw = raws(shared.port, f"enc-{encoding}")
    body = json.dumps({"v": 1, "op": "stream_info", "req": 5, "note": "café"}, ensure_ascii=False)
    assert refused(raw.request(body.encode(encoding))) == ("malformed", None, None)
    assert raw.request({"v": 1, "op": "stream_info", "req": 6})["ok"] is True


# ------------------------------------------------------------------------------ protocol.md: ops, no session


def test_without_a_durable_session_hello_answers_nulls_and_the_session_ops_are_no_session(
    shared: Broker, raws: Callable[..., Raw]
) -> None:
    """protocol.md, `hello`: "Reply: `protocol`, `epoch` (null without a durable session), `session_expiry`
    (granted, null for the broker default and without a durable session), `subscriptions` (null without a
    durable session ...), `max_packet_size` (the broker's setting ...)"; `interest`, `ready` and `end_session`
    "Needs a durable session: yes" (`no_session`), the stream ops "no"."""
    raw = raws(shared.port, "no-session", clean=True)
    reply = raw.request({"v": 1, "op": "hello", "req": 1, "session_expiry": 50})
    assert reply == {
        "op": "hello",
        "req": 1,
        "ok": True,
        "protocol": 1,
        "epoch": None,
        "session_expiry": None,
        "subscriptions": None,
        "max_packet_size": 1048576,
    }
    for number, request in enumerate(
        [{"op": "interest", "filter": "a/#"}, {"op": "ready"}, {"op": "end_session"}], start=2
    ):
        assert refused(raw.request({"v": 1, "req": number, **request})) == ("no_session", request["op"], number)
    assert raw.request({"v": 1, "op": "stream_info", "req": 9})["ok"] is True
    subscribed = raw.request({"v": 1, "op": "stream_subscribe", "filter": "telemetry/none", "req": 10})
    assert subscribed["ok"] is True and subscribed["filter"] == "telemetry/none", subscribed


def test_hello_grants_at_most_max_session_expiry_and_a_hello_without_it_removes_the_override(
    shared: Broker, raws: Callable[..., Raw]
) -> None:
    """protocol.md, `hello`: "sets its expiry override, capped by the broker's `max_session_expiry`; a `hello`
    without `session_expiry` removes the override"; reply "`session_expiry` (granted, null for the broker
    default ...)"."""
    raw = raws(shared.port, "capped")
    assert raw.request({"v": 1, "op": "hello", "session_expiry": 10 * MAX_SESSION_EXPIRY})["session_expiry"] == (
        MAX_SESSION_EXPIRY
    )
    assert raw.request({"v": 1, "op": "hello", "session_expiry": 2.5})["session_expiry"] == 2.5
    assert raw.request({"v": 1, "op": "hello", "session_expiry": 0})["session_expiry"] == 0
    assert raw.request({"v": 1, "op": "hello"})["session_expiry"] is None


# ------------------------------------------------------------------------ protocol.md: frames and the marker


def test_a_retained_message_queued_by_a_subscribe_before_ready_is_flagged_timed_and_counted(
    shared: Broker, raws: Callable[..., Raw], clients: Callable[..., Client]
) -> None:
    """protocol.md, Frames: flags "`0x01` replayed ..., `0x02` retained (an initial value queued with a new
    subscription)"; the publish time "as the broker received it (for a retained message queued with a new
    subscription: when it was queued)"; the epoch "the durable session's id"; The marker: "a retained message
    queued with a SUBSCRIBE handled before the `ready` counts too (it comes before the marker, flags `0x03`,
    replayed and retained)"; "`live` lists the session's subscriptions" with `durable` false for a filter an
    `interest` made non-durable."""
    publisher = clients(shared.port, "ret-pub", clean_session=True)
    publisher.publish("ret10/a", [b"initial"], qos=1, retain=True)
    queued_after = time.time()  # after the PUBACK: the broker received the publish before this
    raw = raws(shared.port, "ret-sub")
    epoch = raw.request({"v": 1, "op": "hello"})["epoch"]
    assert raw.request({"v": 1, "op": "interest", "filter": "nd10/#", "durable": False})["durable"] is False
    assert subscribe_raw(raw, [("ret10/#", 1), ("nd10/#", 0)]) == b"\x01\x00"
    assert raw.request({"v": 1, "op": "ready"})["already"] is False
    _topic, framed = raw.take(lambda topic, _p: topic == "ret10/a")
    version, flags, frame_epoch, seq, published = FRAME.unpack(framed[:26])
    assert (version, flags, frame_epoch, framed[26:]) == (1, 0x03, epoch, b"initial")
    assert queued_after <= published <= time.time() + 1, (queued_after, published)
    _topic, payload = raw.take(lambda topic, _p: topic == MARKER)
    marker = json.loads(payload)
    assert marker == {
        "v": 1,
        "epoch": epoch,
        "replayed": 1,
        "first_seq": seq,
        "last_seq": seq,
        "live": [{"filter": "nd10/#", "qos": 0, "durable": False}, {"filter": "ret10/#", "qos": 1, "durable": True}],
    }


def test_a_session_made_anew_gets_a_new_epoch_and_an_empty_marker(shared: Broker, raws: Callable[..., Raw]) -> None:
    """protocol.md, Frames: epoch "the durable session's id; a session created anew (after expiry,
    `end_session` or a clean connect) gets a new one"; `end_session` "Reply: `messages_dropped`"; The marker:
    "`first_seq` / `last_seq` ... (null when none)", "A brand-new session gets a marker too, with
    `replayed: 0`"."""
    first = raws(shared.port, "anew")
    epochs = [first.request({"v": 1, "op": "hello"})["epoch"]]
    assert first.request({"v": 1, "op": "end_session", "req": 1}) == {
        "op": "end_session",
        "req": 1,
        "ok": True,
        "messages_dropped": 0,
    }
    first.close()
    second = raws(shared.port, "anew")
    epochs.append(second.request({"v": 1, "op": "hello"})["epoch"])
    second.close()
    raws(shared.port, "anew", clean=True).close()  # a clean connect discards the session
    third = raws(shared.port, "anew")
    epochs.append(third.request({"v": 1, "op": "hello"})["epoch"])
    assert len(set(epochs)) == 3 and all(isinstance(e, int) and e >= 1 for e in epochs), epochs
    third.request({"v": 1, "op": "ready"})
    _topic, payload = third.take(lambda topic, _p: topic == MARKER)
    assert json.loads(payload) == {
        "v": 1,
        "epoch": epochs[2],
        "replayed": 0,
        "first_seq": None,
        "last_seq": None,
        "live": [],
    }


# --------------------------------------------------------------------------------------- protocol.md: topics


def test_explicit_subscriptions_to_the_brokers_durable_topics_receive_nothing(
    shared: Broker, clients: Callable[..., Client]
) -> None:
    """protocol.md: "Replies, markers and stream events are written to the one connection concerned, never
    routed; `#` does not match `$` topics, and subscribing to them explicitly receives nothing"; `$durable/v1/
    reply` "broker → the requesting connection", QoS 0 (a requester subscribed to it gets its reply once)."""
    spy = clients(shared.port, "spy10", clean_session=True)
    for topic_filter in ("$durable/v1/reply", "$durable/#", "$durable/v1/marker", "#"):
        spy.subscribe(topic_filter, 1)
    asker = clients(shared.port, "asker10")
    asker.subscribe(REPLY, 1)
    asker.paho.publish(CTL, json.dumps({"v": 1, "op": "hello", "req": 77}), qos=1)
    asker.paho.publish(CTL, json.dumps({"v": 1, "op": "ready", "req": 78}), qos=1)
    assert asker.wait_for(lambda ms: any(m.topic == MARKER for m in ms)), [m.topic for m in asker.messages]
    publisher = clients(shared.port, "spy10-pub", clean_session=True)
    publisher.publish("spy10/end", [b"after"], qos=1)  # routed after the requests: the spy reads in order
    assert spy.wait_for(lambda ms: any(m.topic == "spy10/end" for m in ms))
    assert not [m.topic for m in spy.messages if m.topic.startswith(("$durable", "_durable"))]
    replies = [json.loads(m.payload) for m in asker.messages if m.topic == REPLY]
    assert [r["req"] for r in replies] == [77, 78], replies
    assert all(m.qos == 0 for m in asker.messages if m.topic in (REPLY, MARKER))


def test_a_retained_qos2_control_request_is_answered_never_retained_and_routed_to_nobody(
    shared: Broker, clients: Callable[..., Client]
) -> None:
    """protocol.md: `_durable/v1/ctl` "a control request (JSON), QoS 0 (QoS 1 and 2 are accepted ...)"; "The
    broker takes every PUBLISH under `_durable/` off the message path: it is never routed, retained or
    queued, so no subscriber (not even one to `#`) receives control traffic"."""
    watcher = clients(shared.port, "ctl10-watch", clean_session=True)
    watcher.subscribe("_durable/#", 2)
    watcher.subscribe("#", 2)
    asker = clients(shared.port, "ctl10-ask", clean_session=True)
    info = asker.paho.publish(CTL, json.dumps({"v": 1, "op": "stream_info", "req": 12}), qos=2, retain=True)
    info.wait_for_publish(WAIT)
    assert info.is_published()  # PUBREC, PUBREL, PUBCOMP done
    assert asker.wait_for(lambda ms: any(m.topic == REPLY for m in ms))
    reply = json.loads(next(m.payload for m in asker.messages if m.topic == REPLY))
    assert reply["ok"] is True and reply["req"] == 12 and reply["filter"] == "#", reply
    late = clients(shared.port, "ctl10-late", clean_session=True)
    late.subscribe("_durable/#", 1)
    publisher = clients(shared.port, "ctl10-pub", clean_session=True)
    publisher.publish("ctl10/end", [b"end"], qos=1)
    assert watcher.wait_for(lambda ms: any(m.topic == "ctl10/end" for m in ms))
    late.subscribe("ctl10/#", 1)  # its retained messages, if any, come before this SUBACK's
    assert not [m.topic for m in watcher.messages if m.topic.startswith("_durable")]
    assert not late.messages, [m.topic for m in late.messages]


# ---------------------------------------------------------------------------------- protocol.md: stream ops


def test_stream_info_defaults_to_hash_and_its_store_id_stays_with_the_store(
    broker_factory: Callable[..., Broker], raws: Callable[..., Raw]
) -> None:
    """protocol.md, `stream_info`: "`filter` (optional, default `#`)"; "Reply: `filter` (echoed), `topics` ...,
    and `store`: the store's id (a random number made with the store ...)": the same after a restart on the
    same store, another for another store. `stream_unsubscribe` "Reply: `filter` (also for a filter that is
    not open: there is nothing to close)"."""
    streams = [{"filter": "telemetry/#", "max_count": 10, "max_age": 0}]
    broker = broker_factory(streams=streams)
    raw = raws(broker.port, "store-id")
    first = raw.request({"v": 1, "op": "stream_info", "req": 1})
    assert (first["filter"], first["topics"]) == ("#", {}) and isinstance(first["store"], int), first
    assert raw.request({"v": 1, "op": "stream_unsubscribe", "filter": "telemetry/never", "req": 2}) == {
        "op": "stream_unsubscribe",
        "req": 2,
        "ok": True,
        "filter": "telemetry/never",
    }
    raw.close()
    broker.stop()
    broker.start()
    again = raws(broker.port, "store-id").request({"v": 1, "op": "stream_info"})
    assert again["store"] == first["store"]
    other = broker_factory(streams=streams)
    assert raws(other.port, "store-id").request({"v": 1, "op": "stream_info"})["store"] != first["store"]


def test_an_after_topic_the_filter_does_not_match_is_ignored(
    shared: Broker, raws: Callable[..., Raw], clients: Callable[..., Client]
) -> None:
    """protocol.md, `stream_subscribe`: "from the id after `after[topic]`, or from the first event in the log for
    topics not listed (an `after` topic the filter does not match is ignored)"."""
    publisher = clients(shared.port, "after10-pub", clean_session=True)
    publisher.publish("telemetry/after10/a", [b"a1", b"a2", b"a3"], qos=1)
    publisher.publish("telemetry/after10/b", [b"b1", b"b2"], qos=1)
    raw = raws(shared.port, "after10", clean=True)
    reply = raw.request(
        {
            "v": 1,
            "op": "stream_subscribe",
            "filter": "telemetry/after10/a",
            "window": 5,
            "after": {"telemetry/after10/a": 1, "telemetry/after10/b": 1, "elsewhere/x": 5},
        }
    )
    assert reply["ok"] is True and set(reply["topics"]) == {"telemetry/after10/a"}, reply
    assert reply["ahead"] == {} and reply["gaps"] == {}, reply
    events = raw.stream_events("telemetry/after10/a", 2)
    assert [(event_id, payload) for _flags, event_id, payload in events] == [(2, b"a2"), (3, b"a3")]
    assert not raw.kept_stream_events("telemetry/after10/b")


# ------------------------------------------------------------------ delivery-log.md: a stateless client's log


def test_a_stateless_clients_receive_records_have_seq_and_epoch_0_and_its_receive_time(
    shared: Broker, clients: Callable[..., Client], tmp_path: Path
) -> None:
    """delivery-log.md: `seq`, `epoch` "both 0 for raw events"; `published_at` "(for raw events of a stateless
    connection, which carry none: the receive time)"; `durable` "false: ... every subscription of a stateless
    client"; `replayed` false (a stateless client gets no marker: nothing is delivered before it). For a stream
    event: "the stream log id and epoch 0"."""
    log_path = tmp_path / "stateless.jsonl"
    got: list[Event] = []
    done = threading.Event()
    synced = threading.Event()

    def listener(event: Event) -> None:
        if event.topic == "plain10/sync":
            synced.set()  # the network thread wrote the records of the events before this one
            return
        got.append(event)
        if len(got) == 2:
            done.set()

    client = DurableClient("stateless10", "127.0.0.1", shared.port, durable_session=False, delivery_log=str(log_path))
    try:
        client.subscribe("plain10/#", qos=1, listener=listener)
        client.subscribe_stream("telemetry/stateless10", listener)
        client.connect()
        client.ready_for_events()
        before = time.time()
        clients(shared.port, "stateless10-pub", clean_session=True).publish("plain10/a", [b"p"], qos=1)
        clients(shared.port, "stateless10-tel", clean_session=True).publish("telemetry/stateless10", [b"s"], qos=1)
        assert done.wait(WAIT), got
        clients(shared.port, "stateless10-sync", clean_session=True).publish("plain10/sync", [b""], qos=1)
        assert synced.wait(WAIT)  # a receive is written after its listeners return: that of "s" too by now
        records = [json.loads(line) for line in log_path.read_text(encoding="utf-8").splitlines()]
        receives = {r["topic"]: r for r in records if r["kind"] == "receive"}
        after = time.time()
        assert set(receives) >= {"plain10/a", "telemetry/stateless10"}, records
        raw = receives["plain10/a"]
        assert (raw["seq"], raw["epoch"], raw["replayed"]) == (0, 0, False), raw
        assert before <= raw["published_at"] <= raw["time"] <= after, raw
        stream = receives["telemetry/stateless10"]
        assert (stream["seq"], stream["epoch"]) == (1, 0), stream
        subscribes = [r for r in records if r["kind"] == "subscribe"]
        assert [(r["topic"], r["durable"], r["qos"]) for r in subscribes] == [("plain10/#", False, 1)], subscribes
    finally:
        client.close()


# ------------------------------------------------------------------------------ protocol.md: Versioning


def test_the_sdk_does_not_read_a_frame_of_another_version(
    broker_factory: Callable[..., Broker],
    relays: Callable[..., PacketRelay],
    sdk: Callable[..., DurableClient],
    clients: Callable[..., Client],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """protocol.md, Versioning: "a client does not read frames of another version": the SDK delivers such a
    session message as it came (frame bytes included, `seq` and `epoch` 0, no duplicate check; a WARNING) and
    drops such a stream event (an ERROR), which the broker sends again after `stream_ack_timeout`. A relay sets
    the version byte of the first session message and the first stream event the broker sends to 2."""
    broker = broker_factory(streams=[{"filter": "telemetry/#"}], stream_ack_timeout=0.5)
    rewritten: set[str] = set()

    def version_2(packet: Packet) -> Packet:
        if packet.kind != 3:
            return packet
        length = int.from_bytes(packet.body[:2], "big")
        topic = packet.body[2 : 2 + length].decode()
        if topic not in ("v2f/a", "$durable/v1/stream/telemetry/v2f") or topic in rewritten:
            return packet
        rewritten.add(topic)
        start = 2 + length + (2 if packet.first & 0x06 else 0)
        body = packet.body[:start] + b"\x02" + packet.body[start + 1 :]
        return Packet(packet.direction, packet.first, body)

    relay = relays(broker.port, rewrite_down=version_2)
    session_events: list[Event] = []
    stream_events: list[Event] = []
    got = threading.Condition()

    def keep(into: list[Event]) -> Callable[[Event], None]:
        def listener(event: Event) -> None:
            with got:
                into.append(event)
                got.notify_all()

        return listener

    client = sdk(relay.port, "v2frames")
    client.subscribe("v2f/#", qos=1, listener=keep(session_events))
    client.subscribe_stream("telemetry/v2f", keep(stream_events))
    client.connect()
    client.ready_for_events()
    publisher = clients(broker.port, "v2f-pub", clean_session=True)
    publisher.publish("v2f/a", [b"one", b"two"], qos=1)
    publisher.publish("telemetry/v2f", [b"s1"], qos=1)
    with got:
        assert got.wait_for(lambda: len(session_events) >= 2 and stream_events, WAIT), (session_events, stream_events)
    first, second = session_events
    assert first.payload[:1] == b"\x02" and first.payload[26:] == b"one" and len(first.payload) == 29, first
    assert (first.seq, first.epoch) == (0, 0), first
    assert (second.payload, second.seq >= 1, second.epoch >= 1) == (b"two", True, True), second
    assert [(e.seq, e.payload, e.redelivered) for e in stream_events] == [(1, b"s1", True)], stream_events
    warned = [r for r in caplog.records if r.levelname == "WARNING" and "has no SDK frame" in r.getMessage()]
    dropped = [r for r in caplog.records if r.levelname == "ERROR" and "dropping a stream event" in r.getMessage()]
    assert warned and dropped, caplog.text


# --------------------------------------------------------------------- delivery-log.md: when a send is written


def test_a_publish_from_a_listener_is_logged_as_sent_before_the_broker_has_it(
    broker: Broker,
    relays: Callable[..., PacketRelay],
    sdk: Callable[..., DurableClient],
    clients: Callable[..., Client],
    tmp_path: Path,
) -> None:
    """delivery-log.md: "A `send` is written once the broker has acknowledged the publish ... or once paho has
    queued it (QoS 0, and any publish made from inside a listener, which cannot wait for its PUBACK)": a relay
    holds the listener's QoS 1 PUBLISH before the broker, and its `send` record is there once the listener has
    returned; the broker gets it at the release."""
    log_path = tmp_path / "listener.jsonl"
    relay = relays(broker.port)
    returned = threading.Event()

    def answer(event: Event) -> None:
        device.publish("lst10/out", b"answer:" + event.payload, qos=1)
        returned.set()

    live = threading.Event()
    device = sdk(relay.port, "lst10", delivery_log=str(log_path), on_live=lambda _marker: live.set())
    device.subscribe("lst10/in", qos=1, listener=answer)
    device.connect()
    device.ready_for_events()
    assert live.wait(WAIT)
    watcher = clients(broker.port, "lst10-watch", clean_session=True)
    watcher.subscribe("lst10/out", 1)

    def is_answer(packet: Packet) -> bool:
        return packet.kind == 3 and b"lst10/out" in packet.body[:12]

    relay.hold("up", is_answer)
    clients(broker.port, "lst10-pub", clean_session=True).publish("lst10/in", [b"q"], qos=1)
    assert returned.wait(WAIT)
    relay.wait_seen(is_answer)  # sent by paho, held by the relay: no PUBACK can have come
    sends = [json.loads(line) for line in log_path.read_text(encoding="utf-8").splitlines()]
    assert [(r["topic"], r["qos"]) for r in sends if r["kind"] == "send"] == [("lst10/out", 1)], sends
    assert not watcher.messages
    relay.release("up")
    assert watcher.wait_for(lambda ms: [m.payload for m in ms] == [b"answer:q"])


# ------------------------------------------------------------ sdk.md: the first SDK connect to a plain session


def test_a_plain_sessions_messages_sent_before_the_sdks_hello_takes_effect_come_unframed_and_unheld(
    broker: Broker,
    relays: Callable[..., PacketRelay],
    sdk: Callable[..., DurableClient],
    clients: Callable[..., Client],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """sdk.md: "A durable session that never said `hello` (one a plain MQTT client made) is not held at the
    SDK's first connect: what the broker sends it before that connection's `hello` takes effect ... comes
    unframed, and the SDK delivers it as it came: before `ready_for_events()`, `seq` and `epoch` 0, `replayed`
    false, no duplicate check, a WARNING each. From that `hello` on it is an SDK session for good." A relay
    holds the SDK's `hello` until the plain session's queued message has come."""
    plain = clients(broker.port, "plain10")
    plain.subscribe("plain10/#", 1)
    plain.disconnect()
    publisher = clients(broker.port, "plain10-pub", clean_session=True)
    publisher.publish("plain10/a", [b"while plain"], qos=1)

    def is_hello(packet: Packet) -> bool:
        request = packet.control()
        return request is not None and request.get("op") == "hello"

    relay = relays(broker.port)
    relay.hold("up", is_hello)
    events: list[Event] = []
    got = threading.Condition()

    def listener(event: Event) -> None:
        with got:
            events.append(event)
            got.notify_all()

    live = threading.Event()
    client = sdk(relay.port, "plain10", on_live=lambda _marker: live.set())
    client.subscribe("plain10/#", qos=1, listener=listener)
    failures: list[BaseException] = []

    def connect() -> None:
        try:
            client.connect(timeout=WAIT)
        except BaseException as failure:  # reported by the test thread
            failures.append(failure)

    connecting = threading.Thread(target=connect)
    connecting.start()
    with got:
        assert got.wait_for(lambda: events, WAIT), "the plain session's message never came"
    relay.wait_seen(is_hello)
    relay.release("up")
    connecting.join(WAIT)
    assert not connecting.is_alive() and not failures, failures
    (first,) = events
    assert (first.payload, first.seq, first.epoch, first.replayed) == (b"while plain", 0, 0, False), first
    assert any("has no SDK frame" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    publisher.publish("plain10/a", [b"now held"], qos=1)
    client.ready_for_events()
    assert live.wait(WAIT)
    with got:
        assert got.wait_for(lambda: len(events) == 2, WAIT), events
    second = events[1]
    assert (second.payload, second.seq >= 1, second.epoch >= 1, second.replayed) == (b"now held", True, True, True)
