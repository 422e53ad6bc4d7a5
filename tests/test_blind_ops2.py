"""Black-box checks, second pass, of docs/guarantees.md and docs/operations.md, written from the
documents alone: real broker processes (``amqtt-durable broker``, and the stock ``amqtt`` command
where the page speaks of it), real paho clients and raw sockets over TCP on 127.0.0.1, the real
``amqtt-durable inspect``. Each test quotes the promise it checks; the earlier passes
(test_blind_guarantees.py, test_blind_ops.py, test_docs_promises*.py) cover the others."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from raw_mqtt_helpers import connect_packet, raw_connect, read_exactly
from test_blind_core import inspect_json, seen_disconnected
from test_hostile_wire import PATHS, read_until_closed

from conftest import HOST, WAIT, Broker, Client, connack_code, free_port, mqtt_packet, mqtt_string, payloads, run_cli

AMQTT = Path(sys.executable).parent / "amqtt"
PLUGIN = "amqtt_durable.DurableSessionsPlugin"


def broker_reading_on(broker_factory: Callable[..., Broker], path: str) -> Broker:
    """A started broker whose connections are read by the plugin's reader or by amqtt's (a topic
    plugin loaded): guarantees.md, The message path, "on either reader"."""
    broker = broker_factory(start=False)
    broker.extra_plugins.update(PATHS[path])
    return broker.start()


def log_lines(broker: Broker, needle: str) -> list[str]:
    return [line for line in broker.log().splitlines() if needle in line]


def wait_for_log(broker: Broker, needle: str) -> list[str]:
    """The broker's log lines holding ``needle``, once there is one (bounded by WAIT)."""
    assert broker.wait_until(lambda: bool(log_lines(broker, needle)), WAIT), broker.log()[-3000:]
    return log_lines(broker, needle)


# ------------------------------------------------------------------ the message path: packets refused
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("clean", [True, False], ids=["clean", "durable"])
def test_a_publish_with_both_qos_bits_set_closes_the_connection_unanswered(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], path: str, clean: bool
) -> None:
    """guarantees.md, "A packet MQTT 3.1.1 does not let a client send closes the connection":
    "a PUBLISH whose QoS bits are both set (QoS 3, MQTT-3.3.1-4)", on either reader, unanswered,
    with a WARNING naming the client; nothing of it is routed, whatever its DUP and RETAIN flags."""
    broker = broker_reading_on(broker_factory, path)
    watcher = clients(broker.port, "q3-watch", clean_session=True)
    watcher.subscribe("q3/#", 0)
    for first in (0x36, 0x3E, 0x37):
        client_id = f"q3-{clean}-{first:x}"
        sock = raw_connect(broker.port, client_id, clean=clean)
        sock.sendall(mqtt_packet(first, mqtt_string("q3/t") + b"\x00\x05" + b"three"))
        assert read_until_closed(sock, WAIT) == b"", "closed with no PUBACK / PUBREC"
        sock.close()
        assert wait_for_log(broker, f"closing the connection of {client_id}")
    clients(broker.port, "q3-pub", clean_session=True).publish("q3/ok", [b"after"], qos=1)
    assert watcher.wait_for(lambda ms: any(m.payload == b"after" for m in ms))
    assert [m.payload for m in watcher.messages] == [b"after"], "no QoS 3 PUBLISH was routed"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("requested", [0x03, 0x04, 0x81], ids=["qos3", "reserved-bit-2", "reserved-bit-7"])
def test_a_subscribe_whose_requested_qos_byte_is_not_0_1_or_2_closes_the_connection(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], path: str, requested: int
) -> None:
    """guarantees.md, The message path: a SUBSCRIBE whose requested QoS byte is anything but 0, 1
    or 2 ("QoS 3, or any of its reserved upper six bits set", MQTT-3.8.3-4) closes the connection,
    on either reader, with no SUBACK and nothing granted, and a WARNING naming the client."""
    broker = broker_reading_on(broker_factory, path)
    sock = raw_connect(broker.port, "rsv-sub", clean=False)
    sock.sendall(mqtt_packet(0x82, b"\x00\x01" + mqtt_string("rsv/t") + bytes((requested,))))
    assert read_until_closed(sock, WAIT) == b"", "closed, and no SUBACK"
    sock.close()
    assert wait_for_log(broker, "closing the connection of rsv-sub: SUBSCRIBE refused")
    again = clients(broker.port, "rsv-sub")
    assert again.session_present is True  # the session was created by the CONNECT
    clients(broker.port, "rsv-pub", clean_session=True).publish("rsv/t", [b"x"], qos=1)
    assert not again.wait_for(lambda ms: len(ms) > 0, timeout=0.5), "nothing was granted"


