"""``amqtt-durable repair``: LevelDB's repair, then the plugin's bookkeeping rebuilt from the queues.

LevelDB's repair keeps every readable record, but a record it keeps can still be wrong for the
plugin (a session record that no longer decodes, queue totals that do not match the queue, a
count of references to a shared body). The queue entries (``b"q"``) are the truth: everything
else about a session is rebuilt from them, and what cannot be (a client id whose record key is
gone, subscriptions in a record that does not decode) is reported, never guessed.
"""

from __future__ import annotations

import os
import re
import struct
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import plyvel

from .errors import DamagedRecordError, ForeignStoreError, StoreError
from .inspect_store import shown
from .replication.position import POSITION_KEY
from .store import (
    FLAG_SHARED,
    LAYOUT_VERSION,
    MSG_ID_MARK_KEY,
    NO_BODY,
    RETAINED_PREFIX,
    SID_MARK_KEY,
    STORE_ID_KEY,
    VERSION_KEY,
    Body,
    Entry,
    RetainedMessage,
    SessionRecord,
    awaiting_pubcomp,
    body_key,
    check_repairable,
    decode_refs,
    decode_totals,
    decode_u64,
    encode_refs,
    encode_totals,
    encode_u64,
    leveldb_detail,
    msg_id_of_body_key,
    refs_key,
    repaired_store,
    sent_mark_key,
    seq_of_entry_key,
    sid_of_entry_key,
    totals_key,
)
from .store_owner import Owner, classify, refuse_another_programs
from .stream_log import EVENT_PREFIX, MARK_PREFIX, decode_event, event_id_of, event_topic

_SID_IN_RECORD = re.compile(rb'"sid"\s*:\s*(\d+)')
_USERNAME_IN_RECORD = re.compile(rb'"username"\s*:\s*"([^"\\]*)"')
_ENTRY_KEY_SIZE = 17
_U64_SIZE = 8
_ENTRY_SIZE = 14
_MAX_SID = 2**64 - 1
SENT_MARK_JUMP = 2**40
"""How far past what is in use a mark that no longer decodes is set (a session's sent mark, the
highest session number, the highest message id): further than any can have reached, so no new
message reuses a sequence number a client has seen (the SDK would drop it), no new session an
epoch, and no new message an id a queue entry may still name."""


@dataclass
class RepairReport:
    """What the repair rebuilt, and what it could not recover (each a sentence for the operator)."""

    rebuilt: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)


@dataclass
class _Queue:
    depth: int = 0
    bytes: int = 0
    last_seq: int = 0
    unreadable: int = 0
    """Entries removed: their value did not decode, or their message body is gone or does not decode."""
    released_kept: list[tuple[int, int, str]] = field(default_factory=list)
    """(seq, message id, "is gone" or "does not decode") of QoS 2 RELEASED entries (PUBREL due)
    whose body is gone or does not decode: kept, rewritten to need none."""
    no_body_fixed: int = 0
    """Entries that already pointed at no body (NO_BODY) but were still SHARED or sized: set to neither."""


def repair(path: str, now: float | None = None) -> RepairReport:
    """Repair the store at ``path`` (broker stopped) and say what was rebuilt and what is lost.
    StoreLockedError for a store a process holds, then ForeignStoreError for a LevelDB of another
    program (store_owner.py), before anything of it is written; ForeignStoreError (``repaired``)
    for one that is found another program's only after LevelDB's repair (nothing rebuilt)."""
    check_repairable(path)  # first: nothing of a store a running broker holds is read, nor copied
    refuse_another_programs(path)
    archived = _archived_tables(path)
    with repaired_store(path) as db:  # the store's lock held until it is closed again
        try:
            if db.get(VERSION_KEY) is None and (verdict := classify(db)).owner is Owner.FOREIGN:
                # Unreadable before LevelDB's repair (store_owner.py), another program's after: not taken over.
                raise ForeignStoreError(path, verdict.why, repaired=True)
            report = rebuild(db, time.time() if now is None else now)
        except plyvel.Error as exc:
            raise StoreError(f"repair of '{path}' failed while rebuilding: {leveldb_detail(exc)}") from exc
    damaged = sorted(_archived_tables(path) - archived)
    report.lost[:0] = [
        f"table file {name} was damaged (moved to {os.path.join(path, 'lost', name)}): records only it held "
        "are gone, and older versions of them may be back (a message already delivered may be sent again)"
        for name in damaged
    ]
    return report


