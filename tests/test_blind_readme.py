"""Black-box checks of README.md, the examples as the README runs them, the ``amqtt-durable`` command
line as README.md / docs/operations.md describe it, and the checkable promises of
docs/store-layout.md and docs/architecture.md. Written from those pages alone; each test quotes the
words it checks."""

from __future__ import annotations

import json
import os
import re
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import plyvel
import pytest
import yaml
from test_blind_pipeline import fleet_in_process

from conftest import WAIT, Broker, Client, run_cli

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def run_script(script: Path, *args: str, timeout: float = 4 * WAIT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=timeout, check=False, cwd=ROOT
    )


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    """One broker for the tests that only connect, publish and read (each with client ids of its own)."""
    folder = tmp_path_factory.mktemp("shared")
    broker = Broker(folder)
    broker.start()
    yield broker
    broker.stop()


@pytest.fixture
def made() -> Iterator[Callable[..., Client]]:
    clients: list[Client] = []

    def make(port: int, client_id: str, **kwargs: object) -> Client:
        client = Client(port, client_id, **kwargs)  # type: ignore[arg-type]
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.paho.disconnect()
        client.paho.loop_stop()


# ------------------------------------------------------------------------------------------- README


@pytest.mark.timeout(60)
def test_a_durable_session_with_a_username_keeps_its_queue_and_replays_it_unretained_in_order(
    shared: Broker, made: Callable[..., Client]
) -> None:
    """README: stock amqtt with `allow_anonymous: true` counts every session as anonymous "(even with
    a username)" and deletes it, and "queued messages are replayed with RETAIN=1"; the plugin: "Any
    MQTT 3.1.1 client that connects with `clean_session=false` now has a durable session"."""
    device = made(shared.port, "readme-user-dev", username="alice")
    device.subscribe("readme/user/#", 1)
    device.disconnect()
    publisher = made(shared.port, "readme-user-pub", clean_session=True)
    sent = [f"r{i}".encode() for i in range(5)]
    publisher.publish("readme/user/t", sent, qos=1)
    again = made(shared.port, "readme-user-dev", username="alice", auto_start=False)
    assert again.connect() is True, "session_present=1 expected for the durable session"
    got = again.wait_messages(len(sent))
    assert [m.payload for m in got] == sent
    assert [m.retain for m in got] == [False] * len(sent)
    assert all(m.qos == 1 for m in got)


@pytest.mark.timeout(60)
def test_offline_device_exits_0_with_host_port_and_count_as_the_readme_runs_it(shared: Broker) -> None:
    """README: `examples/offline_device.py  # --host / --port / --count, exit code 0 on success`."""
    result = run_script(
        EXAMPLES / "offline_device.py",
        "--host", "127.0.0.1", "--port", str(shared.port), "--count", "7", "--client-id", "readme-offline-7",
    )
    assert result.returncode == 0, result.stdout + result.stderr


