"""Black-box tests written from docs/protocol.md, guarantees.md and operations.md alone: edges the
earlier rounds left open (bools where numbers are due, a hello's expiry override and an SDK session
across a crash, SUBSCRIBEs holding one bad part, the store id across restarts). Each quotes its promise."""

from __future__ import annotations

import json
import re
import shutil
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from raw_mqtt_helpers import connect_packet, raw_connect, raw_subscribe, read_exactly, read_packet
from test_blind_protocol3 import CTL, REPLY, Raw

from conftest import HOST, WAIT, Broker, Client, mqtt_packet, mqtt_string, run_cli
from durable_client import DurableClient

pytestmark = pytest.mark.timeout(60)

EXPIRED = "$SYS/broker/durable/expired"
CONTROL_WILLS = ("_durable/v1/ctl", "_durable/x")


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    """One broker for the tests that leave nothing behind that another would see (own client ids)."""
    broker = Broker(tmp_path_factory.mktemp("docs4"), streams=[{"filter": "log4/#"}]).start()
    yield broker
    broker.stop()


@pytest.fixture
def raws() -> Iterator[Callable[..., Raw]]:
    made: list[Raw] = []

    def make(port: int, client_id: str, **kwargs: Any) -> Raw:
        made.append(Raw(port, client_id, **kwargs))
        return made[-1]

    yield make
    for raw in made:
        raw.sock.close()


def hello(raw: Raw, **fields: Any) -> dict[str, Any]:
    return raw.request({"v": 1, "op": "hello", "req": 1, **fields})


def closed_unanswered(sock: socket.socket) -> bool:
    """The broker closes ``sock`` without sending anything first."""
    sock.settimeout(WAIT)
    try:
        return sock.recv(64) == b""
    except ConnectionResetError:
        return True


# ------------------------------------------------------------------------------ protocol.md


@pytest.mark.parametrize("req", [True, 1.0, "1", [1]])
def test_a_req_that_is_no_integer_json_true_included_is_malformed_with_op_and_req_null(
    shared: Broker, raws: Callable[..., Raw], req: Any
) -> None:
    """protocol.md, Replies: `malformed` for `req` neither an integer nor absent; such a request is
    answered with `op` and `req` null. JSON's true is no integer (whatever Python makes of it)."""
    reply = raws(shared.port, "d4-req").request({"v": 1, "op": "hello", "req": req})
    assert (reply["op"], reply["req"], reply["ok"], reply["error"]["code"]) == (None, None, False, "malformed")


@pytest.mark.parametrize("value", [True, False, "5", [5], {"s": 5}])
def test_a_hello_session_expiry_that_is_no_number_is_malformed_and_names_the_field(
    shared: Broker, raws: Callable[..., Raw], value: Any
) -> None:
    """protocol.md: `session_expiry` (seconds, optional: a finite number >= 0, else `malformed`); a
    refusal echoes `req` and `op`. JSON's true and false are no numbers of seconds."""
    raw = raws(shared.port, "d4-expiry")
    reply = raw.request({"v": 1, "op": "hello", "req": 9, "session_expiry": value})
    assert (reply["op"], reply["req"], reply["ok"], reply["error"]["code"]) == ("hello", 9, False, "malformed")
    assert "session_expiry" in reply["error"]["message"]
    assert hello(raw, session_expiry=7)["session_expiry"] == 7  # the connection still serves


