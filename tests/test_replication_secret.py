"""replication.secret between real broker processes: the attacks of issue 12 on the replication
address (copy the store as a fake backup, promote a fixed-role backup, replay a handshake, hold a
connection open) are refused, while the real backup stays in sync and clients get their PUBACKs;
the tools authenticate with --secret-file or --config; a mismatched pair says why on both sides;
the secret can come from an environment variable (secret_env), whose value no error shows."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_ha_brokers import BACKUP, SERVING, address, assert_queue_served, node, queue_durable_messages, start

from amqtt_durable.replication.auth import NONCE_BYTES, Session, client_proof, session_keys
from amqtt_durable.replication.framing import Frame, Hello, encode_frame
from amqtt_durable.replication.tool import ask
from conftest import WAIT, Broker, Client, connack_code, payloads, run_cli

pytestmark = pytest.mark.timeout(120)

SECRET = "replication-secret-for-the-tests-0123456789"


def status(broker: Broker, secret: str | None = SECRET) -> dict[str, Any]:
    return asyncio.run(ask(address(broker), Frame.STATUS, secret.encode() if secret else None))


def wait_in_sync(primary: Broker) -> None:
    def ok() -> bool:
        backups = status(primary)["backups"]
        return bool(backups) and backups[0]["state"] == "in_sync"

    assert primary.wait_until(ok, WAIT), primary.log()


def talk(replication_address: str, *frames: bytes, answers: int = 0) -> bytes:
    """Send ``frames`` to a node's replication address; everything it sends back until it closes
    the connection (bounded by the socket timeout)."""
    host, port = replication_address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=WAIT) as sock:
        sock.sendall(b"".join(frames))
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    return received


def handshake_bytes(replication_address: str) -> list[bytes]:
    """An honest handshake (this test knows the secret), as an eavesdropper records it: the
    client's frames; the node accepts this connection."""
    host, port = replication_address.rsplit(":", 1)
    nonce = b"r" * NONCE_BYTES
    with socket.create_connection((host, int(port)), timeout=WAIT) as sock:
        sock.sendall(encode_frame(Frame.AUTH, nonce))
        head = b""
        while len(head) < 5 + NONCE_BYTES + 32 + 4:
            head += sock.recv(4096)
        server_nonce = head[5 : 5 + NONCE_BYTES]
        proof = encode_frame(Frame.AUTH, client_proof(SECRET.encode(), nonce, server_nonce))
        to_node, _ = session_keys(SECRET.encode(), nonce, server_nonce)
        status_frame = Session(send_key=to_node).encode(Frame.STATUS)  # MACed, as every frame after it
        sock.sendall(proof + status_frame)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer[:1] == bytes([Frame.STATUS]), answer  # the recorded handshake was a good one
    return [encode_frame(Frame.AUTH, nonce), proof, status_frame]


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    path = tmp_path / "replication.secret"
    path.write_text(SECRET + "\n")
    return path


def test_a_secured_pair_refuses_every_attack_and_goes_on_replicating(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], secret_file: Path
) -> None:
    primary = start(node(broker_factory, "p", role="primary", secret_file=str(secret_file)), SERVING)
    backup = start(
        node(broker_factory, "b", role="backup", primary=address(primary), secret=SECRET, handshake_timeout=1.0),
        BACKUP,
    )
    wait_in_sync(primary)
    queue_durable_messages(primary, clients, 100)  # sync mode: each PUBACK waited for the backup

    # A fake backup asks for a snapshot of the store: one ERROR frame, no store byte.
    fake_hello = encode_frame(Frame.HELLO, Hello(0, 0, 0, "thief").encode())
    answered = talk(address(primary), fake_hello)
    assert answered[:1] == bytes([Frame.ERROR]) and b"authentication required" in answered
    assert bytes([Frame.SNAP_BEGIN]) + bytes(4) not in answered and b"body" not in answered
    # A wrong secret, and a recorded handshake replayed: refused.
    wrong = encode_frame(Frame.AUTH, b"w" * NONCE_BYTES)
    assert talk(address(primary), wrong, encode_frame(Frame.AUTH, b"x" * 32), fake_hello).endswith(
        encode_frame(Frame.ERROR, b"authentication failed: wrong replication secret")
    )
    replayed = talk(address(primary), *handshake_bytes(address(primary)))
    challenge = 5 + NONCE_BYTES + 32 + 4  # the node's AUTH frame (a fresh nonce), then its refusal, no STATUS
    assert replayed[:1] == bytes([Frame.AUTH])
    assert replayed[challenge:] == encode_frame(Frame.ERROR, b"authentication failed: wrong replication secret")
    # PROMOTE without the secret, to the fixed-role backup: refused, and it stays a backup.
    refused = run_cli("promote", address(backup))
    assert refused.returncode == 1 and "authentication required" in refused.stderr
    assert talk(address(backup), encode_frame(Frame.PROMOTE))[:1] == bytes([Frame.ERROR])
    assert status(backup)["role"] == "backup" and connack_code(backup.port) == BACKUP
    # A silent peer is cut after the handshake timeout (1 s on the backup), not held open.
    assert talk(address(backup)) == b""
    assert "the handshake was not completed within 1 s" in backup.log()

    for log in (primary.log(), backup.log()):
        assert "WARNING" in log and "refused a connection from 127.0.0.1:" in log
    queue_durable_messages(primary, clients, 100)  # more PUBACKs, each waited for the backup
    wait_in_sync(primary)

    # The tools, with the secret: inspect, then promote once the primary is gone.
    shown = run_cli("inspect", "--replication", address(primary), "--secret-file", str(secret_file))
    assert shown.returncode == 0 and "backup b" in shown.stdout and "in_sync" in shown.stdout, shown.stderr
    primary.kill()
    promoted = run_cli("promote", address(backup), "--config", str(backup.config_path))
    assert promoted.returncode == 0, promoted.stderr
    assert backup.wait_until(lambda: connack_code(backup.port) == SERVING, WAIT), backup.log()
    assert_queue_served(backup, clients, 100)  # the first 100 were delivered by the second queueing


