"""Where a store is in the replication history, kept in the store itself.

Two keys, beside the store's layout version 1 (store.py) without changing it::

    b"R"               -> seq:u64 crc:u32   the last batch this store holds (number, checksum)
    b"R\\x00snapshot"   -> b""               a snapshot is being applied: the store is partial

``b"R"`` is written *inside* every replicated batch's LevelDB write batch, on the primary and
on each backup alike, so it can never disagree with the data, the stores stay identical key
for key, and a LevelDB snapshot of the primary says by itself which batch it holds. A store
without ``b"R"`` has never been replicated (position 0). A backup that restarts resumes from
``b"R"``; one that finds the snapshot mark asks for a new snapshot.
"""

from __future__ import annotations

from typing import Any

from .. import store
from .framing import Op, decode_position, encode_position

POSITION_KEY = b"R"
SNAPSHOT_MARK_KEY = b"R\x00snapshot"


def position_op(seq: int, crc: int) -> Op:
    """The operation that records batch ``seq`` (checksum ``crc``) as the store's last."""
    return (POSITION_KEY, encode_position(seq, crc))


def read_position(db: Any) -> tuple[int, int] | None:
    """(seq, crc) of the last batch the store (or a plyvel snapshot of it) holds; None while a
    snapshot is half applied. (0, 0) for a store never replicated."""
    if db.get(SNAPSHOT_MARK_KEY) is not None:
        return None
    raw = db.get(POSITION_KEY)
    return (0, 0) if raw is None else decode_position(raw)


def read_store_id(db: Any) -> int:
    """The store id (store.py's ``b"i"``), 0 for a store that has none yet; DamagedRecordError names
    one that does not decode (store.read_store_id)."""
    stored = store.read_store_id(db)
    return 0 if stored is None else stored
