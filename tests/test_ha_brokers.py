"""Primary-backup replication between real broker processes: a backup refuses clients, the
primary's acknowledged publishes are on the backup, and after the primary's SIGKILL the
backup (promoted by the operator, or by the etcd lease) serves the same sessions."""

from __future__ import annotations

import asyncio
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from _rawmqtt import ClientProcess, Login, PubSpec, publisher_main  # bench/ is put on the path just above

from amqtt_durable.errors import DurableError
from amqtt_durable.process import HOST, free_port
from amqtt_durable.replication.framing import Frame
from amqtt_durable.replication.tool import ask
from amqtt_durable.store import MSG_ID_MARK_KEY, MSG_ID_RESERVE, encode_u64, open_store
from conftest import WAIT, Broker, Client, connack_code, payloads, run_cli
from durable_client import DurableClient, Event
from durable_pipeline.errors import SourceError
from durable_pipeline.source import IdRange, Options, read_range

pytestmark = pytest.mark.timeout(180)

SERVING, BACKUP = 0, 3
"""CONNACK return codes: accepted; server unavailable (a backup, or a demoted primary)."""
FAILOVER_WAIT = 30.0
HA_TIMING = {"lease_ttl": 2, "loop_wait": 0.3, "demote_margin": 0.5}
SQUAT_SECONDS, SQUAT_PAUSE = 20.0, 0.0002
"""PortSquatter's bounds: SQUAT_SECONDS / SQUAT_PAUSE tries a port (so at least SQUAT_SECONDS), a
pause of SQUAT_PAUSE on its stop event between two."""


def node(make: Callable[..., Broker], name: str, plugin: dict[str, Any] | None = None, **replication: Any) -> Broker:
    """A broker with replication settings (not started): its replication address is its own."""
    settings = {"name": name, "listen": f"{HOST}:{free_port()}", **replication}
    return make(start=False, name=name, replication=settings, **(plugin or {}))


def address(broker: Broker) -> str:
    return str(broker.settings["replication"]["listen"])


def start(broker: Broker, code: int) -> Broker:
    """Start and wait until a CONNECT gets ``code`` (a backup answers 3 once it is up)."""
    broker.spawn()
    assert broker.wait_until(lambda: connack_code(broker.port) == code, WAIT), broker.log()
    return broker


def status(broker: Broker) -> dict[str, Any] | None:
    try:
        return asyncio.run(ask(address(broker), Frame.STATUS))
    except DurableError:
        return None


def wait_status(broker: Broker, check: Callable[[dict[str, Any]], bool], timeout: float = WAIT) -> dict[str, Any]:
    seen: list[dict[str, Any]] = []

    def ok() -> bool:
        current = status(broker)
        if current is not None:
            seen.append(current)
        return current is not None and check(current)

    assert broker.wait_until(ok, timeout), f"last status {seen[-1:]}\n{broker.log()}"
    return seen[-1]


def ha_pair(
    broker_factory: Callable[..., Broker], etcd: Any, plugin: dict[str, Any] | None = None, **settings: Any
) -> tuple[Broker, Broker]:
    """Two nodes with etcd as coordinator, HA_TIMING unless ``settings`` (their replication settings)
    say otherwise, ``plugin`` their plugin settings: a, started first, is the primary (CONNACK 0);
    b its backup (CONNACK 3), returned once it says it is caught up."""
    ha = {"coordinator": [etcd.url], **HA_TIMING, **settings}
    first = start(node(broker_factory, "a", plugin, **ha), SERVING)
    second = start(node(broker_factory, "b", plugin, **ha), BACKUP)
    wait_status(second, lambda s: s["caught_up"])
    return first, second


def static_pair(
    broker_factory: Callable[..., Broker],
    plugin: dict[str, Any] | None = None,
    *,
    backup: dict[str, Any] | None = None,
    **primary: Any,
) -> tuple[Broker, Broker]:
    """Two nodes without a coordinator: p, role primary (replication settings ``primary``, plugin
    settings ``plugin``), and b, role backup following p (replication settings ``backup``), each
    started (CONNACK 0 and 3); returned once p lists b in sync and b says it is caught up."""
    first = start(node(broker_factory, "p", plugin, role="primary", **primary), SERVING)
    second = start(node(broker_factory, "b", role="backup", primary=address(first), **(backup or {})), BACKUP)
    wait_status(first, lambda s: [row["state"] for row in s["backups"]] == ["in_sync"])
    wait_status(second, lambda s: s["caught_up"])
    return first, second


