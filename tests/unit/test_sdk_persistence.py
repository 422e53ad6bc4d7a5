"""durable_client.persistence: marks in memory and on disk, crash recovery, compaction, lock, fallback."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from durable_client.errors import PersistenceError
from durable_client.persistence import (
    DiskState,
    FallbackState,
    MemoryState,
    SessionState,
    _pathconf,
    open_state,
    state_folder,
)

SDK_PATH = str(Path(__file__).resolve().parents[2] / "client_sdk")


def disk(tmp_path: Path, opened: list[SessionState], client_id: str = "c1", **kwargs: int) -> DiskState:
    state = DiskState(tmp_path, client_id, **kwargs)
    opened.append(state)
    return state


def journal_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("journal.*"))


# ------------------------------------------------------------------ memory
@pytest.mark.parametrize("make", [MemoryState, "disk"])
def test_marks_per_epoch(make: object, tmp_path: Path, opened: list[SessionState]) -> None:
    state: SessionState = MemoryState() if make is MemoryState else disk(tmp_path, opened)
    assert state.epoch is None and state.get_mark(1) == 0
    state.record(1, 5)
    state.record(1, 9)
    assert (state.epoch, state.get_mark(1), state.get_mark(2)) == (1, 9, 0)
    state.record(2, 3)  # a new session replaces the old one's mark
    assert (state.epoch, state.get_mark(1), state.get_mark(2)) == (2, 0, 3)
    state.record_stream("s/a", 4)
    state.reset()
    assert state.epoch is None and state.get_mark(2) == 0
    assert state.positions() == {"s/a": 4} and state.position("s/a") == 4  # streams survive a lost session
    assert state.position("other") == 0


def test_positions_is_a_copy() -> None:
    state = MemoryState()
    state.record_stream("a", 1)
    state.positions()["a"] = 99
    assert state.position("a") == 1


# -------------------------------------------------------------------- disk
def test_disk_state_survives_close_and_reopen(tmp_path: Path, opened: list[SessionState]) -> None:
    state = disk(tmp_path, opened)
    state.record(7, 41)
    state.record_stream("s/a b", 3)
    state.record_stream("s/ünï\ncode", 8)
    state.close()
    again = disk(tmp_path, opened)
    assert (again.epoch, again.get_mark(7)) == (7, 41)
    assert again.positions() == {"s/a b": 3, "s/ünï\ncode": 8}


@pytest.mark.parametrize("group_commit", [False, True])
def test_restored_stream_positions_survive_close_and_reopen(
    tmp_path: Path, opened: list[SessionState], group_commit: bool
) -> None:
    """A refused stream_subscribe's ``after`` positions are put back: an old value again, a new
    topic gone (the journal has no removal: a snapshot holds the result, with the mark)."""
    state = disk(tmp_path, opened, group_commit=group_commit)
    state.record(7, 41)
    state.record_stream("s/a", 3)
    state.record_stream("s/a", 1)  # a refused call's ``after``
    state.record_stream("s/new", 5)
    state.restore_streams({"s/a": 3, "s/new": None}, if_at={"s/a": 1, "s/new": 5})
    assert state.positions() == {"s/a": 3}
    state.close()
    again = disk(tmp_path, opened)
    assert (again.get_mark(7), again.positions()) == (41, {"s/a": 3})


def test_restore_streams_in_memory_and_through_the_fallback(tmp_path: Path) -> None:
    memory = MemoryState(positions={"s/a": 3, "s/new": 5})
    memory.restore_streams({"s/new": None, "s/gone": None, "s/a": 2}, if_at={"s/new": 5, "s/gone": 1, "s/a": 3})
    assert memory.positions() == {"s/a": 2}
    fallback = FallbackState(DiskState(tmp_path, "fb"), lambda exc: None)
    fallback.record_stream("s/new", 5)
    fallback.restore_streams({"s/new": None}, if_at={"s/new": 5})
    assert fallback.positions() == {}
    fallback.close()


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_restore_streams_leaves_a_position_another_stream_moved_since(
    tmp_path: Path, opened: list[SessionState], kind: str
) -> None:
    """Between a stream_subscribe's ``after`` and its refusal another stream may read the topic on:
    its position is kept, not put back (the other topics of the call are)."""
    state: SessionState = MemoryState() if kind == "memory" else disk(tmp_path, opened)
    state.record_stream("s/a", 3)
    state.record_stream("s/a", 1)  # the refused call's ``after``
    state.record_stream("s/b", 2)  # the refused call's ``after`` too, for a topic without a position
    state.record_stream("s/a", 9)  # another stream read s/a on meanwhile
    state.restore_streams({"s/a": 3, "s/b": None}, if_at={"s/a": 1, "s/b": 2})
    assert state.positions() == {"s/a": 9}
    if kind == "disk":
        state.close()
        assert disk(tmp_path, opened).positions() == {"s/a": 9}


def test_every_record_is_on_disk_before_a_sigkill(tmp_path: Path, opened: list[SessionState]) -> None:
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        sys.path.insert(0, {SDK_PATH!r})
        from durable_client.persistence import DiskState
        state = DiskState({str(tmp_path)!r}, "killed")
        for seq in range(1, 51):
            state.record(3, seq)
        state.record_stream("s/x", 12)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], timeout=60, check=False)
    assert result.returncode == -9
    state = disk(tmp_path, opened, "killed")  # the lock died with the process
    assert (state.epoch, state.get_mark(3), state.positions()) == (3, 50, {"s/x": 12})


def journal_with(tmp_path: Path, opened: list[SessionState], tail: bytes) -> Path:
    """The journal of a closed CPL-2 state holding mark (1, 5), with ``tail`` appended after its line."""
    state = disk(tmp_path, opened)
    state.record(1, 5)
    state.close()
    journal = state.folder / "journal.0"
    with journal.open("ab") as f:
        f.write(tail)
    return journal


def test_torn_last_line_is_ignored_and_cut_off(tmp_path: Path, opened: list[SessionState]) -> None:
    journal = journal_with(tmp_path, opened, b"e 1 6")  # a crash in the middle of the next record
    again = disk(tmp_path, opened)
    assert again.get_mark(1) == 5
    assert journal.read_bytes() == b"e 1 5\n"
    again.record(1, 7)  # appends after a clean line end, not after the fragment
    again.close()
    assert disk(tmp_path, opened).get_mark(1) == 7


def test_garbage_last_line_counts_as_torn(tmp_path: Path, opened: list[SessionState]) -> None:
    journal_with(tmp_path, opened, b"\x00\x00\x00\n")
    assert disk(tmp_path, opened).get_mark(1) == 5


def test_damaged_middle_line_is_a_persistence_error(tmp_path: Path, opened: list[SessionState]) -> None:
    journal = journal_with(tmp_path, opened, b"zz top\ne 1 6\n")
    with pytest.raises(PersistenceError, match=r"journal\.0 is damaged \(line 2"):
        DiskState(tmp_path, "c1")
    # The failed open released its lock: a repaired folder can be opened.
    journal.write_bytes(b"e 1 6\n")
    assert disk(tmp_path, opened).get_mark(1) == 6


@pytest.mark.parametrize("text", ['{"v": 1}', "[" * 5000])  # the second nested past the recursion limit
def test_damaged_snapshot_is_a_persistence_error(tmp_path: Path, opened: list[SessionState], text: str) -> None:
    folder = state_folder(tmp_path, "c1")
    folder.mkdir()
    (folder / "snapshot").write_text(text)
    with pytest.raises(PersistenceError, match="snapshot is damaged"):
        DiskState(tmp_path, "c1")


def test_a_stream_record_nested_too_deeply_is_a_damaged_line(tmp_path: Path, opened: list[SessionState]) -> None:
    journal_with(tmp_path, opened, b"s 3 " + b"[" * 5000 + b"\ne 1 6\n")
    with pytest.raises(PersistenceError, match=r"journal\.0 is damaged \(line 2: JSON nested too deeply"):
        DiskState(tmp_path, "c1")


def test_compaction_folds_the_journal_into_a_snapshot(tmp_path: Path, opened: list[SessionState]) -> None:
    state = disk(tmp_path, opened, compact_after=4)
    for seq in range(1, 11):
        state.record(2, seq)
    state.record_stream("s/a", 5)
    state.reset()
    state.record(3, 1)
    # 13 records, a snapshot every 4: generation 3, one record in its journal.
    assert journal_files(state.folder) == ["journal.3"]
    assert (state.folder / "journal.3").read_bytes() == b"e 3 1\n"
    assert not (state.folder / "snapshot.tmp").exists()
    state.close()
    again = disk(tmp_path, opened, compact_after=4)
    assert (again.epoch, again.get_mark(3), again.positions()) == (3, 1, {"s/a": 5})


def test_crash_after_snapshot_rename_loses_nothing(tmp_path: Path, opened: list[SessionState]) -> None:
    state = disk(tmp_path, opened, compact_after=2)
    state.record(1, 1)
    state.record(1, 2)  # compaction: snapshot gen 1
    state.record(1, 3)
    state.close()
    folder = state.folder
    # As if a compaction died after the rename: a newer snapshot, the old journal still there.
    (folder / "journal.0").write_bytes(b"e 1 1\ne 1 2\n")
    (folder / "snapshot.tmp").write_bytes(b"{half")
    again = disk(tmp_path, opened, compact_after=2)
    assert again.get_mark(1) == 3
    assert journal_files(folder) == ["journal.1"] and not (folder / "snapshot.tmp").exists()


def test_odd_client_ids_get_a_folder_of_their_own(tmp_path: Path) -> None:
    assert state_folder(tmp_path, "plant/line 1") == tmp_path / "plant%2Fline%201"
    assert state_folder(tmp_path, "..") == tmp_path / "%2E%2E"
    assert state_folder(tmp_path, "a.b_c-d") == tmp_path / "a.b_c-d"


# -------------------------------------------------------------------- lock
def test_folder_locked_by_another_process(tmp_path: Path, opened: list[SessionState]) -> None:
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {SDK_PATH!r})
        from durable_client.persistence import DiskState
        state = DiskState({str(tmp_path)!r}, "shared")
        print("locked", flush=True)
        sys.stdin.readline()
        """
    )
    holder = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"locked\n"
        with pytest.raises(PersistenceError) as info:
            DiskState(tmp_path, "shared")
        message = str(info.value)
        assert str(state_folder(tmp_path, "shared")) in message
        assert f"pid {holder.pid}" in message
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=30)
    disk(tmp_path, opened, "shared")  # free again once the holder is gone


