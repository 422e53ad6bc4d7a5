"""The next file number a LevelDB MANIFEST records: LevelDB's open of the folder numbers every file
it makes from it (VersionSet::Recover), never from the MANIFEST's own name, and a table numbered at
or above it is in no version (a crash's, or a flush's or compaction's a running LevelDB has not
recorded yet). A MANIFEST is a log of VersionEdits in LevelDB's log format (32 KiB blocks of records,
each a 7-byte header: CRC32C u32, length u16, type u8); an edit is tagged fields, the next file
number tag 3, the last one recorded wins. Checksums are not verified: a number read is only used to
choose which table files a scratch copy may link, and ``None`` (nothing linked) is always safe."""

from __future__ import annotations

import struct
from collections.abc import Iterator

_BLOCK = 32768
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4
_KINDS = frozenset({_FULL, _FIRST, _MIDDLE, _LAST})
_VARINT_FIELDS = frozenset({2, 3, 4, 9})  # log number, next file number, last sequence, prev log number
_NEXT_FILE = 3
_COMPARATOR, _COMPACT_POINTER, _DELETED_FILE, _NEW_FILE = 1, 5, 6, 7
_BYTE_BITS = 7
_MORE = 0x80
_VARINT_BYTES = 10  # the most a 64-bit value's varint takes


def _records(data: bytes) -> Iterator[bytes]:
    """The log's records, as LevelDB's log reader reads them: a header of zero type and zero length
    (a preallocated block's zeros) skips the rest of its block and drops a record it splits; a
    fragment that continues no first fragment is dropped; the reading ends at a record of a type the
    log format does not have, or torn: an earlier number only links fewer tables."""
    record: bytes | None = None
    for block in range(0, len(data), _BLOCK):
        at, end = block, min(block + _BLOCK, len(data))
        while end - at >= _HEADER:  # less: the zeros that pad a block's tail
            length, kind = struct.unpack_from("<HB", data, at + 4)
            if kind == 0 and length == 0:
                record = None
                break
            if kind not in _KINDS or at + _HEADER + length > end:
                return
            chunk = data[at + _HEADER : at + _HEADER + length]
            at += _HEADER + length
            if kind in (_FULL, _FIRST):
                record = chunk
            elif record is not None:
                record += chunk
            if kind in (_FULL, _LAST) and record is not None:
                yield record
                record = None


def _varint(data: bytes, at: int) -> tuple[int, int]:
    """The 64-bit varint at ``at`` and where the next field starts; IndexError past the end, and
    ValueError for one longer than 10 bytes or over 64 bits (LevelDB's own reader rejects it)."""
    value = shift = 0
    for _ in range(_VARINT_BYTES):
        byte = data[at]
        at += 1
        value |= (byte & (_MORE - 1)) << shift
        if not byte & _MORE:
            if value >> 64:
                raise ValueError(value)
            return value, at
        shift += _BYTE_BITS
    raise ValueError("a varint of more than 10 bytes")


def _skip_bytes(data: bytes, at: int) -> int:
    size, at = _varint(data, at)
    return at + size


def _edit_next_file(edit: bytes) -> tuple[bool, int | None]:
    """(understood, the edit's next file number if it has one); not understood: a tag LevelDB's
    VersionEdit does not write, or a field past the edit's end."""
    found = None
    at = 0
    try:
        while at < len(edit):
            tag, at = _varint(edit, at)
            if tag in _VARINT_FIELDS:
                value, at = _varint(edit, at)
                found = value if tag == _NEXT_FILE else found
            elif tag == _COMPARATOR:
                at = _skip_bytes(edit, at)
            elif tag == _COMPACT_POINTER:  # level, key
                at = _skip_bytes(edit, _varint(edit, at)[1])
            elif tag == _DELETED_FILE:  # level, number
                at = _varint(edit, _varint(edit, at)[1])[1]
            elif tag == _NEW_FILE:  # level, number, size, smallest key, largest key
                for _ in range(3):
                    at = _varint(edit, at)[1]
                at = _skip_bytes(edit, _skip_bytes(edit, at))
            else:
                return False, None
    except (IndexError, ValueError):
        return False, None
    return at == len(edit), found


def next_file_number(manifest: bytes) -> int | None:
    """The next file number the MANIFEST ``manifest`` (its bytes) records last, None if it records
    none, holds an edit this reader does not understand, or records a number lower than an earlier
    one (LevelDB never does: nothing is judged on a guess)."""
    found = None
    for edit in _records(manifest):
        understood, number = _edit_next_file(edit)
        if not understood or (number is not None and found is not None and number < found):
            return None
        found = number if number is not None else found
    return found
