"""The fleet's HA parts without brokers: primary_kill and partition in the random schedule, the
script and the options (validated with the problem named), their driving against a stand-in pair,
the etcd relay's blackhole and the router that follows the primary (stand-in nodes on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import yaml

from amqtt_durable.cli import PLUGIN_PATH
from amqtt_durable.replication.framing import encode_frame, read_frame
from durable_fleet.cli import build_parser, options_from
from durable_fleet.errors import ScheduleError
from durable_fleet.ha import Node, PrimaryRouter
from durable_fleet.model import HA_FAULT_KINDS, Fault
from durable_fleet.proxy import TcpRelay
from durable_fleet.runner import FleetOptions, FleetRun
from durable_fleet.schedule import FIXED_DURATIONS, dump_schedule, load_schedule, random_schedule

pytestmark = pytest.mark.timeout(60)

HOST = "127.0.0.1"
DEVICES = [f"dev-{i:03d}" for i in range(10)]
BROKER_YAML = {"plugins": {PLUGIN_PATH: {"store": "unused"}}}


# ------------------------------------------------------------------ random schedule


def test_random_ha_faults_share_one_stratification_and_never_overlap() -> None:
    counts = {"drop": 3, "primary_kill": 3, "partition": 2}
    for seed in range(30):
        faults = random_schedule(seed, duration=200.0, devices=DEVICES, counts=counts, keepalive=4.0, ha=True)
        on_primary = sorted((f for f in faults if f.kind in HA_FAULT_KINDS), key=lambda f: f.at)
        assert [f.kind for f in on_primary].count("primary_kill") == 3
        assert [f.kind for f in on_primary].count("partition") == 2
        for fault in on_primary:
            low, high = FIXED_DURATIONS[fault.kind]
            assert fault.target is None and low <= fault.duration <= high
            assert fault.at >= 5.0 and fault.at + fault.duration <= 185.0
        for earlier, later in itertools.pairwise(on_primary):  # down time free after each
            assert earlier.at + 2 * earlier.duration <= later.at


def test_random_ha_faults_are_drawn_after_the_others_so_old_seeds_keep_their_schedules() -> None:
    counts = {"drop": 2, "stall": 1, "device_restart": 2}
    plain = random_schedule(4, duration=60.0, devices=DEVICES, counts=counts, keepalive=4.0)
    with_ha = random_schedule(4, duration=60.0, devices=DEVICES, counts={**counts, "partition": 1}, keepalive=4.0,
                              ha=True)
    assert [f for f in with_ha if f.kind != "partition"] == plain


@pytest.mark.parametrize(
    ("counts", "ha", "message"),
    [
        ({"primary_kill": 1}, False, "primary_kill needs a replicated pair: run with --ha"),
        ({"partition": 1}, False, "partition needs a replicated pair: run with --ha"),
        ({"broker_kill": 1}, True, "broker_kill is not available with --ha .* use primary_kill"),
        ({"quake": 1}, True, r"unknown fault kind\(s\) 'quake' \(valid with --ha: drop, stall, device_restart, "
                             r"primary_kill, partition, group_kill\)"),
        ({"quake": 1}, False, r"\(valid: drop, stall, broker_kill, device_restart\) \(with --ha also primary_kill"),
        ({"primary_kill": 2, "partition": 2}, True, r"too short for 4 primary_kill and partition faults"),
    ],
)
def test_random_schedule_names_what_does_not_fit_the_broker(counts: dict[str, int], ha: bool, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        random_schedule(1, duration=45.0, devices=DEVICES, counts=counts, keepalive=4.0, ha=ha)  # type: ignore[arg-type]


# ------------------------------------------------------------------ scripts

HA_SCRIPT = """\
faults:
  - {at: 25s, kind: partition, for: 4s}
  - {at: 10s, kind: primary_kill, for: 2s}
  - {at: 11s, kind: drop, device: all, for: 1s}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "faults.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_a_script_with_ha_faults_loads_and_round_trips(tmp_path: Path) -> None:
    faults = load_schedule(write(tmp_path, HA_SCRIPT), devices=DEVICES, duration=60.0, ha=True)
    assert faults == [Fault(10.0, "primary_kill", None, 2.0), Fault(11.0, "drop", "all", 1.0),
                      Fault(25.0, "partition", None, 4.0)]
    dump_schedule(faults, tmp_path / "again.yaml")
    assert load_schedule(tmp_path / "again.yaml", devices=DEVICES, duration=60.0, ha=True) == faults


