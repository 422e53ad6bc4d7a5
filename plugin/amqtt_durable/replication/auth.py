"""Authentication of the replication channel: a mutual challenge-response over a shared secret.

When ``replication.secret`` (or ``secret_file``, ``secret_env``) is set, every connection to a replication
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

The handshake alone would authenticate only its own three frames: whoever sits between a backup
and its primary could relay them and then speak on the connection in either's name. So after
it **every frame, in both directions, carries a MAC** (``Session``) under a key of that
direction and that connection::

    key_c2s = HMAC-SHA256(secret, b"session c2s" + client_nonce + server_nonce)
    key_s2c = HMAC-SHA256(secret, b"session s2c" + client_nonce + server_nonce)
    mac     = HMAC-SHA256(key, counter:u64 type:u8 plen:u32 payload)[:16]

``counter`` numbers the frames one side sent after the handshake, from 0 (not sent: each side
counts), so a frame cannot be forged, altered, replayed, reordered, dropped from the middle, or
moved to another connection or to the other direction. A frame whose MAC does not match is not
used: the connection is closed (FrameMacError, "frame N ... failed its MAC"). The MAC
authenticates; it does not encrypt (replication.tls does).

Without a secret on either side nothing changes on the wire (protocol version 1 as before).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import secrets
import ssl
import struct

from .errors import FrameMacError, ReplicationError
from .framing import MAX_FRAME, Frame, encode_frame, frame_type, read_frame, read_raw_frame

NONCE_BYTES = 32
MAC_BYTES = hashlib.sha256().digest_size
MAX_AUTH_FRAME = 256
"""The longest frame read during the handshake (an AUTH frame is at most 64 bytes, an ERROR
frame a line of text)."""
TAG_BYTES = 16
"""The MAC of a frame after the handshake: HMAC-SHA256 truncated to 128 bits."""
MAX_ERROR_TEXT = 200
"""Characters of a peer's ERROR text shown in a log line or a tool's output."""
_MAC_HEAD = struct.Struct(">QBI")


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


def session_keys(secret: bytes, client_nonce: bytes, server_nonce: bytes) -> tuple[bytes, bytes]:
    """The keys of one connection's frames after the handshake: (client to server, server to client)."""
    return (
        proof(secret, b"session c2s", client_nonce, server_nonce),
        proof(secret, b"session s2c", client_nonce, server_nonce),
    )


class Session:
    """How one connection's frames are written and read after the handshake. Without keys (no
    secret) they are plain frames, as before; with keys each frame carries the MAC of its
    direction's counter, type, length and payload (module docstring). Frames are written from
    one task per direction, in the order they are encoded."""

    def __init__(self, send_key: bytes | None = None, recv_key: bytes | None = None, sender: str = "the peer") -> None:
        # Keyed once per connection; each frame's MAC starts from a copy (no key setup per frame).
        self._send_mac = hmac.new(send_key, digestmod="sha256") if send_key is not None else None
        self._recv_mac = hmac.new(recv_key, digestmod="sha256") if recv_key is not None else None
        self.sender = sender
        """Who the frames read come from, for the error of a failed MAC."""
        self.sent = 0
        self.received = 0
        self._failed: FrameMacError | None = None

    @property
    def authenticated(self) -> bool:
        return self._recv_mac is not None

    @staticmethod
    def _tag(keyed: hmac.HMAC, counter: int, kind: int, payload: bytes) -> bytes:
        mac = keyed.copy()
        mac.update(_MAC_HEAD.pack(counter, kind, len(payload)))
        mac.update(payload)
        return mac.digest()[:TAG_BYTES]

    def encode(self, kind: Frame, payload: bytes = b"") -> bytes:
        """The frame to write next on this connection (each call takes the next counter)."""
        if self._send_mac is None:
            return encode_frame(kind, payload)
        tag = self._tag(self._send_mac, self.sent, int(kind), payload)
        self.sent += 1
        return encode_frame(kind, payload, tag)

    async def read(self, reader: asyncio.StreamReader, limit: int = MAX_FRAME) -> tuple[Frame, bytes]:
        """The next frame, as framing.read_frame; with keys, FrameMacError for a frame whose MAC
        does not match (and for every read after it: the caller closes the connection)."""
        if self._recv_mac is None:
            return await read_frame(reader, limit)
        if self._failed is not None:
            raise self._failed
        kind, _, payload, tag = await read_raw_frame(reader, limit, TAG_BYTES)
        if not hmac.compare_digest(tag, self._tag(self._recv_mac, self.received, kind, payload)):
            self._failed = FrameMacError(self.received, self.sender)
            raise self._failed
        self.received += 1
        return frame_type(kind), payload


