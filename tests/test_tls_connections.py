"""Client connections on a TLS listener against a real broker process: their end, however it comes,
logs no error, and a take-over of one asyncio lost still answers the new CONNECT. asyncio's TLS
transport differs from its TCP one where the plugin closes connections: closed twice it drops its
TLS state, and it is told of a lost connection a loop pass after the TCP transport under it.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from raw_mqtt_helpers import connect_packet, raw_connect, read_exactly, read_packet
from test_hostile_attacks9 import (
    RESET_PIPELINED,
    RESET_RETAINED,
    packet_id,
    pause_logged,
    publish_all,
    small_window_client,
    subscribe,
)
from test_hostile_door_limits import tls_broker
from test_hostile_wire import PINGREQ, publish_packet, wait_until

from amqtt_durable.amqtt_glue import CLOSE_GRACE
from conftest import HOST, WAIT, Broker, mqtt_string

TLS_IDLE = "Listener 'tls': 0/"
"""amqtt's INFO line as a connection of the TLS listener ends and none is left (before the plugin's
clean-up of it, in the same loop pass)."""


def reset(sock: socket.socket) -> None:
    """Close with a TCP RST (no DISCONNECT, no TLS close_notify)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def read_until(sock: socket.socket, wanted: tuple[int, bytes]) -> None:
    """Reads packets until ``wanted`` (first byte, body) comes, at most RESET_RETAINED + 10 others."""
    deadline = time.monotonic() + WAIT
    for _ in range(RESET_RETAINED + 10):
        if read_packet(sock, deadline) == wanted:
            return
    raise AssertionError(f"{wanted} did not come")


def assert_no_error_logged(broker: Broker) -> None:
    """Once the TLS listener's connections have ended, and the broker has answered a PINGREQ since
    (its clean-up of them is done), its log holds no ERROR and no traceback."""
    assert wait_until(lambda: TLS_IDLE in broker.log(), WAIT), broker.log()[-3000:]
    with raw_connect(broker.port, "pinger", clean=True) as pinger:
        pinger.sendall(PINGREQ)
        assert read_exactly(pinger, 2) == b"\xd0\x00"
    log = broker.log()
    assert " ERROR " not in log and "Traceback" not in log, log[-3000:]


@pytest.mark.parametrize("end", ["disconnect", "reset", "fin"])
def test_a_tls_session_logs_no_error_at_its_end(
    broker_factory: Callable[..., Broker], tmp_path: Path, end: str
) -> None:
    """A durable client over TLS connects, subscribes, publishes to itself, gets its message and
    ends: with DISCONNECT, a reset (RST) or a TCP FIN without TLS's close_notify. The broker logs no
    ERROR and no traceback (each such end logged asyncio's "Unhandled exception in
    client_connected_cb", an AttributeError of the SSL transport the plugin closed twice, and
    skipped the rest of the connection's clean-up)."""
    broker, port, context = tls_broker(broker_factory, tmp_path)
    sock = context.wrap_socket(socket.create_connection((HOST, port), timeout=WAIT), server_hostname=HOST)
    sock.sendall(connect_packet("tls-client", clean=False))
    assert read_exactly(sock, 4) == b"\x20\x02\x00\x00"
    sock.sendall(subscribe(1, "t/x", qos=0))
    assert read_packet(sock) == (0x90, packet_id(1) + b"\x00")  # no deadline: poll() does not see TLS's bytes
    sock.sendall(publish_packet(b"t/x", b"hello", qos=0))
    assert read_packet(sock) == (0x30, mqtt_string("t/x") + b"hello")
    if end == "disconnect":
        sock.sendall(b"\xe0\x00")
        sock.close()
    elif end == "reset":
        reset(sock)
    else:
        sock.close()  # Python's SSLSocket sends no close_notify unless unwrapped
    assert_no_error_logged(broker)