# ------------------------------------------------------------------ owner
@pytest.mark.parametrize("clean", [False, True], ids=["durable", "clean"])
def test_another_users_connect_gets_connack_5_and_a_warning_naming_client_user_and_owner(
    broker: Broker, clients: Callable[..., Client], clean: bool
) -> None:
    """guarantees.md, Owner: with `session_takeover: owner-only` (default) "a CONNECT of its client
    id by any other user, clean or not, is refused with CONNACK 5 (not authorized) and its
    connection closed, before anything is touched: the owner's connection stays up, the session and
    its queue stay as they are, and a WARNING names client id, user and owner"."""
    owner = clients(broker.port, "owned-dev", username="alice")
    owner.subscribe("owned/t", 1)
    with socket.create_connection((HOST, broker.port), timeout=WAIT) as sock:
        sock.sendall(connect_packet("owned-dev", clean=clean, username="mallory"))
        assert read_exactly(sock, 4) == b"\x20\x02\x00\x05"
        assert read_until_closed(sock, WAIT) == b""
    warning = [line for line in wait_for_log(broker, "owned-dev") if " WARNING " in line]
    assert any("owned-dev" in line and "mallory" in line and "alice" in line for line in warning), warning
    clients(broker.port, "owned-pub", clean_session=True).publish("owned/t", [b"still"], qos=1)
    assert owner.wait_for(lambda ms: [m.payload for m in ms] == [b"still"]), "the owner's connection stays up"


