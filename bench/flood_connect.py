"""The pipelining flood (docs/operations.md, Limitations): a client pipelines PINGREQs or SUBSCRIBEs
as fast as its socket takes them and reads none of the answers (its receive buffer 4 KiB). Reports
what the flood sent, how much the broker grew (VmRSS) and how long a new client's CONNECT then
waits for its CONNACK (at most --connack-wait seconds).

    PYTHONPATH=plugin:client_sdk python bench/flood_connect.py --kind PINGREQ
    PYTHONPATH=<another checkout>/plugin:client_sdk python bench/flood_connect.py --kind SUBSCRIBE

The broker runs the amqtt_durable its PYTHONPATH finds first, so two checkouts compare side by side.
"""

from __future__ import annotations

import argparse
import select
import socket
import sys
import tempfile
import time
from pathlib import Path

import amqtt_durable
from amqtt_durable.process import HOST, BrokerProcess, free_port

PINGREQ = b"\xc0\x00"


def mqtt_string(text: str) -> bytes:
    data = text.encode()
    return len(data).to_bytes(2, "big") + data


def connect_packet(client_id: str) -> bytes:
    body = mqtt_string("MQTT") + b"\x04\x02\x00\x00" + mqtt_string(client_id)  # clean session, no keep-alive
    return bytes((0x10, len(body))) + body


def subscribe_packet(index: int) -> bytes:
    body = (index % 65535 + 1).to_bytes(2, "big") + mqtt_string("f/x") + b"\x01"
    return bytes((0x82, len(body))) + body


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


def connack_seconds(port: int, limit: float) -> float | None:
    """Seconds until a new client's CONNECT is answered; None: not within ``limit``."""
    started = time.monotonic()
    with socket.create_connection((HOST, port), timeout=limit) as sock:
        sock.sendall(connect_packet("newcomer"))
        try:
            answer = sock.recv(4)
        except TimeoutError:
            return None
    return time.monotonic() - started if answer[:1] == b"\x20" else None


def flood(port: int, kind: str, seconds: float, stalled: float) -> tuple[socket.socket, int]:
    """Sends for ``seconds``, or until the socket took nothing for ``stalled`` seconds; the packets sent."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(10)
    sock.connect((HOST, port))
    sock.sendall(connect_packet("flooder"))
    if sock.recv(4)[:1] != b"\x20":
        raise RuntimeError("the flooder got no CONNACK")
    packets = [PINGREQ] * 1000 if kind == "PINGREQ" else [subscribe_packet(i) for i in range(1000)]
    chunk, size = b"".join(packets), len(packets[0])
    sock.setblocking(False)
    sent, end, last_progress = 0, time.monotonic() + seconds, time.monotonic()
    while time.monotonic() < end and time.monotonic() - last_progress < stalled:  # bounded in time
        if not select.select([], [sock], [], 0.1)[1]:
            continue
        offset = sent % len(chunk)
        sent += sock.send(chunk[offset:])
        last_progress = time.monotonic()
    return sock, sent // size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", choices=("PINGREQ", "SUBSCRIBE"), default="PINGREQ")
    parser.add_argument("--seconds", type=float, default=3.0, help="longest the flood sends")
    parser.add_argument("--stalled", type=float, default=1.0, help="stop once the socket took nothing that long")
    parser.add_argument("--connack-wait", type=float, default=60.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="flood-") as folder:
        port = free_port()
        config = {
            "listeners": {"default": {"type": "tcp", "bind": f"{HOST}:{port}"}},
            "plugins": {
                "amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True},
                "amqtt_durable.DurableSessionsPlugin": {"store": f"{folder}/store", "metrics_interval": 0},
            },
        }
        broker = BrokerProcess(config, Path(folder), port)
        broker.start()
        try:
            assert broker.proc is not None
            before = rss_kb(broker.proc.pid)
            started = time.monotonic()
            sock, sent = flood(port, args.kind, args.seconds, args.stalled)
            took = time.monotonic() - started
            grown = rss_kb(broker.proc.pid) - before
            connack = connack_seconds(port, args.connack_wait)
            grown = max(grown, rss_kb(broker.proc.pid) - before)  # it may have read on meanwhile
            sock.close()
        finally:
            broker.stop()
    waited = f"{connack:.2f} s" if connack is not None else f"none within {args.connack_wait:.0f} s"
    print(
        f"{args.kind} flood, plugin {Path(amqtt_durable.__file__).parent}: {sent:,} sent in {took:.1f} s, "
        f"the broker grew by {grown / 1024:.1f} MB, a new client's CONNACK: {waited}"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
