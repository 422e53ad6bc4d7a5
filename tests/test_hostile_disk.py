"""A full disk under a real broker, and per-queue byte limits (issue 10, point 5).

The store lives on a real tmpfs of a few MB that the test fills with a file and frees again;
where the machine does not allow mounting one, the test is skipped with the reason.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from raw_mqtt_helpers import connect_packet, raw_subscribe, read_exactly
from small_disk import fill, leave_free, small_disk
from test_hostile_amqtt_sessions import StuckWebsocket
from test_hostile_owner import PASSWORDS, REFUSED, acl_broker, login
from test_hostile_wire import read_until_closed
from test_subscribe_order import retain_big_messages
from test_takeover_races import GATED_AUTH

from amqtt_durable.process import free_port
from conftest import HOST, WAIT, Broker, Client, mqtt_packet, mqtt_string, payloads, run_cli

HEALTH = "$SYS/broker/durable/store/health"
CONNACK_ACCEPTED = b"\x20\x02\x00\x00"
CONNACK_UNAVAILABLE = b"\x20\x02\x00\x03"
PINGREQ = b"\xc0\x00"


def raw_connect(port: int, client_id: str, *, clean: bool) -> tuple[bytes, bool]:
    """CONNECT over a raw socket: the CONNACK's bytes, and whether the broker then closed the
    connection by itself (an accepted one is ended here with DISCONNECT)."""
    body = mqtt_string("MQTT") + bytes([4, 0x02 if clean else 0x00, 0, 60]) + mqtt_string(client_id)
    with socket.create_connection((HOST, port), timeout=WAIT) as sock:
        sock.sendall(mqtt_packet(0x10, body))
        connack = b""
        while len(connack) < 4:
            chunk = sock.recv(4 - len(connack))
            if not chunk:
                break
            connack += chunk
        if connack == CONNACK_ACCEPTED:
            sock.sendall(b"\xe0\x00")
            return connack, False
        return connack, sock.recv(1) == b""


def was_acknowledged(info: mqtt.MQTTMessageInfo) -> bool:
    """paho raises for a publish whose connection went away meanwhile: not acknowledged either."""
    try:
        return info.is_published()
    except RuntimeError:
        return False


def health_states(monitor: Client) -> list[dict[str, Any]]:
    return [json.loads(m.payload) for m in monitor.messages if m.topic == HEALTH]


def wait_health(monitor: Client, status: str, timeout: float = WAIT) -> dict[str, Any]:
    assert monitor.wait_for(lambda _: any(h["status"] == status for h in health_states(monitor)), timeout), (
        f"no '{status}' on {HEALTH}: {health_states(monitor)}"
    )
    return next(h for h in health_states(monitor) if h["status"] == status)


def acknowledging(client: Client) -> Callable[[mqtt.MQTTMessage], None]:
    def ack(message: mqtt.MQTTMessage) -> None:
        client.paho.ack(message.mid, message.qos)

    return ack


def test_full_disk_refuses_what_it_cannot_store_and_serves_again_once_space_is_freed(
    tmp_path: Path, broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    with small_disk(tmp_path / "disk", 16) as disk:
        broker = broker_factory(store=str(disk / "store"), recovery_buffer=10)
        port = broker.port
        offline = clients(port, "offline")
        offline.subscribe("d/#", 1)
        offline.subscribe("o/#", 1)
        offline.disconnect()
        reader = clients(port, "reader", manual_ack=True)
        reader.subscribe("d/#", 1)
        reader.disconnect()
        # After a restart both sessions are disconnected for sure: what comes next is their backlog,
        # and sending it moves the reader's sent mark (stored before each send).
        broker.restart(kill=True)
        monitor = clients(port, "monitor", clean_session=True)
        monitor.subscribe(HEALTH, 1)
        publisher = clients(port, "pub", clean_session=True)
        before = payloads(60, "before")
        publisher.publish("d/x", before)
        assert reader.connect() is True
        assert reader.wait_for(lambda m: len(m) >= 10), "the reader's window (10) is sent"

        filler = fill(disk)
        unstored = b"unstored-" + bytes(64 * 1024)
        attempt = publisher.paho.publish("o/x", unstored, qos=1)  # not for the reader: its sent mark stays
        assert publisher.wait_disconnected(), "the publisher of an unstorable publish must see its connection closed"
        assert not was_acknowledged(attempt), "no PUBACK for a publish that could not be stored"
        failing = wait_health(monitor, "failing")
        assert "No space left on device" in failing["error"]
        exactly_once = clients(port, "pub-qos2", clean_session=True)
        refused = exactly_once.paho.publish("d/x", b"qos2 while full", qos=2)
        assert exactly_once.wait_disconnected(), "a QoS 2 publisher is told the same way"
        assert not was_acknowledged(refused), "no PUBREC either"

        assert raw_connect(port, "new-durable", clean=False) == (CONNACK_UNAVAILABLE, True), "new session: CONNACK 3"
        assert raw_connect(port, "offline", clean=False) == (CONNACK_UNAVAILABLE, True), "stored session: CONNACK 3"
        assert raw_connect(port, "plain", clean=True)[0] == CONNACK_ACCEPTED, "a clean CONNECT needs no write"

        # The connected durable subscriber goes on getting what the store holds, past its window
        # and past the sent mark stored before the disk filled (the mark cannot be written now).
        reader.on_message_hook = acknowledging(reader)
        for message in reader.wait_messages(10):
            reader.paho.ack(message.mid, message.qos)
        assert reader.wait_for(lambda m: len(m) >= len(before)), "stored messages are delivered while full"
        assert [m.payload for m in reader.messages] == before

        filler.unlink()
        recovered = wait_health(monitor, "ok", timeout=WAIT + 10)
        assert recovered["failed_for"] > 0 and recovered["since"] >= failing["since"]
        after = payloads(50, "after")
        clients(port, "pub-again", clean_session=True).publish("d/x", after)
        assert raw_connect(port, "new-durable", clean=False) == (CONNACK_ACCEPTED, False), "durable CONNECT works"
        late = clients(port, "late-monitor", clean_session=True)
        late.subscribe(HEALTH, 1)
        assert late.wait_for(bool), "the current state is retained"
        assert json.loads(late.messages[-1].payload)["status"] == "ok"

        acknowledged = before + after
        assert reader.wait_for(lambda m: [x.payload for x in m if x.payload != unstored] == acknowledged)
        assert b"qos2 while full" not in [m.payload for m in reader.messages], "refused before it was queued"
        assert [m.payload for m in reader.messages].count(unstored) <= 1

        broker.restart(kill=True)  # SIGKILL: what was acknowledged before and after must all be there
        assert offline.connect() is True
        assert offline.wait_for(lambda m: [x.payload for x in m if x.payload != unstored] == acknowledged)
        assert [m.payload for m in offline.messages].count(unstored) <= 1

        log = broker.log()
        assert "store write failed" in log and "store writes succeed again" in log
        assert "CONNACK 3" in log and "not acknowledged" in log


def test_byte_limits_apply_the_overflow_policy_to_a_disconnected_queue(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    broker = broker_factory(max_bytes=500, max_bytes_disconnected=1000)
    device = clients(broker.port, "device")
    device.subscribe("b/#", 1)
    device.disconnect()
    sent = [b"%04d" % i + bytes(96) for i in range(25)]  # 100 bytes each
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("b/x", [*sent, bytes(1001)])  # the last is larger than the limit itself: dropped
    broker.stop()
    inspected = run_cli("inspect", broker.store, "--json")
    assert inspected.returncode == 0, inspected.stderr
    (row,) = json.loads(inspected.stdout)
    assert (row["depth"], row["bytes"], row["dropped"]) == (10, 1000, 16), "drop-oldest keeps the newest 1000 bytes"
    assert "queue full at its limit of 1000000 messages / 1000 bytes" in broker.log()
    broker.start()
    assert device.connect() is True
    assert [m.payload for m in device.wait_messages(10)] == sent[-10:]


def test_a_clean_connect_refused_while_the_store_fails_leaves_the_live_durable_connection(
    tmp_path: Path, broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """A clean CONNECT for the client id of a stored durable session needs a write (the delete): while
    the store fails it gets CONNACK 3, and the take-over happens only if the CONNECT is accepted
    (MQTT 3.1.4): the live durable connection of that client id goes on (it was ended before)."""
    with small_disk(tmp_path / "disk", 16) as disk:
        broker = broker_factory(store=str(disk / "store"))
        port = broker.port
        monitor = clients(port, "monitor", clean_session=True)
        monitor.subscribe(HEALTH, 1)
        with socket.create_connection((HOST, port), timeout=WAIT) as reader:
            reader.sendall(connect_packet("reader", clean=False))
            assert read_exactly(reader, 4) == CONNACK_ACCEPTED
            assert raw_subscribe(reader, "d/#", 1) == 1
            publisher = clients(port, "pub", clean_session=True)
            fill(disk)
            publisher.paho.publish("d/x", bytes(64 * 1024), qos=1)  # its write finds the disk full
            wait_health(monitor, "failing")

            assert raw_connect(port, "reader", clean=True) == (CONNACK_UNAVAILABLE, True)
            # The refused CONNECT was handled in full before its CONNACK: had it ended the reader's
            # connection, the reader's socket would be closed by now.
            reader.sendall(PINGREQ)
            assert read_exactly(reader, 2) == b"\xd0\x00", "the live durable connection goes on"
        assert "reader: a clean CONNECT takes the client id over" not in broker.log()


def stored_session(clients: Callable[..., Client], port: int, client_id: str, queued: int) -> None:
    """A disconnected durable session of ``client_id`` subscribed to d/# with ``queued`` messages."""
    device = clients(port, client_id)
    device.subscribe("d/#", 1)
    device.disconnect()
    clients(port, "pub", clean_session=True).publish("d/x", payloads(queued))


