"""``amqtt-durable repair`` keeps a released QoS 2 message (PUBREC received, PUBREL due) whose body
is gone or does not decode: the client already has the message and is owed only a PUBREL with the
packet id, so after the repair the broker sends it on reconnect and the client's QoS 2 flow for
that packet id completes with PUBCOMP; the rest of the queue follows in order. A real store, the
real repair command, a real broker, a raw-socket client."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
from test_mixed_clients import RECEIVE_ACL_PLUGIN
from test_scale import RawClient

from amqtt_durable.store import (
    FLAG_RELEASED,
    FLAG_SHARED,
    NO_BODY,
    Entry,
    body_key,
    entry_key,
    iter_entries,
    iter_sessions,
    open_store,
    refs_key,
)
from conftest import WAIT, Broker, Client, mqtt_packet, payloads, run_cli

pytestmark = pytest.mark.timeout(120)

_U16 = struct.Struct(">H")
PUBREL, PUBCOMP, PUBREC = 0x62, 0x70, 0x50


def queues(store: str) -> dict[str, list[Entry]]:
    db = open_store(store, create=False)
    try:
        return {record.client_id: list(iter_entries(db, record.sid)) for record in iter_sessions(db)}
    finally:
        db.close()


def receive_qos2(raw: RawClient, count: int) -> list[bytes]:
    """Read ``count`` QoS 2 PUBLISHes with their PUBRELs (PUBREC each, PUBCOMP each PUBREL), in the
    order the broker pipelines them; their payloads in order."""
    got: list[bytes] = []
    released: list[int] = []
    for _ in range(2 * count):  # count PUBLISHes and count PUBRELs
        first, body = raw.read_packet()
        if first == PUBREL:
            released.append(_U16.unpack(body)[0])
            raw.send(mqtt_packet(PUBCOMP, body))
            continue
        assert first >> 4 == 3 and (first >> 1) & 0x03 == 2, f"expected a QoS 2 PUBLISH, got {first:#x}"
        (topic_len,) = _U16.unpack_from(body)
        raw.send(mqtt_packet(PUBREC, body[2 + topic_len : 4 + topic_len]))
        got.append(body[4 + topic_len :])
    assert len(released) == count, released
    return got


def read_publish(raw: RawClient) -> tuple[int, int, bytes]:
    """The next packet, a PUBLISH: (QoS, packet id, payload)."""
    first, body = raw.read_packet()
    assert first >> 4 == 3, f"expected a PUBLISH, got packet type {first >> 4}"
    qos = (first >> 1) & 0x03
    (topic_len,) = _U16.unpack_from(body)
    (packet_id,) = _U16.unpack_from(body, 2 + topic_len)
    return qos, packet_id, body[4 + topic_len :]


def released_first(
    broker: Broker,
    clients: Callable[..., Client],
    damage: str,
    *,
    then: Callable[[Client], None] = lambda publisher: None,
    other_filter: str | None = None,
) -> tuple[int, Entry]:
    """The set-up every test here shares. Session other (when ``other_filter`` is given, QoS 1)
    and raw device dev (q2/#, QoS 2); message "first" (QoS 2) goes to dev, which sends PUBREC,
    gets the PUBREL and goes away before its PUBCOMP: the entry stays, released. ``then`` publishes
    more with the publisher; the broker stops; the released entry's body is damaged ("body
    deleted", or "body undecodable": LevelDB reads it intact, its topic length runs past its end).
    Returns (dev's packet id for "first", the released entry as stored before the damage)."""
    if other_filter is not None:
        other = clients(broker.port, "other")
        assert other.subscribe(other_filter, 1) == [1]
        other.disconnect()
    device = RawClient(broker.port, "dev")
    assert device.connect() is False
    assert device.subscribe("q2/#", 2) == 2
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("q2/t", [b"first"], qos=2)
    qos, packet_id, payload = read_publish(device)
    assert (qos, payload) == (2, b"first")
    device.send(mqtt_packet(PUBREC, _U16.pack(packet_id)))
    assert device.expect(PUBREL >> 4) == _U16.pack(packet_id)
    device.close()
    then(publisher)
    publisher.disconnect()
    broker.stop()
    released = queues(broker.store)["dev"][0]
    assert released.flags & FLAG_RELEASED
    db = open_store(broker.store, create=False)
    try:
        if damage == "body deleted":
            db.delete(body_key(released.msg_id))
        else:
            db.put(body_key(released.msg_id), struct.pack(">dBH", 1.0, 2, 500) + b"q2/t")
    finally:
        db.close()
    return packet_id, released


def fence(broker: Broker, clients: Callable[..., Client], device: RawClient) -> None:
    """Nothing more is queued for the device before this: a QoS 1 message published now is the
    next packet it gets (the queue is sent in order), acknowledged."""
    publisher = clients(broker.port, "fence", clean_session=True)
    publisher.publish("q2/fence", [b"fence"], qos=1)
    publisher.disconnect()
    qos, packet_id, payload = read_publish(device)
    assert (qos, payload) == (1, b"fence"), payload
    device.send(mqtt_packet(0x40, _U16.pack(packet_id)))


@pytest.mark.parametrize("damage", ["body deleted", "body undecodable"])
def test_repair_keeps_a_released_qos2_entry_without_its_body_and_its_pubrel_completes_on_reconnect(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], damage: str
) -> None:
    broker = broker_factory()
    rest = payloads(5, "rest")
    # other: a second durable session, so the first body is shared.
    packet_id, released = released_first(
        broker, clients, damage, then=lambda publisher: publisher.publish("q2/t", rest, qos=2), other_filter="q2/#"
    )
    before = queues(broker.store)
    assert released.flags & FLAG_SHARED, before
    assert before["other"][0].msg_id == released.msg_id

    repaired = run_cli("repair", broker.store)
    assert repaired.returncode == 0, repaired.stderr
    state = "is gone" if damage == "body deleted" else "does not decode"
    assert (
        f"client 'dev': queue entry {released.seq} (QoS 2, PUBREL due): its body, message {released.msg_id}, "
        f"{state}; kept without it (the client has the message; its PUBREL is sent when it reconnects)"
    ) in repaired.stdout, repaired.stdout
    assert "client 'other': 1 queued message(s) unreadable (removed)" in repaired.stdout
    after = queues(broker.store)
    kept = after["dev"][0]
    assert (kept.seq, kept.msg_id, kept.qos, kept.size) == (released.seq, NO_BODY, 2, 0)
    assert kept.flags & FLAG_RELEASED and not kept.flags & FLAG_SHARED
    assert [entry.seq for entry in after["dev"]] == [entry.seq for entry in before["dev"]]
    assert [entry.seq for entry in after["other"]] == [entry.seq for entry in before["other"][1:]]
    db = open_store(broker.store, create=False)
    try:  # nothing points at the first message's body any more: neither it nor its reference count is left
        assert db.get(body_key(released.msg_id)) is None and db.get(refs_key(released.msg_id)) is None
    finally:
        db.close()
    again = run_cli("repair", broker.store)  # a second repair finds nothing more to do
    assert again.returncode == 0 and "were all consistent" in again.stdout, again.stdout

    broker.start()
    device = RawClient(broker.port, "dev")
    assert device.connect() is True
    assert device.expect(PUBREL >> 4) == _U16.pack(packet_id)  # first, before the rest of the queue
    device.send(mqtt_packet(PUBCOMP, _U16.pack(packet_id)))
    assert receive_qos2(device, len(rest)) == rest
    fence(broker, clients, device)  # nothing more came before it: no PUBLISH of the first message
    device.disconnect(wait_closed=True)
    other = clients(broker.port, "other")
    assert [m.payload for m in other.wait_messages(len(rest) + 1)] == [*rest, b"fence"]  # its first is lost
    other.disconnect()
    broker.stop()

    shown = run_cli("inspect", broker.store, "--json")
    assert shown.returncode == 0, shown.stderr
    depths = {row["client_id"]: row["depth"] for row in json.loads(shown.stdout)}
    assert depths == {"dev": 0, "other": 0}  # the PUBCOMP removed the released entry


@pytest.mark.parametrize("damage", ["body deleted", "body undecodable"])
def test_without_a_repair_a_released_entry_whose_body_is_gone_or_damaged_still_gets_its_pubrel(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], damage: str
) -> None:
    """Delivery never needs the body of a released entry: a broker on a store whose released
    message lost its body (or holds one that does not decode) sends the PUBREL, then the rest of
    the queue, without stopping at it or removing it."""
    broker = broker_factory()
    packet_id, released = released_first(
        broker, clients, damage, then=lambda publisher: publisher.publish("q2/t", [b"second"], qos=1)
    )

    broker.start()
    device = RawClient(broker.port, "dev")
    assert device.connect() is True
    assert device.expect(PUBREL >> 4) == _U16.pack(packet_id)
    device.send(mqtt_packet(PUBCOMP, _U16.pack(packet_id)))
    qos, pid, payload = read_publish(device)
    assert (qos, payload) == (1, b"second")
    device.send(mqtt_packet(0x40, _U16.pack(pid)))
    device.disconnect(wait_closed=True)
    broker.stop()
    assert queues(broker.store) == {"dev": []}
    log = broker.log()
    assert "has no message body" not in log and "reading its queue" not in log
    state = "is gone; " if damage == "body deleted" else "does not decode ("
    assert (
        f"session dev: queue entry {released.seq} (QoS 2, PUBREL due): its body, message {released.msg_id}, {state}"
    ) in log, log
    db = open_store(broker.store, create=False)
    try:
        assert db.get(body_key(released.msg_id)) is None  # a damaged body went with the entry's PUBCOMP
    finally:
        db.close()