def _archived_tables(path: str) -> set[str]:
    """Table files LevelDB's repair moved to lost/ (it moves every log and manifest there too)."""
    try:
        return {name for name in os.listdir(os.path.join(path, "lost")) if name.endswith((".ldb", ".sst"))}
    except OSError:
        return set()


def rebuild(db: Any, now: float) -> RepairReport:
    """Make session records, queue totals and body references agree with the queue entries."""
    report = RepairReport()
    version = db.get(VERSION_KEY)
    if version is not None and version != LAYOUT_VERSION:
        report.lost.append(f"layout version {version!r} is not this release's {LAYOUT_VERSION!r}: nothing rebuilt")
        return report
    with db.write_batch(transaction=True, sync=True) as batch:
        if version is None:
            batch.put(VERSION_KEY, LAYOUT_VERSION)
            report.rebuilt.append("layout version key restored")
        if db.get(POSITION_KEY) is not None:
            # Changed behind replication's back: its backups must not take it for the batch it names.
            batch.delete(POSITION_KEY)
            report.rebuilt.append("replication position cleared: this store's backups get a new snapshot")
        queues = _scan_queues(db, batch, report)
        _drop_malformed_keys(db, batch, report)
        _drop_damaged_retained(db, batch, report)
        _drop_damaged_events(db, batch, report)
        _rebuild_stream_marks(db, batch, report)
        keyed = (_sids_with(db, prefix, size) for prefix, (_, size) in _PER_SESSION_KEYS.items())
        with_data = set(queues).union(*keyed)
        names = _sessions(db, batch, with_data, now, report)
        for sid, client_id in sorted(names.items()):
            queue = queues.get(sid, _Queue())
            _report_queue(report, client_id, queue)
            _rebuild_totals(db, batch, sid, client_id=client_id, queue=queue, report=report)
            _rebuild_sent_mark(db, batch, sid, client_id=client_id, queue=queue, report=report)
        for sid in sorted(set(queues) - set(names)):
            report.lost.append(
                f"session number {sid}: {queues[sid].depth} queued message(s) have no session record, so their "
                "client id is lost; the broker deletes them when it starts"
            )
        raw = db.get(SID_MARK_KEY)
        if raw is not None and len(raw) != _U64_SIZE:  # like the sent mark: never lower, so jump past
            batch.put(SID_MARK_KEY, encode_u64(max((*names, *queues, 0)) + SENT_MARK_JUMP))
            report.rebuilt.append("highest session number did not decode: set past every one in use")
        _rebuild_msg_id_mark(db, batch, report)
        raw = db.get(STORE_ID_KEY)
        if raw is not None and len(raw) != _U64_SIZE:
            batch.delete(STORE_ID_KEY)
            report.rebuilt.append(
                "store id did not decode: removed (the broker makes a new one; stream readers see a new store)"
            )
    return report


def _rebuild_msg_id_mark(db: Any, batch: Any, report: RepairReport) -> None:
    """The b"M" mark: never below the highest id a body, a count or a queue entry holds. One that
    does not decode jumps far past (ids past it may have been given); one below it (an earlier
    release, which keeps no mark, ran on the store since) is raised to it; a store without one
    (an earlier release's) gets it, so the broker's first start need not read every entry."""
    raw = db.get(MSG_ID_MARK_KEY)
    in_use = _highest_msg_id_in_use(db)
    if raw is not None and len(raw) != _U64_SIZE:
        batch.put(MSG_ID_MARK_KEY, encode_u64(in_use + SENT_MARK_JUMP))
        report.rebuilt.append("highest message id did not decode: set past every one in use")
    elif raw is None:
        batch.put(MSG_ID_MARK_KEY, encode_u64(in_use))
    elif (mark := decode_u64(raw)) < in_use:
        batch.put(MSG_ID_MARK_KEY, encode_u64(in_use))
        report.rebuilt.append(
            f"highest message id {mark} was below message {in_use}, which is in use (an earlier release "
            f"wrote the store since): set to {in_use}"
        )


