"""MQTT-3.14.4-3: a client that sent DISCONNECT has its will discarded; one whose connection
just drops has it published (MQTT-3.1.2-8).

amqtt hands a DISCONNECT to a one-shot disconnect waiter its message loop asks for only when it
starts. A DISCONNECT read before that (while the durable attach waited for a store commit, or in
the same read as the CONNECT) left the loop no waiter, or a fresh one the connection's end
resolved with None, and amqtt took the None for an abnormal end: it published the will.

Each case runs many clients (the race is a matter of scheduling), then a client that drops its
connection without DISCONNECT: its will is published. A test plugin publishes closed/<client id>
as amqtt reports each connection's end (CLIENT_DISCONNECTED, fired after the will is queued, both
through the same broadcast queue): once every client's has arrived, every will there is has too.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

import pytest
from raw_mqtt_helpers import connect_packet, read_exactly
from test_hostile_wire import read_until_closed

from conftest import HOST, WAIT, Broker, Client, mqtt_packet, mqtt_string

CLIENTS = 20
DISCONNECT = b"\xe0\x00"
TOPIC_PLUGIN = "amqtt.plugins.topic_checking.TopicTabooPlugin"
"""Any topic plugin makes the broker read with amqtt's own loop instead of the plugin's."""
CLOSED_PLUGIN = """
from amqtt.plugins.base import BasePlugin


class Closed(BasePlugin):
    async def on_broker_client_disconnected(self, *, client_id, client_session):
        await self.context.broadcast_message(f"closed/{client_id}", b"")
"""
"""Neither a topic plugin nor a PACKET_RECEIVED listener: the plugin's reader stays in use."""


def start_broker(
    broker_factory: Callable[..., Broker], tmp_path: Path, *, amqtt_reader: bool, **config: object
) -> Broker:
    (tmp_path / "closed_marker.py").write_text(CLOSED_PLUGIN)
    broker = broker_factory(start=False, **config)
    broker.pythonpath.append(str(tmp_path))
    broker.extra_plugins["closed_marker.Closed"] = {}
    if amqtt_reader:
        broker.extra_plugins[TOPIC_PLUGIN] = {}
    broker.start()
    return broker


def watch(clients: Callable[..., Client], broker: Broker) -> Client:
    watcher = clients(broker.port, "watch", clean_session=True)
    assert watcher.subscribe([("will/#", 0), ("closed/#", 0)]) == [0, 0]
    return watcher


def drop_one(broker: Broker, clean: bool) -> None:
    """A client whose connection drops without DISCONNECT (its will must be published)."""
    with socket.create_connection((HOST, broker.port), timeout=WAIT) as sock:
        sock.sendall(connect_packet("dropper", clean=clean, will_topic=b"will/dropper"))
        assert read_exactly(sock, 4)[:2] == b"\x20\x02"


def wills_once_closed(watcher: Client, client_ids: list[str]) -> list[str]:
    """The will topics published once every client's connection end has been reported."""
    expected = {f"closed/{client_id}" for client_id in client_ids}
    assert watcher.wait_for(lambda ms: {m.topic for m in ms} >= expected), (
        f"connection ends never reported: {sorted(expected - {m.topic for m in watcher.messages})}"
    )
    return sorted(m.topic for m in watcher.messages if m.topic.startswith("will/"))


def connack_publish_disconnect(sock: socket.socket, client_id: str, clean: bool, will_topic: bytes) -> None:
    """CONNECT, CONNACK read, then a QoS 0 PUBLISH and DISCONNECT in one write, and the client's side shut."""
    sock.sendall(connect_packet(client_id, clean=clean, will_topic=will_topic))
    assert read_exactly(sock, 4)[:2] == b"\x20\x02"
    sock.sendall(mqtt_packet(0x30, mqtt_string("data/x") + b"v") + DISCONNECT)
    sock.shutdown(socket.SHUT_WR)
    assert read_until_closed(sock, WAIT) is not None, "the broker did not close the connection"


