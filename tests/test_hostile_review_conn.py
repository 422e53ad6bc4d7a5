"""Issue 10 review of the merged connection-level points (3: owner and read access, 5: refusals,
1: sockets): attacks on how the merged branches meet, each against a real broker process."""

from __future__ import annotations

import contextlib
import re
import socket
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from raw_mqtt_helpers import connect_packet
from test_hostile_owner import REFUSED, acl_broker, login
from test_hostile_wire import CONNACK_ACCEPTED, PINGREQ, read_until_closed
from test_mixed_clients import RECEIVE_ACL_PLUGIN
from test_qos2_inbound import PUBACK, PUBREC, complete, expect_ack, publish, pubrel_due
from test_scale import RawClient

from amqtt_durable.amqtt_glue import CLOSE_GRACE
from conftest import HOST, WAIT, Broker, Client, mqtt_packet, mqtt_string


def read_exactly(sock: socket.socket, count: int) -> bytes:
    """``count`` bytes, or fewer if the broker closes first (bounded by the socket's timeout)."""
    got = b""
    while len(got) < count and (chunk := sock.recv(count - len(got))):
        got += chunk
    return got


def test_a_clean_connect_gets_no_retained_message_of_another_clients_subscription(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """amqtt 0.12.1 sends every connecting client the retained messages of every filter any client
    is subscribed to: bob, who may not subscribe to ``secret/#``, read alice's retained secret by
    merely connecting while her clean session was subscribed to it."""
    broker = acl_broker(broker_factory)
    alice = login(clients, broker, "alice-mon", "alice", clean_session=True)
    assert alice.subscribe("secret/#", 1) == [1]
    pub = login(clients, broker, "pub", "pub", clean_session=True)
    pub.publish("secret/plans", [b"the plan"], qos=1, retain=True)
    assert alice.wait_for(lambda ms: any(m.payload == b"the plan" for m in ms))

    bob = login(clients, broker, "bob-dev", "bob", clean_session=True)
    assert bob.subscribe("bob/#", 1) == [1]
    pub.publish("bob/inbox", [b"marker"], qos=1)
    assert bob.wait_for(lambda ms: any(m.topic == "bob/inbox" for m in ms))
    got = [(m.topic, m.payload) for m in bob.messages]
    assert got == [("bob/inbox", b"marker")], f"bob read {got}"


def test_a_clean_subscriber_gets_no_retained_message_it_may_not_receive(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], tmp_path: Path
) -> None:
    """amqtt checks RECEIVE on live messages to clean sessions but not on retained ones it sends
    on SUBSCRIBE: bob, who may receive only ``b/``, subscribed to ``#`` and read ``a/state``."""
    (tmp_path / "receive_acl.py").write_text(RECEIVE_ACL_PLUGIN)
    broker = broker_factory(start=False)
    broker.pythonpath.append(str(tmp_path))
    broker.extra_plugins["receive_acl.ReceiveAcl"] = {"receive": {"bob": ["b/"]}}
    broker.start()
    pub = clients(broker.port, "pub", clean_session=True)
    pub.publish("a/state", [b"alice's state"], qos=1, retain=True)
    pub.publish("b/state", [b"bob's state"], qos=1, retain=True)
    bob = clients(broker.port, "bob-clean", username="bob", clean_session=True)
    assert bob.subscribe("#", 1) == [1]
    pub.publish("b/live", [b"marker"], qos=1)
    assert bob.wait_for(lambda ms: any(m.topic == "b/live" for m in ms))
    got = sorted((m.topic, m.retain) for m in bob.messages)
    assert got == [("b/live", False), ("b/state", True)], f"bob read {got}"