@pytest.mark.parametrize(
    ("request_", "code"),
    [
        ({"op": "hello", "req": 3}, "unsupported_version"),
        ({"v": 2, "op": "hello", "req": 3}, "unsupported_version"),
        ({"v": "1", "op": "ready", "req": 3}, "unsupported_version"),
        ({"v": 1, "op": "Hello", "req": 3}, "unknown_op"),
        ({"v": 1, "req": 3}, "unknown_op"),
    ],
)
def test_version_and_op_refusals_echo_req_and_op_only_when_it_names_a_known_op(
    shared: Broker, raws: Callable[..., Raw], request_: dict[str, Any], code: str
) -> None:
    """protocol.md: `v` missing or not the integer 1 is `unsupported_version`; `op` missing or another
    value is `unknown_op`; a refusal echoes `req`, and `op` when it names a known op (null for `unknown_op`)."""
    reply = raws(shared.port, "d4-version").request(request_)
    assert reply["error"]["code"] == code
    assert reply["req"] == 3
    assert reply["op"] == (request_.get("op") if code != "unknown_op" else None)


def test_invalid_filters_of_a_subscribe_get_0x80_and_only_the_granted_ones_are_the_sessions(
    shared: Broker, raws: Callable[..., Raw]
) -> None:
    """guarantees.md: an invalid topic filter gets 0x80 (empty, `#` other than as the whole last level,
    `+` other than as a whole level); the other filters are granted and the connection stays up.
    protocol.md: the `hello` reply's `subscriptions` are the {filter: qos} the session holds."""
    filters = {"": 0x80, "a/#/b": 0x80, "a+": 0x80, "a/b#": 0x80, "s/t+": 0x80, "+": 1, "#": 2, "x/+/y": 0, "+/+": 1}
    sock = raw_connect(shared.port, "d4-filters", clean=False)
    body = b"\x00\x07" + b"".join(
        mqtt_string(f) + bytes((min(code, 2) if code != 0x80 else 1,)) for f, code in filters.items()
    )
    sock.sendall(mqtt_packet(0x82, body))
    first, suback = read_packet(sock)
    assert (first, suback[:2]) == (0x90, b"\x00\x07")
    assert list(suback[2:]) == list(filters.values())
    sock.sendall(b"\xc0\x00")
    assert read_packet(sock) == (0xD0, b"")
    sock.close()
    raw = raws(shared.port, "d4-filters")
    assert hello(raw)["subscriptions"] == {f: code for f, code in filters.items() if code != 0x80}


@pytest.mark.parametrize("bad_qos", [3, 0x41, 0x80])
def test_a_subscribe_with_one_requested_qos_out_of_range_is_closed_and_grants_none_of_its_filters(
    shared: Broker, raws: Callable[..., Raw], bad_qos: int
) -> None:
    """guarantees.md: a SUBSCRIBE whose requested QoS byte is anything but 0, 1 or 2 (QoS 3, or any of
    its reserved upper six bits set) closes the connection with no SUBACK and nothing granted, and a
    WARNING naming the client; the valid filter before it in the packet is not granted either."""
    client_id = f"d4-badqos-{bad_qos}"
    sock = raw_connect(shared.port, client_id, clean=False)
    sock.sendall(
        mqtt_packet(0x82, b"\x00\x05" + mqtt_string("ok/1") + b"\x01" + mqtt_string("ok/2") + bytes((bad_qos,)))
    )
    assert closed_unanswered(sock)
    sock.close()
    assert hello(raws(shared.port, client_id))["subscriptions"] == {}
    assert shared.wait_until(
        lambda: any(client_id in line and "WARNING" in line for line in shared.log().splitlines()), WAIT
    )


def test_a_hello_session_expiry_of_0_ends_the_session_at_its_disconnect(
    shared: Broker, raws: Callable[..., Raw], clients: Callable[..., Client]
) -> None:
    """protocol.md: `hello` sets the session's expiry override (granted in the reply). guarantees.md,
    Expiry: `session_expiry: 0` deletes a session as soon as it disconnects, with the WARNING and the
    `$SYS/broker/durable/expired` event; a client that returns is a new client (session_present=0)."""
    watcher = clients(shared.port, "d4-watch0", clean_session=True)
    watcher.subscribe(EXPIRED, 1)
    raw = raws(shared.port, "d4-zero")
    reply = hello(raw, session_expiry=0)
    assert reply["ok"] and reply["session_expiry"] == 0
    raw_subscribe(raw.sock, "zero/#", 1)
    raw.close()
    assert watcher.wait_for(lambda ms: any(json.loads(m.payload)["client_id"] == "d4-zero" for m in ms))
    assert "durable session d4-zero expired after 0 s disconnected: 0 queued message(s)" in shared.log()
    sock = socket.create_connection((HOST, shared.port), timeout=WAIT)
    sock.sendall(connect_packet("d4-zero", clean=False))
    assert read_exactly(sock, 4) == b"\x20\x02\x00\x00"
    sock.close()


