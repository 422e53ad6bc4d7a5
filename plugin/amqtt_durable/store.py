"""The LevelDB store: key layout (version 1), record codecs and group commit.

Key layout, version 1 (every integer big-endian, so LevelDB's byte order is numeric order)::

    b"v"                      -> b"1"                      layout version
    b"m" + msg_id:u64         -> time:f64 qos:u8 tlen:u16 topic payload     message body, stored once
    b"c" + msg_id:u64         -> refs:u32                  queue entries still pointing at a body
                                                           (only for bodies queued for 2+ sessions)
    b"s" + client_id(utf-8)   -> JSON session record        subscriptions, deadlines, counters
    b"t" + sid:u64            -> depth:u64 bytes:u64 dropped:u64   queue totals, kept in the same batch
    b"w" + sid:u64            -> seq:u64                    highest seq possibly sent (DUP mark)
    b"i"                      -> store id:u64              random, made with the store: stream ids are
                                                           only comparable within one store (a reader
                                                           seeing another id knows the store changed)
    b"n"                      -> sid:u64                    highest session id ever assigned (an SDK
                                                           client's epoch: never reused, even after
                                                           the session and all its keys are gone)
    b"M"                      -> msg_id:u64                 at least the highest message id ever given:
                                                           written ahead, MSG_ID_RESERVE ids at a time,
                                                           in the batch of (or a batch before) the
                                                           first message past it, so an id is never
                                                           given twice, even after its body is gone
                                                           and a queue entry still points at it. A
                                                           store without it (an older release) starts
                                                           past the highest id its bodies, reference
                                                           counts and queue entries hold (one scan)
    b"q" + sid:u64 + seq:u64  -> msg_id:u64 qos:u8 flags:u8 size:u32       one queue entry
    b"x" + sid:u64 + packet_id:u16 -> b""                 a QoS 2 PUBLISH from that durable session
                                                           was stored (written in the publish's own
                                                           batch) and its PUBREL is due: a re-send
                                                           is not routed again (MQTT-4.3.3-2); the
                                                           PUBREL deletes it before PUBCOMP. At most
                                                           65,535 per session, gone with the session

Entry flags: bit 0 RETAIN (retained message on subscribe), bit 1 RELEASED (QoS 2 PUBREC
received, so PUBREL, not PUBLISH, is re-sent), bit 2 SHARED (the body is counted under b"c";
without it the entry is the body's only reference). A body is deleted with its last entry.
A RELEASED QoS 2 entry's body is never needed again (a PUBREL carries only the packet id;
awaiting_pubcomp): delivery sends its PUBREL whether the body is there or not, and repair keeps
such an entry whose body is gone or does not decode, rewritten to msg_id NO_BODY (0, which no
message gets), size 0. RELEASED on an entry of another QoS is damage and spares it nothing.
From tlen on, a body is a PUBLISH's topic field as MQTT encodes it, then the payload: replay
builds each PUBLISH from the stored bytes without decoding them (BODY_TOPIC_FIELD).

Stream logs (stream_log.py) add two prefixes; the layout stays version 1, as an older store
simply has none of these keys::

    b"e" + tlen:u16 + topic(utf-8) + id:u64  -> published_at:f64 qos:u8 payload   one log event
    b"L" + topic(utf-8)                      -> last_id:u64    highest id ever assigned to the topic

The topic's byte length comes first, so ``b"e" + tlen + topic`` prefixes exactly one topic's
events whatever bytes the topic holds. ``b"L"`` is written in the batch of every append, so
ids are never reused, even after retention removed every event of a topic. Stores written
before kept events under ``b"l" + topic + b"\\x00" + id`` (ambiguous for a topic holding
U+0000); opening such a store moves them to ``b"e"`` keys (stream_log.migrate_legacy_events,
crash-safe: each batch deletes the old keys it re-writes).

Retained messages (retained.py) add one prefix, again without a new version::

    b"r" + topic(utf-8)      -> published_at:f64 qos:u8 payload   the topic's retained message

It is written (or, for an empty payload, deleted) in the group commit of the publish that sets
it, so a retained message is stored before its PUBACK; nothing under ``_durable/`` is retained.

Replication (replication/position.py) adds two keys, written inside every replicated batch on
the primary and its backups alike, so their stores stay key-for-key the same::

    b"R"                     -> seq:u64 crc:u32      the last replicated batch this store holds
    b"R\x00snapshot"         -> b""                  a snapshot is being applied (not usable yet)
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import struct
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from itertools import dropwhile, islice, repeat
from typing import Any, Protocol, TypeVar

import plyvel

from .errors import (
    DamagedRecordError,
    ForeignLayoutError,
    NotPrimaryError,
    StoreCorruptedError,
    StoreError,
    StoreLockedError,
    StoreUnavailableError,
)

log = logging.getLogger("amqtt_durable")

LAYOUT_VERSION = b"1"
_R = TypeVar("_R")
_T = TypeVar("_T")
_U64 = struct.Struct(">Q")
_U16 = struct.Struct(">H")
_ENTRY = struct.Struct(">QBBI")
_TOTALS = struct.Struct(">QQQ")
_BODY_HEAD = struct.Struct(">dBH")
_REFS = struct.Struct(">I")
_RETAINED_HEAD = struct.Struct(">dB")

FLAG_RETAIN = 0x01
FLAG_RELEASED = 0x02
FLAG_SHARED = 0x04

NO_BODY = 0
"""The msg_id of a RELEASED entry that has no body (repair's rewrite): message ids start at 1, so no
body is ever read, counted or deleted under it (deleting ``b"m" + 0`` deletes nothing)."""
RELEASED_BODY = b""
"""What DurableSession.read_stored gives as the stored body of a RELEASED entry whose body is gone or
damaged: the pump sends its PUBREL and never looks at a body for it."""

VERSION_KEY = b"v"
RETAINED_PREFIX = b"r"


def body_key(msg_id: int) -> bytes:
    return b"m" + _U64.pack(msg_id)


def refs_key(msg_id: int) -> bytes:
    return b"c" + _U64.pack(msg_id)


def session_key(client_id: str) -> bytes:
    return b"s" + client_id.encode("utf-8")


def totals_key(sid: int) -> bytes:
    return b"t" + _U64.pack(sid)


def sent_mark_key(sid: int) -> bytes:
    return b"w" + _U64.pack(sid)


def queue_prefix(sid: int) -> bytes:
    return b"q" + _U64.pack(sid)


def entry_key(sid: int, seq: int) -> bytes:
    return b"q" + _U64.pack(sid) + _U64.pack(seq)


def retained_key(topic: str) -> bytes:
    return RETAINED_PREFIX + topic.encode("utf-8")


def pubrel_prefix(sid: int) -> bytes:
    return b"x" + _U64.pack(sid)


def pubrel_key(sid: int, packet_id: int) -> bytes:
    return b"x" + _U64.pack(sid) + _U16.pack(packet_id)


KEY_SIZES = {b"q": 17, b"t": 9, b"w": 9, b"x": 11, b"m": 9, b"c": 9}
"""Prefix -> length of every key under it (a prefix, then a session number or message id, then a
sequence number or packet id): a key of another length is damage."""
KEY_NAMES = {
    b"q": "queue entry",
    b"t": "queue totals",
    b"w": "sent mark",
    b"x": "QoS 2 packet id",
    b"m": "message body",
    b"c": "message reference count",
}


def checked_key(key: bytes) -> bytes:
    """``key`` (under one of KEY_SIZES' prefixes), or DamagedRecordError naming it when its length is wrong
    (its session number, message id or sequence number cannot be read from it)."""
    size = KEY_SIZES[key[:1]]
    if len(key) != size:
        raise DamagedRecordError(f"a {KEY_NAMES[key[:1]]} key of {len(key)} bytes, not {size} (damaged): {key!r}")
    return key


def iter_pubrel_due(db: Any) -> Iterator[tuple[int, int]]:
    """(sid, packet id) of every inbound QoS 2 publish whose PUBREL is due; DamagedRecordError names
    a key of the wrong length."""
    for key in db.iterator(prefix=b"x", include_value=False):
        checked_key(key)
        yield int(_U64.unpack_from(key, 1)[0]), int(_U16.unpack_from(key, 9)[0])


def sid_of_entry_key(key: bytes) -> int:
    return int(_U64.unpack_from(key, 1)[0])


def msg_id_of_body_key(key: bytes) -> int:
    """The message id of a message body key (body_key) or reference count key (refs_key): the same
    bytes 1-8 as a queue entry's session number, but a message id."""
    return int(_U64.unpack_from(key, 1)[0])


def seq_of_entry_key(key: bytes) -> int:
    return int(_U64.unpack_from(key, 9)[0])


@dataclass(slots=True)
class Body:
    """A published message as stored once for every session it was routed to."""

    topic: str
    payload: bytes
    qos: int
    published_at: float

    def encode(self) -> bytes:
        topic = self.topic.encode("utf-8")
        return _BODY_HEAD.pack(self.published_at, self.qos, len(topic)) + topic + self.payload

    @classmethod
    def decode(cls, raw: bytes) -> Body:
        published_at, qos, topic_len = _BODY_HEAD.unpack_from(raw)
        start = _BODY_HEAD.size
        if start + topic_len > len(raw):
            raise ValueError(f"a topic of {topic_len} bytes in a body of {len(raw)}")
        topic = raw[start : start + topic_len].decode("utf-8")
        return cls(topic, raw[start + topic_len :], qos, published_at)


@dataclass(slots=True)
class RetainedMessage:
    """A topic's retained message as stored under b"r" + topic."""

    topic: str
    payload: bytes
    qos: int
    published_at: float

    def encode(self) -> bytes:
        return _RETAINED_HEAD.pack(self.published_at, self.qos) + self.payload

    @classmethod
    def decode(cls, key: bytes, raw: bytes) -> RetainedMessage:
        published_at, qos = _RETAINED_HEAD.unpack_from(raw)
        if qos > 2:  # MQTT has QoS 0, 1 and 2
            raise ValueError(f"QoS {qos}")
        return cls(retained_topic(key), raw[_RETAINED_HEAD.size :], qos, published_at)


def retained_topic(key: bytes) -> str:
    """The topic of a ``b"r"`` key; DamagedRecordError when it is not UTF-8."""
    try:
        return key[len(RETAINED_PREFIX) :].decode("utf-8")
    except UnicodeDecodeError as exc:
        topic = key[len(RETAINED_PREFIX) :]
        raise DamagedRecordError(f"the topic of a retained message, {topic!r}, is not UTF-8") from exc


def iter_retained(db: Any) -> Iterator[RetainedMessage]:
    """Every stored retained message, in topic byte order; DamagedRecordError names one that does not decode."""
    for key, value in db.iterator(prefix=RETAINED_PREFIX, verify_checksums=True):
        topic = retained_topic(key)
        yield decoded(partial(RetainedMessage.decode, key), value, f"the retained message of topic {topic!r}")


def decoded(decode: Callable[[_R], _T], raw: _R, what: str) -> _T:
    """``decode(raw)``, or DamagedRecordError naming ``what`` (repair rebuilds what it can)."""
    try:
        return decode(raw)
    except (struct.error, ValueError) as exc:
        size = len(raw) if isinstance(raw, bytes) else 0
        raise DamagedRecordError(f"{what}: {size} bytes that do not decode") from exc


@dataclass(slots=True)
class Entry:
    """One message in one session's queue."""

    seq: int
    msg_id: int
    qos: int
    flags: int
    size: int

    def encode(self) -> bytes:
        return _ENTRY.pack(self.msg_id, self.qos, self.flags, self.size)

    @classmethod
    def decode(cls, seq: int, raw: bytes) -> Entry:
        msg_id, qos, flags, size = _ENTRY.unpack(raw)
        return cls(seq, msg_id, qos, flags, size)


@dataclass(slots=True)
class DamagedEntry(Entry):
    """A queue entry that does not decode (iter_entries' keep_damaged): removable by ``key`` only; its
    message id, QoS and size are unknown (0), so its body and reference count stay for repair."""

    key: bytes = b""
    problem: str = ""


def awaiting_pubcomp(entry: Entry) -> bool:
    """A QoS 2 entry whose PUBREC came (RELEASED): only its PUBREL is due, which needs no body. The
    RELEASED flag on an entry of another QoS (damage) means nothing: it needs its body as any other."""
    return entry.qos == 2 and bool(entry.flags & FLAG_RELEASED)


@dataclass
class SessionRecord:
    """What survives a restart about one durable session (JSON under b"s" + client id)."""

    client_id: str
    sid: int
    subscriptions: dict[str, int] = field(default_factory=dict)
    created_at: float = field(default_factory=time.time)
    disconnected_at: float | None = None
    expires_at: float | None = None
    username: str | None = None
    """The owner: the user whose CONNECT created the session (or took it over with session_takeover:
    any-user); topic ACL plugins decide by it what the session may receive. Stores written before
    owners existed hold the user of the last CONNECT here, which becomes the owner."""
    sdk: bool = False
    """The client said hello (protocol v1): framed events, held until ready, replay markers."""
    expiry: float | None = None
    """The client's own session expiry (hello), already capped; None: the broker's session_expiry."""
    non_durable: set[str] = field(default_factory=set)
    """Subscriptions dropped when the connection ends (GemFire's non-durable interest)."""

    def encode(self) -> bytes:
        return json.dumps(
            {
                "sid": self.sid,
                "subscriptions": self.subscriptions,
                "created_at": self.created_at,
                "disconnected_at": self.disconnected_at,
                "expires_at": self.expires_at,
                "username": self.username,
                "sdk": self.sdk,
                "expiry": self.expiry,
                "non_durable": sorted(self.non_durable),
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def decode(cls, client_id: str, raw: bytes) -> SessionRecord:
        """The record; ValueError, KeyError, TypeError or AttributeError when its JSON is not one (a
        field of the wrong type or a session number no key can hold: the broker would fail on it later,
        where nothing names the record)."""
        try:
            return cls._decode(client_id, raw)
        except (OverflowError, RecursionError) as exc:  # Infinity or 1e400 as a number, JSON nested too deeply
            raise ValueError(f"a session record that does not decode: {exc}") from exc

    @classmethod
    def _decode(cls, client_id: str, raw: bytes) -> SessionRecord:
        data: dict[str, Any] = json.loads(raw)
        sid = int(data["sid"])
        if not 0 <= sid <= MAX_U64:
            raise ValueError(f"session number {sid} is not 0 to 2**64 - 1")
        return cls(
            client_id=client_id,
            sid=sid,
            subscriptions={str(k): int(v) for k, v in data.get("subscriptions", {}).items()},
            created_at=float(data.get("created_at", 0.0)),
            disconnected_at=_number_or_none(data, "disconnected_at"),
            expires_at=_number_or_none(data, "expires_at"),
            username=_text_or_none(data, "username"),
            sdk=bool(data.get("sdk", False)),
            expiry=_number_or_none(data, "expiry"),
            non_durable={str(f) for f in data.get("non_durable", [])},
        )


MAX_U64 = 2**64 - 1


def _number_or_none(data: dict[str, Any], name: str) -> float | None:
    value = data.get(name)
    if value is None or (isinstance(value, int | float) and not isinstance(value, bool)):
        return value
    raise TypeError(f"{name} is {value!r}, not a number")


def _text_or_none(data: dict[str, Any], name: str) -> str | None:
    value = data.get(name)
    if value is None or isinstance(value, str):
        return value
    raise TypeError(f"{name} is {value!r}, not a string")


def encode_totals(depth: int, size: int, dropped: int) -> bytes:
    return _TOTALS.pack(depth, size, dropped)


def decode_totals(raw: bytes | None) -> tuple[int, int, int]:
    """(messages queued, payload bytes queued, messages dropped by overflow) of one session."""
    if raw is None:
        return 0, 0, 0
    depth, size, dropped = _TOTALS.unpack(raw)
    return int(depth), int(size), int(dropped)


def encode_u64(value: int) -> bytes:
    return _U64.pack(value)


def decode_u64(raw: bytes | None) -> int:
    return 0 if raw is None else int(_U64.unpack(raw)[0])


def decode_refs(raw: bytes | None) -> int:
    return 1 if raw is None else int(_REFS.unpack(raw)[0])


def encode_refs(refs: int) -> bytes:
    return _REFS.pack(refs)


_LEVELDB_DATA = re.compile(r"^(MANIFEST-\d+|\d+\.(log|ldb|sst))$")
"""Files that hold a LevelDB store's data (LOCK, LOG and LOG.old are LevelDB's bookkeeping only)."""
_LEVELDB_BOOKKEEPING = frozenset({"LOCK", "LOG", "LOG.old"})
"""Made by LevelDB before CURRENT: alone in a folder (a crash or full disk while creating the
store) they hold no data, and the folder counts as empty."""
_TABLE_MAGIC = struct.pack("<Q", 0xDB4775248B80FB57)
"""The last 8 bytes of every complete LevelDB table file (its footer's magic number)."""
_TABLE_RANGE = re.compile(rb" (\d+):\d+\['(.*?)' @ \d+ : \d+ \.\. '(.*?)' @ \d+ : \d+\]")
"""A live table in LevelDB's ``leveldb.sstables`` property: `` N:size['smallest' @ seq : type .. 'largest' ...]``."""


def _file_above(path: str) -> str:
    """What stands where a folder on the way to ``path`` should be (``afile`` of ``afile/store``,
    ``/dev/null`` of ``/dev/null/store``): the one to name, not ``path``."""
    above = os.path.dirname(os.path.abspath(path))
    while not _not_a_folder(above) and os.path.dirname(above) != above:
        above = os.path.dirname(above)
    return above


def _not_a_folder(path: str) -> bool:
    """Something other than a folder is there (a file, a device, a FIFO, a socket)."""
    return os.path.exists(path) and not os.path.isdir(path)


def _warn_nested_stores(path: str, names: list[str]) -> None:
    """A WARNING for each folder in the store's folder that is itself a store: a backup copied
    *into* the live store's folder (``cp -a /backups/durable-1 data/durable`` with ``data/durable``
    there) is not what the broker uses, and nothing else says so."""
    for name in names:
        if _LEVELDB_DATA.match(name) or name in _LEVELDB_BOOKKEEPING:
            continue
        if os.path.isfile(os.path.join(path, name, "CURRENT")):
            log.warning(
                "store folder '%s' holds a folder '%s' that is itself a LevelDB store (a backup copied into the "
                "store's folder?): it is not used; '%s' is the store in use. To restore that copy, stop the broker "
                "and put it in place of '%s' (operations.md, Backing up, restoring and moving a store)",
                path,
                name,
                path,
                path,
            )


def _check_folder(path: str, *, create: bool) -> bool:
    """Is ``path`` a LevelDB store (True), or an empty or missing folder to create one in (False)?

    LevelDB opened with create_if_missing over a folder that lost its CURRENT file starts a new
    store and deletes the old table files as obsolete: a store is only ever created where there
    is nothing, and a folder holding anything else is refused untouched.
    """
    try:
        names = os.listdir(path)
    except FileNotFoundError:
        names = None
    except NotADirectoryError as exc:
        what = f"'{path}'" if _not_a_folder(path) else f"'{path}': '{_file_above(path)}'"
        raise StoreError(f"store {what} is a file, not a folder; point 'store' at a folder") from exc
    except OSError as exc:
        raise StoreError(f"cannot read store folder '{path}': {exc.strerror}") from exc
    if names is not None and "CURRENT" in names:
        _warn_nested_stores(path, names)
        return True
    data = sorted(name for name in names or () if _LEVELDB_DATA.match(name))
    if data:
        raise StoreCorruptedError(
            path,
            f"its LevelDB files are there ({', '.join(data[:4])}{', ...' if len(data) > 4 else ''}) but "
            "CURRENT, the file naming the live MANIFEST, is missing; nothing was changed and no new store "
            "is created over them",
        )
    others = sorted(name for name in names or () if name not in _LEVELDB_BOOKKEEPING)
    if others:
        shown = ", ".join(others[:4]) + (", ..." if len(others) > 4 else "")
        raise StoreError(
            f"store folder '{path}' holds files ({shown}) but no LevelDB store; a store is only created in "
            "an empty or missing folder: point 'store' at one"
        )
    if not create:
        raise StoreError(f"no store at '{path}' (no LevelDB files there; is it the plugin's 'store' folder?)")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise StoreError(f"cannot create store folder '{path}': {exc.strerror}") from exc
    return False


def _check_tables(path: str, db: Any) -> None:
    """Every live table file must be whole and its index readable.

    LevelDB checks neither at open: a table cut short (a copy or disk that lost its end) is
    found only when a read reaches it, with a bare ``IO error: ...ldb: Invalid argument``, and a
    table whose index does not open is passed over by iterators as if it were empty (plyvel
    raises nothing): its sessions would vanish and their queues look like a deleted session's
    leftovers. So each table's footer is checked here, and a point read of a key inside its
    range that no store holds (its smallest key + NUL) makes LevelDB open it, index checksum
    verified (paranoid_checks).
    """
    listing = db.get_property(b"leveldb.sstables") or b""
    for number, smallest, largest in _TABLE_RANGE.findall(listing):
        found = _table_tail(path, int(number))
        if found is None:
            continue  # compacted away meanwhile
        name, size, tail = found
        if tail != _TABLE_MAGIC:
            raise StoreCorruptedError(
                path, f"table file {name} is truncated or damaged ({size} bytes, its footer is missing)"
            )
        low, high = _unescape(smallest), _unescape(largest)
        probe = low + b"\x00" if low + b"\x00" <= high else low
        try:
            db.get(probe, verify_checksums=True)
        except plyvel.Error as exc:
            raise StoreCorruptedError(path, f"table file {name} cannot be read: {leveldb_detail(exc)}") from exc


def _table_tail(path: str, number: int) -> tuple[str, int, bytes] | None:
    """(file name, size, last 8 bytes) of table ``number`` (named .ldb, or .sst by older LevelDBs)."""
    for name in (f"{number:06d}.ldb", f"{number:06d}.sst"):
        try:
            with open(os.path.join(path, name), "rb") as table:
                size = table.seek(0, os.SEEK_END)
                table.seek(max(0, size - len(_TABLE_MAGIC)))
                return name, size, table.read()
        except FileNotFoundError:
            continue
    return None


def _unescape(text: bytes) -> bytes:
    """A key as LevelDB's debug strings print it (bytes outside ' '..'~' as \\xNN) back to bytes."""
    return re.sub(rb"\\x([0-9a-f]{2})", lambda found: bytes((int(found.group(1), 16),)), text)


def leveldb_detail(exc: BaseException) -> str:
    """plyvel's message as text (it carries bytes), with what LevelDB's terse ones mean; another
    error's (a body that does not decode) as ``str`` gives it (a UnicodeDecodeError's first
    argument is only the codec's name)."""
    raw = exc.args[0] if exc.args and isinstance(exc, plyvel.Error) else str(exc)
    detail = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
    if isinstance(exc, plyvel.IOError) and "Invalid argument" in detail:
        # LevelDB's pread past the end of a table file: the file is shorter than the store thinks.
        detail += " (a read past the end of that file: it is truncated)"
    return detail


def _is_lock_error(exc: plyvel.Error) -> bool:
    """LevelDB's ``IO error: lock STORE/LOCK: ...``: another process (or handle) has the store open."""
    return isinstance(exc, plyvel.IOError) and leveldb_detail(exc).startswith("IO error: lock ")


def read_error(path: str, exc: BaseException) -> StoreError:
    """A failed open or read of the store as the error to show: what failed, which file, what to do."""
    detail = leveldb_detail(exc)
    if isinstance(exc, plyvel.IOError) and "truncated" not in detail:
        return StoreError(f"cannot read store '{path}': {detail}")
    return StoreCorruptedError(path, detail)


def open_store(path: str, *, create: bool = True) -> Any:
    """Open (or, in an empty or missing folder, create) the store; a clear error for a lock or damage.

    The plugin writes nothing to a store it refuses; one without CURRENT is not even opened.
    """
    exists = _check_folder(path, create=create)
    try:
        db = plyvel.DB(
            path,
            create_if_missing=not exists,
            paranoid_checks=True,
            bloom_filter_bits=10,
            lru_cache_size=8 * 1024 * 1024,
            write_buffer_size=4 * 1024 * 1024,  # memtables count twice against RSS while one is compacted
        )
    except plyvel.Error as exc:
        if _is_lock_error(exc):
            raise StoreLockedError(path) from exc
        raise read_error(path, exc) from exc
    try:
        _check_tables(path, db)
        version = db.get(VERSION_KEY, verify_checksums=True)
        if version is None:
            if next(db.iterator(include_value=False, verify_checksums=True), None) is not None:
                raise StoreCorruptedError(path, "it holds data but no layout version key")
            db.put(VERSION_KEY, LAYOUT_VERSION, sync=True)
        elif version != LAYOUT_VERSION:
            raise ForeignLayoutError(path, version, LAYOUT_VERSION)
    except plyvel.Error as exc:
        db.close()
        raise read_error(path, exc) from exc
    except StoreError:
        db.close()
        raise
    return db


@contextlib.contextmanager
def repaired_store(path: str) -> Iterator[Any]:
    """LevelDB's own repair, then the repaired store, open, for ``repair.rebuild``: the store's lock
    is held from before LevelDB's repair (which takes none) until the store is closed again, so a
    broker or ``inspect`` started meanwhile is refused as locked instead of opening a store whose
    bookkeeping is not rebuilt yet.

    LevelDB's repair does not take the store's lock, so a broker using the store is detected
    first by a test of the lock (``check_repairable``; the store is not opened before LevelDB's
    repair). ForeignLayoutError after LevelDB's repair ran: another release's store that did not
    open before (``store_owner`` refuses one that did).
    """
    _start_repair(path)
    with held_lock(path):
        _repair_db(path)
        try:
            db = plyvel.DB(path, create_if_missing=False, paranoid_checks=True)
        except plyvel.Error as exc:
            detail = leveldb_detail(exc)
            raise StoreError(f"repair of '{path}' failed: the repaired store does not open: {detail}") from exc
        # LevelDB's lock, taken by this open, is this process's fcntl lock of LOCK, the same as
        # held_lock's: held_lock closes its descriptor (which drops every lock this process holds
        # on the file) only after the store is closed.
        try:
            try:
                version = db.get(VERSION_KEY, verify_checksums=True)
            except plyvel.Error as exc:
                raise StoreError(f"repair of '{path}' failed: {leveldb_detail(exc)}") from exc
            if version is not None and version != LAYOUT_VERSION:
                raise ForeignLayoutError(path, version, LAYOUT_VERSION, repaired=True)
            yield db
        finally:
            db.close()


REPAIR_SPACE_FACTOR = 2
"""Repair's free-space check: this many times the store's log and table files, plus PROBE_MARGIN."""


def repair_space(path: str) -> int:
    """Bytes the disk must take for a repair of the store at ``path``. LevelDB's repair writes a
    table of each log's records and a copy of each damaged table's readable records (any table may
    be damaged: all of them), then the reopen compacts every table (repair puts them all at level 0)
    into new ones before removing the old: about the store's size twice, plus the MANIFEST's margin.
    A copy that fails for space is dropped by LevelDB's repair without a word (its readable records
    lost), a failed MANIFEST write leaves a store that does not open."""
    return REPAIR_SPACE_FACTOR * _files_size(path, (".ldb", ".sst", ".log")) + PROBE_MARGIN


def _start_repair(path: str) -> None:
    """A store repair may rewrite (``check_repairable``, again: a broker may have started since
    ``repair`` checked) on a disk that takes what it writes, else StoreError."""
    check_repairable(path)
    need = repair_space(path)
    try:
        reserve(path, need)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StoreError(
                f"repair of '{path}' not started: its folder cannot take the writes a repair needs "
                f"({exc.strerror}: it needs {need / 1e6:.1f} MB free, twice the store's table and log files "
                "plus 1 MB); nothing was changed. Free space on the store's disk, then run repair again"
            ) from exc
        raise StoreError(
            f"repair of '{path}' not started: its folder cannot be written ({exc.strerror or exc}); nothing was changed"
        ) from exc


def _repair_db(path: str) -> None:
    try:
        plyvel.repair_db(path, paranoid_checks=True)  # checksums verified: a damaged block is dropped, not kept
    except plyvel.Error as exc:
        raise StoreError(f"repair of '{path}' failed: {leveldb_detail(exc)}") from exc


def check_repairable(path: str) -> None:
    """A LevelDB store folder at ``path`` that no process holds, else StoreError; nothing in it is
    read but its file names, nor written. Another release's or another program's store is
    ``store_owner.refuse_another_programs``'s to refuse (``repair`` runs it after this check)."""
    try:
        names = os.listdir(path)
    except FileNotFoundError:
        raise StoreError(f"no store at '{path}' (folder does not exist)") from None
    except NotADirectoryError:  # the path, or a folder above it, is a file: named as the broker names it
        what = f"'{path}'" if _not_a_folder(path) else f"'{path}': '{_file_above(path)}'"
        raise StoreError(f"store {what} is a file, not a folder; point 'store' at a folder") from None
    except OSError as exc:
        raise StoreError(f"cannot read store folder '{path}': {exc.strerror}") from exc
    if "CURRENT" not in names and not any(_LEVELDB_DATA.match(name) for name in names):
        raise StoreError(f"no store at '{path}' (no LevelDB files there; is it the plugin's 'store' folder?)")
    _refuse_locked(path)


def _refuse_locked(path: str) -> None:
    """StoreLockedError if a process holds the store's lock (LevelDB's fcntl lock of its LOCK file),
    found without writing anything: LOCK is opened, not created (a folder without one is held by
    nobody; one that cannot be opened is left to LevelDB's open to name), and the lock taken to
    check, a shared one (it needs LOCK readable only, not writable: a user who may not write it
    still sees a broker's lock), is released at once. A lock this process holds is not seen (fcntl
    locks are the process's)."""
    try:
        descriptor = os.open(os.path.join(path, "LOCK"), os.O_RDONLY)
    except OSError:
        return
    try:
        fcntl.lockf(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EAGAIN):
            raise StoreLockedError(path) from exc
        raise StoreError(f"cannot check whether a process holds store '{path}': {exc.strerror or exc}") from exc
    finally:
        os.close(descriptor)


@contextlib.contextmanager
def held_lock(path: str) -> Iterator[None]:
    """LevelDB's lock on the store (an fcntl lock of its LOCK file), held by this process while
    LevelDB's repair, which takes none, rewrites the store: a broker or ``inspect`` started
    meanwhile is refused as 'locked by another process' instead of opening a store half rewritten.
    LevelDB opening the store in this process meanwhile takes the same lock (fcntl locks are the
    process's), and closing this descriptor drops it even for LevelDB: close the store first. Nothing
    else in this process may open the store or its LOCK meanwhile: even a failed open drops the lock."""
    descriptor = os.open(os.path.join(path, "LOCK"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.lockf(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:  # taken since check_repairable found it free
            raise StoreLockedError(path) from exc
        yield
    finally:
        os.close(descriptor)


def iter_entries(
    db: Any,
    sid: int,
    start_seq: int = 0,
    limit: int | None = None,
    client_id: str | None = None,
    *,
    keep_damaged: bool = False,
) -> Iterator[Entry]:
    """Queue entries of one session in order, from ``start_seq`` on; DamagedRecordError names one that
    does not decode (of client id ``client_id``, if given, else of session number ``sid``). With
    ``keep_damaged`` such an entry comes as a DamagedEntry instead (for those that remove entries
    by key: drop-oldest, session deletion), and so does a key of the wrong length (its seq -1)."""
    if limit is not None and limit <= 0:
        return
    rows = _queue_rows(db, sid, start_seq, queue_prefix(sid + 1))
    key_size = KEY_SIZES[b"q"]
    entry_size = _ENTRY.size
    unpack = _ENTRY.unpack
    seq_of = _U64.unpack_from
    for count, (key, value) in enumerate(rows, start=1):
        # Decoded here, not through decoded(): this loop reads every entry of a queue being deleted.
        if len(key) == key_size and len(value) == entry_size:
            msg_id, qos, flags, size = unpack(value)
            yield Entry(seq_of(key, 9)[0], msg_id, qos, flags, size)
        else:
            damaged = damaged_entry(sid, key, value, client_id)
            if not keep_damaged:
                raise DamagedRecordError(damaged.problem)
            yield damaged
        if limit is not None and count >= limit:
            return


def _queue_rows(db: Any, sid: int, start_seq: int, stop: bytes) -> Iterator[tuple[bytes, bytes]]:
    """One session's queue rows from entry ``start_seq``'s place up to the key ``stop``, starting right
    after entry ``start_seq - 1``'s key, not at ``start_seq``'s: a key too short for a queue entry that
    sorts between the two (damage) is met there, so a read after one cut short by it (delivery's, and
    drop-oldest's from the same place) fails on it again, reported, instead of starting past it and
    skipping it. A key too long that begins with entry ``start_seq - 1``'s is passed over: the read
    that met entry ``start_seq - 1`` may have read it too (as that entry)."""
    prefix = queue_prefix(sid)
    if start_seq == 0:
        return iter(db.iterator(start=prefix + _U64.pack(0), stop=stop, verify_checksums=True))
    previous = prefix + _U64.pack(start_seq - 1)
    rows = db.iterator(start=previous + b"\x00", stop=stop, verify_checksums=True)
    return dropwhile(lambda row: row[0].startswith(previous), rows)


def damaged_entry(sid: int, key: bytes, value: bytes, client_id: str | None = None) -> DamagedEntry:
    """A queue entry whose key or value does not decode, named (repair rebuilds what it can)."""
    if len(key) != KEY_SIZES[b"q"]:
        problem = f"a {KEY_NAMES[b'q']} key of {len(key)} bytes, not {KEY_SIZES[b'q']} (damaged): {key!r}"
        return DamagedEntry(-1, NO_BODY, 0, 0, 0, key, problem)
    seq = seq_of_entry_key(key)
    owner = f"client id {client_id!r}" if client_id is not None else f"session number {sid}"
    problem = f"queue entry {seq} of {owner}: {len(value)} bytes that do not decode"
    return DamagedEntry(seq, NO_BODY, 0, 0, 0, key, problem)


def first_seq(db: Any, sid: int) -> int | None:
    """The sequence number of a session's first queue entry (its key only: an entry whose value does not
    decode is met, and named, when delivery reaches it, as any other); None for an empty queue."""
    for key in db.iterator(prefix=queue_prefix(sid), include_value=False, verify_checksums=True):
        return seq_of_entry_key(checked_key(key))
    return None


def last_seq(db: Any, sid: int) -> int | None:
    prefix = queue_prefix(sid)
    for key in db.iterator(prefix=prefix, reverse=True, include_value=False, verify_checksums=True):
        return seq_of_entry_key(checked_key(key))
    return None


def iter_sessions(db: Any) -> Iterator[SessionRecord]:
    for key, value in db.iterator(prefix=b"s", verify_checksums=True):
        try:
            yield SessionRecord.decode(key[1:].decode("utf-8"), value)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            client = key[1:].decode("utf-8", "replace")
            raise DamagedRecordError(
                f"the session record of client id {client!r} does not decode ({type(exc).__name__}: {exc})"
            ) from exc


def last_sid(db: Any, prefix: bytes) -> int:
    """The highest session number under a per-session prefix (b"q", b"t", b"w", b"x"); 0 for none.
    DamagedRecordError names a last key of the wrong length."""
    for key in db.iterator(prefix=prefix, reverse=True, include_value=False, verify_checksums=True):
        return int(_U64.unpack_from(checked_key(key), 1)[0])
    return 0


SID_MARK_KEY = b"n"
STORE_ID_KEY = b"i"
MSG_ID_MARK_KEY = b"M"
MSG_ID_RESERVE = 1024
"""Message ids the b"M" mark is moved ahead by at a time: one write per this many messages."""


def last_msg_id(db: Any) -> int:
    """The highest message id a body is stored under; 0 for none. DamagedRecordError names a last
    key of the wrong length."""
    for key in db.iterator(prefix=b"m", reverse=True, include_value=False, verify_checksums=True):
        return msg_id_of_body_key(checked_key(key))
    return 0


def scan_msg_ids_in_use(db: Any) -> tuple[int, int]:
    """The highest message id a body, a reference count or a queue entry holds (reads every queue
    entry: only for a store without the b"M" mark, once), and how many queue entries it read. The entries are read past
    LevelDB's block cache (fill_cache=False): a read-once scan must not push out what the
    broker reads next."""
    highest = last_msg_id(db)
    for key in db.iterator(prefix=b"c", reverse=True, include_value=False, verify_checksums=True):
        highest = max(highest, msg_id_of_body_key(checked_key(key)))
        break
    read = 0
    for value in db.iterator(prefix=b"q", include_key=False, verify_checksums=True, fill_cache=False):
        read += 1
        if len(value) == _ENTRY.size:
            highest = max(highest, int(_U64.unpack_from(value)[0]))
    return highest, read


def holds_queue_entries(db: Any) -> bool:
    """Whether any queue entry is stored (a new store holds none)."""
    return next(db.iterator(prefix=b"q", include_value=False, verify_checksums=True), None) is not None


def read_msg_id_mark(db: Any) -> int | None:
    """The b"M" mark (None: a store written before it existed); DamagedRecordError if it does not decode."""
    raw = db.get(MSG_ID_MARK_KEY, verify_checksums=True)
    return None if raw is None else decoded(decode_u64, raw, "the highest message id")


def write_msg_id_mark(w: Writes, msg_id: int) -> None:
    w.put(MSG_ID_MARK_KEY, encode_u64(msg_id))


class Writes(Protocol):
    """Where the verbs below put their keys: a GroupCommitter (or a LevelDB write batch)."""

    def put(self, key: bytes, value: bytes) -> None: ...

    def delete(self, key: bytes) -> None: ...


# The verbs sessions and routing write with: code above the store never builds a key itself.


def write_store_id(w: Writes, store_id: int) -> None:
    w.put(STORE_ID_KEY, encode_u64(store_id))


def write_session(w: Writes, record: SessionRecord) -> None:
    w.put(session_key(record.client_id), record.encode())


def erase_session(w: Writes, client_id: str) -> None:
    w.delete(session_key(client_id))


def write_sid_mark(w: Writes, sid: int) -> None:
    w.put(SID_MARK_KEY, encode_u64(sid))


def write_entry(w: Writes, sid: int, entry: Entry) -> None:
    w.put(entry_key(sid, entry.seq), entry.encode())


def erase_entry(w: Writes, sid: int, seq: int) -> None:
    w.delete(entry_key(sid, seq))


def erase_entries(w: Writes, sid: int, seqs: list[int]) -> None:
    _delete_all(w, list(map(queue_prefix(sid).__add__, map(_U64.pack, seqs))))  # entry_key, per seq


def _delete_all(w: Writes, keys: list[bytes]) -> None:
    delete_many = getattr(w, "delete_many", None)  # the committer's: one call for a run
    if delete_many is not None:
        delete_many(keys)
        return
    for key in keys:
        w.delete(key)


def write_sent_mark(w: Writes, sid: int, mark: int) -> None:
    w.put(sent_mark_key(sid), encode_u64(mark))


def write_totals(w: Writes, sid: int, depth: int, size: int, dropped: int) -> None:
    w.put(totals_key(sid), encode_totals(depth, size, dropped))


def erase_session_keys(w: Writes, db: Any, sid: int) -> None:
    """A deleted session's totals, sent mark and QoS 2 states (its entries go in chunks before)."""
    w.delete(totals_key(sid))
    w.delete(sent_mark_key(sid))
    for key in db.iterator(prefix=pubrel_prefix(sid), include_value=False):
        w.delete(key)  # at most 65,535


def write_body(w: Writes, msg_id: int, body: Body) -> None:
    w.put(body_key(msg_id), body.encode())


def erase_body(w: Writes, msg_id: int) -> None:
    w.delete(body_key(msg_id))


def erase_bodies(w: Writes, msg_ids: list[int]) -> None:
    _delete_all(w, list(map(b"m".__add__, map(_U64.pack, msg_ids))))  # body_key, per message id


def write_refs(w: Writes, msg_id: int, refs: int) -> None:
    w.put(refs_key(msg_id), encode_refs(refs))


def erase_refs(w: Writes, msg_id: int) -> None:
    w.delete(refs_key(msg_id))


def write_pubrel_due(w: Writes, sid: int, packet_id: int) -> None:
    w.put(pubrel_key(sid, packet_id), b"")


def erase_pubrel_due(w: Writes, sid: int, packet_id: int) -> None:
    w.delete(pubrel_key(sid, packet_id))


DENSE_SPAN = 4
"""read_stored_bodies walks the body keys between a run's lowest and highest message id in one iterator pass
when that range holds at most this many keys per body wanted; sparser runs (sessions whose messages
interleave with many others') get each body by key."""


BODY_TOPIC_FIELD = _BODY_HEAD.size - 2
"""A stored body from this offset on is the topic field as MQTT encodes it (length in two bytes, then
the UTF-8 topic), then the payload: a PUBLISH is built from it without decoding (wire.PublishRun.add_stored)."""


def read_stored_bodies(db: Any, msg_ids: list[int]) -> dict[int, bytes]:
    """The stored bodies of ``msg_ids`` (a run of queue entries, in order) as stored, each checked as
    Body.decode would (a body shorter than its head or its topic, a topic that is not UTF-8); a missing
    one is absent.

    One iterator pass over the run's body keys when they are dense (a backlog published to few
    sessions), else one get per body; each topic's UTF-8 is checked once per run. Checksums are
    verified either way. Raises what LevelDB or the check raises (plyvel.Error, ValueError,
    struct.error): the caller falls back to reading entry by entry.
    """
    if not msg_ids:
        return {}
    wanted = set(msg_ids)
    bodies: dict[int, bytes] = {}
    low, high = msg_ids[0], msg_ids[-1]
    if low > high:
        low, high = min(wanted), max(wanted)
    if high - low < DENSE_SPAN * len(wanted):
        unpack_id = _U64.unpack_from
        for key, raw in db.iterator(start=body_key(low), stop=body_key(high + 1), verify_checksums=True):
            msg_id = unpack_id(key, 1)[0]
            if msg_id in wanted:
                bodies[msg_id] = raw
    else:
        get = db.get
        for msg_id in wanted:
            raw = get(body_key(msg_id), verify_checksums=True)
            if raw is not None:
                bodies[msg_id] = raw
    check_bodies(bodies.values())
    return bodies


def check_bodies(bodies: Iterable[bytes]) -> None:
    """Raise what Body.decode raises on one of ``bodies`` (struct.error, ValueError) without decoding
    them: each topic's UTF-8 is checked once."""
    head = _BODY_HEAD.unpack_from
    start = _BODY_HEAD.size
    topics: set[bytes] = set()
    for raw in bodies:
        end = start + head(raw)[2]
        if end > len(raw):
            raise ValueError(f"a topic of {end - start} bytes in a body of {len(raw)}")
        field = raw[BODY_TOPIC_FIELD:end]
        if field not in topics:
            field[2:].decode("utf-8")
            topics.add(field)


def read_entry_run(
    db: Any, sid: int, start_seq: int, tail: int, limit: int
) -> tuple[list[Entry], BaseException | None]:
    """Up to ``limit`` queue entries of one session from ``start_seq`` to ``tail``, in one iterator pass,
    and the error that cut the run short (plyvel.Error, ValueError, struct.error; None: no damage met)."""
    entries: list[Entry] = []
    if limit <= 0:
        return entries, None
    append = entries.append
    unpack_seq = _U64.unpack_from
    unpack = _ENTRY.unpack
    if tail < start_seq:
        return entries, None
    rows = _queue_rows(db, sid, start_seq, queue_prefix(sid) + _U64.pack(tail + 1))
    try:
        for key, value in islice(rows, limit):
            msg_id, qos, flags, size = unpack(value)
            append(Entry(unpack_seq(key, 9)[0], msg_id, qos, flags, size))
    except (plyvel.Error, ValueError, struct.error) as exc:
        return entries, exc
    return entries, None


def read_store_id(db: Any) -> int | None:
    """The store id (None: a store written before it existed); DamagedRecordError if it does not decode."""
    raw = db.get(STORE_ID_KEY, verify_checksums=True)
    return None if raw is None else decoded(decode_u64, raw, "the store id")


def read_sid_mark(db: Any) -> int:
    return decoded(decode_u64, db.get(SID_MARK_KEY, verify_checksums=True), "the highest session number")


def read_session_state(db: Any, record: SessionRecord) -> tuple[tuple[int, int, int], int]:
    """A session's queue totals (depth, bytes, dropped) and sent mark; one that does not decode is named."""
    what = f"of client id {record.client_id!r}"
    totals = decoded(decode_totals, db.get(totals_key(record.sid), verify_checksums=True), f"the queue totals {what}")
    mark = decoded(decode_u64, db.get(sent_mark_key(record.sid), verify_checksums=True), f"the sent mark {what}")
    return totals, mark


def orphaned_keys(db: Any, known: set[int]) -> tuple[list[int], list[bytes]]:
    """Sessions with queue entries but no record (a crash in the middle of deleting one: its record
    goes first), and the totals, sent marks and QoS 2 states left of sessions without a record."""
    sids: list[int] = []
    sid = 0
    while True:
        rows = db.iterator(start=queue_prefix(sid), stop=b"r", include_value=False, verify_checksums=True)
        key = next(rows, None)
        if key is None:
            break
        sid = sid_of_entry_key(checked_key(key))
        if sid not in known:
            sids.append(sid)
        sid += 1
    keys = [
        key
        for prefix in (b"t", b"w", b"x")
        for key in db.iterator(prefix=prefix, include_value=False, verify_checksums=True)
        if sid_of_entry_key(checked_key(key)) not in known
    ]
    return sids, keys


def next_free_sid(db: Any) -> int:
    """Past the sid mark and past queues and totals a crash left without a record: a sid is never reused."""
    return max(read_sid_mark(db), *(last_sid(db, prefix) for prefix in (b"q", b"t", b"w", b"x"))) + 1


RETRY_FIRST = 0.25
"""Seconds before the first retry after a failed store write; doubled after each failed retry."""
RETRY_MAX = 5.0
"""Longest wait between two retries: once the disk has room again, service resumes within it."""
PROBE_MARGIN = 1 << 20
"""Bytes a reopen writes besides a table of what its logs hold (manifest, new log, info log)."""
PROBE_NAME = "durable-write-probe.tmp"


def check_writable(path: str) -> None:
    """Raise OSError unless the store's disk can allocate as much as reopening the store needs.

    Reopening LevelDB turns its logs into a table, so a store is only closed for a reopen once
    that can succeed: a store that cannot open again could not be read either.
    """
    reserve(path, PROBE_MARGIN + _files_size(path, (".log",)))


def _files_size(path: str, suffixes: tuple[str, ...]) -> int:
    return sum(entry.stat().st_size for entry in os.scandir(path) if entry.name.endswith(suffixes))


def reserve(path: str, need: int) -> None:
    """Raise OSError unless the disk of the store at ``path`` can allocate ``need`` bytes (a probe
    file in its folder, removed at once)."""
    probe = os.path.join(path, PROBE_NAME)
    try:
        with open(probe, "wb") as out:
            # Reserved, not written: a repair's check of a 10 GB store would otherwise write 20 GB of zeros.
            os.posix_fallocate(out.fileno(), 0, need)
    finally:
        discard_probe(path)


def discard_probe(path: str) -> None:
    """Remove the probe file; at open too, as a crash during a probe leaves it (megabytes, on a
    disk that was full)."""
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):  # no store there: open_store names why
        os.remove(os.path.join(path, PROBE_NAME))


Op = tuple[bytes, bytes | None]
_WAIT, _FAIL_FAST, _LOCAL = 0, 1, 2
"""How a commit's waiter waits: for the retry while writes fail; fails at once then; and, with
replication, resolves after the local write instead of after the backups (see commit)."""


class CommitReplication(Protocol):
    """A replicated store's steps around each group commit (replication/commits.py)."""

    def prepare(self, ops: list[Op]) -> Any:
        """Number the commit; the result's ``ops`` are what to write locally."""

    def withdraw(self, batch: Any) -> None:
        """The local write of ``batch`` failed; the retry reuses its number."""

    def committed(self, batch: Any, then: Callable[[BaseException | None], None]) -> bool:
        """Written locally: ship it. True: acknowledge once ``then`` is called with None (with an
        error: never); False: now."""

    def may_acknowledge(self) -> bool:
        """False once this broker is no longer the primary."""


class GroupCommitter:
    """Collects writes from concurrent publishes and acks into shared LevelDB write batches.

    XAP's batch semantics: a commit starts as soon as ``pending_threshold`` operations wait,
    otherwise after at most ``batch_delay_ms``; ``batch_size`` bounds the operations one
    commit gathers before it is started. Each commit is one atomic write batch (a publish's
    body and its queue entries are never split), written in arrival order, so FIFO holds.
    With ``sync`` the write is fsynced (in a worker thread, so the loop keeps collecting).

    A failed write (disk full, I/O error) loses nothing: its operations stay queued, in front of
    any that came since, and are written again, with a back-off, until a write succeeds. That
    keeps the store consistent with the in-memory state (queue depths, next sequence numbers,
    body references), which already counts them; writing a batch twice is harmless, as a batch
    only puts and deletes whole values. Before each retry ``reopen`` gives a fresh handle:
    LevelDB refuses every write after a failed compaction or fsync until it is reopened, and a
    record written after a torn one in its log would be lost when the log is replayed at the
    next start. While writes fail, commits asked with ``fail_fast`` fail at once (a publish is
    then not acknowledged); the others wait for the retry.
    """

    def __init__(
        self,
        db: Any,
        *,
        sync: bool,
        batch_size: int,
        batch_delay_ms: float,
        pending_threshold: int,
        retry_first: float = RETRY_FIRST,
    ) -> None:
        self._db = db
        self._sync = sync
        self._batch_size = batch_size
        self._delay = batch_delay_ms / 1000.0
        self._threshold = pending_threshold
        self._ops: list[tuple[bytes, bytes | None]] = []
        self._units = 0
        self._waiters: list[tuple[asyncio.Future[None], int]] = []
        self._after_commit: list[Callable[[], None]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._soon: asyncio.Handle | None = None
        self._retry: asyncio.TimerHandle | None = None
        self._retry_first = retry_first
        """Seconds before the first retry after a failed write (RETRY_FIRST; a test may make it shorter)."""
        self._retry_delay = retry_first
        self._writing = False
        self._idle = asyncio.Event()
        self.before_flush: Callable[[], None] | None = None
        self.after_write: Callable[[], None] | None = None
        self.reopen: Callable[[], Any] | None = None
        """Called before a retry; returns the handle to write to from then on."""
        self.on_health: Callable[[BaseException | None, float], None] | None = None
        """Called with (the error, when writes began failing) as writes start failing, and with
        (None, that same time) once a write succeeds again."""
        self.replication: CommitReplication | None = None
        """Set on a replication primary: each commit is numbered, written, then shipped."""
        self.halted: NotPrimaryError | None = None
        """Set once this broker stopped being the primary: nothing more is written or acknowledged."""
        self.commits = 0
        self.failure: BaseException | None = None
        """The last write error while writes fail; None while they succeed."""
        self.failing_since = 0.0
        self._failing_waiters: set[asyncio.Future[None]] = set()

    def when_failing(self) -> asyncio.Future[None]:
        """A future that resolves as writes start failing (at once while they fail); cancel it to
        stop waiting."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.failure is not None:
            waiter.set_result(None)
            return waiter
        self._failing_waiters.add(waiter)
        waiter.add_done_callback(self._failing_waiters.discard)
        return waiter

    def _asked(self) -> bool:
        """Is a write due: operations added, a commit asked, or a ``flush_soon`` whose writes
        ``before_flush`` adds (the engine's changed session records)?"""
        return bool(self._ops or self._waiters or self._after_commit or self._units)

    def put(self, key: bytes, value: bytes) -> None:
        self._ops.append((key, value))

    def delete(self, key: bytes) -> None:
        self._ops.append((key, None))

    def delete_many(self, keys: list[bytes]) -> None:
        self._ops.extend(zip(keys, repeat(None)))

    def flush_soon(self, units: int = 1) -> None:
        """Make sure what was added gets written, without waiting for it (acks, bookkeeping);
        ``units``: how many acks or changes the operations stand for (a run of acks asks once)."""
        self._units += units
        self._schedule(asyncio.get_running_loop())

    def when_written(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` right after the write that holds the operations added so far (before
        that write's waiters resume), without asking for a write: whoever added them commits."""
        if self.halted is None:
            self._after_commit.append(callback)

    def commit(
        self,
        on_durable: Callable[[], None] | None = None,
        *,
        units: int = 1,
        urgent: bool = False,
        fail_fast: bool = False,
        local: bool = False,
    ) -> asyncio.Future[None]:
        """Ask for the operations added so far to be written; the future resolves once they are.

        ``on_durable`` runs right after the write, before any awaiting task resumes, so
        delivery of what was just stored can start in commit order. ``urgent`` commits at the
        end of the current loop pass instead of waiting for company (a pump about to send).
        ``fail_fast``: the future fails with StoreUnavailableError when the write fails or
        writes are failing now, instead of waiting for the retry that writes the operations
        (and runs ``on_durable``) later. ``local`` (fail-fast too): resolve once written here,
        without waiting for sync replication's backups, for bookkeeping whose loss in a failover
        costs only a DUP flag (the sent mark).
        """
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        if self.halted is not None:  # nothing more is written: its callback never runs, nor is kept
            _fail(waiter, self.halted)
            return waiter
        if on_durable is not None:
            self._after_commit.append(on_durable)
        if (fail_fast or local) and self.failure is not None:
            _fail(waiter, StoreUnavailableError(self.failure))
            return waiter
        self._waiters.append((waiter, _LOCAL if local else _FAIL_FAST if fail_fast else _WAIT))
        self._units += self._threshold if urgent else units
        self._schedule(loop)
        return waiter

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._writing or self._soon is not None or self.failure is not None or self.halted is not None:
            return  # while writes fail, only the retry timer writes
        if self._units >= min(self._threshold, self._batch_size) or self._delay == 0:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._soon = loop.call_soon(self._start_flush)
        elif self._timer is None:
            self._timer = loop.call_later(self._delay, self._start_flush)

    def _start_flush(self) -> None:
        self._soon = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._writing or self.halted is not None or not self._asked():
            return
        if self.before_flush is not None:
            try:
                self.before_flush()
            except Exception as exc:
                self._finish(exc, [], [], [])  # nothing taken: everything stays queued
                return
        if not (self._ops or self._waiters or self._after_commit):
            self._units = 0  # a flush_soon whose owner had nothing to add after all
            return
        ops, self._ops = self._ops, []
        waiters, self._waiters = self._waiters, []
        after, self._after_commit = self._after_commit, []
        self._units = 0
        batch = self.replication.prepare(ops) if self.replication is not None else None
        written = batch.ops if batch is not None else ops
        if self._sync:
            self._writing = True
            self._idle.clear()
            loop = asyncio.get_running_loop()
            job = loop.run_in_executor(None, self._write, written)
            job.add_done_callback(lambda done: self._finish(done.exception(), ops, waiters, after, batch))
        else:
            error: BaseException | None = None
            try:
                self._write(written)
            except Exception as exc:
                error = exc
            self._finish(error, ops, waiters, after, batch)

    def _write(self, ops: list[tuple[bytes, bytes | None]]) -> None:
        with self._db.write_batch(sync=self._sync) as batch:
            delete, put = batch.delete, batch.put
            for key, value in ops:
                if value is None:
                    delete(key)
                else:
                    put(key, value)

    def _finish(
        self,
        error: BaseException | None,
        ops: list[tuple[bytes, bytes | None]],
        waiters: list[tuple[asyncio.Future[None], int]],
        after: list[Callable[[], None]],
        batch: Any = None,
    ) -> None:
        self._writing = False
        self._idle.set()
        if error is not None:
            if batch is not None and self.replication is not None:
                self.replication.withdraw(batch)
            self._failed(error, ops, waiters, after)
            return
        self.commits += 1
        if self.after_write is not None:
            self.after_write()
        self._complete_when_shipped(batch, after, waiters)
        if self.failure is not None:
            self.failure = None
            self._retry_delay = self._retry_first
            if self.on_health is not None:
                self.on_health(None, self.failing_since)
        if self._asked():
            self._schedule(asyncio.get_running_loop())

    def _complete_when_shipped(
        self, batch: Any, after: list[Callable[[], None]], waiters: list[tuple[asyncio.Future[None], int]]
    ) -> None:
        """Deliver and acknowledge a written commit: at once, or in sync replication once every
        in-sync backup has it (the primary calls back in commit order, in the loop pass that
        learns it)."""
        if self.replication is None:
            self._complete(after, waiters)
            return
        for waiter, kind in waiters:  # written here: local waiters are never held for the backups
            if kind == _LOCAL and not waiter.done():
                waiter.set_result(None)
        if not self.replication.committed(batch, lambda error: self._complete(after, waiters, error)):
            self._complete(after, waiters)

    def _complete(
        self,
        after: list[Callable[[], None]],
        waiters: list[tuple[asyncio.Future[None], int]],
        shipping_error: BaseException | None = None,
    ) -> None:
        refusal = self.halted
        if refusal is None and (shipping_error is not None or not self._may_acknowledge()):
            # Only these waiters fail: halting is the demotion's (halt), which also ends the clients.
            refusal = NotPrimaryError(str(shipping_error or "its lease is ending"))
        if refusal is not None:
            for waiter, _ in waiters:
                if not waiter.done():
                    _fail(waiter, refusal)
            return
        for callback in after:
            try:
                callback()
            except Exception:
                log.exception("a commit callback failed; delivery of that batch may be late")
        for waiter, _ in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _may_acknowledge(self) -> bool:
        return self.replication is None or self.replication.may_acknowledge()

    def halt(self, reason: str) -> None:
        """This broker stopped being the primary: fail every waiting commit and write nothing
        more (the store now follows the new primary's history)."""
        self.halted = NotPrimaryError(reason)
        for handle in (self._timer, self._soon, self._retry):
            if handle is not None:
                handle.cancel()
        self._timer = self._soon = self._retry = None
        self._ops, self._after_commit = [], []
        waiters, self._waiters = self._waiters, []
        for waiter, _ in waiters:
            if not waiter.done():
                _fail(waiter, self.halted)

    async def wait_idle(self) -> None:
        """Return once no write runs in the worker thread (after ``halt``: the last write of this
        committer is finished, so whoever writes the store next does not race it)."""
        while self._writing:
            await self._idle.wait()

    def _failed(
        self,
        error: BaseException,
        ops: list[tuple[bytes, bytes | None]],
        waiters: list[tuple[asyncio.Future[None], int]],
        after: list[Callable[[], None]],
    ) -> None:
        """Keep the batch, in front of what came since; fail the fail-fast waiters; retry later."""
        if self.halted is not None:  # a write in flight at the demotion: nothing is retried
            for waiter, _ in waiters:
                if not waiter.done():
                    _fail(waiter, self.halted)
            return
        self._ops[:0] = ops
        self._after_commit[:0] = after
        self._waiters[:0] = waiters
        first = self.failure is None
        self.failure = error
        unavailable = StoreUnavailableError(error)
        for waiter, kind in self._waiters:
            if kind != _WAIT and not waiter.done():
                _fail(waiter, unavailable)
        self._waiters = [(w, f) for w, f in self._waiters if not w.done()]
        for handle in (self._timer, self._soon):
            if handle is not None:
                handle.cancel()
        self._timer = self._soon = None
        loop = asyncio.get_running_loop()
        self._retry = loop.call_later(self._retry_delay, self._try_again)
        if first:
            self.failing_since = time.time()
            self._tell_failing()
            if self.on_health is not None:
                self.on_health(error, self.failing_since)
        else:
            log.info("store write failed again: %s; next try in %.2f s", error, self._retry_delay)
        self._retry_delay = min(2 * self._retry_delay, RETRY_MAX)

    def _tell_failing(self) -> None:
        """Resolve the futures of ``when_failing``: writes have started failing."""
        for failing in list(self._failing_waiters):
            if not failing.done():
                failing.set_result(None)

    def _try_again(self) -> None:
        self._retry = None
        if self.halted is not None:
            return
        if self.reopen is not None:
            try:
                self._db = self.reopen()
            except Exception as exc:
                self._failed(exc, [], [], [])
                return
        self._start_flush()

    async def drain(self) -> None:
        """Wait for a write running in the worker thread, then write what is left (closing)."""
        await self.wait_idle()
        if self.halted is not None:
            return
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        if self.failure is not None:
            try:
                if self.reopen is not None:
                    self._db = self.reopen()
                self.flush_now()
            except Exception as exc:
                log.warning(
                    "closing with the store still failing (%s): %d pending write(s) are not stored; "
                    "every message the broker acknowledged is stored already",
                    exc,
                    len(self._ops),
                )
            return
        self.flush_now()

    def flush_now(self) -> None:
        """Write everything pending synchronously; no write may be running in the thread."""
        if self.halted is not None:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.before_flush is not None:
            self.before_flush()
        batch = None
        if self._ops:
            batch = self.replication.prepare(self._ops) if self.replication is not None else None
            self._write(batch.ops if batch is not None else self._ops)
            self._ops = []
        self.failure = None
        if self.after_write is not None:
            self.after_write()
        waiters, self._waiters = self._waiters, []
        after, self._after_commit = self._after_commit, []
        if batch is not None:
            self._complete_when_shipped(batch, after, waiters)
        else:
            self._complete(after, waiters)


def _fail(waiter: asyncio.Future[None], error: StoreUnavailableError) -> None:
    waiter.set_exception(error)
    # Reported once, through on_health: a caller that does not await (a QoS 0 publish, a will)
    # must not have it logged again when the future is collected.
    waiter.exception()
