"""replication.tls between real broker processes: a pair with mutual TLS (and a secret)
replicates; a peer without a certificate signed by the cluster's CA, or without TLS, gets
nothing; the tools connect with --config; bad TLS settings are ConfigErrors naming the key."""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from replication_helpers import cluster_pki
from test_ha_brokers import BACKUP, SERVING, address, node, queue_durable_messages, start

from amqtt_durable.errors import ConfigError
from amqtt_durable.replication.config import ReplicationConfig
from amqtt_durable.replication.framing import Frame, Hello, encode_frame
from amqtt_durable.replication.tool import ask
from conftest import WAIT, Broker, Client, run_cli

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, str]:
    """A cluster CA, a certificate for 127.0.0.1 signed by it (key in the same file), and one
    from a stranger's CA."""
    return cluster_pki(tmp_path)


def tls_settings(pki: dict[str, str], **more: Any) -> dict[str, Any]:
    return {"cert": pki["node"], "ca": pki["ca"], **more}


def answer_over_tls(
    replication_address: str, context: ssl.SSLContext | None, frame: bytes = encode_frame(Frame.STATUS)
) -> bytes:
    """A frame (STATUS) sent to the node (over TLS with ``context``): what comes back before the
    connection ends (b"" or an SSL alert: refused)."""
    host, port = replication_address.rsplit(":", 1)
    received = b""
    with socket.create_connection((host, int(port)), timeout=WAIT) as raw:
        sock: socket.socket = context.wrap_socket(raw, server_hostname=host) if context else raw
        try:
            sock.sendall(frame)
            while chunk := sock.recv(65536):
                received += chunk
        except (ssl.SSLError, ConnectionError):
            pass  # the node refused the handshake
    return received


def test_a_tls_pair_replicates_and_peers_without_the_cas_certificate_get_nothing(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], pki: dict[str, str]
) -> None:
    tls = tls_settings(pki)
    primary = start(node(broker_factory, "p", role="primary", tls=tls), SERVING)
    backup = start(node(broker_factory, "b", role="backup", primary=address(primary), tls=tls), BACKUP)
    member = ReplicationConfig.from_mapping({"role": "primary", "tls": tls}).tls
    assert member is not None
    client_context = member.context(server=False)

    def in_sync() -> bool:
        backups = asyncio.run(ask(address(primary), Frame.STATUS, None, client_context))["backups"]
        return bool(backups) and backups[0]["state"] == "in_sync"

    assert primary.wait_until(in_sync, WAIT), primary.log()
    queue_durable_messages(primary, clients, 50)  # sync mode: each PUBACK waited for the backup over TLS

    no_cert = ssl.create_default_context(cafile=pki["ca"])
    stranger = ssl.create_default_context(cafile=pki["ca"])
    stranger.load_cert_chain(pki["stranger"])
    for target in (primary, backup):
        assert answer_over_tls(address(target), no_cert) == b""
        assert answer_over_tls(address(target), stranger) == b""
        assert answer_over_tls(address(target), None) == b""  # plain TCP
    fake_backup = encode_frame(Frame.HELLO, Hello(0, 0, 0, "thief").encode())
    assert answer_over_tls(address(primary), None, fake_backup) == b""  # no snapshot over plain TCP
    assert answer_over_tls(address(primary), no_cert, fake_backup) == b""

    shown = run_cli("inspect", "--replication", address(primary), "--config", str(primary.config_path))
    assert shown.returncode == 0 and "backup b" in shown.stdout and "in_sync" in shown.stdout, shown.stderr
    plain = run_cli("inspect", "--replication", address(primary))
    assert plain.returncode == 1
    queue_durable_messages(primary, clients, 50)
    assert primary.wait_until(in_sync, WAIT), primary.log()


@pytest.mark.parametrize(
    ("tls", "key", "words"),
    [
        ("yes", "replication.tls", "expected a mapping"),
        ({"ca": "CA"}, "replication.tls.cert", "needed with tls"),
        ({"cert": "NODE"}, "replication.tls.ca", "needed with tls"),
        ({"cert": "/nonexistent/node.pem", "ca": "CA"}, "replication.tls.cert", "cannot load the certificate"),
        ({"cert": "NODE", "ca": "/nonexistent/ca.pem"}, "replication.tls.ca", "cannot load the CA"),
        ({"cert": "NODE", "key": "/nonexistent/key.pem", "ca": "CA"}, "replication.tls.key", "cannot load"),
        ({"cert": "CA", "ca": "CA"}, "replication.tls.cert", "cannot load the certificate"),  # no key in it
        ({"cert": "NODE", "ca": "CA", "verify": True}, "replication.tls.verify", "unknown setting"),
        ({"cert": "NODE", "ca": "CA", "check_hostname": "no"}, "replication.tls.check_hostname", "true or false"),
    ],
)
def test_bad_tls_settings_are_config_errors_naming_the_key(
    pki: dict[str, str], tls: Any, key: str, words: str
) -> None:
    if isinstance(tls, dict):
        tls = {name: {"CA": pki["ca"], "NODE": pki["node"]}.get(value, value) for name, value in tls.items()}
    with pytest.raises(ConfigError) as raised:
        ReplicationConfig.from_mapping({"role": "primary", "tls": tls})
    assert raised.value.key == key and words in str(raised.value)