def test_stream_info_names_the_same_store_across_a_restart_and_a_new_one_for_a_new_store(
    broker_factory: Callable[..., Broker], raws: Callable[..., Raw], tmp_path: Path
) -> None:
    """protocol.md, `stream_info`: `store` is the store's id, a random number made with the store (a
    reader that sees it change knows the store was wiped or replaced); `filter` defaults to `#`."""
    broker = broker_factory(streams=[{"filter": "log4/#"}])
    first = raws(broker.port, "d4-info").request({"v": 1, "op": "stream_info"})
    assert first["ok"] and first["filter"] == "#" and isinstance(first["store"], int)
    broker.restart(kill=True)
    again = raws(broker.port, "d4-info").request({"v": 1, "op": "stream_info"})
    assert again["store"] == first["store"]
    other = broker_factory(name="other", streams=[{"filter": "log4/#"}])
    assert raws(other.port, "d4-info").request({"v": 1, "op": "stream_info"})["store"] != first["store"]


def test_a_request_holding_an_integer_past_4300_digits_is_malformed_with_op_and_req_null(
    shared: Broker, raws: Callable[..., Raw]
) -> None:
    """protocol.md, Replies: `malformed` for a request holding an integer written with more than 4300
    digits, in any field, one the op ignores too (`request holds an integer of <n> digits; the limit is
    4300`), answered with `op` and `req` null; `req` up to that is echoed exactly, and the connection
    stays up. (The parser's error said `not UTF-8 JSON` and named a Python setting.)"""
    raw = raws(shared.port, "d4-digits")
    longest = "9" * 4300
    reply = raw.request(f'{{"v": 1, "op": "hello", "req": {longest}}}'.encode())
    assert reply["ok"] and reply["req"] == int(longest)
    for body, digits in (
        (f'{{"v": 1, "op": "hello", "req": {longest}1}}', 4301),
        (f'{{"v": 1, "op": "hello", "req": 3, "session_expiry": {"1" * 5000}}}', 5000),
        (f'{{"v": 1, "op": "hello", "req": 3, "ignored": [-{"2" * 4301}]}}', 4301),
    ):
        reply = raw.request(body.encode())
        assert (reply["op"], reply["req"], reply["error"]["code"]) == (None, None, "malformed")
        assert reply["error"]["message"] == f"request holds an integer of {digits} digits; the limit is 4300"
    assert hello(raw)["ok"]


@pytest.mark.parametrize(("interpreter", "limit"), [("0", 4300), ("640", 640), ("10000", 4300)])
def test_the_digit_limit_holds_whatever_the_brokers_python_converts(
    broker_factory: Callable[..., Broker],
    raws: Callable[..., Raw],
    monkeypatch: pytest.MonkeyPatch,
    interpreter: str,
    limit: int,
) -> None:
    """protocol.md: a request holding an integer of more than 4300 digits (or the broker's Python's lower
    limit) is `malformed` (`request holds an integer of <n> digits; the limit is <limit>`): with
    PYTHONINTMAXSTRDIGITS=0 (Python's own limit off) the broker counts the digits itself (it took them),
    with 640 it names 640 (the parser's error said `not UTF-8 JSON`). The connection stays up."""
    monkeypatch.setenv("PYTHONINTMAXSTRDIGITS", interpreter)  # the broker's process inherits it
    broker = broker_factory()
    raw = raws(broker.port, "d4-digits-env")
    reply = raw.request(f'{{"v": 1, "op": "hello", "req": 3, "session_expiry": {"1" * (limit + 1)}}}'.encode())
    assert (reply["op"], reply["req"], reply["error"]["code"]) == (None, None, "malformed"), reply
    assert reply["error"]["message"] == f"request holds an integer of {limit + 1} digits; the limit is {limit}"
    assert hello(raw)["ok"]


