"""What ``amqtt-durable promote`` and ``inspect --replication`` ask a running node, over its
replication address (framing's STATUS and PROMOTE frames)."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from typing import Any

from durable_protocol.hostport import join_host_port, parse_host, split_host_port

from ..inspect_store import shown
from .auth import AuthError, client_handshake, error_text
from .coordinator import read_record, record_field
from .errors import FrameError, FrameMacError, ReplicationError
from .framing import Frame

ASK_TIMEOUT = 10.0


def split_address(address: str) -> tuple[str, int]:
    """(host, port) of ``host:port`` (durable_protocol.hostport: an IPv6 host in brackets,
    ``[::1]:7883``, which are taken off); a ReplicationError naming ``address`` otherwise."""
    try:
        return split_host_port(address)
    except ValueError as exc:
        raise ReplicationError(f"replication address {address!r}: {exc} (its replication.listen)") from None


def split_peer_address(address: str, written_in: str) -> tuple[str, int]:
    """(host, port) of an address another node wrote (``written_in`` names where, for the error:
    the coordinator's leader key), read leniently: bracketed as split_address reads it, or an IPv6
    host without brackets with the port after the last colon (``2001:db8::10:7883``), as a node
    from before addresses were bracketed publishes its replication.listen, or brackets around a
    host that is not an IPv6 address (``[10.0.0.1]:7883``, taken off), which such a node accepted
    in its listen or advertise and published as written. Such a node cannot be corrected by this
    one, and failing to read it would leave this node following nobody; the configuration is
    still read strictly (split_address), where the operator can fix it."""
    try:
        return split_host_port(address)
    except ValueError as exc:
        host, _, port = address.rpartition(":")
        if port.isascii() and port.isdigit() and 0 < int(port) < 65536:  # not "²" (int() fails), "٣" (3)
            if ":" in host:  # only a real IPv6 address: not '::1 x', 'fe80::1/64', a tab or newline
                with contextlib.suppress(ValueError):
                    return parse_host(f"[{host}]"), int(port)
            if len(host) > 2 and host[0] == "[" and host[-1] == "]" and ":" not in host:
                with contextlib.suppress(ValueError):
                    return split_host_port(f"{host[1:-1]}:{port}")
        raise ReplicationError(f"replication address {address!r} in {written_in}: {exc}") from None


def join_address(host: str, port: int) -> str:
    """``host:port`` as split_address reads it back and as the configuration writes it: an IPv6
    host in brackets (``[::1]:7883``), so the port is told from the address where one is shown
    (durable_protocol.hostport.join_host_port)."""
    return join_host_port(host, port)


async def ask(
    address: str, kind: Frame, secret: bytes | None = None, tls: ssl.SSLContext | None = None
) -> dict[str, Any]:
    """Send ``kind`` to the node at ``address`` and return its JSON answer; with ``secret`` (the
    node's replication.secret) after the handshake of auth.py; with ``tls`` (a client context of
    replication.tls) over TLS."""
    host, port = split_address(address)
    try:
        async with asyncio.timeout(ASK_TIMEOUT):
            reader, writer = await asyncio.open_connection(host, port, ssl=tls)
            try:
                session = await client_handshake(reader, writer, secret)
                writer.write(session.encode(kind))
                await writer.drain()
                answered, payload = await session.read(reader)
            finally:
                writer.close()
    except AuthError as exc:
        raise ReplicationError(f"replication address {address}: {exc}") from None
    except (OSError, TimeoutError, asyncio.IncompleteReadError, FrameError, FrameMacError) as exc:
        # asyncio.timeout's TimeoutError says nothing of its own: what listens there (an MQTT listener,
        # say) kept silent. (A connect's ETIMEDOUT is a TimeoutError with its own message.)
        # An MQTT listener closes at once a connection whose first packet is not a CONNECT.
        silent = isinstance(exc, TimeoutError) and not str(exc)
        detail = f"nothing answered within {ASK_TIMEOUT:g} s" if silent else str(exc)
        if isinstance(exc, asyncio.IncompleteReadError):
            detail = "the connection was closed without an answer"
        elif isinstance(exc, FrameError):
            detail = f"its answer is no replication frame: {exc}"
        raise ReplicationError(
            f"replication address {address}: no answer to {kind.name} ({type(exc).__name__}: {detail}); "
            "is a broker with replication listening there (its replication.listen)?"
        ) from None
    if answered == Frame.ERROR:
        raise ReplicationError(f"replication address {address}: refused: {error_text(payload)}")
    if answered != kind:
        raise ReplicationError(f"replication address {address}: answered {answered.name} to {kind.name}")
    try:
        return read_record(payload)
    except ValueError as exc:
        raise ReplicationError(
            f"replication address {address}: its answer to {kind.name} is not readable: {exc}"
        ) from None


def status_text(address: str, status: dict[str, Any]) -> str:
    """The status the node at ``address`` answered as the lines an operator reads; one without the fields
    this version shows, or with fields of other types, is a ReplicationError naming ``address`` and what
    is wrong (a KeyError or TypeError traceback otherwise)."""
    try:
        return format_status(_shown_fields(status, 3))
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        wrong = f"no '{exc.args[0]}'" if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"
        raise ReplicationError(
            f"replication address {address}: its answer to STATUS is not one this version shows ({wrong})"
        ) from None


def promote_answer(address: str, answer: dict[str, Any]) -> tuple[bool, str]:
    """Whether the node at ``address`` was promoted and why, from its PROMOTE answer; a ReplicationError
    naming ``address`` and what is wrong for an answer without them, or with other types."""
    try:
        return record_field(answer, "promoted", bool), shown(record_field(answer, "why", str))
    except ValueError as exc:
        raise ReplicationError(f"replication address {address}: its answer to PROMOTE is not readable: {exc}") from None


def _shown_fields(value: Any, depth: int) -> Any:
    """``value`` (a node's answer) with each text in it down to ``depth`` levels (a field of a row in a list of
    the answer: as deep as format_status reads) shown as inspect_store.shown shows it: a newline, a terminal
    escape or a lone surrogate (which print cannot encode: a UnicodeEncodeError traceback) escaped, so a
    node's text neither splits a line nor forges one."""
    if isinstance(value, str):
        return shown(value)
    if depth and isinstance(value, dict):
        return {key: _shown_fields(item, depth - 1) for key, item in value.items()}
    if depth and isinstance(value, list):
        return [_shown_fields(item, depth - 1) for item in value]
    return value


def format_status(status: dict[str, Any]) -> str:
    """A node's status as the lines an operator reads."""
    lines = [f"{status.get('name') or '(unnamed)'}: {status['role']}, at batch {status['batch']}"]
    if status["role"] == "primary":
        lines[0] += f", {status['mode']} replication"
        backups = status.get("backups", [])
        if not backups:
            lines.append("  no backup connected")
        for row in backups:
            lines.append(
                f"  backup {row['name']} ({row['peer']}): {row['state']}, acked {row['acked']}, "
                f"lag {row['lag_batches']} batches / {row['lag_seconds']} s"
                + (f", snapshot rows {row['snapshot_rows']}" if row["state"] == "snapshot" else "")
            )
    else:
        lines += _backup_lines(status)
    if status.get("refused"):  # a node before this field did not send it
        lines.append(f"  connections refused on its replication address since start: {status['refused']}")
    members = status.get("members")
    if members is not None:
        lines.append("  members in the coordinator (as of this node's last HA cycle):" if members else
                     "  no member in the coordinator (yet)")  # fmt: skip
        for row in members:
            lines.append(
                f"    {row['name']}: {row['role']}, at batch {row['batch']}, store {row['store_id']:x}"
                + (", may take over" if row["candidate"] else "")
                + (", its last promotion failed" if row.get("promotion_failed") else "")  # not sent before
            )
    return "\n".join(lines)


def _backup_lines(status: dict[str, Any]) -> list[str]:
    """A backup's lines: what it follows, its failed promotion, why it waits and for whom."""
    lines = [
        f"  following {status.get('primary') or '(nobody yet)'}: {status['state']}"
        + (", caught up" if status.get("caught_up") else ", not caught up")
        + (f", {status['queued_bytes']} bytes received not yet applied" if status.get("queued_bytes") else "")
        + (" (queue full: the primary waits for this backup's writes)" if status.get("queue_full") else "")
    ]
    if status.get("promotion_failed"):
        lines.append(f"  its last promotion failed: {status['promotion_failed']}")
    if status.get("refused_by_primary"):
        lines.append(f"  {status['refused_by_primary']}")
    if status.get("waiting"):
        lines.append(f"  its last HA cycle: {status['waiting']}")
    if status.get("waiting_for"):  # a node before this field did not send it
        lines.append(f"  waiting for: {', '.join(status['waiting_for'])}")
    return lines
