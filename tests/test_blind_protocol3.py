"""Black-box tests written from README.md and docs/*.md alone (protocol.md, streams.md,
guarantees.md's bounds): hostile and edge control requests over raw sockets against real broker
processes, each quoting the promise it checks. One broker serves the module's protocol tests (each
uses client ids and topics of its own); the queue-limit tests start brokers of their own."""

from __future__ import annotations

import json
import socket
import threading
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from raw_mqtt_helpers import (
    CTL,
    REPLY,
    Raw,
    connect_packet,
    raw_subscribe,
    read_exactly,
)

from conftest import WAIT, Broker, Client, mqtt_packet, mqtt_string, refused, seen_away
from durable_client import ControlRequestFailed, DurableClient, DurableClientError, Event, Unconnected

pytestmark = pytest.mark.timeout(60)

ENTRIES_LIMIT = 3
SUBSCRIPTION_LIMIT = 2


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    """One broker for the protocol tests: a stream on telemetry/# keeping 5 events per topic,
    small per-client bounds so that their edges are cheap to reach."""
    folder = tmp_path_factory.mktemp("blind3")
    broker = Broker(
        folder,
        streams=[{"filter": "telemetry/#", "max_count": 5, "max_age": 0}, {"filter": "aged/#", "max_age": 1}],
        stream_ack_timeout=30,
        max_stream_entries_per_client=ENTRIES_LIMIT,
        max_subscriptions_per_client=SUBSCRIPTION_LIMIT,
    ).start()
    yield broker
    broker.stop()


# ----------------------------------------------------------------------------- protocol.md: topics


@pytest.mark.parametrize("topic", ["_durable/v1/ctl/", "_durable/v1/CTL", "_durable/v2/ctl", "_durable/v1/ctl/x"])
def test_a_valid_request_to_another_durable_topic_is_unknown_topic_and_not_acted_on(
    shared: Broker, raws: Callable[..., Raw], topic: str
) -> None:
    """protocol.md Topics: "A PUBLISH under `_durable/` other than `_durable/v1/ctl` gets the error
    `unknown_topic` (and is not acted on, whatever it holds)"; A refused request changes nothing."""
    raw = raws(shared.port, f"b3-topic-{topic.replace('/', '-')}")
    hello = raw.request({"v": 1, "op": "hello", "req": 1})
    assert raw.request({"v": 1, "op": "interest", "req": 2, "filter": "b3t/#", "durable": False})["ok"]
    reply = raw.request({"v": 1, "op": "end_session", "req": 3}, topic=topic)
    assert reply["ok"] is False and reply["error"]["code"] == "unknown_topic", reply
    assert topic[:100] in reply["error"]["message"]
    again = raw.request({"v": 1, "op": "hello", "req": 4})
    assert again["ok"] and again["epoch"] == hello["epoch"], "end_session under another topic ended the session"
    assert raw.alive()


# ------------------------------------------------------------------ protocol.md: requests and replies


def test_req_is_echoed_exactly_whatever_integer_it_is(shared: Broker, raws: Callable[..., Raw]) -> None:
    """protocol.md: "`req` (optional integer): echoed in the reply, to match replies to requests";
    a refusal "echoes `req`"."""
    raw = raws(shared.port, "b3-req", clean=True)
    for req in (0, -5, 2**63, 2**64 + 1, -(2**70), 10**30):
        reply = raw.request({"v": 1, "op": "hello", "req": req})
        assert reply["ok"] and reply["req"] == req, (req, reply)
        refusal = raw.request({"v": 1, "op": "interest", "req": req, "filter": "x"})
        assert refused(refusal) == ("no_session", "interest", req)


def test_pipelined_requests_are_answered_in_order_refusals_included(shared: Broker, raws: Callable[..., Raw]) -> None:
    """protocol.md: "Requests are handled in order"; "A refused request changes nothing: the
    connection stays up"."""
    raw = raws(shared.port, "b3-order")
    requests = []
    for req in range(60):
        if req % 3 == 0:
            requests.append(json.dumps({"v": 1, "op": "hello", "req": req}).encode())
        elif req % 3 == 1:
            requests.append(json.dumps({"v": 1, "op": "nope", "req": req}).encode())
        else:
            requests.append(json.dumps({"v": 2, "op": "hello", "req": req}).encode())
    raw.sock.sendall(b"".join(mqtt_packet(0x30, mqtt_string(CTL) + body) for body in requests))
    replies = [raw.reply() for _ in requests]
    assert [r["req"] for r in replies] == list(range(60))
    codes = [r["error"]["code"] if not r["ok"] else "ok" for r in replies]
    assert codes == ["ok", "unknown_op", "unsupported_version"] * 20
    assert raw.alive()


LONE = "\ud800"
HOSTILE_STRINGS = [
    {"op": "interest", "filter": f"b3s/{LONE}"},
    {"op": "interest", "filter": "b3s/a\u0000b"},
    {"op": "stream_subscribe", "filter": f"telemetry/{LONE}"},
    {"op": "stream_subscribe", "filter": "telemetry/a\u0000b"},
    {"op": "stream_info", "filter": f"telemetry/{LONE}"},
    {"op": "stream_unsubscribe", "filter": f"telemetry/{LONE}"},
    {"op": "stream_ack", "topic": f"telemetry/{LONE}", "id": 1},
    {"op": "stream_ack", "topic": "telemetry/a\u0000b", "id": 1},
    {"op": "hello", "client_id": LONE},
    {"op": "ready", "client_id": f"b3-strings{LONE}"},
]


def test_lone_surrogates_and_nul_in_string_fields_are_refused_and_change_nothing(
    shared: Broker, raws: Callable[..., Raw], clients: Callable[..., Client]
) -> None:
    """protocol.md Replies: the error codes (`internal`: "the broker failed handling it"); "A
    refused request changes nothing: the connection stays up and the session is untouched". A
    filter with a lone surrogate (the JSON escape \\ud800) or U+0000 is no MQTT filter, and a
    client_id with one is not the connection's own."""
    raw = raws(shared.port, "b3-strings")
    raw_subscribe(raw.sock, "b3s/#", 1)
    before = raw.request({"v": 1, "op": "hello", "req": 0})
    for req, fields in enumerate(HOSTILE_STRINGS, start=1):
        reply = raw.request({"v": 1, "req": req, **fields})  # json.dumps writes the escape \ud800
        code, op, echoed = refused(reply)
        assert code in {"malformed", "bad_filter", "not_your_session", "unknown_stream"}, (fields, reply)
        assert (op, echoed) == (fields["op"], req), reply
    after = raw.request({"v": 1, "op": "hello", "req": 99})
    assert after["ok"] and after["epoch"] == before["epoch"] and after["subscriptions"] == {"b3s/#": 1}
    assert raw.request({"v": 1, "op": "ready", "req": 100})["ok"]
    clients(shared.port, "b3-strings-pub", clean_session=True).publish("b3s/x", [b"still"], qos=1)
    _topic, framed = raw.take(lambda t, _p: t == "b3s/x")
    assert framed[26:] == b"still"