def test_the_stream_window_holds_per_topic_and_an_ack_refills_only_its_own_topic(
    shared: Broker, raws: Callable[..., Raw]
) -> None:
    """protocol.md, Streams: the broker sends events at most `window` unacknowledged per topic; an ack
    (cumulative) releases that topic's ids up to it and the broker fills the window again at once."""
    publisher = raws(shared.port, "d4-win-pub", clean=True)
    for n in range(1, 6):
        publisher.publish("log4/win/a", f"a{n}".encode())
        publisher.publish("log4/win/b", f"b{n}".encode())
    reader = raws(shared.port, "d4-win", clean=True)
    reply = reader.request({"v": 1, "op": "stream_subscribe", "req": 1, "filter": "log4/win/+", "window": 2})
    assert reply["topics"] == {"log4/win/a": {"first": 1, "last": 5}, "log4/win/b": {"first": 1, "last": 5}}
    assert [e[1:] for e in reader.stream_events("log4/win/a", 2)] == [(1, b"a1"), (2, b"a2")]
    assert [e[1:] for e in reader.stream_events("log4/win/b", 2)] == [(1, b"b1"), (2, b"b2")]
    reader.send({"v": 1, "op": "stream_ack", "topic": "log4/win/a", "id": 2})
    assert [e[1:] for e in reader.stream_events("log4/win/a", 2)] == [(3, b"a3"), (4, b"a4")]
    assert reader.alive()  # a PINGREQ's answer: what the broker sent before it is read
    assert reader.kept_stream_events("log4/win/b") == [], "b's window is still full: nothing more of b"


# ------------------------------------------------------------------------------ restarts


def test_a_hello_expiry_override_holds_for_a_session_connected_at_a_crash(
    broker_factory: Callable[..., Broker], raws: Callable[..., Raw]
) -> None:
    """guarantees.md, Expiry: a session connected when the broker stopped (a crash alike) gets its
    deadline counted from the restart; protocol.md: its `hello` set its expiry override (2 s here,
    the broker's `session_expiry` 300), remembered with the session, so it expires 2 s after the restart."""
    broker = broker_factory(session_expiry=300)
    raw = raws(broker.port, "d4-short")
    assert hello(raw, session_expiry=2)["session_expiry"] == 2
    broker.restart(kill=True)
    started = time.monotonic()
    line = "durable session d4-short expired after 2 s disconnected"
    assert broker.wait_until(lambda: line in broker.log(), WAIT)
    assert time.monotonic() - started < 12


