"""Durable sessions next to amqtt's own paths: clean subscribers, retained messages, topic ACL plugins,
and PUBACK order when acknowledgements wait for the store."""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import HOST, WAIT, Broker, Client, free_port, payloads


def test_clean_and_durable_subscribers_both_get_every_message(broker: Broker, clients: Callable[..., Client]) -> None:
    durable = clients(broker.port, "durable")
    durable.subscribe("mix/#", 1)
    clean = clients(broker.port, "clean", clean_session=True)
    clean.subscribe("mix/#", 1)
    sent = payloads(500)
    clients(broker.port, "pub", clean_session=True).publish("mix/a", sent, qos=1)
    assert [m.payload for m in durable.wait_messages(500)] == sent
    assert sorted(m.payload for m in clean.wait_messages(500)) == sent


def test_retained_message_reaches_later_durable_and_clean_subscribers(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    pub = clients(broker.port, "pub", clean_session=True)
    pub.publish("state/lamp", [b"on"], qos=1, retain=True)
    durable = clients(broker.port, "durable")
    durable.subscribe("state/#", 1)
    got = durable.wait_messages(1)
    assert [(m.payload, m.retain) for m in got] == [(b"on", True)], "retained on subscribe carries RETAIN=1"
    clean = clients(broker.port, "clean", clean_session=True)
    clean.subscribe("state/#", 1)
    assert [(m.payload, m.retain) for m in clean.wait_messages(1)] == [(b"on", True)]
    durable.disconnect()
    assert durable.connect() is True
    assert not durable.wait_for(lambda ms: len(ms) > 1, timeout=0.5), "no retained replay on a mere reconnect"


def test_topic_acl_plugin_applies_to_durable_sessions(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    broker = broker_factory(start=False)
    broker.extra_plugins["amqtt.plugins.topic_checking.TopicTabooPlugin"] = {}
    broker.start()
    sub = clients(broker.port, "dev")
    assert sub.subscribe("prohibited", 1) == [0x80], "a taboo filter is refused for a durable session too"
    assert sub.subscribe("#", 1) == [1]
    sub.disconnect()
    pub = clients(broker.port, "pub", clean_session=True)
    pub.publish("prohibited", [b"secret"], qos=1)
    pub.publish("fine", payloads(50), qos=1)
    assert sub.connect() is True
    assert [m.payload for m in sub.wait_messages(50)] == payloads(50)
    assert not sub.wait_for(lambda ms: len(ms) > 50, timeout=0.5), "a publish the ACL refuses is never queued"


@pytest.mark.parametrize("amqtt_reader", [False, True], ids=["plugin-reader", "amqtt-reader"])
def test_pubacks_come_in_publish_order(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], amqtt_reader: bool
) -> None:
    """MQTT-4.6.0-2: with and without durable subscribers, PUBACKs follow the PUBLISH order, also on
    amqtt's own reader (used when a topic-filter plugin is loaded)."""
    broker = broker_factory(start=False)
    if amqtt_reader:
        broker.extra_plugins["amqtt.plugins.topic_checking.TopicTabooPlugin"] = {}
    broker.start()
    sub = clients(broker.port, "durable")
    sub.subscribe("ordered/with", 1)
    sock = socket.create_connection((HOST, broker.port), timeout=WAIT)
    client_id = b"raw-pub"
    connect = b"\x00\x04MQTT\x04\x02\x00\x3c" + struct.pack(">H", len(client_id)) + client_id
    sock.sendall(bytes([0x10, len(connect)]) + connect)
    assert sock.recv(4)[:1] == b"\x20"
    packets = []
    for packet_id in range(1, 301):
        topic = b"ordered/with" if packet_id % 3 else b"ordered/without"
        body = struct.pack(">H", len(topic)) + topic + struct.pack(">H", packet_id) + b"x"
        packets.append(bytes([0x32, len(body)]) + body)
    sock.sendall(b"".join(packets))
    received = b""
    while len(received) < 4 * 300:
        chunk = sock.recv(65536)
        assert chunk, "connection closed before every PUBACK arrived"
        received += chunk
    sock.close()
    acked = [struct.unpack(">H", received[i + 2 : i + 4])[0] for i in range(0, len(received), 4)]
    assert received[::4] == b"\x40" * 300
    assert acked == list(range(1, 301))
    assert len(sub.wait_messages(200)) == 200


def test_silent_client_is_disconnected_after_one_and_a_half_keepalives(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    """MQTT-3.1.2-24: a half-open device must not hold its durable session 'connected' forever."""
    sock = socket.create_connection((HOST, broker.port), timeout=WAIT)
    client_id = b"half-open"
    connect = b"\x00\x04MQTT\x04\x00\x00\x01" + struct.pack(">H", len(client_id)) + client_id  # keep-alive 1 s
    sock.sendall(bytes([0x10, len(connect)]) + connect)
    assert sock.recv(4)[:1] == b"\x20"
    subscribe = struct.pack(">H", 1) + struct.pack(">H", 1) + b"k" + b"\x01"
    sock.sendall(bytes([0x82, len(subscribe)]) + subscribe)
    assert sock.recv(5)[:1] == b"\x90"
    assert sock.recv(1) == b"", "the broker must close a connection silent for 1.5 keep-alive periods"
    sock.close()
    clients(broker.port, "pub", clean_session=True).publish("k", [b"queued-while-gone"], qos=1)
    again = clients(broker.port, "half-open")
    assert again.session_present is True
    assert [m.payload for m in again.wait_messages(1)] == [b"queued-while-gone"]


RECEIVE_ACL_PLUGIN = '''
from dataclasses import dataclass, field

from amqtt.contexts import Action
from amqtt.plugins.base import BaseTopicPlugin


class ReceiveAcl(BaseTopicPlugin):
    """Test plugin: users may receive only topics under their prefixes."""

    @dataclass
    class Config:
        receive: dict = field(default_factory=dict)

    async def topic_filtering(self, *, session=None, topic=None, action=None):
        if action != Action.RECEIVE:
            return True
        user = (session.username if session else None) or "anonymous"
        return any(topic.startswith(prefix) for prefix in self.context.config.receive.get(user, []))
'''


def test_receive_acl_applies_to_durable_sessions_across_a_restart(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], tmp_path: Path
) -> None:
    (tmp_path / "receive_acl.py").write_text(RECEIVE_ACL_PLUGIN)
    broker = broker_factory(start=False)
    broker.pythonpath.append(str(tmp_path))
    broker.extra_plugins["receive_acl.ReceiveAcl"] = {"receive": {"alice": ["a/"], "bob": ["b/"]}}
    broker.start()
    alice = clients(broker.port, "alice-dev", username="alice")
    bob = clients(broker.port, "bob-dev", username="bob")
    for device in (alice, bob):
        assert device.subscribe("#", 1) == [1]
        device.disconnect()
    broker.restart(kill=True)  # the usernames the ACL needs come from the store now
    pub = clients(broker.port, "pub", clean_session=True)
    pub.publish("a/1", [b"for-alice"], qos=1)
    pub.publish("b/1", [b"for-bob"], qos=1)
    assert alice.connect() is True and bob.connect() is True
    assert [m.payload for m in alice.wait_messages(1)] == [b"for-alice"]
    assert [m.payload for m in bob.wait_messages(1)] == [b"for-bob"]
    assert not alice.wait_for(lambda ms: len(ms) > 1, timeout=0.5)
    assert not bob.wait_for(lambda ms: len(ms) > 1, timeout=0.1)


def test_durable_session_over_websockets(broker_factory: Callable[..., Broker], clients: Callable[..., Client]) -> None:
    """Websocket connections use amqtt's reader; the pump's writes and PUBACKs must still flow."""
    broker = broker_factory(start=False)
    broker.ws_port = free_port()
    broker.start()
    ws_port = broker.ws_port
    device = clients(ws_port, "ws-device", transport="websockets")
    assert device.subscribe("ws/#", 1) == [1]
    device.disconnect()
    sent = payloads(200)
    clients(broker.port, "pub", clean_session=True).publish("ws/t", sent, qos=1)
    assert device.connect() is True
    assert [m.payload for m in device.wait_messages(200)] == sent
    ws_pub = clients(ws_port, "ws-pub", clean_session=True, transport="websockets")
    ws_pub.publish("ws/t", payloads(100, "w"), qos=1)  # waits for every PUBACK over websockets
    assert [m.payload for m in device.wait_messages(300)][200:] == payloads(100, "w")


def test_client_silent_in_the_middle_of_a_packet_is_disconnected(broker: Broker) -> None:
    sock = socket.create_connection((HOST, broker.port), timeout=WAIT)
    client_id = b"half-packet"
    connect = b"\x00\x04MQTT\x04\x00\x00\x01" + struct.pack(">H", len(client_id)) + client_id  # keep-alive 1 s
    sock.sendall(bytes([0x10, len(connect)]) + connect)
    assert sock.recv(4)[:1] == b"\x20"
    sock.sendall(b"\x32\x20\x00\x05")  # a PUBLISH announcing 32 bytes, then silence
    assert sock.recv(1) == b"", "a packet left unfinished past 1.5 keep-alive periods must end the connection"
    sock.close()
