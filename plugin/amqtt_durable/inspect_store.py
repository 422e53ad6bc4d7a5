"""Read-only view of a stopped broker's store: one row per durable session, or per retained message."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import plyvel

from .errors import DamagedRecordError, StoreCorruptedError
from .store import (
    Body,
    body_key,
    decoded,
    iter_entries,
    iter_retained,
    iter_sessions,
    open_store,
    read_error,
    read_msg_id_mark,
    read_session_state,
    read_sid_mark,
    read_store_id,
)

T = TypeVar("T")


@dataclass
class SessionSummary:
    client_id: str
    depth: int
    bytes: int
    oldest_age_s: float | None
    subscriptions: dict[str, int]
    disconnected_at: float | None
    expires_at: float | None
    dropped: int

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RetainedSummary:
    topic: str
    qos: int
    bytes: int
    age_s: float
    """Seconds since the publish that set it."""

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def summarize(path: str, now: float | None = None) -> list[SessionSummary]:
    """Sessions of the store at ``path`` (the broker must be stopped: LevelDB allows one process)."""
    now = time.time() if now is None else now
    return _read(path, lambda db: _rows(db, now))


def summarize_retained(path: str, now: float | None = None) -> list[RetainedSummary]:
    """Retained messages of the store at ``path``, in topic order (the broker must be stopped)."""
    now = time.time() if now is None else now
    return _read(
        path,
        lambda db: [
            RetainedSummary(m.topic, m.qos, len(m.payload), max(0.0, now - m.published_at)) for m in iter_retained(db)
        ],
    )


def _read(path: str, read: Callable[[Any], T]) -> T:
    db = open_store(path, create=False)
    try:
        # The marks start-up reads first: a damaged one is named here as there (repair rewrites it).
        read_store_id(db)
        read_sid_mark(db)
        read_msg_id_mark(db)
        return read(db)
    except plyvel.Error as exc:
        raise read_error(path, exc) from exc
    except DamagedRecordError as exc:
        raise StoreCorruptedError(path, str(exc)) from exc
    finally:
        db.close()


def _rows(db: Any, now: float) -> list[SessionSummary]:
    rows: list[SessionSummary] = []
    for record in iter_sessions(db):
        what = f"of client id {record.client_id!r}"
        (depth, size, dropped), _ = read_session_state(db, record)  # the sent mark too, as start-up reads it
        oldest: float | None = None
        first = next(iter_entries(db, record.sid, 0, 1, record.client_id), None)
        if first is not None:
            raw = db.get(body_key(first.msg_id), verify_checksums=True)
            if raw is not None:
                body = decoded(Body.decode, raw, f"the message body of the oldest queued message {what}")
                oldest = max(0.0, now - body.published_at)
        rows.append(
            SessionSummary(
                client_id=record.client_id,
                depth=depth,
                bytes=size,
                oldest_age_s=oldest,
                subscriptions=dict(record.subscriptions),
                disconnected_at=record.disconnected_at,
                expires_at=record.expires_at,
                dropped=dropped,
            )
        )
    return rows


def format_table(rows: list[SessionSummary], now: float | None = None) -> str:
    now = time.time() if now is None else now
    header = ("CLIENT ID", "DEPTH", "BYTES", "OLDEST", "EXPIRES IN", "DROPPED", "SUBSCRIPTIONS")
    lines = [header]
    for row in rows:
        expires = "-" if row.expires_at is None else _duration(row.expires_at - now)
        oldest = "-" if row.oldest_age_s is None else _age(row.oldest_age_s)
        subs = ",".join(f"{shown(f)}@{q}" for f, q in sorted(row.subscriptions.items())) or "-"
        lines.append((shown(row.client_id), str(row.depth), str(row.bytes), oldest, expires, str(row.dropped), subs))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = ["  ".join(cell.ljust(widths[i]) for i, cell in enumerate(line)).rstrip() for line in lines]
    text.append(f"{len(rows)} session(s), {sum(r.depth for r in rows)} queued message(s)")
    return "\n".join(text)


def format_retained(rows: list[RetainedSummary]) -> str:
    lines = [("TOPIC", "QOS", "BYTES", "AGE")]
    lines += [(shown(row.topic), str(row.qos), str(row.bytes), _age(row.age_s)) for row in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(4)]
    text = ["  ".join(cell.ljust(widths[i]) for i, cell in enumerate(line)).rstrip() for line in lines]
    text.append(f"{len(rows)} retained message(s)")
    return "\n".join(text)


def shown(text: str) -> str:
    """A client's string (client id, filter, topic) as one table cell: a backslash and every
    character that is not printable (a newline, a tab, a terminal escape, ...) escaped as in a
    Python string, so that no client can split a row, forge one or drive the terminal."""
    if text.isprintable() and "\\" not in text:
        return text
    return "".join(
        ch if ch.isprintable() and ch != "\\" else ch.encode("unicode_escape").decode("ascii") for ch in text
    )


def _age(seconds: float) -> str:
    return "0s" if seconds <= 0 else _duration(seconds)


def _duration(seconds: float) -> str:
    if seconds <= 0:
        return "due"
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"
