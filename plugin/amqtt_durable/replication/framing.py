"""Wire format of replication, version 1: batches and the channel's messages.

Written down once here because a backup and a primary of different releases must agree on
it byte for byte. Every integer is big-endian.

A **batch** is one group commit of the primary: the exact LevelDB operations, in order::

    seq:u64 store_id:u64 count:u32 op*count crc:u32
    op = klen:u32 kind:u8 key [vlen:u32 value]     kind 0 = put (value follows), 1 = delete

``crc`` is CRC-32 of everything before it. It is also the batch's identity: a backup stores
the (seq, crc) of the last batch it applied, and a primary compares it with its own batch of
that number to detect a backup whose history diverged (a former primary in async mode).

A **frame** on the TCP channel::

    type:u8 length:u32 payload [mac] crc:u32     crc = CRC-32 of everything before it

``mac`` is there only on a connection that started with the handshake of replication.secret
(auth.py), on every frame after the handshake, in both directions: the first 16 bytes of
HMAC-SHA256, under that direction's session key, of ``counter:u64 type:u8 plen:u32 payload``
(``counter`` counts that direction's frames after the handshake from 0, ``plen`` is the
payload's length; ``length`` includes the 16 bytes). Without a secret, frames have no mac.

Frame types (backup -> primary: HELLO, ACK; primary -> backup: the rest):

=========  ===================================================================
HELLO      version:u16 store_id:u64 seq:u64 crc:u32 name(utf-8) [0x00 instance:u64]: where
           the backup is, and which broker process it is (``instance``, random per process,
           its top byte 0xFF; absent from an earlier version's HELLO: read as 0, unknown). A
           name holds no NUL character, so the optional field follows one. An earlier
           version's primary refuses a HELLO with it (0xFF is never UTF-8)
SNAP_BEGIN (empty): the backup wipes its store and marks a snapshot in progress
SNAP_CHUNK ops (count:u32 op*count, as in a batch): rows of the primary's snapshot
SNAP_END   seq:u64 crc:u32: the snapshot holds every batch up to ``seq``
BATCH      an encoded batch (above)
IN_SYNC    seq:u64: the backup was sent everything up to ``seq`` live; it now counts
ACK        seq:u64: the backup applied and synced every batch up to ``seq`` (on one connection
           never lower than its last ACK, never past the last batch sent: a primary closes
           the connection on such an ACK)
STATUS     (empty) from a tool; answered by STATUS with this node's status as JSON
PROMOTE    (empty) from ``amqtt-durable promote``; answered by PROMOTE with JSON
           ``{"promoted": bool, "why": text}``
AUTH       the handshake of replication.secret (auth.py), before any other frame, only
           when a secret is set
ERROR      text (utf-8): why the connection is refused (a failed or unexpected handshake, a
           backup's name in use, a HELLO of a version the primary does not speak, one backup past
           replication.max_backups: TOO_MANY_BACKUPS, a HELLO sent to a backup: NOT_PRIMARY); the
           sender closes the connection after it
=========  ===================================================================

A HELLO's ``version`` is read first: a primary answers one other than ``PROTOCOL_VERSION``
with ERROR ``replication protocol version N not supported: this primary speaks 1``.

STATUS and PROMOTE come from tools, as the first frame of a connection to a node's
replication address: the primary's channel server answers them, and so does a backup's.
"""

from __future__ import annotations

import asyncio
import struct
import unicodedata
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import IntEnum

from .errors import FrameError

PROTOCOL_VERSION = 1
Op = tuple[bytes, bytes | None]
"""One LevelDB operation: (key, value) puts, (key, None) deletes (GroupCommitter's ``_ops``)."""

_BATCH_HEAD = struct.Struct(">QQ")
_OP_HEAD = struct.Struct(">IB")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_FRAME_HEAD = struct.Struct(">BI")
_HELLO = struct.Struct(">HQQI")
_POSITION = struct.Struct(">QI")
NAME_FORBIDDEN = "/+#\0"
"""Characters a replication.name never holds: it is one level of the $SYS topics and of an etcd key."""
NAME_MAX_BYTES = 1024
"""A replication.name's longest UTF-8: its $SYS topics stay far below MQTT's 65535-byte topic."""


