"""Is a LevelDB folder an amqtt-durable store? What ``amqtt-durable repair`` decides before it touches it.

LevelDB's repair rewrites every table of the folder in LevelDB's default key order: run on another
program's LevelDB it may leave that program unable to open its own data (one kept in an order of
its own, a custom comparator), and this plugin's bookkeeping means nothing there. So repair, once
it has found the folder holds LevelDB files and no process holds its lock (``store.check_repairable``,
which reads nothing but the folder's file names and writes nothing), asks whose the folder is
(docs/operations.md, ``repair``):

- its keys are kept in the order of another comparator than LevelDB's default (which this plugin
  uses): another program's, refused;
- the layout version key reads this release's ``b"1"`` (another value: another release's store,
  ForeignLayoutError as ever), or the store id (``b"i"``, 8 bytes) is there: ours;
- else every key must have the shape of a key of the layout (store.py's docstring): its prefix and
  its length (``b"q"`` 17 bytes, ``b"t"``/``b"w"``/``b"m"``/``b"c"`` 9, ``b"x"`` 11), the lengths in
  a stream event's key adding up, a client id or topic UTF-8; the first key that fits none makes
  the folder another program's, refused; none at all (an empty store) is ours;
- a folder LevelDB cannot open (other than for the comparator; one whose CURRENT file is lost,
  empty or names no MANIFEST of the folder is opened with its newest MANIFEST), or whose reading
  fails before such a key is met: unreadable, and repaired as ever, since that is what repair is
  for. Keys in a block that does not read prove nothing either way (LevelDB's iterator passes over
  a block whose checksum fails without a word): a store whose every foreign key is in damaged
  blocks is repaired too. After LevelDB's repair, repair asks again (``classify``), and a store
  that is then readable and another program's is ForeignStoreError (``repaired``): nothing rebuilt.

Only keys are judged, never values (a value that does not decode is damage repair rebuilds). A
LevelDB of another program whose every key happens to fit the layout cannot be told from ours.

The folder itself is never opened here (repair opens it only once it is not refused): LevelDB's
open of a store writes to it (its log made a table, a new MANIFEST and log, its LOG file moved to
LOG.old), so ``classify_folder`` opens a scratch copy in a temporary folder (``TMPDIR``): the log,
CURRENT and MANIFEST files copied, the table files numbered below the next file number the MANIFEST
records linked (LevelDB never writes to a table file, only unlinks the link, and the open numbers
its new files from that number on), the other table files (among them a crash's or an interrupted
compaction's, which no MANIFEST lists) copied, and every table file copied if the MANIFEST records
no such number this reader understands. The temporary folder needs room for the
copies and for what LevelDB's open of the copy writes there: a table of the log's records, and the
tables of a compaction that open may start (at worst about the size of the store's tables); it is
removed, whatever the verdict or error.
"""

from __future__ import annotations

import enum
import errno
import os
import re
import tempfile
from dataclasses import dataclass
from typing import Any

import plyvel

from .errors import ForeignLayoutError, ForeignStoreError, StoreError
from .leveldb_manifest import next_file_number
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
_TABLE = re.compile(r"^(\d+)\.(?:ldb|sst)$")
_LOG = re.compile(r"^\d+\.log$")
_MANIFEST = re.compile(r"^MANIFEST-(\d+)$")
_CURRENT_READ = 256
_CHUNK = 1 << 20
_WRITE_FAILED = re.compile(r"No space left on device|Disk quota exceeded")
_COMPARATOR = re.compile(r"Invalid argument: (.*) does not match existing comparator")


