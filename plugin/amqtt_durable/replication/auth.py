"""Authentication of the replication channel: a mutual challenge-response over a shared secret.

When ``replication.secret`` (or ``secret_file``) is set, every connection to a replication
address (a backup's channel, a tool's STATUS or PROMOTE) starts with three AUTH frames, before
anything else (the connecting side is the *client*, the listening node the *server*)::

    client -> server  AUTH  client_nonce (32 random bytes)
    server -> client  AUTH  server_nonce (32) + HMAC-SHA256(secret, b"server" + client_nonce + server_nonce)
    client -> server  AUTH  HMAC-SHA256(secret, b"client" + client_nonce + server_nonce)

Neither side sends the secret; each proof covers both nonces, so a recorded handshake replayed
on a new connection fails (the other side's nonce is new), and the labels keep a proof from
being reflected back. The client checks the server's proof before it sends its own, so a backup
applies nothing from a node that does not know the secret. A failure is answered with an ERROR
frame naming the problem, then the connection closes; a node without a secret answers an AUTH
frame with ERROR too, so a mismatched configuration is a clear error on both sides, never a hang.
Without a secret on either side nothing changes on the wire (protocol version 1 as before).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import secrets

from .errors import ReplicationError
from .framing import Frame, encode_frame, read_frame

NONCE_BYTES = 32
MAC_BYTES = hashlib.sha256().digest_size
MAX_AUTH_FRAME = 256
"""The longest frame read during the handshake (an AUTH frame is at most 64 bytes, an ERROR
frame a line of text)."""


class AuthError(ReplicationError):
    """The replication handshake failed (wrong or missing secret, on one side or the other)."""


def proof(secret: bytes, label: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """HMAC-SHA256 of the label and both nonces under the shared secret."""
    return hmac.new(secret, label + client_nonce + server_nonce, hashlib.sha256).digest()


def server_proof(secret: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return proof(secret, b"server", client_nonce, server_nonce)


def client_proof(secret: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return proof(secret, b"client", client_nonce, server_nonce)


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


async def _refuse(writer: asyncio.StreamWriter, why: str) -> AuthError:
    """Tell the peer why (ERROR frame) and return the error to raise; the caller closes."""
    writer.write(encode_frame(Frame.ERROR, why.encode("utf-8")))
    with contextlib.suppress(ConnectionError):
        await writer.drain()
    return AuthError(why)


def error_text(payload: bytes) -> str:
    return payload[:MAX_AUTH_FRAME].decode("utf-8", "replace")


async def server_handshake(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: bytes | None, first_limit: int
) -> tuple[Frame, bytes]:
    """The listening node's side: authenticate the peer when ``secret`` is set, and return the
    first frame after the handshake (HELLO, STATUS, PROMOTE). Raises AuthError (the peer was
    told why); the caller bounds it in time and closes the connection."""
    kind, payload = await read_frame(reader, MAX_AUTH_FRAME if secret is not None else first_limit)
    if secret is None:
        if kind == Frame.AUTH:
            raise await _refuse(
                writer,
                "the peer sent a replication secret but this node has none set (replication.secret): "
                "set the same secret on both sides, or on neither",
            )
        return kind, payload
    if kind != Frame.AUTH:
        raise await _refuse(
            writer,
            f"authentication required: this node has a replication secret set, the peer sent {kind.name} "
            "without one (set the same replication.secret on both sides; tools: --config or --secret-file)",
        )
    if len(payload) != NONCE_BYTES:
        raise await _refuse(writer, f"malformed AUTH frame: {len(payload)} bytes, expected a {NONCE_BYTES}-byte nonce")
    client_nonce, server_nonce = payload, new_nonce()
    writer.write(encode_frame(Frame.AUTH, server_nonce + server_proof(secret, client_nonce, server_nonce)))
    await writer.drain()
    kind, payload = await read_frame(reader, MAX_AUTH_FRAME)
    if kind == Frame.ERROR:
        raise AuthError(f"the peer refused this node: {error_text(payload)}")
    if kind != Frame.AUTH or not hmac.compare_digest(payload, client_proof(secret, client_nonce, server_nonce)):
        raise await _refuse(writer, "authentication failed: wrong replication secret")
    return await read_frame(reader, first_limit)


async def client_handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: bytes | None) -> None:
    """The connecting side (a backup, a tool): prove we know ``secret`` and check the node does,
    before anything else is sent or applied. Nothing happens without a secret. The caller bounds
    it in time."""
    if secret is None:
        return
    client_nonce = new_nonce()
    writer.write(encode_frame(Frame.AUTH, client_nonce))
    await writer.drain()
    try:
        kind, payload = await read_frame(reader, MAX_AUTH_FRAME)
    except asyncio.IncompleteReadError:
        raise AuthError(
            "the node closed the connection during authentication (does it run a release without "
            "replication.secret support?)"
        ) from None
    if kind == Frame.ERROR:
        raise AuthError(f"refused by the node: {error_text(payload)}")
    if kind != Frame.AUTH or len(payload) != NONCE_BYTES + MAC_BYTES:
        raise await _refuse(writer, f"expected AUTH from the node, got {kind.name}")
    server_nonce, mac = payload[:NONCE_BYTES], payload[NONCE_BYTES:]
    if not hmac.compare_digest(mac, server_proof(secret, client_nonce, server_nonce)):
        raise await _refuse(writer, "authentication failed: the node does not know the replication secret")
    writer.write(encode_frame(Frame.AUTH, client_proof(secret, client_nonce, server_nonce)))
    await writer.drain()


__all__ = ["AuthError", "client_handshake", "client_proof", "server_handshake", "server_proof"]