LONG_ID = "dev-" + "x" * 8000
"""A client id whose record's erasure does not fit in what a full disk leaves."""


@contextlib.contextmanager
def full_disk_with_a_long_id_session(
    tmp_path: Path, broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> Iterator[tuple[Broker, Path, Path]]:
    """A broker on a small disk holding LONG_ID's session with 20 queued messages, the disk then
    filled: (broker, the disk, the filler file to delete for room)."""
    with small_disk(tmp_path / "disk", 16) as disk:
        broker = broker_factory(store=str(disk / "store"))
        stored_session(clients, broker.port, LONG_ID, 20)
        yield broker, disk, fill(disk)


def assert_whole_after_restart(
    broker: Broker, filler: Path, clients: Callable[..., Client], client_id: str, why: str
) -> Client:
    """Kill the broker, give the disk room, start it again: ``client_id``'s session of stored_session is whole."""
    broker.kill()
    filler.unlink()
    broker.start()
    dev = clients(broker.port, client_id)
    assert dev.session_present is True, why
    assert [m.payload for m in dev.wait_messages(20)] == payloads(20)
    return dev


def test_a_clean_connect_whose_queue_deletion_fails_is_answered_at_once_and_the_rest_deleted_later(
    tmp_path: Path, broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """A clean CONNECT deletes the client id's durable session. The disk is full, but no write has
    failed yet, so the check before the CONNACK passes: the record's erasure fits in the room left,
    the erasure of its 3,000 queue entries does not. The CONNECT is accepted at once (CONNACK 0,
    served), its record's erasure being written; the queue goes once the disk has room, and a
    restart in between deletes what is left. (The CONNECT waited for the whole deletion, retried
    until it was written: no CONNACK until the disk had room again.)"""
    with small_disk(tmp_path / "disk", 16) as disk:
        broker = broker_factory(store=str(disk / "store"))
        port = broker.port
        stored_session(clients, port, "dev", 3000)
        monitor = clients(port, "monitor", clean_session=True)
        monitor.subscribe(HEALTH, 1)
        filler = fill(disk)
        leave_free(disk, filler, 32 * 1024)
        with socket.create_connection((HOST, port), timeout=WAIT) as sock:
            sock.sendall(connect_packet("dev", clean=True))
            assert read_exactly(sock, 4) == CONNACK_ACCEPTED, "accepted at once, no session present"
            sock.sendall(PINGREQ)
            assert read_exactly(sock, 2) == b"\xd0\x00", "and served"
            wait_health(monitor, "failing")  # the queue's erasure found the disk full
            broker.kill()
        filler.unlink()
        broker.start()
        dev = clients(port, "dev")
        assert dev.session_present is False, "its record's erasure was written before the CONNACK"
        assert not dev.wait_for(bool, timeout=0.5), "nothing of its queue is left"
        dev.disconnect()
        broker.stop()
    assert "store: deleted 3000 queue entries of a session whose deletion a crash or a stop cut short" in broker.log()


def test_a_clean_connect_whose_session_erasure_fails_gets_connack_3_and_the_session_stays_whole(
    tmp_path: Path, broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """The same with a client id of 8,000 bytes, whose record's erasure does not fit either: the
    CONNECT gets CONNACK 3 at once and is closed, and a restart before the disk has room again finds
    the session whole, queue included. (The CONNECT waited, unanswered, until the disk had room.)
    The refusal comes when the CONNACK is due (``_refuse_connect``, which writes the CONNACK itself):
    all the MQTT 3.1.1 client reads before the close is that CONNACK, 20 02 00 03 (no session
    present, MQTT-3.2.2-4; return code 3, server unavailable)."""
    client_id = LONG_ID
    with full_disk_with_a_long_id_session(tmp_path, broker_factory, clients) as (broker, _, filler):
        with socket.create_connection((HOST, broker.port), timeout=WAIT) as sock:
            sock.sendall(connect_packet(client_id, clean=True))
            assert read_until_closed(sock, WAIT) == CONNACK_UNAVAILABLE, "refused at once, then closed"
        refused_at_connack = "CONNECT refused when its CONNACK was due"
        assert broker.wait_until(lambda: refused_at_connack in broker.log(), WAIT), broker.log()[-3000:]
        assert_whole_after_restart(broker, filler, clients, client_id, "the refused CONNECT deleted nothing")
    assert "CONNACK 3" in broker.log()


def test_a_connect_refused_when_its_connack_is_due_on_a_websocket_already_closed_ends_cleanly(
    tmp_path: Path, broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """A CONNECT refused when its CONNACK is due (``_refuse_connect``: the record's erasure of the
    clean CONNECT of LONG_ID does not fit on the full disk) whose websocket client sent a close frame
    and closed its socket right after the CONNECT, held by its credentials' check (GatedAuth, user
    "slow") until the broker has seen the close. The refusal finds the websocket closed: the
    connection ends with no traceback, nothing is deleted (a restart finds the session whole), and
    the broker serves the client id's next CONNECT over websocket once the disk has room. amqtt's
    write of the refusal logged the client's close as a WARNING ("Unhandled exception")."""
    (tmp_path / "gated_auth.py").write_text(GATED_AUTH.format(folder=str(tmp_path)))
    (tmp_path / "gate").write_text("1")
    with small_disk(tmp_path / "disk", 16) as disk:
        broker = broker_factory(start=False, store=str(disk / "store"))
        broker.ws_port = free_port()
        broker.pythonpath.append(str(tmp_path))
        broker.extra_plugins["gated_auth.GatedAuth"] = {}
        broker.start()
        device = clients(broker.port, LONG_ID, username="slow")
        device.subscribe("d/#", 1)
        device.disconnect()
        clients(broker.port, "pub", clean_session=True).publish("d/x", payloads(20))
        filler = fill(disk)
        (tmp_path / "gate").unlink()
        (tmp_path / "entered").unlink()
        ws = StuckWebsocket(broker.ws_port)
        ws.protocol.send_binary(connect_packet(LONG_ID, clean=True, username="slow"))
        ws.protocol.send_close()
        ws._flush()
        assert broker.wait_until((tmp_path / "entered").exists, WAIT), "its credentials are being checked"
        assert ws.sock.recv(64) and ws.sock.recv(1) == b"", "the broker answered the close and closed"
        ws.sock.close()
        (tmp_path / "gate").write_text("1")
        assert broker.wait_until(lambda: "CONNECT refused when its CONNACK was due" in broker.log(), WAIT), (
            broker.log()[-3000:]
        )
        broker.kill()
        filler.unlink()
        broker.start()
        device = clients(broker.ws_port, LONG_ID, username="slow", transport="websockets")
        assert device.session_present is True, "the refused CONNECT deleted nothing"
        assert [m.payload for m in device.wait_messages(20)] == payloads(20)
        log = broker.log()
        assert "connection handler failed" not in log and "Traceback" not in log, log[-3000:]
        # amqtt's write of the refusal logged the client's routine close as a WARNING.
        assert "Unhandled exception" not in log, log[-3000:]


def test_a_clean_connect_retried_after_connack_3_is_refused_until_the_session_erasure_is_written(
    tmp_path: Path, broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """After that CONNACK 3 the session is gone from the broker's memory, its record's erasure not
    written. The client's retry (paho retries after CONNACK 3) is refused with CONNACK 3 too, and a
    restart then finds the session whole: had the retry been accepted (CONNACK 0, "your session is
    discarded", as it was), that restart would have brought the session back (MQTT-3.1.2-6). Once
    the disk has room the erasure is written, and a retry is accepted: a restart finds no session."""
    client_id = LONG_ID
    with full_disk_with_a_long_id_session(tmp_path, broker_factory, clients) as (broker, disk, filler):
        port = broker.port
        assert raw_connect(port, client_id, clean=True) == (CONNACK_UNAVAILABLE, True), "the erasure failed"
        assert raw_connect(port, client_id, clean=True) == (CONNACK_UNAVAILABLE, True), "the retry is refused too"
        assert_whole_after_restart(broker, filler, clients, client_id, "neither CONNECT deleted anything").disconnect()

        monitor = clients(port, "monitor", clean_session=True)
        monitor.subscribe(HEALTH, 1)
        refill = fill(disk)
        assert raw_connect(port, client_id, clean=True) == (CONNACK_UNAVAILABLE, True)
        assert raw_connect(port, client_id, clean=True) == (CONNACK_UNAVAILABLE, True)
        wait_health(monitor, "failing")
        refill.unlink()
        assert monitor.wait_for(lambda _: [h["status"] for h in health_states(monitor)][-1:] == ["ok"], WAIT + 10), (
            f"the store did not recover: {health_states(monitor)}"
        )
        assert raw_connect(port, client_id, clean=True) == (CONNACK_ACCEPTED, False), "erasure written: accepted"
        broker.kill()
        broker.start()
        dev = clients(port, client_id)
        assert dev.session_present is False, "the accepted clean CONNECT's session is gone for good"
        assert not dev.wait_for(bool, timeout=0.5), "with its queue"


def connack_with_password(port: int, client_id: str, user: str, password: str, *, clean: bool) -> bytes:
    """The CONNACK's bytes to a CONNECT with a username and password over a raw socket."""
    body = mqtt_string("MQTT") + bytes([4, 0xC0 | (0x02 if clean else 0), 0, 60]) + mqtt_string(client_id)
    with socket.create_connection((HOST, port), timeout=WAIT) as sock:
        sock.sendall(mqtt_packet(0x10, body + mqtt_string(user) + mqtt_string(password)))
        return read_exactly(sock, 4)


def test_a_wrong_password_gets_connack_5_while_the_store_fails_too(
    tmp_path: Path, broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """guarantees.md: a CONNECT that fails authentication gets CONNACK 5. The early store check (a
    CONNECT that needs a write while the store fails gets 3) ran before the credentials were checked,
    so a wrong password got 3 in an outage: "server unavailable" to a client with bad credentials,
    and to anyone a way to learn that the store fails and which client ids have a durable session.
    A right password still gets 3 then."""
    with small_disk(tmp_path / "disk", 16) as disk:
        broker = acl_broker(broker_factory, store=str(disk / "store"))
        port = broker.port
        monitor = login(clients, broker, "mon", "monitor", clean_session=True)
        monitor.subscribe(HEALTH, 1)
        alice = login(clients, broker, "alice-dev", "alice")
        assert alice.subscribe("secret/#", 1) == [1]
        alice.disconnect()
        publisher = login(clients, broker, "pub", "pub", clean_session=True)
        fill(disk)
        publisher.paho.publish("secret/x", bytes(64 * 1024), qos=1)  # its write finds the disk full
        wait_health(monitor, "failing")

        assert connack_with_password(port, "new-id", "bob", "WRONG", clean=False) == REFUSED
        assert connack_with_password(port, "alice-dev", "alice", "WRONG", clean=True) == REFUSED
        assert connack_with_password(port, "alice-dev", "bob", "WRONG", clean=True) == REFUSED
        assert connack_with_password(port, "new-id", "bob", PASSWORDS["bob"], clean=False) == CONNACK_UNAVAILABLE
        assert connack_with_password(port, "alice-dev", "alice", PASSWORDS["alice"], clean=True) == CONNACK_UNAVAILABLE


@contextlib.contextmanager
def reading_nothing(
    broker: Broker, listener: str
) -> Iterator[tuple[Callable[[bytes], None], Callable[[], bytes], socket.socket]]:
    """A connection to ``broker``'s ``listener`` ("tcp" or "websocket") whose client reads nothing
    but its CONNACK: how to send a packet, how to read the CONNACK, and its socket."""
    if listener == "websocket":
        assert broker.ws_port is not None
        ws = StuckWebsocket(broker.ws_port)
        with ws.sock:
            yield ws.send, ws.receive, ws.sock
        return
    with socket.create_connection((HOST, broker.port), timeout=WAIT) as sock:
        yield sock.sendall, lambda: read_exactly(sock, 4), sock


@pytest.mark.parametrize("listener", ["tcp", "websocket"])
def test_a_publish_that_cannot_be_stored_ends_a_connection_whose_client_reads_nothing(
    tmp_path: Path, broker_factory: Callable[..., Broker], clients: Callable[..., Client], listener: str
) -> None:
    """operations.md, When the disk is full: a QoS 1 PUBLISH that must be stored gets no PUBACK and
    the broker closes the connection (TCP or websocket), its will published, within 10 s also when
    its client reads nothing: here a SUBSCRIBE sent with it matches 10 MB of retained messages the
    client does not read. The connection stayed open: the wait for the PUBACKs due before the refused
    publish to drain had no bound, and the end it then signals is acted on by the message loop (stuck
    writing the retained messages) or by the reader after its next read (the client sends nothing
    more). A websocket one then waited for the closing handshake too (closed after 15 s)."""
    with small_disk(tmp_path / "disk", 96) as disk:
        broker = broker_factory(start=False, store=str(disk / "store"))
        if listener == "websocket":
            broker.ws_port = free_port()
        broker.start()
        keeper = clients(broker.port, "keeper")
        assert keeper.subscribe("d/#", 1) == [1]
        watcher = clients(broker.port, "watcher", clean_session=True)
        assert watcher.subscribe([("will/#", 0), ("c/#", 1)]) == [0, 1]
        retain_big_messages(clients(broker.port, "big-pub", clean_session=True))
        with reading_nothing(broker, listener) as (send, connack, sock):
            send(connect_packet("stuck-pub", clean=True, will_topic=b"will/stuck-pub"))
            assert connack() == CONNACK_ACCEPTED
            fill(disk)
            send(
                mqtt_packet(0x82, b"\x00\x01" + mqtt_string("big/#") + b"\x00")
                + mqtt_packet(0x32, mqtt_string("d/x") + b"\x00\x02" + bytes(64 * 1024))  # past a partly used page
            )
            refused = "stuck-pub: a publish could not be stored"
            assert broker.wait_until(lambda: refused in broker.log(), WAIT), broker.log()[-3000:]
            started = time.monotonic()
            assert watcher.wait_for(lambda ms: any(m.topic == "will/stuck-pub" for m in ms), 2 * WAIT), (
                broker.log()[-3000:]
            )
            took = time.monotonic() - started
            assert read_until_closed(sock, WAIT) is not None, "the connection is still open"
    assert took < 13.0, f"the will came {took:.2f} s after the refusal (documented: closed within 10 s)"