def test_a_mismatched_or_wrong_secret_is_a_clear_error_on_both_sides_not_a_hang(
    broker_factory: Callable[..., Broker], secret_file: Path
) -> None:
    primary = start(node(broker_factory, "p", role="primary", secret_file=str(secret_file)), SERVING)
    without = start(node(broker_factory, "b1", role="backup", primary=address(primary)), BACKUP)
    wrong = start(
        node(broker_factory, "b2", role="backup", primary=address(primary), secret="another-secret-0123456789"),
        BACKUP,
    )
    assert without.wait_until(lambda: "authentication required" in without.log(), WAIT), without.log()
    assert wrong.wait_until(lambda: "do not share the replication secret" in wrong.log(), WAIT), wrong.log()
    assert primary.wait_until(lambda: "the peer refused this node" in primary.log(), WAIT), primary.log()
    assert status(primary)["backups"] == []
    # The other way round: a backup with a secret, a primary without one.
    open_primary = start(node(broker_factory, "q", role="primary"), SERVING)
    secured = start(node(broker_factory, "b3", role="backup", primary=address(open_primary), secret=SECRET), BACKUP)
    assert secured.wait_until(lambda: "this node has none set" in secured.log(), WAIT), secured.log()
    assert "this node has none set" in open_primary.log()
    assert status(open_primary, None)["backups"] == []


def closed_by_node(sock: socket.socket) -> bool:
    """Whether the node closed ``sock`` (EOF, or a reset for a connection it aborted)."""
    try:
        return sock.recv(1) == b""
    except ConnectionError:
        return True


def test_a_flood_of_idle_connections_leaves_the_pair_in_sync_the_clients_served_and_the_log_short(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], secret_file: Path
) -> None:
    """Review F2: idle connections to a primary's replication address were each held for
    handshake_timeout and each logged when refused (a flood took the file descriptors and wrote
    megabytes of log). Three waves of 200: meanwhile the backup stays in sync and clients get
    their CONNACK and PUBACKs (sync mode: each waited for the backup); every connection is closed
    (most at once); the log names a refusal once and sums up the rest; STATUS counts them all; and
    the backup, restarted once the flood is over, syncs again."""
    primary = start(
        node(broker_factory, "p", role="primary", secret_file=str(secret_file), handshake_timeout=0.5), SERVING
    )
    backup = start(node(broker_factory, "b", role="backup", primary=address(primary), secret=SECRET), BACKUP)
    wait_in_sync(primary)
    host, port = address(primary).rsplit(":", 1)
    flood, waves = 200, 3
    publisher = clients(primary.port, "publisher", clean_session=True)
    for wave in range(waves):
        idle = [socket.create_connection((host, int(port)), timeout=WAIT) for _ in range(flood)]
        try:
            assert connack_code(primary.port) == SERVING
            publisher.publish("t/flood", payloads(20, prefix=f"w{wave}"))  # each PUBACK waited for the backup
            assert all(closed_by_node(sock) for sock in idle)
        finally:
            for sock in idle:
                sock.close()
    wait_in_sync(primary)
    shown = status(primary)
    assert shown["refused"] == waves * flood, shown
    log = primary.log()
    named = [line for line in log.splitlines() if "refused a connection from" in line]
    assert 1 <= len(named) <= waves, named  # one per address in 10 s (the waves may span two); the old code: 600
    assert len([line for line in log.splitlines() if "connection from" in line and " at once" in line]) <= waves
    assert "Too many open files" not in log and "Traceback" not in log

    backup.stop()
    start(backup, BACKUP)
    # The backup's own word: the primary may still show the old link in sync for a moment.
    assert backup.wait_until(lambda: status(backup)["caught_up"] is True, WAIT), backup.log()
    wait_in_sync(primary)


