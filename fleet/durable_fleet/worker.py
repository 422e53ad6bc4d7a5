"""One process of the fleet: a group of simulated devices, or a publisher.

The runner starts ``python -m durable_fleet.worker SPEC.json`` per group, and a device_restart
fault SIGKILLs the whole process: that is the point (a CPL-2 device must come back without
duplicates, from its journal). Everything the runner learns about the devices it reads from
their delivery logs (docs/delivery-log.md), the same files the Spark audit judges, so nothing
here reports anything by another channel. SIGTERM ends the process cleanly: publishers wait
for their PUBACKs, devices close (and end their sessions when the spec says so).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion

from durable_client import DurableClient, DurableClientError, Event
from durable_client.delivery_log import DeliveryLog
from durable_protocol.jsontext import json_object

from .model import DeviceKind

log = logging.getLogger("durable_fleet.worker")

TOPIC_ROOT = "fleet"
BROADCAST_TOPIC = f"{TOPIC_ROOT}/broadcast"
SUBSCRIPTION_QOS = 1
"""Devices subscribe at QoS 1 (durable); ``--qos`` sets what the publishers send."""
DEVICE_HOST = "127.0.0.1"
"""Where the fault proxy listens."""
CLOSE_TIMEOUT = 10.0
RECONNECT_MAX_DELAY = 1.0
EXIT_THREAD_FAILED = 3


def command_topic(device: str) -> str:
    return f"{TOPIC_ROOT}/{device}/cmd"


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    kind: DeviceKind


@dataclass(frozen=True)
class PublisherSpec:
    """Publishes ``rate`` messages/s: message k goes to device (k + offset) mod N, every
    ``broadcast_every``-th one (0: none) to the broadcast topic instead."""

    name: str
    rate: float
    devices: list[str]
    offset: int
    broadcast_every: int
    payload_size: int
    qos: int
    max_inflight: int = 200


@dataclass(frozen=True)
class WorkerSpec:
    """What one worker process runs; written as JSON by the runner."""

    device_port: int
    """Devices connect here: the fault proxy, on 127.0.0.1."""
    broker_host: str
    broker_port: int
    """Publishers connect here: the broker itself (faults hit devices, not the back end)."""
    logs: str
    state_dir: str
    keepalive: int
    end_sessions: bool
    """On SIGTERM, end the devices' sessions (a broker the harness did not start keeps no litter)."""
    harness_pid: int | None = None
    """The process that starts this one: once it is no longer the parent (it died, even before this
    process started), the worker stops by itself. None in a spec an older version wrote (it had no
    such field): that worker runs as it did then, with no watch of its harness (said at its start)."""
    devices: list[DeviceSpec] = field(default_factory=list)
    publisher: PublisherSpec | None = None

    def dump(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1), encoding="utf-8")

    @staticmethod
    def load(path: Path) -> WorkerSpec:
        raw = json_object(path.read_bytes())
        devices = [DeviceSpec(**device) for device in raw.pop("devices")]
        publisher = raw.pop("publisher")
        return WorkerSpec(**raw, devices=devices, publisher=PublisherSpec(**publisher) if publisher else None)

    def harness_gone(self) -> bool:
        """The harness that wrote this spec is no longer this process's parent (False without a harness_pid)."""
        return self.harness_pid is not None and os.getppid() != self.harness_pid


def _log_path(spec: WorkerSpec, name: str) -> Path:
    return Path(spec.logs) / f"{name}.jsonl"


def _paho_client(client_id: str, clean_session: bool) -> mqtt.Client:
    version = MQTTProtocolVersion.MQTTv311
    return mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=clean_session, protocol=version)


def _set_connected(client: mqtt.Client, connected: threading.Event, flags: Any, reason: Any, props: Any) -> None:
    if not reason.is_failure:
        connected.set()


def _ignore(event: Event) -> None:
    """The delivery log is the record of processing; the simulated device does nothing else."""


class SdkDevice:
    """A DurableClient device: CPL-1 (memory) or CPL-2 (disk) duplicate detection."""

    def __init__(self, spec: WorkerSpec, device: DeviceSpec) -> None:
        self.name = device.name
        self.client = DurableClient(
            device.name,
            host=DEVICE_HOST,
            port=spec.device_port,
            keepalive=spec.keepalive,
            persistence="disk" if device.kind == "cpl2" else "memory",
            state_dir=spec.state_dir,
            reconnect_max_delay=RECONNECT_MAX_DELAY,
            delivery_log=_log_path(spec, device.name),
        )
        for topic in (command_topic(device.name), BROADCAST_TOPIC):
            self.client.subscribe(topic, SUBSCRIPTION_QOS, listener=_ignore)

    def run(self, stop: threading.Event) -> None:
        """Connect, retrying while the link is down (a restart can land inside a cut or stall)."""
        while not stop.is_set():
            try:
                self.client.connect(timeout=2.0 * CLOSE_TIMEOUT)
            except DurableClientError as exc:  # ConnectFailed, or a request cut off by the next fault
                log.info("%s: %s; trying again", self.name, exc)
                stop.wait(RECONNECT_MAX_DELAY)
                continue
            self.client.ready_for_events()
            return

    def close(self, end_session: bool) -> None:
        self.client.close(keep_session=not end_session, timeout=CLOSE_TIMEOUT)


