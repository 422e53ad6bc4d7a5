"""A second blind pass over docs/configuration.md and docs/replication.md's Settings, written from the
docs' words only: the replication table's defaults, the edges each replication setting accepts (an
edge is accepted, one step past it refused naming the key), the secret's documented bounds counted
as the docs count them, and the main table's edges test_docs_promises_config.py's EDGES leaves out.

The docs promise: "checked at start-up like every other setting" (replication.md, Settings), an error
"that names the key (exit code 2)" (configuration.md); `loop_wait` is "above 0, at most
`(lease_ttl - demote_margin) / 2`", so a value written as exactly that bound starts a broker.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import socket
import sys
import time
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import yaml
from pwdlib.hashers.argon2 import Argon2Hasher
from test_docs_promises_config import (
    test_each_key_accepts_its_documented_edge_and_refuses_one_step_past_it as edge_check,
)
from test_docs_promises_ha2 import (
    test_each_bad_replication_setting_stops_the_broker_naming_the_key_and_the_problem as bad_replication_cli,
)
from test_docs_promises_ops import _listen_backlog
from test_ha_brokers import SERVING, address, node, start, status
from test_hostile_owner import PASSWORDS
from test_hostile_owner import raw_connect as raw_login

from amqtt_durable.cli import load_broker_config
from amqtt_durable.config import DurableConfig
from amqtt_durable.errors import ConfigError
from amqtt_durable.process import HOST, ChildProcess, free_port
from amqtt_durable.replication.config import ReplicationConfig
from conftest import WAIT, Broker, Client, connack_code, run_cli

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = "amqtt_durable.DurableSessionsPlugin"
SETTINGS_ROW = re.compile(r"^\| `(\w+)` \| (`[^`]*`|absent) \|", re.M)


def _replication_table() -> dict[str, Any]:
    """replication.md's Settings table: key -> default as YAML reads the cell (absent: None)."""
    text = (ROOT / "docs" / "replication.md").read_text()
    table = text.split("\n## Settings\n", 1)[1].split("\n## ", 1)[0]
    rows = SETTINGS_ROW.findall(table)
    return {key: None if cell == "absent" else yaml.safe_load(cell.strip("`")) for key, cell in rows}


def test_the_replication_settings_table_lists_every_key_with_the_code_default() -> None:
    """Settings: the table's Default column is what a broker runs with when the key is left out
    (`role` `auto`, `listen` `127.0.0.1:7883`, `lease_ttl` `5`, `retained_bytes` `67108864`, ...),
    and the table names every key the `replication:` mapping accepts."""
    documented = _replication_table()
    defaults = {
        field.name: field.default_factory() if field.default is dataclasses.MISSING else field.default  # type: ignore[misc]
        for field in dataclasses.fields(ReplicationConfig)
    }
    assert documented == defaults
    # a broker whose only replication setting is its role gets every other default
    loaded = DurableConfig.from_mapping({"replication": {"role": "primary"}}).replication
    assert loaded is not None
    assert {key: getattr(loaded, key) for key in documented if key != "role"} == {
        key: value for key, value in documented.items() if key != "role"
    }


def _bound(lease_ttl: int, demote_margin: float) -> float:
    """(lease_ttl - demote_margin) / 2 as the user reckons it, in decimal, for the numbers as written."""
    return float((Decimal(lease_ttl) - Decimal(repr(demote_margin))) / 2)


# (lease_ttl, demote_margin): loop_wait at exactly (lease_ttl - demote_margin) / 2 is allowed ("at most").
# In binary floating point 2 * 0.45 > 2 - 1.1, so main's check refused most of these with
# "must be at most (lease_ttl - demote_margin) / 2 = 0.45 s ..., got 0.45".
TIMINGS = [(2, 1.1), (2, 1.6), (3, 2.1), (4, 2.7), (5, 4.9), (5, 1.0), (2, 0.5), (6, 4.2)]


@pytest.mark.parametrize(("lease_ttl", "demote_margin"), TIMINGS)
def test_loop_wait_at_exactly_its_documented_bound_is_accepted_and_one_hundredth_more_is_refused(
    lease_ttl: int, demote_margin: float
) -> None:
    """Settings, `loop_wait`: "above 0, at most `(lease_ttl - demote_margin) / 2`"."""
    edge = _bound(lease_ttl, demote_margin)
    base = {"role": "primary", "lease_ttl": lease_ttl, "demote_margin": demote_margin}
    accepted = DurableConfig.from_mapping({"replication": {**base, "loop_wait": edge}}).replication
    assert accepted is not None and accepted.loop_wait == edge
    past = round(edge + 0.01, 2)
    with pytest.raises(ConfigError) as refused:
        DurableConfig.from_mapping({"replication": {**base, "loop_wait": past}})
    assert refused.value.key == "replication.loop_wait", refused.value
    # the error states the bound and the value as written, which differ
    assert f"(lease_ttl - demote_margin) / 2 = {edge:g} s" in str(refused.value), refused.value
    assert str(refused.value).endswith(f"got {past}"), refused.value


