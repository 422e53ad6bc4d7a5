"""MQTT 3.1.1 section 4.6 and 3.10.4: a connection's SUBSCRIBEs and UNSUBSCRIBEs are applied in the
order they arrive, their SUBACKs and UNSUBACKs sent in that order, and none read before the
connection's end (a DISCONNECT, a dropped socket) is lost (docs/guarantees.md).

amqtt 0.12.1 queued the two kinds apart; its message loop applied a waiting SUBSCRIBE before a
waiting UNSUBSCRIBE, and once it had read a DISCONNECT (or the connection closed) applied at most
one more of each: the rest were dropped. The packets here go in ONE write (raw sockets), on both
readers (the plugin's, and amqtt's own, used when a topic plugin is loaded), for durable and clean
sessions. What a session holds is seen by publishing: a client publishes to each filter's topic,
then to a sentinel topic the session also holds; by the sentinel's arrival, a filter's message has
arrived if the session holds the filter (one publisher, one session queue: in order).
"""

from __future__ import annotations

import fcntl
import socket
import struct
import termios
import time
from collections.abc import Callable

import pytest
from raw_mqtt_helpers import connect_packet, raw_connect, raw_subscribe, read_exactly, read_packet

from conftest import HOST, WAIT, Broker, Client, mqtt_packet, mqtt_string

TOPIC_PLUGIN = "amqtt.plugins.topic_checking.TopicTabooPlugin"
"""Any topic plugin makes the broker read with amqtt's own loop instead of the plugin's."""
SUBACK, UNSUBACK, PUBLISH, PUBCOMP = 9, 11, 3, 7
DISCONNECT = b"\xe0\x00"
Packet = tuple[bytes, tuple[int, int]]
"""A packet and the ack (type, packet id) it must get."""


@pytest.fixture(params=["plugin-reader", "amqtt-reader"])
def reader(request: pytest.FixtureRequest, broker_factory: Callable[..., Broker]) -> Broker:
    """A broker read by the plugin's reader, or by amqtt's own loop (a topic plugin loaded)."""
    broker = broker_factory(start=False)
    if request.param == "amqtt-reader":
        broker.extra_plugins[TOPIC_PLUGIN] = {}
    return broker.start()


SESSIONS = pytest.mark.parametrize("clean", [False, True], ids=["durable", "clean"])


def subscribe(topic_filter: str, packet_id: int) -> Packet:
    """A QoS 0 SUBSCRIBE of one filter."""
    body = packet_id.to_bytes(2, "big") + mqtt_string(topic_filter) + b"\x00"
    return mqtt_packet(0x82, body), (SUBACK, packet_id)


def unsubscribe(topic_filter: str, packet_id: int) -> Packet:
    """An UNSUBSCRIBE of one filter."""
    return mqtt_packet(0xA2, packet_id.to_bytes(2, "big") + mqtt_string(topic_filter)), (UNSUBACK, packet_id)


def acks(sock: socket.socket, count: int) -> list[tuple[int, int]]:
    """The next ``count`` SUBACKs / UNSUBACKs (type, packet id); every SUBACK grants QoS 0 to all its filters."""
    got = []
    for _ in range(count):
        first, body = read_packet(sock)  # bounded by the socket's timeout
        assert first >> 4 in (SUBACK, UNSUBACK), (first, body)
        assert first >> 4 == UNSUBACK or not body[2:].strip(b"\x00"), f"SUBSCRIBE refused: {body!r}"
        got.append((first >> 4, int.from_bytes(body[:2], "big")))
    return got


def send_in_one_write(sock: socket.socket, packets: list[Packet], *, then: bytes = b"") -> None:
    """Sends the packets (and ``then``) in one write; their acks must come back in the same order."""
    sock.sendall(b"".join(packet for packet, _ in packets) + then)
    assert acks(sock, len(packets)) == [ack for _, ack in packets], "not handled in the order they arrived"