def test_wrong_types_in_interest_fields_are_malformed_and_name_the_missing_field(
    shared: Broker, raws: Callable[..., Raw]
) -> None:
    """protocol.md: `interest` fields `filter`, `durable` (bool, default true); `malformed`: "a field
    the op needs missing; a field of the wrong type ...; a string field empty"; a missing one is
    `malformed`, "`<op> needs '<field>'`"."""
    raw = raws(shared.port, "b3-interest")
    cases: list[dict[str, Any]] = [
        {"filter": ""},
        {"filter": 5},
        {"filter": ["b3i/#"]},
        {"filter": {"b3i/#": 1}},
        {"filter": "b3i/#", "durable": "false"},
        {"filter": "b3i/#", "durable": 0},
        {"filter": "b3i/#", "durable": []},
    ]
    for req, fields in enumerate(cases):
        reply = raw.request({"v": 1, "op": "interest", "req": req, **fields})
        assert refused(reply) == ("malformed", "interest", req), (fields, reply)
    missing = raw.request({"v": 1, "op": "interest", "req": 50, "durable": False})
    assert refused(missing) == ("malformed", "interest", 50)
    assert missing["error"]["message"] == "interest needs 'filter'"
    ok = raw.request({"v": 1, "op": "interest", "req": 51, "filter": "b3i/#", "durable": False})
    assert ok["ok"] and (ok["filter"], ok["durable"]) == ("b3i/#", False)


@pytest.mark.parametrize(
    ("fields", "code"),
    [
        ({"client_id": 5}, "malformed"),
        ({"client_id": ["b3-cid"]}, "malformed"),
        ({"client_id": True}, "malformed"),
        ({"client_id": "B3-CID"}, "not_your_session"),
        ({"client_id": "b3-cid "}, "not_your_session"),
    ],
)
def test_client_id_of_the_wrong_type_or_another_spelling_is_refused(
    shared: Broker, raws: Callable[..., Raw], fields: dict[str, Any], code: str
) -> None:
    """protocol.md: "`client_id` (optional, a non-empty string): when present it must be the
    connection's own client id, else `not_your_session`"; `malformed`: "a field of the wrong type"."""
    raw = raws(shared.port, "b3-cid")
    for op in ("hello", "ready", "end_session", "stream_info"):
        reply = raw.request({"v": 1, "op": op, "req": 3, **fields})
        assert refused(reply) == (code, op, 3), (op, reply)
    assert raw.request({"v": 1, "op": "hello", "client_id": "b3-cid"})["ok"], "its own id is fine"


# ------------------------------------------------------------------------------- streams


def publish_logged(port: int, topic: str, payloads: list[bytes], clients: Callable[..., Client], name: str) -> None:
    clients(port, name, clean_session=True).publish(topic, payloads, qos=1)


def test_a_stream_ack_naming_another_client_id_is_refused_and_releases_nothing(
    shared: Broker, raws: Callable[..., Raw], clients: Callable[..., Client]
) -> None:
    """protocol.md: "an ack naming another `client_id` waits like any request, to be refused in its
    turn" (`not_your_session`); "A refused request changes nothing"; `stream_ack`: "the broker
    sends the next" (window 1: one event in flight)."""
    topic = "telemetry/b3/other-ack"
    publish_logged(shared.port, topic, [b"e1", b"e2"], clients, "b3-oa-pub")
    raw = raws(shared.port, "b3-oa", clean=True)
    opened = raw.request({"v": 1, "op": "stream_subscribe", "req": 1, "filter": topic, "window": 1})
    assert opened["ok"] and opened["topics"] == {topic: {"first": 1, "last": 2}}, opened
    assert raw.stream_events(topic, 1) == [(0x08, 1, b"e1")]
    reply = raw.request({"v": 1, "op": "stream_ack", "req": 2, "topic": topic, "id": 1, "client_id": "someone"})
    assert refused(reply) == ("not_your_session", "stream_ack", 2)
    assert raw.request({"v": 1, "op": "stream_info", "req": 3, "filter": topic})["ok"]
    assert raw.kept_stream_events(topic) == [], "a refused ack released the window"
    raw.send({"v": 1, "op": "stream_ack", "topic": topic, "id": 1})
    assert raw.stream_events(topic, 1) == [(0x08, 2, b"e2")]


def test_ids_past_any_u64_in_acks_and_positions_are_no_internal_error(
    shared: Broker, raws: Callable[..., Raw], clients: Callable[..., Client]
) -> None:
    """protocol.md: `after` ids "whole numbers, 0 or more", `id` "a whole number, 1 or more"; "An
    `id` past the last one sent on the connection counts as that last one: events not sent yet
    still come, none is skipped"; `ahead`: "{topic: the log's last id} where the position presented
    is past the log's end"."""
    topic = "telemetry/b3/huge"
    publish_logged(shared.port, topic, [b"h1", b"h2", b"h3"], clients, "b3-huge-pub")
    far = raws(shared.port, "b3-huge-far", clean=True)
    opened = far.request({"v": 1, "op": "stream_subscribe", "req": 1, "filter": topic, "after": {topic: 10**30}})
    assert opened["ok"] and opened["ahead"] == {topic: 3} and opened["gaps"] == {}, opened
    assert far.alive()
    raw = raws(shared.port, "b3-huge", clean=True)
    assert raw.request({"v": 1, "op": "stream_subscribe", "req": 1, "filter": topic, "window": 1})["ok"]
    assert raw.stream_events(topic, 1) == [(0x08, 1, b"h1")]
    for huge in (2**64, 10**30):
        raw.send({"v": 1, "op": "stream_ack", "req": 7, "topic": topic, "id": huge})
    assert [event[1:] for event in raw.stream_events(topic, 2)] == [(2, b"h2"), (3, b"h3")]
    info = raw.request({"v": 1, "op": "stream_info", "req": 8, "filter": topic})
    assert info["ok"] and info["topics"] == {topic: {"first": 1, "last": 3, "count": 3}}, info
    assert [p for t, _f, p in raw.publishes if t == REPLY] == [], "an ack past the end got a reply"


