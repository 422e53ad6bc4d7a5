"""Issue 10, points 3 and 9, as the attacks themselves against a real broker.

3. A durable session belongs to the user that created it: with file authentication and amqtt's
   topic ACL (alice may subscribe ``secret/#``, bob ``bob/#``), bob connecting with alice's client
   id must neither read her queue nor take, wipe or end her session; with ``session_takeover:
   any-user`` he may take it, but gets nothing he may not read. Read access is checked on every
   delivery and on retained messages sent on SUBSCRIBE.
9. Session expiry counts from the last disconnect, whatever reconnects came before, also after a
   restart (it used to count from the last CONNECT plus 30 s).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from pwdlib.hashers.argon2 import Argon2Hasher
from test_mixed_clients import RECEIVE_ACL_PLUGIN
from test_protocol import events, request
from test_recovery_and_crash import EXPIRED_TOPIC, wait_expired, warnings

from amqtt_durable.inspect_store import SessionSummary, summarize
from conftest import HOST, WAIT, Broker, Client, mqtt_packet, mqtt_string, payloads

PASSWORDS = {"alice": "alice-pw", "bob": "bob-pw", "pub": "pub-pw", "monitor": "monitor-pw"}
ACL = {"alice": ["secret/#"], "bob": ["bob/#"], "monitor": ["$SYS/#"]}
REFUSED = b"\x20\x02\x00\x05"


def acl_broker(
    broker_factory: Callable[..., Broker], publish_acl: dict[str, list[str]] | None = None, **settings: object
) -> Broker:
    """File authentication and amqtt's own topic ACL plugin (with ``publish_acl``, publishing too).
    A CONNECT with a username needs that user's password; one without (the fixture's readiness
    probe) stays anonymous."""
    broker: Broker = broker_factory(start=False, **settings)
    hasher = Argon2Hasher(time_cost=1, memory_cost=8, parallelism=1)
    password_file = broker.folder / "passwd"
    password_file.write_text("".join(f"{user}:{hasher.hash(pw)}\n" for user, pw in PASSWORDS.items()))
    broker.extra_plugins["amqtt.plugins.authentication.FileAuthPlugin"] = {"password_file": str(password_file)}
    broker.extra_plugins["amqtt.plugins.topic_checking.TopicAccessControlListPlugin"] = {"acl": ACL}
    if publish_acl is not None:
        plugin_config = broker.extra_plugins["amqtt.plugins.topic_checking.TopicAccessControlListPlugin"]
        plugin_config["publish_acl"] = {**publish_acl, "anonymous": ["#"]}
    return broker.start()


def login(clients: Callable[..., Client], broker: Broker, client_id: str, user: str, **kwargs: object) -> Client:
    client = clients(broker.port, client_id, username=user, auto_start=False, **kwargs)
    client.paho.username_pw_set(user, PASSWORDS[user])
    client.connect()
    assert client.connect_reason == 0, f"{user} as {client_id}: CONNACK {client.connect_reason}"
    return client


def raw_connect(port: int, client_id: str, user: str, *, clean: bool = False, will: bool = False) -> bytes:
    """A CONNECT with the user's own (right) password; returns what the broker sends until it closes."""
    flags = 0xC0 | (0x02 if clean else 0) | (0x0C if will else 0)  # user, password, clean, will QoS 1
    body = mqtt_string("MQTT") + bytes([4, flags, 0, 60]) + mqtt_string(client_id)
    if will:
        body += mqtt_string("secret/planted") + mqtt_string("planted by bob")
    body += mqtt_string(user) + mqtt_string(PASSWORDS[user])
    with socket.create_connection((HOST, port), timeout=WAIT) as sock:
        sock.sendall(mqtt_packet(0x10, body))
        received = b""
        while chunk := sock.recv(64):  # bounded by the socket timeout: the broker must close
            received += chunk
        return received


def session_row(broker: Broker, client_id: str) -> SessionSummary:
    broker.stop()
    return next(row for row in summarize(broker.store) if row.client_id == client_id)


def alice_with_queue(clients: Callable[..., Client], broker: Broker, count: int) -> tuple[Client, Client]:
    """alice's durable session holding ``count`` secret messages; returns (alice, publisher)."""
    alice = login(clients, broker, "alice-dev", "alice")
    assert alice.subscribe("secret/#", 1) == [1]
    alice.disconnect()
    pub = login(clients, broker, "pub", "pub", clean_session=True)
    pub.publish("secret/plans", payloads(count, "s"), qos=1)
    return alice, pub