def connect_disconnect_close(sock: socket.socket, client_id: str, clean: bool, will_topic: bytes) -> None:
    """CONNECT and DISCONNECT in one write, then the socket closed."""
    sock.sendall(connect_packet(client_id, clean=clean, will_topic=will_topic) + DISCONNECT)


@pytest.mark.parametrize("amqtt_reader", [False, True], ids=["plugin-reader", "amqtt-reader"])
@pytest.mark.parametrize("clean", [False, True], ids=["durable", "clean"])
@pytest.mark.parametrize(
    "send", [connack_publish_disconnect, connect_disconnect_close], ids=["after-connack", "with-connect"]
)
def test_a_client_that_sent_disconnect_has_no_will_and_one_that_dropped_has_it(
    broker_factory: Callable[..., Broker],
    clients: Callable[..., Client],
    tmp_path: Path,
    *,
    send: Callable[[socket.socket, str, bool, bytes], None],
    clean: bool,
    amqtt_reader: bool,
) -> None:
    broker = start_broker(broker_factory, tmp_path, amqtt_reader=amqtt_reader, session_expiry=0)
    watcher = watch(clients, broker)
    ids = [f"bye-{n}" for n in range(CLIENTS)]
    for client_id in ids:
        with socket.create_connection((HOST, broker.port), timeout=WAIT) as sock:
            send(sock, client_id, clean, f"will/{client_id}".encode())
    drop_one(broker, clean)
    wills = wills_once_closed(watcher, [*ids, "dropper"])
    assert "will/dropper" in wills, "the will of a client whose connection dropped was not published"
    wills.remove("will/dropper")
    assert not wills, f"{len(wills)}/{CLIENTS} wills published although their clients sent DISCONNECT: {wills}"


VIOLATIONS: dict[str, Callable[[str, bool], bytes]] = {
    "reserved-type": lambda client_id, clean: b"\xf0\x00",
    "second-connect": lambda client_id, clean: connect_packet(client_id, clean=clean),
}


@pytest.mark.parametrize("amqtt_reader", [False, True], ids=["plugin-reader", "amqtt-reader"])
@pytest.mark.parametrize("clean", [False, True], ids=["durable", "clean"])
@pytest.mark.parametrize("violation", list(VIOLATIONS))
def test_a_disconnect_after_a_protocol_violation_does_not_discard_the_will(
    broker_factory: Callable[..., Broker],
    clients: Callable[..., Client],
    tmp_path: Path,
    *,
    violation: str,
    clean: bool,
    amqtt_reader: bool,
) -> None:
    """The server ends the connection on a reserved packet type or a second CONNECT (MQTT-3.1.0-2):
    its will is published (MQTT-3.1.2-8), although a DISCONNECT came in the same read after it
    (both readers handle what they had read)."""
    broker = start_broker(broker_factory, tmp_path, amqtt_reader=amqtt_reader, session_expiry=60)
    watcher = watch(clients, broker)
    ids = [f"bad-{n}" for n in range(5)]
    for client_id in ids:
        with socket.create_connection((HOST, broker.port), timeout=WAIT) as sock:
            sock.sendall(connect_packet(client_id, clean=clean, will_topic=f"will/{client_id}".encode()))
            assert read_exactly(sock, 4)[:2] == b"\x20\x02"
            sock.sendall(VIOLATIONS[violation](client_id, clean) + DISCONNECT)
            sock.shutdown(socket.SHUT_WR)
            assert read_until_closed(sock, WAIT) is not None, "the broker did not close the connection"
    assert wills_once_closed(watcher, ids) == sorted(f"will/{client_id}" for client_id in ids)


