"""Is a LevelDB folder an amqtt-durable store? What ``amqtt-durable repair`` decides before it touches it.

LevelDB's repair rewrites every table of the folder in LevelDB's default key order: run on another
program's LevelDB it may leave that program unable to open its own data (one kept in an order of
its own, a custom comparator), and this plugin's bookkeeping means nothing there. So repair first
asks whose the folder is (docs/operations.md, ``repair``):

- its keys are kept in the order of another comparator than LevelDB's default (which this plugin
  uses): another program's, refused;
- the layout version key reads this release's ``b"1"`` (another value: another release's store,
  ForeignLayoutError as ever), or the store id (``b"i"``, 8 bytes) is there: ours;
- else every key must have the shape of a key of the layout (store.py's docstring): its prefix and
  its length (``b"q"`` 17 bytes, ``b"t"``/``b"w"``/``b"m"``/``b"c"`` 9, ``b"x"`` 11), the lengths in
  a stream event's key adding up, a client id or topic UTF-8; the first key that fits none makes
  the folder another program's, refused; none at all (an empty store) is ours;
- a folder LevelDB cannot open (other than for the comparator; one that lost only its CURRENT
  file is opened with the newest MANIFEST), or whose reading fails before such
  a key is met: unreadable, and repaired as ever, since that is what repair is for. Keys in a block
  that does not read prove nothing either way (LevelDB's iterator passes over a block whose checksum
  fails without a word): a store whose every foreign key is in damaged blocks is repaired too. After
  LevelDB's repair the rebuild asks again (``classify``), and rebuilds nothing in a store that is
  then readable and another program's.

Only keys are judged, never values (a value that does not decode is damage repair rebuilds). A
LevelDB of another program whose every key happens to fit the layout cannot be told from ours.

The folder itself is never opened here (repair opens it only once it is not refused): LevelDB's
open of a store writes to it (its log made a table, a new MANIFEST and log, its LOG file moved to
LOG.old), so ``classify_folder`` opens a scratch copy in a temporary folder (``TMPDIR``): table
files linked (LevelDB never writes to a table file and only unlinks the link), the log, MANIFEST
and CURRENT files copied.
"""

from __future__ import annotations

import enum
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

import plyvel

from .errors import ForeignLayoutError, ForeignStoreError, StoreError
from .replication.position import POSITION_KEY, SNAPSHOT_MARK_KEY
from .store import (
    KEY_SIZES,
    LAYOUT_VERSION,
    MSG_ID_MARK_KEY,
    RETAINED_PREFIX,
    SID_MARK_KEY,
    STORE_ID_KEY,
    VERSION_KEY,
    leveldb_detail,
)
from .stream_log import EVENT_PREFIX, LEGACY_EVENT_PREFIX, MARK_PREFIX, event_topic

_SINGLE_KEYS = frozenset({VERSION_KEY, STORE_ID_KEY, SID_MARK_KEY, MSG_ID_MARK_KEY, POSITION_KEY, SNAPSHOT_MARK_KEY})
_NAMED_PREFIXES = frozenset({b"s", RETAINED_PREFIX, MARK_PREFIX})
"""A prefix, then a client id (b"s") or a topic, UTF-8."""
_LEGACY_TAIL = 9
"""An earlier release's stream event key: b"l" + topic + NUL + id:u64."""
_STORE_ID_SIZE = 8
_KEY_SHOWN = 40
_TABLE = re.compile(r"^\d+\.(ldb|sst)$")
_COPIED = re.compile(r"^(CURRENT|MANIFEST-\d+|\d+\.log)$")
_MANIFEST = re.compile(r"^MANIFEST-\d+$")
_COMPARATOR = re.compile(r"Invalid argument: (.*) does not match existing comparator")


class Owner(enum.Enum):
    OURS = "ours"
    ANOTHER_RELEASE = "another release"
    FOREIGN = "another program's"
    UNREADABLE = "unreadable"


@dataclass(frozen=True)
class Verdict:
    """Whose a store is; ``why`` says it for FOREIGN and UNREADABLE, ``version`` for ANOTHER_RELEASE."""

    owner: Owner
    why: str = ""
    version: bytes | None = None


def _utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def key_fits_layout(key: bytes) -> bool:
    """Has ``key`` the shape of a key of the store layout (store.py's docstring)?"""
    if key in _SINGLE_KEYS:
        return True
    prefix = key[:1]
    if prefix in KEY_SIZES:
        return len(key) == KEY_SIZES[prefix]
    if prefix in _NAMED_PREFIXES:
        return _utf8(key[1:])
    if prefix == EVENT_PREFIX:
        topic = event_topic(key)
        return topic is not None and _utf8(topic)
    if prefix == LEGACY_EVENT_PREFIX:
        return len(key) > _LEGACY_TAIL and key[-_LEGACY_TAIL] == 0 and _utf8(key[1:-_LEGACY_TAIL])
    return False


