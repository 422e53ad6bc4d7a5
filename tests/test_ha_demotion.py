"""Role changes of real broker processes (a real etcd, each broker reaching it through its own
TCP relay): what a demoted primary must not do, what a re-promoted one must not remember, a
clean stop of a primary, a promotion that fails, and a refused CONNECT whose client is gone.

A primary is demoted here by blackholing its relay to etcd (its lease ends); a broker is
paused with SIGSTOP (and always continued) to hold its replication acks."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_ha_brokers import (
    BACKUP,
    FAILOVER_WAIT,
    HA_TIMING,
    SERVING,
    address,
    ha_pair,
    node,
    start,
    static_pair,
    status,
    wait_status,
)
from test_ha_partition import in_sync_set
from test_ha_partition import relays as relays  # noqa: PLC0414  (the fixture, by its own name)
from test_qos2_inbound import PUBREC, complete, expect_ack, publish
from test_scale import RawClient

from amqtt_durable.process import HOST, BrokerProcess, ChildExitedError, EtcdProcess, free_port
from amqtt_durable.store import open_store
from conftest import WAIT, Broker, Client, connack_code, mqtt_packet, mqtt_string, payloads, run_cli
from durable_fleet.proxy import TcpRelay

pytestmark = pytest.mark.timeout(180)


def relayed_pair(
    broker_factory: Callable[..., Broker], etcd: EtcdProcess, relays: Callable[[], TcpRelay], **settings: Any
) -> tuple[Broker, TcpRelay, Broker, TcpRelay]:
    """a (primary) and b (backup, in the published synchronous set), each with its own relay."""
    relay_a, relay_b = relays(), relays()
    first = node(broker_factory, "a", coordinator=[f"http://{relay_a.address}"], **HA_TIMING, **settings)
    second = node(broker_factory, "b", coordinator=[f"http://{relay_b.address}"], **HA_TIMING, **settings)
    return first, relay_a, second, relay_b


def started_pair(first: Broker, second: Broker, etcd: EtcdProcess) -> None:
    start(first, SERVING)
    start(second, BACKUP)
    wait_status(first, lambda s: [b["state"] for b in s["backups"]] == ["in_sync"])
    assert first.wait_until(lambda: in_sync_set(etcd, "b"), WAIT), first.log()


class AckedPublisher:
    """A clean paho publisher that remembers which publishes got their PUBACK (no lock is held
    across paho's publish: paho calls on_publish under its own lock)."""

    def __init__(self, port: int) -> None:
        self.client = Client(port, "publisher", clean_session=True)
        self.client.paho.on_publish = self._on_publish
        self.acked_mids: set[int] = set()
        self.sent: dict[int, bytes] = {}

    def _on_publish(self, client: Any, userdata: Any, mid: int, reason: Any, props: Any) -> None:
        self.acked_mids.add(mid)

    def publish(self, payload: bytes) -> None:
        self.sent[self.client.paho.publish("t/a", payload, qos=1).mid] = payload

    def acked(self) -> set[bytes]:
        return {self.sent[mid] for mid in set(self.acked_mids)}


def durable_subscriber(broker: Broker, clients: Callable[..., Client]) -> None:
    device = clients(broker.port, "device")
    device.subscribe("t/#", 1)
    device.disconnect()


@pytest.mark.slow
def test_a_commit_held_across_the_lease_deadline_is_not_acknowledged_and_the_clients_are_closed(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], etcd: EtcdProcess,
    relays: Callable[[], TcpRelay],
) -> None:
    """Finding 1: the backup stops acknowledging (paused), so the primary's sync commits wait;
    then the primary's lease ends (cut off from etcd). Its waiting publishes must never be
    acknowledged, and every client connection must be closed by the demotion."""
    first, relay_a, second, _ = relayed_pair(broker_factory, etcd, relays, ack_timeout=60)
    started_pair(first, second, etcd)
    durable_subscriber(first, clients)
    idle = clients(first.port, "idle", clean_session=True)
    publisher = AckedPublisher(first.port)
    before = payloads(20, "before-")
    for payload in before:
        publisher.publish(payload)
    assert publisher.client.wait_for(lambda _: len(publisher.acked_mids) == 20)
    level = wait_status(first, lambda s: s["backups"][0]["lag_batches"] == 0)["batch"]

    with second.paused():
        for payload in payloads(5, "held-"):
            publisher.publish(payload)
        wait_status(first, lambda s: s["batch"] > level and s["backups"][0]["lag_batches"] > 0)  # held
        relay_a.cut()
        assert publisher.client.wait_disconnected(FAILOVER_WAIT), first.log()
        assert idle.wait_disconnected(WAIT), "a client of the demoted primary stayed connected"
        acked = publisher.acked()
        assert acked == set(before), f"a publish held for the backup was acknowledged: {sorted(acked - set(before))}"
        assert connack_code(first.port) == BACKUP

    assert second.wait_until(lambda: connack_code(second.port) == SERVING, FAILOVER_WAIT), second.log()
    resumed = clients(second.port, "device")
    assert resumed.session_present is True
    assert resumed.wait_for(lambda got: acked <= {m.payload for m in got}), second.log()