EXAMPLE_ARGS = {
    "offline_device.py": ["--count", "3"],
    "flaky_link_device.py": ["--count", "3"],
    "dashboard.py": ["--sensors", "1"],
    "async_consumer.py": ["--count", "4"],
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("script", sorted(EXAMPLE_ARGS))
def test_every_example_bounds_its_waits_by_timeout_against_a_listener_that_never_answers(script: str) -> None:
    """The examples' docstrings (README: "in another terminal, watch a device go offline"): "Exit code
    0 when ..., otherwise 1. Every wait is bounded by --timeout." A port that accepts TCP and never
    sends a CONNACK (a wrong service, a hung broker) must end the run with exit code 1 in about
    --timeout (not the SDK's own default wait), with an error line rather than a traceback, as a
    user runs them."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        port = silent.getsockname()[1]
        started = time.monotonic()
        result = run_script(EXAMPLES / script, "--port", str(port), "--timeout", "2", *EXAMPLE_ARGS[script])
        took = time.monotonic() - started
    assert result.returncode == 1, result.stdout + result.stderr
    assert took < 2 + 6, f"{script} took {took:.1f} s with --timeout 2"
    assert "error: " in result.stderr and "Traceback" not in result.stderr, result.stderr


def fleet_defaults() -> dict[str, str]:
    result = run_cli("fleet", "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    found = {}
    for flag in ("--devices", "--rate", "--duration"):
        match = re.search(re.escape(flag) + r" [A-Z_]+ [^(]*\(default: ([^)]+)\)", text)
        assert match, f"{flag} has no default in fleet --help"
        found[flag] = match.group(1)
    match = re.search(r"--faults FAULTS .*?\(default: ([a-z_=0-9,]+);", text)
    assert match, "--faults has no default in fleet --help"
    found["--faults"] = match.group(1)
    return found


@pytest.mark.timeout(60)
def test_fleet_defaults_are_the_readme_s_20_devices_100_msg_s_45_s_10_faults() -> None:
    """README: `.venv/bin/amqtt-durable fleet  # 20 devices, 100 msg/s, 45 s, 10 faults`."""
    found = fleet_defaults()
    assert found["--devices"] == "20"
    assert float(found["--rate"]) == 100.0
    assert found["--duration"] == "45s"
    counts = [int(part.split("=")[1]) for part in found["--faults"].split(",")]
    assert sum(counts) == 10, found["--faults"]


@pytest.mark.timeout(120)
def test_durable_pipeline_demo_takes_the_readme_s_flags() -> None:
    """README: `.venv/bin/durable-pipeline demo --out ./out  # about 30 s; --events, --devices, --master`."""
    result = subprocess.run(
        [sys.executable, "-m", "durable_pipeline.cli", "demo", "--help"],
        capture_output=True, text=True, timeout=4 * WAIT, check=False,
    )
    assert result.returncode == 0, result.stderr
    for flag in ("--out", "--events", "--devices", "--master"):
        assert flag in result.stdout, flag


# -------------------------------------------------------------------------------- the command line

MALFORMED = ["foo", "127.0.0.1:", ":7883", "127.0.0.1:99999", "[::1]", "[::1]:x", "127.0.0.1:7883x"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", [["inspect", "--replication"], ["promote"]])
def test_a_malformed_host_port_is_a_usage_error_exit_2(command: list[str]) -> None:
    """operations.md: `inspect --replication` and `promote` take "HOST:PORT ... (an IPv6 address in
    brackets, `[::1]:7883`; a malformed HOST:PORT is a usage error, exit code 2)"."""
    for address in MALFORMED:
        result = run_cli(*command, address)
        assert result.returncode == 2, (address, result.stdout, result.stderr)
        assert address in result.stderr, (address, result.stderr)
        assert "usage:" in result.stderr
    bare_ipv6 = run_cli(*command, "::1:7883")
    assert bare_ipv6.returncode == 2, bare_ipv6.stderr
    assert "[::1]:7883" in bare_ipv6.stderr, "the error shows the bracketed form"


@pytest.mark.timeout(60)
def test_inspect_replication_of_an_address_where_nothing_listens_is_exit_1_not_a_usage_error(
    tmp_path: Path,
) -> None:
    """operations.md: a well-formed HOST:PORT is not a usage error; the tool talks "to a **running**
    broker over its `replication.listen` address" and fails as the command (`amqtt-durable: ...`)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]  # bound, not listening: connections are refused
        result = run_cli("inspect", "--replication", f"127.0.0.1:{port}")
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith("amqtt-durable: "), result.stderr
    assert "usage:" not in result.stderr


def plugin_keys_of_broker_yaml() -> list[str]:
    config = yaml.safe_load((ROOT / "broker.yaml").read_text())
    return list(config["plugins"]["amqtt_durable.DurableSessionsPlugin"])


@pytest.mark.timeout(60)
def test_an_unknown_key_is_exit_2_naming_it_and_listing_every_setting_broker_yaml_shows(tmp_path: Path) -> None:
    """operations.md: "**`amqtt_durable config: '<key>': <problem>`** with exit code 2: fix that key in
    `broker.yaml`. An unknown key lists the accepted ones." (README: the shipped broker.yaml "lists
    every setting".)"""
    config = {
        "listeners": {"default": {"type": "tcp", "bind": "127.0.0.1:1"}},
        "plugins": {"amqtt_durable.DurableSessionsPlugin": {"store": str(tmp_path / "s"), "sesion_expiry": 5}},
    }
    path = tmp_path / "broker.yaml"
    path.write_text(yaml.safe_dump(config))
    result = run_cli("broker", "-c", str(path))
    assert result.returncode == 2, result.stderr
    assert "amqtt_durable config: 'sesion_expiry': " in result.stderr
    listed = result.stderr.split("'sesion_expiry': ", 1)[1]
    for key in plugin_keys_of_broker_yaml():
        assert re.search(rf"\b{re.escape(key)}\b", listed), f"{key} not among the accepted settings"
    assert not (tmp_path / "s").exists(), "a refused config created the store"