def test_an_sdk_session_stays_one_across_a_crash_without_a_new_hello(
    broker_factory: Callable[..., Broker], raws: Callable[..., Raw]
) -> None:
    """protocol.md: the `hello` is remembered with the session: an SDK session stays one until it ends
    (its messages held until `ready`, framed, then a marker). After a SIGKILL, a reconnect that sends
    no `hello` still gets nothing before `ready`, then the queued message framed as replayed, then the marker."""
    broker = broker_factory()
    raw = raws(broker.port, "d4-sdk")
    epoch = hello(raw)["epoch"]
    raw_subscribe(raw.sock, "held/#", 1)
    raw.close()
    broker.restart(kill=True)
    raws(broker.port, "d4-pub", clean=True).publish("held/1", b"payload")
    sock = socket.create_connection((HOST, broker.port), timeout=WAIT)
    sock.sendall(connect_packet("d4-sdk", clean=False))
    assert read_exactly(sock, 4) == b"\x20\x02\x01\x00"
    sock.sendall(b"\xc0\x00")  # a PINGRESP before any PUBLISH: nothing was sent before ready
    assert read_packet(sock) == (0xD0, b"")
    sock.sendall(mqtt_packet(0x30, mqtt_string(CTL) + json.dumps({"v": 1, "op": "ready", "req": 4}).encode()))
    seen: list[tuple[str, bytes]] = []
    while len(seen) < 3:
        first, body = read_packet(sock)
        assert first >> 4 == 3
        length = int.from_bytes(body[:2], "big")
        topic, rest = body[2 : 2 + length].decode(), body[2 + length :]
        if first & 0x06:
            sock.sendall(b"\x40\x02" + rest[:2])
            rest = rest[2:]
        seen.append((topic, rest))
    assert [topic for topic, _ in seen] == [REPLY, "held/1", "$durable/v1/marker"]
    frame = seen[1][1]
    assert frame[0] == 1 and frame[1] & 0x01 and int.from_bytes(frame[2:10], "big") == epoch
    assert frame[26:] == b"payload"
    marker = json.loads(seen[2][1])
    assert (marker["epoch"], marker["replayed"]) == (epoch, 1)
    assert marker["first_seq"] == marker["last_seq"] == int.from_bytes(frame[10:18], "big")
    sock.close()


# ------------------------------------------------------------------------------ sdk.md


@pytest.mark.parametrize("option", ["reconnect_min_delay", "reconnect_max_delay"])
def test_reconnect_delays_reach_threading_timeout_max_and_no_further(option: str) -> None:
    """sdk.md, Bad input: `reconnect_min_delay` and `reconnect_max_delay` finite numbers of seconds
    above 0 and at most `threading.TIMEOUT_MAX` (as every `timeout`); a bad value raises `ValueError`
    whose message starts with the option's name."""
    DurableClient("d4-delays", reconnect_min_delay=threading.TIMEOUT_MAX, reconnect_max_delay=threading.TIMEOUT_MAX)
    with pytest.raises(ValueError, match=f"^{option}"):
        DurableClient("d4-delays", **{option: threading.TIMEOUT_MAX * 2})
    with pytest.raises(ValueError, match=f"^{option}"):
        DurableClient("d4-delays", **{option: 0})


# ------------------------------------------------------------------------------ operations.md


def test_a_backup_copied_into_an_empty_store_folder_is_refused_naming_the_path_and_changes_nothing(
    broker_factory: Callable[..., Broker], tmp_path: Path
) -> None:
    """operations.md, Backing up: a backup copied *into* an existing empty folder
    (`data/durable/durable-1`) or `store` pointed at the folder above the store: `store folder '...'
    holds files (...) but no LevelDB store`, exit code 1, and nothing changes (broker and `inspect`;
    `repair` of a folder without LevelDB files says `no store at '...'`)."""
    original = broker_factory()
    sock = raw_connect(original.port, "d4-backup", clean=False)
    raw_subscribe(sock, "bk/#", 1)
    sock.close()
    original.stop()
    store = tmp_path / "data" / "durable"
    store.mkdir(parents=True)
    shutil.copytree(original.store, store / "durable-1")
    copied = sorted(p.name for p in (store / "durable-1").iterdir())
    wrong = broker_factory(start=False, name="wrong")
    wrong.settings["store"] = str(store)
    with pytest.raises(AssertionError, match="broker exited with 1"):
        wrong.start()
    refusal = f"store folder '{store}' holds files (durable-1) but no LevelDB store"
    assert refusal in wrong.log()
    shown = run_cli("inspect", str(store))
    assert (shown.returncode, refusal in shown.stderr) == (1, True), shown.stderr
    above = run_cli("inspect", str(store.parent))
    assert (
        above.returncode == 1
        and f"store folder '{store.parent}' holds files (durable) but no LevelDB store" in above.stderr
    )
    repaired = run_cli("repair", str(store))
    assert repaired.returncode == 1 and f"no store at '{store}'" in repaired.stderr, repaired.stderr
    assert [p.name for p in store.iterdir()] == ["durable-1"]
    assert sorted(p.name for p in (store / "durable-1").iterdir()) == copied
    listed = run_cli("inspect", str(store / "durable-1"), "--json")
    assert [row["client_id"] for row in json.loads(listed.stdout)] == ["d4-backup"]