def name_problem(name: str) -> str | None:
    """Why ``name`` is no replication.name (a level of the $SYS topics and of an etcd key, written to logs), None
    when it is one. The empty name is checked by the caller: a config may leave it out, a HELLO never sends it."""
    if any(ch in NAME_FORBIDDEN or unicodedata.category(ch) == "Cc" for ch in name):
        return "it holds '/', '+', '#' or a control character"
    if len(name.encode("utf-8")) > NAME_MAX_BYTES:
        return f"it is longer than {NAME_MAX_BYTES} bytes of UTF-8"
    return None


MAX_FRAME = 256 * 1024 * 1024
"""A frame longer than this is refused as damage (a batch is bounded by the store's batch_size)."""
MAX_PEER_FRAME = 64 * 1024
"""The longest frame a node reads from a peer that connected to it (a backup's HELLO and ACKs, a
tool's STATUS or PROMOTE are all small): refused before its payload is read, so a stranger on
the replication address cannot make a node buffer ``MAX_FRAME`` bytes per connection."""

NAME_IN_USE = "is in use by the backup connected from"
"""In the ERROR frame with which a primary refuses a backup whose name another broker's backup
connection holds: the refused backup recognises the refusal by these words."""


NOT_PRIMARY = "not the primary"
"""The first words, then a colon, of the ERROR frame with which a backup's replication address
answers a HELLO (a backup whose replication.primary names a backup): the refused backup recognises
the refusal by them (first, so the 200-character cut of a peer's ERROR text never takes them)."""


TOO_MANY_BACKUPS = "too many backups: max_backups is"
"""The first words of the ERROR frame with which a primary that serves replication.max_backups
backups refuses one more (then the number): the refused backup recognises the refusal by them."""


VERSION_REFUSED = "not supported: this primary speaks"
"""In the ERROR frame with which a primary refuses a HELLO of a protocol version it does not speak
(``unsupported_version``): the refused backup recognises the refusal by these words."""


def unsupported_version(payload: bytes) -> str | None:
    """The ERROR text for a HELLO payload whose version is not PROTOCOL_VERSION, naming both
    versions; None for one of this version, or one too short to hold a version (it does not
    decode). Read before the rest of the HELLO: another version's may be laid out otherwise."""
    if len(payload) < _U16.size:
        return None
    (version,) = _U16.unpack_from(payload, 0)
    if version == PROTOCOL_VERSION:
        return None
    return f"replication protocol version {version} {VERSION_REFUSED} {PROTOCOL_VERSION}"


class Frame(IntEnum):
    HELLO = 1
    SNAP_BEGIN = 2
    SNAP_CHUNK = 3
    SNAP_END = 4
    BATCH = 5
    IN_SYNC = 6
    ACK = 7
    STATUS = 8
    PROMOTE = 9
    AUTH = 10
    ERROR = 11


@dataclass(frozen=True, slots=True)
class Batch:
    """One group commit: its number, the store it belongs to, its operations and its checksum."""

    seq: int
    store_id: int
    ops: tuple[Op, ...]
    crc: int


def encode_ops(ops: Sequence[Op]) -> bytes:
    return b"".join(_op_parts(ops, [_U32.pack(len(ops))]))


def _op_parts(ops: Sequence[Op], parts: list[bytes]) -> list[bytes]:
    """``parts`` with the operations' bytes appended (this runs per operation of every commit a
    primary ships): a put's head, key and value length are one ``struct`` call (a ``Struct`` per key
    length, as keys of a kind have one length), so a put is two parts instead of four; a delete's
    head is the same bytes for every key of a length, made once."""
    append, puts, deletes = parts.append, _PUT_HEADS, _DELETE_HEADS
    for key, value in ops:
        if value is None:
            head = deletes.get(len(key))
            if head is None:
                head = _delete_head(len(key))
            append(head)
            append(key)
            continue
        klen = len(key)
        pack = puts.get(klen)
        if pack is None:
            pack = _put_head(klen)
        append(pack(klen, 0, key, len(value)))
        append(value)
    return parts


_PUT_HEADS: dict[int, Callable[..., bytes]] = {}
"""``klen:u32 kind:u8 key vlen:u32`` packers by key length (bounded: see _put_head)."""
_PUT_HEADS_MAX = 256


def _put_head(klen: int) -> Callable[..., bytes]:
    """The packer of a put's head for keys of ``klen`` bytes; kept for at most _PUT_HEADS_MAX
    lengths (the store's keys come in a handful of lengths; a longer tail is packed anew)."""
    pack = struct.Struct(f">IB{klen}sI").pack
    if len(_PUT_HEADS) < _PUT_HEADS_MAX:
        _PUT_HEADS[klen] = pack
    return pack


