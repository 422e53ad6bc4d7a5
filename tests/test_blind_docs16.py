"""A sixteenth pass of black-box tests written from docs/configuration.md and docs/operations.md
alone, for promises the earlier test_blind_* and test_docs_promises* files leave out: how
``amqtt-durable broker`` reads numbers YAML writes in forms of its own (a float no float holds, an
exponent without a point or a sign), and, from operations.md's flood bullet, a clean session's
retained QoS 2 flow behind pipelined SUBSCRIBEs (a PUBREC that comes again) and the packet ids of its
unacknowledged messages. The commands that end without serving run in this process
(test_blind_docs12's run_here); one broker serves the others; each test quotes the promise it checks.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from raw_mqtt_helpers import raw_connect, read_packet
from test_blind_docs12 import refused_config

from conftest import Broker, Client, mqtt_packet, mqtt_string

pytestmark = pytest.mark.timeout(60)

TOO_LARGE = "'session_expiry': must be a finite number, got a number too large for one"


@pytest.mark.parametrize(
    ("line", "error"),
    [
        ("session_expiry: 1.0e+400", TOO_LARGE),
        ("session_expiry: 1" + "0" * 400 + ".5", TOO_LARGE),
        ("session_expiry: 1" + "0" * 309 + ".5", TOO_LARGE),  # 310 digits: above about 1.8e308
        (
            "replication: {role: primary, ack_timeout: 1.0e+999}",
            "'replication.ack_timeout': must be a finite number, got a number too large for one",
        ),
        ("max_depth: 1.0e+400", "'max_depth': expected a whole number, got 1.0e+400"),
        ("session_expiry: .inf", "'session_expiry': must be a finite number, 0 or more, got inf"),
    ],
)
def test_a_yaml_number_too_large_for_a_float_is_refused_as_in_python(tmp_path: Path, line: str, error: str) -> None:
    """configuration.md: a *number* setting "holds it as a float (... one too large for a float is refused
    with `'session_expiry': must be a finite number, got a number too large for one` ...)", and settings
    are "checked by these same rules" in broker.yaml and in Python. PyYAML reads a float written finite
    that no float holds (`1.0e+400`) as inf, which was refused as `got inf`, a value the file does not
    hold; a whole-number setting quoted it as `inf` too. `.inf`, written infinite, is still `got inf`."""
    assert error in refused_config(tmp_path, line)


def test_an_exponent_yaml_reads_as_text(tmp_path: Path) -> None:
    """configuration.md: "broker.yaml's YAML (1.1) reads an exponent only with a point and a sign
    (`1.0e+3`): `1e3` and `1.0e3` are text, refused with `'session_expiry': expected a number, got
    '1e3'`"; `-1.0e+3` is the number -1000, refused by its range as written."""
    assert "'session_expiry': expected a number, got '1e3'" in refused_config(tmp_path, "session_expiry: 1e3")
    assert "'session_expiry': expected a number, got '1.0e3'" in refused_config(tmp_path, "session_expiry: 1.0e3")
    assert "'batch_delay_ms': must be a finite number, 0 or more, got -1000" in refused_config(
        tmp_path, "batch_delay_ms: -1.0e+3"
    )


# --- operations.md, the flood bullet: a clean session's retained and live QoS 1/2 messages -----------------


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    """One broker for the tests of this file that need no setting of their own (each uses its own topics
    and client ids); its acks nothing awaits are logged at most once a minute per connection."""
    broker = Broker(tmp_path_factory.mktemp("shared"), drop_log_interval=60)
    broker.start()
    yield broker
    broker.stop()


def packet_id(body: bytes) -> bytes:
    """The packet id of a QoS 1/2 PUBLISH's body."""
    end = 2 + int.from_bytes(body[:2], "big")
    return body[end : end + 2]


def pinged(sock: socket.socket) -> list[tuple[int, bytes]]:
    """What the broker sends before the PINGRESP of a PINGREQ sent now: the packets it wrote in answer to
    those sent before (it reads a connection's packets in order)."""
    sock.sendall(b"\xc0\x00")
    before = []
    for _ in range(100):
        first, body = read_packet(sock)
        if first == 0xD0:
            return before
        before.append((first, body))
    raise AssertionError(f"no PINGRESP: {before}")


