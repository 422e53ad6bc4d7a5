"""Delivery logs (docs/delivery-log.md, version 1): what this client sent and processed, for the
delivery audit (``durable-pipeline audit``) of any test run.

With CPL-2 the log's ``receive`` records also close the one window the marks leave open. A
``receive`` is written (and flushed) once the listeners have returned, and the mark is written
right after it: a process killed between the two restarts with its mark one event behind, and
the broker re-sends that event. :func:`reconcile` reads the log's tail before the client
connects and records what the log shows processed beyond the marks, so the event is not
processed (nor logged) a second time.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Final

from durable_protocol import Marker

from .events import Event
from .persistence import SessionState

log = logging.getLogger("durable_client")

RECONCILE_TAIL: Final = 64 * 1024
"""Bytes read from the end of a delivery log by :func:`reconcile`. Each mark is written right
after its ``receive`` record, so only the last processed event can be unmarked: it is among the
last records, unless other devices sharing the file wrote this much after it."""


def message_id(topic: str, payload: bytes) -> str:
    """The same id on the publisher's and the receiver's side, with nothing added to the payload."""
    return hashlib.sha256(topic.encode("utf-8") + b"\x00" + payload).hexdigest()[:32]


class DeliveryLog:
    """Appends one JSON line per record and flushes it: a SIGKILL keeps every record written."""

    def __init__(self, path: str | os.PathLike[str], device: str) -> None:
        folder = os.path.dirname(os.fspath(path))
        if folder:
            os.makedirs(folder, exist_ok=True)
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - open for the client's life
        try:
            if not _ends_a_line(path):  # a write that failed (or a kill) cut the last line short: end it
                self._file.write("\n")
                self._file.flush()
        except OSError:  # a full disk: the DurableClient is not created (delivery-log.md)
            with contextlib.suppress(OSError):
                self._file.close()
            raise
        self._path = os.fspath(path)
        self._device = device
        self._lock = threading.Lock()

    def _write(self, kind: str, **fields: Any) -> None:
        line = json.dumps({"kind": kind, "device": self._device, "time": time.time(), **fields})
        with self._lock:
            if not self._file.closed:
                try:
                    self._file.write(line + "\n")
                    self._file.flush()
                except OSError as exc:
                    # A full disk or an I/O error ends the log, not the client: raised here it
                    # would drop the connection on every message (and every hello) for ever.
                    log.error(
                        "cannot write the delivery log %s (%s): the log ends here (its last line may be cut "
                        "short); the client goes on without it",
                        self._path, exc,
                    )
                    with contextlib.suppress(OSError):
                        self._file.close()  # the lines it could not flush are dropped with it

    def send(self, topic: str, payload: bytes, qos: int) -> None:
        self._write("send", topic=topic, id=message_id(topic, payload), qos=qos)

    def receive(self, event: Event) -> None:
        self._write(
            "receive",
            topic=event.topic,
            id=message_id(event.topic, event.payload),
            qos=event.qos,
            replayed=event.replayed,
            redelivered=event.redelivered,
            seq=event.seq,
            epoch=event.epoch,
            published_at=event.published_at,
        )

    def subscribe(self, topic_filter: str, qos: int, durable: bool) -> None:
        self._write("subscribe", topic=topic_filter, qos=qos, durable=durable)

    def unsubscribe(self, topic_filter: str) -> None:
        self._write("unsubscribe", topic=topic_filter)

    def session_end(self) -> None:
        self._write("session_end")

    def connect(self, session_present: bool) -> None:
        self._write("connect", session_present=session_present)

    def live(self, marker: Marker) -> None:
        self._write("live", replayed_count=marker.replayed)

    def close(self) -> None:
        with self._lock, contextlib.suppress(OSError):  # a failed flush was reported by _write's ERROR
            self._file.close()


def _ends_a_line(path: str | os.PathLike[str]) -> bool:
    """Is the file at ``path`` empty or ending with a newline? (The next record starts a line.)"""
    with open(path, "rb") as file:
        if file.seek(0, os.SEEK_END) == 0:
            return True
        file.seek(-1, os.SEEK_END)
        return file.read(1) == b"\n"


@dataclass(slots=True)
class Processed:
    """What the tail of a delivery log says one device processed last."""

    sessions: dict[int, int] = field(default_factory=dict)
    """Highest ``seq`` of the device's session ``receive`` records, per epoch."""
    stream: tuple[str, int] | None = None
    """(topic, log id) of the device's last ``receive`` record, when that is a stream event."""