def queue_durable_messages(primary: Broker, clients: Callable[..., Client], count: int) -> None:
    """A durable subscriber leaves; ``count`` QoS 1 publishes are acknowledged for it."""
    subscriber = clients(primary.port, "device")
    subscriber.subscribe("t/#", 1)
    subscriber.disconnect()
    publisher = clients(primary.port, "publisher", clean_session=True)
    publisher.publish("t/a", payloads(count))
    publisher.disconnect()


def assert_queue_served(broker: Broker, clients: Callable[..., Client], count: int) -> None:
    subscriber = clients(broker.port, "device")
    assert subscriber.session_present is True
    received = subscriber.wait_messages(count)
    assert [m.payload for m in received] == payloads(count)


def test_a_backup_refuses_clients_holds_every_acknowledged_publish_and_is_promoted_by_the_operator(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    primary, backup = static_pair(broker_factory)
    queue_durable_messages(primary, clients, 300)

    shown = run_cli("inspect", "--replication", address(primary))
    assert shown.returncode == 0, shown.stderr
    assert "p: primary" in shown.stdout and "sync replication" in shown.stdout
    assert "backup b" in shown.stdout and "in_sync" in shown.stdout
    refused = run_cli("promote", address(primary))
    assert refused.returncode == 1 and "it is the primary already" in refused.stderr
    assert connack_code(backup.port) == BACKUP

    primary.kill()  # sync mode: every PUBACK above waited for the backup's fsync
    promoted = run_cli("promote", address(backup))
    assert promoted.returncode == 0, promoted.stderr
    assert backup.wait_until(lambda: connack_code(backup.port) == SERVING, WAIT), backup.log()
    assert_queue_served(backup, clients, 300)
    assert wait_status(backup, lambda s: s["role"] == "primary")["batch"] > 0
    backup.stop()
    marks = [dict(store_rows(broker)).get(MSG_ID_MARK_KEY) for broker in (primary, backup)]
    assert marks == [encode_u64(MSG_ID_RESERVE)] * 2, "the message id mark reached the backup in its batch"


def refused_at_once(replication_address: str, attack: bytes) -> bytes:
    """Send ``attack`` to a node's replication address; what it answers before it closes."""
    host, port = replication_address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=WAIT) as sock:
        sock.sendall(attack)
        answered = b""
        while chunk := sock.recv(4096):  # bounded by the socket timeout; the node closes at once
            answered += chunk
    return answered


def test_strangers_on_the_replication_address_are_cut_off_and_replication_goes_on(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    primary, backup = static_pair(broker_factory)
    huge_hello = bytes([Frame.HELLO]) + (200 * 1024 * 1024).to_bytes(4, "big")  # a 200 MiB frame announced
    garbage = bytes(range(256))
    for target in (primary, backup):
        for attack in (huge_hello, huge_hello, garbage):
            assert refused_at_once(address(target), attack) == b""

    queue_durable_messages(primary, clients, 200)  # sync mode: each PUBACK waited for the backup
    shown = wait_status(primary, lambda s: bool(s["backups"]) and s["backups"][0]["state"] == "in_sync")
    assert shown["backups"][0]["name"] == "b"
    assert "larger than 65536" in primary.log() and "larger than 65536" in backup.log()
    primary.kill()
    assert run_cli("promote", address(backup)).returncode == 0
    assert backup.wait_until(lambda: connack_code(backup.port) == SERVING, WAIT), backup.log()
    assert_queue_served(backup, clients, 200)


class PortSquatter:
    """Another process's attempt to take ports: one thread per port binds it and listens, with
    SO_REUSEADDR as a real server would (the node's closed connections in TIME_WAIT on the port do
    not stop it, only a socket listening there does), as soon as it is free. Between two tries it
    waits on its stop event (SQUAT_PAUSE); it gives up after SQUAT_SECONDS / SQUAT_PAUSE tries."""

    def __init__(self, ports: list[int]) -> None:
        self.taken: list[socket.socket] = []
        self.gave_up: list[int] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._squat, args=(port,), daemon=True) for port in ports]
        for thread in self.threads:
            thread.start()

    def _squat(self, port: int) -> None:
        for _ in range(int(SQUAT_SECONDS / SQUAT_PAUSE)):  # at most that many tries, whatever the pauses last
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((HOST, port))
                sock.listen()
            except OSError:
                sock.close()
            else:
                self.taken.append(sock)
                return
            if self.stop.wait(SQUAT_PAUSE):
                return
        self.gave_up.append(port)

    def close(self) -> list[int]:
        """Stop; the ports it got."""
        self.stop.set()
        for thread in self.threads:
            thread.join(WAIT)
        ports = [sock.getsockname()[1] for sock in self.taken]
        for sock in self.taken:
            sock.close()
        return ports