def test_the_stream_entries_limit_holds_exactly_at_its_value_and_refuses_one_more(
    shared: Broker, raws: Callable[..., Raw], clients: Callable[..., Client]
) -> None:
    """guarantees.md: "the filters a connection holds open with `stream_subscribe` and the positions
    it presented for topics without a log ... count against `max_stream_entries_per_client` ...; a
    `stream_subscribe` past it is refused with `malformed` and changes nothing" (here 3)."""
    raw = raws(shared.port, "b3-entries", clean=True)
    # one filter and two positions of topics without a log: exactly the limit
    positions = {"telemetry/b3/ent/nolog1": 4, "telemetry/b3/ent/nolog2": 4}
    first = raw.request(
        {"v": 1, "op": "stream_subscribe", "req": 1, "filter": "telemetry/b3/ent/#", "after": positions}
    )
    assert first["ok"], first
    past = raw.request({"v": 1, "op": "stream_subscribe", "req": 2, "filter": "telemetry/b3/other/#"})
    assert refused(past) == ("malformed", "stream_subscribe", 2)
    assert "max_stream_entries_per_client" in past["error"]["message"], past
    # nothing changed: the open stream still sends, the kept positions still hold
    publish_logged(shared.port, "telemetry/b3/ent/live", [b"L"], clients, "b3-ent-pub")
    assert raw.stream_events("telemetry/b3/ent/live", 1) == [(0x08, 1, b"L")]
    publish_logged(shared.port, "telemetry/b3/ent/nolog1", [b"n1", b"n2", b"n3", b"n4", b"n5"], clients, "b3-ent-p2")
    assert raw.stream_events("telemetry/b3/ent/nolog1", 1) == [(0x08, 5, b"n5")]
    # the refused filter was not opened
    publish_logged(shared.port, "telemetry/b3/other/x", [b"o"], clients, "b3-ent-p3")
    assert raw.request({"v": 1, "op": "stream_info", "req": 3})["ok"]
    assert raw.kept_stream_events("telemetry/b3/other/x") == []


@pytest.mark.parametrize("topic", ["data/classified", "data/fine"])
def test_a_position_kept_for_a_topic_whose_log_appears_stops_counting_even_if_the_topic_is_refused(
    tmp_path: Path, raws: Callable[..., Raw], topic: str
) -> None:
    """protocol.md: a position for a topic without a log is "kept until its log appears"; guarantees.md
    counts only "positions it presented for topics without a log" against
    `max_stream_entries_per_client`. Once the topic's log appears, the position no longer counts,
    whether the topic plugin lets this reader have the topic (data/fine) or refuses it
    (data/classified, amqtt's TopicTabooPlugin, anonymous reader). Before: a refused topic's
    position stayed counted for good."""
    broker = Broker(tmp_path, streams=[{"filter": "data/#"}], max_stream_entries_per_client=2)
    broker.extra_plugins["amqtt.plugins.topic_checking.TopicTabooPlugin"] = {}
    broker.start()
    try:
        reader = raws(broker.port, "b3-kept-acl", clean=True)
        first = reader.request({"v": 1, "op": "stream_subscribe", "req": 1, "filter": "data/#", "after": {topic: 0}})
        assert first["ok"], first  # one filter and one position: the limit
        publisher = raws(broker.port, "b3-kept-admin", clean=True, username="admin")
        publisher.publish(topic, b"x")
        if topic == "data/fine":
            assert reader.stream_events(topic, 1) == [(0x08, 1, b"x")]
        # the reader's side learns of the new log on its own time: ask until it has (a refused
        # request changes nothing, so asking again is harmless); before the fix, never
        for req in range(3, 203):
            second = reader.request(
                {"v": 1, "op": "stream_subscribe", "req": req, "filter": "data/#", "after": {"data/nolog": 0}}
            )
            if second["ok"]:
                break
            assert "max_stream_entries_per_client" in second["error"]["message"], second
        assert second["ok"], second
        assert reader.kept_stream_events("data/classified") == []
    finally:
        broker.stop()


def test_reopening_a_held_stream_filter_at_the_entries_limit_adds_nothing(
    shared: Broker, raws: Callable[..., Raw]
) -> None:
    """guarantees.md/protocol.md: the bound counts "the filters a connection holds open" and the
    positions kept; "A topic already open on this connection (through an earlier
    `stream_subscribe`) keeps its position". A filter held already is no new entry, so a connection
    at the limit may send its `stream_subscribe` again (3 filters open here)."""
    raw = raws(shared.port, "b3-reopen", clean=True)
    filters = ["telemetry/b3/r1/#", "telemetry/b3/r2/#", "telemetry/b3/r3/#"]
    for req, topic_filter in enumerate(filters):
        assert raw.request({"v": 1, "op": "stream_subscribe", "req": req, "filter": topic_filter})["ok"]
    again = raw.request({"v": 1, "op": "stream_subscribe", "req": 9, "filter": filters[0]})
    assert again["ok"], again
    closed = raw.request({"v": 1, "op": "stream_unsubscribe", "req": 10, "filter": filters[1]})
    assert closed["ok"] and closed["filter"] == filters[1]
    assert raw.request({"v": 1, "op": "stream_subscribe", "req": 11, "filter": "telemetry/b3/r4/#"})["ok"], (
        "closing a filter frees its place"
    )


def test_closing_one_of_two_filters_covering_a_topic_keeps_it_sending(
    shared: Broker, raws: Callable[..., Raw], clients: Callable[..., Client]
) -> None:
    """protocol.md `stream_unsubscribe`: "its topics that no other open `stream_subscribe` of the
    connection covers send nothing more, and an ack on them gets `unknown_stream`"."""
    topic = "telemetry/b3/two/x"
    publish_logged(shared.port, topic, [b"t1", b"t2", b"t3"], clients, "b3-two-pub")
    raw = raws(shared.port, "b3-two", clean=True)
    assert raw.request({"v": 1, "op": "stream_subscribe", "req": 1, "filter": "telemetry/b3/two/#"})["ok"]
    assert raw.request({"v": 1, "op": "stream_subscribe", "req": 2, "filter": "telemetry/+/two/x"})["ok"]
    assert raw.stream_events(topic, 1) == [(0x08, 1, b"t1")]
    assert raw.request({"v": 1, "op": "stream_unsubscribe", "req": 3, "filter": "telemetry/b3/two/#"})["ok"]
    raw.send({"v": 1, "op": "stream_ack", "req": 4, "topic": topic, "id": 1})
    assert raw.stream_events(topic, 1) == [(0x08, 2, b"t2")], "the other filter still covers the topic"
    assert raw.request({"v": 1, "op": "stream_unsubscribe", "req": 5, "filter": "telemetry/+/two/x"})["ok"]
    ack = raw.request({"v": 1, "op": "stream_ack", "req": 6, "topic": topic, "id": 2})
    assert refused(ack) == ("unknown_stream", "stream_ack", 6)
    assert raw.kept_stream_events(topic) == [], "a closed topic sent more"