LATE_AUTH_PLUGIN = '''
import asyncio
import logging

from amqtt.plugins.base import BaseAuthPlugin

log = logging.getLogger("late_auth")


class LateAuth(BaseAuthPlugin):
    """Test plugin: the CONNECT of user "late" is authenticated only once this broker stopped
    serving, so its CONNACK is due after the demotion although it was read before."""

    async def authenticate(self, *, session=None):
        if session is None or session.username != "late":
            return True
        durable = next(p for p in self.context._broker_instance.plugins_manager._plugins if hasattr(p, "engine"))
        log.warning("late_auth: holding the CONNECT of %s", session.client_id)
        async with asyncio.timeout(60):
            while durable.engine.serving:
                await asyncio.sleep(0.02)
        return True
'''


def serving_since(broker: Broker) -> float:
    """Ask for a CONNACK until the broker accepts one; the monotonic time just before that ask."""
    deadline = time.monotonic() + FAILOVER_WAIT
    while time.monotonic() < deadline:
        asked = time.monotonic()
        if connack_code(broker.port) == SERVING:
            return asked
        threading.Event().wait(0.02)  # pace the probes (not a synchronisation)
    raise AssertionError(f"never accepted a client\n{broker.log()}")


def late_connect(client_id: str) -> bytes:
    body = mqtt_string("MQTT") + bytes((4, 0x82)) + struct.pack(">H", 60) + mqtt_string(client_id)
    return mqtt_packet(0x10, body + mqtt_string("late"))


@pytest.mark.slow
def test_a_demoted_primary_ends_websocket_clients_and_refuses_a_connect_read_before_the_demotion(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], etcd: EtcdProcess,
    relays: Callable[[], TcpRelay], tmp_path: Path,
) -> None:
    """Finding 4: amqtt's websocket connections and a connection whose CONNECT passed the check made
    when it was read must not be served (CONNACK 0, PUBACK) once the broker was demoted."""
    (tmp_path / "late_auth.py").write_text(LATE_AUTH_PLUGIN)
    first, relay_a, second, _ = relayed_pair(broker_factory, etcd, relays)
    first.ws_port = free_port()
    first.pythonpath.append(str(tmp_path))
    first.extra_plugins["late_auth.LateAuth"] = {}
    started_pair(first, second, etcd)
    ws_client = clients(first.ws_port, "ws-pub", clean_session=True, transport="websockets")
    ws_client.publish("t/a", payloads(10, "ws-"))
    ws_closed: list[float] = []
    on_disconnect = ws_client.paho.on_disconnect
    ws_client.paho.on_disconnect = lambda *args: (ws_closed.append(time.monotonic()), on_disconnect(*args))
    late = socket.create_connection((HOST, first.port), timeout=FAILOVER_WAIT)
    try:
        late.sendall(late_connect("late-client"))
        assert first.wait_until(lambda: "late_auth: holding the CONNECT of late-client" in first.log(), WAIT)
        relay_a.cut()
        serving_from = serving_since(second)
        # The demotion ends every connection before the other broker can accept a client.
        assert ws_closed and ws_closed[0] < serving_from, "the websocket client of the demoted primary stayed"
        connack = late.recv(4)
        assert connack[:1] == b"\x20" and connack[3] == BACKUP, f"CONNACK {connack!r} from a demoted primary"
        with contextlib.suppress(OSError):  # refused: the broker closes the connection
            late.sendall(mqtt_packet(0x32, mqtt_string("t/a") + struct.pack(">H", 1) + b"late"))
            assert late.recv(4)[:1] != b"\x40", "PUBACK from a demoted primary"
    finally:
        late.close()


