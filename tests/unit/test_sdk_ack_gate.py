"""durable_client._commit and DiskState(group_commit=True): acks held until the fsync of their marks.

The gate runs against a real DiskState (real files) whose fsync calls are counted; the clock is
a fake, so the delay rule is checked without waiting.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from durable_client import DurableClient
from durable_client._commit import DEFAULT_FSYNC_BATCH, DEFAULT_FSYNC_DELAY_MS, AckGate, check_group_options
from durable_client.persistence import DiskState, FallbackState, SessionState, open_state

SDK_PATH = str(Path(__file__).resolve().parents[2] / "client_sdk")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Fsyncs:
    """os.fsync, counted; ``fail`` makes the next calls raise an EIO, as a dying disk does."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        self.fail = False
        real = os.fsync

        def fsync(fd: int) -> None:
            self.calls += 1
            if self.fail:
                raise OSError(errno.EIO, "Input/output error (injected)")
            real(fd)

        monkeypatch.setattr(os, "fsync", fsync)


@pytest.fixture
def fsyncs(monkeypatch: pytest.MonkeyPatch) -> Fsyncs:
    return Fsyncs(monkeypatch)


@pytest.fixture
def fallback(tmp_path: Path) -> Iterator[tuple[SessionState, list[OSError]]]:
    seen: list[OSError] = []
    state = open_state("disk", "c1", tmp_path, seen.append, group_commit=True)
    assert isinstance(state, FallbackState)
    yield state, seen
    state.close()


def gate_for(state: SessionState, clock: Clock, *, batch: int = 4, delay_ms: float = 5.0) -> tuple[AckGate, list[int]]:
    sent: list[int] = []
    gate = AckGate(state, lambda mid, qos, stream_ack: sent.append(mid), batch=batch, delay_ms=delay_ms, clock=clock)
    return gate, sent


# ------------------------------------------------------------ DiskState
def test_group_commit_writes_each_record_and_fsyncs_on_sync(
    tmp_path: Path, fsyncs: Fsyncs, opened: list[SessionState]
) -> None:
    state = DiskState(tmp_path, "c1", group_commit=True)
    opened.append(state)
    before = fsyncs.calls
    for seq in range(1, 11):
        state.record(3, seq)
    state.record_stream("s/a", 7)
    assert fsyncs.calls == before and state.unsynced == 11
    assert (state.folder / "journal.0").read_bytes().count(b"\n") == 11, "every record is in the OS already"
    state.sync()
    assert fsyncs.calls == before + 1 and state.unsynced == 0
    state.sync()
    assert fsyncs.calls == before + 1, "nothing to sync: no fsync"
    state.record(3, 11)
    state.reset()  # rare records are synced at once, and cover the ones before
    assert state.unsynced == 0 and fsyncs.calls == before + 2


def test_without_group_commit_every_record_is_fsynced(
    tmp_path: Path, fsyncs: Fsyncs, opened: list[SessionState]
) -> None:
    state = DiskState(tmp_path, "c1")
    opened.append(state)
    before = fsyncs.calls
    state.record(3, 1)
    state.record_stream("s/a", 1)
    assert fsyncs.calls == before + 2 and state.unsynced == 0


def test_compaction_syncs_the_group(tmp_path: Path, opened: list[SessionState]) -> None:
    state = DiskState(tmp_path, "c1", group_commit=True, compact_after=3)
    opened.append(state)
    state.record(1, 1)
    state.record(1, 2)
    assert state.unsynced == 2
    state.record(1, 3)  # compaction: the snapshot (fsynced) holds every mark
    assert state.unsynced == 0


def test_unsynced_records_survive_a_sigkill(tmp_path: Path, opened: list[SessionState]) -> None:
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        sys.path.insert(0, {SDK_PATH!r})
        from durable_client.persistence import DiskState
        state = DiskState({str(tmp_path)!r}, "killed", group_commit=True)
        for seq in range(1, 51):
            state.record(3, seq)
        state.record_stream("s/x", 12)
        assert state.unsynced == 51
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], timeout=60, check=False)
    assert result.returncode == -9
    state = DiskState(tmp_path, "killed")
    opened.append(state)
    assert (state.epoch, state.get_mark(3), state.positions()) == (3, 50, {"s/x": 12})


def test_close_syncs_what_is_pending(tmp_path: Path, fsyncs: Fsyncs) -> None:
    state = DiskState(tmp_path, "c1", group_commit=True)
    state.record(2, 9)
    before = fsyncs.calls
    state.close()
    assert fsyncs.calls == before + 1


# ------------------------------------------------------------------ gate
def test_acks_wait_for_the_sync_that_covers_their_marks(
    fallback: tuple[SessionState, list[OSError]], fsyncs: Fsyncs
) -> None:
    state, _ = fallback
    clock = Clock()
    gate, sent = gate_for(state, clock, batch=4)
    gate.submit(1, 1, None)  # nothing unsynced: a duplicate's ack goes at once
    assert sent == [1] and not gate.pending
    for seq, mid in ((1, 2), (2, 3), (3, 4)):
        state.record(5, seq)
        gate.submit(mid, 1, None)
    assert sent == [1] and gate.held == 3 and gate.pending
    before = fsyncs.calls
    state.record(5, 4)
    gate.submit(5, 1, ("s/a", 4))  # the 4th held ack: the batch is full
    assert fsyncs.calls == before + 1, "one fsync for the group"
    assert sent == [1, 2, 3, 4, 5] and not gate.pending and gate.groups == 1


