"""Black-box checks of promises in README.md and docs/*.md, written from the documents alone
(the hidden tester's view): real broker processes, real paho clients and raw sockets over TCP."""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
import yaml
from raw_mqtt_helpers import connect_packet, raw_connect, read_exactly, read_packet

from amqtt_durable.process import ChildProcess
from conftest import HOST, WAIT, Broker, Client, free_port, mqtt_packet, mqtt_string, payloads, probe_connack, run_cli

CTL = "_durable/v1/ctl"
REPLY = "$durable/v1/reply"
MARKER = "$durable/v1/marker"


# ------------------------------------------------------------------ helpers
def raw_connack(port: int, packet: bytes) -> tuple[bytes, socket.socket]:
    """Send ``packet`` on a new connection; the bytes read back (b'' when closed unanswered) and the socket."""
    sock = socket.create_connection((HOST, port), timeout=WAIT)
    sock.sendall(packet)
    try:
        data = sock.recv(4)
    except ConnectionResetError:
        data = b""
    return data, sock


def read_all(sock: socket.socket) -> bytes:
    """Every byte the broker sends until it closes the connection (bounded by the socket timeout)."""
    received = b""
    try:
        while chunk := sock.recv(4096):
            received += chunk
    except ConnectionResetError:
        pass
    return received


def closed_by_broker(sock: socket.socket) -> bool:
    """True when the broker closes the connection (EOF or reset) before WAIT seconds pass."""
    sock.settimeout(WAIT)
    try:
        while True:
            chunk = sock.recv(4096)
            if not chunk:
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def control(client: Client, request: dict[str, Any]) -> dict[str, Any]:
    """Send one control request (QoS 0) and return its reply (matched by ``req``)."""
    req = request.setdefault("req", 1000 + len(client.messages))
    client.paho.publish(CTL, json.dumps(request), qos=0)
    return reply_for(client, req)


def reply_for(client: Client, req: int | None) -> dict[str, Any]:
    def find(messages: list[mqtt.MQTTMessage]) -> dict[str, Any] | None:
        for message in messages:
            if message.topic == REPLY:
                body = json.loads(message.payload)
                if body.get("req") == req:
                    return body  # type: ignore[no-any-return]
        return None

    assert client.wait_for(lambda ms: find(ms) is not None), f"no reply for req {req}"
    found = find(client.messages)
    assert found is not None
    return found


def frame(payload: bytes) -> tuple[int, int, int, int, float, bytes]:
    """(version, flags, epoch, seq, time, body) of a framed SDK event (docs/protocol.md, Frames)."""
    version, flags, epoch, seq, when = struct.unpack(">BBQQd", payload[:26])
    return version, flags, epoch, seq, when, payload[26:]