# --------------------------------------------------------------- guarantees.md: subscription limit


def test_a_filter_repeated_in_one_subscribe_counts_once_against_the_subscription_limit(
    shared: Broker, clients: Callable[..., Client]
) -> None:
    """guarantees.md Subscription limit: "return code 0x80 for each filter over the limit, the ones
    before it in the packet granted ... Re-subscribing to a filter the client holds does not count
    twice; unsubscribing frees a place"; MQTT-3.8.4-4 "handles a SUBSCRIBE of several filters as
    that many SUBSCRIBEs" (limit 2 here)."""
    for clean in (False, True):
        client = clients(shared.port, f"b3-sublimit-{clean}", clean_session=clean)
        assert client.subscribe([("b3l/a", 1), ("b3l/a", 0), ("b3l/b", 1), ("b3l/c", 1)]) == [1, 0, 1, 0x80]
        assert client.subscribe([("b3l/b", 0), ("b3l/c", 1)]) == [0, 0x80]
        client.unsubscribe("b3l/a")
        assert client.subscribe([("b3l/c", 1), ("b3l/d", 1)]) == [1, 0x80]


# ------------------------------------------------------------------- guarantees.md: queue limits


def test_equal_connected_and_disconnected_limits_keep_exactly_that_many_with_drop_newest(
    tmp_path: Path, raws: Callable[..., Raw], clients: Callable[..., Client]
) -> None:
    """broker.yaml: `max_depth_disconnected` "must be >= max_depth" (equal is allowed);
    guarantees.md: "`drop-newest` does not queue the new message for that session. Either way the
    publisher still gets its PUBACK"; the WARNING `session <id>: queue full at its limit of <n>
    messages (overflow <policy>): dropped <k> message(s) since the last warning, <total> in all`;
    protocol.md `end_session`: "Reply: `messages_dropped`"."""
    broker = Broker(tmp_path, max_depth=3, max_depth_disconnected=3, overflow="drop-newest", drop_log_interval=60)
    broker.start()
    try:
        raw = raws(broker.port, "b3-newest")
        assert raw.request({"v": 1, "op": "hello", "req": 1})["ok"]
        raw_subscribe(raw.sock, "b3q/#", 1)
        raw.close()
        publisher = clients(broker.port, "b3-newest-pub", clean_session=True)
        publisher.publish("b3q/x", [b"k1", b"k2", b"k3", b"d4", b"d5"], qos=1)  # every one acknowledged
        line = (
            "session b3-newest: queue full at its limit of 3 messages (overflow drop-newest): "
            "dropped 1 message(s) since the last warning, 1 in all"
        )
        assert broker.wait_until(lambda: line in broker.log(), WAIT), broker.log()
        back = raws(broker.port, "b3-newest")  # an SDK session: held until ready
        ended = back.request({"v": 1, "op": "end_session", "req": 2})
        assert ended["ok"] and ended["messages_dropped"] == 3, ended
        back.close()
        fresh = socket.create_connection(("127.0.0.1", broker.port), timeout=WAIT)
        with fresh:
            fresh.sendall(connect_packet("b3-newest", clean=False))
            assert read_exactly(fresh, 4) == b"\x20\x02\x00\x00", "the ended session is gone"
    finally:
        broker.stop()


def test_drop_oldest_at_exactly_the_depth_keeps_the_newest_and_replays_them_in_order(
    tmp_path: Path, clients: Callable[..., Client]
) -> None:
    """guarantees.md: "`drop-oldest` (default) deletes the oldest queued message"; "FIFO, no gaps
    ... the only messages skipped are those an overflow policy dropped"; a queue filled exactly to
    `max_depth_disconnected` drops nothing, one more drops one."""
    broker = Broker(tmp_path, max_depth=2, max_depth_disconnected=4, metrics_interval=1).start()
    try:
        device = clients(broker.port, "b3-oldest")
        device.subscribe("b3o/#", 1)
        device.disconnect()
        seen_away(clients, broker, 1)
        publisher = clients(broker.port, "b3-oldest-pub", clean_session=True)
        publisher.publish("b3o/x", [b"m1", b"m2", b"m3", b"m4", b"m5"], qos=1)
        device.connect()
        got = device.wait_messages(4)
        assert [m.payload for m in got] == [b"m2", b"m3", b"m4", b"m5"]
        assert all(not m.retain for m in got)
    finally:
        broker.stop()


def test_a_log_that_age_retention_emptied_reads_last_plus_one_and_its_ids_are_never_reused(
    shared: Broker, raws: Callable[..., Raw], clients: Callable[..., Client]
) -> None:
    """protocol.md `stream_info`: "(a log that retention emptied: `count` 0, `first` = `last` + 1)";
    `gaps`: "for positions retention already trimmed"; streams.md `max_age`: "seconds kept"; "ids
    are never reused by one store"."""
    topic = "aged/b3/x"
    publish_logged(shared.port, topic, [b"a1", b"a2"], clients, "b3-aged-pub")
    raw = raws(shared.port, "b3-aged", clean=True)
    emptied = {topic: {"first": 3, "last": 2, "count": 0}}
    info: dict[str, Any] = {}
    for _ in range(100):  # max_age is 1 s: bounded wait for retention, polled every 0.1 s
        info = raw.request({"v": 1, "op": "stream_info", "filter": "aged/#"})
        if info["ok"] and info["topics"] == emptied:
            break
        threading.Event().wait(0.1)
    assert info["ok"] and info["topics"] == emptied, info
    opened = raw.request({"v": 1, "op": "stream_subscribe", "filter": "aged/#", "after": {topic: 0}})
    assert opened["ok"] and opened["gaps"] == {topic: [1, 2]} and opened["ahead"] == {}, opened
    publish_logged(shared.port, topic, [b"a3"], clients, "b3-aged-pub2")
    assert raw.stream_events(topic, 1) == [(0x08, 3, b"a3")]


