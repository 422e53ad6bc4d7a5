"""The examples run as documented, ``amqtt-durable inspect`` shows their session, broker.yaml documents every knob."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from amqtt_durable.cli import PLUGIN_PATH, load_broker_config, plugin_section
from amqtt_durable.config import DurableConfig
from conftest import WAIT, Broker, Client, free_port, payloads, readme_example, run_cli

ROOT = Path(__file__).resolve().parent.parent
OFFLINE_DEVICE = ROOT / "examples" / "offline_device.py"


def run_script(script: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=4 * WAIT,
        check=False,
        cwd=ROOT,
    )


def run_example(*args: str) -> subprocess.CompletedProcess[str]:
    return run_script(OFFLINE_DEVICE, *args)


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
    readme = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")  # the README links to it
    missing = [f.name for f in dataclasses.fields(DurableConfig) if f"| `{f.name}` |" not in readme]
    assert not missing, f"README's configuration table lacks: {missing}"


# --------------------------------------------------------------------------- the SDK examples
FLAKY_LINK_DEVICE = ROOT / "examples" / "flaky_link_device.py"
DASHBOARD = ROOT / "examples" / "dashboard.py"


def counts(line_start: str, output: str) -> dict[str, int]:
    """``link cuts: 3, reconnects: 3`` -> {"link cuts": 3, "reconnects": 3}, from the line starting so."""
    line = next(line for line in output.splitlines() if line.startswith(line_start))
    return {name.strip(): int(value) for name, value in (part.split(":") for part in line.split(","))}


def test_flaky_link_device_processes_every_command_once_in_order_despite_the_cuts(
    broker_factory: Callable[..., Broker],
) -> None:
    broker = broker_factory()
    result = run_script(FLAKY_LINK_DEVICE, "--port", str(broker.port), "--count", "120", "--cut-every", "20")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "persistence=disk" in result.stdout
    assert "publisher: 120 QoS 1 commands acknowledged by the broker" in result.stdout
    assert "processed 120/120 commands exactly once, in order" in result.stdout
    stats = counts("link cuts:", result.stdout)
    # 120 acknowledgements cannot pass a link cut at every 20th without several cuts; each cut
    # withholds the acknowledgement of a processed command, which the broker re-sends after the
    # reconnect and the SDK drops (only the last cut may come after the last command).
    assert stats["link cuts"] >= 2, result.stdout
    assert stats["reconnects"] >= stats["link cuts"] - 1, result.stdout
    assert stats["duplicates dropped by the SDK"] >= stats["link cuts"] - 1, result.stdout
    assert stats["replayed events"] >= 1, "commands queued while the link was down come replayed"
    assert "OK" in result.stdout
    assert result.stderr == "", "nothing is logged on stderr when all goes well"


def test_flaky_link_device_runs_again_with_the_same_state_folder(
    broker_factory: Callable[..., Broker], tmp_path: Path
) -> None:
    broker = broker_factory()
    state = tmp_path / "device-state"
    for _ in range(2):  # the example ends the earlier session, and resets its marks, before starting
        args = ["--port", str(broker.port), "--count", "30", "--cut-every", "8", "--state-dir", str(state)]
        result = run_script(FLAKY_LINK_DEVICE, *args)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "processed 30/30 commands exactly once, in order" in result.stdout
    assert (state / "flaky-device-1").is_dir(), "the processed marks live in state-dir/<client id>/"


def test_dashboard_cache_skips_replayed_readings_and_takes_live_ones(broker_factory: Callable[..., Broker]) -> None:
    broker = broker_factory()
    result = run_script(DASHBOARD, "--port", str(broker.port), "--sensors", "3", "--readings", "3")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "first visit, cache at the marker:" in out
    assert "publisher: 9 readings (3 per sensor) while the dashboard was away" in out
    assert "back (session_present=1)" in out
    assert "the listener got 9 replayed readings, in order; the cache took 0 of them" in out
    assert "publisher: 3 live readings; the listener got 3" in out
    after_live = out.split("cache after the live readings:", 1)[1].splitlines()
    for n in (1, 2, 3):  # live reading number 4 of sensor n is f"{20 + n}.4"
        row = next(line.split() for line in after_live if line.strip().startswith(f"sensors/{n}/temperature"))
        assert row[1] == f"{20 + n}.4" and row[-2:] == ["live", "reading"], row
    assert not any(line.endswith("replayed reading") for line in out.splitlines()), "no cached replayed reading"
    assert "OK" in out
    # It cleans up after itself (session ended, retained readings deleted): a second run passes too.
    again = run_script(DASHBOARD, "--port", str(broker.port), "--sensors", "2", "--readings", "1")
    assert again.returncode == 0, again.stdout + again.stderr


@pytest.mark.parametrize("script", [FLAKY_LINK_DEVICE, DASHBOARD], ids=lambda path: path.stem)
def test_sdk_examples_exit_1_without_a_broker(script: Path) -> None:
    result = run_script(script, "--port", str(free_port()), "--timeout", "0.5")  # nothing listens: no wait is long
    assert result.returncode == 1
    assert "error:" in result.stderr
    assert "OK" not in result.stdout


def test_the_readme_sdk_example_runs(broker_factory: Callable[..., Broker], tmp_path: Path) -> None:
    broker = broker_factory()
    script = readme_example("## The SDK", broker.port, tmp_path)
    assert 'state_dir="./state"' in script.read_text(encoding="utf-8")
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=4 * WAIT, check=False, cwd=tmp_path
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # Not a line of its own: on_live prints on the network thread, and two prints can interleave.
    assert "None" in result.stdout, "a new dashboard has nothing cached"
    assert (tmp_path / "state" / "dashboard-1").is_dir(), "CPL-2 state lives under state_dir/<client_id>"


def test_async_consumer_processes_replayed_then_live_orders_once_with_a_failed_body_retried(
    broker_factory: Callable[..., Broker],
) -> None:
    broker = broker_factory()
    result = run_script(ROOT / "examples" / "async_consumer.py", "--port", str(broker.port), "--count", "12")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "publisher: 12 orders while the consumer was away" in out
    # The failed body's reconnect replays the orders from order-3 on: the marker counts those.
    assert re.search(r"^marker: \d+ replayed order\(s\); live from now on$", out, re.M), out
    assert "not processed, comes again: order-3: the database was busy (on purpose)" in out
    assert "processed 24/24 orders exactly once, in order: OK" in out


def test_async_consumer_that_gets_no_order_within_timeout_says_so_and_exits_1(
    broker_factory: Callable[..., Broker],
) -> None:
    """The example's docstring: "Every wait is bounded by --timeout"; a consume phase that gets no
    order in time (here a real broker whose topic ACL drops every publish to orders/#) ends with a
    non-empty error line naming the bound and exit code 1 (asyncio.wait_for raises a TimeoutError
    whose text is empty)."""
    broker = broker_factory(start=False)
    acl = {"publish_acl": {"anonymous": ["nothing/#"]}, "acl": {"anonymous": ["#"]}}
    broker.extra_plugins["amqtt.plugins.topic_checking.TopicAccessControlListPlugin"] = acl
    broker.start()
    script = ROOT / "examples" / "async_consumer.py"
    result = run_script(script, "--port", str(broker.port), "--count", "4", "--timeout", "3")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "publisher: 4 orders while the consumer was away" in result.stdout, result.stdout + result.stderr
    assert "error: not done within --timeout 3 s" in result.stderr.splitlines(), result.stderr
