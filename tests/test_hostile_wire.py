"""Issue 10, points 1, 2, 7 (packet size) and 8: what a hostile peer can do on the wire.

Each test is the attack itself against a real broker process over TCP, with raw sockets
where paho cannot send the bad packet.
"""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import struct
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from raw_mqtt_helpers import connect_packet, raw_connect, read_exactly
from test_protocol import request, stream_events

from amqtt_durable.inspect_store import summarize
from conftest import HOST, WAIT, Broker, Client, mqtt_packet, mqtt_string, payloads

PINGREQ = b"\xc0\x00"
CONNACK_ACCEPTED = b"\x20\x02\x00\x00"
TOPIC_PLUGIN = "amqtt.plugins.topic_checking.TopicTabooPlugin"
"""Any topic plugin makes the broker read with amqtt's own loop instead of the plugin's."""


# ------------------------------------------------------------------ raw MQTT
def publish_packet(topic: bytes, payload: bytes, qos: int, packet_id: int = 1) -> bytes:
    body = mqtt_string(topic) + (struct.pack(">H", packet_id) if qos else b"") + payload
    return mqtt_packet(0x30 | qos << 1, body)


def read_until_closed(sock: socket.socket, timeout: float) -> bytes | None:
    """Every byte the broker sends until it closes the connection; None if it is still open."""
    deadline = time.monotonic() + timeout
    got = bytearray()
    while (remaining := deadline - time.monotonic()) > 0:
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            return None
        except ConnectionResetError:
            return bytes(got)
        if not chunk:
            return bytes(got)
        got += chunk
    return None