def test_a_connect_refused_for_ownership_after_a_race_is_closed_and_serves_nothing(
    broker_factory: Callable[..., Broker],
) -> None:
    """Two users' CONNECTs of a new client id read at the same time: both pass the owner check made
    when a CONNECT is read; the second is refused (CONNACK 5) by the owner check made again after
    its authentication, or, if both pass that too, when its CONNACK is due. amqtt then went on
    serving a connection refused at CONNACK time: the refused user could subscribe and publish."""
    broker = broker_factory()
    late_refusals = 0
    for attempt in range(40):
        client_id = f"raced-{attempt}"
        socks = [socket.create_connection((HOST, broker.port), timeout=WAIT) for _ in range(2)]
        try:
            for sock, user in zip(socks, ("alice", "bob"), strict=True):
                sock.sendall(connect_packet(client_id, clean=False, username=user))
            answers = [read_exactly(sock, 4) for sock in socks]
            assert sorted(answers) == [CONNACK_ACCEPTED, REFUSED], answers
            refused = socks[answers.index(REFUSED)]
            refused.sendall(PINGREQ)
            assert read_until_closed(refused, WAIT) == b"", "a refused connection must be closed, unserved"
        finally:
            for sock in socks:
                sock.close()
        log_text = broker.log()
        late_refusals = log_text.count("CONNECT refused when its CONNACK was due") + log_text.count(
            "its session was created while this CONNECT was checked"
        )
        if late_refusals:
            break
    assert late_refusals, "the race never got past the owner check made as the CONNECT was read"


def broker_with_two_connection_slots(broker_factory: Callable[..., Broker], **settings: Any) -> Broker:
    """A started broker whose listener serves at most 2 connections at a time (max_connections)."""
    return with_two_connection_slots(broker_factory(start=False, **settings)).start()


def with_two_connection_slots(broker: Broker) -> Broker:
    """``broker``, not yet started, set to have its listener serve at most 2 connections at a time."""
    write_config = broker.write_config

    def with_max_connections() -> Path:
        path = write_config()
        config = yaml.safe_load(path.read_text())
        config["listeners"]["default"]["max_connections"] = 2
        path.write_text(yaml.safe_dump(config))
        return path

    broker.write_config = with_max_connections  # type: ignore[method-assign]
    return broker


def assert_the_listener_still_serves(broker: Broker) -> None:
    with socket.create_connection((HOST, broker.port), timeout=WAIT) as sock:
        sock.sendall(connect_packet("after-the-flood"))
        assert read_exactly(sock, 4) == CONNACK_ACCEPTED, "the listener no longer serves anyone"


def test_oversized_connects_do_not_use_up_a_listeners_connection_slots(
    broker_factory: Callable[..., Broker],
) -> None:
    """A CONNECT announcing more than max_packet_size is refused before its body is read; that
    refusal escaped amqtt's connection handler before it gave back the listener's connection slot,
    so a few 5-byte packets made a listener with max_connections refuse everyone for good."""
    broker = broker_with_two_connection_slots(broker_factory, max_packet_size=4096)
    for _ in range(3):
        with socket.create_connection((HOST, broker.port), timeout=WAIT) as big_connect:
            big_connect.sendall(b"\x10\xff\xff\xff\x7f")  # a CONNECT announcing 256 MB
            assert read_until_closed(big_connect, WAIT) == b""
    assert_the_listener_still_serves(broker)
    assert "before its CONNECT was read: a packet of 268435455 bytes is larger than max_packet_size" in broker.log()


def test_a_first_packet_with_flags_mqtt_does_not_allow_frees_its_connection_slot(
    broker_factory: Callable[..., Broker],
) -> None:
    """Review 131: a first packet whose fixed header flags MQTT 3.1.1 does not allow (a CONNECT sent
    as 0x11, a DISCONNECT as 0xe1, a PINGREQ as 0xc1) is refused before a CONNECT is read; that
    refusal escaped amqtt's connection handler (an ERROR "Unhandled exception in
    client_connected_cb") before it gave back the listener's connection slot, so three such
    connections locked everyone out of a listener with max_connections 2. Now the WARNING that
    guarantees.md promises, naming the peer's address (there is no client id yet)."""
    broker = broker_with_two_connection_slots(broker_factory)
    rest_of_a_connect = connect_packet("bad-flags")[1:]
    for first in (0x11, 0xE1, 0xC1) * 2:
        with socket.create_connection((HOST, broker.port), timeout=WAIT) as sock:
            sock.sendall(bytes((first,)) + rest_of_a_connect)
            assert read_until_closed(sock, WAIT) == b"", f"{first:#x}: closed, unanswered"
    assert_the_listener_still_serves(broker)
    log = broker.log()
    before_connect = r"closing a connection from 127\.0\.0\.1:\d+ before its CONNECT was read: "
    refusals = [
        "packet type 1 with fixed header flags 0b0001, not 0b0000 (MQTT-2.2.2-2)",
        # review 139: a first DISCONNECT or PINGREQ is refused first for not being a CONNECT
        *(f"its first packet is of type {packet_type}, not CONNECT (MQTT-3.1.0-1)" for packet_type in (14, 12)),
    ]
    for refusal in refusals:
        warning = re.compile(f"WARNING .*{before_connect}{re.escape(refusal)}")
        assert len(warning.findall(log)) == 2, refusal
    assert "Unhandled exception" not in log