SECRET_VAR = "AMQTT_DURABLE_TEST_REPLICATION_SECRET"


def environment(**variables: str | None) -> dict[str, str]:
    """Ours, with ``variables`` set (None: removed)."""
    env = {key: value for key, value in os.environ.items() if key not in variables}
    env.update({key: value for key, value in variables.items() if value is not None})
    return env


def test_a_pair_reading_the_secret_from_environment_variables_replicates_and_the_tools_read_it_too(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], tmp_path: Path
) -> None:
    """Issue 12's containers: replication.secret_env names a variable holding the secret, on each
    member its own name; a backup whose variable holds another secret is refused; inspect with
    --config reads the variable from its own environment; with --secret-file too, inspect and
    promote read the file and not the variable (unset there)."""
    primary = node(broker_factory, "p", role="primary", secret_env=SECRET_VAR)
    primary.env = environment(**{SECRET_VAR: SECRET + "\n"})  # surrounding whitespace stripped
    start(primary, SERVING)
    backup = node(broker_factory, "b", role="backup", primary=address(primary), secret_env="B_SECRET")
    backup.env = environment(B_SECRET=SECRET)
    start(backup, BACKUP)
    stranger = node(broker_factory, "s", role="backup", primary=address(primary), secret_env="S_SECRET")
    stranger.env = environment(S_SECRET="another-secret-0123456789")
    start(stranger, BACKUP)
    wait_in_sync(primary)  # status() authenticates with SECRET: the primary holds it
    queue_durable_messages(primary, clients, 50)  # sync mode: each PUBACK waited for the backup
    assert stranger.wait_until(lambda: "do not share the replication secret" in stranger.log(), WAIT)
    assert [row["name"] for row in status(primary)["backups"]] == ["b"]

    shown = run_cli("inspect", "--replication", address(primary), "--config", str(primary.config_path),
                    env=environment(**{SECRET_VAR: SECRET}))  # fmt: skip
    assert shown.returncode == 0 and "backup b" in shown.stdout and "in_sync" in shown.stdout, shown.stderr
    unset = run_cli("inspect", "--replication", address(primary), "--config", str(primary.config_path),
                    env=environment(**{SECRET_VAR: None}))  # fmt: skip
    assert unset.returncode == 1
    assert f"'replication.secret_env': the environment variable '{SECRET_VAR}' is not set" in unset.stderr
    # --secret-file wins: the config's secret_env is not read, so its variable need not be set.
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET)
    by_file = run_cli("inspect", "--replication", address(primary), "--config", str(primary.config_path),
                      "--secret-file", str(secret_file), env=environment(**{SECRET_VAR: None}))  # fmt: skip
    assert by_file.returncode == 0 and "backup b" in by_file.stdout, by_file.stderr
    primary.kill()
    promoted = run_cli("promote", address(backup), "--config", str(backup.config_path), "--secret-file",
                       str(secret_file), env=environment(B_SECRET=None))  # fmt: skip
    assert promoted.returncode == 0, promoted.stderr
    assert backup.wait_until(lambda: connack_code(backup.port) == SERVING, WAIT), backup.log()
    assert_queue_served(backup, clients, 50)
    for output in (primary.log(), backup.log(), stranger.log(), shown.stdout + shown.stderr, unset.stderr):
        assert SECRET not in output and "another-secret-0123456789" not in output


@pytest.mark.parametrize(
    ("value", "words"),
    [
        (None, f"the environment variable '{SECRET_VAR}' is not set"),
        ("", f"the environment variable '{SECRET_VAR}' is empty"),
        ("fifteen-chars-1", f"the secret in the environment variable '{SECRET_VAR}' must be at least 16 bytes"),
    ],
)
def test_a_missing_empty_or_short_secret_env_stops_the_broker_naming_key_and_variable_not_value(
    broker_factory: Callable[..., Broker], value: str | None, words: str
) -> None:
    broker = node(broker_factory, "p", role="primary", secret_env=SECRET_VAR)
    broker.write_config()
    result = run_cli("broker", "-c", str(broker.config_path), env=environment(**{SECRET_VAR: value}))
    assert result.returncode == 2, result.stderr
    assert f"'replication.secret_env': {words}" in result.stderr
    if value:
        assert value not in result.stdout + result.stderr
