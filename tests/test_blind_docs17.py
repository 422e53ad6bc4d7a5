"""Blind tests of docs/guarantees.md and docs/sdk.md written from those docs alone, for promises the earlier
test_blind_* and test_docs_promises* files leave out (combinations of them, mostly): each test quotes what it
checks and runs it as a user would, against real ``amqtt-durable broker`` processes, raw MQTT 3.1.1 sockets,
paho and SDK clients over TCP to 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from packet_relay import Packet, PacketRelay
from raw_mqtt_helpers import Raw, connect_packet, raw_connect, read_exactly, read_packet
from test_blind_docs15 import Seen

from conftest import WAIT, Broker, Client, mqtt_packet, mqtt_string, seen_away
from durable_client import AsyncDurableClient, DurableClient, RequestTimeout, Unconnected

pytestmark = pytest.mark.timeout(60)

Publish = tuple[str, int, bool, bytes]
"""A PUBLISH the broker sent: topic, QoS, RETAIN flag, payload."""


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    """One broker for the tests of this file that need no setting of their own (each uses its own client ids
    and topics)."""
    broker = Broker(tmp_path_factory.mktemp("shared"))
    broker.start()
    yield broker
    broker.stop()


def subscribe_packet(packet_id: int, entries: list[tuple[str, int]]) -> bytes:
    """One SUBSCRIBE of ``entries`` (filter, requested QoS), in that order."""
    body = packet_id.to_bytes(2, "big") + b"".join(mqtt_string(f) + bytes((qos,)) for f, qos in entries)
    return mqtt_packet(0x82, body)


def read_until_pingresp(sock: socket.socket) -> tuple[list[Publish], list[tuple[int, bytes]]]:
    """Send a PINGREQ and read up to its PINGRESP: the PUBLISHes (acknowledged as they come) and the other
    packets the broker wrote before it. Not everything the broker will send before it: a PINGREQ is
    answered as it is read, a SUBSCRIBE once applied (a durable one after a store commit), so its SUBACK and
    retained messages may come after a PINGRESP sent behind it (``read_publishes`` reads on)."""
    sock.sendall(b"\xc0\x00")
    publishes: list[Publish] = []
    others: list[tuple[int, bytes]] = []
    for _ in range(10_000):
        first, body = read_packet(sock)
        if first == 0xD0:
            return publishes, others
        if first >> 4 != 3:
            others.append((first, body))
            continue
        length = int.from_bytes(body[:2], "big")
        topic, rest, qos = body[2 : 2 + length].decode(), body[2 + length :], (first >> 1) & 3
        if qos:
            packet_id, rest = rest[:2], rest[2:]
            sock.sendall(bytes((0x40 if qos == 1 else 0x50, 2)) + packet_id)
        publishes.append((topic, qos, bool(first & 1), rest))
    raise AssertionError("no PINGRESP")


def read_publishes(
    sock: socket.socket, count: int, others_due: int = 0
) -> tuple[list[Publish], list[tuple[int, bytes]]]:
    """Read until ``count`` PUBLISHes (acknowledging them) and ``others_due`` other packets (a SUBACK) came,
    each run of reads up to a PINGRESP (read_until_pingresp), in whatever order the broker sends them."""
    publishes: list[Publish] = []
    others: list[tuple[int, bytes]] = []
    for _ in range(count + others_due + 100):
        if len(publishes) >= count and len(others) >= others_due:
            break
        more, other = read_until_pingresp(sock)
        publishes += more
        others += other
    return publishes, others


def retained_at(client: Client, topic: str, payload: bytes, qos: int) -> None:
    """Store ``payload`` as ``topic``'s retained message (acknowledged at QoS 1/2)."""
    client.publish(topic, [payload], qos=qos, retain=True)


# ------------------------------------------------------------------ SDK helpers: calls in a thread, a relay
class InThread:
    """A blocking SDK call run in a thread of its own, so that the test can act while it waits."""

    def __init__(self, call: Callable[[], object]) -> None:
        self._ended: list[BaseException | None] = []
        self._thread = threading.Thread(target=self._run, args=(call,), daemon=True)
        self._thread.start()

    def _run(self, call: Callable[[], object]) -> None:
        try:
            call()
            self._ended.append(None)
        except BaseException as exc:  # handed to the test's thread
            self._ended.append(exc)

    def still_waiting(self) -> bool:
        """The call has not returned within a short while (it cannot, in the state the test set up)."""
        self._thread.join(0.3)
        return self._thread.is_alive() and not self._ended

    def outcome(self) -> BaseException | None:
        """What the call raised, None when it returned; AssertionError when it is still running."""
        self._thread.join(3 * WAIT)
        assert self._ended, "the call is still waiting"
        return self._ended[0]


def hello_reply(packet: Packet) -> bool:
    return packet.direction == "down" and (packet.control() or {}).get("op") == "hello"


def reconnect_through(relay: PacketRelay, *, hold_hello: bool) -> int:
    """Cut the client's link through ``relay`` (what the relay held for the client is lost with it) and let the
    client connect again, its hello reply held with ``hold_hello``; where the new link's packets start in
    ``relay.seen``."""
    cut_at = len(relay.seen)
    relay.cut()
    relay.release("down")  # into the cut link: lost
    if hold_hello:
        relay.hold("down", hello_reply)
    relay.accept()
    return cut_at