def _highest_msg_id_in_use(db: Any) -> int:
    """store.scan_msg_ids_in_use's highest id, past keys and entries of the wrong length (removed by this repair)."""
    highest = 0
    for prefix in (b"m", b"c"):
        for key in db.iterator(prefix=prefix, reverse=True, include_value=False):
            if len(key) == _U64_SIZE + 1:
                highest = max(highest, msg_id_of_body_key(key))
                break
    for value in db.iterator(prefix=b"q", include_key=False, fill_cache=False):
        if len(value) == _ENTRY_SIZE:
            highest = max(highest, decode_u64(value[:_U64_SIZE]))
    return highest


RELEASED_SHOWN = 20
"""Kept released entries named one by one per client; more are counted."""


def _report_queue(report: RepairReport, client_id: str, queue: _Queue) -> None:
    if queue.unreadable:
        report.lost.append(f"client {client_id!r}: {queue.unreadable} queued message(s) unreadable (removed)")
    for seq, msg_id, state in queue.released_kept[:RELEASED_SHOWN]:
        report.rebuilt.append(
            f"client {client_id!r}: queue entry {seq} (QoS 2, PUBREL due): its body, message {msg_id}, {state}; "
            "kept without it (the client has the message; its PUBREL is sent when it reconnects)"
        )
    if len(queue.released_kept) > RELEASED_SHOWN:
        report.rebuilt.append(
            f"client {client_id!r}: {len(queue.released_kept) - RELEASED_SHOWN} more queue entry(ies) "
            "(QoS 2, PUBREL due) kept without their body, which is gone or does not decode"
        )
    if queue.no_body_fixed:
        report.rebuilt.append(
            f"client {client_id!r}: {queue.no_body_fixed} queue entry(ies) (QoS 2, PUBREL due) without a body "
            "set to not shared, size 0"
        )


def _retained_decodes(key: bytes, value: bytes) -> bool:
    try:
        RetainedMessage.decode(key, value)
    except (struct.error, ValueError, DamagedRecordError):
        return False
    return True


def _drop_damaged_events(db: Any, batch: Any, report: RepairReport) -> None:
    """A stream event that does not decode would stop its readers at it for good: removed, and said."""
    for key, value in db.iterator(prefix=EVENT_PREFIX):
        topic = event_topic(key)  # None: the lengths in the key do not add up
        event_id = event_id_of(key) if len(key) > _U64_SIZE else 0
        try:
            decode_event(topic.decode("utf-8") if topic is not None else "", event_id, value)
        except (struct.error, ValueError):
            pass
        else:
            if topic is not None:
                continue
        batch.delete(key)
        name = (topic or key[1:]).decode("utf-8", "replace")
        report.lost.append(f"stream {shown(name)}: event {event_id} does not decode: removed")


def _rebuild_stream_marks(db: Any, batch: Any, report: RepairReport) -> None:
    """A stream's id mark that does not decode (start-up reads every one): set past the log's last
    event, far past as the other marks, so no id a reader has seen is given again."""
    for key, value in db.iterator(prefix=MARK_PREFIX):
        if len(value) == _U64_SIZE:
            continue
        last = 0
        for event in db.iterator(
            prefix=EVENT_PREFIX + struct.pack(">H", len(key) - 1) + key[1:], reverse=True, include_value=False
        ):
            last = event_id_of(event) if len(event) == len(key) + 2 + _U64_SIZE else 0
            break
        batch.put(key, encode_u64(last + SENT_MARK_JUMP))
        topic = key[1:].decode("utf-8", "replace")
        report.rebuilt.append(f"stream {shown(topic)}: its id mark did not decode: set past every id it can have given")