def test_a_broker_whose_loop_wait_is_its_documented_bound_starts_and_serves(
    broker_factory: Callable[..., Broker],
) -> None:
    """The same through `amqtt-durable broker -c broker.yaml`: lease_ttl 2, demote_margin 1.1, loop_wait
    0.45 ("at most (2 - 1.1) / 2") is a valid config, so the broker starts (a fixed-role primary: CONNACK 0)
    instead of exiting 2; its tools answer on its replication address."""
    primary = node(broker_factory, "p", role="primary", lease_ttl=2, demote_margin=1.1, loop_wait=0.45)
    start(primary, SERVING)
    shown = status(primary)
    assert shown is not None and shown["role"] == "primary", shown


# ------------------------------------------------------------------ each replication key's edges

EDGES: list[tuple[dict[str, Any], dict[str, Any], str]] = [
    # (accepted at the edge, refused one step past it, the key the refusal names)
    ({"lease_ttl": 2, "loop_wait": 0.5, "demote_margin": 1}, {"lease_ttl": 1}, "lease_ttl"),
    ({"retained_batches": 1}, {"retained_batches": 0}, "retained_batches"),
    ({"retained_bytes": 1024}, {"retained_bytes": 1023}, "retained_bytes"),
    ({"max_backups": 1}, {"max_backups": 0}, "max_backups"),
    ({"snapshot_chunk_bytes": 1024}, {"snapshot_chunk_bytes": 1023}, "snapshot_chunk_bytes"),
    ({"snapshot_chunk_bytes": 134_217_728}, {"snapshot_chunk_bytes": 134_217_729}, "snapshot_chunk_bytes"),
    ({"ack_timeout": 0.001}, {"ack_timeout": 0}, "ack_timeout"),
    ({"catch_up_timeout": 0.001}, {"catch_up_timeout": -1}, "catch_up_timeout"),
    ({"handshake_timeout": 0.001}, {"handshake_timeout": 0}, "handshake_timeout"),
    ({"loop_wait": 0.001}, {"loop_wait": 0}, "loop_wait"),
    ({"demote_margin": 4.999, "loop_wait": 0.0005}, {"demote_margin": 5, "loop_wait": 0.0005}, "demote_margin"),
    ({"demote_margin": 0.001}, {"demote_margin": 0}, "demote_margin"),
    ({"secret": "s" * 16}, {"secret": "s" * 15}, "secret"),
    # "at least 16 characters inline": 8 two-byte characters are 16 bytes but 8 characters
    ({"secret": "\u00e9" * 16}, {"secret": "\u00e9" * 8}, "secret"),
    # "at most 64 KiB ... (inline: its UTF-8 bytes)"
    ({"secret": "s" * 65_536}, {"secret": "s" * 65_537}, "secret"),
    ({"secret": "\u00e9" * 32_768}, {"secret": "\u00e9" * 32_769}, "secret"),
    ({"name": "rack1.node-a_2"}, {"name": "rack1#a"}, "name"),
    # "at most 1024 bytes of UTF-8", "or a control character"
    ({"name": 512 * "\u00e9"}, {"name": 512 * "\u00e9" + "x"}, "name"),
    ({"name": "knoten-\u00e4 \u03a9"}, {"name": "knoten\x1b[2J"}, "name"),
    ({"cluster": "prod.eu-1"}, {"cluster": "prod/eu"}, "cluster"),
    ({"mode": "async"}, {"mode": "Async"}, "mode"),
    ({"listen": "[::1]:7883", "advertise": "db1.example:7883"}, {"listen": "[::1]:0"}, "listen"),
    ({"allow_from": ["0.0.0.0/0", "::/0"]}, {"allow_from": ["10.0.0.2/0"]}, "allow_from"),
]


@pytest.mark.parametrize(("accepted", "refused", "key"), EDGES)
def test_each_replication_setting_accepts_its_documented_edge_and_refuses_one_step_past_it(
    accepted: dict[str, Any], refused: dict[str, Any], key: str
) -> None:
    """Settings: "at least 2, at most 9000000000", "at least 1", "at least 1024, at most 134217728",
    "above 0", "below `lease_ttl`", "at least 16 characters, at most 64 KiB" (inline: its UTF-8 bytes),
    a name "without `/`, `+`, `#`", a cluster "without `/`", "`sync` or `async`", host:port."""
    config = DurableConfig.from_mapping({"replication": {"role": "primary", **accepted}}).replication
    assert config is not None
    for name, value in accepted.items():
        if name != "allow_from":
            assert getattr(config, name) == value
    with pytest.raises(ConfigError) as raised:
        DurableConfig.from_mapping({"replication": {"role": "primary", **refused}})
    assert raised.value.key == f"replication.{key}", raised.value


