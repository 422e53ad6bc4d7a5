#!/usr/bin/env python3
"""A device behind a flaky link processes every command exactly once, in order.

Needs a running broker with the durable plugin (``make run`` in another terminal):

    .venv/bin/python examples/flaky_link_device.py [--host 127.0.0.1] [--port 1883] [--count 200] [--cut-every 25]

1. The script starts a small TCP fault proxy on 127.0.0.1 (an ephemeral port) that forwards
   to the broker. On every connection it counts the MQTT acknowledgements (PUBACK) the device
   sends: the --cut-every'th one is never forwarded, and the link is cut there (both sockets
   closed at once, no MQTT DISCONNECT). So every cut leaves the broker with at least one
   command the device has processed but the broker believes was not delivered.
2. The device is a DurableClient (persistence="disk": its processed marks are fsync'd to a
   state folder, a temporary one unless --state-dir is given) that connects through the
   proxy, reconnects with a short backoff, subscribes durably to devices/<id>/commands and
   calls ready_for_events().
3. A publisher, also the SDK's (a DurableClient with durable_session=False: no session of
   its own; publish() waits for the PUBACK), sends --count numbered commands at QoS 1 straight
   to the broker.
4. After each cut the broker re-sends what was not acknowledged; the SDK recognises the
   commands it already processed by their broker sequence ids and drops them before the
   listener, so the listener sees every command once, in order.

Exit code 0 when the listener got commands 1..--count exactly once and in order, otherwise 1.
Every wait is bounded by --timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
import tempfile
import threading
from collections import Counter

from durable_client import DurableClient, DurableClientError, Event, Marker

LOCALHOST = "127.0.0.1"
PUBACK = 0x40


def split_packets(buffer: bytearray) -> list[bytes]:
    """Take the complete MQTT packets off the front of ``buffer`` (what is left is a packet's start)."""
    packets: list[bytes] = []
    while len(buffer) >= 2:
        length, multiplier, pos = 0, 1, 1
        while True:  # the remaining length: 1 to 4 bytes
            if pos >= len(buffer):
                return packets
            byte = buffer[pos]
            length += (byte & 0x7F) * multiplier
            multiplier *= 128
            pos += 1
            if not byte & 0x80:
                break
            if pos > 4:
                raise ValueError("malformed MQTT remaining length")
        if len(buffer) < pos + length:
            break
        packets.append(bytes(buffer[: pos + length]))
        del buffer[: pos + length]
    return packets


class FaultProxy:
    """A TCP proxy to the broker that cuts each connection at the device's ``cut_every``'th PUBACK.

    It runs an asyncio loop on its own thread; ``cuts`` counts the cuts so far.
    """

    def __init__(self, broker_host: str, broker_port: int, cut_every: int, timeout: float) -> None:
        self.broker_host = broker_host
        self.broker_port = broker_port
        self.cut_every = cut_every
        self.timeout = timeout
        self.port = 0
        self.cuts = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True)
        self._server: asyncio.Server | None = None
        self._links: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[None]] = set()

    def start(self) -> int:
        self._thread.start()
        started = asyncio.run_coroutine_threadsafe(asyncio.start_server(self._handle, LOCALHOST, 0), self._loop)
        self._server = started.result(self.timeout)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    def stop(self) -> None:
        async def close_all() -> None:
            if self._server is not None:
                self._server.close()
            for writer in list(self._links):
                writer.transport.abort()
            if self._handlers:  # they end at once: their sockets are closed
                await asyncio.wait(list(self._handlers), timeout=self.timeout)

        if self._thread.is_alive():
            with contextlib.suppress(Exception):  # stopping is best effort: the loop thread is a daemon
                asyncio.run_coroutine_threadsafe(close_all(), self._loop).result(self.timeout)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(self.timeout)
        if not self._thread.is_alive():
            self._loop.close()

    async def _handle(self, device_reader: asyncio.StreamReader, device_writer: asyncio.StreamWriter) -> None:
        handler = asyncio.current_task()
        if handler is not None:
            self._handlers.add(handler)
            handler.add_done_callback(self._handlers.discard)
        try:
            broker_reader, broker_writer = await asyncio.wait_for(
                asyncio.open_connection(self.broker_host, self.broker_port), self.timeout
            )
        except (OSError, TimeoutError):
            device_writer.transport.abort()
            return
        self._links |= {device_writer, broker_writer}
        to_device = asyncio.create_task(self._forward(broker_reader, device_writer))
        to_broker = asyncio.create_task(self._forward_until_cut(device_reader, broker_writer))
        done, pending = await asyncio.wait({to_device, to_broker}, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        if to_broker in done and not to_broker.cancelled() and to_broker.exception() is None and to_broker.result():
            self.cuts += 1
        # The cut (or the end of either side): both sockets closed at once, nothing more forwarded.
        for writer in (device_writer, broker_writer):
            writer.transport.abort()
            self._links.discard(writer)

    @staticmethod
    async def _forward(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()

    async def _forward_until_cut(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Device -> broker, packet by packet. True at the cut (the PUBACK not forwarded), False at EOF."""
        buffer = bytearray()
        acks = 0
        while data := await reader.read(65536):
            buffer += data
            for packet in split_packets(buffer):
                if packet[0] & 0xF0 == PUBACK:
                    acks += 1
                    if acks == self.cut_every:
                        return True
                writer.write(packet)
            await writer.drain()
        return False


class Device:
    """The device's DurableClient and what its listener saw: command numbers in arrival order."""

    def __init__(self, client_id: str, port: int, state_dir: str) -> None:
        self.numbers: list[int] = []
        self.distinct: set[int] = set()
        self.wrong: list[str] = []
        self.replayed = 0
        self._cond = threading.Condition()
        self._live = threading.Event()
        self.client = DurableClient(
            client_id,
            LOCALHOST,
            port,
            persistence="disk",
            state_dir=state_dir,
            reconnect_min_delay=0.05,
            reconnect_max_delay=0.5,
            on_live=self._on_live,
        )

    def on_command(self, event: Event) -> None:
        """The listener: called once per command (the SDK drops re-sent ones it already processed)."""
        with self._cond:
            try:
                number = int(event.payload.decode().removeprefix("command-"))
                self.numbers.append(number)
                self.distinct.add(number)
            except ValueError:
                self.wrong.append(f"unexpected message on {event.topic}: {event.payload!r}")
            self.replayed += event.replayed
            self._cond.notify_all()

    def _on_live(self, marker: Marker) -> None:
        self._live.set()

    def wait_live(self, timeout: float) -> None:
        if not self._live.wait(timeout):
            raise TimeoutError(f"no replay marker (on_live) within {timeout} s after ready_for_events()")

    def wait_for(self, count: int, timeout: float) -> list[int]:
        """The command numbers processed, once ``count`` distinct ones came (or something wrong, or ``timeout``)."""
        with self._cond:
            self._cond.wait_for(lambda: len(self.distinct) >= count or bool(self.wrong), timeout)
            return list(self.numbers)


def describe_problems(numbers: list[int], count: int, timeout: float) -> list[str]:
    """What is wrong with the processed sequence, compared with 1..count once each, in order."""
    problems = []
    seen = set(numbers)
    duplicated = sorted(n for n, times in Counter(numbers).items() if times > 1)
    missing = sorted(set(range(1, count + 1)) - seen)
    if missing:
        problems.append(f"{len(missing)} command(s) not processed within {timeout} s, e.g. {missing[:10]}")
    if duplicated:
        problems.append(f"{len(duplicated)} command(s) processed more than once, e.g. {duplicated[:10]}")
    unique = list(dict.fromkeys(numbers))
    if unique != sorted(unique):
        at = next(i for i in range(1, len(unique)) if unique[i] < unique[i - 1])
        problems.append(f"out of order: command {unique[at]} came after command {unique[at - 1]}")
    extra = sorted(seen - set(range(1, count + 1)))
    if extra:
        problems.append(f"unexpected command numbers {extra[:10]}")
    return problems


def run(args: argparse.Namespace, state_dir: str) -> tuple[list[str], int]:
    """Returns the problems found (none: exactly once, in order) and the number of cuts."""
    topic = f"devices/{args.client_id}/commands"
    commands = [f"command-{i:06d}" for i in range(1, args.count + 1)]

    # Start from a clean slate: end any session (and marks) an earlier run left behind.
    wipe = DurableClient(args.client_id, args.host, args.port, persistence="disk", state_dir=state_dir)
    wipe.connect(args.timeout)
    wipe.close(keep_session=False, timeout=args.timeout)

    proxy = FaultProxy(args.host, args.port, args.cut_every, args.timeout)
    proxy.start()
    device = Device(args.client_id, proxy.port, state_dir)
    try:
        device.client.subscribe(topic, qos=1, listener=device.on_command)
        device.client.connect(args.timeout)
        device.client.ready_for_events()
        device.wait_live(args.timeout)
        print(
            f"device {args.client_id}: subscribed to {topic} through the fault proxy 127.0.0.1:{proxy.port} "
            f"(cuts the link at every {args.cut_every}th acknowledgement), "
            f"persistence={device.client.persistence_level}"
        )

        # The publisher: a stateless DurableClient (no session of its own), straight to the broker.
        publisher = DurableClient(f"commander-{os.getpid()}", args.host, args.port, durable_session=False)
        publisher.connect(args.timeout)
        try:
            for command in commands:  # each returns once the broker has acknowledged (stored) it
                publisher.publish(topic, command, qos=1, timeout=args.timeout)
        finally:
            publisher.close(timeout=args.timeout)
        print(f"publisher: {args.count} QoS 1 commands acknowledged by the broker")

        numbers = device.wait_for(args.count, args.timeout)
        stats = device.client.stats
    finally:
        device.client.close(keep_session=True, timeout=args.timeout)
        proxy.stop()

    problems = device.wrong + describe_problems(numbers, args.count, args.timeout)
    unique = len(set(numbers) & set(range(1, args.count + 1)))
    print(
        f"device {args.client_id}: processed {unique}/{args.count} commands"
        + ("" if problems else " exactly once, in order")
    )
    print(
        f"link cuts: {proxy.cuts}, reconnects: {stats.reconnects}, "
        f"duplicates dropped by the SDK: {stats.duplicates_dropped}, replayed events: {device.replayed}"
    )
    return problems, proxy.cuts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default=LOCALHOST)
    parser.add_argument("--port", type=int, default=1883)
    parser.add_argument("--client-id", default="flaky-device-1")
    parser.add_argument("--count", type=int, default=200, help="commands to publish (default 200)")
    parser.add_argument(
        "--cut-every", type=int, default=25, help="cut the link at the device's Nth acknowledgement (default 25)"
    )
    parser.add_argument("--state-dir", help="folder for the device's processed marks (default: a temporary one)")
    parser.add_argument("--timeout", type=float, default=10.0, help="bound of every wait, seconds (default 10)")
    parser.add_argument("--verbose", action="store_true", help="show the SDK's log (each cut and reconnect)")
    args = parser.parse_args()
    if args.count < 1 or args.cut_every < 2:
        parser.error("--count must be 1 or more and --cut-every 2 or more (each connection must make progress)")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.ERROR, format="%(name)s: %(message)s")
    if not args.verbose:  # paho logs every cut as an error ("failed to receive on socket"): expected here
        logging.getLogger("durable_client.paho").setLevel(logging.CRITICAL)
    try:
        if args.state_dir:
            problems, cuts = run(args, args.state_dir)
        else:
            with tempfile.TemporaryDirectory(prefix="flaky-device-") as state_dir:
                problems, cuts = run(args, state_dir)
    except (OSError, TimeoutError, DurableClientError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    if problems:
        print("FAILED")
        return 1
    print(f"OK: every command processed exactly once, in order, despite {cuts} link cut(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