def test_a_position_kept_for_a_topic_whose_first_commit_trims_past_it_is_reported_and_resumed(
    shared: Broker, raws: Callable[..., Raw]
) -> None:
    """streams.md: the broker's WARNING "for a topic that appeared after the subscribe whose
    presented position retention had passed (`stream T: ids A to B were trimmed before this
    connection could read them`)"; protocol.md: "The position of a topic that has no log yet is
    kept until its log appears"; `stream_subscribe` opens "from the first event in the log for topics
    not listed" (no warning); guarantees.md Group commit: publishes read in one pass share one
    write batch (20 publishes in one TCP write, 5 kept)."""
    topic = "telemetry/b3/late/t"
    raw = raws(shared.port, "b3-late", clean=True)
    opened = raw.request({"v": 1, "op": "stream_subscribe", "filter": "telemetry/b3/late/#", "after": {topic: 2}})
    assert opened["ok"] and opened["topics"] == {} and opened["gaps"] == {}, opened
    fresh = raws(shared.port, "b3-late-fresh", clean=True)  # presents no position: from the first event
    assert fresh.request({"v": 1, "op": "stream_subscribe", "filter": "telemetry/b3/late/#"})["ok"]
    publisher = raws(shared.port, "b3-late-pub", clean=True)
    burst = b"".join(mqtt_packet(0x30, mqtt_string(topic) + f"p{i}".encode()) for i in range(1, 21))
    publisher.sock.sendall(burst)
    _flags, first_id, payload = raw.stream_events(topic, 1)[0]
    assert (first_id, payload) == (16, b"p16"), "resumed at the first retained id"
    line = f"stream {topic}: ids 3 to 15 were trimmed before this connection could read them"
    assert shared.wait_until(lambda: line in shared.log(), WAIT), [x for x in shared.log().splitlines() if topic in x]
    assert fresh.stream_events(topic, 1) == [(0x00, 16, b"p16")]  # published at QoS 0
    assert f"stream {topic}: ids" not in shared.log().replace(line, ""), "a reader without a position was warned"


def test_interest_sent_before_the_subscribe_makes_it_non_durable_too(
    shared: Broker, raws: Callable[..., Raw], clients: Callable[..., Client]
) -> None:
    """protocol.md `interest`: "`durable: false` makes that filter's subscription non-durable: the
    broker drops it when the connection that sent it ends ... Send it before or after the
    SUBSCRIBE; either order works." """
    raw = raws(shared.port, "b3-before")
    assert raw.request({"v": 1, "op": "hello"})["ok"]
    reply = raw.request({"v": 1, "op": "interest", "req": 1, "filter": "b3nd/#", "durable": False})
    assert reply["ok"] and (reply["filter"], reply["durable"]) == ("b3nd/#", False)
    assert raw_subscribe(raw.sock, "b3nd/#", 1) == 1
    assert raw_subscribe(raw.sock, "b3d/#", 1) == 1
    raw.close()
    back = raws(shared.port, "b3-before")
    hello = back.request({"v": 1, "op": "hello"})
    assert hello["ok"] and hello["subscriptions"] == {"b3d/#": 1}, hello


def test_after_end_session_the_open_connection_has_no_session_and_gets_nothing_of_its_filters(
    shared: Broker, raws: Callable[..., Raw], clients: Callable[..., Client]
) -> None:
    """protocol.md `end_session`: "Deletes the session, its queue and subscriptions at once";
    `hello` reply: "`epoch` (null without a durable session) ... `subscriptions` (null without a
    durable session"; `ready` needs a durable session (`no_session`)."""
    raw = raws(shared.port, "b3-ended")
    assert raw.request({"v": 1, "op": "hello"})["ok"]
    assert raw_subscribe(raw.sock, "b3e/#", 1) == 1
    assert raw.request({"v": 1, "op": "ready"})["ok"]
    ended = raw.request({"v": 1, "op": "end_session", "req": 1})
    assert ended["ok"] and ended["messages_dropped"] == 0, ended
    hello = raw.request({"v": 1, "op": "hello", "req": 2})
    assert hello["ok"] and (hello["epoch"], hello["subscriptions"]) == (None, None), hello
    assert refused(raw.request({"v": 1, "op": "ready", "req": 3})) == ("no_session", "ready", 3)
    watcher = clients(shared.port, "b3-ended-watch")
    watcher.subscribe("b3e/#", 1)
    clients(shared.port, "b3-ended-pub", clean_session=True).publish("b3e/x", [b"after-end"], qos=1)
    assert watcher.wait_messages(1)[0].payload == b"after-end"
    assert raw.alive()
    assert [t for t, _f, _p in raw.publishes if t == "b3e/x"] == [], "the ended session's filter still delivers"


def test_a_filter_closed_and_opened_again_starts_over_from_the_first_retained_event(
    shared: Broker, raws: Callable[..., Raw], clients: Callable[..., Client]
) -> None:
    """protocol.md `stream_subscribe`: "Opens the stream logs matching `filter` on this connection,
    from the id after `after[topic]`, or from the first event in the log for topics not listed";
    `stream_unsubscribe`: its topics "send nothing more"; "The positions live on the client"."""
    topic = "telemetry/b3/again/x"
    publish_logged(shared.port, topic, [b"g1", b"g2", b"g3"], clients, "b3-again-pub")
    raw = raws(shared.port, "b3-again", clean=True)
    assert raw.request({"v": 1, "op": "stream_subscribe", "filter": topic, "window": 3})["ok"]
    assert [e[1] for e in raw.stream_events(topic, 3)] == [1, 2, 3]
    raw.send({"v": 1, "op": "stream_ack", "topic": topic, "id": 2})
    assert raw.request({"v": 1, "op": "stream_unsubscribe", "filter": topic})["ok"]
    reopened = raw.request({"v": 1, "op": "stream_subscribe", "filter": topic, "window": 3})
    assert reopened["ok"] and reopened["topics"] == {topic: {"first": 1, "last": 3}}, reopened
    assert [e[1:] for e in raw.stream_events(topic, 3)] == [(1, b"g1"), (2, b"g2"), (3, b"g3")]
    other = raws(shared.port, "b3-again-2", clean=True)
    assert other.request({"v": 1, "op": "stream_subscribe", "filter": topic, "after": {topic: 3}})["ok"]
    assert other.request({"v": 1, "op": "stream_unsubscribe", "filter": topic})["ok"]
    again = other.request({"v": 1, "op": "stream_subscribe", "filter": topic, "after": {topic: 1}})
    assert again["ok"] and again["ahead"] == {} and again["gaps"] == {}, again
    assert other.stream_events(topic, 1) == [(0x08, 2, b"g2")], "a closed topic's new position applies"