def test_a_clean_sessions_retained_qos2_flow_and_a_pubrec_that_comes_again(shared: Broker) -> None:
    """operations.md (Limitations, pipelined SUBSCRIBEs): "On a clean session the message loop writes the
    retained messages a SUBSCRIBE brings (in order, before the next SUBACK)", "each message right after
    its SUBACK"; "Their acks (PUBACK, or PUBREC then, after the PUBREL the plugin writes, PUBCOMP; a
    PUBREC that comes again is ignored as an ack nothing awaits)"; configuration.md `drop_log_interval`:
    "between two WARNINGs of one connection's acks (PUBACK, PUBREC, PUBCOMP) of packet ids no message
    sent to it awaits (ignored ...)"."""
    publisher = Client(shared.port, "rq2-pub", clean_session=True)
    publisher.publish("rq2/a", [b"A"], qos=2, retain=True)
    publisher.publish("rq2/b", [b"B"], qos=2, retain=True)
    publisher.disconnect()
    sock = raw_connect(shared.port, "rq2-sub", clean=True)
    subscribes = [
        mqtt_packet(0x82, pid.to_bytes(2, "big") + mqtt_string(topic) + b"\x02")
        for pid, topic in ((1, "rq2/a"), (2, "rq2/b"))
    ]
    sock.sendall(b"".join(subscribes))  # pipelined
    got = [read_packet(sock) for _ in range(4)]
    assert [first for first, _ in got] == [0x90, 0x34 | 0x01, 0x90, 0x34 | 0x01], got  # QoS 2, RETAIN
    assert got[0][1] == b"\x00\x01\x02" and got[2][1] == b"\x00\x02\x02", got
    assert got[1][1].endswith(b"rq2/a" + packet_id(got[1][1]) + b"A") and got[3][1].endswith(b"B"), got
    first_id = packet_id(got[1][1])
    sock.sendall(mqtt_packet(0x50, first_id))  # PUBREC
    assert read_packet(sock) == (0x62, first_id), "its PUBREL"
    sock.sendall(mqtt_packet(0x50, first_id))  # the PUBREC again
    assert pinged(sock) == [], "a PUBREC that comes again gets nothing"
    sock.sendall(mqtt_packet(0x70, first_id) + mqtt_packet(0x70, first_id))  # PUBCOMP, then again
    assert pinged(sock) == []
    sock.sendall(b"\xe0\x00")
    sock.close()
    ignored = [line for line in shared.log().splitlines() if "rq2-sub:" in line and "ignored" in line]
    assert len(ignored) == 1 and " WARNING " in ignored[0], ignored  # the second PUBCOMP's is left out
    assert f"PUBREC of packet id {int.from_bytes(first_id, 'big')} ignored" in ignored[0], ignored


def test_a_clean_sessions_unacknowledged_messages_keep_their_packet_ids(shared: Broker) -> None:
    """operations.md (Limitations): the acks of "the live QoS 1/2 messages sent to a clean session ... are
    awaited as entries of a table per connection"; "On the plugin's reader a wait ends only with its ack
    or with the connection"; "Until its wait ends a message's packet id stays taken (no other message to
    that connection gets it)". Retained and live QoS 1 messages, none acknowledged, each get a packet id
    of its own."""
    publisher = Client(shared.port, "ids-pub", clean_session=True)
    publisher.publish("ids/kept", [b"r"], qos=1, retain=True)
    sock = raw_connect(shared.port, "ids-sub", clean=True)
    sock.sendall(mqtt_packet(0x82, b"\x00\x01" + mqtt_string("ids/#") + b"\x01"))
    assert read_packet(sock) == (0x90, b"\x00\x01\x01")
    retained = read_packet(sock)
    publisher.publish("ids/live", [b"l%d" % i for i in range(40)], qos=1)
    live = [read_packet(sock) for _ in range(40)]
    ids = [packet_id(body) for _, body in [retained, *live]]
    assert len(set(ids)) == 41, ids
    assert all(body.endswith(b"l%d" % i) for i, (_, body) in enumerate(live)), live
    sock.sendall(b"".join(mqtt_packet(0x40, pid) for pid in ids))  # every PUBACK, none ignored
    assert pinged(sock) == []
    sock.close()
    publisher.disconnect()
    assert not [line for line in shared.log().splitlines() if "ids-sub:" in line and "ignored" in line]
