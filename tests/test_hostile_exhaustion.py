"""Resource exhaustion by clients that speak valid MQTT and valid control requests: each test is
the attack itself against a real broker process over TCP with a raw socket, and checks that the
broker bounds what the client can take, that other clients are still served and that no message
queued for a durable session is lost.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from collections.abc import Callable

import pytest
from raw_mqtt_helpers import connect_packet, read_exactly, read_packet
from test_hostile_wire import (
    PATHS,
    connack_within,
    memory_kb,
    publish_packet,
    read_until_closed,
    wait_until,
)
from websockets.asyncio.client import connect as ws_connect

from amqtt_durable.process import free_port
from conftest import HOST, WAIT, Broker, Client, mqtt_packet, mqtt_string, payloads, queued_while_dropped

FILTERS = 500
FILTER_BYTES = 1000
"""500 filters of 1000 bytes: under the default max_subscription_bytes_per_client (1 MiB), and a
``hello`` reply (which lists them) of about 500 kB."""

HELLOS = 100
PAD = 60_000
"""100 requests of 60 kB (under the 65,536-byte request limit): 6 MB sent, 50 MB of replies asked for."""


def starved_durable_client(port: int, client_id: str) -> socket.socket:
    """A durable client whose receive buffer is made small before connecting, so what the broker
    writes to it stops at once when it does not read."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(WAIT)
    sock.connect((HOST, port))
    sock.sendall(connect_packet(client_id, clean=False))
    assert read_exactly(sock, 4)[:2] == b"\x20\x02"
    return sock


@pytest.mark.parametrize("path", PATHS)
def test_control_requests_whose_replies_are_never_read_are_bounded_by_max_pending_control_bytes(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], path: str
) -> None:
    """A ``hello`` of 45 bytes asks for a reply listing the session's subscriptions: up to 1 MiB
    under the default max_subscription_bytes_per_client. The broker wrote every reply, read or
    not: 840 kB of hellos sent without reading made it grow by 770 MB in 3 s, and a new client's
    CONNECT went unanswered meanwhile. Now, while the client does not read, its requests wait, and
    past max_pending_control_bytes (1 MiB) of them its connection is closed with a WARNING."""
    broker = broker_factory(start=False)
    broker.extra_plugins.update(PATHS[path])
    broker.start()
    assert broker.proc is not None
    pid = broker.proc.pid
    queued = payloads(5, "before")
    durable, publisher = queued_while_dropped(clients, broker.port, "q/#", "q/before", queued)
    attacker = starved_durable_client(broker.port, "hoarder")
    body = b"\x00\x01" + b"".join(mqtt_string(f"f/{i:04d}/".ljust(FILTER_BYTES, "x")) + b"\x00" for i in range(FILTERS))
    attacker.sendall(mqtt_packet(0x82, body))
    first, suback = read_packet(attacker)
    assert first == 0x90 and suback[2:] == bytes(FILTERS), "the filters were not all granted"
    before_kb = memory_kb(pid, "VmRSS")
    hello = json.dumps({"v": 1, "op": "hello", "pad": "x" * PAD}).encode()
    try:
        for _ in range(HELLOS):
            attacker.sendall(publish_packet(b"_durable/v1/ctl", hello, 0))
    except OSError:  # closed by the broker while sending: what is expected
        pass
    # Read nothing until the broker has given up on the client: reading the replies while it still
    # handles the requests would let it catch up with them (a client that reads is not the attack).
    assert wait_until(lambda: "closing the connection of hoarder: " in broker.log(), WAIT), broker.log()[-3000:]
    closed = read_until_closed(attacker, WAIT)
    assert closed is not None, ("the connection of a client that never reads stays open", broker.log()[-3000:])
    grown_kb = memory_kb(pid, "VmHWM") - before_kb
    # Without the bound the broker held every reply (about 50 MB, and the JSON it was encoded from);
    # with it at most 1 MiB of requests, one reply and the socket's buffer.
    assert grown_kb < 25_000, f"the broker grew by {grown_kb} kB for a client that had read nothing"
    attacker.close()
    log = broker.log()
    assert "closing the connection of hoarder: " in log, log[-3000:]
    assert "max_pending_control_bytes is 1048576" in log
    assert connack_within(broker.port, WAIT), "a new client was not served"
    publisher.publish("q/after", [b"after"], qos=1)
    durable.connect()
    got = durable.wait_messages(len(queued) + 1)
    assert [m.payload for m in got] == [*queued, b"after"], "a queued message was lost"
    again = starved_durable_client(broker.port, "hoarder")  # the attacker's own session is intact
    again.sendall(publish_packet(b"_durable/v1/ctl", json.dumps({"v": 1, "op": "hello", "req": 1}).encode(), 0))
    first, reply = read_packet(again)
    assert first == 0x30, first
    fields = json.loads(reply[2 + len(b"$durable/v1/reply") :])
    assert fields["ok"] and len(fields["subscriptions"]) == FILTERS, str(fields)[:300]
    again.close()