def test_a_secret_file_is_counted_after_its_surrounding_ascii_whitespace_is_stripped(tmp_path: Path) -> None:
    """`secret_file`: "surrounding ASCII whitespace stripped, at least 16 bytes left"; at most 64 KiB.
    Whitespace that is not ASCII (a no-break space) is part of the secret."""
    cases = [
        (b" \t" + b"k" * 16 + b"\r\n", True),
        (b"\n" + b"k" * 15 + b"\n\n", False),
        (b"\xc2\xa0" + b"k" * 14, True),  # U+00A0 is two bytes of the secret: 16 in all
        (b"k" * 65_536 + b"\n", True),
        (b"k" * 65_537, False),
    ]
    for number, (content, ok) in enumerate(cases):
        path = tmp_path / f"secret{number}"
        path.write_bytes(content)
        settings = {"replication": {"role": "primary", "secret_file": str(path)}}
        if ok:
            assert DurableConfig.from_mapping(settings).replication is not None
            continue
        with pytest.raises(ConfigError) as raised:
            DurableConfig.from_mapping(settings)
        assert raised.value.key == "replication.secret_file", (content[:20], raised.value)


def test_secret_env_set_to_whitespace_alone_is_refused_naming_the_variable_not_its_value() -> None:
    """`secret_env`: "its bytes read exactly as `secret_file`'s: surrounding ASCII whitespace stripped, at
    least 16 bytes left"; "a variable that is not set, is empty or holds fewer than 16 bytes stops the
    broker at start-up with an error naming `replication.secret_env` and the variable's name, never its
    value"."""
    name = "BLIND_CONFIG2_SECRET"
    value = " \t  short-secret!  \n"  # 13 bytes once stripped
    os.environ[name] = value
    try:
        with pytest.raises(ConfigError) as raised:
            DurableConfig.from_mapping({"replication": {"role": "primary", "secret_env": name}})
        assert raised.value.key == "replication.secret_env" and name in str(raised.value), raised.value
        assert "short-secret" not in str(raised.value), raised.value
        os.environ[name] = "\n" + "v" * 16 + "  "
        assert DurableConfig.from_mapping({"replication": {"role": "primary", "secret_env": name}}).replication
    finally:
        del os.environ[name]


def test_two_sources_of_the_secret_are_refused() -> None:
    """`secret_file`, `secret_env`: "set one of `secret`, `secret_file`, `secret_env`"."""
    for pair in ({"secret": "s" * 16, "secret_env": "X"}, {"secret": "s" * 16, "secret_file": "/x"},
                 {"secret_file": "/x", "secret_env": "X"}):  # fmt: skip
        with pytest.raises(ConfigError) as raised:
            DurableConfig.from_mapping({"replication": {"role": "primary", **pair}})
        assert raised.value.key in {f"replication.{key}" for key in pair}, (pair, raised.value)


def test_coordinator_urls_default_to_port_2379_and_take_bracketed_ipv6_hosts() -> None:
    """`coordinator`: "etcd client URLs (`http://host:2379`; port 2379 when left out; an IPv6 host in
    brackets, `http://[::1]:2379`)"; `name` is "needed with a coordinator"; `role` `auto` "needs
    `coordinator`"."""
    for urls in (["http://127.0.0.1"], ["http://[::1]:2379"], ["http://[::1]"], ["http://etcd-1.example:12379"]):
        config = DurableConfig.from_mapping({"replication": {"coordinator": urls, "name": "a"}}).replication
        assert config is not None and config.role == "auto" and config.coordinator == urls
    for settings, key in (({"coordinator": ["http://127.0.0.1"]}, "name"), ({"name": "a"}, "role")):
        with pytest.raises(ConfigError) as raised:
            DurableConfig.from_mapping({"replication": settings})
        assert raised.value.key == f"replication.{key}", raised.value


# ------------------------------------------------------------------ the main table's remaining edges

