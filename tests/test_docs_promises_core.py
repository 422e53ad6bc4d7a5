"""Promises of README.md and docs/guarantees.md found by a later sentence-by-sentence audit
(CONNECT checks, SUBSCRIBE return codes, a clean CONNECT ending a live connection) that no other
test states, each against a real broker with raw MQTT 3.1.1 packets.
"""

from __future__ import annotations

import dataclasses
import re
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from raw_mqtt_helpers import connect_packet, raw_connect, read_exactly
from test_hostile_wire import PATHS, read_until_closed

from amqtt_durable.config import DurableConfig
from conftest import HOST, WAIT, Broker, Client, mqtt_packet, mqtt_string, payloads

ROOT = Path(__file__).resolve().parents[1]
PINGREQ = b"\xc0\x00"
PINGRESP = b"\xd0\x00"


def connack(port: int, packet: bytes) -> bytes | None:
    """The CONNACK ``packet`` gets (None: the connection closed without one)."""
    with socket.create_connection((HOST, port), timeout=WAIT) as sock:
        sock.sendall(packet)
        reply = read_until_closed(sock, WAIT)
    assert reply is not None, "a refused CONNECT's connection must be closed"
    return reply or None


def broker_reading_on(broker_factory: Callable[..., Broker], path: str) -> Broker:
    """A started broker whose connections are read on ``path``, the plugin's reader or amqtt's
    (test_hostile_wire.PATHS)."""
    broker = broker_factory(start=False)
    broker.extra_plugins.update(PATHS[path])
    return broker.start()


@pytest.fixture(scope="module")
def reading_on(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Broker]]:
    """broker_reading_on's broker per path, started when a test of this module first asks for it and
    shared by the next ones (each with client ids of its own, ``case_tag``)."""
    started: dict[str, Broker] = {}

    def get(path: str) -> Broker:
        if path not in started:
            started[path] = Broker(tmp_path_factory.mktemp(path))
            started[path].extra_plugins.update(PATHS[path])
            started[path].start()
        return started[path]

    yield get
    for broker in started.values():
        broker.stop()


def test_a_durable_connect_without_a_client_id_is_refused_with_connack_2(broker: Broker) -> None:
    """guarantees.md, Created: a durable session needs a non-empty client id; clean_session=false
    with an empty one gets CONNACK 2 (identifier rejected) and its connection closed (MQTT-3.1.3-8),
    while clean_session=true with an empty one is accepted (MQTT-3.1.3-6)."""
    assert connack(broker.port, connect_packet("", clean=False)) == b"\x20\x02\x00\x02"
    with socket.create_connection((HOST, broker.port), timeout=WAIT) as sock:
        sock.sendall(connect_packet("", clean=True))
        assert read_exactly(sock, 4) == b"\x20\x02\x00\x00"
        sock.sendall(PINGREQ)
        assert read_exactly(sock, 2) == PINGRESP


@pytest.mark.parametrize(
    ("flags", "will"),
    [(0x02 | 0x04 | 0x18, True), (0x02 | 0x08, False), (0x02 | 0x20, False)],
    ids=["will-qos-3", "will-qos-without-will", "will-retain-without-will"],
)
def test_a_connect_whose_will_flags_mqtt_does_not_allow_is_closed_without_connack(
    broker: Broker, clients: Callable[..., Client], flags: int, will: bool
) -> None:
    """guarantees.md, The message path: a CONNECT whose will QoS is 3 (MQTT-3.1.2-14), or that sets
    a will QoS or the will retain flag without a will (MQTT-3.1.2-13/15), is refused: the connection
    is closed without a CONNACK, and no will of it is ever published. (amqtt accepted all three.)"""
    watcher = clients(broker.port, "watch", clean_session=True)
    assert watcher.subscribe("will/#", 2) == [2]
    body = mqtt_string("MQTT") + bytes((4, flags)) + (60).to_bytes(2, "big") + mqtt_string("bad-will")
    if will:
        body += mqtt_string("will/bad") + mqtt_string("gone")
    assert connack(broker.port, mqtt_packet(0x10, body)) is None
    clients(broker.port, "pub", clean_session=True).publish("will/probe", [b"p"], qos=1)
    assert watcher.wait_for(lambda ms: any(m.topic == "will/probe" for m in ms))
    assert [m.topic for m in watcher.messages] == ["will/probe"], "no will was published"