_DELETE_HEADS: dict[int, bytes] = {}
"""``klen:u32 kind:u8`` of a delete, by key length (bounded as _PUT_HEADS)."""


def _delete_head(klen: int) -> bytes:
    head = _OP_HEAD.pack(klen, 1)
    if len(_DELETE_HEADS) < _PUT_HEADS_MAX:
        _DELETE_HEADS[klen] = head
    return head


def decode_ops(data: bytes, offset: int = 0, what: str = "batch", end: int | None = None) -> tuple[list[Op], int]:
    """The operations at ``offset`` and the offset after them; none may reach past ``end`` (the
    end of ``data`` by default)."""
    ops, put, delete = _collecting()
    return ops, apply_ops(data, put, delete, offset=offset, what=what, end=end)


def _collecting() -> tuple[list[Op], Callable[[bytes, bytes], object], Callable[[bytes], object]]:
    """A list of operations, and the ``put`` and ``delete`` that append to it."""
    ops: list[Op] = []
    append = ops.append
    return ops, lambda key, value: append((key, value)), lambda key: append((key, None))


def apply_ops(
    data: bytes,
    put: Callable[[bytes, bytes], object],
    delete: Callable[[bytes], object],
    *,
    offset: int = 0,
    what: str = "batch",
    end: int | None = None,
) -> int:
    """Hand the operations at ``offset`` to ``put`` and ``delete`` (a LevelDB write batch's, on a
    backup: no list of operations in between), in order; the offset after them. FrameError when
    one reaches past ``end`` (the end of ``data`` by default): that check comes after the calls, so
    a caller writing them uses a write batch that is not written when this raises."""
    limit = len(data) if end is None else end
    head, u32 = _OP_HEAD.unpack_from, _U32.unpack_from
    try:
        (count,) = u32(data, offset)
        offset += 4
        for _ in range(count):
            klen, kind = head(data, offset)
            start = offset + 5
            offset = start + klen
            if kind == 0:
                (vlen,) = u32(data, offset)
                value = offset + 4
                put(data[start:offset], data[value : value + vlen])
                offset = value + vlen
            elif kind == 1:
                delete(data[start:offset])
            else:
                raise FrameError(what, f"unknown operation kind {kind}")
    except struct.error as exc:
        raise FrameError(what, f"truncated ({exc})") from exc
    # A slice past the end is silently short, and offsets only grow: one check covers every operation
    # (the loop ends anyway, as each operation moves on by at least 5 bytes until a header is past the data).
    if offset > limit:
        raise FrameError(what, f"truncated: the operations reach byte {offset} of {limit}")
    return offset


def encode_batch(seq: int, store_id: int, ops: Sequence[Op]) -> tuple[bytes, int]:
    """The encoded batch and its CRC-32 (its identity)."""
    body = b"".join(_op_parts(ops, [_BATCH_HEAD.pack(seq, store_id), _U32.pack(len(ops))]))
    crc = zlib.crc32(body)
    return body + _U32.pack(crc), crc


@dataclass(frozen=True, slots=True)
class CheckedBatch:
    """An encoded batch whose checksum matched, its operations not decoded yet (``apply``)."""

    seq: int
    store_id: int
    crc: int
    count: int
    """Its operations."""
    data: bytes

    def apply(self, put: Callable[[bytes, bytes], object], delete: Callable[[bytes], object]) -> None:
        """Hand its operations to ``put`` and ``delete`` (apply_ops); FrameError when they do not
        end exactly before the checksum."""
        end = len(self.data) - 4
        stop = apply_ops(self.data, put, delete, offset=16, end=end)
        if stop != end:
            raise FrameError("batch", f"{end - stop} bytes after the last operation")


def check_batch(data: bytes) -> CheckedBatch:
    """The batch's header, its checksum checked (FrameError when it does not match)."""
    if len(data) < 20 + 4:
        raise FrameError("batch", f"{len(data)} bytes is shorter than a batch header")
    end = len(data) - 4
    (crc,) = _U32.unpack_from(data, end)
    if zlib.crc32(memoryview(data)[:end]) != crc:
        raise FrameError("batch", "checksum mismatch")
    seq, store_id = _BATCH_HEAD.unpack_from(data, 0)
    (count,) = _U32.unpack_from(data, 16)
    return CheckedBatch(seq, store_id, crc, count, data)


def decode_batch(data: bytes) -> Batch:
    checked = check_batch(data)
    ops, put, delete = _collecting()
    checked.apply(put, delete)
    return Batch(checked.seq, checked.store_id, tuple(ops), checked.crc)


