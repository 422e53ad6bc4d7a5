"""docs/replication.md's promises not pinned by test_docs_promises_ha.py: bad input to the replication
tools (`promote`, `inspect --replication`) and to broker.yaml's `replication:` settings, each
answered with an error naming the problem, and the behaviours below it, against real brokers and a
real etcd."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from amqtt_durable.process import HOST, free_port
from conftest import run_cli

pytestmark = pytest.mark.timeout(120)


def _broker_yaml(folder: Path, replication: Any, name: str = "broker.yaml") -> Path:
    """A broker.yaml whose plugin section holds ``replication`` (left out when it is ...)."""
    plugin: dict[str, Any] = {"store": str(folder / "store")}
    if replication is not ...:
        plugin["replication"] = replication
    path = folder / name
    path.write_text(
        yaml.safe_dump(
            {
                "listeners": {"default": {"type": "tcp", "bind": f"{HOST}:0"}},
                "plugins": {"amqtt_durable.DurableSessionsPlugin": plugin},
            }
        )
    )
    return path


def _tool_cases(folder: Path) -> list[tuple[list[str], int, str]]:
    closed = f"{HOST}:{free_port()}"
    short = folder / "short.secret"
    short.write_text("0123456789\n")
    broken = folder / "broken.yaml"
    broken.write_text("plugins: [\n")
    return [
        (["promote"], 2, "the following arguments are required: HOST:PORT"),
        (["promote", closed, "extra"], 2, "unrecognized arguments: extra"),
        (["promote", closed, "--secret-file"], 2, "argument --secret-file: expected one argument"),
        (["promote", "db1"], 2, "replication address 'db1': expected host:port"),
        (["promote", "127.0.0.1:0"], 2, "expected host:port"),
        (["promote", "[10.0.0.1]:7883"], 2, "expected host:port"),
        (["inspect", "--replication"], 2, "argument --replication: expected one argument"),
        (["inspect", "--replication", closed, "--retained"], 2, "--retained lists a stopped broker's store"),
        (["inspect", str(folder), "--replication", closed], 2, "give a store folder (broker stopped) or --replication"),
        (["promote", closed], 1, f"replication address {closed}: no answer to PROMOTE"),
        (["inspect", "--replication", closed], 1, f"replication address {closed}: no answer to STATUS"),
        # The tools' own options are named as the tools spell them: --config, not the broker's -c.
        (["promote", closed, "--config", str(folder / "absent.yaml")], 1, "'--config': cannot read config file"),
        (["inspect", "--replication", closed, "--config", str(broken)], 1, "'--config': "),
        (["promote", closed, "--config", str(_broker_yaml(folder, ..., "single.yaml"))], 1, "no replication section"),
        (
            ["promote", closed, "--config", str(_broker_yaml(folder, {"role": "primary", "lease_ttl": 1}, "l.yaml"))],
            1,
            "'replication.lease_ttl': must be at least 2 s",
        ),
        (["promote", closed, "--secret-file", str(folder / "absent.secret")], 1, "'--secret-file': cannot read"),
        (["inspect", "--replication", closed, "--secret-file", str(short)], 1, "must be at least 16 bytes, not 10"),
    ]


def test_every_bad_argument_of_the_replication_tools_is_named(tmp_path: Path) -> None:
    """`promote` and `inspect --replication`: a malformed HOST:PORT or a missing argument is a usage
    error (exit 2); a config, secret file or address that does not serve is exit 1 with one line
    naming the option and the problem, never a traceback."""
    for argv, code, words in _tool_cases(tmp_path):
        result = run_cli(*argv)
        assert result.returncode == code, (argv, result.stderr)
        assert words in result.stderr, (argv, result.stderr)
        assert "Traceback" not in result.stderr, (argv, result.stderr)
        if code == 1:
            assert result.stderr.startswith("amqtt-durable: "), (argv, result.stderr)


def _refused(tmp_path: Path, replication: Any) -> str:
    result = run_cli("broker", "-c", str(_broker_yaml(tmp_path, replication)))
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    return result.stderr


ETCD = ["http://127.0.0.1:2379"]


@pytest.mark.parametrize(
    ("replication", "words"),
    [
        ("yes", "'replication': expected a mapping of replication settings"),
        ({"role": "primary", "Lease_ttl": 5}, "'replication.Lease_ttl': unknown setting; accepted settings are role,"),
        ({"role": "Primary"}, "'replication.role': expected one of auto, primary, backup, got 'Primary'"),
        ({"role": "primary", "mode": "SYNC"}, "'replication.mode': expected one of sync, async"),
        ({"role": "primary", "name": 5}, "'replication.name': expected text, got 5"),
        ({"role": "primary", "listen": 7883}, "'replication.listen': expected text, got 7883"),
        ({"role": "primary", "listen": "127.0.0.1:65536"}, "'replication.listen': expected host:port"),
        ({"role": "primary", "advertise": "db1"}, "'replication.advertise': expected host:port"),
        ({"role": "primary", "primary": "::1"}, "'replication.primary': "),
        ({"coordinator": ETCD, "name": "a", "primary": "127.0.0.1:7883"}, "'replication.primary': "),
        ({"coordinator": ETCD, "role": "backup", "name": "a"}, "'replication.role': must be auto with a coordinator"),
        ({"coordinator": None, "role": "primary"}, "'replication.coordinator': expected a list of URLs, got None"),
        ({"coordinator": ["https://127.0.0.1:2379"], "name": "a"}, "'replication.coordinator': expected etcd client"),
        ({"coordinator": ["http://u:p@127.0.0.1:2379"], "name": "a"}, "etcd authentication is not supported"),
        ({"coordinator": ["http://127.0.0.1:2379/v3"], "name": "a"}, "a path, query or fragment"),
        ({"role": "primary", "cluster": 7}, "'replication.cluster': expected text, got 7"),
        ({"role": "primary", "lease_ttl": "5"}, "'replication.lease_ttl': expected a whole number, got '5'"),
        ({"role": "primary", "lease_ttl": -5}, "'replication.lease_ttl': must be at least 2 s"),
        ({"role": "primary", "lease_ttl": 9_000_000_001}, "'replication.lease_ttl': must be at most 9000000000"),
        ({"role": "primary", "loop_wait": -1}, "'replication.loop_wait': must be a finite number of seconds above 0"),
        ({"role": "primary", "loop_wait": None}, "'replication.loop_wait': expected a number, got None"),
        ({"role": "primary", "demote_margin": 0}, "'replication.demote_margin': must be a finite number of seconds"),
        ({"role": "primary", "retained_batches": 1.5}, "'replication.retained_batches': expected a whole number"),
        ({"role": "primary", "retained_batches": -1}, "'replication.retained_batches': must be at least 1, got -1"),
        ({"role": "primary", "retained_bytes": -5}, "'replication.retained_bytes': must be at least 1024 bytes"),
        ({"role": "primary", "ack_timeout": 0}, "'replication.ack_timeout': must be a finite number of seconds"),
        ({"role": "primary", "ack_timeout": "5s"}, "'replication.ack_timeout': expected a number, got '5s'"),
        ({"role": "primary", "snapshot_chunk_bytes": 512}, "'replication.snapshot_chunk_bytes': must be at least 1024"),
        ({"role": "primary", "secret": 1234567890123456789}, "'replication.secret': expected text, got a value"),
        ({"role": "primary", "secret": "short"}, "'replication.secret': must be at least 16 characters"),
        ({"role": "primary", "secret_env": "1ABC"}, "'replication.secret_env': expected the name of an environment"),
        ({"role": "primary", "secret_file": "/nonexistent/x"}, "'replication.secret_file': cannot read the secret"),
        ({"role": "primary", "tls": "on"}, "'replication.tls': expected a mapping with cert, key, ca"),
        ({"role": "primary", "tls": {"cert": "/nonexistent/c.pem"}}, "'replication.tls.ca': needed with tls"),
        ({"role": "primary", "handshake_timeout": -1}, "'replication.handshake_timeout': must be a finite number"),
        ({"role": "primary", "allow_from": "10.0.0.2"}, "'replication.allow_from': expected a list of IP addresses"),
    ],
)
def test_each_bad_replication_setting_stops_the_broker_naming_the_key_and_the_problem(
    tmp_path: Path, replication: Any, words: str
) -> None:
    """Settings: "checked at start-up like every other setting": wrong types, negative or out-of-range
    values, unknown keys, each named (exit code 2, configuration.md)."""
    stderr = _refused(tmp_path, replication)
    assert words in stderr, stderr


def test_a_secret_is_never_echoed_in_a_settings_error(tmp_path: Path) -> None:
    """`secret` (and `secret_env`, which may hold the secret pasted in place of a name) are never shown."""
    pasted = "4f9a1c0e7b2d8a6f3e5c9b1d0a7f2e4c"
    for replication in ({"role": "primary", "secret_env": pasted + "!"}, {"role": "primary", "secret": pasted[:9]}):
        stderr = _refused(tmp_path, replication)
        assert pasted[:9] not in stderr, stderr