def test_only_mqtt_3_1_1_connects_are_accepted(broker: Broker) -> None:
    """guarantees.md, The message path: a CONNECT of another protocol level (MQTT 5's 5) gets
    CONNACK 1; one with another protocol name (MQTT 3.1's MQIsdp) is closed without a CONNACK."""
    level_5 = mqtt_string("MQTT") + bytes((5, 0x02)) + (60).to_bytes(2, "big") + mqtt_string("v5")
    assert connack(broker.port, mqtt_packet(0x10, level_5)) == b"\x20\x02\x00\x01"
    mqtt_3_1 = mqtt_string("MQIsdp") + bytes((3, 0x02)) + (60).to_bytes(2, "big") + mqtt_string("v3")
    assert connack(broker.port, mqtt_packet(0x10, mqtt_3_1)) is None


@pytest.mark.parametrize("clean", [True, False], ids=["clean", "durable"])
def test_an_invalid_topic_filter_gets_0x80_and_the_others_in_the_subscribe_are_granted(
    broker: Broker, clean: bool
) -> None:
    """guarantees.md, The message path: a topic filter that is empty (MQTT-4.7.3-1), has `#` other
    than as the whole last level or `+` other than as a whole level (MQTT-4.7.1-2/3) gets return
    code 0x80, clean and durable sessions alike; the other filters of the SUBSCRIBE are granted and
    the connection stays up. (amqtt alone granted an empty filter to a clean session.)"""
    sock = raw_connect(broker.port, f"filters-{clean}", clean=clean)
    filters = [("", 1), ("a/#/b", 1), ("a+", 1), ("#/a", 0), ("ok/+", 1), ("ok/#", 2)]
    body = b"\x00\x09" + b"".join(mqtt_string(f) + bytes((qos,)) for f, qos in filters)
    sock.sendall(mqtt_packet(0x82, body))
    assert read_exactly(sock, 10) == b"\x90\x08\x00\x09" + bytes((0x80, 0x80, 0x80, 0x80, 1, 2))
    sock.sendall(PINGREQ)
    assert read_exactly(sock, 2) == PINGRESP
    sock.close()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("clean", [True, False], ids=["clean", "durable"])
@pytest.mark.parametrize(
    "packet",
    [
        (0x82, b""),
        (0x82, mqtt_string("ok/1") + b"\x01" + mqtt_string("ok/2") + b"\x03"),
        (0xA2, b""),
    ],
    ids=["subscribe-no-filter", "subscribe-qos-3", "unsubscribe-no-filter"],
)
def test_a_subscribe_without_a_filter_or_asking_qos_3_closes_the_connection(
    reading_on: Callable[[str], Broker],
    clients: Callable[..., Client],
    *,
    case_tag: str,
    clean: bool,
    path: str,
    packet: tuple[int, bytes],
) -> None:
    """guarantees.md, The message path: a SUBSCRIBE that holds no topic filter (MQTT-3.8.3-3) or
    asks for a QoS other than 0, 1 or 2 (MQTT-3.8.3-4), and an UNSUBSCRIBE that holds no topic
    filter (MQTT-3.10.3-2), are protocol violations: the connection is closed with no SUBACK /
    UNSUBACK, nothing granted, on either reader, with a WARNING naming the client. (amqtt answered
    the first with an empty SUBACK, the second with 0x80 for QoS 3, the third with an UNSUBACK.)"""
    broker = reading_on(path)
    sock = raw_connect(broker.port, f"bad-sub-{case_tag}", clean=clean)
    first, payload = packet
    sock.sendall(mqtt_packet(first, b"\x00\x03" + payload))
    assert read_until_closed(sock, WAIT) == b"", "closed, and no SUBACK"
    sock.close()
    kind = "UNSUBSCRIBE" if first == 0xA2 else "SUBSCRIBE"
    assert f"closing the connection of bad-sub-{case_tag}: {kind} refused" in broker.log()
    if not clean:
        again = clients(broker.port, f"bad-sub-{case_tag}")
        clients(broker.port, f"pub-{case_tag}", clean_session=True).publish("ok/1", [b"x"], qos=1)
        assert not again.wait_for(lambda ms: len(ms) > 0, timeout=0.5), "nothing was granted"