@pytest.mark.parametrize("half", [b"", b"\x30\x20\x00\x05feed/"], ids=["nothing", "half-a-publish"])
def test_a_silent_client_is_disconnected_after_1_5_keepalives_on_amqtt_s_own_reader(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], half: bytes
) -> None:
    """guarantees.md: "A client silent for 1.5 times its keep-alive, also in the middle of a packet,
    is disconnected (MQTT-3.1.2-24)". Only the plugin's reader did it: with a topic plugin loaded
    (amqtt's own reader loop), a client that went silent, or half-open, kept its connection for as
    long as the broker ran (amqtt's handle_read_timeout does nothing), holding its socket and
    leaving its durable session "connected", its will unpublished. A client within its keep-alive is kept."""
    broker = broker_factory(start=False)
    broker.extra_plugins.update(PATHS["amqtt-reader"])
    broker.start()
    alive = clients(broker.port, "alive", clean_session=True, auto_start=False)
    alive.connect(keepalive=4)  # paho's loop wakes once a second: keep-alive 1 left it 0.5 s of margin
    alive.subscribe("will/#", 0)
    silent = socket.create_connection((HOST, broker.port), timeout=WAIT)
    will = connect_packet("silent", clean=False, will_topic=b"will/silent", keepalive=1)
    silent.sendall(will + half)
    assert read_exactly(silent, 4)[:2] == b"\x20\x02"
    assert read_until_closed(silent, WAIT) == b"", "a client silent for 1.5 keep-alives stays connected"
    silent.close()
    assert [m.payload for m in alive.wait_messages(1)] == [b"gone"], "its will was not published"
    assert not alive.wait_disconnected(0), "a client that pings was disconnected"
    assert "silent: nothing received for 1.5 keep-alive periods: disconnecting" in broker.log()