@pytest.mark.parametrize(
    ("fault", "ha", "message"),
    [
        ("{at: 1s, kind: primary_kill, for: 1s}", False,
         "fault 1: kind: primary_kill needs a replicated pair: run with --ha"),
        ("{at: 1s, kind: partition, for: 4s}", False, "fault 1: kind: partition needs a replicated pair"),
        ("{at: 1s, kind: broker_kill, for: 1s}", True, "fault 1: kind: broker_kill is not available with --ha"),
        ("{at: 1s, kind: partition, device: dev-001, for: 4s}", True,
         "fault 1: device: a partition hits whichever broker is primary, not a device: remove 'device'"),
        ("{at: 1s, kind: flood, for: 4s}", True, r"unknown kind 'flood' \(valid with --ha: drop, stall"),
        ("{at: 1s, kind: group_kill, for: 1s}", False,
         r"fault 1: kind: group_kill needs a replicated pair: run with --ha "
         r"\(it hits both brokers of the pair at once\)"),
        ("{at: 1s, kind: group_kill, device: all, for: 1s}", True,
         "fault 1: device: a group_kill hits both brokers of the pair at once, not a device: remove 'device'"),
        ("{at: 1s, kind: group_kill, for: 0}", True, "fault 1: for: must be more than 0"),
        ("{at: 58s, kind: group_kill, for: 3s}", True, "fault 1: for: the fault ends at 61s, after the run's duration"),
        ("{at: 1s, kind: group_kill, for: soon}", True, "fault 1: for: not a duration: 'soon'"),
    ],
)
def test_a_script_names_an_ha_fault_that_does_not_fit(tmp_path: Path, fault: str, ha: bool, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        load_schedule(write(tmp_path, f"faults:\n  - {fault}\n"), devices=DEVICES, duration=60.0, ha=ha)


def test_a_primary_kill_and_a_partition_must_not_overlap(tmp_path: Path) -> None:
    text = "faults:\n  - {at: 10s, kind: partition, for: 5s}\n  - {at: 12s, kind: primary_kill, for: 1s}\n"
    with pytest.raises(ScheduleError, match=r"fault 2: at: starts during fault 1 \(partition at 10s for 5s\): "
                                            r"two faults on the primary at once"):
        load_schedule(write(tmp_path, text), devices=DEVICES, duration=60.0, ha=True)


def test_a_group_kill_must_not_overlap_another_fault_on_the_pair(tmp_path: Path) -> None:
    text = "faults:\n  - {at: 10s, kind: primary_kill, for: 3s}\n  - {at: 12s, kind: group_kill, for: 1s}\n"
    with pytest.raises(ScheduleError, match=r"fault 2: at: starts during fault 1 \(primary_kill at 10s for 3s\): "
                                            r"two faults on the pair at once \(primary_kill, partition and group_kill "
                                            r"faults must not overlap\)"):
        load_schedule(write(tmp_path, text), devices=DEVICES, duration=60.0, ha=True)


def test_random_group_kills_share_the_pair_s_stratification(tmp_path: Path) -> None:
    counts = {"primary_kill": 1, "partition": 1, "group_kill": 2}
    faults = random_schedule(5, duration=60.0, devices=DEVICES, counts=counts, keepalive=4, ha=True)
    on_pair = sorted(faults, key=lambda f: f.at)
    assert sorted(f.kind for f in on_pair) == ["group_kill", "group_kill", "partition", "primary_kill"]
    assert all(f.target is None for f in on_pair)
    for earlier, later in itertools.pairwise(on_pair):
        assert earlier.at + 2 * earlier.duration <= later.at, on_pair  # its down time free after it
    assert all(0.5 <= f.duration <= 3.0 for f in on_pair if f.kind == "group_kill")
    dump_schedule(faults, tmp_path / "again.yaml")
    assert load_schedule(tmp_path / "again.yaml", devices=DEVICES, duration=60.0, ha=True) == faults
    with pytest.raises(ScheduleError, match=r"too short for 4 primary_kill, partition and group_kill faults"):
        random_schedule(5, duration=24.0, devices=DEVICES, counts=counts, keepalive=4, ha=True)


# ------------------------------------------------------------------ options


def parse(tmp_path: Path, *args: str) -> FleetOptions:
    config = tmp_path / "broker.yaml"
    config.write_text(yaml.safe_dump(BROKER_YAML), encoding="utf-8")
    parser = build_parser()
    return options_from(parser.parse_args(["-c", str(config), "--out", str(tmp_path / "out"), *args]), parser)


def test_ha_gets_faults_on_the_primary_by_default(tmp_path: Path) -> None:
    options = parse(tmp_path, "--ha", "--seed", "3")
    assert options.ha is True
    assert {fault.kind for fault in options.faults} == {"drop", "stall", "device_restart", "primary_kill", "partition"}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--faults", "primary_kill=1"], "primary_kill needs a replicated pair: run with --ha"),
        (["--ha", "--faults", "broker_kill=1"], "broker_kill is not available with --ha"),
        (["--ha", "--faults", "partition=x"], "'partition=x' is not NAME=COUNT"),
    ],
)
def test_ha_options_are_checked_naming_the_problem(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse(tmp_path, *args)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_ha_cannot_target_a_running_broker(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    with pytest.raises(SystemExit):
        options_from(parser.parse_args(["--ha", "--port", "1883"]), parser)
    assert "--ha starts a replicated pair from --config" in capsys.readouterr().err


def test_a_script_with_primary_kill_needs_ha(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = write(tmp_path, json.dumps({"faults": [{"at": 1, "kind": "primary_kill", "for": 1}]}))
    with pytest.raises(SystemExit):
        parse(tmp_path, "--schedule", str(script))
    assert "fault 1: kind: primary_kill needs a replicated pair: run with --ha" in capsys.readouterr().err
    assert parse(tmp_path, "--ha", "--schedule", str(script)).faults == [Fault(1.0, "primary_kill", None, 1.0)]


# ------------------------------------------------------------------ driving


class FakePair:
    """Stands in for durable_fleet.ha.HaPair: the primary alternates as a real pair's does."""

    def __init__(self) -> None:
        self.primary_now = "a"
        self.calls: list[tuple[str, str]] = []

    def kill_primary(self) -> str:
        self.calls.append(("kill", self.primary_now))
        killed, self.primary_now = self.primary_now, "b" if self.primary_now == "a" else "a"
        return killed

    def partition_primary(self) -> str:
        self.calls.append(("cut", self.primary_now))
        cut, self.primary_now = self.primary_now, "b" if self.primary_now == "a" else "a"
        return cut

    def restart(self, name: str) -> float:
        self.calls.append(("restart", name))
        return 1.25

    def heal(self, name: str) -> float:
        self.calls.append(("heal", name))
        return 0.5

    def kill_group(self) -> str:
        self.calls.append(("kill both", self.primary_now))
        return self.primary_now

    def restart_group(self) -> tuple[float, float]:
        self.calls.append(("restart both", ""))
        return 2.5, 0.25

    def primary(self) -> str:
        return self.primary_now


def test_ha_faults_hit_the_primary_of_the_moment_and_end_on_the_same_broker(tmp_path: Path) -> None:
    faults = [Fault(0.0, "primary_kill", None, 0.02), Fault(0.05, "partition", None, 0.02),
              Fault(0.1, "group_kill", None, 0.02)]
    run = FleetRun(FleetOptions(out=tmp_path, config={}, devices=2, processes=1, faults=faults, ha=True))
    run.proxy = object()  # type: ignore[assignment]  # not called by faults on the primary
    run.pair = pair = FakePair()  # type: ignore[assignment]
    errors: list[BaseException] = []
    run.t0 = time.monotonic()
    run._drive_faults(threading.Event(), errors, HA_FAULT_KINDS)
    assert errors == []
    assert pair.calls == [("kill", "a"), ("restart", "a"), ("cut", "b"), ("heal", "b"), ("kill both", "a"),
                          ("restart both", "")]
    assert [applied.detail for applied in run.applied] == [
        "a (primary) killed; restarted: b primary, its backup caught up 1.2 s later",
        "b (primary) cut off from etcd; reconnected to etcd: a primary, its backup caught up 0.5 s later",
        "a (primary) and its backup killed; both restarted: a elected primary 2.5 s later, its backup caught up "
        "0.2 s after that",
    ]
    assert all(not counts for counts in run.counts.values())  # no device is counted as hit


# ------------------------------------------------------------------ the relay in front of etcd


@pytest.fixture
def echo_server() -> Iterator[int]:
    """A threaded echo server on 127.0.0.1: stands in for etcd."""
    server = socket.create_server((HOST, 0))
    stop = threading.Event()

    def serve() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            threading.Thread(target=echo, args=(conn,), daemon=True).start()

    def echo(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            while data := conn.recv(1024):
                conn.sendall(data)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join(5)
    server.close()


def echoes(port: int, data: bytes, timeout: float = 2.0) -> bool:
    """Whether ``data`` comes back through 127.0.0.1:``port`` within ``timeout``."""
    try:
        with socket.create_connection((HOST, port), timeout=timeout) as sock:
            sock.sendall(data)
            return sock.recv(len(data)) == data
    except OSError:  # a timeout is an OSError: the blackhole
        return False


def test_a_cut_relay_is_a_blackhole_until_healed(echo_server: int) -> None:
    relay = TcpRelay(HOST, echo_server)
    relay.start()
    try:
        assert echoes(relay.port, b"ping")
        held = socket.create_connection((HOST, relay.port), timeout=5)
        held.sendall(b"a")
        assert held.recv(1) == b"a"
        relay.cut()
        held.sendall(b"b")  # an open connection gets nothing back, and is not closed
        held.settimeout(0.3)
        with pytest.raises(TimeoutError):
            held.recv(1)
        assert not echoes(relay.port, b"new", timeout=0.3)  # a new one is accepted and held
        relay.heal()
        held.settimeout(5)
        with pytest.raises(ConnectionResetError):  # reset by the heal; its peer gave up long ago
            held.recv(1)
        held.close()
        assert echoes(relay.port, b"pong")
    finally:
        relay.stop()


# ------------------------------------------------------------------ the router


class StandIn:
    """A broker stand-in: a STATUS answer on its replication port, a CONNACK code on its client port."""

    def __init__(self, name: str, role: str, code: int) -> None:
        self.name, self.role, self.code = name, role, code
        self.connects = 0

    async def status(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        kind, _ = await read_frame(reader)
        writer.write(encode_frame(kind, json.dumps({"name": self.name, "role": self.role}).encode()))
        await writer.drain()
        writer.close()

    async def client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connects += 1
        await reader.readexactly(len(CONNECT))
        writer.write(bytes([0x20, 2, 0, self.code]))
        await writer.drain()
        if self.code:
            writer.close()


CONNECT = bytes([0x10, 16, 0, 4]) + b"MQTT" + bytes([4, 0x02, 0, 10, 0, 4]) + b"dev1"


@contextlib.asynccontextmanager
async def serving(stand_in: StandIn) -> AsyncIterator[Node]:
    status = await asyncio.start_server(stand_in.status, HOST, 0)
    client = await asyncio.start_server(stand_in.client, HOST, 0)
    try:
        yield Node(stand_in.name, client.sockets[0].getsockname()[1], f"{HOST}:{status.sockets[0].getsockname()[1]}")
    finally:
        for server in (status, client):
            server.close()


def test_the_router_sends_a_device_to_the_primary_and_asks_again_when_refused() -> None:
    async def main() -> None:
        a, b = StandIn("a", "primary", 3), StandIn("b", "backup", 0)  # a stepped down, b not yet primary
        async with serving(a) as node_a, serving(b) as node_b:
            router = PrimaryRouter([node_a, node_b], wait=5.0)
            b_takes_over = asyncio.get_running_loop().call_later(0.3, lambda: setattr(b, "role", "primary"))
            _, writer, connack = await router.open(CONNECT, lambda: False)
            b_takes_over.cancel()
            writer.close()
            assert connack == bytes([0x20, 2, 0, 0])
            assert router.current == node_b and a.connects >= 1 and b.connects == 1
            with pytest.raises(ConnectionRefusedError, match="no broker of the pair accepted a client"):
                await PrimaryRouter([node_a], wait=0.3).open(CONNECT, lambda: False)
            assert await PrimaryRouter([node_a], wait=5.0).open(CONNECT, lambda: True) is None

    asyncio.run(asyncio.wait_for(main(), 30))