def test_a_process_grabbing_the_backup_s_ports_during_promote_gets_none_and_the_tools_keep_answering(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """The attack on a promotion: another process takes the backup's MQTT port or its replication
    address the moment either is free. Neither ever is: the MQTT listener is the backup's from
    its start, and the replication address stays bound across the promotion (before, the
    promotion closed it and bound it again; a port taken in between left the node without its
    tools: this test failed in 4 of 8 runs on main at 2250aa5; tests/unit/test_replication_address.py forces
    that moment)."""
    primary, backup = static_pair(broker_factory)
    queue_durable_messages(primary, clients, 50)
    primary.kill()
    squatter = PortSquatter([backup.port, int(address(backup).rsplit(":", 1)[1])])
    try:
        promoted = run_cli("promote", address(backup))
        assert promoted.returncode == 0, promoted.stderr
        wait_status(backup, lambda s: s["role"] == "primary")
    finally:
        taken = squatter.close()
    assert taken == [], f"another process took port(s) {taken} of the backup during its promotion"
    assert squatter.gave_up == [], "the squatter stopped trying before the promotion ended"
    shown = run_cli("inspect", "--replication", address(backup))
    assert shown.returncode == 0 and "b: primary" in shown.stdout, shown.stderr
    assert_queue_served(backup, clients, 50)


def test_promote_names_what_is_wrong() -> None:
    unreachable = run_cli("promote", f"{HOST}:{free_port()}")
    assert unreachable.returncode == 1
    assert "no answer to PROMOTE" in unreachable.stderr and "replication.listen" in unreachable.stderr
    for bad in ("no-port", "::1", "127.0.0.1:99999"):  # a usage error (exit 2); 99999 was a traceback
        malformed = run_cli("promote", bad)
        assert malformed.returncode == 2, malformed.stderr
        assert "usage:" in malformed.stderr and "Traceback" not in malformed.stderr
        assert ("brackets" if bad == "::1" else "expected host:port") in malformed.stderr
    malformed = run_cli("inspect", "--replication", "2001:db8::10")
    assert malformed.returncode == 2 and "brackets" in malformed.stderr


@pytest.mark.slow
def test_the_etcd_lease_fails_over_to_the_backup_and_the_old_primary_rejoins(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], etcd: Any
) -> None:
    first, second = ha_pair(broker_factory, etcd)
    queue_durable_messages(first, clients, 200)

    first.kill()
    assert second.wait_until(lambda: connack_code(second.port) == SERVING, FAILOVER_WAIT), second.log()
    assert_queue_served(second, clients, 200)

    start(first, BACKUP)  # the old primary comes back as a backup of the new one and catches up
    caught_up = wait_status(first, lambda s: s["caught_up"])
    assert caught_up["role"] == "backup"
    level = wait_status(second, lambda s: [b["name"] for b in s["backups"] if b["lag_batches"] == 0] == ["a"])
    assert level["role"] == "primary"