class PahoDevice:
    """A plain paho client, clean_session=False at QoS 1: at-least-once, no duplicate check."""

    def __init__(self, spec: WorkerSpec, device: DeviceSpec) -> None:
        self.name = device.name
        self.spec = spec
        self.log = DeliveryLog(_log_path(spec, device.name), device.name)
        self.topics = [command_topic(device.name), BROADCAST_TOPIC]
        self.pending: dict[int, list[str]] = {}
        self.client = _paho_client(device.name, clean_session=False)
        self.client.reconnect_delay_set(1, 1)  # paho's delays are whole seconds
        self.client.on_connect = self._on_connect
        self.client.on_subscribe = self._on_subscribe
        self.client.on_message = self._on_message

    def _on_connect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        if reason.is_failure:
            return
        self.log.connect(bool(flags.session_present))
        _, mid = client.subscribe([(topic, SUBSCRIPTION_QOS) for topic in self.topics])
        if mid is not None:
            self.pending[mid] = self.topics

    def _on_subscribe(self, client: mqtt.Client, userdata: Any, mid: int, reasons: Any, props: Any) -> None:
        for topic, reason in zip(self.pending.pop(mid, []), reasons, strict=False):
            if not reason.is_failure:
                self.log.subscribe(topic, SUBSCRIPTION_QOS, durable=True)

    def _on_message(self, client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
        self.log.receive(
            Event(message.topic, bytes(message.payload), message.qos, 0, 0, time.time(), False, bool(message.retain),
                  bool(message.dup), False)
        )

    def run(self, stop: threading.Event) -> None:
        self.client.connect_async(DEVICE_HOST, self.spec.device_port, self.spec.keepalive)
        self.client.loop_start()

    def close(self, end_session: bool) -> None:
        self.client.disconnect()
        self.client.loop_stop()
        if end_session:  # a clean CONNECT removes the session, once the broker has accepted it
            connected = threading.Event()
            cleaner = _paho_client(self.name, clean_session=True)
            cleaner.user_data_set(connected)
            cleaner.on_connect = _set_connected
            cleaner.connect(DEVICE_HOST, self.spec.device_port, self.spec.keepalive)
            cleaner.loop_start()
            ended = connected.wait(CLOSE_TIMEOUT)
            cleaner.disconnect()
            cleaner.loop_stop()
            if not ended:
                raise TimeoutError(f"{self.name}: no CONNACK for the clean connection within {CLOSE_TIMEOUT} s")
        self.log.close()


class Publisher:
    """Publishes at a steady rate straight to the broker and logs each send at its PUBACK.

    A connection is never resumed: after a loss (a broker SIGKILL) a new client starts, and
    what was in flight is abandoned, not re-sent, so a message the broker stored but did not
    acknowledge can arrive (the audit counts it as unknown) but never twice.
    """

    def __init__(self, spec: WorkerSpec, publisher: PublisherSpec) -> None:
        self.spec = spec
        self.p = publisher
        self.name = publisher.name
        self.log = DeliveryLog(_log_path(spec, publisher.name), publisher.name)
        self.lock = threading.Lock()
        self.settled = threading.Condition(self.lock)
        self.inflight: dict[int, tuple[str, bytes]] = {}
        self.early: set[int] = set()
        """PUBACKs that beat publish() back to this thread. paho calls on_publish under its own
        lock, which publish() takes too, so ours is never held across publish()."""
        self.padding = b"." * max(0, publisher.payload_size - 24)
        self.current: mqtt.Client | None = None
        self.gone = False
        """The current client's connection is lost: paho 2.2 calls on_disconnect before it marks the
        connection lost, so is_connected() can still say True to a thread woken by that callback."""

    def _message(self, k: int) -> tuple[str, bytes]:
        p = self.p
        if p.broadcast_every and k % p.broadcast_every == p.broadcast_every - 1:
            topic = BROADCAST_TOPIC
        else:
            topic = command_topic(p.devices[(k + p.offset) % len(p.devices)])
        return topic, f"{p.name}:{k}:".encode() + self.padding

    def _client(self, stop: threading.Event) -> mqtt.Client | None:
        """A fresh connected client, or None once stopped."""
        while not stop.is_set():
            connected = threading.Event()
            client = _paho_client(f"{self.p.name}-{time.time_ns()}", clean_session=True)
            client.user_data_set(connected)
            client.max_inflight_messages_set(self.p.max_inflight)
            client.reconnect_delay_set(3600, 3600)  # paho must not resume this connection: a new client does
            client.on_connect = _set_connected
            client.on_publish = self._on_publish
            client.on_disconnect = self._on_disconnect
            with self.lock:
                self.current, self.gone = client, False
            try:
                client.connect(self.spec.broker_host, self.spec.broker_port, self.spec.keepalive)
            except OSError:
                stop.wait(0.2)  # the broker is down (being restarted); bounded by stop
                continue
            client.loop_start()
            if connected.wait(CLOSE_TIMEOUT):
                return client
            self._drop(client)
        return None

    def _drop(self, client: mqtt.Client) -> None:
        client.disconnect()
        client.loop_stop()
        with self.lock:
            self.inflight.clear()  # abandoned: never re-sent
            self.early.clear()

    def _on_publish(self, client: mqtt.Client, userdata: Any, mid: int, reason: Any, props: Any) -> None:
        if self.p.qos == 0:
            return  # logged when handed to paho
        with self.lock:
            message = self.inflight.pop(mid, None)
            if message is None:
                self.early.add(mid)
            else:
                self.log.send(message[0], message[1], self.p.qos)
            self.settled.notify_all()

    def _on_disconnect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        with self.lock:
            if client is self.current:
                self.gone = True
            self.settled.notify_all()  # no PUBACK comes any more: run() stops waiting for them

    def _publish(self, client: mqtt.Client, k: int) -> None:
        topic, payload = self._message(k)
        info = client.publish(topic, payload, self.p.qos)
        if info.rc != mqtt.MQTT_ERR_SUCCESS:
            return
        with self.lock:
            if self.p.qos == 0 or info.mid in self.early:
                self.early.discard(info.mid)
                self.log.send(topic, payload, self.p.qos)
            else:
                self.inflight[info.mid] = (topic, payload)

    def run(self, stop: threading.Event) -> None:
        client = self._client(stop)
        start = time.monotonic()
        k = 0
        while client is not None and not stop.is_set():
            due = int((time.monotonic() - start) * self.p.rate)
            while k < due and client.is_connected():
                self._publish(client, k)
                k += 1
            k = max(k, due)  # what was due while the broker was down is not sent late
            if not client.is_connected():
                self._drop(client)
                client = self._client(stop)
                continue
            stop.wait(min(0.05, 1.0 / self.p.rate))
        if client is not None:
            with self.lock:  # the last PUBACKs, bounded; none comes once the connection is gone
                self.settled.wait_for(lambda: not self.inflight or self.gone, CLOSE_TIMEOUT)
            client.disconnect()
            client.loop_stop()
        self.log.close()

    def close(self, end_session: bool) -> None:
        """Publishers have no session; run() closes the client."""


def _die(args: threading.ExceptHookArgs) -> None:
    log.critical("%s failed", args.thread.name if args.thread else "a thread", exc_info=args.exc_value)
    logging.shutdown()
    os._exit(EXIT_THREAD_FAILED)


def _load_spec(parser: argparse.ArgumentParser, path: Path) -> WorkerSpec:
    """The spec at ``path``; one line naming the file and what is wrong (exit 2) for one the runner did not
    write (hand-edited, truncated, another program's), not a traceback."""
    try:
        return WorkerSpec.load(path)
    except (OSError, ValueError, TypeError, KeyError) as error:
        parser.error(f"{path} is not a worker spec the fleet runner wrote: {type(error).__name__}: {error}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m durable_fleet.worker")
    parser.add_argument("spec", type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    threading.excepthook = _die  # a device or publisher thread that fails takes the process down: noticed
    spec = _load_spec(parser, args.spec)
    if spec.harness_gone():  # the harness died while this process started: build nothing (no client, no log)
        log.warning(
            "the harness (PID %d) that wrote %s is gone: stopping before any device starts", spec.harness_pid, args.spec
        )
        return 0
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    members: list[SdkDevice | PahoDevice | Publisher] = [
        SdkDevice(spec, device) if device.kind != "paho" else PahoDevice(spec, device) for device in spec.devices
    ]
    if spec.publisher is not None:
        members.append(Publisher(spec, spec.publisher))
    if spec.harness_pid is None:
        log.warning(
            "%s has no harness_pid (written by an older version): this worker does not stop by itself when its "
            "harness dies; stop it with SIGTERM",
            args.spec,
        )
    threads = [threading.Thread(target=member.run, args=(stop,), name=member.name, daemon=True) for member in members]
    for thread in threads:
        thread.start()
    # Checked at once, then every second (the wake-up also lets the SIGTERM handler run in the main thread).
    while not stop.is_set():
        if spec.harness_gone():  # the harness died without stopping us: stop, leave nothing running
            stop.set()  # the publishers' threads end on it (else each join waited CLOSE_TIMEOUT)
            break
        stop.wait(1.0)
    for thread in threads:
        thread.join(CLOSE_TIMEOUT)
    status = 0
    for member in members:
        try:
            member.close(spec.end_sessions)
        except Exception:  # the others must still close (and end their sessions)
            log.exception("closing %s failed", member.name)
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
