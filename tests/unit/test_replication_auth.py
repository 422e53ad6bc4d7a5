"""The replication channel's handshake (replication/auth.py) between real sockets on 127.0.0.1,
and the secret's settings: each failure named, on both sides, never a hang."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from amqtt_durable.errors import ConfigError
from amqtt_durable.replication.auth import (
    NONCE_BYTES,
    AuthError,
    Session,
    client_handshake,
    client_proof,
    error_text,
    server_handshake,
    server_proof,
    session_keys,
)
from amqtt_durable.replication.config import ReplicationConfig
from amqtt_durable.replication.errors import FrameMacError
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
            _, kind, payload = await server_handshake(reader, writer, server_secret, MAX_PEER_FRAME)
            outcome.set_result((kind, payload))
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
        session = await client_handshake(reader, writer, secret)
        writer.write(session.encode(Frame.STATUS))
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
    assert isinstance(client, AuthError) and "do not share the replication secret" in str(client)
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
        status = Session(send_key=session_keys(SECRET, nonce, payload[:NONCE_BYTES])[0]).encode(Frame.STATUS)
        recorded[:] = [encode_frame(Frame.AUTH, nonce), encode_frame(Frame.AUTH, answer), status]
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
        ({"secret": "s" * 16, "secret_file": "x"}, "replication.secret_file", "not secret and secret_file"),
        ({"secret_file": "/nonexistent/secret"}, "replication.secret_file", "cannot read the secret file"),
        ({"secret_file": "EMPTY"}, "replication.secret_file", "is empty"),
        ({"secret_file": "SHORT"}, "replication.secret_file", "must be at least 16 bytes, not 15"),
        ({"handshake_timeout": 0}, "replication.handshake_timeout", "above 0"),
    ],
)
def test_bad_secret_settings_name_their_key(tmp_path: Path, settings: dict[str, Any], key: str, words: str) -> None:
    if settings.get("secret_file") == "EMPTY":
        (tmp_path / "empty").write_text("\n")
        settings = {"secret_file": str(tmp_path / "empty")}
    if settings.get("secret_file") == "SHORT":  # as short as an inline secret may not be
        (tmp_path / "short").write_text(" " + "s" * 15 + "\n")
        settings = {"secret_file": str(tmp_path / "short")}
    with pytest.raises(ConfigError) as raised:
        ReplicationConfig.from_mapping({"role": "primary", **settings})
    assert raised.value.key == key and words in str(raised.value)


ENV_NAME = "AMQTT_DURABLE_UNIT_REPLICATION_SECRET"
ENV_VALUE = "from-the-environment-0123456789"


def test_the_secret_is_read_from_the_environment_variable_secret_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_NAME, f"  {ENV_VALUE}\n")  # as a file mounted into a variable may end
    config = ReplicationConfig.from_mapping({"role": "primary", "secret_env": ENV_NAME})
    assert config.shared_secret() == ENV_VALUE.encode() and ENV_VALUE not in repr(config)
    monkeypatch.setenv(ENV_NAME, "\u00e9" * 16)
    assert config.shared_secret() == ("\u00e9" * 16).encode()


@pytest.mark.parametrize(
    "value",
    [
        b"\xc2\xa0" + ENV_VALUE.encode() + b"\xe2\x80\x83",  # NO-BREAK SPACE, EM SPACE: not ASCII whitespace
        b"\xc3\xa9" * 8,  # 8 characters, 16 bytes: bytes are counted
        b"\t" + ENV_VALUE.encode() + b"\r\n\x0b\x0c",
        b"\xff\xfe" + ENV_VALUE.encode(),  # not UTF-8
    ],
)
def test_the_same_secret_in_a_file_and_in_a_variable_reads_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: bytes
) -> None:
    """A file on one node, a variable on another: both hold these bytes, both nodes must agree."""
    path = tmp_path / "secret"
    path.write_bytes(value)
    monkeypatch.setitem(os.environb, ENV_NAME.encode(), value)  # the variable's bytes as they are
    from_file = ReplicationConfig.from_mapping({"role": "primary", "secret_file": str(path)}).shared_secret()
    from_env = ReplicationConfig.from_mapping({"role": "primary", "secret_env": ENV_NAME}).shared_secret()
    assert from_env == from_file == value.strip()


@pytest.mark.parametrize(
    ("settings", "value", "words"),
    [
        ({"secret_env": ENV_NAME}, None, f"the environment variable '{ENV_NAME}' is not set"),
        ({"secret_env": ENV_NAME}, " \n", f"the environment variable '{ENV_NAME}' is empty"),
        ({"secret_env": ENV_NAME}, " short-value-123 ", f"'{ENV_NAME}' must be at least 16 bytes, not 15"),
        ({"secret_env": ENV_NAME}, "s" * (64 * 1024 + 1), f"variable '{ENV_NAME}' is larger than 64 KiB"),
        ({"secret_env": f"{ENV_NAME}={ENV_VALUE}"}, ENV_VALUE, "expected the name of an environment variable"),
        ({"secret": "s" * 16, "secret_env": ENV_NAME}, ENV_VALUE, "not secret and secret_env"),
        ({"secret_file": "/nonexistent", "secret_env": ENV_NAME}, ENV_VALUE, "not secret_file and secret_env"),
    ],
)
def test_bad_secret_env_settings_name_the_key_and_the_variable_never_the_value(
    monkeypatch: pytest.MonkeyPatch, settings: dict[str, Any], value: str | None, words: str
) -> None:
    if value is None:
        monkeypatch.delenv(ENV_NAME, raising=False)
    else:
        monkeypatch.setenv(ENV_NAME, value)
    with pytest.raises(ConfigError) as raised:
        ReplicationConfig.from_mapping({"role": "primary", **settings})
    assert raised.value.key == "replication.secret_env" and words in str(raised.value)
    if value is not None and value.strip():
        assert value.strip() not in str(raised.value)


@pytest.mark.parametrize(
    "name",
    ["9LIVES", "MY-SECRET", "a pasted secret 0123456789", "s3cr3t/value+0123456789==", "NAME\n", "N\u00c4ME", "X\0"],
)
def test_a_secret_env_that_is_not_a_variable_name_is_refused_without_showing_it(name: str) -> None:
    """Only [A-Za-z_][A-Za-z0-9_]*: anything else may be the secret pasted in place of the name."""
    with pytest.raises(ConfigError) as raised:
        ReplicationConfig.from_mapping({"role": "primary", "secret_env": name})
    assert raised.value.key == "replication.secret_env"
    assert "expected the name of an environment variable (letters, digits and _" in str(raised.value)
    assert name.strip() not in str(raised.value)


def test_a_secret_env_yaml_read_as_a_number_is_refused_without_echoing_it() -> None:
    with pytest.raises(ConfigError) as raised:  # secret_env: 12345678901234567890123, the secret in the name's place
        ReplicationConfig.from_mapping({"role": "primary", "secret_env": 12345678901234567890123})
    assert raised.value.key == "replication.secret_env" and "quote it" in str(raised.value)
    assert "12345678901234567890123" not in str(raised.value)


def test_a_variable_emptied_after_start_up_is_named_when_the_secret_is_read_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The tools and the node read the secret through shared_secret(): the same checks, the same key."""
    monkeypatch.setenv(ENV_NAME, ENV_VALUE)
    config = ReplicationConfig(role="primary", secret_env=ENV_NAME)
    monkeypatch.delenv(ENV_NAME)
    with pytest.raises(ConfigError) as raised:
        config.shared_secret()
    assert raised.value.key == "replication.secret_env" and ENV_NAME in str(raised.value)