MAIN_EDGES: list[tuple[dict[str, Any], dict[str, Any], str]] = [
    ({"max_keepalive": 65_535}, {"max_keepalive": -1}, "max_keepalive"),
    ({"max_keepalive": 0}, {"max_keepalive": 1.5}, "max_keepalive"),
    ({"attach_limit": 1}, {"attach_limit": -1}, "attach_limit"),
    ({"max_durable_sessions": 0}, {"max_durable_sessions": -1}, "max_durable_sessions"),
    ({"max_connections_per_address": 0}, {"max_connections_per_address": -1}, "max_connections_per_address"),
    ({"max_session_expiry": 0.5}, {"max_session_expiry": float("inf")}, "max_session_expiry"),
    # "must be >= max_depth": raising max_depth past the default 1000000 alone is refused
    ({"max_depth": 1_000_000}, {"max_depth": 1_000_001}, "max_depth_disconnected"),
    ({"max_bytes": 10}, {"max_bytes": 10, "max_bytes_disconnected": 9}, "max_bytes_disconnected"),
    ({"streams": [{"filter": "#"}]}, {"streams": [{"filter": ""}]}, "streams[0].filter"),
    (
        {"streams": [{"filter": "a/#", "max_count": 1}]},
        {"streams": [{"filter": "a/#", "max_count": 1.5}]},
        "streams[0].max_count",
    ),
]


@pytest.mark.parametrize(("accepted", "refused", "key"), MAIN_EDGES)
def test_each_plugin_setting_accepts_its_documented_edge_and_refuses_one_step_past_it(
    accepted: dict[str, Any], refused: dict[str, Any], key: str
) -> None:
    """configuration.md, column Accepts: "0 to 65535", "whole number >= 1", "whole number >= 0",
    "finite number >= 0", "whole number >= `max_depth`", ">= `max_bytes` when both are set" (a
    max_bytes_disconnected of 0 is none, so max_bytes alone is fine), streams' filter "a valid filter";
    checked as test_docs_promises_config.py checks its EDGES (the error's form included)."""
    edge_check(accepted, refused, key)


def test_a_stream_s_max_count_and_max_age_default_to_100000_and_no_age_limit() -> None:
    """`streams`: "kept up to `max_count` events (default 100000) and `max_age` seconds (default 0: no
    age limit)"."""
    (stream,) = DurableConfig.from_mapping({"streams": [{"filter": "sensors/#"}]}).streams
    assert (stream.filter, stream.max_count, stream.max_age) == ("sensors/#", 100_000, 0)


def test_the_readme_ha_example_is_a_valid_config_and_its_mode_comment_holds(tmp_path: Path) -> None:
    """README, High availability: the yaml block (name, listen, coordinator, mode: sync) loads as
    written; "in `sync` mode (the default)": without `mode` it is sync; `# or async` is accepted."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## High availability", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    settings = yaml.safe_load(block)["plugins"][PLUGIN]
    config = DurableConfig.from_mapping(settings).replication
    assert config is not None
    assert (config.name, config.listen, config.coordinator, config.mode, config.role) == (
        "a", "127.0.0.1:7883", ["http://127.0.0.1:2379"], "sync", "auto")  # fmt: skip
    del settings["replication"]["mode"]
    assert DurableConfig.from_mapping(settings).replication.mode == "sync"  # type: ignore[union-attr]
    settings["replication"]["mode"] = "async"
    assert DurableConfig.from_mapping(settings).replication.mode == "async"  # type: ignore[union-attr]


def test_a_refused_loop_wait_stops_the_real_broker_with_exit_2_naming_it(tmp_path: Path) -> None:
    """configuration.md: a value out of range "stops the broker with an error that names the key (exit
    code 2)", through `amqtt-durable broker -c`, for the replication.loop_wait bound too."""
    config = tmp_path / "broker.yaml"
    replication = {"role": "primary", "lease_ttl": 2, "demote_margin": 1.1, "loop_wait": 0.46}
    config.write_text(yaml.safe_dump({
        "listeners": {"default": {"type": "tcp", "bind": f"{HOST}:0"}},
        "plugins": {PLUGIN: {"store": str(tmp_path / "store"), "replication": replication}},
    }))  # fmt: skip
    with pytest.raises(ConfigError):
        load_broker_config(str(config))
    result = run_cli("broker", "-c", str(config))
    assert result.returncode == 2, result.stderr
    assert "'replication.loop_wait': must be at most (lease_ttl - demote_margin) / 2 = 0.45 s" in result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "store").exists()  # refused before anything was created


def _closed_after(replication_address: str, *, silent: bool) -> float:
    """Open a connection to ``replication_address`` and say nothing: seconds until the node closes it
    (``silent``), or close it at once ourselves (not silent): 0."""
    host, port = replication_address.rsplit(":", 1)
    began = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=4 * WAIT) as sock:
        if not silent:
            return 0.0
        while sock.recv(4096):  # the node closes it: b""; bounded by the socket's timeout
            pass
    return time.monotonic() - began