# ------------------------------------------------------------------ delivered QoS of $SYS messages and wills
def test_the_expired_event_and_a_will_reach_clean_subscribers_at_the_lower_qos(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """guarantees.md: "Delivered QoS = min(publish QoS, subscription QoS), durable and clean sessions
    alike (MQTT-3.8.4-6), ... wills and `$SYS` messages too" (amqtt alone sent "wills and `$SYS`
    messages at their own QoS whatever the subscription's"); the expiry event is published "at QoS 1"
    on `$SYS/broker/durable/expired`."""
    broker = broker_factory(session_expiry=0)
    at = {qos: clients(broker.port, f"sys-{qos}", clean_session=True) for qos in (0, 1, 2)}
    for qos, client in at.items():
        client.subscribe("$SYS/broker/durable/expired", qos)
        client.subscribe("lwt/dev", qos)
    will = Client(broker.port, "lwt-dev", clean_session=False, auto_start=False)
    will.paho.will_set("lwt/dev", b"gone", qos=2)
    will.connect()
    will.drop()  # no DISCONNECT: the will (QoS 2) is published; session_expiry 0: it expires at once
    for qos, client in at.items():
        assert client.wait_for(lambda ms: {m.topic for m in ms} == {"$SYS/broker/durable/expired", "lwt/dev"})
        got = {m.topic: m.qos for m in client.messages}
        assert got == {"$SYS/broker/durable/expired": min(1, qos), "lwt/dev": min(2, qos)}, (qos, got)


# ------------------------------------------------------------------ queue limits: the drop WARNING
def test_the_drop_warning_under_a_byte_limit_names_both_limits(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """guarantees.md, Queue limits: drops are "logged as a WARNING with the count ...: `session <id>:
    queue full at its limit of <n> messages (overflow <policy>): dropped <k> message(s) since the last
    warning, <total> in all` (`<n> messages / <b> bytes` under a byte limit; the first drop after a
    quiet interval is logged at once ...)". A disconnected queue is held to the `_disconnected` limits."""
    broker = broker_factory(max_depth=5, max_depth_disconnected=10, max_bytes=100, max_bytes_disconnected=200,
                            metrics_interval=0.2)
    device = clients(broker.port, "bytes-dev")
    device.subscribe("bytes/t", 1)
    device.disconnect()
    seen_disconnected(clients, broker.port, 1)
    clients(broker.port, "bytes-pub", clean_session=True).publish("bytes/t", [b"x" * 30] * 7, qos=1)
    line = wait_for_log(broker, "session bytes-dev: queue full")
    assert line[0].endswith(
        "session bytes-dev: queue full at its limit of 10 messages / 200 bytes (overflow drop-oldest): "
        "dropped 1 message(s) since the last warning, 1 in all"
    ), line


# ------------------------------------------------------------------ $SYS: only store/health is retained
def test_metrics_and_the_expired_event_are_not_retained(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """guarantees.md: "the broker's own retained `$SYS` topics (`store/health`) are kept in memory
    only"; operations.md, Metrics: the numbers are published "at QoS 0", "plus the event topic
    `$SYS/broker/durable/expired` and the retained `$SYS/broker/durable/store/health`": a metric or
    an expiry event is not retained, so a subscriber that comes later gets none of them on SUBSCRIBE
    (and no store/health either while the store never failed)."""
    broker = broker_factory(metrics_interval=0.2, session_expiry=0)
    early = clients(broker.port, "sys-early", clean_session=True)
    early.subscribe("$SYS/broker/durable/#", 0)
    clients(broker.port, "sys-gone").disconnect()
    assert early.wait_for(lambda ms: any(m.topic == "$SYS/broker/durable/expired" for m in ms))
    assert early.wait_for(lambda ms: any(m.topic.endswith("/sessions/connected") for m in ms))
    late = clients(broker.port, "sys-late", clean_session=True)
    late.subscribe("$SYS/broker/durable/#", 0)
    # Two whole rounds of metrics after the SUBSCRIBE: anything retained came before them.
    assert late.wait_for(lambda ms: sum(m.topic.endswith("/messages/sent") for m in ms) >= 2)
    assert not [m.topic for m in late.messages if m.retain], "nothing retained"
    events = {"$SYS/broker/durable/expired", "$SYS/broker/durable/store/health"}
    assert not [m.topic for m in late.messages if m.topic in events]


# ------------------------------------------------------------------ inspect --json
def test_inspect_json_gives_null_where_a_session_has_no_deadline_or_no_queued_message(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """operations.md, inspect: `--json` prints `{"client_id", "depth", "bytes", "oldest_age_s",
    "subscriptions" ({filter: qos}), "disconnected_at", "expires_at", "dropped"}`, "times in Unix
    seconds, null where none"; the table shows `-` for no deadline ("a session that was connected
    when the broker was killed") and for an empty queue's OLDEST."""
    broker = broker_factory(metrics_interval=0.2)
    away = clients(broker.port, "json-away")
    away.subscribe([("j/b", 2), ("j/a", 0)])
    away.disconnect()
    seen_disconnected(clients, broker.port, 1)
    live = clients(broker.port, "json-live")
    live.subscribe("j/live", 1)
    before = time.time()
    clients(broker.port, "json-pub", clean_session=True).publish("j/b", [b"abc"], qos=1)
    broker.kill()
    rows = {row["client_id"]: row for row in inspect_json(broker.store)}
    assert set(rows) == {"json-away", "json-live"}
    for row in rows.values():
        assert set(row) == {"client_id", "depth", "bytes", "oldest_age_s", "subscriptions", "disconnected_at",
                            "expires_at", "dropped"}
    assert rows["json-live"]["disconnected_at"] is None and rows["json-live"]["expires_at"] is None
    assert rows["json-live"]["oldest_age_s"] is None and rows["json-live"]["depth"] == 0
    assert rows["json-live"]["subscriptions"] == {"j/live": 1}
    away_row = rows["json-away"]
    assert away_row["subscriptions"] == {"j/a": 0, "j/b": 2}
    assert (away_row["depth"], away_row["bytes"], away_row["dropped"]) == (1, 3, 0)
    assert away_row["disconnected_at"] <= before <= time.time()
    assert away_row["expires_at"] == pytest.approx(away_row["disconnected_at"] + 300)
    assert 0 <= away_row["oldest_age_s"] <= time.time() - before + 1
    table = run_cli("inspect", broker.store)
    assert table.returncode == 0, table.stderr
    live_row = next(line.split() for line in table.stdout.splitlines() if line.startswith("json-live"))
    assert live_row == ["json-live", "0", "0", "-", "-", "0", "j/live@1"], table.stdout


# ------------------------------------------------------------------ the stock amqtt command
def stock_amqtt(tmp_path: Path, port: int, plugin: str) -> tuple[subprocess.Popen[bytes], Path]:
    """``amqtt -c broker.yaml`` (the stock command) with one TCP listener on ``port`` and the
    plugin's settings ``plugin`` (YAML lines, indented four spaces); its output goes to a file."""
    config = tmp_path / "broker.yaml"
    config.write_text(
        f"listeners:\n  default: {{type: tcp, bind: '{HOST}:{port}'}}\nplugins:\n"
        f"  amqtt.plugins.authentication.AnonymousAuthPlugin: {{allow_anonymous: true}}\n  {PLUGIN}:\n{plugin}"
    )
    log = tmp_path / "amqtt.log"
    with log.open("wb") as out:
        process = subprocess.Popen([str(AMQTT), "-c", str(config)], cwd=tmp_path, stdout=out, stderr=out)
    return process, log


def wait_for_text(process: subprocess.Popen[bytes], log: Path, needle: str) -> str:
    deadline = time.monotonic() + 4 * WAIT
    while time.monotonic() < deadline and process.poll() is None:
        if needle in (text := log.read_text(errors="replace")):
            return text
        time.sleep(0.05)  # polling a file another process writes: a bounded wait, not a synchronisation
    raise AssertionError(f"{needle!r} not logged (exit {process.poll()}):\n{log.read_text(errors='replace')[-3000:]}")


def stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(WAIT)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(WAIT)


@pytest.mark.skipif(not AMQTT.exists(), reason="the stock amqtt command")
def test_the_stock_command_keeps_running_after_a_listener_fails_and_keeps_a_key_given_twice_last(
    tmp_path: Path,
) -> None:
    """operations.md, With the stock `amqtt` command: "A key given twice is not caught (plain YAML
    keeps the last). A listener that cannot open (a port in use ...) is logged as an ERROR, but the
    process keeps running"."""
    with socket.socket() as busy:
        busy.bind((HOST, 0))
        busy.listen()
        process, log = stock_amqtt(tmp_path, busy.getsockname()[1], "    store: ./first\n    store: ./second\n")
        try:
            text = wait_for_text(process, log, "Address already in use")
            assert any(" ERROR " in line for line in text.splitlines()), text[-3000:]
            assert process.poll() is None, "the stock process keeps running"
            assert (tmp_path / "second").is_dir() and not (tmp_path / "first").exists(), "the last store: kept"
        finally:
            stop(process)


@pytest.mark.skipif(not AMQTT.exists(), reason="the stock amqtt command")
def test_the_stock_command_whose_replication_cannot_start_stays_up_answering_connack_3(tmp_path: Path) -> None:
    """operations.md, With the stock `amqtt` command: a broker whose replication cannot start (its
    `replication.listen` in use, ...): "the ERROR line reads `broker not started: <reason>`, as
    `amqtt-durable broker` prints it, but the stock process stays up: a `role: primary` broker then
    answers every CONNECT with CONNACK 3 (server unavailable)"."""
    port = free_port()
    with socket.socket() as busy:
        busy.bind((HOST, 0))
        busy.listen()
        taken = f"{HOST}:{busy.getsockname()[1]}"
        plugin = f"    store: ./s\n    replication:\n      role: primary\n      listen: {taken}\n"
        process, log = stock_amqtt(tmp_path, port, plugin)
        try:
            text = wait_for_text(process, log, "broker not started")
            line = next(line for line in text.splitlines() if "broker not started" in line)
            assert " ERROR " in line and line.endswith(
                f"broker not started: replication.listen {taken}: [Errno 98] Address already in use"
            ), line
            deadline = time.monotonic() + WAIT
            while connack_code(port) is None and time.monotonic() < deadline:
                time.sleep(0.05)  # the listener opens after the error line: bounded polling
            assert connack_code(port) == 3
            assert process.poll() is None, "the stock process stays up"
        finally:
            stop(process)


# ------------------------------------------------------------------ payloads helper kept in use
def test_a_session_s_dropped_count_is_in_inspect_after_a_sigkill(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """guarantees.md, Queue limits: "Drops are counted per session (stored with the queue totals, so
    they survive restarts: the `dropped` column of `amqtt-durable inspect`)", also after SIGKILL
    ("after SIGKILL nothing acknowledged is lost", operations.md), and `drop-newest` "does not queue
    the new message for that session": the oldest stay."""
    broker = broker_factory(max_depth=3, max_depth_disconnected=3, overflow="drop-newest", metrics_interval=0.2)
    device = clients(broker.port, "newest-dev")
    device.subscribe("newest/t", 1)
    device.disconnect()
    seen_disconnected(clients, broker.port, 1)
    clients(broker.port, "newest-pub", clean_session=True).publish("newest/t", payloads(5), qos=1)
    broker.kill()
    (row,) = inspect_json(broker.store)
    assert (row["depth"], row["dropped"]) == (3, 2), row
    broker.start()
    assert device.connect() is True
    assert device.wait_for(lambda ms: len(ms) >= 3)
    assert [m.payload for m in device.messages] == payloads(3)


# ------------------------------------------------------------------ subscription limit: its WARNING
@pytest.mark.parametrize("interval", [0, 60])
def test_subscribes_past_the_limit_are_logged_at_most_once_per_drop_log_interval_per_client(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], interval: int
) -> None:
    """guarantees.md, Subscription limit: a SUBSCRIBE past `max_subscriptions_per_client` gets 0x80
    for each filter over the limit, "the broker logs a WARNING naming the client and the setting, at
    most once per `drop_log_interval` seconds per client" (configuration.md: "also between two
    WARNINGs of ... refusals"); a re-subscribe to a held filter "does not count twice; unsubscribing
    frees a place", clean sessions alike. drop_log_interval 0: every refusal is logged."""
    broker = broker_factory(max_subscriptions_per_client=2, drop_log_interval=interval)
    client = clients(broker.port, "sub-limit", clean_session=True)
    assert client.subscribe([("l/a", 1), ("l/b", 1)]) == [1, 1]
    assert client.subscribe("l/a", 0) == [0], "a held filter does not count twice"
    assert client.subscribe("l/c", 0) == [0x80]
    client.unsubscribe("l/a")
    assert client.subscribe([("l/c", 0), ("l/d", 1)]) == [0, 0x80], "the unsubscribe freed one place"
    refused = wait_for_log(broker, "sub-limit: SUBSCRIBE to")
    assert all(" WARNING " in line and "max_subscriptions_per_client" in line for line in refused), refused
    assert "'l/c'" in refused[0], refused
    if interval == 0:
        refused = wait_for_log(broker, "sub-limit: SUBSCRIBE to 'l/d'")
        assert len(log_lines(broker, "sub-limit: SUBSCRIBE to")) == 2
    else:
        client.paho.publish("l/b", b"sync", qos=1).wait_for_publish(WAIT)  # the second SUBSCRIBE was handled
        assert len(log_lines(broker, "sub-limit: SUBSCRIBE to")) == 1


# ------------------------------------------------------------------ packet size
def remaining_length(value: int) -> bytes:
    """MQTT's variable-length encoding of a remaining length."""
    out = bytearray()
    while True:
        value, digit = divmod(value, 128)
        out.append(digit | (0x80 if value else 0))
        if not value:
            return bytes(out)


def test_a_packet_over_max_packet_size_closes_after_its_fixed_header_with_a_warning_of_size_and_limit(
    broker_factory: Callable[..., Broker],
) -> None:
    """guarantees.md, Packet size: "a packet whose remaining length is larger than
    `max_packet_size` ... closes the connection right after its fixed header, before its body is
    read into memory (CONNECT included); the WARNING says the size and the limit". Only the fixed
    header is sent: the broker does not wait for the body."""
    broker = broker_factory(max_packet_size=1024)
    sock = raw_connect(broker.port, "too-big", clean=True)
    sock.sendall(b"\x30" + remaining_length(2_000_000))  # a PUBLISH's fixed header, no body
    assert read_until_closed(sock, WAIT) == b"", "closed without waiting for the body, nothing sent"
    sock.close()
    (line,) = wait_for_log(broker, "closing the connection of too-big")
    assert " WARNING " in line and "2000000" in line and "1024" in line, line
    with socket.create_connection((HOST, broker.port), timeout=WAIT) as first:
        first.sendall(b"\x10" + remaining_length(1025))  # a CONNECT's fixed header one byte past the limit
        assert read_until_closed(first, WAIT) == b"", "no CONNACK"
    assert any("1025" in line and "1024" in line for line in log_lines(broker, " WARNING ")), broker.log()[-2000:]


# ------------------------------------------------------------------ any-user take-over and QoS 2 packet ids
def test_an_any_user_take_over_forgets_the_previous_users_qos2_packet_ids(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """guarantees.md, Owner: "With `session_takeover: any-user` the session passes to the new user (a
    WARNING says so): ... the packet ids of the previous user's QoS 2 publishes whose PUBREL is due
    are forgotten (the new user's publish with such an id is a new message, not a re-send)". Without
    the take-over, the same packet id is a re-send (PUBREC, not routed): the first part checks that."""
    broker = broker_factory(session_takeover="any-user")
    durable = clients(broker.port, "q2-reader")
    durable.subscribe("q2/t", 2)

    def publish_qos2(sock: socket.socket, payload: bytes) -> None:
        sock.sendall(mqtt_packet(0x34, mqtt_string("q2/t") + b"\x00\x07" + payload))
        assert read_exactly(sock, 4) == b"\x50\x02\x00\x07", "PUBREC"

    alice = raw_connect(broker.port, "q2-dev", clean=False, username="alice")
    publish_qos2(alice, b"alice")
    alice.close()
    again = raw_connect(broker.port, "q2-dev", clean=False, username="alice")
    publish_qos2(again, b"alice-again")  # the same user: a re-send of id 7, not routed
    again.close()
    bob = raw_connect(broker.port, "q2-dev", clean=False, username="bob")
    assert wait_for_log(broker, "durable session q2-dev passes from user 'alice' to user 'bob'")
    publish_qos2(bob, b"bob")  # the new user's id 7: a new message
    bob.sendall(mqtt_packet(0x62, b"\x00\x07"))
    assert read_exactly(bob, 4) == b"\x70\x02\x00\x07", "PUBCOMP"
    assert durable.wait_for(lambda ms: len(ms) >= 2)
    assert [m.payload for m in durable.messages] == [b"alice", b"bob"]
    bob.close()


# ------------------------------------------------------------------ keep-alive on a websocket
def test_websocket_pings_alone_do_not_keep_an_mqtt_connection_alive(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """guarantees.md, The message path: "A client silent for 1.5 times its keep-alive ... is
    disconnected ..., and its will is published. ... Any bytes received count (on a websocket
    connection, any websocket data message; a ping is not one)". A websocket client that answers
    nothing but websocket pings, every quarter of its 1 s keep-alive, is disconnected all the same."""
    from websockets.exceptions import ConnectionClosed  # noqa: PLC0415 - only this test speaks raw websocket
    from websockets.sync.client import connect as ws_connect  # noqa: PLC0415
    from websockets.typing import Subprotocol  # noqa: PLC0415

    broker = broker_factory(start=False)
    broker.ws_port = free_port()
    broker.start()
    watcher = clients(broker.port, "ws-will-watch", clean_session=True)
    watcher.subscribe("will/#", 0)
    connect = connect_packet("ws-pinger", clean=False, will_topic=b"will/ws-pinger", keepalive=1)
    started = time.monotonic()
    with ws_connect(f"ws://{HOST}:{broker.ws_port}/mqtt", subprotocols=[Subprotocol("mqtt")],
                    open_timeout=WAIT, ping_interval=None) as ws:
        ws.send(connect)
        assert ws.recv(timeout=WAIT) == b"\x20\x02\x00\x00"
        closed = False
        while not closed and time.monotonic() - started < WAIT:
            try:
                ws.ping().wait(WAIT)  # answered by the websocket layer: the connection is up
                ws.recv(timeout=0.25)  # the broker sends nothing unasked: this waits a quarter keep-alive
            except TimeoutError:
                continue
            except ConnectionClosed:
                closed = True
    assert closed, "the pings kept the connection open"
    assert wait_for_log(broker, "ws-pinger: nothing received for 1.5 keep-alive periods: disconnecting")
    assert [m.payload for m in watcher.wait_messages(1)] == [b"gone"], "its will is published"