def write_config(folder: Path, settings: dict[str, Any] | str, port: int | None = None) -> Path:
    """A broker.yaml with one listener and the plugin's ``settings`` (a mapping, or YAML text of the plugin's body)."""
    port = port if port is not None else free_port()
    if isinstance(settings, str):
        text = (
            f"listeners:\n  default:\n    type: tcp\n    bind: {HOST}:{port}\n"
            "plugins:\n  amqtt.plugins.authentication.AnonymousAuthPlugin:\n    allow_anonymous: true\n"
            "  amqtt_durable.DurableSessionsPlugin:\n" + settings
        )
    else:
        config = {
            "listeners": {"default": {"type": "tcp", "bind": f"{HOST}:{port}"}},
            "plugins": {
                "amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True},
                "amqtt_durable.DurableSessionsPlugin": {"store": str(folder / "store"), **settings},
            },
        }
        text = yaml.safe_dump(config)
    path = folder / "broker.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def inspect_json(store: str) -> list[dict[str, Any]]:
    result = run_cli("inspect", store, "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout)  # type: ignore[no-any-return]


def seen_disconnected(clients: Callable[..., Client], port: int, count: int) -> None:
    """Wait until the broker's metrics (metrics_interval set) count ``count`` disconnected durable
    sessions: a DISCONNECT the broker has not read yet when it stops leaves its session connected."""
    watcher = clients(port, f"watch-{count}", clean_session=True)
    watcher.subscribe("$SYS/broker/durable/sessions/disconnected", 0)
    expected = str(count).encode()
    assert watcher.wait_for(lambda ms: any(m.payload == expected for m in ms)), "the broker saw the disconnect"
    watcher.disconnect()


# ------------------------------------------------------------------ CONNECT and session_present
# ------------------------------------------------------------------ message path
def test_recovery_buffer_default_is_an_in_flight_window_of_100(
    either_reader: Broker, clients: Callable[..., Client]
) -> None:
    """docs/configuration.md `recovery_buffer` default `100`: "also the in-flight window";
    docs/guarantees.md "at most that many QoS 1/2 messages are sent and not yet acknowledged";
    docs/guarantees.md "a full window of 32 or more refills a quarter at a time"."""
    broker = either_reader
    device = clients(broker.port, "win-dev", manual_ack=True)
    device.subscribe("win/t", 1)
    device.drop()
    clients(broker.port, "win-pub", clean_session=True).publish("win/t", payloads(150), qos=1)
    again = clients(broker.port, "win-dev", manual_ack=True)
    assert len(again.wait_messages(100)) >= 100
    assert not again.wait_for(lambda ms: len(ms) > 100, timeout=1.0), "more than 100 in flight"
    for message in again.messages[:24]:
        again.paho.ack(message.mid, message.qos)
    assert not again.wait_for(lambda ms: len(ms) > 100, timeout=1.0), "a full window refills a quarter at a time"
    again.paho.ack(again.messages[24].mid, again.messages[24].qos)
    assert again.wait_for(lambda ms: len(ms) >= 125)
    assert not again.wait_for(lambda ms: len(ms) > 125, timeout=0.5)
    assert [m.payload for m in again.messages] == payloads(125)


def test_default_subscription_limit_is_1000(broker: Broker, clients: Callable[..., Client]) -> None:
    """docs/configuration.md: `max_subscriptions_per_client` default `1000`."""
    client = clients(broker.port, "lim1000", clean_session=True)
    filters = [(f"d/{i}", 0) for i in range(1001)]
    codes = client.subscribe(filters)
    assert codes[:1000] == [0] * 1000 and codes[1000] == 0x80


@pytest.mark.parametrize(
    "will_topic", [b"$SYS/x", b"", b"w/+", b"w/#", b"w/\x00"], ids=["dollar", "empty", "plus", "hash", "nul"]
)
def test_a_connect_with_an_invalid_will_topic_is_closed_without_connack(
    shared_reader: Broker, case_tag: str, will_topic: bytes
) -> None:
    """docs/guarantees.md: "A CONNECT whose will topic is empty, holds `+`, `#` or U+0000, or
    starts with `$` ... is refused: the connection is closed without a CONNACK"."""
    broker = shared_reader
    sock = socket.create_connection((HOST, broker.port), timeout=WAIT)
    with sock:
        sock.sendall(connect_packet(f"will-bad-{case_tag}", clean=False, will_topic=will_topic))
        assert read_all(sock) == b""
    probe = raw_connect(broker.port, f"will-bad-{case_tag}", clean=False)  # nothing of the refused CONNECT was kept
    with probe:
        pass


# ------------------------------------------------------------------ QoS 2
# ------------------------------------------------------------------ expiry and $SYS
# ------------------------------------------------------------------ control protocol
def test_control_hello_reply_fields_and_cap(either_reader: Broker, clients: Callable[..., Client]) -> None:
    """docs/protocol.md hello: "Reply: `protocol`, `epoch` ..., `session_expiry` (granted, null for
    the broker default ...), `subscriptions` (... {filter: qos} the session holds)" and
    docs/configuration.md `max_session_expiry` default 604800: "longer asks are capped"."""
    broker = either_reader
    client = clients(broker.port, "hello-dev")
    client.subscribe("h/#", 1)
    reply = control(client, {"v": 1, "op": "hello", "req": 7, "session_expiry": 10_000_000})
    assert reply["op"] == "hello" and reply["ok"] is True and reply["protocol"] == 1
    assert isinstance(reply["epoch"], int)
    assert reply["session_expiry"] == 604800
    assert reply["subscriptions"] == {"h/#": 1}
    reply = control(client, {"v": 1, "op": "hello", "req": 8})
    assert reply["session_expiry"] is None


# ------------------------------------------------------------------ the command line
def test_inspect_usage_errors_exit_2(tmp_path: Path) -> None:
    """docs/operations.md: "It takes a store folder or `--replication HOST:PORT`: neither, both,
    or `--retained` with `--replication` is a usage error (exit code 2)"."""
    store = str(tmp_path / "s")
    assert run_cli("inspect").returncode == 2
    assert run_cli("inspect", store, "--replication", "127.0.0.1:7883").returncode == 2
    assert run_cli("inspect", "--retained", "--replication", "127.0.0.1:7883").returncode == 2


def test_config_store_relative_path_from_cwd(tmp_path: Path) -> None:
    """docs/configuration.md: "A relative path is taken from the folder the broker is started in,
    not the config file's"."""
    conf_dir = tmp_path / "conf"
    conf_dir.mkdir()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    port = free_port()
    path = write_config(conf_dir, "    store: ./rel-store\n", port=port)
    broker = ChildProcess([sys.executable, "-m", "durable_fleet.console", "broker", "-c", str(path)],
                          tmp_path / "rel.log", preexec_fn=lambda: os.chdir(run_dir))
    broker.start()
    try:
        assert broker.wait_until(lambda: probe_connack(port), WAIT), "broker not ready"
        assert (run_dir / "rel-store" / "CURRENT").exists()
        assert not (conf_dir / "rel-store").exists()
    finally:
        broker.stop()


def test_a_config_naming_max_qos_is_refused(tmp_path: Path) -> None:
    """docs/configuration.md: "amqtt 0.12.1 has no `max-qos` ...: a config naming it is refused
    (`amqtt-durable: broker not started: can not match "max-qos" to any data class field`, exit code 1)"."""
    path = write_config(tmp_path, {})
    path.write_text(path.read_text(encoding="utf-8") + "max-qos: 1\n", encoding="utf-8")
    result = run_cli("broker", "-c", str(path), cwd=tmp_path)
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        'amqtt-durable: broker not started: can not match "max-qos" to any data class field'
    ), result.stderr[-3000:]

# ------------------------------------------------------------------ second batch: less travelled promises
def test_hello_session_expiry_override_is_the_stored_deadline(broker: Broker, clients: Callable[..., Client]) -> None:
    """docs/protocol.md: hello "sets its expiry override, capped by the broker's
    `max_session_expiry`; a `hello` without `session_expiry` removes the override"; the deadline is
    stored (docs/guarantees.md) and shown by inspect (`expires_at`)."""
    broker.stop()
    broker.settings["metrics_interval"] = 1
    broker.start()
    device = clients(broker.port, "ovr-dev")
    reply = control(device, {"v": 1, "op": "hello", "req": 1, "session_expiry": 5000})
    assert reply["session_expiry"] == 5000
    device.disconnect()
    seen_disconnected(clients, broker.port, 1)
    broker.stop()
    [row] = inspect_json(broker.store)
    assert row["expires_at"] - row["disconnected_at"] == pytest.approx(5000, abs=1)


def test_plain_durable_session_ready_gets_an_unframed_replay_and_a_marker(
    either_reader: Broker, clients: Callable[..., Client]
) -> None:
    """docs/protocol.md: "A session that never said `hello` gets the marker too (its events
    unframed)"; :91 "Without a `hello`, a durable session is a plain MQTT session: no frames, no hold"."""
    broker = either_reader
    device = clients(broker.port, "plain-dev")
    device.subscribe("plain/t", 1)
    device.drop()
    clients(broker.port, "plain-pub", clean_session=True).publish("plain/t", [b"raw"], qos=1)
    again = clients(broker.port, "plain-dev")
    assert again.wait_for(lambda ms: any(m.topic == "plain/t" for m in ms)), "no hold without hello"
    assert [m.payload for m in again.messages if m.topic == "plain/t"] == [b"raw"]
    reply = control(again, {"v": 1, "op": "ready", "req": 1})
    assert reply["ok"] is True
    assert again.wait_for(lambda ms: any(m.topic == MARKER for m in ms))