ANONYMOUS = "amqtt.plugins.authentication.AnonymousAuthPlugin"


def named_users_only(broker: Broker) -> None:
    """Refuse CONNECTs without a username. amqtt marks every session anonymous while anonymous
    logins are allowed, and drops an anonymous session as soon as it is disconnected: only
    named sessions outlive their connections in amqtt's memory."""
    Broker.write_config(broker)
    broker.config["plugins"][ANONYMOUS] = {"allow_anonymous": False}
    broker.write_config = lambda: BrokerProcess.write_config(broker)  # type: ignore[method-assign]


def connack_as_user(port: int) -> int | None:
    """connack_code with a username (an anonymous probe is refused here)."""
    body = mqtt_string("MQTT") + bytes((4, 0x82)) + struct.pack(">H", 10) + mqtt_string("prob")
    try:
        with socket.create_connection((HOST, port), timeout=1.0) as sock:
            sock.sendall(mqtt_packet(0x10, body + mqtt_string("probe")))
            reply = sock.recv(4)
            return reply[3] if reply[:1] == b"\x20" and len(reply) == 4 else None
    except OSError:
        return None


class NamedRawClient(RawClient):
    def connect_packet(self, keepalive: int = 60) -> bytes:
        flags = 0x80 | (0x02 if self.clean_session else 0x00)
        body = mqtt_string("MQTT") + bytes((4, flags)) + struct.pack(">H", keepalive) + mqtt_string(self.client_id)
        return mqtt_packet(0x10, body + mqtt_string("publisher"))


@pytest.mark.slow
def test_a_re_promoted_primary_stores_a_qos2_publish_reusing_a_packet_id_of_its_earlier_term(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], etcd: EtcdProcess,
    relays: Callable[[], TcpRelay],
) -> None:
    """Finding 2: a's amqtt Session of a durable publisher still holds, from a's first term, the
    QoS 2 packet id whose exchange b completed. After a is primary again, a new publish with
    that packet id must be stored, not answered with PUBREC from amqtt's stale record."""
    first, relay_a, second, relay_b = relayed_pair(broker_factory, etcd, relays)
    for broker, code in ((first, SERVING), (second, BACKUP)):
        named_users_only(broker)
        broker.spawn()
        assert broker.wait_until(lambda b=broker, c=code: connack_as_user(b.port) == c, WAIT), broker.log()
    wait_status(first, lambda s: [b["state"] for b in s["backups"]] == ["in_sync"])
    assert first.wait_until(lambda: in_sync_set(etcd, "b"), WAIT), first.log()
    device = clients(first.port, "device", username="device")
    device.subscribe("q2/#", 1)
    device.disconnect()

    pub = NamedRawClient(first.port, "q2-pub")
    pub.connect()
    publish(pub, b"one", 7)
    expect_ack(pub, PUBREC, 7)  # stored on a and b; the PUBREL goes to b after the failover
    relay_a.cut()  # a is demoted, b takes over
    assert second.wait_until(lambda: connack_as_user(second.port) == SERVING, FAILOVER_WAIT), second.log()
    pub.sock.close()
    pub = NamedRawClient(second.port, "q2-pub")
    assert pub.connect() is True
    complete(pub, 7)  # b forgets packet id 7: its exchange is over
    pub.sock.close()

    relay_a.heal()  # a rejoins as b's backup; then b is cut off and a is primary again
    wait_status(first, lambda s: s["role"] == "backup" and s["caught_up"], FAILOVER_WAIT)
    assert second.wait_until(lambda: in_sync_set(etcd, "a"), FAILOVER_WAIT), second.log()
    relay_b.cut()
    assert first.wait_until(lambda: connack_as_user(first.port) == SERVING, FAILOVER_WAIT), first.log()

    pub = NamedRawClient(first.port, "q2-pub")
    assert pub.connect() is True
    publish(pub, b"two", 7)  # packet id 7 is free again
    expect_ack(pub, PUBREC, 7)
    complete(pub, 7)
    pub.sock.close()
    device = clients(first.port, "device", username="device")
    assert device.session_present is True
    assert device.wait_for(lambda got: [m.payload for m in got] == [b"one", b"two"]), [
        m.payload for m in device.messages
    ]