# ------------------------------------------------------------------------------------- point 3


def test_another_user_is_refused_the_client_id_of_a_durable_session_and_its_queue_stays(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    broker = acl_broker(broker_factory)
    alice, pub = alice_with_queue(clients, broker, 5)
    assert raw_connect(broker.port, "alice-dev", "bob") == REFUSED, "a durable take-over by bob"
    assert raw_connect(broker.port, "alice-dev", "bob", clean=True) == REFUSED, "a clean CONNECT would wipe it"
    assert warnings(broker, "'alice-dev' by user 'bob' refused (CONNACK 5)"), broker.log()

    assert alice.connect() is True, "alice's session must still be there"
    assert [m.payload for m in alice.wait_messages(5)] == payloads(5, "s")
    # While alice is connected: a refused CONNECT must not close her connection nor plant its will.
    assert raw_connect(broker.port, "alice-dev", "bob", will=True) == REFUSED
    pub.publish("secret/plans", [b"live"], qos=1)
    assert alice.wait_for(lambda ms: ms[-1].payload == b"live")
    assert not alice.wait_disconnected(0.2), "bob's refused CONNECT closed alice's connection"
    alice.drop()  # abnormal end: a will, if bob had planted one, goes now, to alice's own queue
    assert alice.connect() is True
    pub.publish("secret/plans", [b"after"], qos=1)
    assert alice.wait_for(lambda ms: ms[-1].payload == b"after")
    assert b"planted by bob" not in [m.payload for m in alice.messages]
    alice.disconnect()
    bob = login(clients, broker, "bob-dev", "bob")  # his own client id: the control channel
    for op in ("hello", "end_session"):  # acts only on the connection's own session
        reply = request(bob, op, client_id="alice-dev")
        assert reply.error_code == "not_your_session", reply
    row = session_row(broker, "alice-dev")
    assert row.subscriptions == {"secret/#": 1} and row.dropped == 0


def test_with_any_user_takeover_bob_gets_nothing_alice_may_read_and_the_drops_are_counted(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    broker = acl_broker(broker_factory, session_takeover="any-user")
    _, pub = alice_with_queue(clients, broker, 5)
    bob = login(clients, broker, "alice-dev", "bob")
    assert bob.session_present is True
    hello = request(bob, "hello")
    assert hello.ok and hello.fields["subscriptions"] == {}, "alice's subscriptions do not pass to bob"
    assert warnings(broker, "durable session alice-dev passes from user 'alice' to user 'bob'"), broker.log()
    assert bob.subscribe("secret/#", 1) == [0x80]
    assert bob.subscribe("bob/#", 1) == [1]
    pub.publish("secret/plans", [b"new secret"], qos=1)
    pub.publish("bob/inbox", [b"for bob"], qos=1)  # FIFO per session: it comes after anything before it
    assert request(bob, "ready").ok  # hello made it an SDK session: held until ready, framed
    assert bob.wait_for(lambda ms: any(m.topic == "bob/inbox" for m in ms))
    # paho sends a PUBACK once the message's callback has returned: a DISCONNECT sent now could
    # overtake it, and the message would rightly stay queued. A reply that comes after bob/inbox
    # is read by the same network thread after that PUBACK is queued, so the PUBACK goes first.
    assert request(bob, "ready").fields == {"already": True}
    secrets = [m.payload for m in bob.messages if m.topic.startswith("secret/")]
    assert not secrets, f"bob read alice's {secrets}"
    got = [(topic, payload) for topic, _, payload in events(bob)]
    assert got == [("bob/inbox", b"for bob")], f"bob read {got}"
    bob.disconnect()
    row = session_row(broker, "alice-dev")
    assert row.dropped == 5, "the queued messages bob may not read are dropped and counted"
    assert row.depth == 0 and row.subscriptions == {"bob/#": 1}


def test_receive_acl_is_checked_on_queued_messages_and_retained_ones_sent_on_subscribe(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], tmp_path: Path
) -> None:
    """The receive ACL blocked new messages but not those queued before the take-over, nor retained
    messages queued with a subscription."""
    (tmp_path / "receive_acl.py").write_text(RECEIVE_ACL_PLUGIN)
    broker = broker_factory(start=False, session_takeover="any-user")
    broker.pythonpath.append(str(tmp_path))
    broker.extra_plugins["receive_acl.ReceiveAcl"] = {"receive": {"alice": ["a/"], "bob": ["b/"]}}
    broker.start()
    alice = clients(broker.port, "shared-dev", username="alice")
    assert alice.subscribe("#", 1) == [1]
    alice.disconnect()
    pub = clients(broker.port, "pub", clean_session=True)
    pub.publish("a/state", [b"alice's state"], qos=1, retain=True)
    pub.publish("b/state", [b"bob's state"], qos=1, retain=True)
    pub.publish("a/1", payloads(4, "a"), qos=1)

    bob = clients(broker.port, "shared-dev", username="bob")
    assert bob.session_present is True
    pub.publish("a/1", [b"new for alice"], qos=1)
    pub.publish("b/1", [b"for bob"], qos=1)
    assert bob.wait_for(lambda ms: any(m.topic == "b/1" for m in ms))
    assert [(m.topic, m.payload) for m in bob.messages] == [("b/1", b"for bob")]

    other = clients(broker.port, "bob-dev", username="bob")
    assert other.subscribe("#", 1) == [1]
    pub.publish("b/2", [b"marker"], qos=1)
    assert other.wait_for(lambda ms: any(m.topic == "b/2" for m in ms))
    assert [(m.topic, m.retain) for m in other.messages] == [("b/state", True), ("b/2", False)]
    bob.disconnect()
    other.disconnect()
    broker.stop()
    rows = {row.client_id: row for row in summarize(broker.store)}
    assert rows["shared-dev"].dropped == 5, "what was queued for alice (a/state and 4 on a/1) is dropped"
    assert rows["bob-dev"].dropped == 0, "a retained message bob may not read is not even queued"


# ------------------------------------------------------------------------------------- point 9


def reconnect_twice(clients: Callable[..., Client], broker: Broker, client_id: str) -> float:
    """connect, subscribe, disconnect, reconnect, disconnect; returns when the last disconnect began."""
    device = clients(broker.port, client_id)
    assert device.subscribe("exp/t", 1) == [1]
    device.disconnect()
    assert device.connect() is True
    gone = time.monotonic()
    device.disconnect()
    return gone


def take_over_then_leave(clients: Callable[..., Client], broker: Broker, client_id: str) -> float:
    """connect, subscribe, a second connection of the client id takes the session over, disconnects
    (with session_expiry: 0 the only way to CONNECT to an existing session); returns when it left."""
    first = clients(broker.port, client_id)
    assert first.subscribe("exp/t", 1) == [1]
    second = clients(broker.port, client_id)
    assert second.session_present is True
    assert first.wait_disconnected(), "the take-over must close the first connection"
    gone = time.monotonic()
    second.disconnect()
    return gone


@pytest.mark.parametrize(("expiry", "reconnect"), [(0, take_over_then_leave), (1, reconnect_twice)])
def test_expiry_counts_from_the_last_disconnect_after_a_reconnect(
    expiry: int,
    reconnect: Callable[[Callable[..., Client], Broker, str], float],
    broker_factory: Callable[..., Broker],
    clients: Callable[..., Client],
) -> None:
    broker = broker_factory(session_expiry=expiry)
    monitor = clients(broker.port, "monitor", clean_session=True)
    assert monitor.subscribe(EXPIRED_TOPIC, 1) == [1]
    gone = reconnect(clients, broker, "dev")
    wait_expired(monitor, "dev", timeout=expiry + 5)
    waited = time.monotonic() - gone
    assert waited <= expiry + 3, f"session_expiry={expiry} but it expired {waited:.1f} s after the last disconnect"
    assert clients(broker.port, "dev").session_present is False


def test_expiry_after_reconnects_holds_across_a_restart(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    broker = broker_factory(session_expiry=2)
    reconnect_twice(clients, broker, "before")
    broker.restart(kill=True)  # its deadline is stored, or counts from the restart if the kill came first
    monitor = clients(broker.port, "monitor", clean_session=True)
    assert monitor.subscribe(EXPIRED_TOPIC, 1) == [1]
    gone = reconnect_twice(clients, broker, "after")
    wait_expired(monitor, "after", timeout=7)
    waited = time.monotonic() - gone
    assert waited <= 5, f"session_expiry=2 but it expired {waited:.1f} s after the last disconnect"
    broker.stop()
    left = {row.client_id for row in summarize(broker.store)}
    assert not {"before", "after"} & left, f"sessions past their deadline still stored: {left}"