def test_json_nested_500_levels_in_an_ignored_field_is_read_and_1000_is_malformed(
    shared: Broker, raws: Callable[..., Raw]
) -> None:
    """protocol.md: `malformed` for a request whose "JSON nested deeper than the parser's recursion
    limit allows (a little under 1000 levels)"; "Fields an op does not take are ignored"; a request
    nested too deeply "is answered with `op` and `req` null"."""
    raw = raws(shared.port, "b3-nest", clean=True)
    for depth, ok in ((500, True), (1000, False), (100_000, False)):
        body = b'{"v":1,"op":"hello","req":5,"x":' + b"[" * depth + b"]" * depth + b"}"
        reply = raw.request(body)
        if ok:
            assert reply["ok"] and reply["req"] == 5, (depth, reply)
        else:
            assert refused(reply) == ("malformed", None, None), (depth, reply)
    assert raw.request({"v": 1, "op": "hello", "req": 6})["ok"]


def test_a_flood_of_hostile_control_traffic_loses_no_queued_message(
    shared: Broker, raws: Callable[..., Raw], clients: Callable[..., Client]
) -> None:
    """protocol.md: "A refused request changes nothing: the connection stays up and the session is
    untouched"; guarantees.md "FIFO, no gaps"; the broker keeps serving other clients."""
    device = clients(shared.port, "b3-flood-dev")
    device.subscribe("b3f/#", 1)
    device.disconnect()
    hostile = raws(shared.port, "b3-flood-dev-evil", clean=True)
    garbage: list[bytes] = [
        b"",
        b"\xff\xfe\x00",
        b"null",
        b"{" * 3000,
        b'{"v":1,"op":"end_session","client_id":"b3-flood-dev"}',
        b'{"v":1,"op":"ready","client_id":"b3-flood-dev"}',
        b'{"v":1,"op":"stream_subscribe","filter":"#","after":{"telemetry/x":-1}}',
        b'{"v":1,"op":"stream_subscribe","filter":"#","window":0}',
        b'{"v":1,"op":"hello","session_expiry":-0.5}',
        json.dumps({"v": 1, "op": "hello", "pad": "x" * 65_600}).encode(),
    ]
    wire = b"".join(mqtt_packet(0x30, mqtt_string(CTL) + body) for body in garbage * 20)
    hostile.sock.sendall(wire)
    replies = [hostile.reply() for _ in range(len(garbage) * 20)]
    assert all(r["ok"] is False and r["error"]["code"] != "internal" for r in replies), [
        r for r in replies if r["ok"] or r["error"]["code"] == "internal"
    ]
    publisher = clients(shared.port, "b3-flood-pub", clean_session=True)
    publisher.publish("b3f/x", [f"q{i}".encode() for i in range(50)], qos=1)
    assert hostile.alive()
    device.connect()
    got = device.wait_messages(50)
    assert [m.payload for m in got] == [f"q{i}".encode() for i in range(50)]


def test_drop_oldest_while_connected_spares_the_messages_in_flight(
    tmp_path: Path, clients: Callable[..., Client]
) -> None:
    """guarantees.md: "`drop-oldest` (default) deletes the oldest queued message (while the session
    is connected, the oldest one not sent yet: messages in flight ... are never dropped)"; "A
    message stays in LevelDB until its PUBACK"; `recovery_buffer` "is a session's in-flight window"
    (max_depth 3, window 2 here)."""
    broker = Broker(tmp_path, max_depth=3, max_depth_disconnected=3, recovery_buffer=2).start()
    try:
        device = clients(broker.port, "b3-flight", manual_ack=True)
        device.subscribe("b3w/#", 1)
        publisher = clients(broker.port, "b3-flight-pub", clean_session=True)
        publisher.publish("b3w/x", [b"m1", b"m2"], qos=1)
        assert [m.payload for m in device.wait_messages(2)] == [b"m1", b"m2"]  # in flight, not acknowledged
        publisher.publish("b3w/x", [b"m3", b"m4", b"m5"], qos=1)  # m4 pushes m3 out, m5 pushes m4 out
        for message in device.wait_messages(2)[:2]:
            device.paho.ack(message.mid, message.qos)
        got = device.wait_messages(3)
        assert [m.payload for m in got] == [b"m1", b"m2", b"m5"], [m.payload for m in got]
        device.paho.ack(got[2].mid, 1)
    finally:
        broker.stop()


def test_a_window_of_1000_sends_that_many_without_an_ack(
    shared: Broker, raws: Callable[..., Raw], clients: Callable[..., Client]
) -> None:
    """protocol.md `stream_subscribe`: "`window` (1-1000, optional)"; the broker sends "at most
    `window` unacknowledged per topic"; `window` 1001 is `malformed`."""
    topic = "telemetry/b3/wide"
    raw = raws(shared.port, "b3-wide", clean=True)
    past = raw.request({"v": 1, "op": "stream_subscribe", "req": 1, "filter": topic, "window": 1001})
    assert refused(past) == ("malformed", "stream_subscribe", 1)
    assert raw.request({"v": 1, "op": "stream_subscribe", "req": 2, "filter": topic, "window": 1000})["ok"]
    publish_logged(shared.port, topic, [f"w{i}".encode() for i in range(1, 6)], clients, "b3-wide-pub")  # max_count 5
    assert [e[1] for e in raw.stream_events(topic, 5)] == [1, 2, 3, 4, 5]


def test_a_topic_two_stream_filters_of_a_connection_match_takes_the_window_of_the_one_subscribed_first(
    shared: Broker, raws: Callable[..., Raw], clients: Callable[..., Client]
) -> None:
    """streams.md: a topic that two stream subscriptions of one connection match has one cursor, with
    the `window` of the filter that connection subscribed first, whichever filter is the wider, for a
    log open at the subscribe as for one that appears later; the second subscribe changes it neither
    at once nor at the next ack."""
    for name, first, second, topic, late, sent_at_once in (
        (
            "wide-first",
            ("telemetry/b3/ovw/#", 1),
            ("telemetry/b3/ovw/+", 3),
            "telemetry/b3/ovw/a",
            "telemetry/b3/ovw/b",
            1,
        ),
        ("narrow-first", ("telemetry/b3/ovn/a", 3), ("telemetry/b3/ovn/#", 1), "telemetry/b3/ovn/a", None, 3),
    ):
        publish_logged(shared.port, topic, [b"e1", b"e2", b"e3", b"e4", b"e5"], clients, f"b3-{name}-pub")
        raw = raws(shared.port, f"b3-{name}", clean=True)
        for req, (topic_filter, window) in enumerate((first, second), 1):
            assert raw.request(
                {"v": 1, "op": "stream_subscribe", "req": req, "filter": topic_filter, "window": window}
            )["ok"]
        assert [event[1] for event in raw.stream_events(topic, sent_at_once)] == list(range(1, sent_at_once + 1))
        assert raw.request({"v": 1, "op": "stream_info", "req": 3, "filter": topic})["ok"]
        assert raw.kept_stream_events(topic) == [], f"{name}: more than the first filter's window in flight"
        raw.send({"v": 1, "op": "stream_ack", "topic": topic, "id": 1})  # one slot frees: one more event
        assert [event[1] for event in raw.stream_events(topic, 1)] == [sent_at_once + 1]
        assert raw.request({"v": 1, "op": "stream_info", "req": 5, "filter": topic})["ok"]
        assert raw.kept_stream_events(topic) == [], f"{name}: the window changed with the second subscribe"
        if late is not None:  # a log that appears after both subscribes: the first filter's window too
            publish_logged(shared.port, late, [b"l1", b"l2", b"l3"], clients, f"b3-{name}-late")
            assert [event[1] for event in raw.stream_events(late, 1)] == [1]
            assert raw.request({"v": 1, "op": "stream_info", "req": 4, "filter": late})["ok"]
            assert raw.kept_stream_events(late) == [], f"{name}: a late log took the second filter's window"