def _drop_damaged_retained(db: Any, batch: Any, report: RepairReport) -> None:
    """A retained message that does not decode would stop every start-up: it is removed, and said."""
    for key, value in db.iterator(prefix=RETAINED_PREFIX):
        if not _retained_decodes(key, value):
            batch.delete(key)
            topic = key[len(RETAINED_PREFIX) :].decode("utf-8", "replace")
            report.lost.append(f"the retained message of topic {topic!r} does not decode: removed")


def _scan_queues(db: Any, batch: Any, report: RepairReport) -> dict[int, _Queue]:
    """Count every session's readable entries; remove those that do not decode or whose body is gone
    or does not decode (Body.decode refuses it: a replay would stop there for good), with that body;
    fix the reference counts of shared bodies.

    A RELEASED entry (PUBREC received, PUBREL due) needs no body: the client has the message and
    is owed only a PUBREL with the packet id. One whose body is gone or does not decode is kept,
    rewritten to point at no body (msg_id NO_BODY, not SHARED, size 0), so the broker sends its
    PUBREL when the client reconnects and the client's QoS 2 flow completes."""
    queues: dict[int, _Queue] = {}
    shared: Counter[int] = Counter()
    undecodable: dict[int, str] = {}
    """Message id -> why its body does not decode."""
    pointing: Counter[int] = Counter()
    """Message id of an undecodable body -> queue entries found pointing at it (removed)."""
    kept_released: Counter[int] = Counter()
    """Message id of an undecodable body -> RELEASED entries pointing at it (kept without it)."""
    used: set[int] = set()
    """Message ids the kept entries point at: every other body is removed (_drop_unused_bodies)."""
    for key, value in db.iterator(prefix=b"q"):
        if len(key) != _ENTRY_KEY_SIZE:
            batch.delete(key)
            report.lost.append(f"a queue key of {len(key)} bytes (damaged) removed")
            continue
        queue = queues.setdefault(sid_of_entry_key(key), _Queue())
        try:
            entry = Entry.decode(seq_of_entry_key(key), value)
        except struct.error:
            entry = None
        if entry is not None:
            counted = kept_released if awaiting_pubcomp(entry) else pointing
            entry = _checked(db, batch, key, entry, queue=queue, undecodable=undecodable, counted=counted)
        if entry is None:
            batch.delete(key)
            queue.unreadable += 1
            continue
        queue.depth += 1
        queue.bytes += entry.size
        queue.last_seq = entry.seq
        used.add(entry.msg_id)
        if entry.flags & FLAG_SHARED:
            shared[entry.msg_id] += 1
    for msg_id, why in sorted(undecodable.items()):
        batch.delete(body_key(msg_id))  # nothing points at it any more (its count goes in _fix_refs)
        kept = (
            f" ({kept_released[msg_id]} queue entry(ies) (QoS 2, PUBREL due) kept without it)"
            if kept_released[msg_id]
            else ""
        )
        report.lost.append(
            f"message {msg_id}: its body does not decode ({why}): removed, with the {pointing[msg_id]} "
            f"queue entry(ies) pointing at it{kept}"
        )
    _fix_refs(db, batch, shared, report)
    _drop_unused_bodies(db, batch, used | set(undecodable), report)
    return queues


def _drop_unused_bodies(db: Any, batch: Any, used: set[int], report: RepairReport) -> None:
    """Remove the message bodies no queue entry points at: left by an entry erased by its key (it did not
    decode, so its body was not known) or by a release whose reference count was missing or damaged.
    No new message is given their ids (the b"M" mark), so they would only hold their bytes for good.
    ``used`` holds the undecodable bodies too: they are removed, and reported, on their own."""
    unused = 0
    for key in db.iterator(prefix=b"m", include_value=False):
        if len(key) == _U64_SIZE + 1 and msg_id_of_body_key(key) not in used:
            batch.delete(key)
            unused += 1
    if unused:
        report.rebuilt.append(f"{unused} message body(ies) that no queue entry points at removed")