def topics_until_sentinel(sock: socket.socket, publisher: Client, topics: list[str]) -> list[str]:
    """Publishes to each topic, then to the sentinel; the topics ``sock`` receives up to the sentinel."""
    for topic in topics:
        publisher.publish(topic, [b"m"])
    publisher.publish("sentinel", [b"s"])
    received = []
    for _ in range(len(topics) + 1):
        first, body = read_packet(sock)
        assert first >> 4 == PUBLISH and not first & 0x06, f"a QoS 0 PUBLISH expected: {first:#x} {body!r}"
        received.append(body[2 : 2 + int.from_bytes(body[:2], "big")].decode())
        if received[-1] == "sentinel":
            return received
    raise AssertionError(f"no sentinel: {received}")


def connected(broker: Broker, client_id: str, *, clean: bool, filters: tuple[str, ...] = ()) -> socket.socket:
    """A raw client holding the sentinel and ``filters`` (each SUBACK awaited)."""
    sock = raw_connect(broker.port, client_id, clean=clean)
    for packet_id, topic_filter in enumerate(("sentinel", *filters), start=1):
        assert raw_subscribe(sock, topic_filter, 0, packet_id=packet_id) == 0
    return sock


def closed_by_broker(sock: socket.socket) -> bool:
    """True once the broker has closed the connection (bounded by the socket's timeout)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


@SESSIONS
def test_subscribe_unsubscribe_subscribe_in_one_write_ends_subscribed(
    reader: Broker, clients: Callable[..., Client], clean: bool
) -> None:
    """SUBSCRIBE a, UNSUBSCRIBE a, SUBSCRIBE a, behind SUBSCRIBEs of other filters (amqtt applied
    the UNSUBSCRIBE while the SUBSCRIBEs before it still waited: its UNSUBACK came first)."""
    with connected(reader, "order-sus", clean=clean) as sock:
        lead = [subscribe(f"g{i}/#", 10 + i) for i in range(3)]
        send_in_one_write(sock, [*lead, subscribe("a/#", 2), unsubscribe("a/#", 3), subscribe("a/#", 4)])
        publisher = clients(reader.port, "order-pub", clean_session=True)
        assert topics_until_sentinel(sock, publisher, ["a/x"]) == ["a/x", "sentinel"]


@SESSIONS
def test_unsubscribe_then_subscribe_of_a_filter_in_one_write_keeps_it(
    reader: Broker, clients: Callable[..., Client], clean: bool
) -> None:
    """UNSUBSCRIBE f then SUBSCRIBE f (before the UNSUBACK): amqtt applied the SUBSCRIBE first, then
    removed the filter its SUBACK had granted. Alone, then behind a SUBSCRIBE of another filter."""
    with connected(reader, "order-resub", clean=clean, filters=("a/#", "b/#")) as sock:
        send_in_one_write(sock, [unsubscribe("a/#", 3), subscribe("a/#", 4)])
        send_in_one_write(sock, [subscribe("g/#", 5), unsubscribe("b/#", 6), subscribe("b/#", 7)])
        publisher = clients(reader.port, "order-pub", clean_session=True)
        assert topics_until_sentinel(sock, publisher, ["a/x", "b/x"]) == ["a/x", "b/x", "sentinel"]


@SESSIONS
def test_subscribe_then_unsubscribe_behind_other_subscribes_leaves_no_subscription(
    reader: Broker, clients: Callable[..., Client], clean: bool
) -> None:
    """The pair behind five SUBSCRIBEs: amqtt applied the UNSUBSCRIBE while the SUBSCRIBE still
    waited, and the filter its UNSUBACK removed stayed."""
    with connected(reader, "order-unsub", clean=clean) as sock:
        lead = [subscribe(f"g{i}/#", 10 + i) for i in range(5)]
        send_in_one_write(sock, [*lead, subscribe("f/#", 2), unsubscribe("f/#", 3)])
        publisher = clients(reader.port, "order-pub", clean_session=True)
        assert topics_until_sentinel(sock, publisher, ["f/x"]) == ["sentinel"]


@SESSIONS
def test_two_unsubscribes_and_disconnect_in_one_write_are_both_applied(
    reader: Broker, clients: Callable[..., Client], clean: bool
) -> None:
    """Both UNSUBACKs come, in order, before the broker closes the connection, and the durable
    session holds neither filter after a reconnect (amqtt dropped the second: kept for ever). A
    clean session's are behind a SUBSCRIBE (amqtt's reader, slower, had applied the two before)."""
    lead = [subscribe("g/#", 2)] if clean else []
    with connected(reader, "order-bye", clean=clean, filters=("a/#", "b/#")) as sock:
        send_in_one_write(sock, [*lead, unsubscribe("a/#", 3), unsubscribe("b/#", 4)], then=DISCONNECT)
        assert closed_by_broker(sock)
    if clean:
        return  # a clean session ends with its connection: the UNSUBACKs are all there is to see
    with raw_connect(reader.port, "order-bye", clean=False) as again:
        publisher = clients(reader.port, "order-pub", clean_session=True)
        assert topics_until_sentinel(again, publisher, ["a/x", "b/x"]) == ["sentinel"]


@SESSIONS
def test_subscribes_and_disconnect_in_one_write_are_all_applied(
    reader: Broker, clients: Callable[..., Client], clean: bool
) -> None:
    """SUBSCRIBE a, UNSUBSCRIBE s, SUBSCRIBE b, then DISCONNECT: every SUBACK and UNSUBACK comes, in
    order, before the close, and the durable session holds a and b, not s, after a reconnect."""
    with connected(reader, "order-sub-bye", clean=clean, filters=("s/#",)) as sock:
        changes = [subscribe("a/#", 3), unsubscribe("s/#", 4), subscribe("b/#", 5)]
        send_in_one_write(sock, changes, then=DISCONNECT)
        assert closed_by_broker(sock)
    if clean:
        return
    with raw_connect(reader.port, "order-sub-bye", clean=False) as again:
        publisher = clients(reader.port, "order-pub", clean_session=True)
        assert topics_until_sentinel(again, publisher, ["a/x", "s/x", "b/x"]) == ["a/x", "b/x", "sentinel"]


@pytest.mark.parametrize("half_close", [False, True], ids=["closed", "half-closed"])
def test_unsubscribes_right_before_a_dropped_socket_are_applied(
    reader: Broker, clients: Callable[..., Client], half_close: bool
) -> None:
    """A durable session's UNSUBSCRIBEs, then the socket closes (no DISCONNECT): the session holds
    none of their filters after a reconnect. Half-closed, the client still reads: every UNSUBACK
    comes before the broker closes its side. Closed, the reconnect may come while the broker still
    ends the old connection (a take-over): they are applied all the same."""
    sock = connected(reader, "order-drop", clean=False, filters=("a/#", "b/#", "c/#"))
    with sock:
        sock.sendall(b"".join(unsubscribe(f, 3 + i)[0] for i, f in enumerate(("a/#", "b/#", "c/#"))))
        if half_close:
            sock.shutdown(socket.SHUT_WR)
            assert acks(sock, 3) == [(UNSUBACK, 3), (UNSUBACK, 4), (UNSUBACK, 5)]
            assert closed_by_broker(sock)
    with raw_connect(reader.port, "order-drop", clean=False) as again:
        publisher = clients(reader.port, "order-pub", clean_session=True)
        assert topics_until_sentinel(again, publisher, ["a/x", "b/x", "c/x"]) == ["sentinel"]


@SESSIONS
def test_unsubscribes_of_a_connection_taken_over_are_applied(
    reader: Broker, clients: Callable[..., Client], clean: bool
) -> None:
    """A durable session's connection sends 30 UNSUBSCRIBEs in one write and a newer connection of
    its client id takes the session over at once (a durable CONNECT; a clean one ends the session
    anyway, so then the older one's UNSUBACKs are checked): none is lost (amqtt's take-over emptied
    the queue of those not yet applied)."""
    filters = [f"t{i}/#" for i in range(30)]
    sock = connected(reader, "order-take", clean=False)
    with sock:
        body = (2).to_bytes(2, "big") + b"".join(mqtt_string(f) + b"\x00" for f in filters)
        sock.sendall(mqtt_packet(0x82, body))
        assert acks(sock, 1) == [(SUBACK, 2)]
        sock.sendall(b"".join(unsubscribe(f, 10 + i)[0] for i, f in enumerate(filters)))
        with raw_connect(reader.port, "order-take", clean=clean) as newer:
            assert acks(sock, len(filters)) == [(UNSUBACK, 10 + i) for i in range(len(filters))]
            assert closed_by_broker(sock)
            if clean:
                return
            publisher = clients(reader.port, "order-pub", clean_session=True)
            assert topics_until_sentinel(newer, publisher, [f"t{i}/x" for i in range(30)]) == ["sentinel"]


def subscribe_qos1(topic_filter: str, packet_id: int) -> bytes:
    """A QoS 1 SUBSCRIBE of one filter."""
    return mqtt_packet(0x82, packet_id.to_bytes(2, "big") + mqtt_string(topic_filter) + b"\x01")


def waiting_for_a_retained_puback(port: int, client_id: str, *, clean: bool, filters: int = 1) -> socket.socket:
    """A connection that SUBSCRIBEs at QoS 1 to ``filters`` filters r0/#, r1/#, ... each matching a
    retained QoS 1 message, and never PUBACKs the first: a clean session's message loop sends the
    retained messages of a SUBSCRIBE itself and waits (amqtt: up to 5 s) for each one's PUBACK."""
    sock = raw_connect(port, client_id, clean=clean)
    sock.sendall(b"".join(subscribe_qos1(f"r{k}/#", 1 + k) for k in range(filters)))
    kinds = sorted(read_packet(sock)[0] >> 4 for _ in range(2))
    assert kinds == [PUBLISH, SUBACK] if clean else [SUBACK], kinds
    return sock