def test_brand_new_sdk_session_marker_has_replayed_0_and_null_seqs(
    either_reader: Broker, clients: Callable[..., Client]
) -> None:
    """docs/protocol.md: "`first_seq` / `last_seq` are their sequence ids (null when none) ...
    A brand-new session gets a marker too, with `replayed: 0`"; after the marker, live events are
    framed without the `replayed` flag (:35)."""
    broker = either_reader
    device = clients(broker.port, "new-sdk")
    hello = control(device, {"v": 1, "op": "hello", "req": 1})
    assert device.subscribe("new/t", 1) == [1]
    control(device, {"v": 1, "op": "ready", "req": 2})
    assert device.wait_for(lambda ms: any(m.topic == MARKER for m in ms))
    marker = json.loads(next(m.payload for m in device.messages if m.topic == MARKER))
    assert (marker["replayed"], marker["first_seq"], marker["last_seq"]) == (0, None, None)
    assert marker["epoch"] == hello["epoch"] and marker["v"] == 1
    clients(broker.port, "new-pub", clean_session=True).publish("new/t", [b"live"], qos=1)
    assert device.wait_for(lambda ms: any(m.topic == "new/t" for m in ms))
    [live] = [m for m in device.messages if m.topic == "new/t"]
    version, flags, epoch, _seq, _when, body = frame(live.payload)
    assert (version, flags, epoch, body) == (1, 0, hello["epoch"], b"live")


def stream_broker(broker_factory: Callable[..., Broker], **settings: Any) -> Broker:
    return broker_factory(streams=[{"filter": "log/#", "max_count": 3}], **settings)


def stream_events(client: Client, topic: str) -> list[tuple[int, int, bytes]]:
    """(flags, id, body) of the stream events of ``topic`` received so far."""
    return [
        (frame(m.payload)[1], frame(m.payload)[3], frame(m.payload)[5])
        for m in client.messages
        if m.topic == f"$durable/v1/stream/{topic}"
    ]