def test_a_silent_peer_of_the_replication_address_is_cut_off_at_handshake_timeout_and_counted(
    broker_factory: Callable[..., Broker],
) -> None:
    """Settings, `handshake_timeout`: "seconds a peer of a replication address has, from its connection's
    accept, for its first frame ... before it is disconnected". Securing the channel: "A silent peer is one
    still silent at `handshake_timeout`; a peer that closes its connection before then is not refused (an
    INFO line, not counted)"; a refused one is logged as a WARNING `refused a connection from ADDRESS:PORT:
    REASON` and counted: `inspect --replication` shows "connections refused on its replication address since
    start: N", shown once there is one."""
    timeout = 1.5
    primary = start(node(broker_factory, "p", role="primary", handshake_timeout=timeout), SERVING)
    assert _closed_after(address(primary), silent=False) == 0.0  # leaves before its time: not refused
    shown = run_cli("inspect", "--replication", address(primary))
    assert shown.returncode == 0 and "connections refused" not in shown.stdout, shown
    waited = _closed_after(address(primary), silent=True)  # cut off at all: within the socket's 4 * WAIT
    # Not before handshake_timeout: the node's clock starts at its accept, after ours (a loaded machine only
    # makes `waited` longer; 0.2 s spares a timer's rounding). No upper bound: load delays the cut.
    assert waited >= timeout - 0.2, waited
    shown = run_cli("inspect", "--replication", address(primary))
    assert "  connections refused on its replication address since start: 1" in shown.stdout.splitlines(), shown
    warning = re.compile(rf"WARNING .*refused a connection from {re.escape(HOST)}:\d+: \S")
    assert primary.wait_until(lambda: warning.search(primary.log()) is not None, WAIT), primary.log()
    assert connack_code(primary.port) == SERVING  # the node goes on