@pytest.mark.parametrize("new_clean", [True, False], ids=["new-clean", "new-durable"])
@pytest.mark.parametrize("old_clean", [True, False], ids=["old-clean", "old-durable"])
def test_take_over_of_a_connection_waiting_for_a_retained_puback_is_answered_at_once(
    broker: Broker, clients: Callable[..., Client], old_clean: bool, new_clean: bool
) -> None:
    """The older connection's loop waits for the PUBACK of a retained message its SUBSCRIBE sent (a
    device that died): the take-over's CONNACK does not wait for it (the wait for the older one's
    changes cancelled amqtt's PUBACK waiters only after it: the CONNACK took 5 s)."""
    publisher = clients(broker.port, "ret-pub", clean_session=True)
    publisher.publish("r0/1", [b"retained"], qos=1, retain=True)
    with waiting_for_a_retained_puback(broker.port, "ret-dev", clean=old_clean):
        started = time.monotonic()
        with raw_connect(broker.port, "ret-dev", clean=new_clean):
            seconds = time.monotonic() - started
    assert seconds < 1.0, f"the take-over's CONNACK came after {seconds:.3f} s"


def retain_big_messages(publisher: Client) -> None:
    """10 MB of retained messages under big/ (50 of 200 kB): more than a socket's buffers hold."""
    for i in range(50):
        publisher.publish(f"big/{i}", [b"x" * 200_000], qos=1, retain=True)