def _checked(
    db: Any, batch: Any, key: bytes, entry: Entry, *, queue: _Queue, undecodable: dict[int, str], counted: Counter[int]
) -> Entry | None:
    """``entry`` as kept (rewritten to NO_BODY, not SHARED, size 0 when it awaits PUBCOMP without a
    usable body, or points at none but is still SHARED or sized: a count of references under id 0
    must never be written), or None: it goes. ``counted``: entries per undecodable body, kept or not."""
    released = awaiting_pubcomp(entry)
    if released and entry.msg_id == NO_BODY and (entry.flags & FLAG_SHARED or entry.size):
        entry = Entry(entry.seq, NO_BODY, entry.qos, entry.flags & ~FLAG_SHARED, 0)
        batch.put(key, entry.encode())
        queue.no_body_fixed += 1
    if not _body_unusable(db, entry, undecodable):
        return entry
    if entry.msg_id in undecodable:
        counted[entry.msg_id] += 1
    if not released:
        return None
    state = "does not decode" if entry.msg_id in undecodable else "is gone"
    queue.released_kept.append((entry.seq, entry.msg_id, state))
    entry = Entry(entry.seq, NO_BODY, entry.qos, entry.flags & ~FLAG_SHARED, 0)
    batch.put(key, entry.encode())
    return entry


