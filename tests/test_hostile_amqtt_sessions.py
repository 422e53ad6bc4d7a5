"""amqtt keeps an in-memory Session per client id until its session monitor removes it, and it
removes only anonymous and clean ones: with a password plugin, every durable client id would stay
in amqtt's table after its durable session ended (expiry, a clean CONNECT, end_session), so a
client cycling fresh client ids would grow the broker's memory without bound. Against a real
broker with file authentication; a probe plugin reports amqtt's table."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from pathlib import Path

from pwdlib.hashers.argon2 import Argon2Hasher
from raw_mqtt_helpers import connect_packet, raw_subscribe, read_exactly, read_packet
from test_hostile_door_limits import slow_auth_broker
from test_hostile_owner import PASSWORDS, login
from test_hostile_wire import read_until_closed
from test_recovery_and_crash import EXPIRED_TOPIC
from websockets.client import ClientProtocol
from websockets.frames import Frame, Opcode
from websockets.protocol import State
from websockets.typing import Subprotocol
from websockets.uri import parse_uri

from amqtt_durable.process import free_port
from conftest import HOST, WAIT, Broker, Client, connack_code, mqtt_packet, mqtt_string
from durable_client import DurableClient

PROBE_PLUGIN = '''
import json

from amqtt.plugins.base import BasePlugin


class AmqttSessions(BasePlugin):
    """Test plugin: a message to probe/sessions is answered on probe/sessions/ids with the client
    ids of amqtt's session table."""

    async def on_broker_message_received(self, *, client_id, message):
        if message.topic == "probe/sessions":
            ids = sorted(self.context._broker_instance._sessions)
            await self.context.broadcast_message("probe/sessions/ids", json.dumps(ids).encode())