def classify(db: Any) -> Verdict:
    """Whose is the open store ``db``: read with checksums verified, so every key read is as written."""
    try:
        version = db.get(VERSION_KEY, verify_checksums=True)
    except plyvel.Error:
        version = None  # damaged: the keys decide
    if version == LAYOUT_VERSION:
        return Verdict(Owner.OURS)
    if version is not None:
        return Verdict(Owner.ANOTHER_RELEASE, version=version)
    try:
        store_id = db.get(STORE_ID_KEY, verify_checksums=True)
    except plyvel.Error:
        store_id = None
    if store_id is not None and len(store_id) == _STORE_ID_SIZE:
        return Verdict(Owner.OURS)
    try:
        for key in db.iterator(include_value=False, verify_checksums=True):
            if not key_fits_layout(key):
                shown = f"{key[:_KEY_SHOWN]!r}{', ...' if len(key) > _KEY_SHOWN else ''}"
                return Verdict(
                    Owner.FOREIGN,
                    f"no layout version key or store id, and its key {shown} has the shape of no key "
                    "of amqtt-durable's store layout",
                )
    except plyvel.Error as exc:
        return Verdict(Owner.UNREADABLE, leveldb_detail(exc))
    return Verdict(Owner.OURS)


def classify_folder(path: str) -> Verdict:
    """Whose is the LevelDB in folder ``path``, judged on a scratch copy (nothing in ``path`` is
    written). A path that is no readable folder is UNREADABLE here: repair's own checks name it.
    StoreError when the scratch copy cannot be made."""
    try:
        names = os.listdir(path)
    except OSError as exc:
        return Verdict(Owner.UNREADABLE, exc.strerror or str(exc))
    try:
        with tempfile.TemporaryDirectory(prefix="amqtt-durable-check-") as scratch:
            _scratch_copy(path, names, scratch)
            return _classify_copy(scratch)
    except OSError as exc:
        raise StoreError(
            f"repair of '{path}' not started: whose LevelDB it is could not be checked (a scratch copy of its "
            f"log and MANIFEST files in {tempfile.gettempdir()} failed: {exc.strerror or exc}); nothing was "
            "changed. Set TMPDIR to a folder with room for them, then run repair again"
        ) from exc


def _scratch_copy(path: str, names: list[str], scratch: str) -> None:
    """The scratch copy; without CURRENT (lost), one naming the newest MANIFEST, so that the keys of
    a folder that lost only that file are judged too (LevelDB's repair writes its own MANIFEST anyway)."""
    manifests = sorted((name for name in names if _MANIFEST.match(name)), key=lambda name: int(name[9:]))
    if "CURRENT" not in names and manifests:
        with open(os.path.join(scratch, "CURRENT"), "w", encoding="ascii") as current:
            current.write(f"{manifests[-1]}\n")
    for name in names:
        source = os.path.abspath(os.path.join(path, name))
        try:
            if _TABLE.match(name):
                os.symlink(source, os.path.join(scratch, name))
            elif _COPIED.match(name):
                shutil.copyfile(source, os.path.join(scratch, name))
        except FileNotFoundError:
            continue  # removed meanwhile (a program using the store): the copy may not open, the lock check follows


def _classify_copy(scratch: str) -> Verdict:
    try:
        db = plyvel.DB(scratch, create_if_missing=False)
    except plyvel.Error as exc:
        detail = leveldb_detail(exc)
        found = _COMPARATOR.search(detail)
        if found is None:
            return Verdict(Owner.UNREADABLE, detail)
        return Verdict(
            Owner.FOREIGN,
            f"its keys are kept in the order of the comparator '{found.group(1)}', not LevelDB's default, "
            "which amqtt-durable uses",
        )
    try:
        return classify(db)
    finally:
        db.close()


def refuse_another_programs(path: str) -> None:
    """ForeignStoreError for another program's LevelDB, ForeignLayoutError for another release's
    store, before anything in ``path`` is touched; nothing for ours or an unreadable one."""
    verdict = classify_folder(path)
    if verdict.owner is Owner.FOREIGN:
        raise ForeignStoreError(path, verdict.why)
    if verdict.owner is Owner.ANOTHER_RELEASE and verdict.version is not None:
        raise ForeignLayoutError(path, verdict.version, LAYOUT_VERSION)