@pytest.mark.parametrize(
    "cleans",
    [(old, new) for new in (False, True) for old in (False, True)],
    ids=lambda cleans: "old-{}-new-{}".format(*("clean" if clean else "durable" for clean in cleans)),
)
def test_a_taken_over_connection_publishes_its_own_will_and_not_the_new_ones(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], tmp_path: Path, cleans: tuple[bool, bool]
) -> None:
    """MQTT-3.1.4-2 / 3.1.2-8 / 3.14.4-3: a connection taken over by a newer CONNECT of its client
    id is ended by the broker, without DISCONNECT: its own will is published; the newer one, which
    sends DISCONNECT, has none. (amqtt had given the shared Session the new will before ending the
    old connection, which then published the new client's will; and a clean CONNECT deleted the
    Session and left the old connection open.)"""
    old_clean, new_clean = cleans
    broker = start_broker(broker_factory, tmp_path, amqtt_reader=False, session_expiry=60)
    watcher = watch(clients, broker)
    with socket.create_connection((HOST, broker.port), timeout=WAIT) as old:
        old.sendall(connect_packet("dev", clean=old_clean, will_topic=b"will/old"))
        assert read_exactly(old, 4)[:2] == b"\x20\x02"
        with socket.create_connection((HOST, broker.port), timeout=WAIT) as new:
            new.sendall(connect_packet("dev", clean=new_clean, will_topic=b"will/new"))
            assert read_exactly(new, 4)[:2] == b"\x20\x02"
            assert read_until_closed(old, WAIT) is not None, "taken over: the broker did not end it"
            new.sendall(DISCONNECT)
            new.shutdown(socket.SHUT_WR)
            assert read_until_closed(new, WAIT) is not None, "the broker did not close the connection"
    assert watcher.wait_for(lambda ms: sum(m.topic == "closed/dev" for m in ms) >= 2), "both ends never reported"
    assert sorted(m.topic for m in watcher.messages if m.topic.startswith("will/")) == ["will/old"]


@pytest.mark.parametrize("new_clean", [True, False], ids=["new-clean", "new-durable"])
def test_a_disconnect_read_while_a_take_over_waits_discards_the_older_connection_s_will(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], tmp_path: Path, new_clean: bool
) -> None:
    """MQTT-3.14.4-3, on both paths of a take-over: the older connection (with a will) is stuck
    sending retained messages it does not read, a SUBSCRIBE waiting behind, so the take-over waits
    for it (up to 5 s); it sends DISCONNECT meanwhile, before the broker closes it: no will. A
    clean CONNECT's take-over published it (the DISCONNECT counted for nothing once the take-over
    had begun), a durable one's did not."""
    broker = start_broker(broker_factory, tmp_path, amqtt_reader=False, session_expiry=60)
    watcher = watch(clients, broker)
    publisher = clients(broker.port, "big-pub", clean_session=True)
    for i in range(50):
        publisher.publish(f"big/{i}", [b"x" * 200_000], qos=1, retain=True)
    with socket.create_connection((HOST, broker.port), timeout=WAIT) as old:
        old.sendall(connect_packet("dev", clean=True, will_topic=b"will/old"))
        assert read_exactly(old, 4) == b"\x20\x02\x00\x00"
        old.sendall(mqtt_packet(0x82, b"\x00\x01" + mqtt_string("big/#") + b"\x00"))
        old.sendall(mqtt_packet(0x82, b"\x00\x02" + mqtt_string("c/#") + b"\x02"))  # waits behind
        with socket.create_connection((HOST, broker.port), timeout=WAIT) as new:
            new.sendall(connect_packet("dev", clean=new_clean))
            marker = "a clean CONNECT takes the client id over" if new_clean else "dev is already connected"
            assert broker.wait_until(lambda: marker in broker.log(), WAIT), broker.log()[-2000:]
            old.sendall(DISCONNECT)
            assert read_exactly(new, 4) == b"\x20\x02\x00\x00"  # the older connection is closed by now
            # its unsent bytes read: its socket closes now, not CLOSE_GRACE later
            assert read_until_closed(old, WAIT) is not None, "the older connection was not closed"
            new.sendall(DISCONNECT)
            new.shutdown(socket.SHUT_WR)
            assert read_until_closed(new, WAIT) is not None, "the broker did not close the connection"
            # both ends reported (each after its will, if any, through the same queue)
            assert watcher.wait_for(lambda ms: sum(m.topic == "closed/dev" for m in ms) >= 2), broker.log()[-2000:]
    assert [m.topic for m in watcher.messages if m.topic.startswith("will/")] == []