class HeldConsumer:
    """A CPL-2 SDK client whose listener stops at chosen counts until released: the broker is
    killed while the events after it are sent but not acknowledged."""

    def __init__(self, state_dir: Path, first: Broker, failover: list[Broker]) -> None:
        self.processed: list[bytes] = []
        self.hold_at: set[int] = set()
        self.holding = threading.Event()
        self.release = threading.Event()
        self.changed = threading.Condition()
        self.client = DurableClient(
            "device", HOST, first.port, failover=[(HOST, b.port) for b in failover],
            persistence="disk", state_dir=state_dir, reconnect_max_delay=0.5,
        )  # fmt: skip
        self.client.subscribe("t/#", qos=1, listener=self.on_event)
        self.client.connect()
        self.client.ready_for_events()

    def on_event(self, event: Event) -> None:
        if len(self.processed) in self.hold_at:
            self.hold_at.discard(len(self.processed))
            self.holding.set()
            assert self.release.wait(WAIT)
            self.release.clear()
        with self.changed:
            self.processed.append(event.payload)
            self.changed.notify_all()

    def wait_count(self, count: int) -> list[bytes]:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.processed) >= count, FAILOVER_WAIT), len(self.processed)
            return list(self.processed)


def publish_to(broker: Broker, clients: Callable[..., Client], messages: list[bytes]) -> None:
    publisher = clients(broker.port, f"publisher-{broker.port}", clean_session=True)
    publisher.publish("t/a", messages)
    publisher.disconnect()


@pytest.mark.slow
def test_a_cpl2_sdk_client_is_exactly_once_and_in_order_across_two_failovers(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], etcd: Any, tmp_path: Path
) -> None:
    first, second = ha_pair(broker_factory, etcd)
    consumer = HeldConsumer(tmp_path / "state", first, [second])
    batches = [payloads(150, "one-"), payloads(150, "two-")]
    try:
        for number, (primary, backup) in enumerate([(first, second), (second, first)]):
            consumer.hold_at.add(number * 150 + 50)
            publish_to(primary, clients, batches[number])
            assert consumer.holding.wait(WAIT)
            consumer.holding.clear()
            primary.kill()  # events 51.. of this batch are sent, not acknowledged
            consumer.release.set()
            assert backup.wait_until(lambda b=backup: connack_code(b.port) == SERVING, FAILOVER_WAIT), backup.log()
            assert consumer.wait_count((number + 1) * 150)[-1] == batches[number][-1]
            start(primary, BACKUP)
            wait_status(primary, lambda s: s["caught_up"])
    finally:
        consumer.client.close()
    assert consumer.processed == batches[0] + batches[1]


class BurstPublisher:
    """Publishes QoS 1 without waiting; remembers which payloads got their PUBACK and signals once
    ``kill_after`` of them have: the primary dies right after a PUBACK, in mid-burst."""

    def __init__(self, port: int, messages: list[bytes], kill_after: int) -> None:
        self.acked: set[bytes] = set()
        self.kill_now = threading.Event()
        self.kill_after = kill_after
        self._by_mid: dict[int, bytes] = {}
        self._lock = threading.Lock()
        self.paho = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="burst", clean_session=True)
        self.paho.max_inflight_messages_set(50)
        self.paho.on_publish = self._on_publish
        self.paho.connect(HOST, port)
        for payload in messages:  # queued before the network loop runs: no PUBACK can come first
            self._by_mid[self.paho.publish("t/a", payload, qos=1).mid] = payload
        self.paho.loop_start()

    def _on_publish(self, _client: Any, _userdata: Any, mid: int, _reason: Any, _props: Any) -> None:
        with self._lock:
            self.acked.add(self._by_mid[mid])
            if len(self.acked) >= self.kill_after:
                self.kill_now.set()

    def stop(self) -> set[bytes]:
        self.paho.loop_stop()
        with self._lock:
            return set(self.acked)


def assert_every_acknowledged_publish_arrives_in_order(
    broker: Broker, clients: Callable[..., Client], published: list[bytes], acked: set[bytes]
) -> None:
    subscriber = clients(broker.port, "device")
    assert subscriber.session_present is True
    subscriber.wait_for(lambda got: acked <= {m.payload for m in got})
    received = [m.payload for m in subscriber.messages]
    missing = acked - set(received)
    assert not missing, f"{len(missing)} acknowledged publishes lost, e.g. {sorted(missing)[:3]}"
    order = {payload: index for index, payload in enumerate(published)}
    assert [order[p] for p in received] == sorted(order[p] for p in set(received)), "out of order or duplicated"