@pytest.mark.slow
def test_a_clean_stop_of_a_primary_leaves_no_acknowledged_publish_unshipped(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """Finding 5: async mode acknowledges after the local write. The backup is paused, so about
    24 MiB of acknowledged batches wait in the primary; a clean stop (SIGTERM) must ship them
    before the replication end closes."""
    primary, backup = static_pair(broker_factory, mode="async", ack_timeout=60, backup={"ack_timeout": 60})
    durable_subscriber(primary, clients)
    big = [b"%06d" % n + b"x" * 16_378 for n in range(1500)]
    with backup.paused():
        clients(primary.port, "publisher", clean_session=True).publish("t/a", big)  # every PUBACK came
        primary.terminate()
        with contextlib.suppress(ChildExitedError):  # without the wait for the backups: gone at once
            primary.wait_until(lambda: "until the backups have batch" in primary.log(), WAIT)
    assert primary.wait_stopped(time.monotonic() + FAILOVER_WAIT), primary.log()
    promoted = run_cli("promote", address(backup))
    assert promoted.returncode == 0, promoted.stderr
    assert backup.wait_until(lambda: connack_code(backup.port) == SERVING, WAIT), backup.log()
    device = clients(backup.port, "device")
    assert device.wait_for(lambda got: len(got) >= len(big), FAILOVER_WAIT), f"{len(device.messages)} of {len(big)}"
    assert [m.payload for m in device.messages] == big


@pytest.mark.slow
def test_a_backup_whose_store_cannot_be_loaded_gives_the_lease_back_and_tries_again(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], etcd: EtcdProcess
) -> None:
    """Finding 7: the promotion's load fails (a damaged session record in the backup's store): the
    HA loop must go on (an ERROR naming the problem, the lease released, still a backup)."""
    first, second = ha_pair(broker_factory, etcd)
    durable_subscriber(first, clients)
    second.kill()
    db = open_store(second.store, create=False)
    db.put(b"sbroken-device", b"\xff not a session record")
    db.close()
    start(second, BACKUP)  # resumes from its position: the damaged record stays
    wait_status(first, lambda s: [b["state"] for b in s["backups"]] == ["in_sync"])
    assert first.wait_until(lambda: in_sync_set(etcd, "b"), WAIT), first.log()

    first.kill()
    failed = "replication HA b: the promotion failed"
    assert second.wait_until(lambda: second.log().count(failed) >= 2, FAILOVER_WAIT), second.log()
    line = next(line for line in second.log().splitlines() if failed in line)
    assert "ERROR" in line and "broken-device" in line, line
    assert connack_code(second.port) == BACKUP
    current = status(second)
    assert current is not None and current["role"] == "backup"


def test_a_refused_connect_whose_client_reset_the_connection_frees_its_slot(
    broker_factory: Callable[..., Broker]
) -> None:
    """Finding 8: a backup refusing CONNECTs (CONNACK 3) of clients that reset the connection must
    free each listener slot: with max_connections 1, one leaked slot blocks every later client."""
    primary = start(node(broker_factory, "p", role="primary"), SERVING)
    backup = node(broker_factory, "b", role="backup", primary=address(primary))
    Broker.write_config(backup)
    backup.config["listeners"]["default"]["max_connections"] = 1
    backup.write_config = lambda: BrokerProcess.write_config(backup)  # type: ignore[method-assign]
    start(backup, BACKUP)
    for n in range(5):
        sock = socket.create_connection((HOST, backup.port), timeout=WAIT)
        sock.sendall(late_connect(f"gone-{n}"))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # RST: the CONNACK 3 (or the read of the CONNECT) meets a reset connection
        assert backup.wait_until(lambda: connack_code(backup.port) == BACKUP, WAIT), backup.log()
    noisy = [line for line in backup.log().splitlines() if "WARNING" in line and "replication backup" in line]
    assert not noisy, f"amqtt's WARNING of a routine refusal: {noisy[:1]}"