@pytest.mark.parametrize("read_first", [False, True])
def test_a_new_message_never_takes_the_id_of_a_gone_body_a_released_entry_still_names(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], read_first: bool
) -> None:
    """The released entry's body was the highest one stored; once it is gone, ids went on from the
    highest body left, so the next message took that id, and the released entry's PUBCOMP deleted
    the new message's body: another session lost it. ``read_first``: the device reconnects and
    leaves before PUBCOMP first, so the broker has read the entry without its body."""
    broker = broker_factory()
    packet_id, _ = released_first(broker, clients, "body deleted", other_filter="o/#")
    pid = _U16.pack(packet_id)

    broker.start()
    if read_first:
        device = RawClient(broker.port, "dev")
        assert device.connect() is True
        assert device.expect(PUBREL >> 4) == pid
        device.disconnect(wait_closed=True)
    publisher = clients(broker.port, "pub2", clean_session=True)
    publisher.publish("o/t", [b"for-other"], qos=1)
    publisher.disconnect()
    device = RawClient(broker.port, "dev")
    assert device.connect() is True
    assert device.expect(PUBREL >> 4) == pid
    device.send(mqtt_packet(PUBCOMP, pid))
    device.disconnect(wait_closed=True)
    other = clients(broker.port, "other")
    assert [m.payload for m in other.wait_messages(1, timeout=WAIT)] == [b"for-other"]
    other.disconnect()
    broker.stop()


