"""docs/configuration.md, broker.yaml's comments, docs/operations.md (commands, exit codes, the
stock amqtt command) and docs/architecture.md, promise by promise, against the real command.

test_docs_promises_ops.py checks the table's keys and defaults and one bad value per key; here:
the edges of what each key accepts, the error's exact form, values no float or C int holds, the
exit codes of the commands on a running broker's store or on no store, and the project layout.
"""

from __future__ import annotations

import ast
import asyncio
import errno
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from raw_mqtt_helpers import raw_connect, read_exactly
from test_docs_promises_ops import BAD_VALUES
from test_hostile_owner import acl_broker, login
from test_hostile_wire import publish_packet, read_until_closed

from amqtt_durable.amqtt_glue import _BROKER_INTERNALS
from amqtt_durable.cli import load_broker_config, plugin_section
from amqtt_durable.config import DurableConfig
from amqtt_durable.errors import ConfigError
from amqtt_durable.inspect_store import summarize
from amqtt_durable.process import HOST, ChildExitedError, free_port
from amqtt_durable.replication.framing import Frame
from amqtt_durable.replication.position import SNAPSHOT_MARK_KEY
from amqtt_durable.replication.tool import ask
from amqtt_durable.store import open_store
from conftest import WAIT, Broker, Client, connack_code, payloads, probe_connack, run_cli, seen_away

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = "amqtt_durable.DurableSessionsPlugin"
ERROR = re.compile(r"^amqtt_durable config: '([^']+)': \S")
"""operations.md, Troubleshooting: ``amqtt_durable config: '<key>': <problem>``."""


# ------------------------------------------------------------------ what each key accepts

EDGES: list[tuple[dict[str, Any], dict[str, Any], str]] = [
    # (accepted at the edge, refused one step past it, the key the refusal names)
    ({"session_expiry": 0}, {"session_expiry": -0.001}, "session_expiry"),
    ({"max_depth": 1, "max_depth_disconnected": 1}, {"max_depth": 0}, "max_depth"),
    ({"max_depth": 7, "max_depth_disconnected": 7}, {"max_depth": 7, "max_depth_disconnected": 6},
     "max_depth_disconnected"),
    ({"recovery_buffer": 1}, {"recovery_buffer": 0}, "recovery_buffer"),
    ({"recovery_buffer": 65_535}, {"recovery_buffer": 65_536}, "recovery_buffer"),
    ({"batch_size": 1}, {"batch_size": 0}, "batch_size"),
    ({"batch_delay_ms": 0}, {"batch_delay_ms": -1}, "batch_delay_ms"),
    ({"pending_threshold": 1}, {"pending_threshold": 0}, "pending_threshold"),
    ({"metrics_interval": 0}, {"metrics_interval": -0.1}, "metrics_interval"),
    ({"drop_log_interval": 0}, {"drop_log_interval": -0.1}, "drop_log_interval"),
    ({"max_session_expiry": 0}, {"max_session_expiry": -1}, "max_session_expiry"),
    ({"stream_window": 1}, {"stream_window": 0}, "stream_window"),
    ({"stream_window": 1000}, {"stream_window": 1001}, "stream_window"),
    ({"stream_ack_timeout": 0.001}, {"stream_ack_timeout": 0}, "stream_ack_timeout"),
    ({"connect_timeout": 0.001}, {"connect_timeout": 0}, "connect_timeout"),
    ({"connection_end_wait": 0.001}, {"connection_end_wait": 0}, "connection_end_wait"),
    ({"max_packet_size": 1024}, {"max_packet_size": 1023}, "max_packet_size"),
    ({"max_packet_size": 268_435_455}, {"max_packet_size": 268_435_456}, "max_packet_size"),
    ({"max_bytes": 0}, {"max_bytes": -1}, "max_bytes"),
    ({"max_bytes": 10, "max_bytes_disconnected": 0}, {"max_bytes": 10, "max_bytes_disconnected": 9},
     "max_bytes_disconnected"),
    ({"max_bytes": 10, "max_bytes_disconnected": 10}, {"max_bytes_disconnected": -1}, "max_bytes_disconnected"),
    ({"max_subscriptions_per_client": 0}, {"max_subscriptions_per_client": -1}, "max_subscriptions_per_client"),
    ({"max_subscription_bytes_per_client": 0}, {"max_subscription_bytes_per_client": -1},
     "max_subscription_bytes_per_client"),
    ({"max_pending_clean": 0}, {"max_pending_clean": -1}, "max_pending_clean"),
    ({"max_pending_bytes_clean": 0}, {"max_pending_bytes_clean": -1}, "max_pending_bytes_clean"),
    ({"max_awaiting_pubrel": 0}, {"max_awaiting_pubrel": -1}, "max_awaiting_pubrel"),
    ({"max_stream_entries_per_client": 0}, {"max_stream_entries_per_client": -1}, "max_stream_entries_per_client"),
    ({"max_pending_control_bytes": 0}, {"max_pending_control_bytes": -1}, "max_pending_control_bytes"),
    ({"listen_backlog": 1}, {"listen_backlog": 0}, "listen_backlog"),
    ({"streams": [{"filter": "a/#", "max_count": 1, "max_age": 0}]},
     {"streams": [{"filter": "a/#", "max_count": 0}]}, "streams[0].max_count"),
    ({"streams": [{"filter": "a/+/b"}]}, {"streams": [{"filter": "a/#", "max_age": -1}]}, "streams[0].max_age"),
    ({"streams": [{"filter": "a/#"}, {"filter": "b/#"}]},
     {"streams": [{"filter": "a/#"}, {"filter": "a/#"}]}, "streams[1].filter"),
    ({"overflow": "drop-newest", "session_takeover": "any-user"}, {"overflow": "Drop-Newest"}, "overflow"),
    ({"sync": True, "queue_qos0": True}, {"queue_qos0": "true"}, "queue_qos0"),
    ({"store": "relative/folder"}, {"store": "a\0b"}, "store"),
]


@pytest.mark.parametrize(("accepted", "refused", "key"), EDGES)
def test_each_key_accepts_its_documented_edge_and_refuses_one_step_past_it(
    accepted: dict[str, Any], refused: dict[str, Any], key: str
) -> None:
    """configuration.md, column Accepts: ">= 0", "1 to 65535", ">= max_depth", ... are inclusive."""
    config = DurableConfig.from_mapping(accepted)
    for name, value in accepted.items():
        if name != "streams":
            assert getattr(config, name) == value
    with pytest.raises(ConfigError) as raised:
        DurableConfig.from_mapping(refused)
    assert raised.value.key == key, raised.value
    assert ERROR.match(str(raised.value)), raised.value