def test_a_first_packet_that_is_not_a_connect_is_refused_at_once_and_frees_its_slot(
    broker_factory: Callable[..., Broker],
) -> None:
    """Review 139: a first packet that is not a CONNECT (MQTT-3.1.0-1) was read by amqtt as a
    CONNECT body: a 2-byte one (a reserved type 15, a PINGREQ) hung until connect_timeout (10 s),
    others were closed only once their body was read. Now it is refused on its fixed header, with
    the WARNING guarantees.md promises naming the peer's address, and its listener slot is freed
    (max_connections 2, three of each)."""
    broker = broker_with_two_connection_slots(broker_factory)
    firsts = {15: b"\xf0\x00", 12: b"\xc0\x00", 2: b"\x20\x02\x00\x00", 8: b"\x82\x06\x00\x01\x00\x01t\x01"}
    for _ in range(3):
        for packet in firsts.values():
            with socket.create_connection((HOST, broker.port), timeout=WAIT) as sock:
                sock.sendall(packet)
                assert read_until_closed(sock, 5.0) == b"", f"{packet!r}: closed, unanswered, before connect_timeout"
    assert_the_listener_still_serves(broker)
    log = broker.log()
    before_connect = r"closing a connection from 127\.0\.0\.1:\d+ before its CONNECT was read: "
    for packet_type in firsts:
        refusal = f"its first packet is of type {packet_type}, not CONNECT (MQTT-3.1.0-1)"
        warning = re.compile(f"WARNING .*{before_connect}{re.escape(refusal)}")
        assert len(warning.findall(log)) == 3, refusal
        amqtt_s = re.compile(f"WARNING .*Failed to initialize client session: .*{re.escape(refusal)}")
        assert len(amqtt_s.findall(log)) == 3, f"amqtt's own WARNING, as guarantees.md quotes it: {refusal}"
    assert len(re.findall(r"WARNING .*Invalid connection from \(client @=127\.0\.0\.1:\d+\)", log)) == 12
    assert "no complete CONNECT within connect_timeout" not in log
    assert "Unhandled exception" not in log


class UserClient(RawClient):
    """A raw durable client that connects with a username (anonymous authentication lets it claim any)."""

    def __init__(self, port: int, client_id: str, user: str) -> None:
        super().__init__(port, client_id)
        self.user = user

    def connect_packet(self, keepalive: int = 60) -> bytes:
        return connect_packet(self.client_id, clean=False, username=self.user)