# ------------------------------------------------------------------------------ store layout, repair

U64 = struct.Struct(">Q")


@pytest.mark.timeout(90)
def test_the_store_holds_the_keys_store_layout_md_names(tmp_path: Path, made: Callable[..., Client]) -> None:
    """store-layout.md: "The version is stored under key `v`"; "a mark at or past the highest message
    id ever given (key `M`, moved ahead 1,024 ids at a time ...)"; "Stream-log events are keyed by the
    topic's byte length, the topic and the id"; "one retained message per topic"; per-session queue
    entries "keyed by a big-endian sequence number"."""
    broker = Broker(tmp_path, streams=[{"filter": "log/#"}])
    broker.start()
    try:
        device = made(broker.port, "layout-dev")
        device.subscribe("d/#", 1)
        device.disconnect()
        publisher = made(broker.port, "layout-pub", clean_session=True)
        publisher.publish("d/x", [f"{i}".encode() for i in range(1100)], qos=1)
        publisher.publish("r/tél", [b"first", b"second"], qos=1, retain=True)
        publisher.publish("log/tél", [b"e1", b"e2", b"e3"], qos=1)
        publisher.disconnect()
    finally:
        broker.stop()
    db = plyvel.DB(broker.store)
    try:
        assert db.get(b"v") == b"1"
        body_ids = [U64.unpack(key[1:])[0] for key, _ in db.iterator(prefix=b"m") if len(key) == 9]
        mark = U64.unpack(db.get(b"M"))[0]
        assert body_ids and mark >= max(body_ids)
        assert mark - max(body_ids) < 1024, (mark, max(body_ids))
        entries = [key for key, _ in db.iterator(prefix=b"q")]
        assert len(entries) == 1100
        seqs = [U64.unpack(key[9:17])[0] for key in entries]
        assert seqs == sorted(seqs) and len(set(seqs)) == 1100, "queue entries keyed by big-endian seq"
        topic = "log/tél".encode()
        prefix = b"e" + struct.pack(">H", len(topic)) + topic
        ids = [U64.unpack(key[len(prefix):])[0] for key, _ in db.iterator(prefix=prefix)]
        assert ids == [1, 2, 3]
        retained = [key for key, _ in db.iterator(prefix=b"r")]
        assert retained == [b"r" + "r/tél".encode()], "one retained message per topic"
        assert db.get(b"r" + "r/tél".encode()).endswith(b"second")
    finally:
        db.close()


@pytest.mark.timeout(60)
def test_a_store_with_data_but_no_version_is_refused(tmp_path: Path) -> None:
    """store-layout.md: "The version is stored under key `v`; a store with another version, or with
    data but no version, is refused." operations.md: `broker not started: ...`, exit code 1; inspect too."""
    store = tmp_path / "store"
    db = plyvel.DB(str(store), create_if_missing=True)
    db.put(b"zz", b"1")
    db.close()
    inspected = run_cli("inspect", str(store))
    assert inspected.returncode == 1, inspected.stderr
    assert f"store '{store}'" in inspected.stderr
    broker = Broker(tmp_path)
    broker.settings["store"] = str(store)
    started = run_cli("broker", "-c", str(broker.write_config()))
    assert started.returncode == 1, started.stderr
    assert f"amqtt-durable: broker not started: store '{store}'" in started.stderr
    db = plyvel.DB(str(store))
    try:
        assert list(db) == [(b"zz", b"1")], "a refused store was written to"
    finally:
        db.close()