def stuck_on_big_retained_messages(
    port: int, client_id: str, publisher: Client, *, qos2_first: bool = False
) -> socket.socket:
    """A clean connection whose SUBSCRIBE big/# matches 10 MB of retained messages it never reads
    (its loop is stuck sending them: the sockets' buffers are full). With ``qos2_first``, it
    first PUBLISHes q2/a at QoS 2 (packet id 7) and reads the PUBREC, sending no PUBREL."""
    retain_big_messages(publisher)
    sock = socket.create_connection((HOST, port), timeout=WAIT)
    sock.sendall(connect_packet(client_id, clean=True))
    assert read_exactly(sock, 4)[3] == 0
    if qos2_first:
        sock.sendall(mqtt_packet(0x34, mqtt_string("q2/a") + (7).to_bytes(2, "big") + b"hello"))
        assert read_packet(sock)[0] >> 4 == 5  # PUBREC
    sock.sendall(mqtt_packet(0x82, (1).to_bytes(2, "big") + mqtt_string("big/#") + b"\x00"))
    return sock


@pytest.mark.parametrize("new_clean", [True, False], ids=["new-clean", "new-durable"])
def test_take_over_of_a_stuck_connection_with_a_waiting_subscribe_is_answered_within_the_grace(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], new_clean: bool
) -> None:
    """The older connection is stuck (``stuck_on_big_retained_messages``) with one more SUBSCRIBE
    queued behind: the take-over's CONNACK comes at most connection_end_wait (5 s) later, not 5 s for the
    changes then CLOSE_GRACE more for the full socket (10 s: the newer connection's connect_timeout
    closed it, a clean one got no CONNACK). A CONNECT whose checks passed is not closed at a
    connect_timeout shorter than that wait (2 s here: a clean one was closed with no CONNACK)."""
    broker = broker_factory(connect_timeout=2)
    publisher = clients(broker.port, "big-pub", clean_session=True)
    newer = socket.create_connection((HOST, broker.port), timeout=WAIT)
    with newer, stuck_on_big_retained_messages(broker.port, "stuck-dev", publisher) as sock:
        sock.sendall(subscribe("c/#", 2)[0])
        started = time.monotonic()
        newer.sendall(connect_packet("stuck-dev", clean=new_clean))
        assert read_exactly(newer, 4) == b"\x20\x02\x00\x00"
        seconds = time.monotonic() - started
    assert seconds < 6.0, f"the take-over's CONNACK came after {seconds:.2f} s"