def last_processed(path: str | os.PathLike[str], device: str, tail: int = RECONCILE_TAIL) -> Processed:
    """The ``receive`` records of ``device`` in the last ``tail`` bytes of the log at ``path``.

    Session events have an epoch (never 0: the broker numbers sessions from 1) and seq > 0;
    stream events have epoch 0 and their log id as seq; raw events (seq 0) are skipped. A
    line cut in two by the tail's start, a last line without its newline (torn by a crash:
    the SDK writes each line at once) and lines that are not such records are ignored.
    Raises OSError when the file cannot be read.
    """
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        start = max(0, size - tail)
        # From one byte earlier: then the first line is whole exactly when that byte is a newline.
        begin = max(0, start - 1)
        file.seek(begin)
        data = file.read(size - begin)
    lines = data.split(b"\n")
    lines.pop()  # b"" after the last newline, or a torn last line
    if begin > 0:
        lines = lines[1:]  # the end of a line that started before the tail (or b"")
    found = Processed()
    for line in lines:
        record = _receive_of(line, device)
        if record is None:
            continue
        topic, epoch, seq = record
        found.stream = None  # processed after any stream event before it: that one's mark was written
        if seq <= 0:
            continue
        if epoch == 0:
            found.stream = (topic, seq)
        else:
            found.sessions[epoch] = max(seq, found.sessions.get(epoch, 0))
    return found


def _receive_of(line: bytes, device: str) -> tuple[str, int, int] | None:
    """(topic, epoch, seq) of a ``receive`` record written by ``device``; None for any other line."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError too
        return None
    if not isinstance(record, dict) or record.get("kind") != "receive" or record.get("device") != device:
        return None
    topic, epoch, seq = record.get("topic"), record.get("epoch"), record.get("seq")
    if not (isinstance(topic, str) and isinstance(epoch, int) and isinstance(seq, int)):
        return None
    if isinstance(epoch, bool) or isinstance(seq, bool) or epoch < 0 or seq < 0:
        return None
    return topic, epoch, seq


def reconcile(state: SessionState, path: str | os.PathLike[str], device: str) -> None:
    """Count what the delivery log at ``path`` shows ``device`` processed as processed in ``state``.

    Only for CPL-2 (``state.level == "disk"``): a ``receive`` record is written once the
    listeners have returned, before the mark, so a record beyond the mark is an event processed
    by a process killed before its mark was written. The session mark moves only for records
    of the state's current epoch (a record of an older session says nothing about this one; no
    epoch: nothing to move). A stream position moves only for the device's very last
    ``receive`` (the only one whose mark can be missing), so a position moved back on purpose
    (``subscribe_stream(after=...)``) is not moved forward again by older records. Marks only
    move forward. A log that cannot be read is logged as a warning: the client still starts.
    """
    if state.level != "disk":
        return
    try:
        processed = last_processed(path, device)
    except FileNotFoundError:
        if state.epoch is not None or state.positions():
            log.warning(
                "delivery log %s does not exist (moved away?): an event processed just before the last "
                "process was killed may be processed again",
                path,
            )
        return
    except OSError as exc:
        log.warning(
            "cannot read the delivery log %s (%s): starting without checking it against the marks; an event "
            "processed just before the last process was killed may be processed again",
            path,
            exc,
        )
        return
    epoch = state.epoch
    if epoch is not None:
        seq, mark = processed.sessions.get(epoch, 0), state.get_mark(epoch)
        if seq > mark:
            state.record(epoch, seq)
            log.info(
                "delivery log %s shows epoch %d seq %d processed; mark advanced (was seq %d)", path, epoch, seq, mark
            )
    if processed.stream is not None:
        topic, event_id = processed.stream
        position = state.position(topic)
        if event_id > position:
            state.record_stream(topic, event_id)
            log.info(
                "delivery log %s shows stream %s id %d processed; position advanced (was %d)",
                path, topic, event_id, position,
            )