def test_stream_ids_retention_gaps_and_info(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """docs/configuration.md "every topic a filter matches gets its own log with ids 1, 2, 3, ...
    kept up to `max_count` events"; docs/protocol.md reply `topics` ({topic: {first, last}}), `gaps`
    ({topic: [first missing id, last missing id]}), :89 `stream_info` `topics` {first, last, count} and
    `store`; :36 epoch 0 for stream events."""
    broker = stream_broker(broker_factory)
    clients(broker.port, "st-pub", clean_session=True).publish("log/a", payloads(5), qos=1)
    reader = clients(broker.port, "st-reader", clean_session=True)
    info = control(reader, {"v": 1, "op": "stream_info", "req": 1, "filter": "log/#"})
    assert info["ok"] is True and info["topics"] == {"log/a": {"first": 3, "last": 5, "count": 3}}
    assert isinstance(info["store"], int)
    reply = control(reader, {"v": 1, "op": "stream_subscribe", "req": 2, "filter": "log/#", "after": {"log/a": 1}})
    assert reply["topics"] == {"log/a": {"first": 3, "last": 5}}
    assert reply["gaps"] == {"log/a": [2, 2]}
    assert reader.wait_for(lambda ms: len(stream_events(reader, "log/a")) >= 1)
    [(flags, first_id, body)] = stream_events(reader, "log/a")
    assert first_id == 3 and body == payloads(5)[2]
    epochs = {frame(m.payload)[2] for m in reader.messages if m.topic.startswith("$durable/v1/stream/")}
    assert epochs == {0}
    assert (flags & 0x18) >> 3 == 1, "bits 3-4 carry the publish QoS"


def test_will_of_dropped_durable_client_queued_for_disconnected_durable_subscriber(
    either_reader: Broker, clients: Callable[..., Client]
) -> None:
    """docs/guarantees.md: "Wills ... reach durable sessions through the same queue"; a client that
    sent DISCONNECT never has its will published (docs/guarantees.md)."""
    broker = either_reader
    sub = clients(broker.port, "wq-sub")
    sub.subscribe("wq/#", 1)
    sub.drop()
    for name, graceful in (("wq-polite", True), ("wq-crash", False)):
        sock = socket.create_connection((HOST, broker.port), timeout=WAIT)
        flags = 0x04 | 0x08  # will, will QoS 1 (a QoS 0 will is not queued for a disconnected session)
        body = mqtt_string("MQTT") + bytes((4, flags)) + (60).to_bytes(2, "big") + mqtt_string(name)
        body += mqtt_string(f"wq/{name}") + mqtt_string("gone")
        sock.sendall(mqtt_packet(0x10, body))
        assert read_exactly(sock, 4)[3] == 0
        if graceful:
            sock.sendall(b"\xe0\x00")
        sock.close()
    clients(broker.port, "wq-pub", clean_session=True).publish("wq/sentinel", [b"sentinel"], qos=1)
    again = clients(broker.port, "wq-sub")
    assert again.wait_for(lambda ms: any(m.payload == b"sentinel" for m in ms))
    assert [(m.topic, m.payload) for m in again.messages] == [("wq/wq-crash", b"gone"), ("wq/sentinel", b"sentinel")]


# ------------------------------------------------------------------ third batch
def test_resubscribe_requeues_retained_but_reconnect_does_not(
    either_reader: Broker, clients: Callable[..., Client]
) -> None:
    """docs/guarantees.md: retained messages matching a new subscription "are queued, with the
    subscription and before any live message it matches ...; they are not sent again on every
    reconnect (MQTT-3.3.1-6)"; docs/protocol.md "a repeated SUBSCRIBE re-queues retained messages,
    MQTT-3.8.4-3"."""
    broker = either_reader
    clients(broker.port, "rr-pub", clean_session=True).publish("rr/t", [b"ret"], qos=1, retain=True)
    device = clients(broker.port, "rr-dev")
    device.subscribe("rr/t", 1)
    assert device.wait_for(lambda ms: len(ms) >= 1)
    device.subscribe("rr/t", 1)
    assert device.wait_for(lambda ms: len(ms) >= 2)
    assert [(m.payload, m.retain) for m in device.messages] == [(b"ret", True), (b"ret", True)]
    device.disconnect()
    again = clients(broker.port, "rr-dev")
    clients(broker.port, "rr-pub2", clean_session=True).publish("rr/t", [b"live"], qos=1)
    assert again.wait_for(lambda ms: any(m.payload == b"live" for m in ms))
    assert [(m.payload, m.retain) for m in again.messages] == [(b"live", False)]


def test_anonymous_owner_refuses_a_named_user(either_reader: Broker, clients: Callable[..., Client]) -> None:
    """docs/guarantees.md: "a session belongs to the user (CONNECT username; none counts as one
    user too) whose CONNECT created it" and owner-only refuses "any other user" with CONNACK 5."""
    broker = either_reader
    clients(broker.port, "anon-owned").disconnect()
    sock = socket.create_connection((HOST, broker.port), timeout=WAIT)
    with sock:
        sock.sendall(connect_packet("anon-owned", clean=False, username="mallory"))
        assert read_exactly(sock, 4) == b"\x20\x02\x00\x05"
    assert clients(broker.port, "anon-owned").session_present is True


def test_unknown_topic_error_cuts_the_topic_to_100_characters(
    either_reader: Broker, clients: Callable[..., Client]
) -> None:
    """docs/protocol.md: "A PUBLISH under `_durable/` other than `_durable/v1/ctl` gets the error
    `unknown_topic` ...; its message, and the broker's log line, show the topic cut to 100
    characters"."""
    broker = either_reader
    topic = "_durable/" + "".join(chr(ord("a") + i % 26) for i in range(191))
    client = clients(broker.port, "cut-dev", clean_session=True)
    client.paho.publish(topic, b"{}", qos=0)
    assert client.wait_for(lambda ms: any(m.topic == REPLY for m in ms))
    reply = json.loads(next(m.payload for m in client.messages if m.topic == REPLY))
    message = reply["error"]["message"]
    assert reply["error"]["code"] == "unknown_topic"
    assert topic[:100] in message and topic[:101] not in message


def test_overflow_warning_at_most_once_per_interval(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """docs/guarantees.md and docs/configuration.md: drops are "logged as a WARNING with the
    count, at most once per `drop_log_interval` seconds per session" (default 10)."""
    broker = broker_factory(max_depth=1, max_depth_disconnected=1)
    device = clients(broker.port, "once-dev")
    device.subscribe("once/t", 1)
    device.drop()
    clients(broker.port, "once-pub", clean_session=True).publish("once/t", payloads(6), qos=1)
    broker.stop()
    [row] = inspect_json(broker.store)
    assert row["dropped"] == 5
    lines = [line for line in broker.log().splitlines() if "WARNING" in line and "once-dev" in line]
    assert len(lines) == 1, lines


def test_repair_of_a_healthy_store_keeps_the_sessions(broker: Broker, clients: Callable[..., Client]) -> None:
    """docs/operations.md: `amqtt-durable repair STORE` "rebuilds the plugin's bookkeeping"; a
    store that needs nothing keeps its sessions and queues ("Then start the broker again")."""
    device = clients(broker.port, "rep-dev")
    device.subscribe("rep/t", 1)
    device.drop()
    clients(broker.port, "rep-pub", clean_session=True).publish("rep/t", payloads(3), qos=1)
    broker.stop()
    result = run_cli("repair", broker.store)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "not recovered" not in result.stdout
    broker.start()
    again = clients(broker.port, "rep-dev")
    assert again.session_present is True
    assert [m.payload for m in again.wait_messages(3)] == payloads(3)


def test_marker_lists_non_durable_interest(either_reader: Broker, clients: Callable[..., Client]) -> None:
    """docs/protocol.md: the marker's `live` lists the session's subscriptions as
    {"filter", "qos", "durable"}."""
    broker = either_reader
    device = clients(broker.port, "mk-dev")
    control(device, {"v": 1, "op": "hello", "req": 1})
    device.subscribe([("mk/a", 1), ("mk/b", 0)])
    control(device, {"v": 1, "op": "interest", "req": 2, "filter": "mk/b", "durable": False})
    control(device, {"v": 1, "op": "ready", "req": 3})
    assert device.wait_for(lambda ms: any(m.topic == MARKER for m in ms))
    marker = json.loads(next(m.payload for m in device.messages if m.topic == MARKER))
    assert sorted(marker["live"], key=lambda e: e["filter"]) == [
        {"filter": "mk/a", "qos": 1, "durable": True},
        {"filter": "mk/b", "qos": 0, "durable": False},
    ]


# ------------------------------------------------------------------ fourth batch
def test_frame_publish_time_is_when_the_broker_received_it(
    either_reader: Broker, clients: Callable[..., Client]
) -> None:
    """docs/protocol.md: "publish time, Unix seconds, as the broker received it"; :37 sequence ids
    increase along the delivery order."""
    broker = either_reader
    import time  # noqa: PLC0415

    device = clients(broker.port, "pt-sdk")
    control(device, {"v": 1, "op": "hello", "req": 1})
    device.subscribe("pt/t", 1)
    control(device, {"v": 1, "op": "ready", "req": 2})
    assert device.wait_for(lambda ms: any(m.topic == MARKER for m in ms))
    before = time.time()
    clients(broker.port, "pt-pub", clean_session=True).publish("pt/t", payloads(3), qos=1)
    after = time.time()
    assert device.wait_for(lambda ms: len([m for m in ms if m.topic == "pt/t"]) >= 3)
    frames = [frame(m.payload) for m in device.messages if m.topic == "pt/t"]
    assert all(before - 0.01 <= f[4] <= after + 0.01 for f in frames), (before, [f[4] for f in frames], after)
    assert [f[3] for f in frames] == sorted({f[3] for f in frames})


def test_retained_initial_value_before_ready_counts_in_marker(
    either_reader: Broker, clients: Callable[..., Client]
) -> None:
    """docs/protocol.md hello "holds delivery before a SUBSCRIBE that follows it is handled"; :124 "A
    brand-new session gets a marker too, with `replayed: 0`, or more when messages arrived between its
    SUBSCRIBE and its `ready`: a retained message queued with a SUBSCRIBE handled before the `ready`
    counts too (it comes before the marker, flags `0x03`, replayed and retained)"."""
    broker = either_reader
    clients(broker.port, "iv-pub", clean_session=True).publish("iv/t", [b"seed"], qos=1, retain=True)
    device = clients(broker.port, "iv-sdk")
    control(device, {"v": 1, "op": "hello", "req": 1})
    device.subscribe("iv/t", 1)
    assert not device.wait_for(lambda ms: any(m.topic == "iv/t" for m in ms), timeout=0.5), "held until ready"
    control(device, {"v": 1, "op": "ready", "req": 2})
    assert device.wait_for(lambda ms: any(m.topic == MARKER for m in ms))
    topics = [m.topic for m in device.messages if m.topic in ("iv/t", MARKER)]
    assert topics == ["iv/t", MARKER]
    marker = json.loads(next(m.payload for m in device.messages if m.topic == MARKER))
    [initial] = [m for m in device.messages if m.topic == "iv/t"]
    seq, flags = frame(initial.payload)[3], frame(initial.payload)[1]
    assert flags == 0x03, "replayed and retained"
    assert (marker["replayed"], marker["first_seq"], marker["last_seq"]) == (1, seq, seq)


# ------------------------------------------------------------------ fifth batch
def ctl_publish(packet_id: int, qos: int, request: dict[str, Any], dup: bool = False) -> bytes:
    first = 0x30 | (qos << 1) | (0x08 if dup else 0)
    return mqtt_packet(first, mqtt_string(CTL) + packet_id.to_bytes(2, "big") + json.dumps(request).encode())


def publish_body(body: bytes) -> tuple[str, bytes]:
    """(topic, payload) of a QoS 0 PUBLISH body."""
    size = int.from_bytes(body[:2], "big")
    return body[2 : 2 + size].decode(), body[2 + size :]


@pytest.mark.parametrize("qos", [1, 2])
def test_a_control_request_at_qos_1_or_2_is_accepted_and_a_retransmission_handled_again(
    either_reader: Broker, qos: int
) -> None:
    """docs/protocol.md: `_durable/v1/ctl` "a control request (JSON), QoS 0 (QoS 1 and 2 are accepted,
    but a retransmitted request is handled again)"."""
    broker = either_reader
    sock = raw_connect(broker.port, f"ctlq{qos}", clean=False)
    with sock:
        replies: list[dict[str, Any]] = []
        acks: list[int] = []
        sock.sendall(ctl_publish(9, qos, {"v": 1, "op": "hello", "req": 1}))
        sock.sendall(ctl_publish(9, qos, {"v": 1, "op": "hello", "req": 1}, dup=True))
        if qos == 2:
            sock.sendall(b"\x62\x02\x00\x09")
        expected_acks = [0x40, 0x40] if qos == 1 else [0x50, 0x50, 0x70]
        for _ in range(20):
            if len(replies) == 2 and len(acks) == len(expected_acks):
                break
            first, body = read_packet(sock)
            if first >> 4 == 3:
                topic, payload = publish_body(body)
                assert topic == REPLY
                replies.append(json.loads(payload))
            else:
                acks.append(first)
                assert body == b"\x00\x09"
        assert acks == expected_acks
        assert [r["req"] for r in replies] == [1, 1] and all(r["ok"] for r in replies)


def test_pubacks_go_out_in_the_order_the_publishes_arrived(
    either_reader: Broker, clients: Callable[..., Client]
) -> None:
    """docs/guarantees.md: "PUBACKs go out in the order the PUBLISHes arrived, each once its
    message is durable"."""
    broker = either_reader
    device = clients(broker.port, "order-dev")
    device.subscribe("order/durable", 1)
    sock = raw_connect(broker.port, "order-pub", clean=True)
    with sock:
        ids = list(range(40, 0, -1))
        packets = b""
        for i in ids:
            topic = "order/durable" if i % 3 else "order/nobody"
            packets += mqtt_packet(0x32, mqtt_string(topic) + i.to_bytes(2, "big") + b"x")
            if i % 5 == 0:
                packets += mqtt_packet(0x30, mqtt_string("order/durable") + b"qos0")
        sock.sendall(packets)
        got = [read_exactly(sock, 4) for _ in ids]
    assert [int.from_bytes(p[2:], "big") for p in got] == ids
    assert all(p[:2] == b"\x40\x02" for p in got)


def test_a_client_id_that_is_not_utf8_is_accepted_as_str_of_bytes(either_reader: Broker) -> None:
    """docs/operations.md: "CONNECT strings that are not valid UTF-8 (client id, will topic,
    username) are turned into `str(bytes)` by amqtt's CONNECT decoder and accepted as such"."""
    broker = either_reader
    raw_id = b"\xff\xfeid"
    body = mqtt_string("MQTT") + bytes((4, 0x00)) + (30).to_bytes(2, "big") + mqtt_string(raw_id)
    sock = socket.create_connection((HOST, broker.port), timeout=WAIT)
    with sock:
        sock.sendall(mqtt_packet(0x10, body))
        assert read_exactly(sock, 4) == b"\x20\x02\x00\x00"
        sock.sendall(b"\xe0\x00")
    broker.stop()
    assert [row["client_id"] for row in inspect_json(broker.store)] == [str(raw_id)]


def test_refused_control_requests_are_logged_once_per_interval(broker: Broker, clients: Callable[..., Client]) -> None:
    """docs/protocol.md: "The broker logs refusals (INFO) at most once per `drop_log_interval`
    per connection"; every request is still answered (docs/configuration.md)."""
    client = clients(broker.port, "refused-log", clean_session=True)
    for req in range(5):
        reply = control(client, {"v": 1, "op": "no-such-op", "req": req})
        assert reply["error"]["code"] == "unknown_op"
    lines = [line for line in broker.log().splitlines() if "refused-log" in line and "unknown_op" in line]
    assert len(lines) == 1, lines
    assert " INFO " in lines[0], lines


def test_no_store_health_message_while_the_store_never_failed(broker: Broker, clients: Callable[..., Client]) -> None:
    """docs/operations.md: "No retained message there [`$SYS/broker/durable/store/health`] means
    the store has not failed since the broker started"."""
    watcher = clients(broker.port, "health-watch", clean_session=True)
    watcher.subscribe([("$SYS/broker/durable/store/health", 1), ("health/sentinel", 1)])
    clients(broker.port, "health-pub", clean_session=True).publish("health/sentinel", [b"s"], qos=1)
    assert watcher.wait_for(lambda ms: any(m.topic == "health/sentinel" for m in ms))
    assert [m.topic for m in watcher.messages] == ["health/sentinel"]


@pytest.mark.parametrize("clean", [False, True], ids=["durable", "clean"])
def test_a_retained_message_comes_once_per_new_matching_filter(
    broker: Broker, clients: Callable[..., Client], clean: bool
) -> None:
    """docs/guarantees.md: a durable session "gets each message once, at the highest QoS" of its
    matching filters, but "A retained message sent because of a SUBSCRIBE ... comes once per new filter
    that matches it, at the lower of that filter's QoS and its own, durable and clean sessions alike"."""
    clients(broker.port, "ov-ret-pub", clean_session=True).publish("ovr/b", [b"ret"], qos=1, retain=True)
    device = clients(broker.port, f"ov-ret-{clean}", clean_session=clean)
    assert device.subscribe([("ovr/#", 0), ("ovr/b", 1)]) == [0, 1]
    assert device.wait_for(lambda ms: len(ms) >= 2)
    clients(broker.port, "ov-live-pub", clean_session=True).publish("ovr/b", [b"live"], qos=1)
    copies = 1 if not clean else 2
    assert device.wait_for(lambda ms: sum(m.payload == b"live" for m in ms) >= copies)
    retained = sorted((m.qos, m.retain) for m in device.messages if m.payload == b"ret")
    assert retained == [(0, True), (1, True)]
    live = sorted(m.qos for m in device.messages if m.payload == b"live")
    assert live == ([1] if not clean else [0, 1])


@pytest.mark.parametrize("clean", [False, True], ids=["durable", "clean"])
def test_a_retained_qos0_message_comes_at_qos_0_once_per_new_matching_filter(
    broker: Broker, clients: Callable[..., Client], clean: bool
) -> None:
    """docs/guarantees.md: a retained message sent because of a SUBSCRIBE "comes once per new filter
    that matches it, at the lower of that filter's QoS and its own ... one stored at QoS 0 twice at
    QoS 0"."""
    clients(broker.port, f"ov0-pub-{clean}", clean_session=True).publish("ov0/b", [b"ret"], qos=0, retain=True)
    device = clients(broker.port, f"ov0-{clean}", clean_session=clean)
    assert device.subscribe([("ov0/#", 0), ("ov0/b", 1)]) == [0, 1]
    assert device.wait_for(lambda ms: len(ms) >= 2)
    assert sorted((m.payload, m.qos, m.retain) for m in device.messages) == [(b"ret", 0, True)] * 2

def test_repair_refuses_a_folder_of_other_files_as_no_store(tmp_path: Path) -> None:
    """docs/operations.md: "A path that is missing or a folder without LevelDB files (empty, or
    holding only other files ...) is refused with `no store at '...'` ...; exit code 1, untouched"."""
    other = tmp_path / "data"
    other.mkdir()
    (other / "notes.txt").write_text("x")
    result = run_cli("repair", str(other))
    assert result.returncode == 1
    assert f"no store at '{other}'" in result.stderr, result.stderr
    assert [p.name for p in other.iterdir()] == ["notes.txt"]


def test_ready_replays_what_was_queued_up_to_it_then_the_marker_then_live(
    either_reader: Broker, clients: Callable[..., Client]
) -> None:
    """docs/protocol.md: "`ready` ... Ends the hold: the broker sends the recovery buffer and what was
    queued up to this point (flag `replayed`), then a marker, then live messages"; :121 "`replayed`
    counts the messages sent before it with the `replayed` flag"."""
    broker = either_reader
    device = clients(broker.port, "rl-sdk")
    control(device, {"v": 1, "op": "hello", "req": 1})
    device.subscribe("rl/t", 1)
    device.drop()
    pub = clients(broker.port, "rl-pub", clean_session=True)
    pub.publish("rl/t", payloads(300), qos=1)
    again = clients(broker.port, "rl-sdk")
    assert control(again, {"v": 1, "op": "ready", "req": 2})["ok"] is True
    pub.publish("rl/t", [b"live"], qos=1)  # queued after the ready was handled
    assert again.wait_for(lambda ms: any(m.topic == "rl/t" and m.payload.endswith(b"live") for m in ms))
    stream = [m for m in again.messages if m.topic in ("rl/t", MARKER)]
    assert [m.topic for m in stream] == ["rl/t"] * 300 + [MARKER, "rl/t"]
    replayed = [frame(m.payload) for m in stream[:300]]
    assert [f[5] for f in replayed] == payloads(300) and all(f[1] == 0x01 for f in replayed)
    marker = json.loads(stream[300].payload)
    assert (marker["replayed"], marker["first_seq"], marker["last_seq"]) == (300, replayed[0][3], replayed[-1][3])
    live = frame(stream[301].payload)
    assert live[1] == 0 and live[5] == b"live" and live[3] > replayed[-1][3]


def test_inspect_shows_no_deadline_for_a_session_connected_at_a_clean_stop(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    """docs/operations.md: time until expiry "`-`: no deadline stored, as for a session that was
    connected when the broker was killed or stopped"; `--json`: "null where none"."""
    device = clients(broker.port, "stop-dev")
    device.subscribe("stop/t", 1)
    broker.stop()
    [row] = inspect_json(broker.store)
    assert (row["disconnected_at"], row["expires_at"]) == (None, None)
    table = run_cli("inspect", broker.store).stdout.strip().splitlines()
    assert table[-2].split() == ["stop-dev", "0", "0", "-", "-", "0", "stop/t@1"], table


def test_hello_session_expiry_must_be_a_number_0_or_more_and_null_is_absent(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    """docs/protocol.md hello `session_expiry` "(seconds, optional: a finite number >= 0, else
    `malformed`)"; "A field given as JSON `null` counts as absent"."""
    device = clients(broker.port, "exp-args")
    for bad in (-1, True, "10"):
        reply = control(device, {"v": 1, "op": "hello", "session_expiry": bad})
        assert reply["ok"] is False and reply["error"]["code"] == "malformed", bad
    assert control(device, {"v": 1, "op": "hello", "session_expiry": 60})["session_expiry"] == 60
    reply = control(device, {"v": 1, "op": "hello", "session_expiry": None, "client_id": None})
    assert reply["ok"] is True and reply["session_expiry"] is None, "null removes the override as absence does"
    reply = control(device, {"v": 1, "op": "hello", "client_id": ""})
    assert reply["error"]["code"] == "malformed"


def wait_past(start: float, seconds: float) -> None:
    """Let ``seconds`` pass since ``start`` (time.monotonic()): a rate limit's interval, not a synchronisation."""
    import time  # noqa: PLC0415

    threading.Event().wait(max(0.0, start + seconds - time.monotonic()))


def test_the_line_after_a_quiet_interval_counts_what_was_left_out(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """docs/configuration.md `drop_log_interval`: overflow warnings at most once per interval per
    session ("drops are always counted"), and refused control requests logged "(INFO; the next line
    says how many were left out; every request is still answered)"; docs/guarantees.md "logged as a
    WARNING with the count, ...: `session <id>: queue full at its limit of <n> messages (overflow
    <policy>): dropped <k> message(s) since the last warning, <total> in all`"; docs/protocol.md."""
    import time  # noqa: PLC0415

    broker = broker_factory(drop_log_interval=1, max_depth=1, max_depth_disconnected=1)
    client = clients(broker.port, "quiet-ctl", clean_session=True)
    device = clients(broker.port, "quiet-dev")
    device.subscribe("quiet/t", 1)
    device.drop()
    pub = clients(broker.port, "quiet-pub", clean_session=True)
    for _ in range(3):
        assert control(client, {"v": 1, "op": "nope"})["error"]["code"] == "unknown_op"
    pub.publish("quiet/t", payloads(4), qos=1)  # 3 drops (before the PUBACKs): the first logged, 2 left out

    def warnings() -> list[str]:
        return [line for line in broker.log().splitlines() if "quiet-dev" in line and "WARNING" in line]

    assert broker.wait_until(lambda: len(warnings()) == 1, WAIT)
    wait_past(time.monotonic(), 1.05)  # both intervals began before the first WARNING was in the log
    assert control(client, {"v": 1, "op": "nope"})["error"]["code"] == "unknown_op"
    pub.publish("quiet/t", [b"late"], qos=1)  # the 4th drop
    refusals = [line for line in broker.log().splitlines() if "quiet-ctl" in line and "refused" in line]
    assert len(refusals) == 2 and all(" INFO " in line for line in refusals), refusals
    assert refusals[0].endswith("quiet-ctl: control request refused (unknown_op): 'op' is 'nope'; known ops are "
                                "hello, interest, ready, end_session, stream_subscribe, stream_ack, "
                                "stream_unsubscribe, stream_info"), refusals[0]
    assert refusals[1].endswith("(2 more refused since the last such line)"), refusals[1]
    assert broker.wait_until(lambda: len(warnings()) == 2, WAIT)
    lines = warnings()
    prefix = "session quiet-dev: queue full at its limit of 1 messages (overflow drop-oldest): dropped "
    assert lines[0].endswith(prefix + "1 message(s) since the last warning, 1 in all"), lines
    assert lines[1].endswith(prefix + "3 message(s) since the last warning, 4 in all"), lines


@pytest.mark.parametrize("publish_qos", [0, 1, 2])
def test_clean_subscribers_get_min_of_publish_and_subscription_qos(
    either_reader: Broker, clients: Callable[..., Client], publish_qos: int
) -> None:
    """docs/guarantees.md "Delivered QoS = min(publish QoS, subscription QoS)", durable and clean
    sessions alike (MQTT-3.8.4-6: never more than the publish's QoS, never more than granted)."""
    broker = either_reader
    subscribers = {qos: clients(broker.port, f"minq-{qos}", clean_session=True) for qos in (0, 1, 2)}
    for qos, subscriber in subscribers.items():
        assert subscriber.subscribe("minq/t", qos) == [qos]
    clients(broker.port, "minq-pub", clean_session=True).publish("minq/t", [b"x"], qos=publish_qos)
    for qos, subscriber in subscribers.items():
        [message] = subscriber.wait_messages(1)
        assert message.qos == min(qos, publish_qos), (qos, publish_qos, message.qos)


def test_a_forced_qos_message_to_a_clean_subscriber_is_capped_by_its_subscription(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """docs/guarantees.md (min of the message's QoS and the subscription's): the broker's own
    `$SYS/broker/durable/expired` event, published at QoS 1 (docs/guarantees.md), and a QoS 1 will
    reach a clean QoS 0 subscriber at QoS 0."""
    broker = broker_factory(session_expiry=0)
    watcher = clients(broker.port, "cap-watch", clean_session=True)
    assert watcher.subscribe([("$SYS/broker/durable/expired", 0), ("cap/#", 0)]) == [0, 0]
    sock = socket.create_connection((HOST, broker.port), timeout=WAIT)
    flags = 0x04 | 0x08  # a will at QoS 1
    body = mqtt_string("MQTT") + bytes((4, flags)) + (60).to_bytes(2, "big") + mqtt_string("cap-dev")
    sock.sendall(mqtt_packet(0x10, body + mqtt_string("cap/will") + mqtt_string("gone")))
    assert read_exactly(sock, 4)[3] == 0
    sock.close()  # no DISCONNECT: the will goes, and the session (expiry 0) expires
    assert watcher.wait_for(lambda ms: {m.topic for m in ms} >= {"cap/will", "$SYS/broker/durable/expired"})
    assert [m.qos for m in watcher.messages] == [0, 0]


@pytest.mark.parametrize("clean", [False, True], ids=["durable", "clean"])
def test_a_retained_qos0_message_comes_at_qos_0_to_a_qos_1_subscription(
    either_reader: Broker, clients: Callable[..., Client], clean: bool
) -> None:
    """docs/guarantees.md: retained messages matching a new subscription come with "RETAIN=1, QoS
    min(subscription, retained)"; docs/guarantees.md "Delivered QoS = min(publish QoS, subscription
    QoS)" (a retained message stored at QoS 0 is not raised to QoS 1)."""
    broker = either_reader
    clients(broker.port, "r0-pub", clean_session=True).publish("r0/t", [b"zero"], qos=0, retain=True)
    subscriber = clients(broker.port, f"r0-sub-{clean}", clean_session=clean)
    assert subscriber.subscribe("r0/t", 1) == [1]
    [message] = subscriber.wait_messages(1)
    assert (message.payload, message.retain, message.qos) == (b"zero", True, 0)


def test_inspect_text_header_durations_and_a_past_deadline(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """docs/operations.md: inspect's rows under the header `CLIENT ID`, `DEPTH`, `BYTES`, `OLDEST`,
    `EXPIRES IN`, `DROPPED`, `SUBSCRIPTIONS` ("the header reads `CLIENT ID  DEPTH  BYTES  OLDEST  EXPIRES
    IN  DROPPED  SUBSCRIPTIONS` only while no cell is wider than its column's name"); "ages and times
    read `45s` (under 2 minutes), `5m` (under 2 hours) or `3.5h`, an expiry already past `due` (the
    broker deletes that session when it starts)"; docs/guarantees.md "The deadline is stored, so it
    holds across restarts"."""
    import time  # noqa: PLC0415

    expiry = 5  # well past the broker's stop, even on a loaded machine: the stopped store keeps the session
    broker = broker_factory(metrics_interval=1, session_expiry=expiry)
    device = clients(broker.port, "due-dev")
    device.subscribe("due/t", 1)
    device.disconnect()
    seen_disconnected(clients, broker.port, 1)
    broker.stop()
    table = run_cli("inspect", broker.store).stdout.splitlines()
    assert table[0] == "CLIENT ID  DEPTH  BYTES  OLDEST  EXPIRES IN  DROPPED  SUBSCRIPTIONS", table
    row = table[1].split()
    assert row[:4] == ["due-dev", "0", "0", "-"] and row[4] in {f"{s}s" for s in range(expiry + 1)}, table
    [stored] = json.loads(run_cli("inspect", broker.store, "--json").stdout)
    # the stored deadline (wall clock), counted from when the broker handled the DISCONNECT
    wait_past(time.monotonic(), stored["expires_at"] - time.time() + 0.1)
    table = run_cli("inspect", broker.store).stdout.splitlines()
    assert table[1].split() == ["due-dev", "0", "0", "-", "due", "0", "due/t@1"], table
    broker.start()
    assert clients(broker.port, "due-dev").session_present is False


@pytest.mark.parametrize("clean", [False, True], ids=["durable", "clean"])
def test_a_repeated_subscribe_at_a_lower_qos_caps_delivery(
    either_reader: Broker, clients: Callable[..., Client], clean: bool
) -> None:
    """MQTT-3.8.4-3: a SUBSCRIBE of a filter the session holds replaces that subscription, its QoS
    too; docs/guarantees.md "Delivered QoS = min(publish QoS, subscription QoS)"."""
    broker = either_reader
    sub = clients(broker.port, f"resub-{clean}", clean_session=clean)
    pub = clients(broker.port, f"resub-pub-{clean}", clean_session=True)
    for granted in (2, 0, 1):
        assert sub.subscribe("resub/t", granted) == [granted]
        pub.publish("resub/t", [f"at {granted}".encode()], qos=2)
        assert sub.wait_for(lambda ms, g=granted: any(m.payload == f"at {g}".encode() for m in ms))
    assert [(m.payload, m.qos) for m in sub.messages] == [(b"at 2", 2), (b"at 0", 0), (b"at 1", 1)]


def test_interest_durable_null_counts_as_absent(broker: Broker, clients: Callable[..., Client]) -> None:
    """docs/protocol.md: "A field given as JSON `null` counts as absent"; `interest`'s
    `durable` is "(bool, default true)"."""
    device = clients(broker.port, "null-int")
    device.subscribe("ni/t", 1)
    reply = control(device, {"v": 1, "op": "interest", "filter": "ni/t", "durable": None})
    assert (reply["ok"], reply["durable"]) == (True, True), reply
    control(device, {"v": 1, "op": "ready"})
    assert device.wait_for(lambda ms: any(m.topic == MARKER for m in ms))
    marker = json.loads(next(m.payload for m in device.messages if m.topic == MARKER))
    assert marker["live"] == [{"filter": "ni/t", "qos": 1, "durable": True}], marker


def test_stream_subscribe_after_null_counts_as_absent(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """docs/protocol.md: "A field given as JSON `null` counts as absent" (`stream_subscribe`'s
    `after`: topics not listed start at the log's first event)."""
    broker = stream_broker(broker_factory)
    clients(broker.port, "null-after-pub", clean_session=True).publish("log/a", [b"e1", b"e2"], qos=1)
    reader = clients(broker.port, "null-after", clean_session=True)
    reply = control(reader, {"v": 1, "op": "stream_subscribe", "filter": "log/#", "after": None})
    assert (reply["ok"], reply["topics"], reply["gaps"]) == (True, {"log/a": {"first": 1, "last": 2}}, {}), reply
    assert reader.wait_for(lambda ms: len(stream_events(reader, "log/a")) >= 1)
    assert [(event_id, body) for _, event_id, body in stream_events(reader, "log/a")] == [(1, b"e1")]  # window 1


@pytest.mark.parametrize(
    ("request_fields", "name"),
    [({"topic": None, "id": None}, "topic"), ({"topic": "log/a", "id": None}, "id")],
)
def test_a_required_field_given_as_null_is_refused_as_missing(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], request_fields: dict[str, Any], name: str
) -> None:
    """docs/protocol.md: "A field given as JSON `null` counts as absent: ... one the op needs is missing
    (`malformed`, `<op> needs '<field>'`...)"."""
    broker = stream_broker(broker_factory)
    reader = clients(broker.port, f"null-ack-{name}", clean_session=True)
    assert control(reader, {"v": 1, "op": "stream_subscribe", "filter": "log/#"})["ok"] is True
    reply = control(reader, {"v": 1, "op": "stream_ack", **request_fields})
    assert reply["error"] == {"code": "malformed", "message": f"stream_ack needs '{name}'"}, reply