def ops_size(ops: Iterable[Op]) -> int:
    """Bytes the operations take in a batch (for the retained log's byte bound and chunking)."""
    return sum(9 + len(k) + (len(v) if v is not None else 0) for k, v in ops)


# --- frames -------------------------------------------------------------------------------


def encode_frame(kind: Frame | int, payload: bytes = b"", tag: bytes = b"") -> bytes:
    """A frame; ``tag`` (the session MAC of auth.py, with a secret) follows the payload inside it."""
    head = _FRAME_HEAD.pack(int(kind), len(payload) + len(tag))
    crc = zlib.crc32(tag, zlib.crc32(payload, zlib.crc32(head)))
    return b"".join((head, payload, tag, _U32.pack(crc)))


async def read_raw_frame(
    reader: asyncio.StreamReader, limit: int = MAX_FRAME, tag_bytes: int = 0
) -> tuple[int, int, bytes, bytes]:
    """The next frame as read, type not yet checked: (type, length, payload, tag), the last
    ``tag_bytes`` of the frame's content being the tag. IncompleteReadError at a clean end of the
    stream, FrameError on damage (checksum) or on a payload longer than ``limit`` (checked before
    it is read)."""
    head = await reader.readexactly(_FRAME_HEAD.size)
    kind, length = _FRAME_HEAD.unpack(head)
    if length > limit + tag_bytes:
        raise FrameError("frame", f"length {length - tag_bytes} is larger than {limit}")
    rest = await reader.readexactly(length + 4)
    if zlib.crc32(memoryview(rest)[:length], zlib.crc32(head)) != _U32.unpack_from(rest, length)[0]:
        raise FrameError("frame", "checksum mismatch")
    cut = max(length - tag_bytes, 0)  # a frame shorter than its tag has a short tag, which does not match
    return kind, cut, rest[:cut], rest[cut:length]


_FRAME_TYPES = {int(kind): kind for kind in Frame}
"""Frame types by number: a dict lookup, as every frame read takes one (an enum's call costs ten times more)."""


def frame_type(kind: int) -> Frame:
    found = _FRAME_TYPES.get(kind)
    if found is None:
        raise FrameError("frame", f"unknown type {kind}")
    return found


async def read_frame(reader: asyncio.StreamReader, limit: int = MAX_FRAME) -> tuple[Frame, bytes]:
    """The next frame; IncompleteReadError at a clean end of the stream, FrameError on damage
    or on a length above ``limit`` (checked before the payload is read)."""
    kind, _, payload, _ = await read_raw_frame(reader, limit)
    return frame_type(kind), payload


@dataclass(frozen=True, slots=True)
class Hello:
    """Where a backup is: the store it replicates, the last batch it applied (0, 0: none), its
    name, and which broker process it is (``instance``: 0 when its HELLO did not say)."""

    store_id: int
    seq: int
    crc: int
    name: str
    version: int = PROTOCOL_VERSION
    instance: int = 0

    def encode(self) -> bytes:
        head = _HELLO.pack(self.version, self.store_id, self.seq, self.crc) + self.name.encode("utf-8")
        return head + b"\x00" + _U64.pack(self.instance) if self.instance else head

    @classmethod
    def decode(cls, payload: bytes) -> Hello:
        try:
            version, store_id, seq, crc = _HELLO.unpack_from(payload, 0)
            name, nul, rest = payload[_HELLO.size :].partition(b"\x00")
            instance = int(_U64.unpack(rest)[0]) if nul else 0
            text = name.decode("utf-8")
        except (struct.error, UnicodeDecodeError) as exc:
            raise FrameError("HELLO", str(exc)) from exc
        problem = name_problem(text) if text else "it is empty"
        if problem:  # never a real backup's: a stranger's, or damage
            raise FrameError("HELLO", f"the backup's name is no replication.name: {problem}")
        return cls(store_id, seq, crc, text, version, instance)


def encode_position(seq: int, crc: int) -> bytes:
    return _POSITION.pack(seq, crc)


def decode_position(payload: bytes) -> tuple[int, int]:
    try:
        seq, crc = _POSITION.unpack(payload)
    except struct.error as exc:
        raise FrameError("position", str(exc)) from exc
    return int(seq), int(crc)


def encode_seq(seq: int) -> bytes:
    return _U64.pack(seq)


def decode_seq(payload: bytes) -> int:
    try:
        return int(_U64.unpack(payload)[0])
    except struct.error as exc:
        raise FrameError("sequence number", str(exc)) from exc