def unread_by_the_broker(sock: socket.socket) -> int:
    """Bytes ``sock`` sent that the broker has not read yet: its end's receive queue, from
    /proc/net/tcp (the kernel's own table: no command to install); -1 when no such socket is."""
    ours = f"{sock.getsockname()[1]:04X}"
    broker = f"{sock.getpeername()[1]:04X}"
    with open("/proc/net/tcp") as table:
        for line in table.read().splitlines()[1:]:
            fields = line.split()
            local, remote, state, queues = fields[1], fields[2], fields[3], fields[4]
            if state == "01" and local.endswith(":" + broker) and remote.endswith(":" + ours):
                return int(queues.split(":")[1], 16)
    return -1


def test_a_qos2_publish_whose_pubrel_comes_during_the_take_over_wait_is_delivered(
    reader: Broker, clients: Callable[..., Client]
) -> None:
    """A clean connection's QoS 2 PUBLISH got its PUBREC; the connection is stuck
    (``stuck_on_big_retained_messages``), a SUBSCRIBE waits behind, and a newer durable connection
    takes the client id over (amqtt's take-over: the older connection's reader goes on reading):
    its PUBREL, read while the take-over waits for the SUBSCRIBE, gets the message to its
    subscribers (that wait began by cancelling amqtt's PUBREL waiters with its PUBACK, PUBREC and
    PUBCOMP ones: the PUBREL got a PUBCOMP, the message was never delivered). The client then reads
    what it was sent, so the wait ends with the SUBSCRIBE applied (its SUBACK after the PUBCOMP: the
    PUBREL was read during the wait), not at the grace's end and CLOSE_GRACE after (10 s)."""
    publisher = clients(reader.port, "big-pub", clean_session=True)
    watcher = clients(reader.port, "q2-watcher", clean_session=True)
    watcher.subscribe("q2/#", qos=2)
    newer = socket.create_connection((HOST, reader.port), timeout=WAIT)
    with newer, stuck_on_big_retained_messages(reader.port, "q2-dev", publisher, qos2_first=True) as sock:
        sock.sendall(subscribe("c/#", 2)[0])
        newer.sendall(connect_packet("q2-dev", clean=False))
        assert reader.wait_until(lambda: "q2-dev is already connected, performing take-over" in reader.log(), WAIT)
        sock.sendall(mqtt_packet(0x62, (7).to_bytes(2, "big")))  # PUBREL
        # Its PUBCOMP comes before SUBACK 2 once the broker read the PUBREL before the client reads
        # what it was sent (which lets the SUBSCRIBE be applied): wait for that read.
        assert reader.wait_until(lambda: unread_by_the_broker(sock) == 0, WAIT), unread_by_the_broker(sock)
        read: list[tuple[int, int]] = []
        while not closed_at_packet(sock, read):  # bounded: the broker closes after the retained messages
            assert len(read) <= 60, read
        assert (PUBCOMP, 7) in read and (SUBACK, 2) in read, read
        assert read.index((PUBCOMP, 7)) < read.index((SUBACK, 2)), read  # the PUBREL was read during the wait
        assert watcher.wait_for(lambda got: any(m.topic == "q2/a" for m in got), timeout=WAIT), reader.log()[-3000:]