def queue_one_and_two(
    broker: Broker,
    clients: Callable[..., Client],
    topic_filter: str = "t/#",
    *,
    username: str | None = None,
    before: tuple[tuple[str, bytes], ...] = (),
) -> None:
    """Session dev (user ``username``) subscribes to ``topic_filter`` (QoS 1) and goes away; a
    publisher sends ``before`` ((topic, payload) each), then "one" and "two" to t/x, all QoS 1;
    the broker stops."""
    subscriber = clients(broker.port, "dev", username=username)
    assert subscriber.subscribe(topic_filter, 1) == [1]
    subscriber.disconnect()
    publisher = clients(broker.port, "pub", clean_session=True)
    for topic, payload in before:
        publisher.publish(topic, [payload], qos=1)
    publisher.publish("t/x", [b"one", b"two"], qos=1)
    publisher.disconnect()
    broker.stop()


def flag_released(store: str, qos: int, flagged: slice, *, delete_bodies: bool = False) -> list[Entry]:
    """Damage: dev's queue entries ``flagged`` (each stored with its body) get QoS ``qos`` and the
    RELEASED flag, and lose their bodies when ``delete_bodies``. Returns dev's entries as they were."""
    db = open_store(store, create=False)
    try:
        (sid,) = (record.sid for record in iter_sessions(db) if record.client_id == "dev")
        entries = list(iter_entries(db, sid))
        for entry in entries[flagged]:
            assert db.get(body_key(entry.msg_id)) is not None
            db.put(
                entry_key(sid, entry.seq),
                Entry(entry.seq, entry.msg_id, qos, entry.flags | FLAG_RELEASED, entry.size).encode(),
            )
            if delete_bodies:
                db.delete(body_key(entry.msg_id))
    finally:
        db.close()
    return entries