@pytest.mark.slow
@pytest.mark.parametrize("kill_after", [1, 700, 1900])
def test_sync_mode_loses_no_acknowledged_publish_when_the_primary_dies_mid_burst(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], etcd: Any, kill_after: int
) -> None:
    first, second = ha_pair(broker_factory, etcd)
    subscriber = clients(first.port, "device")
    subscriber.subscribe("t/#", 1)
    subscriber.disconnect()
    published = payloads(2000, "burst-")
    burst = BurstPublisher(first.port, published, kill_after)
    assert burst.kill_now.wait(WAIT)
    first.kill()
    acked = burst.stop()
    assert len(acked) >= kill_after
    assert second.wait_until(lambda: connack_code(second.port) == SERVING, FAILOVER_WAIT), second.log()
    assert_every_acknowledged_publish_arrives_in_order(second, clients, published, acked)


@pytest.mark.slow
def test_the_primary_dies_during_a_replay_and_the_new_primary_replays_the_rest(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], etcd: Any
) -> None:
    first, second = ha_pair(broker_factory, etcd)
    queue_durable_messages(first, clients, 3000)
    reader = clients(first.port, "device")
    assert reader.wait_for(lambda got: len(got) >= 500)
    first.kill()  # mid-replay: acks of what was delivered may not have reached the backup
    reader.wait_disconnected()
    assert second.wait_until(lambda: connack_code(second.port) == SERVING, FAILOVER_WAIT), second.log()
    resumed = clients(second.port, "device")
    assert resumed.session_present is True
    assert resumed.wait_for(lambda got: bool(got) and got[-1].payload == payloads(3000)[-1])
    delivered = [m.payload for m in reader.messages] + [m.payload for m in resumed.messages]
    assert set(delivered) == set(payloads(3000))
    first_resent = resumed.messages[0].payload
    assert payloads(3000).index(first_resent) <= len(reader.messages), "a gap between the two primaries"
    assert [m.payload for m in resumed.messages] == payloads(3000)[payloads(3000).index(first_resent):]


@pytest.mark.slow
def test_a_backup_still_catching_up_is_not_promoted_and_loses_nothing_acknowledged(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], etcd: Any
) -> None:
    # Small snapshot chunks: the new backup's snapshot of 20,000 queued messages takes a while.
    first, second = ha_pair(broker_factory, etcd, snapshot_chunk_bytes=1024)
    queue_durable_messages(first, clients, 20_000)
    third = start(node(broker_factory, "c", coordinator=[etcd.url], **HA_TIMING), BACKUP)
    wait_status(first, lambda s: any(b["name"] == "c" and b["state"] == "snapshot" for b in s["backups"]))
    published = payloads(1000, "more-")
    burst = BurstPublisher(first.port, published, 300)
    assert burst.kill_now.wait(WAIT)
    first.kill()  # while c catches up from empty, publishes going on
    acked = burst.stop()
    assert second.wait_until(lambda: connack_code(second.port) == SERVING, FAILOVER_WAIT), second.log()
    assert connack_code(third.port) == BACKUP
    everything = payloads(20_000) + published
    assert_every_acknowledged_publish_arrives_in_order(second, clients, everything, set(payloads(20_000)) | acked)
    assert wait_status(third, lambda s: s["caught_up"])["primary"] == address(second)


@pytest.mark.slow
def test_a_stream_reader_reads_on_across_a_failover_with_the_same_ids(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], etcd: Any
) -> None:
    first, second = ha_pair(broker_factory, etcd, {"streams": [{"filter": "telemetry/#"}]})
    events = [f"event-{i}".encode() for i in range(1, 201)]
    publisher = clients(first.port, "stream-publisher", clean_session=True)
    publisher.publish("telemetry/a", events)
    opts = Options.parse({"port": str(first.port), "filter": "telemetry/#", "window": "10",
                          "failover": f"{HOST}:{second.port}", "timeout": str(FAILOVER_WAIT)})  # fmt: skip
    batches = read_range(opts, IdRange("telemetry/a", 0, 200))
    rows = next(batches).to_pylist()
    assert len(rows) <= 10
    first.kill()
    for batch in batches:
        rows.extend(batch.to_pylist())
    assert [row["id"] for row in rows] == list(range(1, 201))
    assert [row["payload"] for row in rows] == events


