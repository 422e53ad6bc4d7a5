"""The fleet's publisher (durable_fleet.worker.Publisher) in this process, against a real broker through
the fleet's fault proxy: how it stops when its connection is lost while it waits for its last PUBACKs."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt

from conftest import Broker
from durable_fleet.proxy import FaultProxy
from durable_fleet.worker import CLOSE_TIMEOUT, Publisher, PublisherSpec, WorkerSpec

WAIT = 10.0


class _Looks(threading.Condition):
    """The publisher's ``settled`` condition, counting each look of a wait_for at its predicate."""

    def __init__(self, lock: threading.Lock) -> None:
        super().__init__(lock)
        self.seen = threading.Condition()
        self.looks = 0

    def wait_for(self, predicate: Callable[[], Any], timeout: float | None = None) -> Any:
        def counted() -> Any:
            result = predicate()
            with self.seen:
                self.looks += 1
                self.seen.notify_all()
            return result

        return super().wait_for(counted, timeout)


class _WatchedPublisher(Publisher):
    """A Publisher whose on_disconnect holds paho's thread until the waiting thread has looked again. That
    widens to certainty the window paho 2.2 leaves open: it calls on_disconnect before it marks the
    connection lost, so a thread woken by the callback could still find is_connected() True."""

    def __init__(self, spec: WorkerSpec, publisher: PublisherSpec) -> None:
        super().__init__(spec, publisher)
        self.settled = self.looks = _Looks(self.lock)
        self.published = threading.Condition()
        self.acks = 0

    def _publish(self, client: mqtt.Client, k: int) -> None:
        super()._publish(client, k)
        with self.published:
            self.published.notify_all()

    def _on_publish(self, client: mqtt.Client, userdata: Any, mid: int, reason: Any, props: Any) -> None:
        super()._on_publish(client, userdata, mid, reason, props)
        with self.published:
            self.acks += 1
            self.published.notify_all()

    def _on_disconnect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        with self.looks.seen:
            before = self.looks.looks
        super()._on_disconnect(client, userdata, flags, reason, props)
        with self.looks.seen:
            self.looks.seen.wait_for(lambda: self.looks.looks > before, WAIT)


PUBLISHER = PublisherSpec("pub-0", 100.0, ["dev-000"], 0, 0, 64, 1)
"""100 QoS 1 messages a second to one device."""


def _spec(tmp_path: Path, port: int) -> WorkerSpec:
    """A worker's spec whose broker (and devices' proxy) is 127.0.0.1:``port``, its logs in ``tmp_path``."""
    (tmp_path / "logs").mkdir()
    return WorkerSpec(
        device_port=port, broker_host="127.0.0.1", broker_port=port, logs=str(tmp_path / "logs"),
        state_dir=str(tmp_path / "state"), keepalive=30, end_sessions=False, harness_pid=0,
    )


def ends_well_before_close_timeout(runner: threading.Thread, since: float) -> None:
    """The publisher's run() (``runner``) ends well before CLOSE_TIMEOUT from ``since``, which it sat out before."""
    runner.join(CLOSE_TIMEOUT + WAIT)
    assert not runner.is_alive()
    assert time.monotonic() - since < CLOSE_TIMEOUT - 2


def test_a_publisher_stops_waiting_for_pubacks_once_its_connection_is_lost(broker: Broker, tmp_path: Path) -> None:
    """Stopped with messages in flight (the link stalled: no PUBACK comes), then its connection cut: run() ends
    at once. Before, the wait re-checked is_connected(), which paho 2.2 still reports True while it calls
    on_disconnect, and slept out CLOSE_TIMEOUT."""
    proxy = FaultProxy("127.0.0.1", broker.port)
    port = proxy.start()
    publisher = _WatchedPublisher(_spec(tmp_path, port), PUBLISHER)
    stop = threading.Event()
    runner = threading.Thread(target=publisher.run, args=(stop,), name="pub-0")
    runner.start()
    try:
        with publisher.published:  # a PUBACK came: connected and publishing
            assert publisher.published.wait_for(lambda: publisher.acks > 0, WAIT), "no PUBACK"
        assert proxy.stall() == 1
        with publisher.published:  # at most one or two sent before the stall can still be acknowledged
            assert publisher.published.wait_for(lambda: len(publisher.inflight) >= 5, WAIT)
        stop.set()
        with publisher.looks.seen:  # run() waits for the last PUBACKs
            assert publisher.looks.seen.wait_for(lambda: publisher.looks.looks > 0, WAIT)
        assert proxy.cut() == 1
        ends_well_before_close_timeout(runner, time.monotonic())
    finally:
        stop.set()
        proxy.stop()
        runner.join(CLOSE_TIMEOUT + WAIT)


def test_a_publisher_stopped_while_it_waits_for_its_connack_ends_at_once(tmp_path: Path) -> None:
    """Stopped (SIGTERM) while it waits for the CONNACK of a broker that takes the connection but never answers
    it (a wedged one: its kernel still accepts): run() ends at once. Before, it sat out CLOSE_TIMEOUT there, and
    a fleet's Ctrl-C with a wedged broker waited that long for the publisher's process before stopping the
    broker."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        silent.settimeout(WAIT)
        publisher = Publisher(_spec(tmp_path, silent.getsockname()[1]), PUBLISHER)
        stop = threading.Event()
        runner = threading.Thread(target=publisher.run, args=(stop,), name="pub-0")
        runner.start()
        try:
            connection, _ = silent.accept()  # it connected: past its check of stop, it waits for the CONNACK
            with connection:
                stop.set()
                ends_well_before_close_timeout(runner, time.monotonic())
        finally:
            stop.set()
            runner.join(CLOSE_TIMEOUT + WAIT)