def damaged_queue_of(tmp_path: Path, made: Callable[..., Client], client_id: str) -> Broker:
    """A stopped broker whose store holds `client_id`'s session with a queue of 4 messages, the second
    entry's value cut to one byte (it does not decode) and its queue totals undecodable."""
    broker = Broker(tmp_path)
    broker.start()
    try:
        device = made(broker.port, client_id)
        device.subscribe("rep/#", 1)
        device.disconnect()
        publisher = made(broker.port, "rep-pub", clean_session=True)
        publisher.publish("rep/t", [b"a", b"b", b"c", b"d"], qos=1)
        publisher.disconnect()
    finally:
        broker.stop()
    db = plyvel.DB(broker.store)
    try:
        entries = [key for key, _ in db.iterator(prefix=b"q")]
        assert len(entries) == 4
        db.put(entries[1], b"\x01")
        totals = [key for key, _ in db.iterator(prefix=b"t")]
        assert len(totals) == 1
        db.put(totals[0], b"xx")
    finally:
        db.close()
    return broker


@pytest.mark.timeout(90)
def test_repair_lists_rebuilt_lines_before_not_recovered_ones_and_quotes_a_client_id_with_an_apostrophe(
    tmp_path: Path, made: Callable[..., Client]
) -> None:
    """operations.md: repair "prints `repaired 'STORE'; start the broker to use it`, then, each on a
    line indented two spaces, each thing it rebuilt (`rebuilt: ...`) and then each thing it could not
    recover (`not recovered: ...`; every `rebuilt:` line comes before the first `not recovered:` line)";
    "a client id ... in quotes as Python's `repr()` writes a string: `client '...'`, or `client "..."`
    for one holding a `'` and no `"`"; "removed entries per client" are among what it could not recover;
    "queue totals that are missing, undecodable or wrong" are rebuilt. The rest of the queue is kept,
    in order."""
    client_id = "it's-dev"
    broker = damaged_queue_of(tmp_path, made, client_id)
    result = run_cli("repair", broker.store)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"repaired '{broker.store}'; start the broker to use it"
    rest = lines[1:]
    assert rest and all(line.startswith("  ") and not line.startswith("   ") for line in rest), lines
    kinds = [line.strip().split(":")[0] for line in rest]
    assert "rebuilt" in kinds and "not recovered" in kinds, lines
    assert set(kinds) <= {"rebuilt", "not recovered"}, lines
    assert kinds.index("not recovered") > max(i for i, kind in enumerate(kinds) if kind == "rebuilt"), lines
    assert any(line.strip().startswith("not recovered:") and 'client "it\'s-dev"' in line for line in rest), lines
    inspected = run_cli("inspect", broker.store, "--json")
    assert inspected.returncode == 0, inspected.stderr
    (row,) = json.loads(inspected.stdout)
    assert row["client_id"] == client_id and row["depth"] == 3
    broker.start()
    device = made(broker.port, client_id, auto_start=False)
    assert device.connect() is True
    assert [m.payload for m in device.wait_messages(3)] == [b"a", b"c", b"d"]


@pytest.mark.timeout(60)
def test_repair_of_a_running_broker_s_store_is_refused_as_locked_and_the_broker_keeps_serving(
    shared: Broker, made: Callable[..., Client]
) -> None:
    """operations.md: "`repair` needs the broker **stopped** (it refuses a store that a running broker
    holds ...)"; "**`store '...' is locked by another process`**: a broker, or an `inspect`, already has
    that store open. ... The broker that holds it keeps serving."; exit code 1."""
    device = made(shared.port, "locked-dev")
    device.subscribe("locked/#", 1)
    device.disconnect()
    made(shared.port, "locked-pub", clean_session=True).publish("locked/t", [b"kept"], qos=1)
    result = run_cli("repair", shared.store)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"store '{shared.store}' is locked by another process" in result.stderr
    assert "repaired" not in result.stdout
    again = made(shared.port, "locked-dev", auto_start=False)
    assert again.connect() is True
    assert [m.payload for m in again.wait_messages(1)] == [b"kept"]


# ------------------------------------------------------------------------------------ architecture