def test_a_clean_connect_ends_the_live_durable_connection_and_deletes_its_session(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    """guarantees.md: clean_session=true with the same client id deletes the stored session, and a
    clean CONNECT of a client id whose connection is live ends that connection (MQTT-3.1.4-2); that
    connection ended without DISCONNECT, so its will is published (MQTT-3.1.2-8)."""
    watcher = clients(broker.port, "watch", clean_session=True)
    assert watcher.subscribe("will/#", 0) == [0]
    live = socket.create_connection((HOST, broker.port), timeout=WAIT)
    live.sendall(connect_packet("dev-7", clean=False, will_topic=b"will/dev-7"))
    assert read_exactly(live, 4) == b"\x20\x02\x00\x00"
    live.sendall(mqtt_packet(0x82, b"\x00\x01" + mqtt_string("c/t") + b"\x01"))
    assert read_exactly(live, 5) == b"\x90\x03\x00\x01\x01"

    clean = raw_connect(broker.port, "dev-7", clean=True)
    assert read_until_closed(live, WAIT) is not None, "the live connection must be ended"
    live.close()
    assert watcher.wait_for(lambda ms: [m.topic for m in ms] == ["will/dev-7"]), "its will must be published"
    clients(broker.port, "pub", clean_session=True).publish("c/t", payloads(2), qos=1)
    clean.sendall(PINGREQ)
    assert read_exactly(clean, 2) == PINGRESP, "the clean connection is served (and sent no queued message)"
    clean.sendall(b"\xe0\x00")
    clean.close()

    again = clients(broker.port, "dev-7")
    assert again.session_present is False, "the stored session was deleted"
    assert not again.wait_for(lambda ms: len(ms) > 0, timeout=0.5), "with its subscription and queue"


DEFAULT_QUOTED = re.compile(r"`([a-z_0-9]+)`(?:[^`()]{0,40}\(|, )default:? ([0-9][0-9,.]*)( MiB)?")


def test_every_default_the_pages_quote_is_the_code_s() -> None:
    """README.md, guarantees.md and protocol.md quote defaults beside the settings they describe
    ("`max_depth` (default 100,000)", "`max_pending_bytes_clean` payload bytes (default 16 MiB)",
    "(`listen_backlog`, default 512"); each is the DurableConfig default."""
    defaults = {field.name: field.default for field in dataclasses.fields(DurableConfig)}
    quoted: list[tuple[str, str, float]] = []
    for page in ("README.md", "docs/guarantees.md", "docs/protocol.md"):
        text = " ".join((ROOT / page).read_text().split())
        for key, number, mib in DEFAULT_QUOTED.findall(text):
            if key in defaults:
                quoted.append((page, key, float(number.replace(",", "")) * (2**20 if mib else 1)))
    assert len(quoted) >= 17, quoted
    wrong = [(page, key, value, defaults[key]) for page, key, value in quoted if value != defaults[key]]
    assert not wrong, wrong


def watching(broker: Broker, clients: Callable[..., Client]) -> Client:
    """A clean client subscribed to after/# (QoS 1) and will/# (QoS 0)."""
    watcher = clients(broker.port, "watch", clean_session=True)
    assert watcher.subscribe([("after/#", 1), ("will/#", 0)]) == [1, 0]
    return watcher


def closed_unanswered(
    broker: Broker, client_id: str, name: str, packet: bytes, *, clean: bool = False, publishes: int = 1
) -> None:
    """``client_id`` connects with a will on will/<name>, then sends ``packet`` followed, in the same
    write, by ``publishes`` QoS 1 PUBLISHes to after/<name> (packet ids 7, 8, ...): the broker closes
    the connection without answering anything."""
    with socket.create_connection((HOST, broker.port), timeout=WAIT) as sock:
        sock.sendall(connect_packet(client_id, clean=clean, will_topic=f"will/{name}".encode()))
        assert read_exactly(sock, 4) == b"\x20\x02\x00\x00"
        after = [mqtt_packet(0x32, mqtt_string(f"after/{name}") + bytes((0, 7 + n)) + b"v") for n in range(publishes)]
        sock.sendall(packet + b"".join(after))
        assert read_until_closed(sock, WAIT) == b"", f"{name}: closed, unanswered"


def only_the_wills_were_routed(
    broker: Broker, clients: Callable[..., Client], watcher: Client, names: list[str]
) -> None:
    """The ``watching`` watcher got the will of each of ``names`` and, once a probe is published to
    after/probe, that probe: nothing after/<name> was routed."""
    wills = sorted(f"will/{name}" for name in names)
    assert watcher.wait_for(lambda ms: sorted(m.topic for m in ms) == wills), [m.topic for m in watcher.messages]
    clients(broker.port, "pub", clean_session=True).publish("after/probe", [b"p"], qos=1)
    assert watcher.wait_for(lambda ms: any(m.topic == "after/probe" for m in ms))
    assert sorted(m.topic for m in watcher.messages) == sorted([*wills, "after/probe"]), "nothing after was routed"


@pytest.mark.parametrize("path", PATHS)
def test_a_packet_with_fixed_header_flags_mqtt_does_not_allow_closes_the_connection(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], path: str
) -> None:
    """guarantees.md, The message path: a packet whose fixed header flags are not those MQTT 3.1.1
    gives its type (PUBREL, SUBSCRIBE and UNSUBSCRIBE 0010, every other but PUBLISH 0000) closes the
    connection (MQTT-2.2.2-2) unanswered, with a WARNING naming the client; nothing read after it
    is handled, and the will is published. (amqtt answered each as if its flags were right.)"""
    broker = broker_reading_on(broker_factory, path)
    watcher = watching(broker, clients)
    bad = {
        "pubrel": b"\x60\x02\x00\x01",
        "pubrel-dup": b"\x6a\x02\x00\x01",  # what paho-mqtt <= 1.3.1 re-sends (guarantees.md)
        "subscribe": mqtt_packet(0x80, b"\x00\x01" + mqtt_string("s/t") + b"\x01"),
        "unsubscribe": mqtt_packet(0xA0, b"\x00\x01" + mqtt_string("s/t")),
        "puback": b"\x42\x02\x00\x01",
        "pingreq": b"\xc1\x00",
        "disconnect": b"\xe8\x00",
    }
    for name, packet in bad.items():
        closed_unanswered(broker, f"flags-{name}", name, packet)
        assert f"flags-{name}: packet type" in broker.log(), f"{name}: a WARNING names the client"
    only_the_wills_were_routed(broker, clients, watcher, list(bad))