@pytest.mark.parametrize("qos", [0, 1])
def test_a_released_flag_on_an_entry_that_is_not_qos2_does_not_spare_it_without_its_body(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], qos: int
) -> None:
    """Only a QoS 2 entry awaits PUBCOMP: a QoS 0 or 1 entry with the RELEASED flag (damage) whose
    body is gone is removed like any entry without a body, and the rest of the queue follows. It
    was passed on with an empty body, and delivery failed on it at every reconnect."""
    broker = broker_factory()
    queue_one_and_two(broker, clients)
    damaged = flag_released(broker.store, qos, slice(1), delete_bodies=True)[0]

    broker.start()
    subscriber = clients(broker.port, "dev")
    assert [m.payload for m in subscriber.wait_messages(1, timeout=WAIT)] == [b"two"]
    subscriber.disconnect()
    broker.stop()
    assert queues(broker.store) == {"dev": []}
    log = broker.log()
    assert f"session dev: queue entry {damaged.seq} has no message body; removing it" in log
    assert "Traceback" not in log


@pytest.mark.parametrize("acl", [False, True])
def test_a_released_flag_on_a_qos1_entry_with_its_body_still_sends_its_publish(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], tmp_path: Path, acl: bool
) -> None:
    """A QoS 1 entry with the RELEASED flag (damage) that has its body is sent as a PUBLISH, never
    as a PUBREL, and in order. ``acl``: with a receive ACL the pump checks each message's topic;
    the flag spares a QoS 1 entry nothing there either (one on a topic the user may not read is
    dropped, not sent)."""
    broker = broker_factory(start=False)
    if acl:
        (tmp_path / "receive_acl.py").write_text(RECEIVE_ACL_PLUGIN)
        broker.pythonpath.append(str(tmp_path))
        broker.extra_plugins["receive_acl.ReceiveAcl"] = {"receive": {"alice": ["t/", "secret/"]}}
    broker.start()
    before = (("secret/x", b"secret"),) if acl else ()
    queue_one_and_two(broker, clients, "#" if acl else "t/#", username="alice", before=before)
    entries = flag_released(broker.store, 1, slice(-1))  # "one" (and "secret"): RELEASED, bodies kept
    assert len(entries) == (3 if acl else 2)

    if acl:  # alice may no longer read what is queued for her under secret/
        broker.extra_plugins["receive_acl.ReceiveAcl"] = {"receive": {"alice": ["t/"]}}
    broker.start()
    subscriber = clients(broker.port, "dev", username="alice")
    assert subscriber.session_present is True
    assert [(m.topic, m.payload, m.qos) for m in subscriber.wait_messages(2, timeout=WAIT)] == [
        ("t/x", b"one", 1),
        ("t/x", b"two", 1),
    ]
    subscriber.disconnect()
    broker.stop()
    assert queues(broker.store) == {"dev": []}
    assert "Traceback" not in broker.log()