def not_seen_for_a_while(relay: PacketRelay, predicate: Callable[[Packet], bool], after: int = 0) -> None:
    """No packet matching ``predicate`` passes ``relay`` within a quiet window of 0.5 s."""
    relay.wait = 0.5
    try:
        with pytest.raises(AssertionError, match="no such packet"):
            relay.wait_seen(predicate, after)
    finally:
        relay.wait = WAIT


# ------------------------------------------------------------------ guarantees.md: one SUBSCRIBE, one filter twice
@pytest.mark.parametrize("clean", [False, True], ids=["durable", "clean"])
def test_one_subscribe_naming_a_filter_twice_sends_its_retained_message_per_entry_and_keeps_the_last_qos(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], clean: bool
) -> None:
    """guarantees.md, Delivered QoS: "A retained message sent because of a SUBSCRIBE is not a published message:
    it comes once per filter of the SUBSCRIBE that matches it, at the lower of that filter's QoS and its own,
    durable and clean sessions alike (... MQTT-3.8.4-4 handles a SUBSCRIBE of several filters as that many
    SUBSCRIBEs)"; "A SUBSCRIBE of a filter the session already holds replaces that subscription: messages
    published after it come at the new QoS". So one SUBSCRIBE naming `f` at QoS 0 and then `f` at QoS 1 gets
    the retained message twice (QoS 0, then QoS 1, RETAIN=1) and holds one subscription at QoS 1: a QoS 2
    publish comes once, at QoS 1, and a durable session queues it while away (a QoS 0 subscription would
    not: "QoS 0 messages ... are queued for a disconnected session only with `queue_qos0: true`")."""
    broker = broker_factory(metrics_interval=0.05)  # seen_away: its own, the only durable session in it
    kind = "clean" if clean else "durable"
    topic = f"b17twice/{kind}"
    publisher = clients(broker.port, f"b17twice-pub-{kind}", clean_session=True)
    retained_at(publisher, topic, b"kept", qos=2)
    sock = raw_connect(broker.port, f"b17twice-{kind}", clean=clean)
    sock.sendall(subscribe_packet(7, [(topic, 0), (topic, 1)]))
    publishes, others = read_publishes(sock, 2, others_due=1)
    assert publishes == [(topic, 0, True, b"kept"), (topic, 1, True, b"kept")]
    assert others == [(0x90, b"\x00\x07\x00\x01")], "one SUBACK, granting QoS 0 and 1"
    if clean:
        publisher.publish(topic, [b"live"], qos=2)
        publishes, _ = read_publishes(sock, 1)
        assert publishes == [(topic, 1, False, b"live")], "one subscription, at the last entry's QoS"
        sock.close()
        return
    sock.sendall(b"\xe0\x00")
    sock.close()
    seen_away(clients, broker, 1)  # the broker has the session disconnected before the publish comes
    publisher.publish(topic, [b"while away"], qos=2)
    back = socket.create_connection(("127.0.0.1", broker.port), timeout=WAIT)
    back.sendall(connect_packet(f"b17twice-{kind}", clean=False))
    assert read_exactly(back, 4) == b"\x20\x02\x01\x00", "session present"
    publishes, _ = read_publishes(back, 1)
    assert publishes == [(topic, 1, False, b"while away")], "queued at QoS 1 while away"
    back.sendall(b"\xe0\x00")
    back.close()


# ------------------------------------------------------------------ guarantees.md: retained runs, several filters
@pytest.mark.parametrize("clean", [False, True], ids=["durable", "clean"])
def test_two_filters_of_one_subscribe_each_get_every_retained_topic_past_a_run_of_256(
    shared: Broker, clients: Callable[..., Client], clean: bool
) -> None:
    """guarantees.md, Delivered QoS: a retained message sent because of a SUBSCRIBE "comes once per filter of
    the SUBSCRIBE that matches it, at the lower of that filter's QoS and its own, durable and clean sessions
    alike (a SUBSCRIBE of `a/#` at QoS 0 and `a/b` at QoS 1 gets a retained `a/b` stored at QoS 1 or 2 twice,
    at QoS 0 and 1"; operations.md has a SUBSCRIBE's retained messages go 256 at a time. With 300 retained
    topics (more than one run) under two filters of one SUBSCRIBE, each filter gets every topic's retained
    message once, RETAIN=1, at its own QoS, and nothing else comes."""
    kind = "clean" if clean else "durable"
    prefix = f"b17runs/{kind}"
    count = 300
    publisher = clients(shared.port, f"b17runs-pub-{kind}", clean_session=True)
    infos = [publisher.paho.publish(f"{prefix}/{i:03d}", b"v%d" % i, qos=1, retain=True) for i in range(count)]
    for info in infos:
        info.wait_for_publish(WAIT)
        assert info.is_published()
    sock = raw_connect(shared.port, f"b17runs-{kind}", clean=clean)
    sock.sendall(subscribe_packet(5, [(f"{prefix}/#", 0), (f"{prefix}/+", 1)]))
    publishes, others = read_publishes(sock, 2 * count, others_due=1)
    assert others == [(0x90, b"\x00\x05\x00\x01")]
    expected = {(f"{prefix}/{i:03d}", b"v%d" % i) for i in range(count)}
    for qos in (0, 1):
        got = [(topic, payload) for topic, q, _retain, payload in publishes if q == qos]
        assert len(got) == count and set(got) == expected, f"QoS {qos}: each retained topic once"
    assert len(publishes) == 2 * count and all(retain for _t, _q, retain, _p in publishes)
    sock.sendall(b"\xe0\x00")
    sock.close()