@pytest.mark.parametrize("qos", [1, 2])
def test_a_connection_shut_right_after_its_subscribe_is_closed_without_waiting_for_a_retained_ack(
    reader: Broker, clients: Callable[..., Client], qos: int
) -> None:
    """A clean client SUBSCRIBEs to # with a QoS ``qos`` retained message stored and shuts its
    socket for writing in the same breath (it can send no PUBACK or PUBREC any more): it gets the
    SUBACK and the retained message, then the close, at once. The connection's end stopped waiting
    for the acks of what had been sent before its message loop applied the SUBSCRIBE; the retained
    message's, sent after, was waited for until the end's 5-second bound."""
    publisher = clients(reader.port, "ret-pub", clean_session=True)
    publisher.publish("r/1", [b"kept"], qos=qos, retain=True)
    with raw_connect(reader.port, "ret-dev", clean=True) as sock:
        sock.sendall(mqtt_packet(0x82, b"\x00\x01" + mqtt_string("#") + bytes((qos,))))
        sock.shutdown(socket.SHUT_WR)
        started = time.monotonic()
        got: list[tuple[int, int]] = []
        while not closed_at_packet(sock, got):  # bounded by the socket's timeout (WAIT)
            assert len(got) <= 2, got
        took = time.monotonic() - started
    assert got == [(SUBACK, 1), (PUBLISH, 0)], got
    assert took < 4.0, f"closed {took:.2f} s after the SUBSCRIBE (the bound: 5 s)"