# ------------------------------------------------------------------------------ sdk: streams


def test_sdk_stream_arguments_at_and_past_their_edges_and_stream_info_of_an_emptied_log(
    shared: Broker, sdk: Callable[..., DurableClient], raws: Callable[..., Raw], clients: Callable[..., Client]
) -> None:
    """streams.md: `window`: "a whole number from 1 to 1000, `None` for the broker's
    `stream_window`; anything else raises `ValueError`"; "`after` must be a dict (else `TypeError`)
    of topics without wildcards, U+0000 or a lone surrogate that the filter matches, each with a
    whole number of 0 or more (else `ValueError`); a topic that an open stream subscription of the
    client already reads cannot be moved (`ValueError`)"; `stream_info` "returns `{topic: (first
    retained id, last id)}` ... (a log retention emptied reads `(last + 1, last)`), with `.store` the
    broker store's random id"; "a filter no configured stream covers raises `ControlRequestFailed`
    with code `unknown_stream`. It needs a connection (`Unconnected`) and cannot be called from a
    listener (`DurableClientError`)"."""
    topic = "aged/b3/sdk"
    publish_logged(shared.port, topic, [b"s1"], clients, "b3-sdk-pub")
    client = sdk(shared.port, "b3-sdk", durable_session=False)
    with pytest.raises(Unconnected):
        client.stream_info("aged/#")
    got: list[Event] = []
    seen = threading.Event()

    def listener(event: Event) -> None:
        got.append(event)
        seen.set()

    for window in (0, 1001, True, 2.5, "1"):
        with pytest.raises(ValueError, match="window"):
            client.subscribe_stream("aged/#", listener, window=window)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        client.subscribe_stream("aged/#", listener, after=[(topic, 1)])  # type: ignore[arg-type]
    for after in ({"aged/+": 1}, {"aged/#": 1}, {"aged/a\u0000": 1}, {f"aged/{LONE}": 1}, {"other/x": 1},
                  {topic: -1}, {topic: True}, {topic: 1.5}):  # fmt: skip
        with pytest.raises(ValueError, match="after"):
            client.subscribe_stream("aged/#", listener, after=after)  # type: ignore[arg-type]
    client.connect()
    client.subscribe_stream("aged/#", listener, window=1000, after={topic: 0})
    with pytest.raises(ValueError, match="after"):
        client.subscribe_stream("aged/b3/#", listener, after={topic: 0})  # already read by the open one
    with pytest.raises(ControlRequestFailed) as refused_info:
        client.stream_info("nothing-logged/#")
    assert refused_info.value.code == "unknown_stream"
    bounds: dict[str, Any] = {}
    for _ in range(100):  # max_age is 1 s: bounded wait for retention, polled every 0.1 s
        bounds = dict(client.stream_info(topic))
        if bounds.get(topic) == (2, 1):
            break
        threading.Event().wait(0.1)
    assert bounds == {topic: (2, 1)}, bounds
    raw = raws(shared.port, "b3-sdk-raw", clean=True)
    assert client.stream_info(topic).store == raw.request({"v": 1, "op": "stream_info"})["store"]
    errors: list[BaseException] = []

    def calls_info(event: Event) -> None:
        try:
            client.stream_info("aged/#")
        except DurableClientError as exc:
            errors.append(exc)
        seen.set()

    client.subscribe_stream("aged/b3/in/#", calls_info)
    seen.clear()
    publish_logged(shared.port, "aged/b3/in/x", [b"i1"], clients, "b3-sdk-pub2")
    assert seen.wait(WAIT)
    assert len(errors) == 1 and not isinstance(errors[0], (Unconnected, ControlRequestFailed)), errors


# ------------------------------------------------------------------------------ delivery-log.md


def test_a_subscribe_the_broker_refuses_with_0x80_writes_no_subscribe_record(
    shared: Broker, sdk: Callable[..., DurableClient], tmp_path: Path, clients: Callable[..., Client]
) -> None:
    """delivery-log.md: "A `subscribe` is written when the broker confirms it (SUBACK): from then on
    the broker routes to it" (a refusal routes nothing: an audit would count its window's sends as
    lost); sdk.md: "A SUBACK that refuses the filter (0x80: ...`max_subscriptions_per_client`) does
    not raise"; `receive` records carry `id`: "the first 16 bytes of SHA-256 over the topic (UTF-8),
    a NUL byte and the payload, in hex" (limit 2 here)."""
    import hashlib  # noqa: PLC0415

    log_path = tmp_path / "deliveries.jsonl"
    client = sdk(shared.port, "b3-dlog", delivery_log=str(log_path))
    second = threading.Event()  # the first event's record is written before the second's listener runs
    client.connect()
    for topic_filter in ("b3dl/a", "b3dl/b", "b3dl/c"):
        client.subscribe(topic_filter, qos=1, listener=lambda e: e.payload == b"two" and second.set())
    client.ready_for_events()
    clients(shared.port, "b3-dlog-pub", clean_session=True).publish("b3dl/a", [b"one", b"two"], qos=1)
    assert second.wait(WAIT)
    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert [(r["topic"], r["qos"]) for r in records if r["kind"] == "subscribe"] == [("b3dl/a", 1), ("b3dl/b", 1)]
    receives = [r for r in records if r["kind"] == "receive"]
    expected_id = hashlib.sha256(b"b3dl/a\x00one").digest()[:16].hex()
    assert [(r["topic"], r["id"], r["device"]) for r in receives][:1] == [("b3dl/a", expected_id, "b3-dlog")]