@pytest.mark.parametrize("clean", [False, True], ids=["durable", "clean"])
def test_a_take_over_of_a_lost_tls_connection_still_applying_its_subscribes_gets_its_connack(
    broker_factory: Callable[..., Broker], tmp_path: Path, clean: bool
) -> None:
    """A client over TLS subscribes to `#` over 8 MB of retained messages and pipelines 5,000
    SUBSCRIBEs, reading nothing, until its reader pauses; its connection is then reset while its
    handler still applies them. A CONNECT of its client id takes it over: it gets its CONNACK and
    the messages it subscribes to (the take-over's close of the old connection raised, as the TLS
    transport asyncio lost was closed twice, and the new CONNECT got no answer), and no error is
    logged."""
    broker, port, context = tls_broker(broker_factory, tmp_path, max_subscriptions_per_client=0)  # 5,002 held
    pub = raw_connect(broker.port, "pub", clean=True, keepalive=0)
    publish_all(pub, [f"r/{i}" for i in range(RESET_RETAINED)], retain=True, payload=bytes(1024))
    sock = small_window_client(port, "lost", context, clean=clean, keepalive=0)
    sock.sendall(subscribe(0, "#", qos=0))
    assert read_packet(sock)[0] >> 4 in (9, 3)  # its SUBACK, or (durable) a retained message before it
    sock.sendall(b"".join(subscribe(i, f"f/{i}", qos=0) for i in range(1, RESET_PIPELINED + 1)))
    assert wait_until(lambda: pause_logged(broker, "lost"), WAIT), broker.log()[-3000:]
    reset(sock)
    again = raw_connect(broker.port, "lost", clean=clean, keepalive=0)  # its CONNACK, accepted
    again.sendall(subscribe(1, "live", qos=0))
    read_until(again, (0x90, packet_id(1) + b"\x00"))  # behind what its session (durable: `#`) still sends
    publish_all(pub, ["live"], retain=False)
    read_until(again, (0x30, mqtt_string("live") + b"v"))
    again.close()
    pub.close()
    assert_no_error_logged(broker)


def tcp_state(local_port: int, remote_port: int) -> str | None:
    """The kernel's state (hex, as /proc/net/tcp has it) of the 127.0.0.1 socket from ``local_port``
    to ``remote_port``, or None once it is gone."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote = (int(address.split(":")[1], 16) for address in fields[1:3])
        if (local, remote) == (local_port, remote_port):
            return fields[3]
    return None


ESTABLISHED = "01"


def test_a_taken_over_tls_connection_whose_client_reads_nothing_is_aborted_after_close_grace(
    broker_factory: Callable[..., Broker], tmp_path: Path
) -> None:
    """A client over TLS that reads nothing of a `#` over 4 MB of retained messages is taken over:
    the broker closes the old connection and, its bytes still unsent after CLOSE_GRACE, aborts the TCP
    connection under TLS (the TLS transport alone would wait for its client's close_notify for
    asyncio's 30 s TLS shutdown timeout, and for the unsent bytes before that)."""
    broker, port, context = tls_broker(broker_factory, tmp_path)
    pub = raw_connect(broker.port, "pub", clean=True, keepalive=0)
    publish_all(pub, [f"r/{i}" for i in range(4000)], retain=True, payload=bytes(1024))
    sock = small_window_client(port, "unread", context, clean=True, keepalive=0)
    sock.sendall(subscribe(1, "#", qos=0))
    read_packet(sock)  # its SUBACK; the retained messages back up in the broker
    brokers_end = (port, sock.getsockname()[1])
    assert tcp_state(*brokers_end) == ESTABLISHED
    again = raw_connect(broker.port, "unread", clean=True, keepalive=0)  # the take-over
    assert wait_until(lambda: tcp_state(*brokers_end) != ESTABLISHED, CLOSE_GRACE + WAIT), tcp_state(*brokers_end)
    again.close()
    sock.close()
    pub.close()