@pytest.mark.parametrize(
    ("settings", "key"),
    [
        ({"max_depth": 100.0}, "max_depth"),  # "whole number": not a float, even a whole one
        ({"recovery_buffer": True}, "recovery_buffer"),  # YAML's true is no number
        ({"session_expiry": False}, "session_expiry"),
        ({"batch_delay_ms": math.inf}, "batch_delay_ms"),  # "finite number"
        ({"session_expiry": math.nan}, "session_expiry"),
        ({"connect_timeout": -math.inf}, "connect_timeout"),
        ({"connection_end_wait": math.inf}, "connection_end_wait"),
        ({"streams": [{"filter": "$SYS/#"}]}, "streams[0].filter"),  # "outside $ and _durable/"
        ({"streams": [{"filter": "_durable/x"}]}, "streams[0].filter"),
        ({"streams": [{"filter": "a/#/b"}]}, "streams[0].filter"),  # "a valid filter"
        ({"streams": [{"max_count": 5}]}, "streams[0].filter"),
        ({"streams": [{"filter": "a", "max_size": 5}]}, "streams[0].max_size"),
        ({"streams": ["a/#"]}, "streams[0]"),
        ({"store": 5}, "store"),  # "non-empty path"
    ],
)
def test_values_outside_the_accepts_column_are_refused_naming_the_key(settings: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as raised:
        DurableConfig.from_mapping(settings)
    assert raised.value.key == key, raised.value


def test_a_whole_number_is_taken_where_a_number_is_documented() -> None:
    config = DurableConfig.from_mapping({"session_expiry": 30, "batch_delay_ms": 0, "stream_ack_timeout": 2})
    assert (config.session_expiry, config.batch_delay_ms, config.stream_ack_timeout) == (30.0, 0.0, 2.0)


@pytest.mark.parametrize(("key", "value"), sorted(BAD_VALUES.items()))
def test_every_config_error_reads_as_operations_md_quotes_it(key: str, value: Any) -> None:
    """operations.md: ``amqtt_durable config: '<key>': <problem>``, the key exactly as written."""
    with pytest.raises(ConfigError) as raised:
        DurableConfig.from_mapping({key: value})
    match = ERROR.match(str(raised.value))
    assert match is not None, raised.value
    assert match.group(1) == key or match.group(1).startswith((f"{key}.", f"{key}[")), raised.value


# ------------------------------------------------------------- values no float or C int holds


def _write(folder: Path, text: str | bytes) -> Path:
    path = folder / "bad.yaml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def _refused(folder: Path, text: str | bytes) -> ConfigError:
    """The config error `amqtt-durable broker` stops with for this broker.yaml (load_broker_config
    is what it runs first; test_a_config_error_is_exit_2_without_a_traceback runs the command)."""
    with pytest.raises(ConfigError) as raised:
        load_broker_config(str(_write(folder, text)))
    return raised.value


def _settings(text: str) -> str:
    return f"plugins:\n  {PLUGIN}:\n{text}"


def test_a_number_setting_given_an_integer_no_float_holds_is_a_config_error_naming_it(tmp_path: Path) -> None:
    """A YAML integer of 400 digits for session_expiry ("finite number >= 0") once escaped as an
    OverflowError traceback (exit 1); it is a bad value of that key."""
    huge = "1" + "0" * 400
    for key, text in (
        ("session_expiry", f"    session_expiry: {huge}\n"),
        ("replication.lease_ttl", "    replication:\n      name: a\n"
         f"      coordinator: [http://127.0.0.1:2379]\n      lease_ttl: {huge}\n"),
    ):
        error = _refused(tmp_path, _settings(text))
        assert str(error).startswith(f"amqtt_durable config: '{key}': must be"), error


def test_a_yaml_value_python_cannot_read_is_an_error_naming_its_key(tmp_path: Path) -> None:
    """configuration.md: a bad value stops the broker "with an error that names the key". PyYAML's
    int() of 5,000 digits (past Python's limit) and its date of a 13th month raised ValueError past
    the loader: a traceback, then an error naming only '-c'; now the key and its line."""
    for value in ("9" * 5000, "2026-13-45"):
        error = _refused(tmp_path, _settings(f"    session_expiry: {value}\n"))
        assert error.key == "session_expiry", error
        assert str(error).startswith("amqtt_durable config: 'session_expiry': line 3: a value YAML cannot read: ")


def test_a_config_file_not_utf_8_or_nested_too_deeply_is_not_yaml(tmp_path: Path) -> None:
    """operations.md: exit code 2 for a config file that is "not YAML": bytes that are not UTF-8
    (once reported as a value YAML cannot read) and 3,000 nested lists (once a RecursionError)."""
    not_utf_8 = _refused(tmp_path, _settings("    store: \xff\xfe\n").encode("latin-1"))
    assert str(not_utf_8).startswith(f"amqtt_durable config: '-c': '{tmp_path / 'bad.yaml'}' is not valid YAML "
                                      "(not UTF-8): "), not_utf_8
    deep = _refused(tmp_path, "a: " + "[" * 3000 + "\n")
    assert str(deep) == f"amqtt_durable config: '-c': '{tmp_path / 'bad.yaml'}' is not valid YAML: nested too deeply"


def test_a_path_or_address_with_a_nul_is_a_bad_value_not_a_failed_start(tmp_path: Path) -> None:
    """store ("non-empty path"): a NUL (YAML's "\\0") got past the check and the start failed
    later, exit 1 with just "embedded null byte"; the same for replication's file paths, and
    replication.listen's host (the broker stayed up, its replication never started)."""
    cases = {
        "store": '    store: "data\\0x"\n',
        "replication.secret_file": '    replication:\n      role: primary\n      secret_file: "s\\0x"\n',
        "replication.tls.cert": '    replication:\n      role: primary\n      tls: {cert: "c\\0x", ca: ca.pem}\n',
        "replication.listen": '    replication:\n      role: primary\n      listen: "127.0.0.1\\0x:7883"\n',
    }
    for key, text in cases.items():
        error = _refused(tmp_path, _settings(text))
        assert error.key == key, error
        assert ERROR.match(str(error)), error


def test_a_config_error_is_exit_2_without_a_traceback(tmp_path: Path) -> None:
    """The command itself, once: the error as the key's, exit code 2, no traceback, no store."""
    result = run_cli("broker", "-c", str(_write(tmp_path, _settings(f"    session_expiry: {'9' * 5000}\n"))),
                     cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("amqtt-durable: amqtt_durable config: 'session_expiry': line 3: "), result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "data").exists(), "no store is created for a refused config"


def test_a_lease_longer_than_etcd_grants_is_refused_at_start() -> None:
    base = {"name": "a", "coordinator": ["http://127.0.0.1:2379"]}
    assert DurableConfig.from_mapping({"replication": {**base, "lease_ttl": 9_000_000_000}}).replication
    with pytest.raises(ConfigError, match=re.escape("'replication.lease_ttl': must be at most 9000000000")):
        DurableConfig.from_mapping({"replication": {**base, "lease_ttl": 9_000_000_001}})


def test_extreme_valid_values_start_a_broker_that_serves_and_ctrl_c_stops_it(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """"whole number >= 1" for listen_backlog, capped by the kernel: 2**40 failed the start (listen()
    takes a C int: "signed integer is greater than maximum", exit 1). Every "finite number" at
    1e308 starts too, a durable session still gets what was queued while it was away, and
    operations.md's Ctrl-C (SIGINT) shuts the broker down cleanly, exit status 0."""
    far = 1e308
    broker = broker_factory(
        listen_backlog=2**40,
        session_expiry=far,
        max_session_expiry=far,
        drop_log_interval=far,
        stream_ack_timeout=far,
        connect_timeout=far,
        metrics_interval=far,
        max_depth=2**62,
        max_depth_disconnected=2**63,
    )
    device = clients(broker.port, "far-1")
    device.subscribe("far/t", 1)
    device.disconnect()
    clients(broker.port, "far-pub", clean_session=True).publish("far/t", payloads(3), qos=1)
    assert device.connect() is True and device.session_present is True
    assert [m.payload for m in device.wait_messages(3)] == payloads(3)
    device.disconnect()
    broker.stop_signal = signal.SIGINT
    broker.stop()
    assert broker.exit_status == 0, broker.log()
    assert "Traceback" not in broker.log()


def test_a_listen_backlog_past_a_c_int_also_starts_a_broker_with_a_replication_address(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """The same cap for the replication address's listener: a fixed primary with listen_backlog
    2**40 exited 1 (`replication start: OverflowError(...)`, listen() takes a C int)."""
    broker = broker_factory(
        listen_backlog=2**40, replication={"name": "a", "role": "primary", "listen": f"{HOST}:{free_port()}"}
    )
    assert clients(broker.port, "cap-1", clean_session=True).subscribe("cap/t", 1) == [1]
    assert "broker not started" not in broker.log()


# --------------------------------------------------------------- commands and exit codes


def test_broker_exits_2_for_a_missing_config_file_and_one_without_the_plugin(tmp_path: Path) -> None:
    """operations.md: exit code 2 for a config file that is missing or does not load the plugin."""
    missing = run_cli("broker", "-c", str(tmp_path / "absent.yaml"), cwd=tmp_path)
    assert missing.returncode == 2, missing.stderr
    assert f"cannot read config file '{tmp_path / 'absent.yaml'}'" in missing.stderr
    path = _write(tmp_path, "listeners:\n  default: {type: tcp, bind: '127.0.0.1:1'}\nplugins:\n"
                  "  amqtt.plugins.authentication.AnonymousAuthPlugin: {allow_anonymous: true}\n")
    without = run_cli("broker", "-c", str(path), cwd=tmp_path)
    assert without.returncode == 2, without.stderr
    assert f"does not load {PLUGIN}" in without.stderr
    not_a_mapping = run_cli("broker", "-c", str(_write(tmp_path, "- a\n- b\n")), cwd=tmp_path)
    assert not_a_mapping.returncode == 2, not_a_mapping.stderr


def test_an_empty_plugin_entry_runs_every_default(broker_factory: Callable[..., Broker], tmp_path: Path) -> None:
    """configuration.md: every key is optional; `amqtt_durable.DurableSessionsPlugin:` alone
    (YAML null) is the defaults: the store is ./data/durable, beside where the broker runs."""
    broker = broker_factory(start=False)
    broker.settings = {"metrics_interval": 0}
    broker.write_config()
    text = broker.config_path.read_text()
    broker.config = yaml.safe_load(text)
    broker.config["plugins"][PLUGIN] = None
    broker.config_path.write_text(yaml.safe_dump(broker.config))
    assert DurableConfig.from_mapping(plugin_section(load_broker_config(str(broker.config_path)))) == DurableConfig()
    with (tmp_path / "default.log").open("w") as log:
        child = subprocess.Popen(
            [sys.executable, "-m", "amqtt_durable.cli", "broker", "-c", str(broker.config_path)],
            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=log,
        )
    try:
        deadline = time.monotonic() + WAIT
        while not probe_connack(broker.port) and child.poll() is None and time.monotonic() < deadline:
            threading.Event().wait(0.05)  # bounded poll: the child has no readiness event to wait on
        assert child.poll() is None, f"the broker exited with {child.returncode}"
        assert probe_connack(broker.port)
        assert (tmp_path / "data" / "durable" / "CURRENT").exists()
    finally:
        child.send_signal(signal.SIGTERM)
        try:
            assert child.wait(WAIT) == 0
        finally:
            if child.poll() is None:  # it did not stop in time: no broker is left behind
                child.kill()
                child.wait()


def test_inspect_and_repair_refuse_a_running_broker_s_store_and_it_keeps_serving(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], tmp_path: Path
) -> None:
    """operations.md: inspect (sessions or --retained) and repair need the broker stopped: `store
    '...' is locked by another process`, exit code 1; a folder without a store: `no store at
    '...'`, exit code 1. Stopped, `--json` gives exactly the documented fields, retained rows in
    topic order; a session connected when the broker was killed has no deadline (`-`, null)."""
    broker = broker_factory(metrics_interval=0.05)
    device = clients(broker.port, "insp-1")
    device.subscribe([("insp/b", 1), ("insp/a/#", 2)])
    device.disconnect()
    publisher = clients(broker.port, "insp-pub", clean_session=True)
    publisher.publish("insp/b", payloads(2), qos=1)
    publisher.publish("r/z", [b"zz"], qos=1, retain=True)
    publisher.publish("r/a", [b"a"], qos=0, retain=True)
    for args in (("inspect", broker.store), ("inspect", broker.store, "--retained"), ("repair", broker.store)):
        refused = run_cli(*args)
        assert refused.returncode == 1, (args, refused.stdout, refused.stderr)
        assert f"store '{broker.store}' is locked by another process" in refused.stderr, refused.stderr
    assert probe_connack(broker.port)
    assert device.connect() is True
    assert [m.payload for m in device.wait_messages(2)] == payloads(2)
    device.disconnect()
    seen_away(clients, broker, 1)  # else the kill may come before the broker handled the DISCONNECT
    publisher.publish("insp/b", [b"queued"], qos=1)
    publisher.disconnect()
    clients(broker.port, "insp-2").subscribe("insp/c", 0)  # still connected when the broker is killed
    broker.kill()
    sessions = json.loads(run_cli("inspect", broker.store, "--json").stdout)
    assert [row["client_id"] for row in sessions] == ["insp-1", "insp-2"]
    killed = sessions[1]
    assert (killed["disconnected_at"], killed["expires_at"], killed["subscriptions"]) == (None, None, {"insp/c": 0})
    row = sessions[0]
    assert set(row) == {"client_id", "depth", "bytes", "oldest_age_s", "subscriptions", "disconnected_at",
                        "expires_at", "dropped"}
    assert row["subscriptions"] == {"insp/b": 1, "insp/a/#": 2}
    assert (row["depth"], row["bytes"], row["dropped"]) == (1, len(b"queued"), 0)
    assert row["expires_at"] - row["disconnected_at"] == pytest.approx(300, abs=0.01)
    table = run_cli("inspect", broker.store).stdout.strip().splitlines()
    assert table[-1] == "2 session(s), 1 queued message(s)"
    assert table[-2].split() == ["insp-2", "0", "0", "-", "-", "0", "insp/c@0"], table
    assert "insp/a/#@2" in "".join(table) and "insp/b@1" in "".join(table)
    retained = json.loads(run_cli("inspect", broker.store, "--retained", "--json").stdout)
    assert [(r["topic"], r["qos"], r["bytes"]) for r in retained] == [("r/a", 0, 1), ("r/z", 1, 2)]
    assert all(set(r) == {"topic", "qos", "bytes", "age_s"} for r in retained)
    nowhere = str(tmp_path / "nowhere")
    for args in (("inspect", nowhere), ("repair", nowhere)):
        missing = run_cli(*args)
        assert missing.returncode == 1, (args, missing.stderr)
        assert f"no store at '{nowhere}'" in missing.stderr, missing.stderr


def test_metrics_interval_0_publishes_no_metric(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """configuration.md: metrics_interval 0 turns the $SYS/broker/durable/ metrics off; the
    expiry event topic still comes (it is an event, not a metric)."""
    broker = broker_factory(metrics_interval=0, session_expiry=0.3)
    watcher = clients(broker.port, "watch", clean_session=True)
    watcher.subscribe("$SYS/broker/durable/#", 0)
    device = clients(broker.port, "short-1")
    device.subscribe("s/t", 1)
    device.disconnect()
    assert watcher.wait_for(lambda ms: any(m.topic == "$SYS/broker/durable/expired" for m in ms))
    assert not watcher.wait_for(lambda ms: any(m.topic != "$SYS/broker/durable/expired" for m in ms), timeout=1.0)


def test_debug_flag_logs_at_debug(broker_factory: Callable[..., Broker]) -> None:
    """operations.md: `amqtt-durable broker -c broker.yaml ... -d for debug logs`."""
    broker = broker_factory(start=False)
    broker.argv = [*broker.argv, "-d"]
    broker.start()
    assert probe_connack(broker.port)
    broker.stop()
    assert " DEBUG " in broker.log(), broker.log()[-2000:]


@pytest.mark.skipif(not (Path(sys.executable).parent / "amqtt").exists(), reason="the stock amqtt command")
def test_the_stock_amqtt_command_reports_a_bad_setting_as_operations_md_says(tmp_path: Path) -> None:
    """operations.md, With the stock `amqtt` command: exit code 1, a traceback ending in
    PluginLoadError for a wrong type (look for `wrong value type for field "overflow"`), or in the
    plugin's own error for a value out of range."""
    amqtt = str(Path(sys.executable).parent / "amqtt")
    cases = {
        "overflow: drop-random": ('wrong value type for field "overflow"', "PluginLoadError"),
        "max_depth: 0": ("amqtt_durable config: 'max_depth': must be at least 1", "ConfigError"),
    }
    for setting, (shown, last) in cases.items():
        path = _write(tmp_path, f"listeners:\n  default: {{type: tcp, bind: '{HOST}:{free_port()}'}}\n"
                                f"plugins:\n  {PLUGIN}:\n    store: ./s\n    {setting}\n")
        result = subprocess.run([amqtt, "-c", str(path)], capture_output=True, text=True, timeout=60,
                                cwd=tmp_path, check=False)
        assert result.returncode == 1, result.stderr[-2000:]
        output = result.stdout + result.stderr
        assert shown in output, output[-3000:]
        assert output.strip().splitlines()[-1].startswith(last), output[-500:]


# ---------------------------------------------------------------------------- architecture.md


def test_architecture_md_names_every_module_in_its_package() -> None:
    """docs/architecture.md lists each package's modules; a module it does not name is a gap."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    blocks = re.split(r"^(?=\S)", text, flags=re.M)
    packages = {
        "plugin/amqtt_durable/": ROOT / "plugin" / "amqtt_durable",
        "client_sdk/durable_client/": ROOT / "client_sdk" / "durable_client",
        "pipeline/durable_pipeline/": ROOT / "pipeline" / "durable_pipeline",
        "fleet/durable_fleet/": ROOT / "fleet" / "durable_fleet",
    }
    missing = []
    for header, folder in packages.items():
        block = next(b for b in blocks if b.startswith(header))
        for module in sorted(folder.glob("*.py")):
            if module.name != "__init__.py" and not re.search(rf"(?<![\w/]){re.escape(module.name)}\b", block):
                missing.append(f"{header}{module.name}")
    plugin = next(b for b in blocks if b.startswith("plugin/amqtt_durable/"))
    replication = plugin[plugin.index("replication/"):]
    for module in sorted((ROOT / "plugin" / "amqtt_durable" / "replication").glob("*.py")):
        if module.name != "__init__.py" and not re.search(rf"\b{module.stem}\b", replication):
            missing.append(f"replication/{module.name}")
    assert not missing, missing


def test_broker_yaml_comment_defaults_are_the_code_s() -> None:
    """broker.yaml's comments say "(default N" for settings; each N is the dataclass default."""
    text = (ROOT / "broker.yaml").read_text()
    defaults = DurableConfig()
    said = {
        "session_expiry": r"are kept \(default (\d+)\)",
        "max_depth": r"connected session \(default (\d+)\)",
        "max_depth_disconnected": r"disconnected \(default (\d+),",
        "recovery_buffer": r"per session \(default (\d+), at most 65535\)",
        "batch_delay_ms": r"batch_delay_ms \(default (\d+)\)",
        "pending_threshold": r"pending_threshold\s+#?\s*\(default (\d+)\)",
        "batch_size": r"batch_size \(default (\d+)\)",
        "metrics_interval": r"0 = off, default (\d+)\)",
        "max_session_expiry": r"\(seconds, default\s+#\s+(\d+) = 7 days\)",
        "stream_window": r"per topic before the client's ack \(default (\d+),",
        "stream_ack_timeout": r"sent again \(default (\d+)\)",
        "connect_timeout": r"before it is closed \(default (\d+)\)",
        "connection_end_wait": r"handed over \(default (\d+)\)",
        "max_packet_size": r"\(default (\d+) = 1 MB, at most 268435455\)",
        "max_subscriptions_per_client": r"durable or clean \(default (\d+);",
        "max_subscription_bytes_per_client": r"summed \(default (\d+) = 1 MiB;",
        "max_pending_clean": r"\(default (\d+) and \d+ = 16 MiB;",
        "max_pending_bytes_clean": r"\(default \d+ and (\d+) = 16 MiB;",
        "max_awaiting_pubrel": r"awaiting their PUBREL \(default (\d+);",
        "listen_backlog": r"accepts them \(default (\d+),",
        "max_stream_entries_per_client": r"without\s+#\s+a log \(default (\d+);",
        "max_pending_control_bytes": r"waiting to be handled\s+#\s+\(default (\d+) = 1 MiB;",
    }
    for key, pattern in said.items():
        found = re.search(pattern, text)
        assert found is not None, (key, pattern)
        assert float(found.group(1)) == getattr(defaults, key), key


# ----------------------------------------------------------------------------- benchmarks.md


def test_benchmarks_md_lists_what_make_bench_runs_in_order_and_every_benchmark() -> None:
    """benchmarks.md: "`make bench` runs, in this order, ..."; every bench/bench_*.py is named there,
    and those it says take --quick and --out (and bench_storm's options) have them."""
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    makefile = (ROOT / "Makefile").read_text()
    target = makefile[makefile.index("\nbench:"):]
    target = target[: target.index("\n\n")]
    run = re.findall(r"bench/(bench_\w+\.py)", target)
    said = text[text.index("`make bench` runs, in this order,"):]
    said = said[: said.index(";")]
    assert re.findall(r"`(bench_\w+\.py)`", said) == run
    for script in sorted((ROOT / "bench").glob("bench_*.py")):
        assert script.name in text, script.name
    for name in ("bench_durable.py", "bench_sdk.py", "bench_pipeline.py", "bench_fleet.py", "bench_storm.py"):
        source = (ROOT / "bench" / name).read_text()
        assert '"--quick"' in source and '"--out"' in source, name
    storm = (ROOT / "bench" / "bench_storm.py").read_text()
    assert '"--sessions"' in storm and '"--messages"' in storm


# -------------------------------------------------------------- limits of clean-session sends


def _max_pending_clean_3_and_bytes_100(broker: Broker, clients: Callable[..., Client]) -> None:
    """configuration.md `max_pending_clean`: past N messages waiting for a clean-session connection
    (QoS 1: until acknowledged) a new one is dropped, counted in messages/dropped_clean and logged
    as a WARNING at most once per drop_log_interval; `max_pending_bytes_clean`: the same in payload
    bytes, but a connection with nothing waiting still gets a message larger than the limit."""
    counted = clients(broker.port, "slow-count", clean_session=True, manual_ack=True)
    counted.subscribe("pend/count", 1)
    sized = clients(broker.port, "slow-bytes", clean_session=True, manual_ack=True)
    sized.subscribe("pend/bytes", 1)
    watcher = clients(broker.port, "pend-watch", clean_session=True)
    watcher.subscribe("$SYS/broker/durable/messages/dropped_clean", 0)
    publisher = clients(broker.port, "pend-pub", clean_session=True)
    publisher.publish("pend/count", payloads(5, "c"), qos=1)  # none acknowledged: 3 wait, 2 dropped
    publisher.publish("pend/bytes", [b"L" * 500], qos=1)  # nothing waits: sent although > 100 bytes
    publisher.publish("pend/bytes", [b"s"], qos=1)  # 500 + 1 bytes would wait: dropped
    assert watcher.wait_for(lambda ms: bool(ms) and ms[-1].payload == b"3"), [m.payload for m in watcher.messages]
    assert [m.payload for m in counted.wait_messages(3)] == payloads(3, "c")
    assert [m.payload for m in sized.wait_messages(1)] == [b"L" * 500]
    assert not counted.wait_for(lambda ms: len(ms) > 3, timeout=0.5) and len(sized.messages) == 1
    log = broker.log()
    warnings = [line for line in log.splitlines() if "dropped (the last on" in line]
    assert len(warnings) == 2, warnings  # one per connection, within drop_log_interval
    assert any("slow-count: 1 message(s) dropped" in line and "max_pending_clean 3" in line for line in warnings)
    assert any("slow-bytes: 1 message(s) dropped" in line and "max_pending_bytes_clean 100" in line
               for line in warnings)
    assert all(" WARNING " in line for line in warnings)


# ------------------------------------------------------------------- troubleshooting lines


def test_another_amqtt_version_is_refused_with_the_documented_line(
    broker_factory: Callable[..., Broker], tmp_path: Path
) -> None:
    """operations.md: a wrong amqtt version is a broker that cannot start, exit code 1, and
    Troubleshooting quotes `amqtt_durable was written for amqtt 0.12.1; installed is ...`. The
    broker runs in a real process whose amqtt says it is 0.13.0 (what a pip upgrade would install)."""
    broker = broker_factory(start=False)
    broker.write_config()
    script = (
        "import sys, amqtt; amqtt.__version__ = '0.13.0'; "
        "from durable_fleet.console import console_main; "
        f"sys.argv = ['amqtt-durable', 'broker', '-c', {str(broker.config_path)!r}]; console_main()"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                            check=False, cwd=tmp_path)
    assert result.returncode == 1, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "amqtt-durable: broker not started: amqtt_durable was written for amqtt 0.12.1; installed is 0.13.0"
    ), last
    assert "pip install 'amqtt==0.12.1'" in last
    assert not probe_connack(broker.port)


BROKER_NAMES = {"broker", "_broker"}
"""What the glue calls amqtt's Broker: a name, or an attribute of ``self``."""


def test_every_broker_attribute_the_glue_uses_is_checked_at_start_up() -> None:
    """The version check above also names what another amqtt lacks: every attribute of amqtt's Broker
    the glue reaches for (``broker.X``, ``self.broker.X``, ``self._broker.X``) is in ``_BROKER_INTERNALS``, so an amqtt
    without it refuses to start rather than fail on the first websocket client (``ws_connected``
    was used and not checked). ``plugins_manager`` is not yet set when the plugin checks: amqtt sets
    it once the PluginManager loading this plugin returns; ``start`` (``start_broker``) is the call
    that runs the check."""
    tree = ast.parse((ROOT / "plugin" / "amqtt_durable" / "amqtt_glue.py").read_text())
    used = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and (
            (isinstance(node.value, ast.Name) and node.value.id in BROKER_NAMES)
            or (isinstance(node.value, ast.Attribute) and node.value.attr in BROKER_NAMES)
        )
    }
    assert "stream_connected" in used and "ws_connected" in used, sorted(used)
    assert not (missing := used - {"plugins_manager", "start"} - set(_BROKER_INTERNALS)), sorted(missing)


@pytest.mark.parametrize("role", ["primary", "backup"])
def test_a_replication_address_in_use_stops_the_broker_with_exit_1(
    role: str, broker_factory: Callable[..., Broker], tmp_path: Path
) -> None:
    """operations.md: exit code 1 when the broker cannot start, "a listener's port in use": the
    replication address too (a primary's listener, a backup's for the tools). amqtt runs the
    plugin's post-start as a task whose error nobody read: the broker stayed up for good,
    answering CONNACK 3, with only asyncio's "Task exception was never retrieved"."""
    with socket.socket() as holder:
        holder.bind((HOST, 0))
        holder.listen()
        address = f"{HOST}:{holder.getsockname()[1]}"
        replication = {"name": "a", "role": role, "listen": address}
        if role == "backup":
            replication["primary"] = f"{HOST}:{free_port()}"
        broker = broker_factory(start=False, replication=replication)
        broker.write_config()
        started = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-m", "amqtt_durable.cli", "broker", "-c", str(broker.config_path)],
            capture_output=True, text=True, timeout=60, check=False, cwd=tmp_path,
        )
    assert time.monotonic() - started < WAIT, "the broker took too long to give up"
    assert result.returncode == 1, result.stderr[-3000:]
    reason = f"replication.listen {address}: [Errno {errno.EADDRINUSE}] {os.strerror(errno.EADDRINUSE)}"
    assert result.stderr.strip().splitlines()[-1] == f"amqtt-durable: broker not started: {reason}", result.stderr
    assert f"ERROR amqtt_durable: broker not started: {reason}" in result.stderr
    assert "Task exception was never retrieved" not in result.stderr and "Traceback" not in result.stderr
    assert not probe_connack(broker.port)