def test_tls_left_empty_is_no_tls_and_a_mapping_needs_cert_and_ca(tmp_path: Path) -> None:
    """Settings, `tls`: "absent"; "`tls:` left empty (null) is absent, as `replication: null` is: no TLS";
    a mapping of `cert`, `key` (optional), `ca`, `check_hostname` (`false`); "A file that cannot be read or
    loaded is a ConfigError at start-up naming the key (`replication.tls.cert`, `.key`, `.ca`)"."""
    config = tmp_path / "broker.yaml"
    config.write_text(f"plugins:\n  {PLUGIN}:\n    replication:\n      role: primary\n      tls:\n")
    replication = DurableConfig.from_mapping(load_broker_config(str(config))["plugins"][PLUGIN]).replication
    assert replication is not None and replication.tls is None
    config.write_text(f"plugins:\n  {PLUGIN}:\n    replication: null\n")
    assert DurableConfig.from_mapping(load_broker_config(str(config))["plugins"][PLUGIN]).replication is None
    missing = str(tmp_path / "missing.pem")
    for tls, key in (
        ({"ca": missing}, "cert"),
        ({"cert": missing}, "ca"),
        ({"cert": missing, "ca": missing}, "cert"),
        ({"cert": missing, "ca": missing, "check_hostname": "yes"}, "check_hostname"),
        ({"cert": missing, "ca": missing, "certfile": missing}, "certfile"),
    ):
        with pytest.raises(ConfigError) as raised:
            DurableConfig.from_mapping({"replication": {"role": "primary", "tls": tls}})
        assert raised.value.key == f"replication.tls.{key}", (tls, raised.value)


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2) to read a listening socket's backlog")
def test_listen_backlog_is_every_mqtt_listener_s_websocket_ones_included(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """`listen_backlog`: "Connections the kernel holds for each listener, TCP and websocket, and for the
    replication address ... (the listen backlog; amqtt's own and asyncio's are 100)": a reconnect storm over
    websockets meets the same backlog. The websocket listener still serves durable sessions."""
    broker = broker_factory(start=False, listen_backlog=13)
    broker.ws_port = free_port()
    broker.start()
    assert _listen_backlog(broker.port) == _listen_backlog(broker.ws_port) == 13
    device = clients(broker.ws_port, "ws-device", transport="websockets")
    device.subscribe("t/#", 1)
    device.disconnect()  # clean_session=false: its session and subscription stay
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("t/a", [b"queued"])
    again = clients(broker.ws_port, "ws-device", transport="websockets")
    assert again.session_present is True and [m.payload for m in again.wait_messages(1)] == [b"queued"]


def _doc_block(page: str, heading: str) -> str:
    """The first ```yaml block after ``heading`` in docs/``page``."""
    text = (ROOT / "docs" / page).read_text()
    return text.split(heading, 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]


def test_the_topic_acl_example_runs_as_written_from_the_broker_s_folder(
    tmp_path: Path, clients: Callable[..., Client]
) -> None:
    """configuration.md, Topic ACL and read access: the example (FileAuthPlugin with `./passwd` of
    user:argon2-hash lines, amqtt's ACL plugin, `session_takeover: owner-only`) as written, with a listener
    added, started from its folder: "bob connecting with alice's client id: CONNACK 5"; the SUBSCRIBE list
    "decides what its users read" (bob's `secret/#` gets 0x80); alice's durable session gets what was
    published to `secret/...` while she was away; the store is the default `./data/durable` of that folder."""
    block = _doc_block("configuration.md", "## Topic ACL and read access")
    config = yaml.safe_load(block)
    assert config["plugins"][PLUGIN] == {"session_takeover": "owner-only"}
    port = free_port()
    config["listeners"] = {"default": {"type": "tcp", "bind": f"{HOST}:{port}"}}
    (tmp_path / "broker.yaml").write_text(yaml.safe_dump(config))
    hasher = Argon2Hasher(time_cost=1, memory_cost=8, parallelism=1)
    (tmp_path / "passwd").write_text("".join(f"{user}:{hasher.hash(pw)}\n" for user, pw in PASSWORDS.items()))
    broker = ChildProcess(
        [sys.executable, "-m", "durable_fleet.console", "broker", "-c", "broker.yaml"],
        tmp_path / "broker.log",
        preexec_fn=lambda: os.chdir(tmp_path),
    )
    broker.start()
    try:

        def user(client_id: str, name: str, *, clean: bool) -> Client:
            client = clients(port, client_id, clean_session=clean, auto_start=False)
            client.paho.username_pw_set(name, PASSWORDS[name])
            client.connect()
            return client

        assert broker.wait_until(lambda: connack_code(port) is not None, WAIT), (tmp_path / "broker.log").read_text()
        alice = user("alice-1", "alice", clean=False)
        assert alice.connect_reason == 0 and alice.subscribe("secret/#", 1) == [1]
        alice.disconnect()
        assert raw_login(port, "alice-1", "bob") == b"\x20\x02\x00\x05"  # CONNACK 5, then closed
        bob = user("bob-1", "bob", clean=True)
        assert bob.subscribe("secret/#", 1) == [0x80] and bob.subscribe("bob/#", 1) == [1]
        bob.publish("secret/plans", [b"for alice"])
        again = user("alice-1", "alice", clean=False)
        assert again.session_present is True
        assert [m.payload for m in again.wait_messages(1)] == [b"for alice"]
        assert (tmp_path / "data" / "durable" / "CURRENT").exists()
    finally:
        broker.stop()


def test_every_replication_setting_of_the_table_has_a_bad_value_run_through_the_real_cli() -> None:
    """As test_docs_promises_ops.py's BAD_VALUES for the plugin's table: every key of replication.md's
    Settings table has a bad value that test_docs_promises_ha2.py runs through `amqtt-durable broker -c`
    (exit 2, the key and the problem named), so a new replication key cannot go in without one."""
    marks = getattr(bad_replication_cli, "pytestmark", [])
    rows = next(mark for mark in marks if mark.name == "parametrize").args[1]
    named = {found.group(1) for _, words in rows if (found := re.match(r"'replication\.(\w+)'", words))}
    assert set(_replication_table()) <= named, sorted(set(_replication_table()) - named)


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ("plugins:\n  {plugin}:\n    replication:\n      role: primary\n      mode: sync\n      mode: async\n",
         "replication.mode"),
        ("plugins:\n  {plugin}:\n    replication:\n      role: primary\n      tls:\n        cert: a\n        cert: b\n",
         "replication.tls.cert"),
        ("plugins:\n  {plugin}:\n    streams:\n      - filter: a/#\n      - filter: b/#\n        max_age: 1\n"
         "        max_age: 2\n", "streams[1].max_age"),
        ("plugins:\n  - {plugin}:\n      store: a\n      store: b\n", "store"),
        ("listeners:\n  default:\n    type: tcp\n    bind: 127.0.0.1:1\n    bind: 127.0.0.1:2\n"
         "plugins:\n  {plugin}:\n", "listeners.default.bind"),
        ("plugins:\n  {plugin}:\n    store: a\n  {plugin}:\n    store: b\n", f"plugins.{PLUGIN}"),
        ("plugins:\n  - {plugin}:\n      store: a\n    {plugin}:\n      store: b\n", f"plugins[0].{PLUGIN}"),
    ],
)  # fmt: skip
def test_a_key_given_twice_is_named_as_the_settings_are(tmp_path: Path, body: str, named: str) -> None:
    """configuration.md: "a key given twice in one mapping (anywhere in the file ...) stops the broker with an
    error that names the key (exit code 2)"; the `replication` row: its settings are "each named
    `replication.<key>` in errors" (a duplicated `mode` was named `'mode'`, its path lost)."""
    config = tmp_path / "broker.yaml"
    config.write_text(body.format(plugin=PLUGIN))
    with pytest.raises(ConfigError) as raised:
        load_broker_config(str(config))
    assert raised.value.key == named, raised.value
    assert re.search(rf"'{re.escape(named)}': given twice in one mapping \(lines \d+ and \d+\)", str(raised.value))


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ("plugins:\n  {plugin}:\n    <<: {{store: {a}, store: {b}}}\n", "<<.store"),
        ("plugins:\n  {plugin}:\n    <<: [&m {{store: {a}, store: {b}}}]\n", "<<[0].store"),
        ("shared:\n  <<: &m {{x: 1, x: 2}}\nplugins:\n  {plugin}:\n    <<: *m\n    store: {a}\n", "shared.<<.x"),
    ],
)
def test_a_key_given_twice_in_a_merged_mapping_stops_the_real_broker_naming_it_where_written(
    tmp_path: Path, body: str, named: str
) -> None:
    """configuration.md: "a key given twice in one mapping (anywhere in the file, a mapping merged with
    `<<:` too, named where it is written ...)" stops the broker (exit 2); PyYAML reads a merged
    mapping's pairs itself, and the second `store:` was used unseen."""
    config = tmp_path / "broker.yaml"
    first, second = tmp_path / "first", tmp_path / "second"
    config.write_text(body.format(plugin=PLUGIN, a=first, b=second))
    result = run_cli("broker", "-c", str(config))
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"'{named}': given twice in one mapping (lines " in result.stderr, result.stderr[-3000:]
    assert not first.exists() and not second.exists()


