"""A primary partitioned from etcd (issue 12, point 4): two real broker processes, each reaching
a real etcd through its own TCP relay (durable_fleet.proxy.TcpRelay), and the primary's relay
blackholed. The primary must stop acknowledging and close its clients before the other broker
accepts a client, every publish it acknowledged must be on the new primary, and once healed the
old primary rejoins as a caught-up backup."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from test_ha_brokers import BACKUP, FAILOVER_WAIT, HA_TIMING, SERVING, node, start, wait_status

from amqtt_durable.process import HOST, EtcdProcess
from amqtt_durable.replication.config import ReplicationConfig
from amqtt_durable.replication.etcd import EtcdCoordinator
from conftest import WAIT, Broker, Client, connack_code
from durable_fleet.proxy import TcpRelay

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

PUBLISH_EVERY = 0.02
"""Seconds between two publishes to the partitioned primary (load, not synchronisation)."""


@pytest.fixture
def relays(etcd: EtcdProcess) -> Iterator[Callable[[], TcpRelay]]:
    made: list[TcpRelay] = []

    def make() -> TcpRelay:
        relay = TcpRelay(HOST, etcd.client_port)
        relay.start()
        made.append(relay)
        return relay

    yield make
    for relay in made:
        relay.stop()


def in_sync_set(etcd: EtcdProcess, name: str) -> bool:
    """The primary published ``name`` in its synchronous set: that backup may take over."""
    prefix = ReplicationConfig(coordinator=[etcd.url], name="test").prefix
    members = asyncio.run(EtcdCoordinator([etcd.url], prefix=prefix, ttl=2).sync_members())
    return members is not None and name in members


class TimedPublisher:
    """A clean paho publisher that records when each PUBACK and the connection's end arrived."""

    def __init__(self, port: int) -> None:
        self.client = Client(port, "publisher", clean_session=True)
        self.lock = threading.RLock()
        self.payloads: dict[int, bytes] = {}
        self._acked_mids: list[tuple[float, int]] = []
        self.closed_at: float | None = None
        self._on_disconnect_before = self.client.paho.on_disconnect
        self.client.paho.on_publish = self._on_publish
        self.client.paho.on_disconnect = self._on_disconnect
        self.sent = 0

    def _on_publish(self, client: Any, userdata: Any, mid: int, reason: Any, props: Any) -> None:
        # No lock here: paho calls this under its own lock, which publish() takes too.
        self._acked_mids.append((time.monotonic(), mid))

    @property
    def acked(self) -> list[tuple[float, bytes]]:
        """(when, payload) of each PUBACK, in arrival order."""
        with self.lock:
            return [(at, self.payloads[mid]) for at, mid in list(self._acked_mids)]

    def _on_disconnect(self, *args: Any) -> None:
        self.closed_at = self.closed_at or time.monotonic()
        if self._on_disconnect_before is not None:
            self._on_disconnect_before(*args)

    def publish_one(self) -> None:
        if self.closed_at is not None:
            return
        payload = b"p%d" % self.sent
        self.sent += 1
        with self.lock:  # on_publish may run before publish() returns: acked waits for the mid's payload
            info = self.client.paho.publish("t/a", payload, qos=1)
            self.payloads[info.mid] = payload


def test_a_primary_cut_off_from_etcd_stops_acknowledging_before_the_backup_takes_over_and_rejoins(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], etcd: EtcdProcess,
    relays: Callable[[], TcpRelay],
) -> None:
    relay_a, relay_b = relays(), relays()
    first = start(node(broker_factory, "a", coordinator=[f"http://{relay_a.address}"], **HA_TIMING), SERVING)
    second = start(node(broker_factory, "b", coordinator=[f"http://{relay_b.address}"], **HA_TIMING), BACKUP)
    wait_status(first, lambda s: [b["state"] for b in s["backups"]] == ["in_sync"])
    assert first.wait_until(lambda: in_sync_set(etcd, "b"), WAIT), first.log()

    device = clients(first.port, "device")
    device.subscribe("t/#", 1)
    device.disconnect()
    publisher = TimedPublisher(first.port)
    for _ in range(20):
        publisher.publish_one()
    assert publisher.client.wait_for(lambda _: len(publisher.acked) == 20), "no PUBACKs before the partition"

    pace = threading.Event()  # never set: its wait paces the load
    cut_at = time.monotonic()
    relay_a.cut()
    serving_from: float | None = None
    refused_until = cut_at
    deadline = cut_at + FAILOVER_WAIT
    while serving_from is None and time.monotonic() < deadline:
        publisher.publish_one()
        asked = time.monotonic()
        code = connack_code(second.port)
        if code == SERVING:
            serving_from = asked  # b accepted a client no earlier than this
        elif code == BACKUP:
            refused_until = time.monotonic()
        pace.wait(PUBLISH_EVERY)
    assert serving_from is not None, f"b never accepted a client\n{second.log()}"

    # a stopped acknowledging and closed its clients before b accepted one (and b refused until then)
    assert publisher.closed_at is not None, first.log()
    assert publisher.closed_at < serving_from
    assert all(at < serving_from for at, _ in publisher.acked)
    assert cut_at < refused_until <= serving_from  # b refused clients while a's lease could still live
    assert connack_code(first.port) == BACKUP  # a refuses clients from now on
    with publisher.lock:
        acked = [payload for _, payload in publisher.acked]

    # every publish a acknowledged is in the device's queue on b, in order
    resumed = clients(second.port, "device")
    assert resumed.session_present is True
    assert resumed.wait_for(lambda got: {m.payload for m in got} >= set(acked)), (len(acked), second.log())
    received = [m.payload for m in resumed.messages if m.payload in set(acked)]
    assert received[: len(acked)] == acked

    relay_a.heal()  # a rejoins as a backup of b and catches up
    rejoined = wait_status(first, lambda s: s["role"] == "backup" and s["caught_up"], FAILOVER_WAIT)
    assert rejoined["primary"] == second.settings["replication"]["listen"]
    wait_status(second, lambda s: s["role"] == "primary" and [b["name"] for b in s["backups"]
                                                              if b["state"] == "in_sync"] == ["a"])
    assert connack_code(first.port) == BACKUP and connack_code(second.port) == SERVING