def failed_start_with_shutdown(
    broker_factory: Callable[..., Broker], tmp_path: Path, shutdown: str, timeout: float = 60
) -> tuple[subprocess.CompletedProcess[str], str]:
    """`amqtt-durable broker` whose plugin start fails (its replication.listen address in use),
    with amqtt's Broker.shutdown replaced by ``shutdown`` (the text of an ``async def
    shutdown(self)`` that may call ``real``, amqtt's): the process's result and the reason."""
    with socket.socket() as holder:
        holder.bind((HOST, 0))
        holder.listen()
        address = f"{HOST}:{holder.getsockname()[1]}"
        broker = broker_factory(start=False, replication={"name": "a", "role": "primary", "listen": address})
        broker.write_config()
        script = (
            "import asyncio, threading\n"
            "import amqtt.broker\n"
            "real = amqtt.broker.Broker.shutdown\n"
            f"{shutdown}\n"
            "amqtt.broker.Broker.shutdown = shutdown\n"
            "from amqtt_durable.cli import exit_process, main\n"
            f"exit_process(main(['broker', '-c', {str(broker.config_path)!r}]))\n"
        )
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout,
                                check=False, cwd=tmp_path)
    return result, f"replication.listen {address}: [Errno {errno.EADDRINUSE}] {os.strerror(errno.EADDRINUSE)}"