class Owner(enum.Enum):
    """Whose a LevelDB is: this release's store, another release's, another program's, or unknown
    (LevelDB cannot open or read it)."""

    OURS = enum.auto()
    ANOTHER_RELEASE = enum.auto()
    FOREIGN = enum.auto()
    UNREADABLE = enum.auto()


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
    StoreError when a file of the folder cannot be read, or the scratch copy cannot be made."""
    try:
        names = os.listdir(path)
    except OSError as exc:
        return Verdict(Owner.UNREADABLE, exc.strerror or str(exc))
    folder = os.path.abspath(path)
    try:
        with tempfile.TemporaryDirectory(prefix="amqtt-durable-check-") as scratch:
            scratch_copy(folder, names, scratch)
            return _classify_copy(scratch)
    except OSError as exc:
        if isinstance(exc.filename, str) and os.path.dirname(os.path.abspath(exc.filename)) == folder:
            raise StoreError(
                f"repair of '{path}' not started: whose LevelDB it is could not be checked (its file "
                f"{os.path.basename(exc.filename)} could not be read: {exc.strerror or exc}); nothing was changed"
            ) from exc
        raise StoreError(
            f"repair of '{path}' not started: whose LevelDB it is could not be checked (a scratch copy of it in "
            f"{tempfile.gettempdir()} failed: {exc.strerror or exc}); nothing was changed. Set TMPDIR to a folder "
            "with room for copies of its log and MANIFEST files and of the table files numbered at or above the next "
            "file number its MANIFEST records, and for what LevelDB writes opening the copy, then run repair again"
        ) from exc


def scratch_copy(folder: str, names: list[str], scratch: str) -> list[str]:
    """The scratch copy, in folder ``scratch``, of the LevelDB in ``folder`` (its file ``names``),
    and the names of the table files linked, not copied. CURRENT, the MANIFEST and the log files are
    copied; the table files numbered below the next file number that MANIFEST records are linked
    (LevelDB never writes to a table file, and its open of the copy numbers every file it makes from
    that number on, so a new file never replaces a linked one: writing through the link would change
    the folder's file); the other table files (among them a crash's or an interrupted compaction's,
    which no MANIFEST lists) are copied, and all of them if the MANIFEST records no next file number this
    reader understands (leveldb_manifest.py). A CURRENT that is lost, empty or names no MANIFEST of
    the folder (a crash's leftovers) is replaced, in the copy, by one naming the newest MANIFEST, so
    that such a folder's keys are judged too (LevelDB's repair writes a MANIFEST of its own anyway).
    Without a MANIFEST nothing is copied: nothing opens. An OSError of reading names the folder's
    file, of writing the copy's (``filename``)."""
    manifests = sorted((int(found.group(1)), name) for name in names if (found := _MANIFEST.match(name)))
    if not manifests:
        return []
    current = _current(folder) if "CURRENT" in names else None
    manifest = next((name for _, name in manifests if current == f"{name}\n"), manifests[-1][1])
    with open(os.path.join(scratch, "CURRENT"), "w", encoding="ascii") as written:
        written.write(f"{manifest}\n")
    copied = os.path.join(scratch, manifest)
    if not _copy_listed(os.path.join(folder, manifest), copied):
        return []
    with open(copied, "rb") as reading:
        below = next_file_number(reading.read()) or 0
    linked = []
    for name in names:
        source = os.path.join(folder, name)
        target = os.path.join(scratch, name)
        table = _TABLE.match(name)
        if table is not None and int(table.group(1)) < below:
            try:
                os.symlink(source, target)
            except OSError as exc:  # a symlink's target is not read: TMPDIR's fault, not the store's file's
                exc.filename = target
                raise
            linked.append(name)
        elif table is not None or _LOG.match(name):
            _copy_listed(source, target)
    return linked


def _copy_listed(source: str, target: str) -> bool:
    """``_copy``; False if ``source`` was removed since it was listed (nothing holds the store's
    lock: the copy may not open)."""
    try:
        _copy(source, target)
    except FileNotFoundError as exc:
        if exc.filename != source:
            raise
        return False
    return True


def _current(folder: str) -> str | None:
    """The folder's CURRENT file's text (its first bytes: a MANIFEST's name fits), None if it is not text."""
    with open(os.path.join(folder, "CURRENT"), "rb") as current:
        raw = current.read(_CURRENT_READ)
    try:
        return raw.decode("ascii")
    except UnicodeDecodeError:
        return None


def _copy(source: str, target: str) -> None:
    """``source`` copied to ``target``; an OSError names the file it happened on (``filename``)."""
    with open(source, "rb") as reading, open(target, "wb") as writing:
        for _ in range(os.fstat(reading.fileno()).st_size // _CHUNK + 1):  # what it held when opened
            try:
                chunk = reading.read(_CHUNK)
            except OSError as exc:
                exc.filename = source
                raise
            if not chunk:
                return
            try:
                writing.write(chunk)
            except OSError as exc:
                exc.filename = target
                raise


def _classify_copy(scratch: str) -> Verdict:
    try:
        db = plyvel.DB(scratch, create_if_missing=False)
    except plyvel.Error as exc:
        detail = leveldb_detail(exc)
        failed = _WRITE_FAILED.search(detail) if isinstance(exc, plyvel.IOError) else None
        if failed is not None:  # the temporary folder's fault, not the store's: said as a scratch file's write
            code = errno.ENOSPC if failed.group(0) == os.strerror(errno.ENOSPC) else errno.EDQUOT
            raise OSError(code, os.strerror(code)) from exc
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
    store, before anything in ``path`` is touched; nothing for ours or an unreadable one. Run once
    ``store.check_repairable`` found no process holding the folder's lock."""
    verdict = classify_folder(path)
    if verdict.owner is Owner.FOREIGN:
        raise ForeignStoreError(path, verdict.why)
    if verdict.owner is Owner.ANOTHER_RELEASE and verdict.version is not None:
        raise ForeignLayoutError(path, verdict.version, LAYOUT_VERSION)