def test_a_new_owner_s_qos2_publish_is_not_taken_for_the_previous_owner_s_resend(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """session_takeover: any-user. alice's QoS 2 publish got PUBREC, her PUBREL never came; bob takes
    the session over and publishes with the same packet id: he got PUBREC and PUBCOMP, and his
    message was never routed (taken for alice's re-send). Packet ids are the publisher's own."""
    broker = broker_factory(session_takeover="any-user")
    watcher = clients(broker.port, "watcher")
    assert watcher.subscribe("q2/#", 2) == [2]
    alice = UserClient(broker.port, "shared-dev", "alice")
    assert alice.connect() is False
    for packet_id in (7, 9):
        publish(alice, b"alice's %d" % packet_id, packet_id)
        expect_ack(alice, PUBREC, packet_id)
    assert watcher.wait_for(lambda ms: any(m.payload == b"alice's 9" for m in ms))
    alice.sock.close()  # gone before her PUBRELs

    bob = UserClient(broker.port, "shared-dev", "bob")
    assert bob.connect() is True
    publish(bob, b"bob's", 7)
    expect_ack(bob, PUBREC, 7)
    complete(bob, 7)
    publish(bob, b"marker", 8, qos=1)
    expect_ack(bob, PUBACK, 8)
    # paho hands a QoS 2 message over at the broker's PUBREL, possibly after the QoS 1 marker.
    arrived = watcher.wait_for(lambda ms: {b"bob's", b"marker"} <= {m.payload for m in ms})
    got = sorted(m.payload for m in watcher.messages)
    assert arrived, f"bob's message was never routed: {got}"
    assert got == [b"alice's 7", b"alice's 9", b"bob's", b"marker"], got
    bob.sock.close()
    broker.stop()
    # A stop as a client goes: the connection's reader, cancelled by the stop, read on when Python
    # 3.11's wait_for swallowed the cancellation (two stops in three), and the stop hung until killed.
    assert "Broker closed" in broker.log().rsplit("Shutting down broker", 1)[-1], "the stop was not graceful"
    assert pubrel_due(broker) == {}, "alice's packet ids must not stay due in bob's session"


def test_a_wrong_password_neither_ends_the_owner_s_connection_nor_plants_a_will(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """amqtt reuses the cached Session of a client id (copying the CONNECT's will into it) and takes
    the live connection over before it checks the password: a CONNECT with alice's client id and
    username and a wrong password ended her connection, and her disconnect then published the
    intruder's will, retained, as hers."""
    broker = acl_broker(broker_factory)
    alice = login(clients, broker, "alice-dev", "alice")
    assert alice.subscribe("secret/#", 1) == [1]
    body = mqtt_string("MQTT") + bytes((4, 0xC0 | 0x20 | 0x0C, 0, 60)) + mqtt_string("alice-dev")
    body += mqtt_string("secret/planted") + mqtt_string("planted by a guess")  # will QoS 1, RETAIN
    body += mqtt_string("alice") + mqtt_string("a wrong guess")
    with socket.create_connection((HOST, broker.port), timeout=WAIT) as sock:
        sock.sendall(mqtt_packet(0x10, body))
        refusal = read_until_closed(sock, WAIT)
    pub = login(clients, broker, "pub", "pub", clean_session=True)
    pub.publish("secret/plans", [b"live"], qos=1)
    assert alice.wait_for(lambda ms: any(m.payload == b"live" for m in ms))
    assert not alice.wait_disconnected(0.2), "a wrong password ended alice's connection"
    alice.drop()  # abnormal end: only alice's own will (none) may go
    assert alice.connect() is True
    pub.publish("secret/plans", [b"after"], qos=1)
    assert alice.wait_for(lambda ms: any(m.payload == b"after" for m in ms))
    watcher = login(clients, broker, "alice-watch", "alice", clean_session=True)
    assert watcher.subscribe("secret/#", 1) == [1]
    pub.publish("secret/plans", [b"marker"], qos=1)
    assert watcher.wait_for(lambda ms: any(m.payload == b"marker" for m in ms))
    planted = [m.payload for m in alice.messages + watcher.messages if m.topic == "secret/planted"]
    assert not planted, f"the intruder's will was published: {planted}"
    assert refusal == REFUSED, "CONNACK 5 without session present (MQTT-3.2.2-4)"


def test_a_qos3_publish_closes_the_connection_unrouted(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """MQTT-3.3.1-4: QoS 3 is reserved; the one check left after amqtt's decoder on the PUBLISH path."""
    broker = broker_factory()
    watcher = clients(broker.port, "watcher")
    assert watcher.subscribe("q3/#", 1) == [1]
    with socket.create_connection((HOST, broker.port), timeout=WAIT) as sock:
        sock.sendall(connect_packet("q3-pub"))
        assert read_exactly(sock, 4) == CONNACK_ACCEPTED
        sock.sendall(mqtt_packet(0x36, mqtt_string("q3/t") + b"\x00\x05" + b"three"))
        assert read_until_closed(sock, WAIT) == b"", "no PUBACK/PUBREC, and the connection closed"
    other = clients(broker.port, "q1-pub", clean_session=True)
    other.publish("q3/t", [b"marker"], qos=1)
    assert watcher.wait_for(lambda ms: any(m.payload == b"marker" for m in ms))
    assert [m.payload for m in watcher.messages] == [b"marker"]
    assert "PUBLISH refused: QoS 3 is reserved (MQTT-3.3.1-4)" in broker.log()


PUBLISH_ACL_PLUGIN = '''
from dataclasses import dataclass, field

from amqtt.contexts import Action
from amqtt.plugins.base import BaseTopicPlugin


class PublishAcl(BaseTopicPlugin):
    """Test plugin: users may publish only to topics under their prefixes."""

    @dataclass
    class Config:
        publish: dict = field(default_factory=dict)

    async def topic_filtering(self, *, session=None, topic=None, action=None):
        if action != Action.PUBLISH:
            return True
        user = (session.username if session else None) or "anonymous"
        return any(topic.startswith(prefix) for prefix in self.context.config.publish.get(user, []))
'''


def test_a_will_the_user_may_not_publish_is_refused_at_connect(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], tmp_path: Path
) -> None:
    """amqtt publishes a will, and retains it, without the PUBLISH check its user's PUBLISHes get:
    mallory, who may publish only under ``m/``, planted a retained ``cmd/door`` (now durable, so
    it outlived restarts) by connecting with that will and dropping the connection."""
    (tmp_path / "publish_acl.py").write_text(PUBLISH_ACL_PLUGIN)
    broker = broker_factory(start=False)
    broker.pythonpath.append(str(tmp_path))
    broker.extra_plugins["publish_acl.PublishAcl"] = {"publish": {"mallory": ["m/"], "ops": ["cmd/"]}}
    broker.start()
    device = clients(broker.port, "door", username="ops")
    assert device.subscribe("cmd/#", 1) == [1]
    body = mqtt_string("MQTT") + bytes((4, 0x80 | 0x20 | 0x0C, 0, 60)) + mqtt_string("mallory-dev")
    body += mqtt_string("cmd/door") + mqtt_string("open")  # will QoS 1, RETAIN
    body += mqtt_string("mallory")
    with socket.create_connection((HOST, broker.port), timeout=WAIT) as sock:
        sock.sendall(mqtt_packet(0x10, body))
        refusal = read_exactly(sock, 4)
    ops = clients(broker.port, "ops-pub", username="ops", clean_session=True)
    ops.publish("cmd/door", [b"marker"], qos=1)
    assert device.wait_for(lambda ms: any(m.payload == b"marker" for m in ms))
    assert [m.payload for m in device.messages] == [b"marker"], "mallory's will reached the door"
    assert refusal == REFUSED, "CONNACK 5: the will's topic is not the user's to publish to"
    assert "may not publish its will to 'cmd/door'" in broker.log()


def test_a_connection_dropped_while_a_qos2_publish_awaits_its_pubrel_ends_at_once(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    """At EOF the reader lets the handlers of what it read finish (an UNSUBSCRIBE before DISCONNECT
    must be stored), but a QoS 2 PUBLISH's handler waits for a PUBREL that only the ended reader
    could deliver: the end (the will, the session's detach) waited CLOSE_GRACE for nothing, per
    connection, for anyone who sends a QoS 2 PUBLISH and drops the line."""
    watcher = clients(broker.port, "will-watcher")
    assert watcher.subscribe("wills/#", 1) == [1]
    body = mqtt_string("MQTT") + bytes((4, 0x02 | 0x04 | 0x08, 0, 60)) + mqtt_string("q2-dropper")
    body += mqtt_string("wills/q2-dropper") + mqtt_string("gone")  # will QoS 1, clean session
    with socket.create_connection((HOST, broker.port), timeout=WAIT) as sock:
        sock.sendall(mqtt_packet(0x10, body))
        assert read_exactly(sock, 4) == CONNACK_ACCEPTED
        sock.sendall(mqtt_packet(0x34, mqtt_string("q2/t") + b"\x00\x07" + b"exactly once"))
        assert read_exactly(sock, 4) == b"\x50\x02\x00\x07"  # PUBREC: its handler now waits for PUBREL
    assert watcher.wait_for(lambda got: any(m.payload == b"gone" for m in got), timeout=CLOSE_GRACE / 2), (
        "the will came only after CLOSE_GRACE: the connection's end waited for the QoS 2 handler"
    )


BACKEND_AUTH = '''
import asyncio

from amqtt.plugins.base import BaseAuthPlugin


class BackendAuth(BaseAuthPlugin):
    """User "remote" is checked by an authentication service at 127.0.0.1:{port}, where nothing
    listens: the check raises ConnectionRefusedError. User "held" is checked by the service at
    127.0.0.1:{service}, which answers nothing until it resets the connection: the check raises
    ConnectionResetError then. User "buggy" meets the plugin's own bug (RuntimeError). User
    "refused" is refused (False). Any other user passes."""

    async def authenticate(self, *, session):
        if session.username == "remote":
            _, writer = await asyncio.open_connection("127.0.0.1", {port})
            writer.close()
        if session.username == "held":
            reader, writer = await asyncio.open_connection("127.0.0.1", {service})
            await asyncio.wait_for(reader.read(1), 60)
            writer.close()
        if session.username == "buggy":
            raise RuntimeError("the plugin's own bug")
        return session.username != "refused"
'''


@contextlib.contextmanager
def backend_auth_broker(
    broker_factory: Callable[..., Broker], tmp_path: Path, **settings: Any
) -> Iterator[tuple[Broker, socket.socket]]:
    """A broker (not started) with BackendAuth, and the listening socket of its "held" user's
    service; the port of its "remote" user's service is held (bound, not listening) for the block,
    so its connections are refused and nothing else may listen there meanwhile."""
    with socket.socket() as unreachable, socket.create_server((HOST, 0)) as service:
        unreachable.bind((HOST, 0))
        code = BACKEND_AUTH.format(port=unreachable.getsockname()[1], service=service.getsockname()[1])
        (tmp_path / "backend_auth.py").write_text(code)
        broker = broker_factory(start=False, **settings)
        broker.pythonpath.append(str(tmp_path))
        broker.extra_plugins["backend_auth.BackendAuth"] = {}
        yield broker, service


@pytest.mark.parametrize(("username", "error"), [("remote", "ConnectionRefusedError"), ("buggy", "RuntimeError")])
def test_a_connect_whose_credentials_cannot_be_checked_gets_connack_3_and_frees_its_connection_slot(
    broker_factory: Callable[..., Broker], tmp_path: Path, username: str, error: str
) -> None:
    """docs/guarantees.md (amqtt fixes): a CONNECT whose credentials cannot be checked (an auth
    plugin raises: an OSError, its service refuses its connection; or its own bug) gets CONNACK 3
    (server unavailable), the error logged as an ERROR naming it, with its traceback, not as 'the
    connection ended while its CONNECT was refused' (that OSError alone is a refused CONNECT's
    close). It escaped amqtt's handler: an "Unhandled exception" traceback, the connection's place
    among its listener's max_connections never given back, and two of them made a listener of two
    places refuse everyone. Durable CONNECTs (checked as they are read) and a clean one (checked
    before its client id's turn)."""
    with backend_auth_broker(broker_factory, tmp_path) as (broker, _):
        with_two_connection_slots(broker).start()
        for round_ in range(3):
            with socket.create_connection((HOST, broker.port), timeout=WAIT) as sock:
                sock.sendall(connect_packet(f"{username}-{round_}", clean=round_ == 1, username=username))
                got = read_until_closed(sock, WAIT)
                assert got is not None, f"CONNECT {round_ + 1}: not closed (its listener has no place left?)"
                assert got == b"\x20\x02\x00\x03", f"CONNECT {round_ + 1}: a CONNECT whose check failed got {got!r}"
        assert_the_listener_still_serves(broker)
    log = broker.log()
    refused = r"ERROR amqtt_durable: CONNECT of client id '[\w-]+' by user '\w+' refused \(CONNACK 3\): "
    failed = re.findall(refused + r"its credentials could not be checked: (\w+)\(.*\)\nTraceback ", log)
    assert failed == [error] * 3, log[-5000:]
    assert "ended while its CONNECT was refused" not in log, log[-5000:]
    assert "Unhandled exception" not in log, log[-5000:]


def logged(broker: Broker, needle: str, *, times: int) -> None:
    """Returns once the broker's log holds ``needle`` ``times`` times (bounded by WAIT)."""
    assert broker.wait_until(lambda: broker.log().count(needle) >= times, WAIT), broker.log()[-5000:]


def test_an_error_of_a_connects_check_after_its_connect_timeout_is_named_and_frees_its_connection_slot(
    broker_factory: Callable[..., Broker], tmp_path: Path
) -> None:
    """docs/guarantees.md (amqtt fixes): an auth plugin's OSError raised after its connection was
    closed at connect_timeout (its service reset the connection it waited on) is logged as the ERROR
    it is, with its traceback: it was taken for a refused CONNECT's close (a WARNING 'the connection
    ended while its CONNECT was refused', no traceback), as the connection was already closed. The
    connection's place among its listener's max_connections is given back (3 rounds, 2 places)."""
    with backend_auth_broker(broker_factory, tmp_path, connect_timeout=3) as (broker, service):
        with_two_connection_slots(broker).start()
        service.settimeout(WAIT)
        for round_ in range(3):
            with socket.create_connection((HOST, broker.port), timeout=WAIT) as sock:
                sock.sendall(connect_packet(f"held-{round_}", clean=False, username="held"))
                checking, _ = service.accept()
                with checking:
                    logged(broker, "no complete CONNECT within connect_timeout", times=round_ + 1)
                    assert read_until_closed(sock, WAIT) == b"", "closed at connect_timeout, without a CONNACK"
                    checking.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # closed: reset
            logged(broker, "the handling of a CONNECT from", times=round_ + 1)
        assert_the_listener_still_serves(broker)
    log = broker.log()
    failed = re.findall(r"ERROR amqtt_durable: the handling of a CONNECT from \S+ failed: (\w+)\(.*\)\nTraceback ", log)
    assert failed == ["ConnectionResetError"] * 3, log[-5000:]
    assert "ended while its CONNECT was refused" not in log, log[-5000:]
    assert "Unhandled exception" not in log, log[-5000:]


def test_a_connect_refused_with_a_connack_from_a_client_gone_at_once_frees_its_slot_without_an_error(
    broker_factory: Callable[..., Broker], tmp_path: Path
) -> None:
    """A client that sends its CONNECT and closes at once (a plain close): the broker's close after
    its CONNACK refusal (write_eof on a connection its peer reset as the CONNACK came) raises a plain
    OSError (ENOTCONN), not a ConnectionError, and it was logged as an ERROR 'the handling of a
    CONNECT from ... failed' with its traceback. amqtt's CONNACK 4 (a password without a username),
    an auth plugin's refusal (CONNACK 5) and its bug (CONNACK 3), 3 rounds on a listener of 2 places."""
    password_without_username = mqtt_packet(
        0x10, mqtt_string("MQTT") + bytes((4, 0x40 | 0x02, 0, 60)) + mqtt_string("no-user") + mqtt_string("secret")
    )
    connects = [
        password_without_username,
        connect_packet("refused", clean=False, username="refused"),
        connect_packet("buggy", clean=False, username="buggy"),
    ]
    with backend_auth_broker(broker_factory, tmp_path) as (broker, _):
        with_two_connection_slots(broker).start()
        for round_ in range(3):
            for number, connect in enumerate(connects, start=1):
                with socket.create_connection((HOST, broker.port), timeout=WAIT) as sock:
                    sock.sendall(connect)
                logged(broker, "Failed to initialize client session", times=round_ * len(connects) + number)
        assert_the_listener_still_serves(broker)
    log = broker.log()
    assert log.count("refused (CONNACK 5): authentication failed") == 3, log[-5000:]
    assert log.count("refused (CONNACK 3): its credentials could not be checked") == 3, log[-5000:]
    assert "the handling of a CONNECT from" not in log, log[-5000:]
    assert "Unhandled exception" not in log, log[-5000:]