@pytest.mark.parametrize(
    "bad",
    [
        {"after": {"telemetry/b3/atom/{n}/a": 1, "telemetry/b3/atom/{n}/b": -1}},
        {"after": {"telemetry/b3/atom/{n}/a": 1, "telemetry/b3/atom/{n}/+": 1}},
        {"after": {"telemetry/b3/atom/{n}/a": 1}, "window": 0},
        {"after": {"telemetry/b3/atom/{n}/a": 1, "telemetry/b3/atom/{n}/b": None}},
    ],
)
def test_a_stream_subscribe_refused_for_one_bad_part_opens_nothing_and_keeps_no_position(
    shared: Broker, raws: Callable[..., Raw], clients: Callable[..., Client], bad: dict[str, Any]
) -> None:
    """protocol.md: "A refused request changes nothing"; `malformed` for `after` ids "whole numbers,
    0 or more", keys "no `+`, `#`", `window` "a whole number from 1 to 1000", "a null id inside
    `after` is `malformed`"; a later `stream_subscribe` without `after` starts "from the first event
    in the log for topics not listed"."""
    n = zlib.crc32(json.dumps(bad, sort_keys=True).encode())  # topics of its own per case
    prefix = f"telemetry/b3/atom/{n}"
    raw = raws(shared.port, f"b3-atom-{n}", clean=True)
    fields = {
        key: ({k.format(n=n): v for k, v in value.items()} if key == "after" else value) for key, value in bad.items()
    }
    reply = raw.request({"v": 1, "op": "stream_subscribe", "req": 1, "filter": f"{prefix}/#", **fields})
    assert refused(reply) == ("malformed", "stream_subscribe", 1)
    publish_logged(shared.port, f"{prefix}/a", [b"x1", b"x2"], clients, f"b3-atom-pub-{n}")
    assert raw.alive()
    assert raw.kept_stream_events(f"{prefix}/a") == [], "the refused subscription was opened"
    assert raw.request({"v": 1, "op": "stream_subscribe", "req": 2, "filter": f"{prefix}/#"})["ok"]
    assert raw.stream_events(f"{prefix}/a", 1) == [(0x08, 1, b"x1")], "a position of the refused request was kept"


def test_a_session_expiry_past_a_doubles_range_is_malformed_not_the_end_of_the_connection(
    shared: Broker, raws: Callable[..., Raw], clients: Callable[..., Client]
) -> None:
    """protocol.md `hello`: "`session_expiry` (seconds, optional: a finite number >= 0, else
    `malformed`)" (JSON's 1e400 reads as infinite, and 10**400 written out is the same number); "A
    refused request changes nothing: the connection stays up and the session is untouched"; the
    granted value is the number asked for (0 for -0.0)."""
    raw = raws(shared.port, "b3-bigexp")
    assert raw_subscribe(raw.sock, "b3big/#", 1) == 1
    before = raw.request({"v": 1, "op": "hello", "req": 1, "session_expiry": 60})
    for req, number in enumerate(("1" + "0" * 400, "-" + "1" + "0" * 400, "1e400"), start=2):
        body = f'{{"v":1,"op":"hello","req":{req},"session_expiry":{number}}}'.encode()
        reply = raw.request(body)
        assert refused(reply) == ("malformed", "hello", req), reply
        assert "session_expiry" in reply["error"]["message"]
    zero = raw.request(b'{"v":1,"op":"hello","req":9,"session_expiry":-0.0}')
    assert zero["ok"] and zero["epoch"] == before["epoch"] and zero["subscriptions"] == {"b3big/#": 1}, zero
    assert json.dumps(zero["session_expiry"]) == "0.0", zero
    assert raw.request({"v": 1, "op": "ready"})["ok"]
    clients(shared.port, "b3-bigexp-pub", clean_session=True).publish("b3big/x", [b"kept"], qos=1)
    assert raw.take(lambda t, _p: t == "b3big/x")[1][26:] == b"kept"


def test_the_subscription_byte_limit_holds_exactly_and_a_repeated_filter_counts_once(
    tmp_path: Path, clients: Callable[..., Client]
) -> None:
    """guarantees.md: "The filters' UTF-8 bytes, summed per client, are bounded the same way by
    `max_subscription_bytes_per_client`"; "Re-subscribing to a filter the client holds does not count
    twice; unsubscribing frees a place" (10 bytes here: 'aaaa' + 'bbbbbb' fill it exactly; 'é' is 2)."""
    broker = Broker(tmp_path, max_subscription_bytes_per_client=10).start()
    try:
        for clean in (False, True):
            client = clients(broker.port, f"b3-subbytes-{clean}", clean_session=clean)
            assert client.subscribe([("aaaa", 1), ("aaaa", 0), ("bbbbbb", 1), ("c", 1)]) == [1, 0, 1, 0x80]
            assert client.subscribe([("bbbbbb", 0)]) == [0]
            client.unsubscribe("aaaa")
            assert client.subscribe([("ééé", 1), ("d", 1)]) == [0x80, 1], "6 + 6 bytes pass 10; 6 + 1 fit"
            client.disconnect()
    finally:
        broker.stop()


def test_a_non_durable_interest_belongs_to_its_connection_and_durable_true_undoes_it(
    shared: Broker, raws: Callable[..., Raw]
) -> None:
    """protocol.md `interest`: "`durable: false` makes that filter's subscription non-durable: the
    broker drops it when the connection that sent it ends ... A newer connection of the session (a
    reconnect, a take-over) that wants the filter sends `interest` again ... `durable: true` undoes
    it." An interest a connection sent for a filter it never subscribed does not make a later
    connection's SUBSCRIBE of it non-durable."""
    first = raws(shared.port, "b3-owner")
    assert first.request({"v": 1, "op": "hello"})["ok"]
    assert first.request({"v": 1, "op": "interest", "filter": "b3o/never", "durable": False})["ok"]
    assert first.request({"v": 1, "op": "interest", "filter": "b3o/undone", "durable": False})["ok"]
    assert raw_subscribe(first.sock, "b3o/undone", 1) == 1
    assert first.request({"v": 1, "op": "interest", "filter": "b3o/undone", "durable": True})["ok"]
    first.close()
    second = raws(shared.port, "b3-owner")
    hello = second.request({"v": 1, "op": "hello"})
    assert hello["subscriptions"] == {"b3o/undone": 1}, hello
    assert raw_subscribe(second.sock, "b3o/never", 1) == 1
    second.close()
    third = raws(shared.port, "b3-owner")
    hello = third.request({"v": 1, "op": "hello"})
    assert hello["subscriptions"] == {"b3o/undone": 1, "b3o/never": 1}, hello