def _body_unusable(db: Any, entry: Entry, undecodable: dict[int, str]) -> bool:
    """Is the message body gone, or does it not decode (a replay would stop at it for good)?
    Those that do not decode are kept in ``undecodable`` with the reason. A released entry an
    earlier repair kept without its body (NO_BODY) needs none."""
    msg_id = entry.msg_id
    if msg_id == NO_BODY and awaiting_pubcomp(entry):
        return False
    if msg_id in undecodable:
        return True
    raw = db.get(body_key(msg_id))
    if raw is None:
        return True
    try:
        Body.decode(raw)
    except (struct.error, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        undecodable[msg_id] = str(exc)
        return True
    return False


def _fix_refs(db: Any, batch: Any, shared: Counter[int], report: RepairReport) -> None:
    """Make every shared body's reference count the number of entries found pointing at it."""
    fixed = 0
    for key, value in db.iterator(prefix=b"c"):
        if len(key) != _U64_SIZE + 1:
            continue  # removed by _drop_malformed_keys
        msg_id = msg_id_of_body_key(key)
        try:
            stored = decode_refs(value)
        except struct.error:
            stored = -1
        if msg_id not in shared:
            batch.delete(key)  # no entry points at the body any more
            fixed += 1
        elif stored != shared[msg_id]:
            batch.put(key, encode_refs(shared[msg_id]))
            fixed += 1
        shared.pop(msg_id, None)
    for msg_id, count in shared.items():
        batch.put(refs_key(msg_id), encode_refs(count))
        fixed += 1
    if fixed:
        report.rebuilt.append(f"{fixed} shared message reference count(s) rebuilt from the queues")


_PER_SESSION_KEYS = {b"t": ("queue totals", 9), b"w": ("sent mark", 9), b"x": ("QoS 2 packet id", 11)}
"""Prefix -> (what, key length) of the per-session keys besides queue entries; start-up reads a
session number from each, so one of another length would stop every start."""


_PER_MESSAGE_KEYS = {b"m": ("message body", 9), b"c": ("message reference count", 9)}
"""Prefix -> (what, key length) of the per-message keys: start-up reads the highest message id from
the last of each, so one of another length would stop every start."""


def _drop_malformed_keys(db: Any, batch: Any, report: RepairReport) -> None:
    for prefix, (what, size) in {**_PER_SESSION_KEYS, **_PER_MESSAGE_KEYS}.items():
        for key in db.iterator(prefix=prefix, include_value=False):
            if len(key) != size:
                batch.delete(key)
                report.lost.append(f"a {what} key of {len(key)} bytes (damaged) removed")


def _sids_with(db: Any, prefix: bytes, size: int) -> set[int]:
    return {sid_of_entry_key(key) for key in db.iterator(prefix=prefix, include_value=False) if len(key) == size}


def _sessions(db: Any, batch: Any, with_data: set[int], now: float, report: RepairReport) -> dict[int, str]:
    """Client id of every session number; a record that does not decode is rebuilt when its session
    number can be found (in its bytes, or as the one queue left without a record)."""
    names: dict[int, str] = {}
    damaged: list[tuple[bytes, bytes]] = []
    for key, value in db.iterator(prefix=b"s"):
        try:
            record = SessionRecord.decode(key[1:].decode("utf-8"), value)
        except (ValueError, KeyError, TypeError, AttributeError):
            damaged.append((key, value))
            continue
        names[record.sid] = record.client_id
    unmatched: list[tuple[bytes, bytes]] = []
    for key, value in damaged:
        found = _SID_IN_RECORD.search(value)
        sid = int(found.group(1)) if found else None
        if sid is not None and sid > _MAX_SID:  # no key can hold it: not a session number
            sid = None
        if sid is None or sid in names:
            unmatched.append((key, value))
        else:
            _rebuild_record(batch, key, value, sid=sid, now=now, names=names, report=report)
    orphans = sorted(with_data - set(names))
    if len(unmatched) == 1 and len(orphans) == 1:
        key, value = unmatched.pop()
        _rebuild_record(batch, key, value, sid=orphans[0], now=now, names=names, report=report)
    for key, _ in unmatched:
        batch.delete(key)
        client = key[1:].decode("utf-8", "replace")
        report.lost.append(
            f"client {client!r}: its session record does not decode and no queue could be matched to it; "
            "removed (the client starts a new session)"
        )
    return names


def _rebuild_record(
    batch: Any, key: bytes, raw: bytes, *, sid: int, now: float, names: dict[int, str], report: RepairReport
) -> None:
    try:
        client_id = key[1:].decode("utf-8")
    except UnicodeDecodeError:
        batch.delete(key)
        report.lost.append(f"a session record whose key {key[1:]!r} is not a client id (damaged): removed")
        return
    found = _USERNAME_IN_RECORD.search(raw)
    username = found.group(1).decode("utf-8", "replace") if found else None
    # expires_at None: the broker starts its expiry at start-up, as for a session connected at a crash.
    record = SessionRecord(client_id=client_id, sid=sid, created_at=now, username=username)
    batch.put(key, record.encode())
    names[sid] = client_id
    report.rebuilt.append(f"client {client_id!r}: session record rebuilt (session number {sid})")
    report.lost.append(
        f"client {client_id!r}: its subscriptions and SDK settings were in the damaged record; "
        "the client must subscribe again (its queued messages are kept)"
    )


def _rebuild_totals(db: Any, batch: Any, sid: int, *, client_id: str, queue: _Queue, report: RepairReport) -> None:
    raw = db.get(totals_key(sid))
    try:
        depth, size, dropped = decode_totals(raw)
    except struct.error:
        depth, size, dropped = -1, -1, 0
    if (depth, size) == (queue.depth, queue.bytes):
        return
    batch.put(totals_key(sid), encode_totals(queue.depth, queue.bytes, dropped))
    if raw is None:
        was = "there were none"
    elif depth < 0:
        was = "they did not decode"
    else:
        was = f"they said {depth} message(s), {size} bytes"
    report.rebuilt.append(
        f"client {client_id!r}: queue totals rebuilt from the queue: {queue.depth} message(s), "
        f"{queue.bytes} bytes ({was})"
    )


def _rebuild_sent_mark(db: Any, batch: Any, sid: int, *, client_id: str, queue: _Queue, report: RepairReport) -> None:
    """The sent mark only ever grows (sequence numbers continue past it), and its old value is
    unknown: set it far past the queue; queued messages then go out DUP-flagged, which is harmless."""
    raw = db.get(sent_mark_key(sid))
    if raw is None or len(raw) == _U64_SIZE:
        return
    batch.put(sent_mark_key(sid), encode_u64(queue.last_seq + SENT_MARK_JUMP))
    report.rebuilt.append(
        f"client {client_id!r}: sent mark rebuilt past the queue (its queued messages go out again DUP-flagged)"
    )
