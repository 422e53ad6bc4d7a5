"""docs/configuration.md and broker.yaml, promise by promise, against the plugin's own settings.

The table's keys and defaults are the dataclass's, broker.yaml lists every key with its
default, and a bad value of every key the table lists stops the broker with an error that
names the key (exit code 2 through the real CLI for a few).
"""

from __future__ import annotations

import dataclasses
import math
import re
import shutil
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from amqtt_durable.cli import load_broker_config
from amqtt_durable.config import DurableConfig
from amqtt_durable.errors import ConfigError, StoreError
from amqtt_durable.process import HOST, free_port
from amqtt_durable.store import open_store
from conftest import Broker, probe_connack, run_cli

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = "amqtt_durable.DurableSessionsPlugin"
ROW = re.compile(r"^\| `(\w+)` \| (`[^`]*`|absent) \|", re.M)


def documented_defaults() -> dict[str, Any]:
    text = (ROOT / "docs" / "configuration.md").read_text()
    return {key: None if cell == "absent" else yaml.safe_load(cell.strip("`")) for key, cell in ROW.findall(text)}


def dataclass_defaults() -> dict[str, Any]:
    config = DurableConfig()
    return {field.name: getattr(config, field.name) for field in dataclasses.fields(DurableConfig)}


def test_configuration_table_lists_every_setting_with_the_code_default() -> None:
    assert documented_defaults() == dataclass_defaults()


def test_shipped_broker_yaml_lists_every_setting_at_its_default() -> None:
    shipped = yaml.safe_load((ROOT / "broker.yaml").read_text())["plugins"][PLUGIN]
    assert shipped == dataclass_defaults()
    assert DurableConfig.from_mapping(shipped) == DurableConfig()


BAD_VALUES: dict[str, Any] = {
    "store": "",
    "sync": "yes",
    "session_expiry": -1,
    "max_depth": 0,
    "max_depth_disconnected": "many",
    "overflow": "drop-random",
    "recovery_buffer": 65_536,
    "queue_qos0": 1,
    "batch_size": 0,
    "batch_delay_ms": math.inf,
    "pending_threshold": 1.5,
    "metrics_interval": -0.5,
    "drop_log_interval": math.nan,
    "max_session_expiry": "a week",
    "streams": {"filter": "a/#"},
    "stream_window": 1001,
    "stream_ack_timeout": 0,
    "session_takeover": "anyone",
    "connect_timeout": -1,
    "connection_end_wait": 0,
    "max_packet_size": 1023,
    "max_bytes": -1,
    "max_bytes_disconnected": True,
    "max_subscriptions_per_client": -1,
    "max_subscription_bytes_per_client": -1,
    "max_pending_clean": -1,
    "max_pending_bytes_clean": 1.5,
    "max_awaiting_pubrel": -1,
    "max_pending_control_bytes": "1MB",
    "max_stream_entries_per_client": 1.5,
    "max_durable_sessions": -1,
    "max_connections_per_address": 2.5,
    "max_keepalive": 65_536,
    "listen_backlog": 0,
    "attach_limit": 0,
    "replication": "on",
}


def test_every_documented_key_has_a_bad_value_here() -> None:
    assert set(BAD_VALUES) == set(documented_defaults())


@pytest.mark.parametrize(("key", "value"), sorted(BAD_VALUES.items()))
def test_a_bad_value_of_every_documented_key_names_the_key(key: str, value: Any) -> None:
    with pytest.raises(ConfigError) as raised:
        DurableConfig.from_mapping({key: value})
    assert f"'{key}'" in str(raised.value) or f"'{key}." in str(raised.value)


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"session_expiry": math.nan}, "'session_expiry'"),
        ({"streams": [{"filter": "a/#", "max_count": 0}]}, "'streams[0].max_count'"),
        ({"replication": {"role": "bogus"}}, "'replication.role'"),
        ({"max_packet_size": 1023}, "'max_packet_size'"),
    ],
)
def test_bad_values_through_the_real_cli_exit_2_naming_the_key(
    broker_factory: Callable[..., Broker], settings: dict[str, object], named: str
) -> None:
    broker = broker_factory(start=False, **settings)
    broker.write_config()
    result = run_cli("broker", "-c", str(broker.config_path))
    assert result.returncode == 2, result.stderr
    assert named in result.stderr
    assert "amqtt_durable config:" in result.stderr


def test_a_key_given_twice_in_broker_yaml_stops_the_broker_naming_it(broker_factory: Callable[..., Broker]) -> None:
    """configuration.md: a key given twice is refused (exit 2, naming it); plain YAML would keep
    the second ``store:`` unseen and start a broker on a store the operator did not mean."""
    broker = broker_factory(start=False)
    broker.write_config()
    text = broker.config_path.read_text()
    assert text.count("    store: ") == 1, text
    broker.config_path.write_text(text.replace("    store: ", "    store: ./elsewhere\n    store: "))
    result = run_cli("broker", "-c", str(broker.config_path), cwd=broker.config_path.parent)
    assert result.returncode == 2, result.stderr
    assert "'store': given twice" in result.stderr
    assert not (broker.config_path.parent / "elsewhere").exists()