def test_a_start_failure_is_the_last_line_even_when_the_shutdown_after_it_fails(
    broker_factory: Callable[..., Broker], tmp_path: Path
) -> None:
    """Review 90: after a plugin start failure `amqtt-durable broker` shuts the broker down, then
    prints why it did not start; a shutdown that raised (here made to, after amqtt's real one)
    replaced that line with its traceback. Now the shutdown's error is logged and the reason is
    still the last line, with exit code 1."""
    failing = "async def shutdown(self):\n    await real(self)\n    raise RuntimeError('the shutdown failed')"
    result, reason = failed_start_with_shutdown(broker_factory, tmp_path, failing)
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == f"amqtt-durable: broker not started: {reason}", result.stderr
    assert "ERROR amqtt_durable: shutdown after a failed start failed" in result.stderr
    assert "RuntimeError: the shutdown failed" in result.stderr


def test_a_shutdown_after_a_failed_start_that_hangs_is_left_after_its_timeout_and_the_exit_is_1(
    broker_factory: Callable[..., Broker], tmp_path: Path
) -> None:
    """Review: the shutdown after a plugin start failure had no bound; one that hung (here amqtt's
    real shutdown, then a wait in a thread that never ends, as a store close stuck on a dead disk
    would) hung the process for good. Now it is left after FAILED_START_SHUTDOWN_TIMEOUT (shortened
    here), logged, and the process exits 1 with the reason last."""
    hanging = (
        "import amqtt_durable.cli\n"
        "amqtt_durable.cli.FAILED_START_SHUTDOWN_TIMEOUT = 1.0\n"
        "async def shutdown(self):\n    await real(self)\n    await asyncio.to_thread(threading.Event().wait)"
    )
    started = time.monotonic()
    result, reason = failed_start_with_shutdown(broker_factory, tmp_path, hanging, timeout=WAIT)
    assert time.monotonic() - started < WAIT
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == f"amqtt-durable: broker not started: {reason}", result.stderr
    assert "ERROR amqtt_durable: shutdown after a failed start did not end within 1 s" in result.stderr


