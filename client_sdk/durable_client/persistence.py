"""Client-side persistence of what was processed: the marks behind exactly-once.

Two things are kept (seeds/stateless-client-persistence.txt):

* the session mark: the durable session's ``epoch`` and the highest ``seq`` processed in it.
  An event at or below the mark is a duplicate (a redelivery) and skips the listeners;
* stream positions: the last log id processed per stream topic, presented in the next
  ``stream_subscribe`` so a stateless connection resumes where it stopped.

``MemoryState`` (CPL-1) keeps them while the process lives. ``DiskState`` (CPL-2) also writes
them to ``state_dir/<client_id>/``, version 1 of this layout:

* ``lock``: held with ``flock`` while a client uses the folder; holds the owner's pid.
* ``snapshot``: JSON ``{"v": 1, "gen": G, "epoch": E|null, "mark": M, "streams": {topic: id}}``,
  replaced atomically (temp file, fsync, rename, fsync of the folder) by compaction.
* ``journal.<G>``: records since snapshot generation G, one line each, written with
  ``os.write`` before ``record()`` returns:
  ``e <epoch> <seq>`` (session mark), ``r`` (session reset), ``s <id> <topic as JSON>``
  (stream position). Every record is an assignment, so replaying one twice is harmless. A
  last line cut short by a crash (no newline) is ignored and cut off on load.
  No record removes a stream position: ``restore_streams()`` (a refused ``stream_subscribe``
  puts back the positions its ``after`` set) writes a new snapshot generation instead.

When is a record durable? A record is in the OS when ``record()`` returns, so a SIGKILL of the
process cannot lose it. Against a power loss it needs an ``fsync``: by default ``record()``
does one per record; with ``group_commit=True`` (what the client uses) it does not, and
``sync()`` makes every record written so far durable with one ``fsync``. ``unsynced`` counts the
records waiting for it. The client's group commit (``_commit.py``) sends the acknowledgement of
an event only after the ``sync()`` that covers its mark. ``reset()`` and compaction always
fsync at once (they are rare).

An ``OSError`` while writing, syncing (or creating the folder) switches the client to a
``MemoryState`` holding the same marks: CPL-2 -> CPL-1, as the seed prescribes, instead of
stopping delivery. The marks written but not synced before the error are in that memory state:
they were applied in memory when written.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final
from urllib.parse import quote

from .errors import PersistenceError, WrongTypeError
from .events import PersistenceLevel

log = logging.getLogger("durable_client")

LAYOUT_VERSION: Final = 1
DEFAULT_COMPACT_AFTER: Final = 10_000
"""Journal lines before compaction: bounds start-up replay and disk use, costs one snapshot write."""


class SessionState(ABC):
    """Marks of processed events. Every method is thread-safe."""

    @property
    @abstractmethod
    def level(self) -> PersistenceLevel: ...

    @property
    @abstractmethod
    def epoch(self) -> int | None:
        """The session whose mark is kept; None before any durable session was seen (or after reset)."""

    @abstractmethod
    def get_mark(self, epoch: int) -> int:
        """Highest seq processed in ``epoch``; 0 for any other epoch (a new session starts clean)."""

    @abstractmethod
    def record(self, epoch: int, seq: int) -> None:
        """``seq`` of ``epoch`` was processed (replaces the mark of any older epoch)."""

    @abstractmethod
    def reset(self) -> None:
        """Forget the session mark (the session was lost); stream positions stay."""

    @abstractmethod
    def positions(self) -> dict[str, int]:
        """A copy of the last id processed per stream topic."""

    @abstractmethod
    def position(self, topic: str) -> int:
        """Last id processed on ``topic``; 0 when none."""

    @abstractmethod
    def record_stream(self, topic: str, event_id: int) -> None: ...

    @abstractmethod
    def restore_streams(self, previous: dict[str, int | None], *, if_at: dict[str, int]) -> None:
        """Put stream positions back as they were (``None``: the topic had none): the ``after``
        positions of a ``stream_subscribe`` the broker refused. A topic is put back only while
        its position is still ``if_at[topic]`` (the one ``after`` set): one that another stream
        has moved on since keeps its new position."""

    @property
    def unsynced(self) -> int:
        """Records written to the OS but not yet made durable by ``sync()`` (always 0 in memory)."""
        return 0

    def sync(self) -> None:  # noqa: B027 - a no-op by default: only a disk state has anything to sync
        """Make every record so far durable (one fsync); a no-op in memory. OSError on failure."""

    @abstractmethod
    def close(self) -> None: ...


class MemoryState(SessionState):
    """CPL-1: exactly-once while the process lives."""

    def __init__(self, epoch: int | None = None, mark: int = 0, positions: dict[str, int] | None = None) -> None:
        self._lock = threading.Lock()
        self._epoch = epoch
        self._mark = mark if epoch is not None else 0
        self._positions: dict[str, int] = dict(positions or {})

    @property
    def level(self) -> PersistenceLevel:
        return "memory"

    @property
    def epoch(self) -> int | None:
        return self._epoch

    def get_mark(self, epoch: int) -> int:
        with self._lock:
            return self._mark if epoch == self._epoch else 0

    def record(self, epoch: int, seq: int) -> None:
        with self._lock:
            self._epoch, self._mark = epoch, seq

    def reset(self) -> None:
        with self._lock:
            self._epoch, self._mark = None, 0

    def positions(self) -> dict[str, int]:
        with self._lock:
            return dict(self._positions)

    def position(self, topic: str) -> int:
        with self._lock:
            return self._positions.get(topic, 0)

    def record_stream(self, topic: str, event_id: int) -> None:
        with self._lock:
            self._positions[topic] = event_id

    def restore_streams(self, previous: dict[str, int | None], *, if_at: dict[str, int]) -> None:
        with self._lock:
            for topic, event_id in previous.items():
                if self._positions.get(topic) != if_at[topic]:
                    continue
                if event_id is None:
                    self._positions.pop(topic, None)
                else:
                    self._positions[topic] = event_id

    def copy(self) -> MemoryState:
        with self._lock:
            return MemoryState(self._epoch, self._mark, self._positions)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"epoch": self._epoch, "mark": self._mark, "streams": dict(self._positions)}

    def close(self) -> None:
        pass


def state_folder(state_dir: str | os.PathLike[str], client_id: str) -> Path:
    """``state_dir/<client_id>``, the id percent-encoded where it is not a safe file name."""
    name = quote(client_id, safe="")
    if name in ("", ".", ".."):
        name = "%2E" * len(name) or "%00empty"
    return Path(state_dir) / name


class DiskState(SessionState):
    """CPL-2: exactly-once across restarts (layout in the module docstring).

    Raises OSError when the folder cannot be created or written (the caller falls back to
    memory) and PersistenceError when another process holds it or its files are damaged.
    ``group_commit=True``: ``record()``/``record_stream()`` leave the fsync to ``sync()``.
    """

    def __init__(
        self,
        state_dir: str | os.PathLike[str],
        client_id: str,
        *,
        compact_after: int = DEFAULT_COMPACT_AFTER,
        group_commit: bool = False,
    ) -> None:
        if compact_after < 1:
            raise ValueError(f"compact_after must be 1 or more, got {compact_after}")
        self.folder = state_folder(state_dir, client_id)
        self._compact_after = compact_after
        self._group_commit = group_commit
        self._lock = threading.Lock()
        self._journal_fd = -1
        self._lines = 0
        self._unsynced = 0
        self._gen = 0
        self.folder.mkdir(parents=True, exist_ok=True)
        self._lock_fd = self._take_lock()
        try:
            self._mem = self._load()
            self._journal_fd = self._open_journal()
        except BaseException:
            os.close(self._lock_fd)
            raise

    # ---------------------------------------------------------------- start
    def _take_lock(self) -> int:
        fd = os.open(self.folder / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise PersistenceError(
                f"the client state folder {self.folder} is in use by another process (pid {owner}): two "
                "clients with one client id would process events twice. Stop the other one, or give "
                "this client another client_id or state_dir."
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd

    def _load(self) -> MemoryState:
        snapshot = self.folder / "snapshot"
        mem = MemoryState()
        if snapshot.exists():
            mem = self._read_snapshot(snapshot)
        journal = self._journal_path(self._gen)
        if journal.exists():
            self._replay(journal, mem)
        for stale in self.folder.glob("journal.*"):
            if stale != journal:
                stale.unlink()
        (self.folder / "snapshot.tmp").unlink(missing_ok=True)
        return mem

    def _read_snapshot(self, path: Path) -> MemoryState:
        try:
            data = json.loads(path.read_bytes())
            if data["v"] != LAYOUT_VERSION:
                raise ValueError(f"layout version {data['v']}; this SDK reads {LAYOUT_VERSION}")
            self._gen = int(data["gen"])
            epoch = data["epoch"]
            streams = {str(topic): int(event_id) for topic, event_id in data["streams"].items()}
            return MemoryState(None if epoch is None else int(epoch), int(data["mark"]), streams)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise self._damaged(path, str(exc)) from None
        except RecursionError:
            raise self._damaged(path, "JSON nested too deeply") from None

    def _replay(self, path: Path, mem: MemoryState) -> None:
        data = path.read_bytes()
        lines = data.split(b"\n")
        torn = lines.pop()  # b"" when the file ends with a newline
        good = len(data) - len(torn)
        for number, line in enumerate(lines, 1):
            try:
                _apply_line(line, mem)
            except RecursionError:  # a stream record's topic is JSON
                raise self._damaged(path, f"line {number}: JSON nested too deeply") from None
            except (ValueError, IndexError) as exc:
                if number < len(lines) or torn:
                    raise self._damaged(path, f"line {number}: {exc}") from None
                good -= len(line) + 1  # a damaged last line is a torn write, like a line without newline
            else:
                self._lines += 1
        if good != len(data):
            log.info("client state: ignoring a record cut short by a crash at the end of %s", path)
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.ftruncate(fd, good)
                os.fsync(fd)
            finally:
                os.close(fd)

    def _damaged(self, path: Path, detail: str) -> PersistenceError:
        return PersistenceError(
            f"the client state file {path} is damaged ({detail}). Move the folder {self.folder} away to "
            "start with empty state: events processed before may then be delivered again."
        )

    def _journal_path(self, gen: int) -> Path:
        return self.folder / f"journal.{gen}"

    def _open_journal(self) -> int:
        path = self._journal_path(self._gen)
        created = not path.exists()
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        if created:
            try:
                _fsync_dir(self.folder)
            except BaseException:
                os.close(fd)
                raise
        return fd

    # ---------------------------------------------------------------- reads
    @property
    def level(self) -> PersistenceLevel:
        return "disk"

    @property
    def epoch(self) -> int | None:
        return self._mem.epoch

    def get_mark(self, epoch: int) -> int:
        return self._mem.get_mark(epoch)

    def positions(self) -> dict[str, int]:
        return self._mem.positions()

    def position(self, topic: str) -> int:
        return self._mem.position(topic)

    def memory_copy(self) -> MemoryState:
        """The marks as of the last successful write: what a fallback continues from."""
        return self._mem.copy()

    # --------------------------------------------------------------- writes
    def record(self, epoch: int, seq: int) -> None:
        self._write(f"e {epoch} {seq}\n".encode(), lambda: self._mem.record(epoch, seq), self._group_commit)

    def reset(self) -> None:
        self._write(b"r\n", self._mem.reset, False)

    def record_stream(self, topic: str, event_id: int) -> None:
        line = f"s {event_id} {json.dumps(topic, ensure_ascii=False)}\n".encode()
        self._write(line, lambda: self._mem.record_stream(topic, event_id), self._group_commit)

    def restore_streams(self, previous: dict[str, int | None], *, if_at: dict[str, int]) -> None:
        """The journal has no record that removes a position: a new snapshot generation holds the
        positions as restored (rare: a refused ``stream_subscribe`` with ``after``)."""
        with self._lock:
            self._mem.restore_streams(previous, if_at=if_at)
            self._compact()

    @property
    def unsynced(self) -> int:
        return self._unsynced

    def sync(self) -> None:
        with self._lock:
            if self._unsynced and self._journal_fd >= 0:
                os.fsync(self._journal_fd)
                self._unsynced = 0

    def _write(self, line: bytes, apply: Callable[[], None], defer_sync: bool) -> None:
        with self._lock:
            view = memoryview(line)
            while view:
                written = os.write(self._journal_fd, view)
                view = view[written:]
            if defer_sync:
                self._unsynced += 1
            else:
                os.fsync(self._journal_fd)  # covers the unsynced records before this one too
                self._unsynced = 0
            apply()
            self._lines += 1
            if self._lines >= self._compact_after:
                self._compact()

    def _compact(self) -> None:
        """Fold the journal into a new snapshot generation; a crash at any step loses nothing."""
        gen = self._gen + 1
        body = json.dumps({"v": LAYOUT_VERSION, "gen": gen, **self._mem.snapshot()}).encode()
        tmp = self.folder / "snapshot.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            view = memoryview(body)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.folder / "snapshot")
        _fsync_dir(self.folder)
        # From here the snapshot holds everything: journal.<gen> may be missing or empty.
        old_fd, old_path = self._journal_fd, self._journal_path(self._gen)
        self._gen, self._lines, self._unsynced = gen, 0, 0
        self._journal_fd = self._open_journal()
        os.close(old_fd)
        old_path.unlink(missing_ok=True)

    # -------------------------------------------------------------- closing
    def abandon(self) -> None:
        """Stop writing (after an I/O error) but keep the folder locked until close()."""
        with self._lock:
            if self._journal_fd >= 0:
                with contextlib.suppress(OSError):  # the descriptor may be what failed
                    os.close(self._journal_fd)
                self._journal_fd = -1

    def close(self) -> None:
        """Sync what is not synced yet (a failure is logged: the process loses only power-loss safety), unlock."""
        try:
            self.sync()
        except OSError as exc:
            log.warning("client state: the last %d records in %s may not be on disk: %s", self._unsynced,
                        self.folder, exc)
        self.abandon()
        with self._lock:
            if self._lock_fd >= 0:
                os.close(self._lock_fd)  # releases the flock
                self._lock_fd = -1


class FallbackState(SessionState):
    """DiskState until its first OSError, then a MemoryState with the same marks (CPL-2 -> CPL-1)."""

    def __init__(self, disk: DiskState, on_fallback: Callable[[OSError], None]) -> None:
        self._lock = threading.Lock()
        self._disk = disk
        self._active: SessionState = disk
        self._on_fallback = on_fallback

    @property
    def level(self) -> PersistenceLevel:
        return self._active.level

    @property
    def epoch(self) -> int | None:
        return self._active.epoch

    def get_mark(self, epoch: int) -> int:
        return self._active.get_mark(epoch)

    def positions(self) -> dict[str, int]:
        return self._active.positions()

    def position(self, topic: str) -> int:
        return self._active.position(topic)

    def record(self, epoch: int, seq: int) -> None:
        self._mutate(lambda state: state.record(epoch, seq))

    def reset(self) -> None:
        self._mutate(lambda state: state.reset())

    def record_stream(self, topic: str, event_id: int) -> None:
        self._mutate(lambda state: state.record_stream(topic, event_id))

    def restore_streams(self, previous: dict[str, int | None], *, if_at: dict[str, int]) -> None:
        self._mutate(lambda state: state.restore_streams(previous, if_at=if_at))

    @property
    def unsynced(self) -> int:
        return self._active.unsynced

    def sync(self) -> None:
        """fsync; on OSError fall back to memory, which holds every mark written (synced or not)."""
        self._mutate(lambda state: state.sync())

    def _mutate(self, apply: Callable[[SessionState], None]) -> None:
        with self._lock:
            try:
                apply(self._active)
                return
            except OSError as exc:
                if self._active is not self._disk:
                    raise
                memory = self._disk.memory_copy()
                apply(memory)  # the record that failed is kept (records are assignments: idempotent)
                self._active = memory
                self._disk.abandon()
                error = exc
        _warn_fallback(self._disk.folder, error)
        self._on_fallback(error)

    def close(self) -> None:
        self._active.close()
        self._disk.close()


def open_state(
    level: PersistenceLevel,
    client_id: str,
    state_dir: str | os.PathLike[str] | None,
    on_fallback: Callable[[OSError], None],
    *,
    compact_after: int = DEFAULT_COMPACT_AFTER,
    group_commit: bool = False,
) -> SessionState:
    """The client's state for ``level``; ``disk`` falls back to memory on OSError (see above)."""
    if level == "memory":
        return MemoryState()
    if level != "disk":
        error = ValueError if isinstance(level, str) else WrongTypeError
        raise error(f"persistence must be 'memory' or 'disk', got {level!r}")
    if state_dir is None:
        raise ValueError("persistence='disk' needs state_dir: the folder that keeps state_dir/<client_id>/")
    name, limit = state_folder(state_dir, client_id).name, _name_max(state_dir)
    if len(name.encode()) > limit:
        # Refused, not a fall-back to memory: that would silently lose exactly-once across restarts.
        raise ValueError(
            f"client_id: with persistence='disk' it names the folder state_dir/<client_id>/, {len(name.encode())} "
            f"bytes percent-encoded, more than the {limit} bytes a file name may have there; use a shorter client_id"
        )
    # The path as DiskState gives it to the kernel, whose limit applies to that string: a relative
    # state_dir is not made absolute (a deep current folder does not count).
    folder, path_limit = state_folder(state_dir, client_id), _path_max(state_dir)
    longest = len(os.fsencode(folder)) + _LONGEST_FILE
    if longest >= path_limit:
        # The same: the folder or a file in it could not be made ([Errno 36] File name too long).
        raise ValueError(
            f"state_dir: with persistence='disk' the files of state_dir/<client_id>/ take paths of up to "
            f"{longest} bytes there, more than the {path_limit - 1} bytes a path may have; use a shorter "
            "state_dir or client_id"
        )
    try:
        disk = DiskState(state_dir, client_id, compact_after=compact_after, group_commit=group_commit)
    except OSError as exc:
        _warn_fallback(state_folder(state_dir, client_id), exc)
        on_fallback(exc)
        return MemoryState()
    return FallbackState(disk, on_fallback)