def test_a_bad_listener_port_says_what_to_fix(broker_factory: Callable[..., Broker]) -> None:
    """operations.md: a broker that cannot start exits 1 with `amqtt-durable: broker not started: ...`;
    for a bind whose port is not a number that is amqtt's own sentence, naming the bind value,
    not the bare int() error underneath it."""
    broker = broker_factory(start=False)
    broker.write_config()
    text = broker.config_path.read_text()
    bind = f"127.0.0.1:{broker.port}"
    assert bind in text, text
    broker.config_path.write_text(text.replace(bind, "127.0.0.1:notaport"))
    result = run_cli("broker", "-c", str(broker.config_path))
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last == "amqtt-durable: broker not started: Invalid port value in bind value: 127.0.0.1:notaport"


def test_yaml_merge_keys_in_broker_yaml_load_as_yaml_says(broker_factory: Callable[..., Broker]) -> None:
    """Refusing a key given twice must not refuse YAML merge keys (``<<: *anchor``), where a key of
    the mapping's own overrides a merged one: two listeners sharing settings through an anchor
    start both (the loader once refused the file as "not valid YAML")."""
    broker = broker_factory(start=False)
    broker.write_config()
    second = free_port()
    plugins = yaml.safe_dump({"plugins": broker.config["plugins"]})
    text = (
        f"listeners:\n  default: &tcp\n    type: tcp\n    bind: {HOST}:{broker.port}\n"
        f"  second:\n    <<: *tcp\n    bind: {HOST}:{second}\n{plugins}"
    )
    broker.config_path.write_text(text)
    assert load_broker_config(str(broker.config_path)) == yaml.safe_load(text)
    broker.write_config = lambda: broker.config_path  # type: ignore[method-assign] # start with this text
    broker.start()
    assert probe_connack(broker.port) and probe_connack(second)


def test_a_complex_key_in_broker_yaml_is_a_clear_config_error(tmp_path: Path) -> None:
    path = tmp_path / "broker.yaml"
    path.write_text("? [1, 2]\n: a\n")
    result = run_cli("broker", "-c", str(path))
    assert result.returncode == 2, result.stderr
    assert "is not valid YAML" in result.stderr and "Traceback" not in result.stderr


def test_the_duplicate_key_error_names_both_lines(tmp_path: Path) -> None:
    path = tmp_path / "broker.yaml"
    path.write_text("a: 1\nb:\n  c: 2\n  c: 3\n")
    with pytest.raises(ConfigError, match=r"'b.c': given twice in one mapping \(lines 3 and 4\)"):
        load_broker_config(str(path))


def test_a_listener_port_in_use_is_named(broker_factory: Callable[..., Broker]) -> None:
    """The message names the listener and its address, as replication.listen's does (docs/operations.md)."""
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen()
        broker = broker_factory(start=False)
        broker.port = taken.getsockname()[1]
        broker.write_config()
        result = run_cli("broker", "-c", str(broker.config_path))
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("amqtt-durable: broker not started: "), last
    expected = f"listener 'default' {HOST}:{broker.port}: [Errno 98] Address already in use"
    assert last == f"amqtt-durable: broker not started: {expected}", last


def test_a_store_below_a_file_names_the_file(tmp_path: Path) -> None:
    blocking = tmp_path / "afile"
    blocking.write_text("not a folder\n")
    with pytest.raises(StoreError, match=f"store '{blocking}/s': '{blocking}' is a file, not a folder"):
        open_store(str(blocking / "s"))


def test_a_merged_anchor_that_overrides_its_own_merge_is_not_a_duplicate(tmp_path: Path) -> None:
    """PyYAML rewrites an anchored mapping's pairs in place when a shallower mapping merges it
    first; the check reads the pairs as written, so a plugin section built from a base and
    merged again elsewhere loads as yaml.safe_load loads it."""
    text = (
        "b: &B {k: 1}\nouter:\n  inner:\n    a: &A {<<: *B, k: 2}\nm: {<<: *A}\n"
        "plugins: {amqtt_durable.DurableSessionsPlugin: {}}\n"
    )
    path = tmp_path / "broker.yaml"
    path.write_text(text)
    assert load_broker_config(str(path)) == yaml.safe_load(text)


def test_a_store_below_a_device_names_the_device() -> None:
    with pytest.raises(StoreError, match="store '/dev/null/s': '/dev/null' is a file, not a folder"):
        open_store("/dev/null/s")


def _listen_backlog(port: int) -> int:
    """The backlog of the socket listening on 127.0.0.1:port, as the kernel reports it (ss's Send-Q)."""
    out = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True, check=True, timeout=10)
    rows = [line.split() for line in out.stdout.splitlines() if line.strip()]
    assert len(rows) == 1, out.stdout
    return int(rows[0][2])


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2) to read a listening socket's backlog")
def test_listen_backlog_is_the_tcp_listeners_backlog(broker_factory: Callable[..., Broker]) -> None:
    """amqtt listens with asyncio's default backlog of 100: in a storm of 1,000 reconnects the kernel
    dropped about half the SYNs, and those clients came back 1 and 2 s later (bench/RESULTS.md)."""
    somaxconn = int(Path("/proc/sys/net/core/somaxconn").read_text())
    default = broker_factory()
    assert _listen_backlog(default.port) == min(512, somaxconn)
    small = broker_factory(listen_backlog=7)
    assert _listen_backlog(small.port) == 7
