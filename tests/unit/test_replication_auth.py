"""The replication channel's handshake (replication/auth.py) between real sockets on 127.0.0.1,
and the secret's settings: each failure named, on both sides, never a hang."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from amqtt_durable.errors import ConfigError
from amqtt_durable.replication.auth import (
    NONCE_BYTES,
    AuthError,
    client_handshake,
    client_proof,
    server_handshake,
    server_proof,
)
from amqtt_durable.replication.config import ReplicationConfig
from amqtt_durable.replication.framing import MAX_PEER_FRAME, Frame, encode_frame, read_frame
from amqtt_durable.replication.node import _loopback

pytestmark = pytest.mark.timeout(30)

SECRET = b"a-long-shared-secret-0123456789"
BOUND = 5.0
Client = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[Any]]


async def exchange(server_secret: bytes | None, client: Client) -> tuple[Any, Any]:
    """Run ``server_handshake`` on a real listening socket against ``client``; each side's result
    (its return value, or the exception it raised)."""
    outcome: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            outcome.set_result(await server_handshake(reader, writer, server_secret, MAX_PEER_FRAME))
        except Exception as exc:
            outcome.set_result(exc)
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with asyncio.timeout(BOUND):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                mine: Any = await client(reader, writer)
            except Exception as exc:
                mine = exc
            finally:
                writer.close()
            return await outcome, mine
    finally:
        server.close()
        await server.wait_closed()


def honest(secret: bytes | None) -> Client:
    async def run(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Any:
        await client_handshake(reader, writer, secret)
        writer.write(encode_frame(Frame.STATUS))
        await writer.drain()
        return "sent"

    return run


def test_the_same_secret_on_both_sides_passes_and_the_first_frame_follows() -> None:
    server, client = asyncio.run(exchange(SECRET, honest(SECRET)))
    assert server == (Frame.STATUS, b"") and client == "sent"


def test_no_secret_on_either_side_is_the_old_protocol() -> None:
    server, client = asyncio.run(exchange(None, honest(None)))
    assert server == (Frame.STATUS, b"") and client == "sent"


def test_a_wrong_secret_is_refused_and_the_client_finds_out_first() -> None:
    server, client = asyncio.run(exchange(SECRET, honest(b"another-secret-of-some-length")))
    # The client checks the server's proof first: it refuses the node and sends no proof of its own.
    assert isinstance(client, AuthError) and "does not know the replication secret" in str(client)
    assert isinstance(server, AuthError) and "the peer refused this node" in str(server)


def test_a_peer_without_the_secret_is_told_so_and_so_is_one_with_a_secret_a_node_lacks() -> None:
    async def no_secret(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Any:
        writer.write(encode_frame(Frame.HELLO, b"\x00" * 22))
        await writer.drain()
        return await read_frame(reader)

    server, client = asyncio.run(exchange(SECRET, no_secret))
    assert isinstance(server, AuthError) and "authentication required" in str(server)
    assert client[0] == Frame.ERROR and b"authentication required" in client[1]

    server, client = asyncio.run(exchange(None, honest(SECRET)))
    assert isinstance(server, AuthError) and "this node has none set" in str(server)
    assert isinstance(client, AuthError) and "refused by the node" in str(client) and "none set" in str(client)


def test_a_recorded_handshake_replayed_on_a_new_connection_is_refused() -> None:
    recorded: list[bytes] = []

    async def recording(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Any:
        nonce = b"n" * NONCE_BYTES
        writer.write(encode_frame(Frame.AUTH, nonce))
        _, payload = await read_frame(reader)
        answer = client_proof(SECRET, nonce, payload[:NONCE_BYTES])
        recorded[:] = [encode_frame(Frame.AUTH, nonce), encode_frame(Frame.AUTH, answer), encode_frame(Frame.STATUS)]
        writer.write(b"".join(recorded[1:]))
        await writer.drain()
        return "recorded"

    async def replaying(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Any:
        writer.write(b"".join(recorded))
        await writer.drain()
        await read_frame(reader)  # the node's challenge, with a fresh nonce
        return await read_frame(reader)

    assert asyncio.run(exchange(SECRET, recording))[0] == (Frame.STATUS, b"")
    server, client = asyncio.run(exchange(SECRET, replaying))
    assert isinstance(server, AuthError) and "wrong replication secret" in str(server)
    assert client[0] == Frame.ERROR


def test_the_proofs_differ_by_side_and_by_nonce() -> None:
    a, b = b"a" * NONCE_BYTES, b"b" * NONCE_BYTES
    assert server_proof(SECRET, a, b) != client_proof(SECRET, a, b)  # a proof cannot be reflected
    assert server_proof(SECRET, a, b) != server_proof(SECRET, b, a)
    assert server_proof(SECRET, a, b) != server_proof(b"x" + SECRET, a, b)


def test_an_oversized_auth_frame_is_refused_before_its_payload() -> None:
    async def huge(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Any:
        writer.write(bytes([Frame.AUTH]) + (60_000).to_bytes(4, "big"))
        await writer.drain()
        return "sent"

    server, _ = asyncio.run(exchange(SECRET, huge))
    assert "larger than 256" in str(server)


def test_the_secret_settings_are_read_and_checked(tmp_path: Path) -> None:
    assert ReplicationConfig(role="primary").shared_secret() is None
    inline = ReplicationConfig(role="primary", secret="s" * 16)
    assert inline.shared_secret() == b"s" * 16 and "s" * 16 not in repr(inline)
    held = tmp_path / "secret"
    held.write_text("  from-a-file-0123456789\n")
    assert ReplicationConfig(role="primary", secret_file=str(held)).shared_secret() == b"from-a-file-0123456789"


@pytest.mark.parametrize(
    ("settings", "key", "words"),
    [
        ({"secret": "short"}, "replication.secret", "at least 16"),
        ({"secret": "s" * 16, "secret_file": "x"}, "replication.secret_file", "not both"),
        ({"secret_file": "/nonexistent/secret"}, "replication.secret_file", "cannot read the secret file"),
        ({"secret_file": "EMPTY"}, "replication.secret_file", "is empty"),
        ({"handshake_timeout": 0}, "replication.handshake_timeout", "above 0"),
    ],
)
def test_bad_secret_settings_name_their_key(tmp_path: Path, settings: dict[str, Any], key: str, words: str) -> None:
    if settings.get("secret_file") == "EMPTY":
        (tmp_path / "empty").write_text("\n")
        settings = {"secret_file": str(tmp_path / "empty")}
    with pytest.raises(ConfigError) as raised:
        ReplicationConfig.from_mapping({"role": "primary", **settings})
    assert raised.value.key == key and words in str(raised.value)


def test_loopback_addresses_are_told_apart() -> None:
    assert _loopback("127.0.0.1") and _loopback("localhost") and _loopback("::1") and _loopback("127.0.0.2")
    assert not _loopback("0.0.0.0") and not _loopback("10.0.0.1") and not _loopback("db1.example")