# ------------------------------------------------------------------ guarantees.md: $ topics and wildcards
def test_a_durable_sessions_wildcard_first_level_filters_do_not_match_the_expired_event(
    shared: Broker, clients: Callable[..., Client], raws: Callable[..., Raw]
) -> None:
    """guarantees.md, lifecycle: "Wills and broker-internal messages (`$SYS/...`) reach durable sessions
    through the same queue. As MQTT requires, filters starting with `+` or `#` do not match `$` topics"; on
    expiry the broker "publishes, at QoS 1, on `$SYS/broker/durable/expired`"; "`session_expiry: 0` deletes
    a session as soon as it disconnects" (here a hello's override of 0). A durable session holding `#` and
    `+/broker/durable/expired` gets no expired event, one naming the topic gets it (at QoS 1), and the first
    one's later messages come without it before them (FIFO: the event was published first)."""
    wild = clients(shared.port, "b17dollar-wild")
    assert wild.subscribe([("#", 1), ("+/broker/durable/expired", 1)]) == [1, 1]
    named = clients(shared.port, "b17dollar-named")
    assert named.subscribe("$SYS/broker/durable/expired", 2) == [2]
    expiring = raws(shared.port, "b17dollar-expiring")
    assert expiring.request({"v": 1, "op": "hello", "req": 1, "session_expiry": 0})["ok"] is True
    expiring.close()
    assert named.wait_for(lambda ms: any(b'"b17dollar-expiring"' in m.payload for m in ms)), "no expired event"
    event = next(m for m in named.messages if b'"b17dollar-expiring"' in m.payload)
    assert (event.topic, event.qos) == ("$SYS/broker/durable/expired", 1)
    clients(shared.port, "b17dollar-pub", clean_session=True).publish("b17dollar/after", [b"sentinel"])
    assert wild.wait_for(lambda ms: any(m.topic == "b17dollar/after" for m in ms)), "the sentinel never came"
    assert not [m.topic for m in wild.messages if m.topic.startswith("$")], "a $ topic matched # or +/..."


# ------------------------------------------------------------------ sdk.md: AsyncDurableClient and QoS 0
def test_an_async_body_that_raises_on_a_qos0_event_logs_an_error_and_the_event_counts_as_processed(
    shared: Broker, clients: Callable[..., Client], caplog: pytest.LogCaptureFixture
) -> None:
    """sdk.md, asyncio: "A body that raises does not acknowledge it: the client reconnects and the broker sends
    it again ...; an event delivered at QoS 0, which cannot come again, is logged (ERROR) and counts as
    processed". So the exception reaches the code around the loop, no reconnect follows, and the next
    `events()` goes on with the next event, not the failed one again."""
    publisher = clients(shared.port, "b17aq0-pub", clean_session=True)
    caplog.set_level(logging.ERROR, logger="durable_client")

    async def main() -> None:
        async with AsyncDurableClient("b17aq0", "127.0.0.1", shared.port, reconnect_max_delay=0.5) as client:
            await client.subscribe("b17aq0/#", qos=0)
            await client.ready_for_events()
            await asyncio.to_thread(publisher.publish, "b17aq0/t", [b"m1", b"m2", b"m3"], 0)
            with pytest.raises(RuntimeError, match="on purpose"):
                async with client.events() as events:
                    async for event in events:
                        assert (event.payload, event.qos) == (b"m1", 0)
                        raise RuntimeError("body failed (on purpose)")
            rest: list[bytes] = []

            async def collect() -> None:
                async with client.events() as events:
                    async for event in events:
                        rest.append(event.payload)
                        if len(rest) == 2:
                            break

            await asyncio.wait_for(collect(), WAIT)
            assert rest == [b"m2", b"m3"], "the failed QoS 0 event is not given again"
            assert client.stats.redeliveries_requested == 0 and client.stats.reconnects == 0
            assert client.stats.processed == 3, "the failed QoS 0 event counts as processed"

    asyncio.run(main())
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("b17aq0/t" in message for message in errors), errors