def connack_within(port: int, timeout: float) -> bool:
    """A new client gets an accepted CONNACK within ``timeout`` seconds."""
    try:
        with socket.create_connection((HOST, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            sock.sendall(connect_packet("newcomer"))
            return sock.recv(4) == CONNACK_ACCEPTED
    except OSError:
        return False


def open_descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def memory_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def wait_until(condition: Callable[[], bool], timeout: float) -> bool:
    """Poll a condition of another process (no event to wait on), bounded by ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


# ------------------------------------------------- point 1: descriptor floods
NOFILE = 256
SERVING_AGAIN_S = 30.0
"""Bound on the first CONNACK after the flood. Each time the flood fills the descriptor limit,
asyncio stops accepting for ACCEPT_RETRY_DELAY (1 s), and the broker then works through the
connections the flood left in its listen backlog (up to listen_backlog, 512): about a second on
a quiet machine, but 5 s was exceeded on 2 cores at load 8 (other tests beside this one). Before
the fix the broker never served again, so a liberal bound still tells the two apart; the time
itself is measured in bench, not asserted here."""


@pytest.mark.slow  # 5 x the descriptor limit of connections, then connect_timeout: seconds
def test_a_connect_flood_of_five_times_the_descriptor_limit_leaves_the_broker_serving(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    broker = broker_factory(start=False, connect_timeout=3)
    proc = broker.spawn()
    resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (NOFILE, NOFILE))
    broker.wait_ready()
    sub = clients(broker.port, "dev-1")
    sub.subscribe("t", 1)
    baseline = open_descriptors(proc.pid)
    silent = [socket.create_connection((HOST, broker.port), timeout=WAIT) for _ in range(20)]
    refused = 0
    flood_deadline = time.monotonic() + 60
    for index in range(5 * NOFILE):
        if time.monotonic() > flood_deadline:
            refused += 5 * NOFILE - index
            break
        try:
            with socket.create_connection((HOST, broker.port), timeout=5) as sock:
                if index % 4 == 1:
                    sock.sendall(connect_packet("half")[:7])  # a CONNECT cut short, then gone
                elif index % 4 == 2:
                    sock.sendall(connect_packet("x")[:8] + b"\x03" + connect_packet("x")[9:])  # MQTT 3.1: refused
        except OSError:
            refused += 1
    flood_ended = time.monotonic()
    assert connack_within(broker.port, SERVING_AGAIN_S), f"no CONNACK within {SERVING_AGAIN_S} s after the flood"
    assert time.monotonic() - flood_ended < SERVING_AGAIN_S
    assert refused == 0, f"{refused} flood connections were not even accepted"
    clients(broker.port, "pub", clean_session=True).publish("t", [b"after-flood"], qos=1)
    assert [m.payload for m in sub.wait_messages(1)] == [b"after-flood"]
    for sock in silent:  # connections that never sent CONNECT are closed after connect_timeout
        assert read_until_closed(sock, WAIT) == b""
        sock.close()
    # Nothing waits for the garbage collector: the broker is back to its descriptors (the
    # publisher's connection may still be closing).
    assert wait_until(lambda: open_descriptors(proc.pid) <= baseline + 1, WAIT), (
        f"{open_descriptors(proc.pid)} descriptors open, {baseline} before the flood"
    )


def test_connections_without_a_whole_connect_are_closed_after_connect_timeout(
    broker_factory: Callable[..., Broker],
) -> None:
    broker = broker_factory(connect_timeout=1.5)
    connected = raw_connect(broker.port, "idle-but-connected", clean=True)
    silent = socket.create_connection((HOST, broker.port), timeout=WAIT)
    half = socket.create_connection((HOST, broker.port), timeout=WAIT)
    half.sendall(connect_packet("slow-loris")[:10])
    opened_at = time.monotonic()
    for sock in (silent, half):
        assert read_until_closed(sock, 1.5 + WAIT) == b""
        assert time.monotonic() - opened_at >= 1.4, "closed before connect_timeout"
        sock.close()
    connected.sendall(PINGREQ)  # a client whose CONNECT was complete is not touched
    assert connected.recv(2) == b"\xd0\x00"
    connected.close()
    assert "no complete CONNECT within connect_timeout (1.5 s)" in broker.log()


# ------------------------------------------- points 2 and 8: invalid PUBLISH topics
LOSSY_TOPICS = [b"k/\xff\xfe"]
BAD_TOPICS = [b"k/a\x00b", b"k/+", b"k/#", b"#", b"", *LOSSY_TOPICS]
PATHS = {
    "plugin-reader": {},  # the plugin's reader checks every PUBLISH before QoS 2 goes to amqtt
    "amqtt-reader": {TOPIC_PLUGIN: {}},  # amqtt's own reader loop and decoder
}


@pytest.mark.parametrize("path", PATHS)
def test_a_publish_to_an_invalid_topic_closes_the_connection_on_every_path(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], path: str
) -> None:
    broker = broker_factory(start=False)
    broker.extra_plugins.update(PATHS[path])
    broker.start()
    durable = clients(broker.port, "dev-1")
    assert durable.subscribe("#", 1) == [1]
    watcher = clients(broker.port, "watcher", clean_session=True)
    assert watcher.subscribe("#", 2) == [2]
    for topic in BAD_TOPICS:
        for qos in (0, 1, 2):
            bad = raw_connect(broker.port, "bad", clean=True)
            bad.sendall(publish_packet(topic, b"attack", qos) + PINGREQ)
            got = read_until_closed(bad, WAIT)
            assert got is not None, f"{topic!r} at QoS {qos}: the connection stayed open"
            # amqtt's reader handles the PINGREQ in a task of its own, maybe before the close.
            assert got in (b"", b"\xd0\x00"), f"{topic!r} at QoS {qos}: acknowledged ({got!r})"
            bad.close()
        if topic in LOSSY_TOPICS:
            continue  # amqtt's CONNECT decoder makes str(bytes) of it: a topic with no problem left
        with socket.create_connection((HOST, broker.port), timeout=WAIT) as will:
            will.sendall(connect_packet("bad-will", will_topic=topic))
            assert read_until_closed(will, WAIT) == b"", f"a will on {topic!r} was accepted"
    past_end = raw_connect(broker.port, "bad", clean=True)
    past_end.sendall(b"\x30\x05\x00\x09abc" + PINGREQ)  # a topic length of 9 in a 5-byte packet
    assert read_until_closed(past_end, WAIT) in (b"", b"\xd0\x00")
    past_end.close()
    clients(broker.port, "pub", clean_session=True).publish("k/good", [b"good"], qos=1)
    for receiver in (durable, watcher):
        assert receiver.wait_for(lambda ms: any(m.topic == "k/good" for m in ms))
        assert [(m.topic, m.payload) for m in receiver.messages] == [("k/good", b"good")]
    log = broker.log()
    for problem in (
        "the topic contains U+0000",
        "the topic contains a wildcard",
        "the topic is empty",
        "the topic is not valid UTF-8",
        "its topic length runs past the packet's end",
    ):
        assert f"closing the connection of bad: PUBLISH refused: {problem}" in log


BAD_FILTERS = (b"a/\xff", b"a/\xed\xa0\x80", b"a/\xc3", b"a/\x00b")
"""Not UTF-8: a stray byte, an encoded surrogate, a sequence cut short (MQTT-1.5.3-1); and
U+0000, which a string must not hold (MQTT-1.5.3-2)."""


@pytest.mark.parametrize("path", PATHS)
def test_a_subscribe_or_unsubscribe_of_a_filter_not_utf8_closes_the_connection_on_every_path(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], path: str
) -> None:
    """amqtt read such a filter as ``str(bytes)`` ("b'a/\\xff'"), a valid filter: the SUBSCRIBE was
    granted and a durable session kept it for ever. Now the connection is closed, nothing stored."""
    broker = broker_factory(start=False)
    broker.extra_plugins.update(PATHS[path])
    broker.start()
    receiver = clients(broker.port, "ä-receiver")
    assert receiver.subscribe("zähler/#", 1) == [1], "a filter that is UTF-8 beyond ASCII is fine"
    publisher = clients(broker.port, "pub", clean_session=True)
    durable_connect = connect_packet("bad", clean=False)  # what it subscribes is stored
    for raw in BAD_FILTERS:
        for first, options in ((0x82, b"\x01"), (0xA2, b"")):  # SUBSCRIBE QoS 1, UNSUBSCRIBE
            with socket.create_connection((HOST, broker.port), timeout=WAIT) as bad:
                bad.sendall(durable_connect)
                assert read_exactly(bad, 4)[:2] == b"\x20\x02"
                bad.sendall(mqtt_packet(first, struct.pack(">H", 7) + mqtt_string(raw) + options) + PINGREQ)
                got = read_until_closed(bad, WAIT)
            assert got is not None, f"{raw!r} in {first:#x}: the connection stayed open"
            assert got in (b"", b"\xd0\x00"), f"{raw!r} in {first:#x}: answered {got!r}"
        publisher.publish("zähler/1", [raw], qos=1)
    assert receiver.wait_for(lambda ms: len(ms) == len(BAD_FILTERS))
    assert [m.payload for m in receiver.messages] == list(BAD_FILTERS)
    log = broker.log()
    assert "closing the connection of bad: SUBSCRIBE refused: a topic filter is not valid UTF-8 (MQTT-1.5.3-1)" in log
    assert "closing the connection of bad: UNSUBSCRIBE refused: a topic filter is not valid UTF-8" in log
    assert "closing the connection of bad: SUBSCRIBE refused: a topic filter contains U+0000 (MQTT-1.5.3-2)" in log
    assert "closing the connection of bad: UNSUBSCRIBE refused: a topic filter contains U+0000" in log
    broker.stop()
    stored = {row.client_id: row.subscriptions for row in summarize(broker.store)}
    assert stored.get("bad", {}) == {}, stored


def test_a_nul_topic_cannot_forge_a_stream_event(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """The attack of issue 10: a publish to s/a, NUL, 8 bytes of 2 was read as s/a's event 1."""
    broker = broker_factory(streams=[{"filter": "s/#"}])
    durable = clients(broker.port, "dev-1")
    assert durable.subscribe("s/#", 1) == [1]
    assert durable.subscribe("k/#", 1) == [1]
    durable.disconnect()
    watcher = clients(broker.port, "watcher", clean_session=True)
    watcher.subscribe("s/#", 1)
    watcher.subscribe("k/#", 1)
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("s/a", payloads(2, "e"), qos=1)
    for topic in (b"s/a\x00" + struct.pack(">Q", 2), b"k/a\x00b"):
        bad = raw_connect(broker.port, "attacker", clean=True)
        bad.sendall(publish_packet(topic, b"injected", 1))
        assert read_until_closed(bad, WAIT) == b"", "the NUL topic was acknowledged, or the connection kept"
        bad.close()
    publisher.publish("s/a", [b"e0000002"], qos=1)
    expected = [("s/a", b"e0000000"), ("s/a", b"e0000001"), ("s/a", b"e0000002")]
    assert watcher.wait_for(lambda ms: len(ms) >= 3)
    assert [(m.topic, m.payload) for m in watcher.messages] == expected
    for restarted in (False, True):
        if restarted:
            broker.restart()
        reader = clients(broker.port, f"reader-{restarted}", clean_session=True)
        reply = request(reader, "stream_subscribe", filter="s/#", window=10)
        assert reply.ok and reply.fields["topics"] == {"s/a": {"first": 1, "last": 3}}, reply
        assert reader.wait_for(lambda ms, r=reader: len(stream_events(r)) >= 3)
        got = [(topic, frame.seq, payload) for topic, frame, payload in stream_events(reader)]
        assert got == [("s/a", i + 1, payload) for i, (_, payload) in enumerate(expected)]
        assert not reader.wait_for(lambda ms, r=reader: len(stream_events(r)) > 3, timeout=0.3)
    assert durable.connect() is True
    assert durable.wait_for(lambda ms: len(ms) >= 3)
    assert [(m.topic, m.payload) for m in durable.messages] == expected
    assert not durable.wait_for(lambda ms: len(ms) > 3, timeout=0.3), "an injected message was queued"


# ------------------------------------------------------- point 7: packet size
def test_a_publish_past_max_packet_size_is_refused_before_its_body_is_read(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    assert broker.proc is not None
    pid = broker.proc.pid
    sub = clients(broker.port, "dev-1")
    sub.subscribe("t", 1)
    pub = clients(broker.port, "pub", clean_session=True)
    pub.publish("t", [b"before"], qos=1)
    size = 2 * 1024 * 1024  # twice the default max_packet_size (1 MB)
    body = mqtt_string("t") + b"\x00\x01" + b"x" * (size - 5)
    attack = mqtt_packet(0x32, body)
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # restart the peak-RSS count (VmHWM) from now
    rss_before = memory_kb(pid, "VmRSS")
    bad = raw_connect(broker.port, "big", clean=True)
    bad.settimeout(WAIT)
    with contextlib.suppress(OSError):  # the broker closes after the header: the rest meets a reset
        bad.sendall(attack)
    assert read_until_closed(bad, WAIT) == b"", "the 2 MB PUBLISH was acknowledged, or the connection kept"
    bad.close()
    peak_growth = memory_kb(pid, "VmHWM") - rss_before
    assert peak_growth < size // 1024 // 2, f"peak RSS grew by {peak_growth} kB for a {size // 1024} kB packet"
    pub.publish("t", [b"after"], qos=1)
    assert [m.payload for m in sub.wait_messages(2)] == [b"before", b"after"]
    assert "closing the connection of big: a packet of 2097152 bytes is larger than max_packet_size (1048576" in (
        broker.log()
    )


@pytest.mark.parametrize("path", PATHS)
def test_max_packet_size_is_configurable_and_checked_on_every_path(
    broker_factory: Callable[..., Broker], path: str
) -> None:
    broker = broker_factory(start=False, max_packet_size=4096)
    broker.extra_plugins.update(PATHS[path])
    broker.start()
    fits = raw_connect(broker.port, "fits", clean=True)
    fits.sendall(publish_packet(b"t", b"x" * (4096 - 5), 1))  # remaining length exactly 4096
    assert fits.recv(4) == b"\x40\x02\x00\x01"
    fits.sendall(publish_packet(b"t", b"x" * 4092, 1, packet_id=2))  # 4097
    assert read_until_closed(fits, WAIT) == b""
    fits.close()
    with socket.create_connection((HOST, broker.port), timeout=WAIT) as big_connect:
        big_connect.sendall(b"\x10" + bytes((0x81, 0x40)))  # a CONNECT announcing 8193 bytes, none sent
        assert read_until_closed(big_connect, 5.0) == b"", "not closed before connect_timeout (10 s)"
    assert connack_within(broker.port, WAIT)
    log = broker.log()
    assert "closing the connection of fits: a packet of 4097 bytes is larger than max_packet_size (4096" in log
    assert "before its CONNECT was read: a packet of 8193 bytes is larger than max_packet_size (4096" in log


@pytest.mark.parametrize("violation", ["reserved-type", "second-connect"])
def test_nothing_read_after_a_protocol_violation_is_handled(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], violation: str
) -> None:
    """A reserved packet type or a second CONNECT (MQTT-3.1.0-2) ends the connection: a QoS 1
    PUBLISH that came after it in the same read is neither routed nor acknowledged (the plugin's
    reader handled it: delivered and PUBACKed)."""
    broker = broker_factory()
    watcher = clients(broker.port, "watcher", clean_session=True)
    assert watcher.subscribe("v/#", 1) == [1]
    durable = clients(broker.port, "dev-1")
    assert durable.subscribe("v/#", 1) == [1]
    bad = raw_connect(broker.port, "bad", clean=True)
    first = b"\xf0\x00" if violation == "reserved-type" else connect_packet("bad", clean=True)
    bad.sendall(first + publish_packet(b"v/after", b"after the violation", 1, packet_id=7))
    got = read_until_closed(bad, WAIT)
    bad.close()
    assert got == b"", f"the broker answered after the violation: {got!r}"
    clients(broker.port, "pub", clean_session=True).publish("v/marker", [b"marker"], qos=1)
    for receiver in (watcher, durable):
        assert receiver.wait_for(lambda ms: any(m.topic == "v/marker" for m in ms))
        assert [m.topic for m in receiver.messages] == ["v/marker"]