def test_the_plugin_listed_in_two_items_of_plugins_stops_the_real_broker_naming_the_second(tmp_path: Path) -> None:
    """configuration.md: the plugin "listed in two items of a `plugins:` list" stops the broker (exit 2)
    naming `plugins[1].amqtt_durable.DurableSessionsPlugin`; the second item's store was used unseen."""
    config = tmp_path / "broker.yaml"
    first, second = tmp_path / "first", tmp_path / "second"
    config.write_text(f"plugins:\n  - {PLUGIN}:\n      store: {first}\n  - {PLUGIN}:\n      store: {second}\n")
    result = run_cli("broker", "-c", str(config))
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"'plugins[1].{PLUGIN}': given twice" in result.stderr, result.stderr[-3000:]
    assert not first.exists() and not second.exists()


@pytest.mark.timeout(20)
def test_lists_made_of_aliased_lists_load_at_once(tmp_path: Path) -> None:
    """Naming each mapping's place for errors walks every list once: 9 levels of a list made of 10
    aliases of the level below (10^9 paths if each alias were walked again; plain YAML loads it at once)."""
    levels = ["l0: &l0 [1, 2]"] + [f"l{n}: &l{n} [{', '.join([f'*l{n - 1}'] * 10)}]" for n in range(1, 10)]
    config = tmp_path / "broker.yaml"
    config.write_text("\n".join(levels) + f"\nplugins:\n  {PLUGIN}:\n")
    loaded = load_broker_config(str(config))
    assert loaded["l9"][3][9][0][0][0][0][0][0][0] == loaded["l0"] == [1, 2]


@pytest.mark.timeout(20)
def test_a_list_that_holds_itself_loads_as_yaml_reads_it(tmp_path: Path) -> None:
    """`x: &s [*s]` is valid YAML (a list holding itself), not one nested too deeply: it loads."""
    config = tmp_path / "broker.yaml"
    config.write_text(f"x: &s [*s, 1]\nm: &m {{self: *m}}\nplugins:\n  {PLUGIN}:\n")
    loaded = load_broker_config(str(config))
    assert loaded["x"][0] is loaded["x"] and loaded["x"][1] == 1
    assert loaded["m"]["self"] is loaded["m"]