def test_a_quiet_connection_or_the_delay_ends_a_group(fallback: tuple[SessionState, list[OSError]]) -> None:
    state, _ = fallback
    clock = Clock()
    gate, sent = gate_for(state, clock, batch=100, delay_ms=5.0)
    assert not gate.due(idle=True), "nothing pending"
    state.record(5, 1)
    gate.submit(1, 1, None)
    assert not gate.due(idle=False), "messages keep coming and the delay has not passed"
    clock.now += 0.004
    state.record(5, 2)
    gate.submit(2, 1, None)
    assert not gate.due(idle=False)
    clock.now += 0.0011  # 5.1 ms after the first held ack
    assert gate.due(idle=False)
    gate.flush()
    assert sent == [1, 2]
    state.record(5, 3)
    gate.submit(3, 1, None)
    assert gate.due(idle=True), "nothing more to read: the group ends at once"
    state.record_stream("s/b", 1)  # written without an ack to hold (subscribe_stream's 'after')
    gate.flush()
    assert sent == [1, 2, 3]
    state.record_stream("s/b", 2)
    assert gate.pending and gate.due(idle=True) and not gate.due(idle=False)


def test_a_lost_connection_drops_the_held_acks(fallback: tuple[SessionState, list[OSError]]) -> None:
    state, _ = fallback
    gate, sent = gate_for(state, Clock())
    state.record(5, 1)
    gate.submit(1, 1, None)
    state.record(5, 2)
    gate.submit(2, 1, None)
    assert gate.drop() == 2
    gate.flush()
    assert sent == [] and not gate.pending
    assert state.get_mark(5) == 2, "the marks stay: the events sent again are duplicates"


def test_an_fsync_error_falls_back_to_memory_then_sends_the_held_acks(
    fallback: tuple[SessionState, list[OSError]], fsyncs: Fsyncs
) -> None:
    state, seen = fallback
    gate, sent = gate_for(state, Clock(), batch=3)
    state.record(5, 1)
    gate.submit(1, 1, None)
    gate.flush()
    state.record(5, 2)
    gate.submit(2, 1, None)
    state.record(5, 3)
    gate.submit(3, 1, None)
    fsyncs.fail = True
    sends_before_the_failed_fsync: list[int] = []
    calls = fsyncs.calls

    def observed_send(mid: int, qos: int, stream_ack: tuple[str, int] | None) -> None:
        assert fsyncs.calls == calls + 1, "an ack of the failed group went before its fsync was tried"
        assert state.level == "memory", "an ack of the failed group went as if it were on disk"
        sends_before_the_failed_fsync.append(mid)

    gate._send = observed_send
    state.record(5, 4)
    gate.submit(4, 1, None)  # the batch is full: the fsync fails
    assert state.level == "memory" and len(seen) == 1 and seen[0].errno == errno.EIO
    assert (state.epoch, state.get_mark(5)) == (5, 4), "CPL-1 keeps every mark written, synced or not"
    assert sends_before_the_failed_fsync == [2, 3, 4], "then acknowledged under CPL-1's rule, in order"
    assert sent == [1]
    state.record(5, 5)
    assert not gate.pending, "CPL-1: nothing to hold from now on"


# --------------------------------------------------------------- options
def test_default_options_are_valid() -> None:
    assert check_group_options(DEFAULT_FSYNC_BATCH, DEFAULT_FSYNC_DELAY_MS) == (64, 5.0)
    assert check_group_options(1, 0) == (1, 0.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"fsync_batch": 0}, "fsync_batch must be a whole number of events from 1 to 65535"),
        ({"fsync_batch": 70_000}, "fsync_batch"),
        ({"fsync_batch": 2.5}, "fsync_batch"),
        ({"fsync_batch": True}, "fsync_batch"),
        ({"fsync_batch": "64"}, "fsync_batch"),
        ({"fsync_delay_ms": -1}, "fsync_delay_ms must be a finite number of milliseconds, at least 0 and at most 1000"),
        ({"fsync_delay_ms": 1000.5}, "fsync_delay_ms"),
        ({"fsync_delay_ms": float("nan")}, "fsync_delay_ms"),
        ({"fsync_delay_ms": "5"}, "fsync_delay_ms"),
        ({"fsync_delay_ms": None}, "fsync_delay_ms"),
    ],
)
def test_the_client_rejects_bad_group_options(kwargs: dict[str, object], match: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=match):
        DurableClient("c1", persistence="disk", state_dir=tmp_path, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=match):
        DurableClient("c1", **kwargs)  # type: ignore[arg-type] # checked with CPL-1 too: a typo fails early
    assert not list(tmp_path.iterdir()), "nothing was opened"