# ------------------------------------------------------------------ guarantees.md: stored before CONNACK / SUBACK
def test_the_owner_and_a_subscription_acknowledged_just_before_a_sigkill_survive_it(broker: Broker) -> None:
    """guarantees.md, lifecycle: a durable session "is stored before CONNACK; its subscriptions are stored
    before SUBACK"; "session_present in CONNACK comes from the store: ... 1 for an existing one, also after a
    broker restart or crash. Subscriptions come back without re-subscribing"; Owner: "a session belongs to the
    user ... whose CONNECT created it. With `session_takeover: owner-only` (default) a CONNECT of its client id
    by any other user, clean or not, is refused with CONNACK 5". The broker is SIGKILLed right after the
    SUBACK: after the restart the session keeps its owner (bob's CONNECTs, clean and durable, get CONNACK 5)
    and its subscription (a publish is queued for it)."""
    sock = socket.create_connection(("127.0.0.1", broker.port), timeout=WAIT)
    sock.sendall(connect_packet("b17kill", clean=False, username="alice"))
    assert read_exactly(sock, 4) == b"\x20\x02\x00\x00"
    sock.sendall(subscribe_packet(1, [("b17kill/t", 1)]))
    assert read_packet(sock) == (0x90, b"\x00\x01\x01")
    broker.kill()
    sock.close()
    broker.start()
    for clean in (False, True):
        other = socket.create_connection(("127.0.0.1", broker.port), timeout=WAIT)
        other.sendall(connect_packet("b17kill", clean=clean, username="bob"))
        assert read_exactly(other, 4) == b"\x20\x02\x00\x05", f"another user's CONNECT (clean={clean})"
        other.close()
    publisher = Client(broker.port, "b17kill-pub", clean_session=True)
    publisher.publish("b17kill/t", [b"after the crash"])
    publisher.disconnect()
    back = socket.create_connection(("127.0.0.1", broker.port), timeout=WAIT)
    back.sendall(connect_packet("b17kill", clean=False, username="alice"))
    assert read_exactly(back, 4) == b"\x20\x02\x01\x00", "session present after the SIGKILL"
    publishes, _ = read_publishes(back, 1)
    assert publishes == [("b17kill/t", 1, False, b"after the crash")]
    back.sendall(b"\xe0\x00")
    back.close()


# ------------------------------------------------------------------ guarantees.md: a byte limit and the expansion
def ack_all(sock: socket.socket, packet_ids: list[bytes]) -> None:
    """PUBACK each of ``packet_ids``, then wait for a PINGRESP: the broker handled the acks (read in order)."""
    sock.sendall(b"".join(b"\x40\x02" + packet_id for packet_id in packet_ids))
    publishes, others = read_until_pingresp(sock)
    assert (publishes, others) == ([], []), "nothing was due"


def unacked(sock: socket.socket, count: int) -> list[tuple[bytes, bytes]]:
    """The next ``count`` QoS 1 PUBLISHes, not acknowledged: (packet id, payload) each."""
    got = []
    for _ in range(count):
        first, body = read_packet(sock)
        assert first >> 4 == 3 and (first >> 1) & 3 == 1, (first, body)
        length = int.from_bytes(body[:2], "big")
        got.append((body[2 + length : 4 + length], body[4 + length :]))
    return got


