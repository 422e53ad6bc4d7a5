"""ReplicationConfig: the `replication:` settings, each problem named by its key."""

from __future__ import annotations

import dataclasses
import ssl
from pathlib import Path
from typing import Any

import pytest
from replication_helpers import cluster_pki

from amqtt_durable.config import DurableConfig
from amqtt_durable.errors import ConfigError
from amqtt_durable.replication.config import ReplicationConfig, TlsConfig

HA = {"coordinator": ["http://127.0.0.1:2379"], "name": "broker-a"}


def test_an_ha_node_and_fixed_roles_are_accepted() -> None:
    config = ReplicationConfig.from_mapping({**HA, "mode": "async", "listen": "0.0.0.0:7883", "lease_ttl": 3,
                                             "loop_wait": 1, "demote_margin": 0.5})
    assert (config.role, config.mode, config.advertised, config.prefix) == (
        "auto", "async", "0.0.0.0:7883", "/amqtt-durable/amqtt-durable/")
    assert config.loop_wait == 1.0
    backup = ReplicationConfig.from_mapping({"role": "backup", "primary": "10.0.0.1:7883"})
    assert backup.coordinator == []
    assert ReplicationConfig.from_mapping({"role": "primary", "advertise": "db1:7883"}).advertised == "db1:7883"
    assert ReplicationConfig.from_mapping({**HA, "coordinator": "http://e:2379"}).coordinator == ["http://e:2379"]
    assert ReplicationConfig.from_mapping({**HA, "coordinator": "http://[::1]:2379"}).coordinator == ["http://[::1]:2379"]
    assert ReplicationConfig.from_mapping({**HA, "coordinator": ["http://e/", "http://f:2379/"]}).coordinator == [
        "http://e/", "http://f:2379/"]
    assert ReplicationConfig.from_mapping({**HA, "snapshot_chunk_bytes": 128 << 20}).snapshot_chunk_bytes == 128 << 20