@pytest.mark.timeout(60)
def test_free_port_hands_out_ports_in_turn_outside_the_ephemeral_range_and_slices_give_disjoint_blocks() -> None:
    """architecture.md: process.py's `free_port`: "ports outside the kernel's ephemeral range, handed
    out in turn; AMQTT_DURABLE_PORT_SLICE gives each parallel test worker a block of its own"."""
    low, high = (int(part) for part in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    code = "from amqtt_durable.process import free_port; print(*[free_port() for _ in range(20)])"

    def ports(slice_: str) -> list[int]:
        env = {k: v for k, v in os.environ.items() if k != "AMQTT_DURABLE_PORT_SLICE"}
        if slice_:
            env["AMQTT_DURABLE_PORT_SLICE"] = slice_
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=WAIT, check=True, env=env
        )
        return [int(port) for port in out.stdout.split()]

    first, second = ports("0/2"), ports("1/2")
    for got in (first, second):
        assert len(set(got)) == 20, "a port handed out twice"
        assert all(not low <= port <= high for port in got), (got, low, high)
        assert all(1024 <= port <= 65535 for port in got)
    assert not set(first) & set(second), "two workers' blocks overlap"


@pytest.mark.timeout(10)
def test_the_quick_start_names_every_system_package_the_makefile_installs() -> None:
    """README quick start: "the first `make` also installs, with `apt-get` (through `sudo` unless run as
    root), ...": whatever the first `make run` / `make test` installs on the machine (system packages,
    with apt-get and sudo) the quick start must name, so that a user is not surprised by a sudo prompt
    or a package."""
    makefile = (ROOT / "Makefile").read_text()
    install = makefile.split("$(STAMP): pyproject.toml", 1)[1].split("\nsetup:", 1)[0]  # what make run / test run first
    packages = set(re.findall(r"apt-get install -y -qq ([\w.+-]+)", install))
    assert packages, "the Makefile installs no system package: drop this test"
    quick_start = (ROOT / "README.md").read_text().split("\n## ", 1)[0]
    for package in sorted(packages):
        assert f"`{package}`" in quick_start, f"{package} is installed by make but not named in the quick start"
    assert "apt-get" in quick_start and "sudo" in quick_start


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("key", "written"), [("session_expiry", "-1"), ("connect_timeout", "0"), ("metrics_interval", "-5")]
)
def test_a_number_out_of_range_is_named_as_written_in_broker_yaml(tmp_path: Path, key: str, written: str) -> None:
    """operations.md: "**`amqtt_durable config: '<key>': <problem>`** with exit code 2: fix that key in
    `broker.yaml`". The problem quotes the value the user wrote (`-1`), not the number it was read
    as (`-1.0`), so that it can be found in the file."""
    path = tmp_path / "broker.yaml"
    path.write_text(
        "listeners:\n  default:\n    type: tcp\n    bind: 127.0.0.1:1\nplugins:\n"
        f"  amqtt_durable.DurableSessionsPlugin:\n    store: {tmp_path / 's'}\n    {key}: {written}\n"
    )
    result = run_cli("broker", "-c", str(path))
    assert result.returncode == 2, result.stderr
    assert f"amqtt_durable config: '{key}': " in result.stderr
    assert result.stderr.rstrip().endswith(f", got {written}"), result.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("written", "problem"), [("0", "positive"), ("-5", "positive"), ("1e7", "below")])
def test_fleet_rate_out_of_range_is_exit_2_naming_the_bound_it_broke_and_the_value_as_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], written: str, problem: str
) -> None:
    """README's `amqtt-durable fleet` ("100 msg/s"; fleet --help: "--rate RATE messages per second from
    all publishers together"); docs/fleet.md: "A bad ... option ... stops the run before it starts, with
    exit status 2". The error names what is wrong with the value (a rate of 10,000,000 is positive) and
    the value as the user typed it. The command's main() in this process (fleet_in_process)."""
    status, err = fleet_in_process(tmp_path, capsys, "--rate", written)
    assert status == 2, err
    line = err.strip().splitlines()[-1]
    assert "--rate" in line and problem in line and line.endswith(f"got {written}"), line