'''


def login_and_leave(port: int, client_id: str, user: str, *, clean: bool) -> None:
    """CONNECT with the user's password, CONNACK 0, DISCONNECT."""
    flags = 0xC0 | (0x02 if clean else 0)
    body = mqtt_string("MQTT") + bytes([4, flags, 0, 60]) + mqtt_string(client_id)
    body += mqtt_string(user) + mqtt_string(PASSWORDS[user])
    with socket.create_connection((HOST, port), timeout=WAIT) as sock:
        sock.sendall(mqtt_packet(0x10, body))
        assert sock.recv(4) == b"\x20\x02\x00\x00"
        sock.sendall(bytes((0xE0, 0)))
        assert sock.recv(1) == b"", "closed after DISCONNECT"


def wait_expired(monitor: Client, client_ids: list[str]) -> None:
    """Until the $SYS expired events of every one of ``client_ids`` arrived."""
    wanted = set(client_ids)
    assert monitor.wait_for(
        lambda ms: {json.loads(m.payload)["client_id"] for m in ms if m.topic == EXPIRED_TOPIC} >= wanted, 4 * WAIT
    )


def amqtt_table(monitor: Client) -> list[str]:
    """The client ids in amqtt's session table (the probe plugin's answer)."""
    before = len(monitor.messages)
    monitor.paho.publish("probe/sessions", b"", qos=0)
    assert monitor.wait_for(lambda ms: any(m.topic == "probe/sessions/ids" for m in ms[before:]))
    return json.loads(next(m.payload for m in monitor.messages[before:] if m.topic == "probe/sessions/ids"))


def password_broker(
    broker_factory: Callable[..., Broker], tmp_path: Path, *, websocket: bool = False, **settings: object
) -> Broker:
    """File authentication, no anonymous clients (as a deployment with passwords runs), and the probe."""
    (tmp_path / "amqtt_sessions_probe.py").write_text(PROBE_PLUGIN)
    broker: Broker = broker_factory(start=False, **settings)
    if websocket:
        broker.ws_port = free_port()
    broker.pythonpath.append(str(tmp_path))
    broker.extra_plugins["amqtt_sessions_probe.AmqttSessions"] = {}
    hasher = Argon2Hasher(time_cost=1, memory_cost=8, parallelism=1)
    password_file = tmp_path / "passwd"
    password_file.write_text("".join(f"{user}:{hasher.hash(PASSWORDS[user])}\n" for user in ("alice", "monitor")))
    broker.extra_plugins["amqtt.plugins.authentication.AnonymousAuthPlugin"] = {"allow_anonymous": False}
    broker.extra_plugins["amqtt.plugins.authentication.FileAuthPlugin"] = {"password_file": str(password_file)}
    broker.ready = lambda: connack_code(broker.port) == 5  # type: ignore[method-assign]  # anonymous: refused
    return broker.start()


def test_amqtt_forgets_an_authenticated_durable_client_id_once_its_session_expires(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], tmp_path: Path
) -> None:
    broker = password_broker(broker_factory, tmp_path, session_expiry=1)
    monitor = login(clients, broker, "monitor", "monitor", clean_session=True)
    monitor.subscribe("probe/#", 0)
    monitor.subscribe(EXPIRED_TOPIC, 1)
    for cycle in range(3):
        ids = [f"cycle{cycle}-{i}" for i in range(10)]
        for client_id in ids:
            login_and_leave(broker.port, client_id, "alice", clean=False)
        wait_expired(monitor, ids)
        left = [client_id for client_id in amqtt_table(monitor) if client_id.startswith("cycle")]
        assert left == [], f"cycle {cycle}: amqtt still holds {left}"


def test_amqtt_forgets_a_client_id_whose_session_ended_by_end_session_and_keeps_live_ones(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], sdk: Callable[..., DurableClient],
    tmp_path: Path,
) -> None:
    broker = password_broker(broker_factory, tmp_path)
    monitor = login(clients, broker, "monitor", "monitor", clean_session=True)
    monitor.subscribe("probe/#", 0)
    kept = sdk(broker.port, "kept", username="alice", password=PASSWORDS["alice"])
    kept.connect(timeout=WAIT)
    kept.close(keep_session=True)  # disconnected, its durable session kept
    for i in range(5):
        ending = sdk(broker.port, f"ending-{i}", username="alice", password=PASSWORDS["alice"])
        ending.connect(timeout=WAIT)
        ending.close(keep_session=False)  # end_session, then DISCONNECT
    assert broker.wait_until(lambda: not [c for c in amqtt_table(monitor) if c.startswith("ending")], WAIT)
    table = amqtt_table(monitor)
    assert "kept" in table and "monitor" in table, table


def failed_login(port: int, client_id: str, *, clean: bool) -> bytes:
    """A CONNECT of alice with a wrong password; the broker's answer."""
    flags = 0xC0 | (0x02 if clean else 0)  # username, password
    body = mqtt_string("MQTT") + bytes([4, flags, 0, 60]) + mqtt_string(client_id)
    body += mqtt_string("alice") + mqtt_string(PASSWORDS["alice"] + "-wrong")
    with socket.create_connection((HOST, port), timeout=WAIT) as sock:
        sock.sendall(mqtt_packet(0x10, body))
        answer = sock.recv(4)
        assert sock.recv(1) == b"", "closed after CONNACK 5"
        return answer


def test_failed_logins_with_fresh_client_ids_leave_nothing_in_amqtts_table(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], tmp_path: Path
) -> None:
    """amqtt put the Session of a CONNECT that failed its authentication in its table, marked
    connected, and nothing ever removed it: every failed login with a fresh client id (durable,
    clean, or one amqtt generated for an empty client id) grew the broker's memory for ever."""
    broker = password_broker(broker_factory, tmp_path)
    monitor = login(clients, broker, "monitor", "monitor", clean_session=True)
    monitor.subscribe("probe/#", 0)
    before = amqtt_table(monitor)
    for i in range(30):
        assert failed_login(broker.port, f"durable-{i}", clean=False) == b"\x20\x02\x00\x05"
        assert failed_login(broker.port, f"clean-{i}", clean=True) == b"\x20\x02\x00\x05"
        assert failed_login(broker.port, "", clean=True) == b"\x20\x02\x00\x05"
    after = amqtt_table(monitor)
    assert after == before, f"amqtt's table grew by {sorted(set(after) - set(before))[:5]}... ({len(after)})"


def test_failed_logins_of_a_durable_client_id_amqtt_holds_no_session_of_leave_its_next_login_served(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], tmp_path: Path
) -> None:
    """guarantees.md: a refused CONNECT touches nothing (review 250). alice's durable session "dev"
    holds a queued message; after a restart amqtt's table has no Session of "dev". CONNECTs of
    "dev" that fail (a wrong password, durable and clean; another user, "monitor") leave nothing
    there, and alice's next CONNECT of "dev" is served as if none had come: session present, the
    queued message, and the connection stays up (a Session left marked connected would have been
    taken over, or the new connection ended by amqtt's session monitor)."""
    broker = password_broker(broker_factory, tmp_path)
    device = login(clients, broker, "dev", "alice")
    assert device.subscribe("t/#", 1) == [1]
    device.disconnect()
    monitor = login(clients, broker, "monitor", "monitor", clean_session=True)
    monitor.publish("t/1", [b"queued"], qos=1)
    monitor.disconnect()
    broker.stop()
    broker.start()
    monitor = login(clients, broker, "monitor", "monitor", clean_session=True)
    monitor.subscribe("probe/#", 0)
    assert "dev" not in amqtt_table(monitor)
    assert failed_login(broker.port, "dev", clean=False) == b"\x20\x02\x00\x05"
    assert failed_login(broker.port, "dev", clean=True) == b"\x20\x02\x00\x05"
    assert connect_as(broker.port, "dev", "monitor") == b"\x20\x02\x00\x05"
    assert "dev" not in amqtt_table(monitor)
    device = login(clients, broker, "dev", "alice")
    assert device.session_present
    assert device.wait_for(lambda ms: [m.payload for m in ms] == [b"queued"]), device.messages
    assert not device.wait_disconnected(1.5), "the login of 'dev' was ended"  # a session monitor pass
    monitor.publish("t/2", [b"live"], qos=1)
    assert device.wait_for(lambda ms: len(ms) == 2), "the login of 'dev' was not served"


def connect_as(port: int, client_id: str, user: str) -> bytes:
    """A durable CONNECT of ``user`` with the user's own password; the broker's answer."""
    body = mqtt_string("MQTT") + bytes([4, 0xC0, 0, 60]) + mqtt_string(client_id)
    body += mqtt_string(user) + mqtt_string(PASSWORDS[user])
    with socket.create_connection((HOST, port), timeout=WAIT) as sock:
        sock.sendall(mqtt_packet(0x10, body))
        return read_exactly(sock, 4)


def test_a_failed_login_racing_a_live_connection_of_its_client_id_leaves_that_connection_its_messages(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], tmp_path: Path
) -> None:
    """guarantees.md: amqtt keeps nothing of a CONNECT that failed authentication. A failed login
    (a slow password check) of client id "dup" while a legitimate clean connection of "dup"
    connects and subscribes: amqtt's table entry of the legitimate one is put back, and it still
    gets its messages."""
    broker, entered, gate = slow_auth_broker(broker_factory, tmp_path, False)
    try:
        with socket.create_connection((HOST, broker.port), timeout=WAIT) as failing:
            failing.sendall(connect_packet("dup", clean=True, username="slow"))
            assert broker.wait_until(entered.exists, WAIT), "the failing login is being authenticated"
            live = clients(broker.port, "dup", clean_session=True)
            assert live.subscribe("t/#", 1) == [1]
            gate.write_text("1")
            assert read_exactly(failing, 4) == b"\x20\x02\x00\x05"
        publisher = clients(broker.port, "pub", clean_session=True)
        publisher.publish("t/1", [b"hello"], qos=1)
        got = live.wait_for(lambda ms: any(m.topic == "t/1" for m in ms), 5)
        assert got, "the live connection of 'dup' gets nothing: its entry in amqtt's table is gone"
    finally:
        gate.write_text("1")


class StuckWebsocket:
    """A websocket MQTT client over a raw socket (websockets' sans-I/O protocol) that answers
    nothing the broker sends: in particular not the close frame of the broker's closing handshake,
    which the broker then waits for (websockets' close_timeout, 10 s) before it drops the connection."""

    def __init__(self, ws_port: int) -> None:
        self.sock = socket.create_connection((HOST, ws_port), timeout=WAIT)
        self.protocol = ClientProtocol(parse_uri(f"ws://{HOST}:{ws_port}/"), subprotocols=[Subprotocol("mqtt")])
        self.protocol.send_request(self.protocol.connect())
        self._flush()
        while self.protocol.state is State.CONNECTING:
            self._receive()
        assert self.protocol.state is State.OPEN, self.protocol.handshake_exc

    def _flush(self) -> None:
        for data in self.protocol.data_to_send():
            self.sock.sendall(data)

    def _receive(self) -> bool:
        data = self.sock.recv(65536)
        if data:
            self.protocol.receive_data(data)
        else:
            self.protocol.receive_eof()
        return bool(data)

    def send(self, packet: bytes) -> None:
        self.protocol.send_binary(packet)
        self._flush()

    def receive(self) -> bytes:
        """The next binary message (an MQTT packet, as the broker frames them)."""
        while True:
            for event in self.protocol.events_received():
                if isinstance(event, Frame) and event.opcode is Opcode.BINARY:
                    return bytes(event.data)
            assert self._receive(), "closed"


def alice_connect(client_id: str, *, clean: bool, will_topic: str | None = None) -> bytes:
    """A CONNECT of alice with her password; with ``will_topic``, a will (QoS 0, "gone")."""
    flags = 0xC0 | (0x02 if clean else 0) | (0x04 if will_topic is not None else 0)
    body = mqtt_string("MQTT") + bytes([4, flags, 0, 60]) + mqtt_string(client_id)
    if will_topic is not None:
        body += mqtt_string(will_topic) + mqtt_string("gone")
    return mqtt_packet(0x10, body + mqtt_string("alice") + mqtt_string(PASSWORDS["alice"]))


def test_a_clean_take_over_of_a_websocket_client_that_answers_nothing_gets_its_connack_within_connect_timeout(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], tmp_path: Path
) -> None:
    """MQTT-3.1.4-2 and configuration.md connect_timeout: a clean CONNECT of a client id connected
    over a websocket by a client that answers nothing (not the closing handshake either) ends that
    connection, whose will is published once, and gets its CONNACK within connect_timeout (1 s).
    The take-over waited for the old client's close frame (websockets waits 10 s) with the new
    CONNECT's connect_timeout running: both connections ended, the new one with no CONNACK, and so
    did every reconnect of the client id until then. amqtt's table keeps no Session of it after."""
    broker = password_broker(broker_factory, tmp_path, websocket=True, connect_timeout=1)
    monitor = login(clients, broker, "monitor", "monitor", clean_session=True)
    monitor.subscribe([("probe/#", 0), ("will/#", 0)])
    old = StuckWebsocket(broker.ws_port)
    old.send(alice_connect("dev", clean=True, will_topic="will/dev"))
    assert old.receive() == b"\x20\x02\x00\x00"
    with socket.create_connection((HOST, broker.port), timeout=WAIT) as new:
        new.sendall(alice_connect("dev", clean=True))
        assert read_exactly(new, 4) == b"\x20\x02\x00\x00"
        assert read_until_closed(old.sock, WAIT) is not None, "the connection taken over is still open"
        old.sock.close()
        assert raw_subscribe(new, "t/#", 0) == 0
        monitor.publish("t/1", [b"to the new connection"], qos=0)
        assert read_packet(new) == (0x30, mqtt_string("t/1") + b"to the new connection")
        new.sendall(bytes((0xE0, 0)))  # DISCONNECT
        assert read_until_closed(new, WAIT) == b""
    assert monitor.wait_for(lambda ms: any(m.topic == "will/dev" for m in ms)), "no will of the connection taken over"
    assert broker.wait_until(lambda: "dev" not in amqtt_table(monitor), WAIT), "amqtt keeps a Session of 'dev'"
    assert [m.payload for m in monitor.messages if m.topic == "will/dev"] == [b"gone"], "the will, once"


def test_a_durable_take_over_of_a_websocket_client_that_answers_nothing_gets_its_connack_and_the_messages_in_flight(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], tmp_path: Path
) -> None:
    """MQTT-3.1.4-2 and configuration.md connect_timeout, for a durable (clean_session=false)
    CONNECT: it takes the client id over from a websocket client that answers nothing, gets its
    CONNACK (session present) well within connect_timeout, and the message the old connection had
    in flight, unacknowledged, is delivered again on the new one, with DUP (MQTT-4.4.0-1); the old
    connection's will is published once. amqtt's take-over waited 10 s (websockets' close_timeout)
    for the old client's close frame before the new CONNACK: past connect_timeout (1 s here)."""
    broker = password_broker(broker_factory, tmp_path, websocket=True, connect_timeout=1)
    monitor = login(clients, broker, "monitor", "monitor", clean_session=True)
    monitor.subscribe([("will/#", 0)])
    old = StuckWebsocket(broker.ws_port)
    old.send(alice_connect("dev", clean=False, will_topic="will/dev"))
    assert old.receive() == b"\x20\x02\x00\x00"
    old.send(mqtt_packet(0x82, b"\x00\x01" + mqtt_string("t/#") + b"\x01"))
    assert old.receive() == b"\x90\x03\x00\x01\x01"
    monitor.publish("t/1", [b"in flight"], qos=1)
    in_flight = old.receive()  # not acknowledged
    assert in_flight[:1] == b"\x32" and in_flight.endswith(b"in flight"), in_flight
    packet_id = in_flight[2 + len(mqtt_string("t/1")) : 4 + len(mqtt_string("t/1"))]
    with socket.create_connection((HOST, broker.port), timeout=WAIT) as new:
        began = time.monotonic()
        new.sendall(alice_connect("dev", clean=False))
        connack = read_exactly(new, 4)
        took = time.monotonic() - began
        assert connack == b"\x20\x02\x01\x00" and took < 3, (connack, took)
        assert read_packet(new) == (0x3A, mqtt_string("t/1") + packet_id + b"in flight"), "again, with DUP"
        new.sendall(b"\x40\x02" + packet_id)  # PUBACK
        assert read_until_closed(old.sock, WAIT) is not None, "the connection taken over is still open"
        old.sock.close()
        new.sendall(bytes((0xE0, 0)))  # DISCONNECT
        assert read_until_closed(new, WAIT) == b""
    assert monitor.wait_for(lambda ms: any(m.topic == "will/dev" for m in ms)), "no will of the connection taken over"
    assert [m.payload for m in monitor.messages if m.topic == "will/dev"] == [b"gone"], "the will, once"