def test_loopback_addresses_are_told_apart() -> None:
    assert _loopback("127.0.0.1") and _loopback("localhost") and _loopback("::1") and _loopback("127.0.0.2")
    assert not _loopback("0.0.0.0") and not _loopback("10.0.0.1") and not _loopback("db1.example")


def test_a_secret_yaml_read_as_a_number_is_refused_without_echoing_it() -> None:
    with pytest.raises(ConfigError) as raised:  # secret: 12345678901234567890123, unquoted in broker.yaml
        ReplicationConfig.from_mapping({"role": "primary", "secret": 12345678901234567890123})
    assert raised.value.key == "replication.secret" and "quote it" in str(raised.value)
    assert "12345678901234567890123" not in str(raised.value)


def test_a_relayed_handshake_gives_no_say_on_the_connection() -> None:
    """The handshake passes (a relay forwards it between the real peers), then the relay speaks
    on the connection: its frame has no valid MAC, and the node uses nothing from it."""

    async def relay_then_inject(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Any:
        await client_handshake(reader, writer, SECRET)  # what the relay forwarded, frame by frame
        writer.write(encode_frame(Frame.HELLO, b"\x00" * 22))  # then its own HELLO, as on a plain channel
        await writer.drain()
        return await reader.read()  # the node closes the connection, answering nothing

    server, client = asyncio.run(exchange(SECRET, relay_then_inject))
    assert isinstance(server, FrameMacError) and "frame 0 from the peer failed its MAC" in str(server)
    assert client == b""


def frames(*encoded: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(b"".join(encoded))
    reader.feed_eof()
    return reader


def test_each_frame_after_the_handshake_is_bound_to_its_key_direction_and_place() -> None:
    async def main() -> None:
        a, b = b"a" * NONCE_BYTES, b"b" * NONCE_BYTES
        c2s, s2c = session_keys(SECRET, a, b)
        assert len({c2s, s2c, session_keys(SECRET, b, a)[0], session_keys(b"x" + SECRET, a, b)[0]}) == 4

        def sent(*kinds: tuple[Frame, bytes], key: bytes = c2s) -> list[bytes]:
            sender = Session(send_key=key)
            return [sender.encode(kind, payload) for kind, payload in kinds]

        def reading(key: bytes = c2s) -> Session:
            return Session(recv_key=key, sender="the backup")

        hello, ack = sent((Frame.HELLO, b"h" * 30), (Frame.ACK, (7).to_bytes(8, "big")))
        session = reading()
        stream = frames(hello, ack)
        assert await session.read(stream) == (Frame.HELLO, b"h" * 30)
        assert await session.read(stream) == (Frame.ACK, (7).to_bytes(8, "big"))

        def tampered(frame: bytes, at: int) -> bytes:
            """A byte changed, and the frame's CRC made right again (CRC-32 is no protection)."""
            content = bytearray(frame[:-4])
            content[at] ^= 0x01
            return encode_frame(content[0], bytes(content[5:]))

        refused = {  # what: (the frames, the number of the one refused)
            "replayed (frame 0 again as frame 1)": ([hello, hello], 1),
            "reordered": ([ack, hello], 0),
            "from the other direction": (sent((Frame.HELLO, b"h" * 30), key=s2c), 0),
            "from another connection": (sent((Frame.HELLO, b"h" * 30), key=session_keys(SECRET, b, a)[0]), 0),
            "a payload byte flipped": ([tampered(hello, 9)], 0),
            "the type changed": ([encode_frame(Frame.STATUS, hello[5:-4])], 0),
            "no MAC at all": ([encode_frame(Frame.HELLO, b"h" * 30)], 0),
        }
        for what, (stream_frames, number) in refused.items():
            session, stream = reading(), frames(*stream_frames)
            with pytest.raises(FrameMacError) as raised:
                for _ in stream_frames:
                    await session.read(stream)
            assert f"frame {number} from the backup failed its MAC" in str(raised.value), what
            with pytest.raises(FrameMacError):  # and the session stays refused
                await session.read(frames(hello))
        # Without a secret: the frames of protocol version 1, byte for byte.
        assert Session().encode(Frame.ACK, b"12345678") == encode_frame(Frame.ACK, b"12345678")

    asyncio.run(main())


def test_a_peers_error_text_is_shown_escaped_and_bounded() -> None:
    hostile = b"x\n[2026-11-26] WARNING forged line \x1b[2J\x07 " + "\u00e9".encode() + b"\xff" + b"y" * 1000
    shown = error_text(hostile)
    assert "\n" not in shown and "\x1b" not in shown and "\x07" not in shown
    assert shown.startswith("x\\n[2026-11-26] WARNING forged line \\x1b[2J\\x07 \u00e9\ufffd")
    assert len(shown) <= 220 and shown.endswith("(cut)")

    async def refusing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Any:
        writer.write(encode_frame(Frame.AUTH, b"n" * NONCE_BYTES))
        await read_frame(reader)
        writer.write(encode_frame(Frame.ERROR, b"no\n\x1b[31mfake\x1b[0m"))  # its refusal, as the node logs it
        await writer.drain()
        return "sent"

    server, _ = asyncio.run(exchange(SECRET, refusing))
    assert isinstance(server, AuthError) and str(server).endswith("no\\n\\x1b[31mfake\\x1b[0m")