@pytest.mark.parametrize(
    ("settings", "key", "words"),
    [
        ({}, "replication.role", "needs a coordinator"),
        ({**HA, "role": "primary"}, "replication.role", "must be auto"),
        ({**HA, "name": ""}, "replication.name", "needed with a coordinator"),
        ({**HA, "mode": "semi"}, "replication.mode", "sync, async"),
        ({**HA, "listen": "7883"}, "replication.listen", "host:port"),
        ({**HA, "advertise": "db:0"}, "replication.advertise", "host:port"),
        ({**HA, "coordinator": ["https://e:2379"]}, "replication.coordinator", "etcd client URLs"),
        ({**HA, "coordinator": [2379]}, "replication.coordinator", "list of URLs"),
        ({**HA, "coordinator": ["http://[::1:2379"]}, "replication.coordinator", "'http://[::1:2379' (Invalid IPv6"),
        ({**HA, "coordinator": ["http://127.0.0.1:abc"]}, "replication.coordinator", "'http://127.0.0.1:abc' (Port"),
        ({**HA, "coordinator": ["http://e:2379", "http://e:70000"]}, "replication.coordinator", "'http://e:70000'"),
        ({**HA, "coordinator": ["http://e:0"]}, "replication.coordinator", "(port 0)"),
        # etcd.py uses host and port only: a user, a path or a query was silently ignored
        ({**HA, "coordinator": ["http://root:pw@e:2379"]}, "replication.coordinator", "authentication is not supp"),
        ({**HA, "coordinator": ["http://e:2379/etcd"]}, "replication.coordinator", "'http://e:2379/etcd' (a path"),
        ({**HA, "coordinator": ["http://e:2379?timeout=5"]}, "replication.coordinator", "a path, query or fragment"),
        ({**HA, "coordinator": ["http://e:2379#x"]}, "replication.coordinator", "a path, query or fragment"),
        ({**HA, "coordinator": ["http://e 1:2379"]}, "replication.coordinator", "(a space or NUL in the host)"),
        ({**HA, "coordinator": ["http://\uff4cocalhost:2379"]}, "replication.coordinator", "(a host in non-ASCII"),
        ({**HA, "coordinator": ["http://b\u00fccher.example"]}, "replication.coordinator", "its ASCII xn-- form"),
        ({**HA, "coordinator": ["http://\u212aeeper:2379"]}, "replication.coordinator", "(a host in non-ASCII"),
        ({**HA, "listen": "::1"}, "replication.listen", "brackets"),
        ({"role": "backup", "primary": "2001:db8::10"}, "replication.primary", "brackets"),
        ({**HA, "name": "a\0b"}, "replication.name", "or a control character"),
        (  # a newline or an escape sequence reached the logs and a terminal raw
            {**HA, "name": "a\nb"},
            "replication.name",
            "'a\\nb': a name without '/', '+', '#' or a control character, at most 1024 bytes of UTF-8 (it is one",
        ),
        # a $SYS topic of a 65,500-byte name was longer than MQTT's 65535 bytes: an exception every metrics_interval
        ({**HA, "name": 1025 * "x"}, "replication.name", "or a control character, at most 1024 bytes of UTF-8"),
        ({**HA, "cluster": "a/b"}, "replication.cluster", "without '/'"),
        ({"role": "backup"}, "replication.primary", "needed on a backup"),
        ({"role": "backup", "primary": "db1"}, "replication.primary", "host:port"),
        # str.isdigit() let other digits through: U+0663 was port 3, fullwidth 7883 port 7883, U+00B2 int()'s error
        ({**HA, "listen": "db1:\u0663"}, "replication.listen", "expected host:port"),
        ({**HA, "advertise": "db1:\uff17\uff18\uff18\uff13"}, "replication.advertise", "expected host:port"),
        ({"role": "backup", "primary": "db1:\u00b2"}, "replication.primary", "expected host:port"),
        # a primary that goes unused was not checked at all
        ({"role": "primary", "primary": "::1"}, "replication.primary", "brackets"),
        # a backup following itself retried every 0.5 s, logging "the primary ... closed the channel"
        ({"role": "backup", "primary": "127.0.0.1:7883"}, "replication.primary", "this node's own replication address"),
        (  # a host name's case does not matter
            {"role": "backup", "primary": "DB1:7883", "listen": "db1:7883"},
            "replication.primary",
            "this node's own replication address",
        ),
        (
            {"role": "backup", "primary": "[2001:DB8::1]:7883", "advertise": "[2001:db8::1]:7883"},
            "replication.primary",
            "this node's own replication address",
        ),
        (
            {"role": "backup", "primary": "[::1]:7884", "listen": "[::1]:7884"},
            "replication.primary",
            "'[::1]:7884' is this node's own",
        ),
        ({"role": "backup", "primary": "db2:7883", "advertise": "db2:7883"}, "replication.primary", "own replication"),
        ({"role": "primary", "primary": "db1"}, "replication.primary", "host:port"),
        ({**HA, "primary": "10.0.0.1:7883"}, "replication.primary", "with a coordinator, its lease names the primary"),
        ({**HA, "lease_ttl": 1}, "replication.lease_ttl", "at least 2"),
        ({**HA, "lease_ttl": 2.5}, "replication.lease_ttl", "whole number"),
        ({**HA, "demote_margin": 5}, "replication.demote_margin", "below lease_ttl"),
        ({**HA, "loop_wait": 0}, "replication.loop_wait", "above 0"),
        ({**HA, "loop_wait": 2.5}, "replication.loop_wait", "two renewal attempts"),
        ({**HA, "ack_timeout": float("inf")}, "replication.ack_timeout", "finite"),
        ({**HA, "retained_batches": 0}, "replication.retained_batches", "at least 1"),
        ({**HA, "retained_bytes": 10}, "replication.retained_bytes", "1024"),
        ({**HA, "snapshot_chunk_bytes": True}, "replication.snapshot_chunk_bytes", "whole number"),
        ({**HA, "snapshot_chunk_bytes": 128 << 20 | 1}, "replication.snapshot_chunk_bytes", "at most 134217728"),
        ({**HA, "snapshot_chunk_bytes": 256 << 20}, "replication.snapshot_chunk_bytes", "at most 134217728"),
        ({**HA, "backups": ["a"]}, "replication.backups", "unknown setting"),
        ({**HA, "allow_from": "10.0.0.2"}, "replication.allow_from", "expected a list of IP addresses or CIDR"),
        ({**HA, "allow_from": None}, "replication.allow_from", "expected a list of IP addresses or CIDR"),
        ({**HA, "allow_from": []}, "replication.allow_from", "an empty list would refuse every backup and tool"),
        ({**HA, "allow_from": ["10.0.0.2", 10]}, "replication.allow_from", "got 10 (quote it in YAML)"),
        ({**HA, "allow_from": ["10.0.0.300"]}, "replication.allow_from", "'10.0.0.300' is not an IP address"),
        ({**HA, "allow_from": ["db1.example"]}, "replication.allow_from", "'db1.example' is not an IP address"),
        ({**HA, "allow_from": ["10.0.0.0/33"]}, "replication.allow_from", "'10.0.0.0/33' is not an IP address"),
        (
            {**HA, "allow_from": ["10.0.0.2", "10.0.1.1/24"]},
            "replication.allow_from",
            "'10.0.1.1/24' has host bits set: write the network 10.0.1.0/24 or the single address 10.0.1.1",
        ),
        ({**HA, "allow_from": ["2001:db8::1/64"]}, "replication.allow_from", "network 2001:db8::/64 or the single"),
        (
            {**HA, "allow_from": ["10.0.0.2/0"]},
            "replication.allow_from",
            "'10.0.0.2/0' has host bits set, and a /0 network would be every IPv4 address: write the single "
            "address 10.0.0.2, or the network you mean with its own prefix",
        ),
        ({**HA, "allow_from": ["::1/0"]}, "replication.allow_from", "every IPv6 address: write the single address ::1"),
        (
            {**HA, "allow_from": ["10.0.0.2", "fe80::1%eth0"]},
            "replication.allow_from",
            "'fe80::1%eth0' has a zone (%...), which allow_from cannot check (a peer is matched by its address "
            "alone): write fe80::1, which matches that address on every interface",
        ),
        ({**HA, "allow_from": ["fe80::%eth0/64"]}, "replication.allow_from", "write fe80::/64, which matches"),
        (
            {**HA, "allow_from": ["::ffff:10.0.0.2"]},
            "replication.allow_from",
            "'::ffff:10.0.0.2' is an IPv4-mapped IPv6 address, which no peer has (asyncio's IPv6 listeners take "
            "IPv6 peers only: an IPv4 peer is seen as its IPv4 address): write the IPv4 10.0.0.2",
        ),
        ({**HA, "allow_from": ["::ffff:10.0.1.0/120"]}, "replication.allow_from", "write the IPv4 10.0.1.0/24"),
        ({**HA, "allow_from": ["::ffff:0:0/96"]}, "replication.allow_from", "write the IPv4 0.0.0.0/0"),
    ],
)
def test_a_bad_setting_is_named(settings: dict[str, Any], key: str, words: str) -> None:
    with pytest.raises(ConfigError) as caught:
        ReplicationConfig.from_mapping(settings)
    assert caught.value.key == key
    assert words in caught.value.problem
    if key == "replication.backups" or ("allow_from", None) in settings.items():
        return  # an unknown key is no keyword of the constructor; allow_from=None is its default (any address)
    with pytest.raises(ConfigError) as made:  # the constructor refuses it with the same error
        ReplicationConfig(**settings)
    assert (made.value.key, made.value.problem) == (key, caught.value.problem)