@pytest.mark.parametrize(
    ("lease_ttl", "demote_margin", "loop_wait", "under"),
    [(9_000_000_000, 1e-300, 4.5e9, 4.4e9), (2, 5e-324, 1.0, 0.99)],
)
def test_loop_wait_is_compared_with_its_bound_exactly_whatever_the_digits(
    lease_ttl: float, demote_margin: float, loop_wait: float, under: float
) -> None:
    """`loop_wait` "at most `(lease_ttl - demote_margin) / 2`" however many digits it takes to tell:
    (9000000000 - 1e-300) / 2 is below 4.5e9, which 28-digit decimals rounded to equal; and the bound
    the error shows is below the value refused (rounded half-even it read "= 4500000000 s ... got
    4500000000.0")."""
    replication = {"role": "primary", "lease_ttl": lease_ttl, "demote_margin": demote_margin, "loop_wait": loop_wait}
    with pytest.raises(ConfigError) as refused:
        DurableConfig.from_mapping({"replication": replication})
    assert refused.value.key == "replication.loop_wait", refused.value
    assert str(refused.value).endswith(f"got {loop_wait}"), refused.value
    shown = re.search(r"/ 2 = (\S+) s", str(refused.value))
    assert shown is not None and Decimal(shown[1]) < Decimal(repr(loop_wait)), refused.value
    accepted = DurableConfig.from_mapping({"replication": {**replication, "loop_wait": under}}).replication
    assert accepted is not None and accepted.loop_wait == under


HUGE = "0x" + "f" * 4000  # an int of 4,817 decimal digits: Python's str() refuses ints over 4,300 digits


@pytest.mark.parametrize(
    ("section", "named"),
    [
        ({"max_keepalive": HUGE}, "max_keepalive"),
        ({"stream_window": HUGE}, "stream_window"),
        ({"max_packet_size": HUGE}, "max_packet_size"),
        ({"replication": {"role": "primary", "lease_ttl": HUGE}}, "replication.lease_ttl"),
        ({"replication": {"role": "primary", "snapshot_chunk_bytes": HUGE}}, "replication.snapshot_chunk_bytes"),
    ],
)
def test_an_integer_too_long_to_print_stops_the_real_broker_with_exit_2_naming_it(
    tmp_path: Path, section: dict[str, Any], named: str
) -> None:
    """configuration.md: a value out of range "stops the broker with an error that names the key (exit
    code 2)"; a hexadecimal integer of thousands of digits too (it crashed with a traceback, exit 1,
    showing it in the error)."""
    config = tmp_path / "broker.yaml"
    text = yaml.safe_dump({
        "listeners": {"default": {"type": "tcp", "bind": f"{HOST}:0"}},
        "plugins": {PLUGIN: {"store": str(tmp_path / "store"), **section}},
    })  # fmt: skip
    config.write_text(text.replace(f"'{HUGE}'", HUGE))
    result = run_cli("broker", "-c", str(config))
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"'{named}': " in result.stderr and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert len(result.stderr) < 1000, result.stderr[-3000:]


@pytest.mark.parametrize("written", [HUGE, "1" * 4301, "-1_" + "0" * 4300])
@pytest.mark.parametrize(("interpreter", "limit"), [("0", 4300), ("640", 640), ("10000", 4300)])
def test_a_too_long_integer_is_refused_whatever_python_converts(
    tmp_path: Path, interpreter: str, limit: int, written: str
) -> None:
    """broker.yaml's reader counts the digits itself: a hexadecimal integer of 4,817 digits, or a decimal
    one past the limit, stops the broker with exit 2 naming the key and the limit in a short message, with
    PYTHONINTMAXSTRDIGITS=0 (Python's own limit off: it printed all 4,817 digits), with 640 (that limit
    named: it crashed, exit 1; a decimal one got Python's own message) and with 10000 (4300 kept)."""
    config = tmp_path / "broker.yaml"
    config.write_text(f"plugins:\n  {PLUGIN}:\n    store: {tmp_path / 'store'}\n    max_keepalive: {written}\n")
    result = run_cli("broker", "-c", str(config), env={**os.environ, "PYTHONINTMAXSTRDIGITS": interpreter})
    assert result.returncode == 2, result.stderr[-3000:]
    assert "'max_keepalive'" in result.stderr and f"an integer of more than {limit} digits" in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr) < 1000, result.stderr[-3000:]


@pytest.mark.parametrize(
    ("place", "line"),
    [(f"extra: [1, {HUGE}]\n", 1), (f"extra:\n  - 1\n  - {HUGE}\n", 3), (f"extra:\n  ? {HUGE}\n  : 1\n", 2)],
)
def test_an_integer_too_long_to_print_in_a_list_or_as_a_key_is_given_its_line(
    tmp_path: Path, place: str, line: int
) -> None:
    """An over-long integer with no key name to show (an item of a list, a key itself) stops the real
    broker with exit 2 naming its line (the error named only the file)."""
    config = tmp_path / "broker.yaml"
    config.write_text(place + f"plugins:\n  {PLUGIN}:\n    store: {tmp_path / 'store'}\n")
    result = run_cli("broker", "-c", str(config))
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"'-c': '{config}' line {line}: a value YAML cannot read: an integer of more than " in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr) < 1000, result.stderr[-3000:]
    assert not (tmp_path / "store").exists()