def test_the_stream_source_names_a_bad_failover_address() -> None:
    assert Options.parse({"filter": "t/#", "failover": "h1:1883, h2:1884"}).failover == (("h1", 1883), ("h2", 1884))
    with pytest.raises(SourceError, match="option failover takes host:port entries"):
        Options.parse({"filter": "t/#", "failover": "h1:1883,h2"})


@pytest.mark.slow
def test_async_mode_can_lose_only_a_tail_of_acknowledged_publishes_never_a_hole(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], etcd: Any
) -> None:
    first, second = ha_pair(broker_factory, etcd, mode="async")
    subscriber = clients(first.port, "device")
    subscriber.subscribe("t/#", 1)
    subscriber.disconnect()
    published = payloads(3000, "async-")
    burst = BurstPublisher(first.port, published, 1500)
    assert burst.kill_now.wait(WAIT)
    first.kill()
    acked = burst.stop()
    assert second.wait_until(lambda: connack_code(second.port) == SERVING, FAILOVER_WAIT), second.log()
    resumed = clients(second.port, "device")
    assert resumed.session_present is True
    newest = max(published.index(p) for p in acked)
    resumed.wait_for(lambda got: bool(got) and published.index(got[-1].payload) >= newest, timeout=5.0)
    received = [m.payload for m in resumed.messages]
    assert received == published[: len(received)], "batches apply in order: what survives is a prefix"
    lost = acked - set(received)
    print(f"async failover: {len(lost)} of {len(acked)} acknowledged publishes lost")  # docs/replication.md
    assert len(lost) < len(acked)


def test_sys_topics_show_the_role_the_backups_and_their_lag(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    primary, _ = static_pair(broker_factory, {"metrics_interval": 0.2})
    monitor = clients(primary.port, "monitor", clean_session=True)
    monitor.subscribe("$SYS/broker/durable/replication/#", 0)
    wanted = {
        "$SYS/broker/durable/replication/role": b"primary",
        "$SYS/broker/durable/replication/backups": b"1",
        "$SYS/broker/durable/replication/backups_in_sync": b"1",
        "$SYS/broker/durable/replication/backup/b/state": b"in_sync",
        "$SYS/broker/durable/replication/backup/b/lag_batches": b"0",
    }
    assert monitor.wait_for(lambda got: wanted.items() <= {m.topic: m.payload for m in got}.items()), [
        (m.topic, m.payload) for m in monitor.messages
    ]


@pytest.mark.slow
def test_a_new_backup_catches_up_200000_queued_messages_while_publishes_go_on(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    primary = start(node(broker_factory, "p", role="primary"), SERVING)
    subscriber = clients(primary.port, "device")
    subscriber.subscribe("t/#", 1)
    subscriber.disconnect()
    backlog = range(200_000)
    spec = PubSpec(primary.port, "loader", Login(), "t/a", b"load", len(backlog), inflight=500, timeout=120.0)
    with ClientProcess("loader", publisher_main, spec) as loader:  # the benchmarks' raw publisher: fast
        loader.expect("ready", WAIT)
        loader.send("go")
        assert loader.expect("result", 150.0).acked == len(backlog)
    backup = start(node(broker_factory, "b", role="backup", primary=address(primary)), BACKUP)
    more = payloads(2000, "live-")
    ongoing = BurstPublisher(primary.port, more, len(more))  # while the snapshot streams
    caught_up = wait_status(backup, lambda s: s["caught_up"], timeout=120)
    assert ongoing.kill_now.wait(WAIT)
    ongoing.stop()
    level = wait_status(primary, lambda s: [(b["name"], b["state"], b["lag_batches"]) for b in s["backups"]]
                        == [("b", "in_sync", 0)])  # fmt: skip
    assert caught_up["batch"] > 0 and level["batch"] >= caught_up["batch"]
    primary.kill()
    backup.kill()
    assert store_rows(primary) == store_rows(backup), "the backup's store is the primary's, key for key"


def store_rows(broker: Broker) -> list[tuple[bytes, bytes]]:
    db = open_store(broker.store, create=False)
    try:
        return list(db.iterator())
    finally:
        db.close()