def newest(messages: list[Any], names: set[str]) -> dict[str, int]:
    prefix = "$SYS/broker/durable/"
    return {m.topic.removeprefix(prefix): int(m.payload) for m in messages if m.topic.removeprefix(prefix) in names}


def metrics_settle(client: Client, expected: dict[str, int]) -> None:
    """Wait (bounded by WAIT) until the newest value of each metric in ``expected`` is the one given."""
    settled = client.wait_for(lambda ms: newest(ms, set(expected)) == expected)
    assert settled, newest(client.messages, set(expected))


def test_after_a_crash_the_counters_start_at_0_and_the_gauges_are_the_stores(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """operations.md, Metrics: counters (`messages/enqueued`, `messages/dropped`, ...) restart at 0 with
    the broker; `messages/queued` and `bytes/queued` are what the queues hold now, `sessions/connected` /
    `disconnected` the durable sessions with and without a connection now, and `retained/messages`
    the same count after a restart."""
    broker = broker_factory(metrics_interval=0.2, max_depth=2, max_depth_disconnected=2)
    away = clients(broker.port, "d4-m-away")
    away.subscribe("d4m/#", 1)
    away.disconnect()
    here = clients(broker.port, "d4-m-here")
    here.subscribe("d4other/#", 1)  # connected, matching nothing: no queue its pump races with the limit
    publisher = clients(broker.port, "d4-m-pub", clean_session=True)
    publisher.publish("d4m/t", [b"1", b"22", b"333"])
    publisher.publish("d4m/r", [b"r"], retain=True)
    watcher = clients(broker.port, "d4-m-watch", clean_session=True)
    watcher.subscribe("$SYS/broker/durable/#", 0)
    # d4-m-away keeps b"333" and b"r" (two dropped by its limit of 2)
    metrics_settle(watcher, {
        "messages/enqueued": 4, "messages/dropped": 2, "messages/queued": 2, "bytes/queued": 4,
        "retained/messages": 1, "sessions/connected": 1, "sessions/disconnected": 1,
    })  # fmt: skip
    broker.restart(kill=True)
    watcher = clients(broker.port, "d4-m-watch2", clean_session=True)
    watcher.subscribe("$SYS/broker/durable/#", 0)
    metrics_settle(watcher, {
        "messages/enqueued": 0, "messages/dropped": 0,
        "messages/queued": 2, "bytes/queued": 4, "retained/messages": 1,
        "sessions/connected": 0, "sessions/disconnected": 2,
    })  # fmt: skip


def connect_with_will(port: int, client_id: str, topic: str, payload: bytes) -> socket.socket:
    """A clean CONNECT with a QoS 1 retained will on ``topic``; returns the socket once CONNACK accepted it."""
    flags = 0x02 | 0x04 | 1 << 3 | 0x20
    body = mqtt_string("MQTT") + bytes((4, flags)) + (60).to_bytes(2, "big") + mqtt_string(client_id)
    sock = socket.create_connection((HOST, port), timeout=WAIT)
    sock.sendall(mqtt_packet(0x10, body + mqtt_string(topic) + mqtt_string(payload)))
    assert read_exactly(sock, 4) == b"\x20\x02\x00\x00"
    return sock


def test_a_will_under_durable_is_never_routed_retained_queued_or_logged(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], raws: Callable[..., Raw]
) -> None:
    """protocol.md, Topics: nothing under `_durable/` is routed, retained or queued, so no subscriber
    (not even one to `#`) receives control traffic; guarantees.md: nothing under `_durable/` is ever
    retained. A will on `_durable/v1/ctl` (holding an `end_session` request) or `_durable/x` is not
    delivered, retained, logged in a stream of `#`, nor acted on for the subscriber's session."""
    broker = broker_factory(streams=[{"filter": "#"}])
    clean = clients(broker.port, "d4-w-clean", clean_session=True)
    assert clean.subscribe([("#", 1), ("_durable/#", 1)]) == [1, 1]
    durable = clients(broker.port, "d4-w-durable")
    assert durable.subscribe([("#", 1), ("_durable/#", 1)]) == [1, 1]
    request = json.dumps({"v": 1, "op": "end_session", "req": 5}).encode()
    dying = [connect_with_will(broker.port, f"d4-w-{n}", topic, request) for n, topic in enumerate(CONTROL_WILLS)]
    dying.append(connect_with_will(broker.port, "d4-w-last", "w4/sentinel", b"last"))
    for sock in dying:
        sock.close()
    for subscriber in (clean, durable):
        assert subscriber.wait_for(lambda ms: any(m.topic == "w4/sentinel" for m in ms))
        assert [m.topic for m in subscriber.messages] == ["w4/sentinel"]
    late = clients(broker.port, "d4-w-late", clean_session=True)
    assert late.subscribe([("_durable/#", 1), ("w4/#", 1)]) == [1, 1]
    assert late.wait_for(lambda ms: len(ms) > 0)
    assert [(m.topic, m.retain) for m in late.messages] == [("w4/sentinel", True)]
    info = raws(broker.port, "d4-w-info").request({"v": 1, "op": "stream_info"})
    assert list(info["topics"]) == ["w4/sentinel"]
    durable.disconnect()
    assert durable.connect() is True, "the durable subscriber's session was not ended"