def test_a_silent_websocket_client_is_disconnected_after_1_5_keepalives(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """Websocket connections are read by amqtt's own loop too: a client whose network loop stopped
    (no PINGREQ, nothing read) was never disconnected."""
    broker = broker_factory(start=False)
    broker.ws_port = free_port()
    broker.start()
    stopped = clients(broker.ws_port, "ws-silent", clean_session=False, transport="websockets", auto_start=False)
    stopped.connect(keepalive=1)
    stopped.paho.loop_stop()  # silent from now on
    line = "ws-silent: nothing received for 1.5 keep-alive periods: disconnecting"
    assert wait_until(lambda: line in broker.log(), WAIT), broker.log()[-2000:]
    assert connack_within(broker.port, WAIT), "a new client was not served"


CTL = b"_durable/v1/ctl"


def congested_durable_client(port: int, client_id: str) -> socket.socket:
    """A durable client that never reads, with 40 replies of 500 kB asked for (20 MB): more than the
    broker's socket buffer holds (at most 4 MB on Linux), so later requests wait."""
    sock = starved_durable_client(port, client_id)
    body = b"\x00\x01" + b"".join(mqtt_string(f"f/{i:04d}/".ljust(FILTER_BYTES, "x")) + b"\x00" for i in range(FILTERS))
    sock.sendall(mqtt_packet(0x82, body))
    first, _ = read_packet(sock)
    assert first == 0x90
    sock.sendall(publish_packet(CTL, json.dumps({"v": 1, "op": "hello"}).encode(), 0) * 40)
    return sock


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    ("packet", "count"),
    [(publish_packet(b"_durable/" + b"x" * 60_000, b"", 0), 300), (publish_packet(CTL, b"", 0), 50_000)],
    ids=["60-kB-topic", "empty-payload"],
)
def test_waiting_requests_count_their_topic_and_an_overhead_against_max_pending_control_bytes(
    broker_factory: Callable[..., Broker], path: str, packet: bytes, count: int
) -> None:
    """Only the payload was counted: a PUBLISH under ``_durable/`` with a 60 kB topic and no
    payload, or an empty request, counted 0 bytes, so a client that did not read its replies could
    make the broker hold requests without end (tens of MB) and was never disconnected. Now each
    waiting request counts its topic, its payload and 200 bytes, and the connection is closed."""
    broker = broker_factory(start=False)
    broker.extra_plugins.update(PATHS[path])
    broker.start()
    attacker = congested_durable_client(broker.port, "hoarder")
    try:
        for _ in range(count // 1000 or count):
            attacker.sendall(packet * (1000 if count >= 1000 else 1))
    except OSError:  # closed by the broker while sending: what is expected
        pass
    # Not read before: reading the replies would let the waiting requests be handled.
    line = "closing the connection of hoarder: "
    assert wait_until(lambda: line in broker.log(), WAIT), ("requests counted as nothing", broker.log()[-1500:])
    assert read_until_closed(attacker, WAIT) is not None
    attacker.close()


def test_unknown_topic_errors_and_log_lines_show_a_long_topic_cut(broker: Broker) -> None:
    """The ``unknown_topic`` error and its log line held the whole topic, up to 65 kB."""
    client = starved_durable_client(broker.port, "long")
    client.sendall(publish_packet(b"_durable/" + b"y" * 60_000, b'{"v":1,"op":"hello","req":5}', 0))
    _, reply = read_packet(client)
    client.close()
    fields = json.loads(reply[2 + len(b"$durable/v1/reply") :])
    assert fields["error"]["code"] == "unknown_topic" and fields["req"] == 5, str(fields)[:300]
    assert len(fields["error"]["message"]) < 200, fields["error"]["message"][:300]
    lines = [line for line in broker.log().splitlines() if "long: control request refused" in line]
    assert lines and all(len(line) < 400 for line in lines), [line[:300] for line in lines]


STREAM_TOPICS = 40
STREAM_EVENTS = 1000


@pytest.mark.parametrize(
    ("name", "op"),
    [("s/{:03d}", "stream_info"), ("s/\u00e9{:03d}", "stream_info"), ("s/{:03d}", "stream_unsubscribe")],
    ids=["ascii", "non-ascii", "unsubscribe-of-another-filter"],
)
def test_a_consumer_acking_each_stream_event_as_fast_as_it_reads_is_not_disconnected(
    broker_factory: Callable[..., Broker], name: str, op: str
) -> None:
    """protocol.md allows a ``stream_ack`` per event. While the broker's writes to the connection
    were behind (stream events, not replies), each ack waited as a control request and counted
    toward max_pending_control_bytes: a consumer reading 40 topics with window 1000 as fast as it
    could was reset after some 26,500 events, logged as a client that does not read its replies.
    An ack on an open stream has no reply: it is handled on arrival. While a request waits
    (a stream_info here), acks still do not wait unless it is a stream_unsubscribe: on non-ASCII
    topics every ack held a JSON escape (json.dumps writes \\u00e9, as the SDK does) and counted
    as a possible unsubscribe, so they waited again and the consumer was reset after some 27,000
    events. A waiting stream_unsubscribe held back every ack, so one of a filter the consumer does
    not read got it reset as well (review 160: after 26,531 events); now only acks on topics its
    filter matches wait for it."""
    broker = broker_factory(streams=[{"filter": "s/#", "max_count": 100000}])
    pub = socket.create_connection((HOST, broker.port), timeout=WAIT)
    pub.sendall(connect_packet("pub", clean=True))
    read_exactly(pub, 4)
    pub.sendall(
        b"".join(
            publish_packet(name.format(t).encode(), b"e" * 200, 1, packet_id=(t * STREAM_EVENTS + i) % 65535 + 1)
            for t in range(STREAM_TOPICS)
            for i in range(STREAM_EVENTS)
        )
    )
    read_exactly(pub, 4 * STREAM_TOPICS * STREAM_EVENTS)  # every PUBACK: stored
    pub.close()
    sock = socket.create_connection((HOST, broker.port), timeout=WAIT)
    sock.sendall(connect_packet("reader", clean=True))
    read_exactly(sock, 4)
    subscribe = {"v": 1, "op": "stream_subscribe", "req": 1, "filter": "s/#", "window": 1000}
    sock.sendall(publish_packet(CTL, json.dumps(subscribe).encode(), 0))
    prefix = b"$durable/v1/stream/"
    events = STREAM_TOPICS * STREAM_EVENTS
    got: set[tuple[bytes, int]] = set()  # an event the machine's load kept unacknowledged past
    replies = 0  # stream_ack_timeout comes again (protocol.md): each is counted once
    asked = False
    try:
        for _ in range(2 * events + 2):  # the events, each resent at most once, and the two replies
            if len(got) == events and replies == 2:
                break
            _, packet = read_packet(sock)
            (length,) = struct.unpack(">H", packet[:2])
            topic = packet[2 : 2 + length]
            if not topic.startswith(prefix):
                replies += 1
                continue
            event_id = struct.unpack(">BBQQd", packet[2 + length : 2 + length + 26])[3]
            ack = {"v": 1, "op": "stream_ack", "topic": topic[len(prefix) :].decode(), "id": event_id}
            sock.sendall(publish_packet(CTL, json.dumps(ack).encode(), 0))  # ensure_ascii, as the SDK
            got.add((topic, event_id))
            if len(got) == 2000 and not asked:  # a request that waits its turn, ahead of the next acks
                asked = True
                info = {"v": 1, "op": op, "req": 2, "filter": name.format(0) if op == "stream_info" else "s/zzz"}
                sock.sendall(publish_packet(CTL, json.dumps(info).encode(), 0))
    except OSError as exc:
        raise AssertionError(f"disconnected after {len(got)} events: {exc!r}; {broker.log()[-1500:]}") from exc
    finally:
        sock.close()
    assert (len(got), replies) == (events, 2)
    assert "closing the connection of reader" not in broker.log()


AHEAD_TOPICS = 4
AHEAD_EVENTS = 5000


def fill_ahead_logs(port: int) -> socket.socket:
    """AHEAD_EVENTS events of 1,000 bytes in each of the AHEAD_TOPICS logs a/<t>, every one
    PUBACKed (stored); returns the publisher's connection, still open."""
    pub = socket.create_connection((HOST, port), timeout=WAIT)
    pub.sendall(connect_packet("pub", clean=True))
    read_exactly(pub, 4)
    for t in range(AHEAD_TOPICS):
        pub.sendall(
            b"".join(
                publish_packet(f"a/{t}".encode(), b"e" * 1000, 1, packet_id=i % 65535 + 1) for i in range(AHEAD_EVENTS)
            )
        )
        read_exactly(pub, 4 * AHEAD_EVENTS)  # every PUBACK: stored
    return pub


def test_acks_for_events_not_read_do_not_pour_the_log_into_the_broker_s_memory(
    broker_factory: Callable[..., Broker],
) -> None:
    """An ack is handled on arrival, but the events it makes room for wait for the client to read:
    a client that reads nothing and acks ids far ahead (window 10) would otherwise have the broker
    write its whole log (20 MB here) to a connection it does not read."""
    broker = broker_factory(streams=[{"filter": "a/#", "max_count": 100000}])
    assert broker.proc is not None
    pid = broker.proc.pid
    pub = fill_ahead_logs(broker.port)
    pub.close()
    sock = starved_durable_client(broker.port, "ahead")
    before_kb = memory_kb(pid, "VmRSS")
    subscribe = {"v": 1, "op": "stream_subscribe", "req": 1, "filter": "a/#", "window": 10}
    sock.sendall(publish_packet(CTL, json.dumps(subscribe).encode(), 0))
    acks = b"".join(
        publish_packet(CTL, json.dumps({"v": 1, "op": "stream_ack", "topic": f"a/{t}", "id": 10**9}).encode(), 0)
        for t in range(AHEAD_TOPICS)
    )
    for _ in range(AHEAD_EVENTS // 10):
        sock.sendall(acks)
    info = {"v": 1, "op": "stream_info", "req": 2, "filter": "a/#"}
    sock.sendall(publish_packet(CTL, json.dumps(info).encode(), 0))
    for _ in range(AHEAD_TOPICS * AHEAD_EVENTS + 2):  # read until its reply: every ack was handled
        _, packet = read_packet(sock)
        if packet.startswith(b"\x00\x11$durable/v1/reply") and b'"req":2' in packet:
            break
    else:
        raise AssertionError("no reply to stream_info")
    grown_kb = memory_kb(pid, "VmHWM") - before_kb
    sock.close()
    assert grown_kb < 10_000, f"the broker grew by {grown_kb} kB for a client that had read nothing"


APPEND_ROUNDS = 4000


def test_acks_for_events_not_read_do_not_pour_the_log_out_while_events_are_appended(
    broker_factory: Callable[..., Broker],
) -> None:
    """An ack taken on arrival while the client is behind held back only the refill of that ack:
    the next append to the topic sent a window again, so a client that read nothing and acked
    10**9 on each topic after every append had the broker write 10,910 events (11 MB) to it at
    4,000 appends per topic, 2,950 (what the socket buffers take) with the topic held until the
    client has read."""
    broker = broker_factory(streams=[{"filter": "a/#", "max_count": 100000}])
    assert broker.proc is not None
    pid = broker.proc.pid
    pub = fill_ahead_logs(broker.port)
    sock = starved_durable_client(broker.port, "ahead")
    before_kb = memory_kb(pid, "VmRSS")
    subscribe = {"v": 1, "op": "stream_subscribe", "req": 1, "filter": "a/#", "window": 10}
    sock.sendall(publish_packet(CTL, json.dumps(subscribe).encode(), 0))
    acks = b"".join(
        publish_packet(CTL, json.dumps({"v": 1, "op": "stream_ack", "topic": f"a/{t}", "id": 10**9}).encode(), 0)
        for t in range(AHEAD_TOPICS)
    )
    appends = b"".join(publish_packet(f"a/{t}".encode(), b"n", 1, packet_id=t + 1) for t in range(AHEAD_TOPICS))
    for _ in range(APPEND_ROUNDS):
        sock.sendall(acks)
        pub.sendall(appends)
        read_exactly(pub, 4 * AHEAD_TOPICS)  # stored, and the senders told
    pub.close()
    grown_kb = memory_kb(pid, "VmHWM") - before_kb
    info = {"v": 1, "op": "stream_info", "req": 2, "filter": "a/#"}
    sock.sendall(publish_packet(CTL, json.dumps(info).encode(), 0))
    events = 0
    for _ in range(AHEAD_TOPICS * (AHEAD_EVENTS + APPEND_ROUNDS) + 2):  # read until its reply
        _, packet = read_packet(sock)
        if packet.startswith(b"\x00\x11$durable/v1/reply") and b'"req":2' in packet:
            break
        events += packet[2:21] == b"$durable/v1/stream/"
    else:
        raise AssertionError("no reply to stream_info")
    sock.close()
    assert events < 6000, f"{events} events of 1 kB written to a client that had read nothing"
    assert grown_kb < 10_000, f"the broker grew by {grown_kb} kB for a client that had read nothing"


@pytest.mark.parametrize("transport", ["tcp", "websocket"])
def test_a_client_uploading_a_large_publish_in_slow_pieces_is_not_silent(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], transport: str
) -> None:
    """MQTT over websockets may split a packet across websocket messages (MQTT 3.1.1 section 6).
    amqtt's websocket reader waits for a whole fixed header or body over as many messages as it
    takes, and only that wait counted as heard: a client sending a 100 kB PUBLISH in 50 pieces,
    one every 0.2 s, with keep-alive 2 was disconnected as silent after 3 s. Every websocket
    message counts now (a TCP connection's every chunk already did). Keep-alive 1 and 13 pieces here:
    the body's wait lasts 2.4 s or more, past the 1.5 s at which such a client was disconnected."""
    broker = broker_factory(start=False)
    broker.extra_plugins.update(PATHS["amqtt-reader"])
    broker.ws_port = free_port()
    broker.start()
    sub = clients(broker.port, "sub", clean_session=True)
    sub.subscribe("up/#", 0)
    packet = publish_packet(b"up/big", b"p" * 100_000, 0)
    step = -(-len(packet) // 13)
    pieces = [packet[i : i + step] for i in range(0, len(packet), step)]
    connect = connect_packet("uploader", clean=True, keepalive=1)

    async def paced() -> None:
        await asyncio.sleep(0.2)  # the client's slow uplink (the input under test, not a synchronisation)

    if transport == "websocket":

        async def upload() -> None:
            async with ws_connect(f"ws://{HOST}:{broker.ws_port}/", subprotocols=["mqtt"]) as ws:  # type: ignore[list-item]
                await ws.send(connect)
                assert bytes(await ws.recv())[:2] == b"\x20\x02"  # type: ignore[arg-type]
                for piece in pieces:
                    await ws.send(piece)
                    await paced()
                got = sub.wait_messages(1)
                assert len(got[0].payload) == 100_000

        asyncio.run(upload())
    else:

        async def upload_tcp() -> None:
            sock = socket.create_connection((HOST, broker.port), timeout=WAIT)
            sock.sendall(connect)
            assert read_exactly(sock, 4)[:2] == b"\x20\x02"
            for piece in pieces:
                sock.sendall(piece)
                await paced()
            got = sub.wait_messages(1)
            assert len(got[0].payload) == 100_000
            sock.close()

        asyncio.run(upload_tcp())
    assert "uploader: nothing received for 1.5 keep-alive periods" not in broker.log()


POSITIONS = 1800
"""Positions of topics without a log in one stream_subscribe: about 56 kB, under the request limit."""


def test_stream_positions_of_topics_without_a_log_are_bounded_by_max_stream_entries_per_client(
    broker_factory: Callable[..., Broker],
) -> None:
    """A stream_subscribe keeps the position of every topic in ``after`` that has no log yet, until
    the connection ends: 200 requests of 56 kB (11 MB) grew the broker by 52 MB, without end. Past
    max_stream_entries_per_client (10000) filters and kept positions a stream_subscribe is refused,
    changes nothing, and the connection goes on."""
    broker = broker_factory(streams=[{"filter": "t/#"}])
    assert broker.proc is not None
    pid = broker.proc.pid
    client = starved_durable_client(broker.port, "positions")
    before_kb = memory_kb(pid, "VmRSS")
    codes = []
    for r in range(40):
        after = {f"t/{r}/{i:05d}/yyyyyyyyyy": i for i in range(POSITIONS)}
        request = json.dumps({"v": 1, "op": "stream_subscribe", "req": r, "filter": "t/#", "after": after})
        client.sendall(publish_packet(b"_durable/v1/ctl", request.encode(), 0))
        _, reply = read_packet(client)
        fields = json.loads(reply[2 + len(b"$durable/v1/reply") :])
        codes.append(None if fields["ok"] else fields["error"]["code"])
    grown_kb = memory_kb(pid, "VmRSS") - before_kb
    kept = 10_000 // POSITIONS
    assert codes == [None] * kept + ["malformed"] * (40 - kept), codes
    assert grown_kb < 20_000, f"the broker grew by {grown_kb} kB"
    info = json.dumps({"v": 1, "op": "stream_info", "req": 99, "filter": "t/#"}).encode()
    client.sendall(publish_packet(b"_durable/v1/ctl", info, 0))
    assert json.loads(read_packet(client)[1][2 + len(b"$durable/v1/reply") :])["ok"], "the connection goes on"
    client.close()
    assert "positions: stream_subscribe 't/#' refused" in broker.log()
    assert "max_stream_entries_per_client is 10000" in broker.log()


REFUSED = 2000


def test_refused_control_requests_are_logged_at_most_once_per_drop_log_interval(broker: Broker) -> None:
    """Every refused control request was logged (INFO, some 200 bytes for a request of 30): a client
    sending them as fast as it reads the replies filled the broker's log at several MB/s. Now one
    line per connection per drop_log_interval (10 s); every request is still answered."""
    client = starved_durable_client(broker.port, "noisy")
    request = publish_packet(b"_durable/v1/ctl", b'{"v":1,"op":"x"}', 0)
    for _batch in range(REFUSED // 100):
        client.sendall(request * 100)
        for _ in range(100):
            _, reply = read_packet(client)
            assert json.loads(reply[2 + len(b"$durable/v1/reply") :])["error"]["code"] == "unknown_op"
    client.close()
    lines = [line for line in broker.log().splitlines() if "noisy: control request refused" in line]
    assert 1 <= len(lines) <= 2, f"{len(lines)} log lines for {REFUSED} refused requests"
