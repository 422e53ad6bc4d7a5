#!/usr/bin/env python3
"""A device that goes offline misses nothing.

Needs a running broker with the durable plugin (``make run`` in another terminal):

    .venv/bin/python examples/offline_device.py [--host 127.0.0.1] [--port 1883] [--count 20]

1. The device connects with clean_session=False and a client id, subscribes at QoS 1,
   and disconnects.
2. A publisher sends --count QoS 1 events to the device's topic; the broker acknowledges
   each one only after it is stored for the device.
3. The device connects again (a fresh client object, as after a reboot), without
   subscribing: the broker says session_present=1 and sends every event, in order.

Exit code 0 when all events arrived in order with session_present=1, otherwise 1.
Every wait is bounded by --timeout.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion


class Connection:
    """One paho client with bounded waits for CONNACK, SUBACK and incoming messages."""

    def __init__(self, host: str, port: int, client_id: str, clean_session: bool, timeout: float) -> None:
        self.timeout = timeout
        self.session_present: bool | None = None
        self.payloads: list[str] = []
        self._connected = threading.Event()
        self._subscribed = threading.Event()
        self._received = threading.Condition()
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=clean_session)
        self.client.on_connect = self._on_connect
        self.client.on_subscribe = lambda *_: self._subscribed.set()
        self.client.on_message = self._on_message
        self.client.connect(host, port, keepalive=30)
        self.client.loop_start()
        if not self._connected.wait(timeout):
            raise TimeoutError(f"{client_id}: no CONNACK within {timeout} s")

    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason_code: Any, properties: Any) -> None:
        self.session_present = bool(flags.session_present)
        self._connected.set()

    def _on_message(self, client: Any, userdata: Any, message: mqtt.MQTTMessage) -> None:
        with self._received:
            self.payloads.append(message.payload.decode())
            self._received.notify_all()

    def subscribe(self, topic: str) -> None:
        self.client.subscribe(topic, qos=1)
        if not self._subscribed.wait(self.timeout):
            raise TimeoutError(f"no SUBACK for {topic} within {self.timeout} s")

    def publish_all(self, topic: str, payloads: list[str]) -> None:
        """Publish at QoS 1 and return once the broker has acknowledged (PUBACK) every message."""
        infos = [self.client.publish(topic, payload, qos=1) for payload in payloads]
        deadline = time.monotonic() + self.timeout
        for info in infos:
            info.wait_for_publish(max(0.0, deadline - time.monotonic()))
            if not info.is_published():
                raise TimeoutError(f"no PUBACK for message {info.mid} within {self.timeout} s")

    def wait_for(self, count: int) -> list[str]:
        with self._received:
            self._received.wait_for(lambda: len(self.payloads) >= count, self.timeout)
            return list(self.payloads)

    def close(self) -> None:
        self.client.disconnect()  # a normal DISCONNECT keeps a durable session
        self.client.loop_stop()


def run(host: str, port: int, client_id: str, count: int, timeout: float) -> bool:
    topic = f"devices/{client_id}/events"
    events = [f"event-{i:04d}" for i in range(1, count + 1)]

    # Start from a clean slate: clean_session=True deletes any session left by an earlier run.
    Connection(host, port, client_id, clean_session=True, timeout=timeout).close()

    device = Connection(host, port, client_id, clean_session=False, timeout=timeout)
    device.subscribe(topic)
    print(f"device {client_id}: subscribed to {topic} (session_present={int(bool(device.session_present))})")
    device.close()
    print(f"device {client_id}: offline")

    publisher = Connection(host, port, f"publisher-{os.getpid()}", clean_session=True, timeout=timeout)
    publisher.publish_all(topic, events)
    publisher.close()
    print(f"publisher: {count} QoS 1 events acknowledged by the broker while the device was offline")

    device = Connection(host, port, client_id, clean_session=False, timeout=timeout)
    received = device.wait_for(count)
    device.close()
    present = int(bool(device.session_present))
    in_order = received == events
    print(
        f"device {client_id}: reconnected with session_present={present}, "
        f"got {len(received)}/{count} events{' in order' if in_order else ''}"
    )
    if not in_order:
        print(f"expected {events}\n     got {received}")
    return present == 1 and in_order


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=1883)
    parser.add_argument("--client-id", default="offline-device-1")
    parser.add_argument("--count", type=int, default=20, help="events to publish while offline (default 20)")
    parser.add_argument("--timeout", type=float, default=10.0, help="bound of every wait, seconds (default 10)")
    args = parser.parse_args()
    try:
        ok = run(args.host, args.port, args.client_id, args.count, args.timeout)
    except (OSError, TimeoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print("OK: nothing was lost while the device was offline" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