def test_a_replayed_frame_and_a_stream_event_keep_their_publish_time_across_a_crash(
    broker_factory: Callable[..., Broker], raws: Callable[..., Raw]
) -> None:
    """protocol.md, Frames: offset 18, f64, the publish time, Unix seconds, as the broker received it
    (the message's, and a stream event's, not when it is sent, also after a SIGKILL and restart)."""
    broker = broker_factory(streams=[{"filter": "pt/#"}])
    raw = raws(broker.port, "d4-ptime")
    hello(raw)
    raw_subscribe(raw.sock, "pt/#", 1)
    raw.close()
    before = time.time()
    raws(broker.port, "d4-ptime-pub", clean=True).publish("pt/a", b"then")
    after = time.time()
    broker.restart(kill=True)
    assert time.time() > after + 0.1, "the restart took time: a send time would be past the publish's"
    reader = raws(broker.port, "d4-ptime")
    reader.request({"v": 1, "op": "ready", "req": 2})
    _topic, frame = reader.take(lambda topic, _payload: topic == "pt/a")
    assert frame[26:] == b"then" and frame[1] & 0x01
    assert before - 0.01 <= struct.unpack(">d", frame[18:26])[0] <= after + 0.01
    reader.send({"v": 1, "op": "stream_subscribe", "req": 3, "filter": "pt/#"})
    _topic, event = reader.take(lambda topic, _payload: topic == "$durable/v1/stream/pt/a")
    assert event[26:] == b"then" and int.from_bytes(event[2:10], "big") == 0
    assert before - 0.01 <= struct.unpack(">d", event[18:26])[0] <= after + 0.01