@pytest.mark.parametrize(
    ("settings", "error"),
    [
        ({"lease_ttl": "5"}, "'replication.lease_ttl': expected a whole number, got '5'"),
        ({"lease_ttl": 5.0}, "'replication.lease_ttl': must be written as an integer (5), not 5.0"),
        ({"loop_wait": "1"}, "'replication.loop_wait': expected a number, got '1'"),
        ({"listen": 5}, "'replication.listen': expected text, got 5"),
        ({"secret": 5}, "'replication.secret': expected text, got a value of type int (quote it in YAML)"),
        ({"role": "primary", "coordinator": [5]}, "'replication.coordinator': expected a list of URLs, got [5]"),
        ({"tls": TlsConfig(cert="", ca="ca.pem")}, "'replication.tls.cert': expected a file path, got ''"),
        ({"secret_file": 5}, "'replication.secret_file': expected a file path, got 5"),
        # two bad settings, the mapping's order not the fields': each way names the first field (role)
        ({"lease_ttl": "5", "role": "x"}, "'replication.role': expected one of auto, primary, backup, got 'x'"),
    ],
)
def test_a_config_built_in_code_is_checked_as_a_mapping_with_the_same_error(
    settings: dict[str, Any], error: str
) -> None:
    """configuration.md: ReplicationConfig(...) checks as from_mapping does (a wrong type crashed with a
    TypeError, or was kept: lease_ttl=5.0, which broker.yaml refuses)."""
    settings = {**HA, **settings}
    for build in (
        ReplicationConfig.from_mapping,
        lambda given: ReplicationConfig(**given),
        lambda given: DurableConfig.from_mapping({"replication": given}),  # so DurableConfig refuses it too
        lambda given: DurableConfig(replication=given),  # a mapping given to the constructor
    ):
        with pytest.raises(ConfigError) as caught:
            build(settings)
        assert str(caught.value) == f"amqtt_durable config: {error}"


def test_one_coordinator_url_given_in_code_is_a_list_of_one() -> None:
    """It was read a character at a time ("got 'h'"), as broker.yaml's one URL is not."""
    assert ReplicationConfig(name="a", coordinator="http://x:1").coordinator == ["http://x:1"]
    assert ReplicationConfig(name="a", coordinator="http://x:1") == ReplicationConfig.from_mapping(
        {"name": "a", "coordinator": "http://x:1"}
    )