@pytest.mark.parametrize("path", PATHS)
def test_a_reserved_or_server_only_packet_type_closes_the_connection(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], path: str
) -> None:
    """guarantees.md, The message path: a reserved packet type (0 or 15, whatever its body) or a
    type only servers send (CONNACK, SUBACK, UNSUBACK, PINGRESP; MQTT 3.1.1 section 4.8) closes the
    connection unanswered, with a WARNING naming the client, on both readers; nothing read after
    it is handled (a QoS 1 PUBLISH in the same write is neither routed nor PUBACKed), and the will
    is published. (amqtt's reader logged a reserved type and read on, PUBACKing what followed, and
    ignored the server-only types; the plugin's took a type 0 with a 2-byte body for an ack run.)"""
    broker = broker_reading_on(broker_factory, path)
    watcher = watching(broker, clients)
    bad = {
        "reserved0": (b"\x00\x00", "packet type 0 is reserved"),
        "reserved0-2": (b"\x00\x02\x00\x01", "packet type 0 is reserved"),  # shaped like an ack
        "reserved15": (b"\xf0\x00", "packet type 15 is reserved"),
        "reserved15-flags": (b"\xf7\x02\x00\x01", "packet type 15 is reserved"),
        "connack": (b"\x20\x02\x00\x00", "packet type 2 (CONNACK) is sent by servers only"),
        "suback": (b"\x90\x03\x00\x01\x00", "packet type 9 (SUBACK) is sent by servers only"),
        "unsuback": (b"\xb0\x02\x00\x01", "packet type 11 (UNSUBACK) is sent by servers only"),
        "pingresp": (b"\xd0\x00", "packet type 13 (PINGRESP) is sent by servers only"),
    }
    for name, (packet, refusal) in bad.items():
        closed_unanswered(broker, f"type-{name}", name, packet)
        warning = f"closing the connection of type-{name}: {refusal}"
        assert warning in broker.log(), f"{name}: a WARNING names the client"
    only_the_wills_were_routed(broker, clients, watcher, list(bad))
    assert "reader stopped" not in broker.log()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("clean", [True, False], ids=["clean", "durable"])