def test_without_max_bytes_disconnected_no_byte_limit_holds_the_expansion_until_80_percent_of_the_messages(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """guarantees.md, Queue limits: "With `max_bytes` set and `max_bytes_disconnected` 0, a disconnected queue
    has no byte limit and no byte limit holds the expansion after a reconnect: `max_bytes` applies again once
    the queue holds at most 80% of `max_depth_disconnected` messages ... (while the backlog is over
    `max_bytes`, each new message goes by the overflow policy)"; "A queue is full when either its message or
    its byte limit would be passed"; `drop-newest` "does not queue the new message for that session". With
    max_bytes 100 and 10 messages at most: 9 messages of 20 bytes queue while away (180 bytes); after the
    reconnect a 10th still goes in (9 > 8 messages: no byte limit yet); once the backlog is down to 8 (160
    bytes, acknowledged by the client) the next one is dropped; once all are acknowledged one goes in again."""
    broker = broker_factory(
        max_bytes=100, max_depth=10, max_depth_disconnected=10, overflow="drop-newest", metrics_interval=0.05
    )
    device = clients(broker.port, "b17bytes")
    device.subscribe("b17bytes/t", 1)
    device.disconnect()
    seen_away(clients, broker, 1)  # the broker has the session disconnected before the publishes come
    publisher = clients(broker.port, "b17bytes-pub", clean_session=True)
    away = [b"away-%014d" % i for i in range(9)]  # 20 bytes each
    publisher.publish("b17bytes/t", away)
    sock = socket.create_connection(("127.0.0.1", broker.port), timeout=WAIT)
    sock.sendall(connect_packet("b17bytes", clean=False))
    assert read_exactly(sock, 4) == b"\x20\x02\x01\x00"
    backlog = unacked(sock, 9)
    assert [payload for _pid, payload in backlog] == away, "a disconnected queue has no byte limit"
    publisher.publish("b17bytes/t", [b"tenth-%014d" % 10])
    [tenth] = unacked(sock, 1)
    assert tenth[1] == b"tenth-%014d" % 10, "the expansion holds with 9 of 10 messages, whatever the bytes"
    ack_all(sock, [backlog[0][0], backlog[1][0]])  # 8 left, 160 bytes: the limits revert
    publisher.publish("b17bytes/t", [b"dropped-%012d" % 11, b"x" * 20])
    ack_all(sock, [pid for pid, _payload in backlog[2:]] + [tenth[0]])  # nothing came meanwhile: both dropped
    publisher.publish("b17bytes/t", [b"last-%015d" % 12])
    assert [payload for _pid, payload in unacked(sock, 1)] == [b"last-%015d" % 12]
    sock.sendall(b"\xe0\x00")
    sock.close()


# ------------------------------------------------------------------ sdk.md: an UNSUBSCRIBE lost with its connection
def test_an_unsubscribe_lost_with_the_connection_goes_again_before_the_reconnects_subscribes(
    broker_factory: Callable[..., Broker], caplog: pytest.LogCaptureFixture
) -> None:
    """sdk.md, Subscriptions: "A durable session's UNSUBSCRIBE whose UNSUBACK had not come when the connection
    was lost is sent again after the reconnect if the broker's session still holds the filter (its hello reply
    lists it ...); it goes before the reconnect's SUBSCRIBEs, so the filters it removes no longer count against
    `max_subscriptions_per_client`"; `subscribe()` raises "`RequestTimeout` after `timeout` without that SUBACK"
    and the subscription "stays registered and is sent again after every reconnect"; the marker's `live` list
    "holds the filters they granted, not those refused with 0x80, nor those unsubscribed". With a limit of 2
    filters held (u/1, u/2), `unsubscribe(u/1)` and `subscribe(u/3)` are sent to a broker that is stopped
    (SIGSTOP) and then SIGKILLed, so it never read them: after its restart the session still holds u/1 and
    u/2, and the reconnect's UNSUBSCRIBE of u/1 makes room for u/3."""
    broker = broker_factory(max_subscriptions_per_client=2)
    seen = Seen()

    client = DurableClient(
        "b17unsub", port=broker.port, on_live=seen.on_live, reconnect_min_delay=0.05, reconnect_max_delay=0.3
    )
    try:
        client.subscribe("b17unsub/1")
        client.subscribe("b17unsub/2")
        client.connect(timeout=WAIT)
        client.ready_for_events()
        seen.until(lambda: len(seen.markers) >= 1)
        assert {s.filter for s in seen.markers[0].live} == {"b17unsub/1", "b17unsub/2"}
        assert broker.pid is not None
        os.kill(broker.pid, signal.SIGSTOP)  # reads nothing more; SIGKILL ends it stopped
        client.unsubscribe("b17unsub/1")
        with pytest.raises(RequestTimeout):
            client.subscribe("b17unsub/3", timeout=0.3)
        broker.kill()
        caplog.set_level(logging.WARNING, logger="durable_client")
        broker.start()
        seen.until(lambda: len(seen.markers) >= 2)
        live = {(s.filter, s.qos, s.durable) for s in seen.markers[1].live}
        assert live == {("b17unsub/2", 1, True), ("b17unsub/3", 1, True)}, live
        refused = [r.getMessage() for r in caplog.records if "refused the subscription" in r.getMessage()]
        assert not refused, refused
    finally:
        client.close()


# ------------------------------------------------------------------ sdk.md: the largest PUBLISH, byte for byte
def test_publish_takes_payloads_up_to_what_max_packet_size_lets_a_publish_carry_at_its_qos(
    shared: Broker, clients: Callable[..., Client]
) -> None:
    """sdk.md, `publish`: `payload` "no larger than the broker's `max_packet_size` lets a PUBLISH be (its
    remaining length: 2 bytes and the topic's, 2 more at QoS 1 and 2, and the payload's; the broker's hello
    reply says it)", a `str` "sent as UTF-8"; a bad value "raises `ValueError` whose message starts with the
    option's or argument's name". With the default 1048576 and a topic of 10 bytes in UTF-8 (`é` is 2), QoS 0
    carries 2 bytes more than QoS 1 and 2; one byte past either is refused before anything is sent, and what
    was taken reaches a subscriber whole, on the same connection (the broker closed none)."""
    topic = "b17size/é"
    room = 1048576 - 2 - len(topic.encode())
    subscriber = clients(shared.port, "b17size-sub", clean_session=True)
    assert subscriber.subscribe("b17size/#", 2) == [2]
    client = DurableClient("b17size", port=shared.port, durable_session=False)
    try:
        client.connect(timeout=WAIT)
        too_large: list[tuple[int, bytes | str, int]] = [
            (0, b"0" * (room + 1), room + 1),
            (1, b"1" * (room - 1), room - 1),
            (2, "é" * ((room - 2) // 2) + "a", room - 1),  # counted in UTF-8 bytes
        ]
        for qos, payload, size in too_large:
            with pytest.raises(ValueError) as refused:
                client.publish(topic, payload, qos=qos)
            parts = "topic, packet id" if qos else "topic"  # a QoS 0 PUBLISH has no packet id
            assert str(refused.value).startswith("payload"), refused.value
            assert f"({parts} and {size} bytes of payload)" in str(refused.value), refused.value
        client.publish(topic, b"0" * room, qos=0)
        client.publish(topic, b"1" * (room - 2), qos=1)
        client.publish(topic, "é" * ((room - 2) // 2), qos=2)
        assert subscriber.wait_for(lambda ms: len(ms) >= 3), "not delivered"
        assert [(m.qos, len(m.payload)) for m in subscriber.messages] == [(0, room), (1, room - 2), (2, room - 2)]
        assert client.connected and client.stats.reconnects == 0
    finally:
        client.close()


# ------------------------------------------------------------------ guarantees.md: drop-oldest that runs out
def test_drop_oldest_that_runs_out_of_messages_it_may_delete_drops_the_new_one_and_keeps_its_deletions(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """guarantees.md, Queue limits: `drop-oldest` "deletes the oldest queued message (while the session is
    connected, the oldest one not sent yet: messages in flight ... are never dropped) ... Under a byte limit it
    deletes more of the oldest while the new message does not fit yet ... If it runs out of messages it may
    delete before the new one fits (the rest are in flight), the new message is dropped too, and what it
    deleted stays deleted (each a counted drop)"; drops are counted "in all
    (`$SYS/broker/durable/messages/dropped`)". A 100-byte limit, a window of 2: two messages of 40 bytes in
    flight and one of 10 not sent yet; a new one of 30 bytes deletes the 10-byte one, still does not fit, and
    is dropped too: 2 drops, and neither comes after the acks."""
    broker = broker_factory(max_bytes=100, max_bytes_disconnected=100, recovery_buffer=2, metrics_interval=0.05)
    device = clients(broker.port, "b17runsout")
    device.subscribe("b17runsout/t", 1)
    device.disconnect()
    seen_away(clients, broker, 1)
    publisher = clients(broker.port, "b17runsout-pub", clean_session=True)
    publisher.publish("b17runsout/t", [b"a" * 40, b"b" * 40, b"c" * 10])
    sock = socket.create_connection(("127.0.0.1", broker.port), timeout=WAIT)
    sock.sendall(connect_packet("b17runsout", clean=False))
    assert read_exactly(sock, 4) == b"\x20\x02\x01\x00"
    in_flight = unacked(sock, 2)
    assert [payload for _pid, payload in in_flight] == [b"a" * 40, b"b" * 40]
    publisher.publish("b17runsout/t", [b"d" * 30])  # PUBACKed all the same
    watcher = clients(broker.port, "b17runsout-watch", clean_session=True)
    watcher.subscribe("$SYS/broker/durable/messages/dropped", 0)
    assert watcher.wait_for(lambda ms: any(m.payload == b"2" for m in ms)), [m.payload for m in watcher.messages]
    ack_all(sock, [pid for pid, _payload in in_flight])
    publisher.publish("b17runsout/t", [b"e" * 5])
    assert [payload for _pid, payload in unacked(sock, 1)] == [b"e" * 5], "the deleted and the dropped never come"
    sock.sendall(b"\xe0\x00")
    sock.close()


# ------------------------------------------------------------------ guarantees.md: QoS 0 behind a backlog
def test_a_qos0_message_to_a_connected_session_waits_behind_its_backlog_and_a_full_window(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """guarantees.md: "FIFO, no gaps. Each session gets its messages in the order the broker accepted them,
    backlog first and then live messages, with no gap or reordering where the replay ends"; "QoS 0 messages
    ... are delivered to connected durable sessions"; `recovery_buffer` "is a session's in-flight window: at
    most that many QoS 1/2 messages are sent and not yet acknowledged". With a window of 2 and 6 messages
    queued while away, a QoS 0 and a QoS 1 message published once the session is back (its window full,
    nothing acknowledged) come after the whole backlog, in the order they were published, the QoS 0 one at
    QoS 0."""
    broker = broker_factory(recovery_buffer=2, metrics_interval=0.05)
    device = clients(broker.port, "b17q0fifo")
    device.subscribe("b17q0fifo/t", 1)
    device.disconnect()
    seen_away(clients, broker, 1)
    publisher = clients(broker.port, "b17q0fifo-pub", clean_session=True)
    backlog = [b"backlog-%d" % i for i in range(6)]
    publisher.publish("b17q0fifo/t", backlog)
    sock = socket.create_connection(("127.0.0.1", broker.port), timeout=WAIT)
    sock.sendall(connect_packet("b17q0fifo", clean=False))
    assert read_exactly(sock, 4) == b"\x20\x02\x01\x00"
    window = unacked(sock, 2)
    publisher.publish("b17q0fifo/t", [b"live qos 0"], qos=0)
    publisher.publish("b17q0fifo/t", [b"live qos 1"], qos=1)
    sock.sendall(b"".join(b"\x40\x02" + pid for pid, _payload in window))  # the window was full until now
    publishes, _ = read_publishes(sock, 6)
    got = [payload for _pid, payload in window] + [payload for _topic, _qos, _retain, payload in publishes]
    assert got == [*backlog, b"live qos 0", b"live qos 1"]
    assert [qos for _topic, qos, _retain, _payload in publishes][-2:] == [0, 1]
    sock.sendall(b"\xe0\x00")
    sock.close()


# ------------------------------------------------------------------ sdk.md: a subscribe() waiting through a reconnect
def test_a_subscribe_waiting_when_the_connection_is_lost_returns_at_the_suback_after_the_reconnect(
    broker_factory: Callable[..., Broker],
) -> None:
    """sdk.md, `subscribe`: connected, it "returns at the SUBACK"; "`RequestTimeout` after `timeout` without that
    SUBACK or reply (a connection lost first is neither: it waits for the SUBACK of the SUBSCRIBE sent again
    after the reconnect ... within the same `timeout`"; the marker's `live` list "holds the filters they
    granted". The broker is stopped (SIGSTOP) while `subscribe()` waits, then SIGKILLed: the call still waits
    once the client saw its connection lost, and returns without raising once the broker, started again, grants
    the reconnect's SUBSCRIBE; the next marker lists it."""
    broker = broker_factory()
    seen = Seen()

    lost = threading.Event()
    client = DurableClient(
        "b17lost",
        port=broker.port,
        on_live=seen.on_live,
        on_disconnected=lambda _reason: lost.set(),
        reconnect_min_delay=0.05,
        reconnect_max_delay=0.3,
    )
    try:
        client.subscribe("b17lost/a")
        client.connect(timeout=WAIT)
        client.ready_for_events()
        seen.until(lambda: len(seen.markers) >= 1)
        assert broker.pid is not None
        os.kill(broker.pid, signal.SIGSTOP)
        waiting = InThread(lambda: client.subscribe("b17lost/b", timeout=3 * WAIT))
        assert waiting.still_waiting(), "returned without a SUBACK from a stopped broker"
        broker.kill()
        assert lost.wait(WAIT), "the client did not see its connection lost"
        assert waiting.still_waiting(), "a lost connection ended the wait"
        broker.start()
        assert waiting.outcome() is None
        seen.until(lambda: len(seen.markers) >= 2)
        assert {s.filter for s in seen.markers[1].live} == {"b17lost/a", "b17lost/b"}
    finally:
        client.close()


def test_a_subscribe_whose_suback_was_lost_returns_at_the_hello_reply_that_lists_it(
    shared: Broker, relays: Callable[..., PacketRelay], tmp_path: Path
) -> None:
    """sdk.md, `subscribe`: a connection lost first "waits for the SUBACK of the SUBSCRIBE sent again after the
    reconnect ...; a durable filter the reconnect's hello reply lists at its QoS is sent no SUBSCRIBE again: it
    returns at that hello reply, which writes the delivery-log record of one whose SUBACK was lost". A relay
    holds the SUBACK the broker sent and the connection is cut: the reconnect sends no SUBSCRIBE of the filter,
    `subscribe()` returns without raising, and the delivery log holds one `subscribe` record of it."""
    relay = relays(shared.port)
    log = tmp_path / "delivery.jsonl"
    client = DurableClient(
        "b17suback", port=relay.port, delivery_log=str(log), reconnect_min_delay=0.05, reconnect_max_delay=0.3
    )

    def suback(packet: Packet) -> bool:
        return packet.direction == "down" and packet.kind == 9

    def subscribe_of_b(packet: Packet) -> bool:
        return packet.direction == "up" and packet.kind == 8 and b"b17suback/b" in packet.body

    try:
        client.subscribe("b17suback/a")
        client.connect(timeout=WAIT)
        relay.hold("down", suback)
        waiting = InThread(lambda: client.subscribe("b17suback/b", timeout=3 * WAIT))
        subscribe = relay.wait_seen(subscribe_of_b)
        at = next(i for i, packet in enumerate(relay.seen) if packet is subscribe)
        relay.wait_seen(suback, after=at)  # the broker granted (and stored) it: its SUBACK is held
        cut_at = reconnect_through(relay, hold_hello=False)
        assert waiting.outcome() is None
        assert not [p for p in relay.seen[cut_at:] if subscribe_of_b(p)], "SUBSCRIBE sent again"
        subscribed = [r["topic"] for r in map(json.loads, log.read_text().splitlines()) if r["kind"] == "subscribe"]
        assert subscribed.count("b17suback/b") == 1, subscribed
    finally:
        client.close()


def test_after_a_lost_connection_the_sdk_resends_only_what_the_broker_lacks_once_its_hello_reply_came(
    shared: Broker, relays: Callable[..., PacketRelay]
) -> None:
    """sdk.md, `unsubscribe`: "A durable session's UNSUBSCRIBE whose UNSUBACK had not come when the connection was
    lost is sent again after the reconnect if the broker's session still holds the filter (its hello reply
    lists it ...)"; `publish`: "A QoS 1/2 publish still unacknowledged when the connection is lost goes out
    again once the next hello reply has come (not at CONNACK)", and `publish()` returns "once the broker has
    the message (its PUBACK ...)". A relay holds the UNSUBACK of an UNSUBSCRIBE the broker applied and the
    PUBACK of a publish, then cuts the connection: the reconnect sends no UNSUBSCRIBE (the hello reply no
    longer lists the filter), and the publish again (DUP) only after the hello reply, whose PUBACK ends the
    waiting `publish()`."""
    relay = relays(shared.port)
    client = DurableClient("b17resend", port=relay.port, reconnect_min_delay=0.05, reconnect_max_delay=0.3)

    def unsuback_or_puback(packet: Packet) -> bool:
        return packet.direction == "down" and packet.kind in (4, 11)

    def published(packet: Packet) -> bool:
        return packet.direction == "up" and packet.kind == 3 and b"b17resend/t" in packet.body

    try:
        client.subscribe("b17resend/gone")
        client.connect(timeout=WAIT)
        relay.hold("down", unsuback_or_puback)
        client.unsubscribe("b17resend/gone")
        relay.wait_seen(lambda p: p.direction == "down" and p.kind == 11)  # applied: its UNSUBACK is held
        sending = InThread(lambda: client.publish("b17resend/t", b"once more", qos=1, timeout=3 * WAIT))
        relay.wait_seen(lambda p: p.direction == "down" and p.kind == 4)
        cut_at = reconnect_through(relay, hold_hello=True)
        relay.wait_seen(hello_reply, after=cut_at)  # the reconnect's CONNACK came, its hello reply is held
        not_seen_for_a_while(relay, published, after=cut_at)  # the publish waits for the hello reply
        relay.release("down")
        assert sending.outcome() is None
        after = relay.seen[cut_at:]
        assert not [p for p in after if p.direction == "up" and p.kind == 10], "UNSUBSCRIBE sent again"
        again = [p for p in after if published(p)]
        assert len(again) == 1 and again[0].first & 0x08, "sent again once, with DUP"
    finally:
        client.close()


def test_a_qos2_publish_the_broker_has_goes_on_with_its_pubrel_at_connack_not_its_publish(
    shared: Broker, relays: Callable[..., PacketRelay]
) -> None:
    """sdk.md, `publish`: "A QoS 2 publish whose PUBREC came (the broker has it) is not sent again: its PUBREL is,
    at CONNACK"; at QoS 2 `publish()` returns once the broker has the message ("its PUBCOMP"). A relay holds the
    PUBCOMP and cuts the connection, then holds the reconnect's hello reply: the PUBREL goes out all the same
    (at CONNACK), the PUBLISH is not sent again, and the PUBCOMP of the new connection ends `publish()`."""
    relay = relays(shared.port)
    client = DurableClient("b17pubrel", port=relay.port, reconnect_min_delay=0.05, reconnect_max_delay=0.3)
    try:
        client.connect(timeout=WAIT)
        relay.hold("down", lambda p: p.kind == 7)  # PUBCOMP
        sending = InThread(lambda: client.publish("b17pubrel/t", b"exactly once", qos=2, timeout=3 * WAIT))
        relay.wait_seen(lambda p: p.direction == "down" and p.kind == 7)
        cut_at = reconnect_through(relay, hold_hello=True)
        relay.wait_seen(lambda p: p.direction == "up" and p.kind == 6, after=cut_at)  # the hello reply still held
        relay.release("down")
        assert sending.outcome() is None
        after = relay.seen[cut_at:]
        assert not [p for p in after if p.direction == "up" and p.kind == 3 and b"b17pubrel/t" in p.body]
    finally:
        client.close()


def test_ready_goes_out_only_once_the_broker_confirmed_the_connections_subscribes(
    shared: Broker, relays: Callable[..., PacketRelay]
) -> None:
    """sdk.md, Ready for events: `ready_for_events()` "may be called before `connect()`"; "The client sends it
    once the broker has confirmed the connection's SUBSCRIBEs and UNSUBSCRIBEs (their SUBACK, UNSUBACK), also
    those a reconnect or a `ready_for_events()` called before `connect()` sends, so the marker's `live` list
    reflects them". A relay holds the SUBACK of the connection's SUBSCRIBE: no `ready` request goes out until
    it is released, then the marker lists the filter."""
    relay = relays(shared.port)
    seen = Seen()

    def ready(packet: Packet) -> bool:
        return packet.direction == "up" and (packet.control() or {}).get("op") == "ready"

    client = DurableClient("b17ready", port=relay.port, on_live=seen.on_live)
    try:
        client.subscribe("b17ready/t")
        client.ready_for_events()
        relay.hold("down", lambda p: p.kind == 9)  # SUBACK
        connecting = InThread(lambda: client.connect(timeout=3 * WAIT))
        relay.wait_seen(lambda p: p.direction == "down" and p.kind == 9)
        not_seen_for_a_while(relay, ready)  # no ready before the SUBACK
        relay.release("down")
        relay.wait_seen(ready)
        assert connecting.outcome() is None
        seen.until(lambda: len(seen.markers) >= 1)
        assert [(s.filter, s.qos) for s in seen.markers[0].live] == [("b17ready/t", 1)]
    finally:
        client.close()


def test_close_ending_the_session_raises_unconnected_when_the_connection_is_lost_before_the_reply(
    shared: Broker, relays: Callable[..., PacketRelay], tmp_path: Path
) -> None:
    """sdk.md, `close`: "`close(keep_session=False)` removes it on the broker at once ... The client is closed
    either way: ... `RequestTimeout` when no reply came within `timeout`, or `Unconnected` when the connection
    was lost before it, and then the session may or may not have been ended. In each of these cases the
    delivery log gets no `session_end`". A relay holds the broker's `end_session` reply and cuts the
    connection: `close()` raises `Unconnected` well before its timeout, and the client stays closed."""
    relay = relays(shared.port)
    log = tmp_path / "delivery.jsonl"
    client = DurableClient("b17endlost", port=relay.port, delivery_log=str(log), reconnect_min_delay=0.05)

    def end_session_reply(packet: Packet) -> bool:
        return packet.direction == "down" and (packet.control() or {}).get("op") == "end_session"

    try:
        client.connect(timeout=WAIT)
        relay.hold("down", end_session_reply)
        closing = InThread(lambda: client.close(keep_session=False, timeout=6 * WAIT))
        relay.wait_seen(end_session_reply)
        relay.cut()
        assert isinstance(closing.outcome(), Unconnected)
        with pytest.raises(Unconnected, match="this client was closed"):
            client.connect(timeout=1)
    finally:
        client.close()  # does nothing again once closed
    kinds = [json.loads(line)["kind"] for line in log.read_text().splitlines()]
    assert "connect" in kinds and "session_end" not in kinds, kinds