def test_a_tls_config_given_in_code_has_its_files_read(tmp_path: Path) -> None:
    missing = str(tmp_path / "node.pem")
    tls = TlsConfig(cert=missing, ca=str(tmp_path / "ca.pem"))
    for build in (lambda: ReplicationConfig(role="primary", tls=tls),
                  lambda: ReplicationConfig.from_mapping({"role": "primary", "tls": tls})):  # fmt: skip
        with pytest.raises(ConfigError) as caught:
            build()
        assert caught.value.key == "replication.tls.cert"
        assert caught.value.problem.startswith(f"cannot load the certificate {missing!r} and its key ''")


def test_file_paths_given_as_path_objects_are_held_as_their_text(tmp_path: Path) -> None:
    """configuration.md: tls's cert, key, ca and secret_file take a path object as store does (refused
    since the constructor checked them as a mapping's: "expected a file path, got PosixPath(...)")."""
    pki = cluster_pki(tmp_path)
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    paths = {"cert": Path(pki["node"]), "key": Path(pki["node"]), "ca": Path(pki["ca"])}
    given = TlsConfig(**paths)  # type: ignore[arg-type]  # os.PathLike, as store's str
    made = (
        ReplicationConfig(role="primary", tls=given, secret_file=secret),  # type: ignore[arg-type]
        ReplicationConfig.from_mapping({"role": "primary", "tls": given, "secret_file": secret}),
        ReplicationConfig.from_mapping({"role": "primary", "tls": paths, "secret_file": secret}),
    )
    for config in made:
        assert config.tls == TlsConfig(cert=pki["node"], key=pki["node"], ca=pki["ca"])
        assert config.secret_file == str(secret)
        assert config.shared_secret() == b"s" * 32


def test_coordinator_and_allow_from_take_a_tuple_held_as_a_list() -> None:
    """configuration.md: as streams, given in Python (refused: "expected a list of URLs, got (...)")."""
    for build in (ReplicationConfig.from_mapping, lambda given: ReplicationConfig(**given)):
        config = build({"name": "a", "coordinator": ("http://x:1", "http://y:2"), "allow_from": ("10.0.0.1",)})
        assert (config.coordinator, config.allow_from) == (["http://x:1", "http://y:2"], ["10.0.0.1"])
        assert config == ReplicationConfig.from_mapping(
            {"name": "a", "coordinator": ["http://x:1", "http://y:2"], "allow_from": ["10.0.0.1"]}
        )


def test_tls_files_are_read_once_per_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An encrypted key's passphrase is asked once: from_mapping read them, and the constructor it
    called read them again. The real load_cert_chain, counted."""
    pki = cluster_pki(tmp_path)
    settings = {"cert": pki["node"], "ca": pki["ca"]}
    loads: list[str] = []
    load_cert_chain = ssl.SSLContext.load_cert_chain

    def counted(context: ssl.SSLContext, *args: Any, **kwargs: Any) -> None:
        loads.append(args[0])
        load_cert_chain(context, *args, **kwargs)

    monkeypatch.setattr(ssl.SSLContext, "load_cert_chain", counted)
    for build in (
        lambda: ReplicationConfig.from_mapping({"role": "primary", "tls": settings}),
        lambda: ReplicationConfig.from_mapping({"role": "primary", "tls": TlsConfig(**settings)}),
        lambda: ReplicationConfig(role="primary", tls=TlsConfig(**settings)),
        lambda: DurableConfig.from_mapping({"replication": {"role": "primary", "tls": settings}}).replication,
        lambda: DurableConfig(replication=ReplicationConfig(role="primary", tls=TlsConfig(**settings))).replication,
    ):
        loads.clear()
        config = build()
        assert config is not None and config.tls is not None
        assert loads == [pki["node"]]
        loads.clear()
        dataclasses.replace(config, ack_timeout=3)  # its TlsConfig, read already
        assert loads == []


def test_allow_from_takes_ipv4_and_ipv6_addresses_and_networks_and_defaults_to_any_address() -> None:
    assert ReplicationConfig.from_mapping(HA).allowed_networks() is None
    entries = ["10.0.0.2", "10.0.1.0/24", "2001:db8::/64", "::1", "192.168.0.0/255.255.0.0", "0.0.0.0/0", "::/0"]
    config = ReplicationConfig.from_mapping({**HA, "allow_from": entries})
    assert config.allow_from == entries
    shown = [str(network) for network in config.allowed_networks() or ()]
    assert shown == ["10.0.0.2/32", "10.0.1.0/24", "2001:db8::/64", "::1/128", "192.168.0.0/16", "0.0.0.0/0", "::/0"]


def test_allow_from_is_checked_when_the_config_is_built_in_code_too() -> None:
    with pytest.raises(ConfigError) as caught:
        ReplicationConfig(role="primary", allow_from=[])
    assert caught.value.key == "replication.allow_from" and "an empty list" in caught.value.problem


def test_not_a_mapping() -> None:
    with pytest.raises(ConfigError, match="'replication': expected a mapping"):
        ReplicationConfig.from_mapping(["role"])