def test_broker_stops_at_once_with_connections_waiting_for_a_retained_puback(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    """Three clean connections each wait for the PUBACK of a retained message, three more SUBSCRIBEs
    queued behind: the broker (SIGTERM) stops within 5 s (each connection's end waited 5 s)."""
    publisher = clients(broker.port, "ret-pub", clean_session=True)
    for k in range(4):
        publisher.publish(f"r{k}/1", [b"retained"], qos=1, retain=True)
    socks = [waiting_for_a_retained_puback(broker.port, f"ret-{i}", clean=True, filters=4) for i in range(3)]
    started = time.monotonic()
    broker.terminate()
    stopped = broker.wait_stopped(started + WAIT)
    seconds = time.monotonic() - started
    for sock in socks:
        sock.close()
    assert stopped and seconds < 5.0, f"the broker stopped after {seconds:.2f} s"


def test_broker_stops_cleanly_with_retained_sends_stuck_on_a_client_that_reads_nothing(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    """A clean client SUBSCRIBEs to 2,000 retained QoS 1 messages of 4 kB and reads nothing: their
    sends (a task each) wait to write. The broker stops (SIGTERM) and its log has no error of theirs:
    the connection's stop cancels them (when it did not, asyncio.run's shutdown cancelled them
    and logged about 1,300 'unhandled exception during asyncio.run() shutdown' ERRORs)."""
    publisher = clients(broker.port, "ret-pub", clean_session=True)
    for i in range(0, 2000, 500):
        for j in range(i, i + 500):
            publisher.paho.publish(f"r/{j}", b"x" * 4096, qos=1, retain=True)
        publisher.publish("sync", [b"x"], qos=1)  # the 500 before it are acknowledged too
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(WAIT)
    with sock:
        sock.connect((HOST, broker.port))
        sock.sendall(connect_packet("no-read", clean=True))
        assert read_exactly(sock, 4)[3] == 0
        sock.sendall(subscribe_qos1("r/+", 1))

        def unread() -> int:
            return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0" * 4))[0])

        assert broker.wait_until(lambda: unread() > 0, WAIT)  # the SUBACK, then the sends' first writes
        broker.terminate()
        assert broker.wait_stopped(time.monotonic() + WAIT)
    log = broker.log()
    for error in ("unhandled exception during asyncio.run() shutdown", "never retrieved", "Traceback"):
        assert error not in log, log[-3000:]


def test_changes_still_waiting_when_the_grace_runs_out_are_dropped_with_a_warning(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """A clean session's loop is stuck sending the retained messages of its first SUBSCRIBE (the
    client reads nothing of its 10 MB: the sockets' buffers are full); four more changes and a DISCONNECT follow.
    ``connection_end_wait`` (5 s; 1 s here) after the DISCONNECT the WARNING counts the four dropped (the first,
    under way, completes) and none of them is applied after: once the client reads, it gets the first's SUBACK
    and retained messages, then the close (amqtt's loop applied one more after the close, uncounted)."""
    broker = broker_factory(connection_end_wait=1)
    publisher = clients(broker.port, "big-pub", clean_session=True)
    with stuck_on_big_retained_messages(broker.port, "grace-dev", publisher) as sock:
        later = [subscribe("a/#", 2), subscribe("b/#", 3), unsubscribe("a/#", 4), subscribe("c/#", 5)]
        started = time.monotonic()
        sock.sendall(b"".join(packet for packet, _ in later) + DISCONNECT)
        warning = "grace-dev: 4 SUBSCRIBE/UNSUBSCRIBE read before the connection ended not applied: dropped"
        assert broker.wait_until(lambda: warning in broker.log(), WAIT), broker.log()[-3000:]
        took = time.monotonic() - started
        assert 0.8 < took < 4.0, f"dropped {took:.2f} s after the DISCONNECT (connection_end_wait: 1 s)"
        got = []
        while not closed_at_packet(sock, got):  # bounded: the broker closes after the retained messages
            assert len(got) <= 60, got
    assert [ack for ack in got if ack[0] != PUBLISH] == [(SUBACK, 1)], got
    assert len([line for line in broker.log().splitlines() if "grace-dev" in line and "dropped" in line]) == 1


def closed_at_packet(sock: socket.socket, got: list[tuple[int, int]]) -> bool:
    """Reads one packet into ``got`` as (type, packet id of an ack, else 0); True once the broker closed."""
    try:
        first, body = read_packet(sock)
    except (AssertionError, ConnectionResetError):  # read_exactly asserts at EOF
        return True
    got.append((first >> 4, int.from_bytes(body[:2], "big") if first >> 4 in (SUBACK, UNSUBACK, PUBCOMP) else 0))
    return False


@pytest.mark.parametrize("bad", [b"\x00\x00", b"\x90\x03\x00\x01\x00"], ids=["reserved", "suback"])
def test_changes_read_before_a_protocol_violation_are_applied(
    reader: Broker, clients: Callable[..., Client], bad: bytes
) -> None:
    """SUBSCRIBE a, UNSUBSCRIBE s, then a packet that closes the connection, in one write: both are
    applied, their SUBACK and UNSUBACK sent before the close, on either reader (the plugin's cancelled
    their handlers before they queued them: nothing applied; amqtt's applied both)."""
    for round_ in range(3):
        client_id = f"viol-{round_}"
        with connected(reader, client_id, clean=False, filters=("s/#",)) as sock:
            sock.sendall(subscribe("a/#", 3)[0] + unsubscribe("s/#", 4)[0] + bad)
            got: list[tuple[int, int]] = []
            while not closed_at_packet(sock, got):
                assert len(got) <= 2, got
        assert got == [(SUBACK, 3), (UNSUBACK, 4)], got
        with raw_connect(reader.port, client_id, clean=False) as again:
            publisher = clients(reader.port, f"viol-pub-{round_}", clean_session=True)
            assert topics_until_sentinel(again, publisher, ["a/x", "s/x"]) == ["a/x", "sentinel"]


def acknowledged(broker: Broker, sock: socket.socket) -> bool:
    """True once the broker's TCP has acknowledged every byte written to ``sock`` (Linux SIOCOUTQ:
    none left unacknowledged), polled up to WAIT (no event tells it)."""

    def unacknowledged() -> int:
        return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0])

    return broker.wait_until(lambda: unacknowledged() == 0, WAIT)


def test_unsubscribes_arriving_with_the_take_over_are_all_acknowledged_before_the_close(
    reader: Broker, clients: Callable[..., Client]
) -> None:
    """The newer CONNECT's last byte is sent right after the older connection's 100 UNSUBSCRIBEs
    (once the broker's TCP has them: two sockets give no order), so the take-over comes while they
    wait: its end waits until all are applied, every UNSUBACK is sent before the close, and the
    session holds none of the filters (3 rounds: a take-over that stopped the older connection
    first lost the UNSUBACKs of those applied after; 100 of them, each its own store commit, keep
    amqtt's reader's loop busy past the take-over. amqtt's reader, a task per packet, often had
    queued only the first, or none, as the take-over came, the rest read but still in its stream:
    the queue counted as drained once empty, and those were never applied nor acknowledged)."""
    filters = [f"t{i}/#" for i in range(100)]
    for round_ in range(3):
        client_id = f"race-{round_}"
        old = connected(reader, client_id, clean=False)
        with old, socket.create_connection((HOST, reader.port), timeout=WAIT) as new:
            body = (2).to_bytes(2, "big") + b"".join(mqtt_string(f) + b"\x00" for f in filters)
            old.sendall(mqtt_packet(0x82, body))
            assert acks(old, 1) == [(SUBACK, 2)]
            connect = connect_packet(client_id, clean=False)
            new.sendall(connect[:-1])  # the broker waits for the last byte
            old.sendall(b"".join(unsubscribe(f, 10 + i)[0] for i, f in enumerate(filters)))
            assert acknowledged(reader, old)  # in the broker's socket before the last byte is sent
            new.sendall(connect[-1:])
            got: list[tuple[int, int]] = []
            while not closed_at_packet(old, got):
                assert len(got) <= len(filters), got
            assert got == [(UNSUBACK, 10 + i) for i in range(len(filters))], f"round {round_}: {got}"
            assert read_exactly(new, 4)[3] == 0
            publisher = clients(reader.port, f"race-pub-{round_}", clean_session=True)
            assert topics_until_sentinel(new, publisher, [f"t{i}/x" for i in range(0, 100, 9)]) == ["sentinel"]