def test_lock_is_not_a_fallback_case(tmp_path: Path, opened: list[SessionState]) -> None:
    disk(tmp_path, opened)
    with pytest.raises(PersistenceError, match="in use by another process"):
        open_state("disk", "c1", tmp_path, lambda exc: None)


# ---------------------------------------------------------------- fallback
def test_unwritable_folder_at_start_falls_back_to_memory(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a regular file")
    seen: list[OSError] = []
    with caplog.at_level(logging.WARNING, logger="durable_client"):
        state = open_state("disk", "c1", blocker / "state", seen.append)
    assert isinstance(state, MemoryState) and state.level == "memory"
    assert len(seen) == 1 and isinstance(seen[0], OSError)
    assert "CPL-2 -> CPL-1" in caplog.text and "after a restart" in caplog.text
    state.record(1, 1)
    assert state.get_mark(1) == 1


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a 0o500 folder anyway")
def test_read_only_folder_falls_back_to_memory(tmp_path: Path) -> None:
    tmp_path.chmod(0o500)
    try:
        seen: list[OSError] = []
        state = open_state("disk", "c1", tmp_path, seen.append)
        assert state.level == "memory" and len(seen) == 1
    finally:
        tmp_path.chmod(0o700)


def test_write_error_mid_run_keeps_every_mark_in_memory(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    seen: list[OSError] = []
    state = open_state("disk", "c1", tmp_path, seen.append)
    try:
        assert isinstance(state, FallbackState) and state.level == "disk"
        state.record(4, 10)
        state.record_stream("s/a", 2)
        inner = state._disk
        full = os.open("/dev/full", os.O_WRONLY)
        os.dup2(full, inner._journal_fd)  # the journal now answers ENOSPC, like a full disk
        os.close(full)
        with caplog.at_level(logging.WARNING, logger="durable_client"):
            state.record(4, 11)  # fails on disk: kept in memory, no exception
        assert state.level == "memory"
        assert len(seen) == 1 and seen[0].errno == 28
        assert "CPL-2 -> CPL-1" in caplog.text
        assert (state.epoch, state.get_mark(4), state.positions()) == (4, 11, {"s/a": 2})
        state.record(4, 12)
        state.record_stream("s/a", 3)
        state.reset()
        state.record(5, 1)
        assert (state.epoch, state.get_mark(5), state.positions()) == (5, 1, {"s/a": 3})
        assert len(seen) == 1  # warned once
    finally:
        state.close()
    # What reached the disk before the failure is still there for the next run.
    reopened = DiskState(tmp_path, "c1")
    try:
        assert (reopened.epoch, reopened.get_mark(4), reopened.positions()) == (4, 10, {"s/a": 2})
    finally:
        reopened.close()


def test_compaction_error_falls_back_too(tmp_path: Path) -> None:
    seen: list[OSError] = []
    state = open_state("disk", "c1", tmp_path, seen.append, compact_after=3)
    try:
        state.record(1, 1)
        state.record(1, 2)
        folder = state_folder(tmp_path, "c1")
        (folder / "snapshot.tmp").mkdir()  # the snapshot cannot be written
        state.record(1, 3)
        assert state.level == "memory" and len(seen) == 1
        assert state.get_mark(1) == 3
    finally:
        state.close()


def test_open_state_validates_its_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs state_dir"):
        open_state("disk", "c1", None, lambda exc: None)
    with pytest.raises(ValueError, match="'memory' or 'disk'"):
        open_state("cloud", "c1", tmp_path, lambda exc: None)  # type: ignore[arg-type]
    assert open_state("memory", "c1", None, lambda exc: None).level == "memory"


def test_a_pathconf_answer_of_minus_one_is_no_limit_not_a_limit_of_minus_one(tmp_path: Path) -> None:
    """Review 143: os.pathconf returns -1 without an exception for "no limit"; _pathconf returned
    it as the limit (every name or path then "too long"). It now asks the parents, then the default."""
    if os.pathconf(tmp_path, "PC_SYMLINK_MAX") != -1:
        pytest.skip("PC_SYMLINK_MAX has a limit here: no real -1 answer to test with")
    assert _pathconf(tmp_path, "PC_SYMLINK_MAX", 1234) == 1234
    assert _pathconf(tmp_path, "PC_NAME_MAX", 1234) == os.pathconf(tmp_path, "PC_NAME_MAX") > 0