_LONGEST_FILE = len(b"/journal.") + 20
"""Bytes a file in the folder adds to its path: ``/journal.<gen>``, the generation a 64-bit number
at most, is longer than ``/lock``, ``/snapshot`` and ``/snapshot.tmp``."""


def _name_max(state_dir: str | os.PathLike[str]) -> int:
    """The most bytes of a file name in ``state_dir`` (or its nearest existing parent): 255 on most."""
    return _pathconf(state_dir, "PC_NAME_MAX", 255)


def _path_max(state_dir: str | os.PathLike[str]) -> int:
    """The most bytes of a path in ``state_dir`` (or its nearest existing parent), its ending NUL
    included: 4096 on Linux."""
    return _pathconf(state_dir, "PC_PATH_MAX", 4096)


def _pathconf(state_dir: str | os.PathLike[str], name: str, default: int) -> int:
    """``os.pathconf(name)`` of ``state_dir`` or its nearest parent that answers with a limit;
    ``default`` when none does (-1 is "no limit": the next parent is asked)."""
    path = Path(state_dir)
    with contextlib.suppress(OSError):  # the current folder deleted: the path as given is walked
        path = path.absolute()
    for folder in (path, *path.parents):
        try:
            value = os.pathconf(folder, name)
        except (OSError, ValueError):
            continue
        if value > 0:
            return value
    return default


def _warn_fallback(folder: Path, exc: OSError) -> None:
    log.warning(
        "client state: CPL-2 -> CPL-1: cannot write %s (%s). Marks of processed events are kept in memory "
        "from now on: exactly-once holds while this process runs, but events processed from now on may be "
        "delivered again after a restart. Fix the folder and restart the client to get CPL-2 back.",
        folder,
        exc,
    )


def _apply_line(line: bytes, mem: MemoryState) -> None:
    kind, _, rest = line.decode().partition(" ")
    if kind == "e":
        epoch, seq = rest.split(" ")
        mem.record(int(epoch), int(seq))
    elif kind == "r" and not rest:
        mem.reset()
    elif kind == "s":
        event_id, topic = rest.split(" ", 1)
        name = json.loads(topic)
        if not isinstance(name, str):
            raise ValueError(f"topic {topic!r} is not a JSON string")
        mem.record_stream(name, int(event_id))
    else:
        raise ValueError(f"unknown record {line[:40]!r}")


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
