"""The examples run as documented, ``amqtt-durable inspect`` shows their session, broker.yaml documents every knob."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from amqtt_durable.cli import PLUGIN_PATH, load_broker_config, plugin_section
from amqtt_durable.config import DurableConfig
from conftest import WAIT, Broker, Client, free_port, payloads, run_cli

ROOT = Path(__file__).resolve().parent.parent
OFFLINE_DEVICE = ROOT / "examples" / "offline_device.py"


def run_example(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(OFFLINE_DEVICE), *args],
        capture_output=True,
        text=True,
        timeout=4 * WAIT,
        check=False,
        cwd=ROOT,
    )


def test_offline_device_gets_every_event_in_order(broker_factory: Callable[..., Broker]) -> None:
    broker = broker_factory()
    result = run_example("--port", str(broker.port), "--count", "25")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "session_present=0" in result.stdout, "the first durable connect starts a new session"
    assert "reconnected with session_present=1, got 25/25 events in order" in result.stdout
    assert "OK" in result.stdout


def test_offline_device_runs_again_on_the_same_broker(broker_factory: Callable[..., Broker]) -> None:
    broker = broker_factory()
    for _ in range(2):  # the example wipes its earlier session (clean_session=True) before starting
        result = run_example("--port", str(broker.port), "--count", "5")
        assert result.returncode == 0, result.stdout + result.stderr
        assert "got 5/5 events in order" in result.stdout


def test_offline_device_exits_1_without_a_broker() -> None:
    result = run_example("--port", str(free_port()), "--timeout", "2")
    assert result.returncode == 1
    assert "error:" in result.stderr


def test_inspect_shows_the_device_session_with_its_queue(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    broker = broker_factory()
    device_id = "inspected-device"
    topic = f"devices/{device_id}/events"
    assert run_example("--port", str(broker.port), "--client-id", device_id, "--count", "3").returncode == 0
    # The device is offline again (its session kept); 7 more events queue up for it.
    clients(broker.port, "pub", clean_session=True).publish(topic, payloads(7), qos=1)
    broker.stop()  # LevelDB allows one process: inspect needs the broker stopped

    listed = run_cli("inspect", broker.store, "--json")
    assert listed.returncode == 0, listed.stderr
    rows = {row["client_id"]: row for row in json.loads(listed.stdout)}
    assert rows[device_id]["depth"] == 7
    assert rows[device_id]["bytes"] == sum(len(p) for p in payloads(7))
    assert rows[device_id]["subscriptions"] == {topic: 1}
    assert rows[device_id]["expires_at"] is not None, "a disconnected session has an expiry deadline"

    table = run_cli("inspect", broker.store)
    assert table.returncode == 0, table.stderr
    line = next(line for line in table.stdout.splitlines() if line.startswith(device_id))
    assert line.split()[1] == "7", line
    assert f"{topic}@1" in line
    assert "queued message(s)" in table.stdout


def test_inspect_refuses_a_running_brokers_store(broker_factory: Callable[..., Broker]) -> None:
    broker = broker_factory()
    result = run_cli("inspect", broker.store)
    assert result.returncode == 1
    assert "locked by another process" in result.stderr


def test_repo_broker_yaml_is_valid_and_documents_every_knob() -> None:
    config = load_broker_config(str(ROOT / "broker.yaml"))
    assert config["listeners"]["default"]["bind"] == "127.0.0.1:1883"
    section = plugin_section(config)
    assert section is not None, f"broker.yaml must load {PLUGIN_PATH}"
    missing = [f.name for f in dataclasses.fields(DurableConfig) if f.name not in section]
    assert not missing, f"broker.yaml does not show these settings: {missing}"
    # Its comments say "(default ...)": the values must be the defaults.
    assert DurableConfig.from_mapping(section) == DurableConfig()


def test_readme_configuration_table_lists_every_knob() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    missing = [f.name for f in dataclasses.fields(DurableConfig) if f"| `{f.name}` |" not in readme]
    assert not missing, f"README's configuration table lacks: {missing}"