def test_a_second_connect_closes_the_connection_and_nothing_after_it_is_handled(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], clean: bool, path: str
) -> None:
    """guarantees.md, The message path: a second CONNECT (MQTT-3.1.0-2) closes the connection
    unanswered, on both readers, with a WARNING naming the client; the QoS 1 PUBLISHes that came
    after it in the same write are neither stored, routed nor PUBACKed, and the will is published.
    (amqtt's reader logged an ERROR and read on: it stored those PUBLISHes for a durable subscriber,
    and the connection stayed open until the client closed it.)"""
    broker = broker_reading_on(broker_factory, path)
    watcher = watching(broker, clients)
    keeper = clients(broker.port, "keeper")  # offline while the violations come: anything routed is stored
    assert keeper.subscribe("after/#", 1) == [1]
    keeper.disconnect()
    ids = [f"again-{n}" for n in range(3)]
    for client_id in ids:
        again = connect_packet(client_id, clean=clean)
        closed_unanswered(broker, client_id, client_id, again, clean=clean, publishes=2)
        warning = f"closing the connection of {client_id}: a second CONNECT on the connection (MQTT-3.1.0-2)"
        assert warning in broker.log(), f"{client_id}: a WARNING names the client"
    only_the_wills_were_routed(broker, clients, watcher, ids)
    keeper = clients(broker.port, "keeper")
    assert keeper.wait_for(lambda ms: any(m.topic == "after/probe" for m in ms))
    assert [m.topic for m in keeper.messages] == ["after/probe"], "nothing after was stored"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("clean", [True, False], ids=["clean", "durable"])
def test_a_packet_identifier_0_closes_the_connection_before_anything_is_routed(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], clean: bool, path: str
) -> None:
    """guarantees.md, The message path: a PUBLISH at QoS 1 or 2, a SUBSCRIBE or an UNSUBSCRIBE whose
    packet identifier is 0 (MQTT-2.3.1-1) closes the connection unanswered, before anything of it
    is stored, routed or acknowledged. (amqtt routed such a QoS 1 PUBLISH without a PUBACK, and
    answered the others as usual.)"""
    broker = broker_reading_on(broker_factory, path)
    watcher = clients(broker.port, "watch", clean_session=True)
    assert watcher.subscribe("z/#", 2) == [2]
    bad = {
        "qos1": mqtt_packet(0x32, mqtt_string("z/1") + b"\x00\x00" + b"v"),
        "qos2": mqtt_packet(0x34, mqtt_string("z/2") + b"\x00\x00" + b"v"),
        "subscribe": mqtt_packet(0x82, b"\x00\x00" + mqtt_string("z/3") + b"\x01"),
        "unsubscribe": mqtt_packet(0xA2, b"\x00\x00" + mqtt_string("z/3")),
    }
    for name, packet in bad.items():
        sock = raw_connect(broker.port, f"id0-{name}", clean=clean)
        sock.sendall(packet)
        assert read_until_closed(sock, WAIT) == b"", f"{name}: closed, unanswered"
        sock.close()
        assert f"closing the connection of id0-{name}:" in broker.log(), f"{name}: a WARNING names the client"
    clients(broker.port, "pub", clean_session=True).publish("z/probe", [b"p"], qos=1)
    assert watcher.wait_for(lambda ms: any(m.topic == "z/probe" for m in ms))
    assert [m.topic for m in watcher.messages] == ["z/probe"], "nothing was routed"