async def _refuse(writer: asyncio.StreamWriter, why: str) -> AuthError:
    """Tell the peer why (ERROR frame) and return the error to raise; the caller closes."""
    writer.write(encode_frame(Frame.ERROR, why.encode("utf-8")))
    with contextlib.suppress(ConnectionError):
        await writer.drain()
    return AuthError(why)


def error_text(payload: bytes) -> str:
    """A peer's ERROR text, safe to log or print: at most ``MAX_ERROR_TEXT`` characters, and a
    character that is not printable (newline, escape sequence) shown escaped, as in a Python
    string (an unauthenticated peer writes this text)."""
    text = payload[: MAX_ERROR_TEXT * 4].decode("utf-8", "replace")
    shown = "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)
    return shown if len(shown) <= MAX_ERROR_TEXT else shown[:MAX_ERROR_TEXT] + "... (cut)"


async def server_handshake(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: bytes | None, first_limit: int
) -> tuple[Session, Frame, bytes]:
    """The listening node's side: authenticate the peer when ``secret`` is set, and return the
    connection's session and the first frame after the handshake (HELLO, STATUS, PROMOTE).
    Raises AuthError (the peer was told why), FrameMacError (a first frame that failed its MAC);
    the caller bounds it in time and closes the connection."""
    kind, payload = await read_frame(reader, MAX_AUTH_FRAME if secret is not None else first_limit)
    if secret is None:
        if kind == Frame.AUTH:
            raise await _refuse(
                writer,
                "the peer sent a replication secret but this node has none set (replication.secret): "
                "set the same secret on both sides, or on neither",
            )
        return Session(), kind, payload
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
    from_client, to_client = session_keys(secret, client_nonce, server_nonce)
    session = Session(send_key=to_client, recv_key=from_client)
    kind, payload = await session.read(reader, first_limit)
    return session, kind, payload


async def client_handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: bytes | None) -> Session:
    """The connecting side (a backup, a tool): prove we know ``secret`` and check the node does,
    before anything else is sent or applied; returns the session every later frame goes through.
    Nothing happens without a secret (a plain session). The caller bounds it in time."""
    if secret is None:
        return Session(sender="the node")
    client_nonce = new_nonce()
    try:
        writer.write(encode_frame(Frame.AUTH, client_nonce))
        await writer.drain()
        kind, payload = await read_frame(reader, MAX_AUTH_FRAME)
    except (asyncio.IncompleteReadError, ConnectionResetError, BrokenPipeError, ssl.SSLError):
        # Which of these a node's close gives depends on whether our AUTH frame reached it first (then
        # its kernel resets the connection) or, with TLS, whether its alert came before the close.
        raise AuthError(
            "the node closed the connection during authentication: with replication.tls it may refuse this "
            "node's certificate (the same ca on both sides); without, it may run a release without replication.secret"
        ) from None
    if kind == Frame.ERROR:
        raise AuthError(f"refused by the node: {error_text(payload)}")
    if kind != Frame.AUTH or len(payload) != NONCE_BYTES + MAC_BYTES:
        raise await _refuse(writer, f"expected AUTH from the node, got {kind.name}")
    server_nonce, mac = payload[:NONCE_BYTES], payload[NONCE_BYTES:]
    if not hmac.compare_digest(mac, server_proof(secret, client_nonce, server_nonce)):
        raise await _refuse(
            writer,
            "authentication failed: the node and the connecting side (backup or tool) do not share the "
            "replication secret",
        )
    writer.write(encode_frame(Frame.AUTH, client_proof(secret, client_nonce, server_nonce)))
    await writer.drain()
    to_server, from_server = session_keys(secret, client_nonce, server_nonce)
    return Session(send_key=to_server, recv_key=from_server, sender="the node")


__all__ = [
    "AuthError",
    "Session",
    "client_handshake",
    "client_proof",
    "error_text",
    "server_handshake",
    "server_proof",
    "session_keys",
]