def test_an_integer_too_long_to_write_is_refused_naming_the_option_or_argument() -> None:
    """sdk.md, Bad input: a bad value raises `ValueError` whose message starts with the option's or
    argument's name; streams.md: each `after` id a whole number of 0 or more written with at most 4300
    digits (else `ValueError`), refused at the call, not when the reconnect sends it (it broke the
    network thread, and `connect()` failed as if no broker answered)."""
    with pytest.raises(ValueError, match=r"^port must be a whole number from 1 to 65535, got an integer of \d+ bits"):
        DurableClient("d4-long", port=10**5000)
    client = DurableClient("d4-long")
    with pytest.raises(ValueError, match=r"^after: the id of 't/a' must be .* of at most 4300 digits"):
        client.subscribe_stream("t/#", lambda _event: None, after={"t/a": 10**4300})
    client.subscribe_stream("t/#", lambda _event: None, after={"t/a": 10**4299})


@pytest.mark.parametrize(("interpreter", "limit"), [(0, 4300), (640, 640), (10000, 4300)])
def test_the_sdk_refuses_an_id_past_the_digit_limit_whatever_python_writes(interpreter: int, limit: int) -> None:
    """streams.md: each `after` id "written with at most 4300 digits (else `ValueError`)"; sdk.md: a bad value's
    message starts with its name, a long integer shown as its size in bits. In a process whose Python writes
    integers of any length (0) the SDK counts the digits itself (it took them, and sent what the broker
    refuses); under a lower limit (640) it names that one, and a port past it is still refused by name
    (the message was Python's own "Exceeds the limit")."""
    client = DurableClient("d4-long-any")
    before = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(interpreter)
    try:
        with pytest.raises(ValueError, match=rf"^after: the id of 't/a' must be .* of at most {limit} digits"):
            client.subscribe_stream("t/#", lambda _event: None, after={"t/a": 10**limit})
        port_refused = r"^port must be a whole number from 1 to 65535, got an integer of \d+ bits"
        with pytest.raises(ValueError, match=port_refused):
            DurableClient("d4-long-port", port=10**limit)
    finally:
        sys.set_int_max_str_digits(before)


def test_inspect_retained_escapes_topics_and_orders_them_as_sent(broker_factory: Callable[..., Broker]) -> None:
    """operations.md, inspect: a topic shows a backslash and each character that is not printable
    (`str.isprintable()`) escaped as in a Python string, spaces, commas and `@` as they are; rows in
    topic order (code points, as sent, not as escaped: U+0001 before `A`); columns as wide as their
    widest cell in characters of the escaped text, two spaces between; `--json` gives topics as they are."""
    broker = broker_factory()
    publisher = raw_connect(broker.port, "d4-retained-pub", clean=True)
    topics = ["r/A", "r/\x01", "r/\n", "r/é", "r/\u200d", "r/a b,c@d", "r/\U0001f600", "r/\uffef"]
    for topic in topics:
        publisher.sendall(mqtt_packet(0x31, mqtt_string(topic) + b"v"))  # QoS 0, retained
    publisher.sendall(b"\xc0\x00")
    assert read_packet(publisher) == (0xD0, b""), "the PUBLISHes before the PINGREQ are handled"
    publisher.close()
    broker.stop()
    shown = run_cli("inspect", broker.store, "--retained")
    assert shown.returncode == 0, shown.stderr
    escaped = ["r/\\x01", "r/\\n", "r/A", "r/a b,c@d", "r/é", "r/\\u200d", "r/\\uffef", "r/\U0001f600"]
    width = max(len(topic) for topic in escaped)
    lines = shown.stdout.splitlines()
    assert lines[0] == "TOPIC".ljust(width) + "  QOS  BYTES  AGE"
    assert len(lines) == 10 and lines[-1] == "8 retained message(s)", shown.stdout
    for topic, line in zip(escaped, lines[1:-1], strict=True):
        assert re.fullmatch(re.escape(f"{topic.ljust(width)}  0    1      ") + r"\d+s", line), (topic, line)
    listed = run_cli("inspect", broker.store, "--retained", "--json")
    assert [row["topic"] for row in json.loads(listed.stdout)] == sorted(topics)