def test_a_fixed_primary_that_cannot_serve_its_store_exits_1(
    broker_factory: Callable[..., Broker], tmp_path: Path
) -> None:
    """The same start, failing after the listener: a store a backup left half-applied (snapshot
    mark) cannot be a primary's; `role: primary` stayed up answering CONNACK 3, unseen."""
    broker = broker_factory(start=False, replication={"name": "a", "role": "primary",
                                                      "listen": f"{HOST}:{free_port()}"})
    db = open_store(broker.store)
    db.put(SNAPSHOT_MARK_KEY, b"")
    db.close()
    broker.write_config()
    result = subprocess.run(
        [sys.executable, "-m", "amqtt_durable.cli", "broker", "-c", str(broker.config_path)],
        capture_output=True, text=True, timeout=60, check=False, cwd=tmp_path,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith(
        "amqtt-durable: broker not started: replication: a cannot become primary: its store holds a half-applied "
        "snapshot."
    ), result.stderr
    assert "Task exception was never retrieved" not in result.stderr


def test_a_backup_whose_primary_is_unreachable_starts_and_keeps_running(broker_factory: Callable[..., Broker]) -> None:
    """Beside the start failures above: a backup's primary that cannot be reached is not one. It
    starts (the CONNACK 3 of a backup, its tools listener answering) and keeps trying; the
    command does not exit 1 after the start, as it does for its own replication.listen in use."""
    listen, unreachable = f"{HOST}:{free_port()}", f"{HOST}:{free_port()}"
    broker = broker_factory(start=False, replication={"name": "b", "role": "backup", "listen": listen,
                                                      "primary": unreachable})
    broker.spawn()
    tried = f"replication: backup b: channel to {unreachable} ended"
    try:
        # Its second try comes after a backoff, well after the command's check of the start.
        assert broker.wait_until(lambda: broker.log().count(tried) >= 2, WAIT), broker.log()[-3000:]
    except ChildExitedError:
        raise AssertionError(f"the backup exited with {broker.exit_status}:\n{broker.log()[-3000:]}") from None
    assert broker.running, broker.log()[-3000:]
    assert connack_code(broker.port) == 3, "a backup answers CONNACK 3 (server unavailable)"
    assert asyncio.run(ask(listen, Frame.STATUS))["role"] == "backup"
    assert "broker not started" not in broker.log()
    assert broker.running


def test_a_write_probe_left_by_a_crash_is_removed_at_the_next_start(broker_factory: Callable[..., Broker]) -> None:
    """operations.md, When the disk is full: the probe file `durable-write-probe.tmp` is removed at
    once, "or at the next start if a crash left it" (megabytes, on a disk that was full)."""
    broker = broker_factory()
    broker.kill()
    probe = Path(broker.store) / "durable-write-probe.tmp"
    probe.write_bytes(bytes(1 << 20))
    broker.start()
    assert not probe.exists()


def _commented_block(text: str, first: str) -> str:
    """The YAML example commented out in broker.yaml that starts with the line ``first``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == f"#   {first}")
    indent = lines[start].index("#")
    block = []
    for line in lines[start:]:
        if not line.strip().startswith("#   "):
            break
        block.append(line[indent + 2:])
    return "\n".join(block) + "\n"


def test_broker_yaml_s_commented_examples_are_valid_settings(tmp_path: Path) -> None:
    """broker.yaml's commented `streams:` and `replication:` examples load as they are written
    (the secret file and the TLS files replaced by real ones: they are the operator's)."""
    text = (ROOT / "broker.yaml").read_text()
    streams = yaml.safe_load(_commented_block(text, "streams:"))
    assert DurableConfig.from_mapping(streams).streams[0].max_age == 86400
    replication = yaml.safe_load(_commented_block(text, "replication:"))["replication"]
    assert replication.pop("secret_file") == "/etc/amqtt-durable/replication.secret"
    assert replication.pop("tls") == {"cert": "node-a.pem", "ca": "cluster-ca.pem"}
    secret = tmp_path / "replication.secret"
    secret.write_text("0123456789abcdef0123456789abcdef\n")
    config = DurableConfig.from_mapping({"replication": {**replication, "secret_file": str(secret)}}).replication
    assert config is not None
    assert (config.name, config.listen, config.coordinator, config.mode) == (
        "a", "127.0.0.1:7883", ["http://127.0.0.1:2379"], "sync")
    assert config.shared_secret() == b"0123456789abcdef0123456789abcdef"


# ------------------------------------------------------------------------------------ metrics

METRIC = "$SYS/broker/durable/"


def _latest(client: Client, name: str) -> int | None:
    values = [int(m.payload) for m in client.messages if m.topic == METRIC + name]
    return values[-1] if values else None


def test_counters_restart_at_0_and_gauges_read_the_store_after_a_restart(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """operations.md, Metrics: "Counters restart at 0 with the broker"; messages/queued, bytes/queued,
    sessions/disconnected and retained/messages are "now" (the same after a restart)."""
    broker = broker_factory(metrics_interval=0.2)
    device = clients(broker.port, "gauge-1")
    device.subscribe("g/t", 1)
    device.disconnect()
    publisher = clients(broker.port, "gauge-pub", clean_session=True)
    publisher.publish("g/t", [b"12345", b"678"], qos=1)
    publisher.publish("g/r", [b"r"], qos=1, retain=True)
    publisher.disconnect()
    before = {"messages/enqueued": 2, "messages/queued": 2, "bytes/queued": 8, "sessions/disconnected": 1,
              "retained/messages": 1}
    watcher = clients(broker.port, "gauge-watch", clean_session=True)
    watcher.subscribe(METRIC + "#", 0)
    assert watcher.wait_for(lambda _: all(_latest(watcher, k) == v for k, v in before.items())), {
        k: _latest(watcher, k) for k in before
    }
    watcher.disconnect()
    broker.restart(kill=True)
    after = {"messages/enqueued": 0, "messages/sent": 0, "messages/queued": 2, "bytes/queued": 8,
             "sessions/disconnected": 1, "retained/messages": 1}
    again = clients(broker.port, "gauge-watch-2", clean_session=True)
    again.subscribe(METRIC + "#", 0)
    assert again.wait_for(lambda _: all(_latest(again, k) == v for k, v in after.items())), {
        k: _latest(again, k) for k in after
    }


# ------------------------------ max_awaiting_pubrel, max_subscription_bytes_per_client; limits together


def _pubrecs(sock: socket.socket, count: int) -> bytes:
    return read_exactly(sock, 4 * count)


def _max_awaiting_pubrel_2(broker: Broker) -> None:
    """configuration.md `max_awaiting_pubrel`: a QoS 2 PUBLISH with a new packet id past it closes
    the connection unacknowledged (a WARNING names the client and the limit); a re-send of one that
    awaits counts once."""
    sock = raw_connect(broker.port, "hoard-2", clean=True)
    for packet_id in (1, 2):
        sock.sendall(publish_packet(b"aw/t", b"x", 2, packet_id=packet_id))
    assert _pubrecs(sock, 2) == b"\x50\x02\x00\x01\x50\x02\x00\x02"
    resend = publish_packet(b"aw/t", b"x", 2, packet_id=2)
    sock.sendall(bytes((resend[0] | 0x08,)) + resend[1:])
    assert _pubrecs(sock, 1) == b"\x50\x02\x00\x02"
    sock.sendall(publish_packet(b"aw/t", b"x", 2, packet_id=3))
    assert read_until_closed(sock, WAIT) == b""
    sock.close()
    assert any(
        " WARNING " in line and "closing the connection of hoard-2" in line and "max_awaiting_pubrel is 2" in line
        for line in broker.log().splitlines()
    ), broker.log()[-3000:]


def _max_subscription_bytes_per_client_50(broker: Broker, clients: Callable[..., Client]) -> None:
    """configuration.md `max_subscription_bytes_per_client`: the UTF-8 bytes of one client's filters,
    summed, durable or clean session; past it 0x80 for the filters over the limit; re-subscribing to
    a held filter does not count twice."""
    first, second = "a" * 25, "b" * 23 + "\u00e9"  # 25 + 25 bytes (é is 2): 49 characters
    for clean in (False, True):
        device = clients(broker.port, f"bytes-{clean}", clean_session=clean)
        assert device.subscribe([(first, 1), (second, 1)]) == [1, 1]
        assert device.subscribe([(first, 0), ("k", 1)]) == [0, 0x80], clean
    assert "max_subscription_bytes_per_client" in broker.log()


def test_small_limits_as_set(broker_factory: Callable[..., Broker], clients: Callable[..., Client]) -> None:
    """One broker with each limit set small: max_pending_clean and max_pending_bytes_clean,
    max_awaiting_pubrel, max_subscription_bytes_per_client (each check's own clients and topics,
    every filter of the others within the 50 bytes)."""
    broker = broker_factory(max_pending_clean=3, max_pending_bytes_clean=100, drop_log_interval=60,
                            metrics_interval=0.2, max_awaiting_pubrel=2, max_subscription_bytes_per_client=50)
    _max_pending_clean_3_and_bytes_100(broker, clients)
    _max_awaiting_pubrel_2(broker)
    _max_subscription_bytes_per_client_50(broker, clients)


def test_limits_set_to_0_are_no_limit(broker_factory: Callable[..., Broker], clients: Callable[..., Client]) -> None:
    """configuration.md: 0 means no limit for max_awaiting_pubrel (here 1,100 QoS 2 messages
    awaiting their PUBREL, past the default of 1000) and max_subscription_bytes_per_client (1.2 MB
    of filters, past the default 1 MiB)."""
    broker = broker_factory(max_awaiting_pubrel=0, max_subscription_bytes_per_client=0)
    sock = raw_connect(broker.port, "hoard-0", clean=True)
    sock.sendall(b"".join(publish_packet(b"aw/t", b"x", 2, packet_id=i) for i in range(1, 1101)))
    replies = _pubrecs(sock, 1100)
    assert replies[-4:] == b"\x50\x02" + (1100).to_bytes(2, "big")
    sock.close()
    device = clients(broker.port, "bytes-0")
    filters = [(f"{i:02d}/" + "f" * 59_996, 0) for i in range(20)]
    for start in range(0, 20, 5):
        assert device.subscribe(filters[start:start + 5]) == [0] * 5


def test_a_new_store_does_not_claim_to_be_written_by_an_earlier_release(broker_factory: Callable[..., Broker]) -> None:
    """operations.md, Upgrading: the "has no message id mark (written by an earlier release)" lines are
    for a store with queue entries and no mark; a new store's first start logged them too, a false
    alarm for every new broker. Its later starts read the mark."""
    broker = broker_factory()
    broker.restart(kill=False)
    assert f"durable store {broker.store}: 0 session(s)" in broker.log()
    assert "has no message id mark" not in broker.log(), broker.log()


def test_the_one_module_promises_of_architecture_md() -> None:
    """architecture.md: amqtt_glue.py is "the only module that imports amqtt" (cli.py starts the
    broker through its start_broker), _paho.py "the one adapter around paho-mqtt" in the SDK."""
    importing = re.compile(r"^\s*(?:from|import) (amqtt|paho)\b(\S*)", re.M)
    for module in sorted((ROOT / "plugin" / "amqtt_durable").rglob("*.py")):
        found = {m.group(1) + m.group(2) for m in importing.finditer(module.read_text())}
        if module.name != "amqtt_glue.py":
            assert not {f for f in found if f.startswith("amqtt")}, (module, found)
    for module in sorted((ROOT / "client_sdk").rglob("*.py")):
        found = {m.group(1) for m in importing.finditer(module.read_text())}
        assert module.name == "_paho.py" or "paho" not in found, module


def test_messages_sent_counts_re_sends_and_replayed_counts_what_was_queued_before_the_connect(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """operations.md, Metrics: messages/sent counts sends to durable sessions "re-sends included";
    messages/replayed the sends of messages queued before their session connected."""
    broker = broker_factory(metrics_interval=0.2)
    watcher = clients(broker.port, "sent-watch", clean_session=True)
    watcher.subscribe(METRIC + "messages/#", 0)
    device = clients(broker.port, "sent-1", manual_ack=True)
    device.subscribe("sent/t", 1)
    publisher = clients(broker.port, "sent-pub", clean_session=True)
    publisher.publish("sent/t", [b"live"], qos=1)
    assert [m.payload for m in device.wait_messages(1)] == [b"live"]  # never acknowledged
    assert watcher.wait_for(lambda _: _latest(watcher, "messages/sent") == 1)
    assert _latest(watcher, "messages/replayed") == 0
    device.disconnect()
    assert device.connect() is True
    assert device.wait_for(lambda ms: len(ms) == 2)
    assert device.messages[1].payload == b"live" and device.messages[1].dup
    assert watcher.wait_for(
        lambda _: _latest(watcher, "messages/sent") == 2 and _latest(watcher, "messages/replayed") == 1
    ), (_latest(watcher, "messages/sent"), _latest(watcher, "messages/replayed"))


# --------------------------------------------------------------------------- read access (ACL)


def test_with_amqtt_s_acl_a_user_allowed_a_hash_does_not_read_a_itself(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """operations.md, Limitations: read access is SUBSCRIBE-to-the-topic and RECEIVE together, "so
    with that plugin a user allowed `a/#` does not read messages on `a` itself"; and the queued one
    it may not read is dropped and counted in the session's `dropped` (configuration.md)."""
    broker = acl_broker(broker_factory)
    alice = login(clients, broker, "alice-lvl", "alice")
    assert alice.subscribe("secret/#", 1) == [1]  # MQTT: it matches `secret` itself too
    alice.disconnect()
    publisher = login(clients, broker, "pub-lvl", "pub", clean_session=True)
    publisher.publish("secret", [b"parent level"], qos=1)
    publisher.publish("secret/x", [b"child level"], qos=1)
    alice.connect()
    assert alice.wait_for(lambda ms: any(m.topic == "secret/x" for m in ms))
    assert [(m.topic, m.payload) for m in alice.messages] == [("secret/x", b"child level")]
    alice.disconnect()
    broker.stop()
    assert next(row for row in summarize(broker.store) if row.client_id == "alice-lvl").dropped == 1
