"""durable_client.delivery_log.reconcile: with CPL-2, a delivery log's receive records count as
processed, closing the window between a record and its mark (real files in tmp_path)."""

from __future__ import annotations

import errno
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from durable_client import DurableClient
from durable_client.delivery_log import DeliveryLog, Processed, last_processed, reconcile
from durable_client.events import Event
from durable_client.persistence import DiskState, MemoryState, SessionState, open_state

EPOCH = 3
DEVICE = "dev-1"


def disk(tmp_path: Path, opened: list[SessionState], client_id: str = DEVICE) -> DiskState:
    state = DiskState(tmp_path / "state", client_id)
    opened.append(state)
    return state


def event(seq: int, epoch: int = EPOCH, topic: str = "work", stream: bool = False) -> Event:
    return Event(topic, f"p{seq}".encode(), 1, seq, epoch, 1.0, False, False, False, stream)


def write_log(path: Path, events: list[Event], device: str = DEVICE) -> None:
    """Receive records as the SDK writes them (appended: several calls share one file)."""
    writer = DeliveryLog(path, device)
    for item in events:
        writer.receive(item)
    writer.close()


def stream(topic: str, event_id: int) -> Event:
    return event(event_id, epoch=0, topic=topic, stream=True)


# ------------------------------------------------------------------ session mark
def test_a_receive_beyond_the_mark_advances_it_on_disk(
    tmp_path: Path, opened: list[SessionState], caplog: pytest.LogCaptureFixture
) -> None:
    state = disk(tmp_path, opened)
    state.record(EPOCH, 10)
    log = tmp_path / "device.jsonl"
    write_log(log, [event(9), event(10), event(11)])  # killed after 11's record, before its mark
    with caplog.at_level(logging.INFO, logger="durable_client"):
        reconcile(state, log, DEVICE)
    assert state.get_mark(EPOCH) == 11
    assert f"epoch {EPOCH} seq 11 processed; mark advanced" in caplog.text
    state.close()
    assert disk(tmp_path, opened).get_mark(EPOCH) == 11, "journalled like any mark"


@pytest.mark.parametrize("last", [10, 7])
def test_a_receive_at_or_below_the_mark_changes_nothing(
    last: int, tmp_path: Path, opened: list[SessionState], caplog: pytest.LogCaptureFixture
) -> None:
    state = disk(tmp_path, opened)
    state.record(EPOCH, 10)
    log = tmp_path / "device.jsonl"
    write_log(log, [event(seq) for seq in range(1, last + 1)])
    with caplog.at_level(logging.INFO, logger="durable_client"):
        reconcile(state, log, DEVICE)
    assert (state.epoch, state.get_mark(EPOCH)) == (EPOCH, 10)
    assert caplog.text == ""


@pytest.mark.parametrize("epoch", [EPOCH - 1, EPOCH + 1])
def test_receives_of_another_epoch_move_nothing(epoch: int, tmp_path: Path, opened: list[SessionState]) -> None:
    state = disk(tmp_path, opened)
    state.record(EPOCH, 10)
    log = tmp_path / "device.jsonl"
    write_log(log, [event(9), event(50, epoch=epoch)])
    reconcile(state, log, DEVICE)
    assert (state.epoch, state.get_mark(EPOCH), state.get_mark(epoch)) == (EPOCH, 10, 0)


def test_without_a_session_epoch_nothing_moves(tmp_path: Path, opened: list[SessionState]) -> None:
    """After end_session (reset) the log's receives belong to a session that is gone."""
    state = disk(tmp_path, opened)
    state.record(EPOCH, 10)
    state.reset()
    log = tmp_path / "device.jsonl"
    write_log(log, [event(11)])
    reconcile(state, log, DEVICE)
    assert state.epoch is None and state.get_mark(EPOCH) == 0


def test_a_torn_last_line_is_ignored(tmp_path: Path, opened: list[SessionState]) -> None:
    state = disk(tmp_path, opened)
    state.record(EPOCH, 10)
    log = tmp_path / "device.jsonl"
    write_log(log, [event(10), event(11)])
    whole = json.dumps({"kind": "receive", "device": DEVICE, "topic": "work", "id": "x", "seq": 12, "epoch": EPOCH})
    with log.open("a") as sink:
        sink.write(whole[:-9])  # cut short by a crash
    reconcile(state, log, DEVICE)
    assert state.get_mark(EPOCH) == 11
    with log.open("a") as sink:
        sink.write(whole[-9:])  # a whole record without its newline is still a torn write
    reconcile(state, log, DEVICE)
    assert state.get_mark(EPOCH) == 11


def test_raw_events_and_other_lines_are_ignored(tmp_path: Path, opened: list[SessionState]) -> None:
    state = disk(tmp_path, opened)
    state.record(EPOCH, 10)
    log = tmp_path / "device.jsonl"
    write_log(log, [event(11)])
    with log.open("a") as sink:
        sink.write("not json\n[1, 2]\n" + "[" * 5000 + "\n")  # nested past the recursion limit: RecursionError
        sink.write(json.dumps({"kind": "receive", "device": DEVICE, "topic": "work", "seq": True, "epoch": EPOCH}))
        sink.write("\n" + json.dumps({"kind": "send", "device": DEVICE, "topic": "work", "seq": 99}) + "\n")
    write_log(log, [event(0, epoch=0)])  # a raw event: no seq, no epoch
    reconcile(state, log, DEVICE)
    assert state.get_mark(EPOCH) == 11


def test_the_records_of_other_devices_in_a_shared_log_are_ignored(tmp_path: Path, opened: list[SessionState]) -> None:
    state = disk(tmp_path, opened)
    state.record(EPOCH, 10)
    log = tmp_path / "shared.jsonl"
    write_log(log, [event(10)])
    write_log(log, [event(11), event(12), stream("work", 40)], device="dev-2")  # same epoch, topic: another device
    reconcile(state, log, DEVICE)
    assert (state.get_mark(EPOCH), state.positions()) == (10, {})
    write_log(log, [event(11)])
    write_log(log, [event(13)], device="dev-2")
    reconcile(state, log, DEVICE)
    assert state.get_mark(EPOCH) == 11, "this device's record behind another device's lines still counts"


# ------------------------------------------------------------------ stream positions
def test_the_last_stream_receive_advances_its_topic_position(
    tmp_path: Path, opened: list[SessionState], caplog: pytest.LogCaptureFixture
) -> None:
    state = disk(tmp_path, opened)
    state.record_stream("log/a", 4)
    state.record_stream("log/b", 6)
    log = tmp_path / "device.jsonl"
    write_log(log, [stream("log/a", 4), stream("log/b", 6), stream("log/b", 7)])
    with caplog.at_level(logging.INFO, logger="durable_client"):
        reconcile(state, log, DEVICE)
    assert state.positions() == {"log/a": 4, "log/b": 7}
    assert "stream log/b id 7 processed; position advanced" in caplog.text
    state.close()
    assert disk(tmp_path, opened).positions() == {"log/a": 4, "log/b": 7}


def test_a_stream_position_moved_back_on_purpose_stays(tmp_path: Path, opened: list[SessionState]) -> None:
    """Only the device's very last receive can be unmarked; older ones may predate subscribe_stream(after=)."""
    state = disk(tmp_path, opened)
    state.record(EPOCH, 5)
    log = tmp_path / "device.jsonl"
    write_log(log, [stream("log/a", 100), event(5), stream("log/b", 7), event(0, epoch=0)])
    state.record_stream("log/a", 3)  # after={"log/a": 3}: read it again from id 4
    state.record_stream("log/b", 7)
    reconcile(state, log, DEVICE)
    assert state.positions() == {"log/a": 3, "log/b": 7}
    write_log(log, [stream("log/a", 4)])  # killed after this record, before its mark
    reconcile(state, log, DEVICE)
    assert state.positions() == {"log/a": 4, "log/b": 7}
    assert state.get_mark(EPOCH) == 5


def test_session_and_stream_marks_move_together(tmp_path: Path, opened: list[SessionState]) -> None:
    state = disk(tmp_path, opened)
    state.record(EPOCH, 10)
    log = tmp_path / "device.jsonl"
    write_log(log, [event(11), stream("log/a", 2)])  # 11's mark lost too (a fallback to memory, then a restart)
    reconcile(state, log, DEVICE)
    assert (state.get_mark(EPOCH), state.positions()) == (11, {"log/a": 2})


# ------------------------------------------------------------------ unreadable logs, levels
def test_a_missing_log_changes_nothing_and_warns_when_marks_were_kept(
    tmp_path: Path, opened: list[SessionState], caplog: pytest.LogCaptureFixture
) -> None:
    state = disk(tmp_path, opened)
    with caplog.at_level(logging.INFO, logger="durable_client"):
        reconcile(state, tmp_path / "missing.jsonl", DEVICE)
    assert caplog.text == "", "a first start has nothing to check"
    state.record(EPOCH, 10)
    with caplog.at_level(logging.INFO, logger="durable_client"):
        reconcile(state, tmp_path / "missing.jsonl", DEVICE)
    assert state.get_mark(EPOCH) == 10
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "does not exist" in caplog.text


def test_an_unreadable_log_changes_nothing_and_warns(
    tmp_path: Path, opened: list[SessionState], caplog: pytest.LogCaptureFixture
) -> None:
    state = disk(tmp_path, opened)
    state.record(EPOCH, 10)
    folder = tmp_path / "a-folder.jsonl"
    folder.mkdir()
    with caplog.at_level(logging.INFO, logger="durable_client"):
        reconcile(state, folder, DEVICE)
    assert state.get_mark(EPOCH) == 10
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "cannot read the delivery log" in caplog.text


def test_memory_state_is_left_alone(tmp_path: Path) -> None:
    """CPL-1 forgets its marks with the process: nothing to reconcile (and nothing written)."""
    state = MemoryState(EPOCH, 10)
    log = tmp_path / "device.jsonl"
    write_log(log, [event(11), stream("log/a", 2)])
    reconcile(state, log, DEVICE)
    assert (state.get_mark(EPOCH), state.positions()) == (10, {})


def test_the_fallback_state_of_open_state_is_reconciled(tmp_path: Path, opened: list[SessionState]) -> None:
    state = open_state("disk", DEVICE, tmp_path / "state", lambda exc: None)
    opened.append(state)
    state.record(EPOCH, 10)
    log = tmp_path / "device.jsonl"
    write_log(log, [event(11)])
    reconcile(state, log, DEVICE)
    assert (state.level, state.get_mark(EPOCH)) == ("disk", 11)


def test_a_client_reconciles_when_it_is_created(tmp_path: Path, opened: list[SessionState]) -> None:
    state = disk(tmp_path, opened)
    state.record(EPOCH, 10)
    state.close()
    log = tmp_path / "device.jsonl"
    write_log(log, [event(11)])
    client = DurableClient(DEVICE, persistence="disk", state_dir=tmp_path / "state", delivery_log=log)
    client.close()
    assert disk(tmp_path, opened).get_mark(EPOCH) == 11


# ------------------------------------------------------------------ reading the tail
def test_the_tail_is_read_from_its_first_whole_line_at_any_size(tmp_path: Path) -> None:
    log = tmp_path / "device.jsonl"
    write_log(log, [event(seq) for seq in range(1, 6)] + [stream("log/é", 9)])
    data = log.read_bytes()
    ends = [i + 1 for i, byte in enumerate(data) if byte == ord("\n")]
    for tail in range(1, len(data) + 2):
        whole = [end for end in [0, *ends] if len(data) - end <= tail]  # lines starting inside the tail
        first = whole[0] if whole else len(data)
        lines = data[first:].splitlines()
        expected = Processed()
        if lines:
            expected.stream = ("log/é", 9)
            if len(lines) > 1:
                expected.sessions = {EPOCH: 5}
        got = last_processed(log, DEVICE, tail=tail)
        assert (got.sessions, got.stream) == (expected.sessions, expected.stream), f"tail of {tail} bytes"


def test_a_client_whose_log_cannot_get_its_newline_is_not_created(tmp_path: Path) -> None:
    """delivery-log.md: the constructor ends a cut-short last line; when that write fails (a full
    disk: here the process's file size limit, EFBIG) creating the DurableClient raises OSError."""
    path = tmp_path / "log.jsonl"
    path.write_bytes(b'{"kind": "send", "cut')
    script = (
        "import resource, signal, sys\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        f"resource.setrlimit(resource.RLIMIT_FSIZE, ({path.stat().st_size}, resource.RLIM_INFINITY))\n"
        "from durable_client import DurableClient\n"
        "try:\n"
        f"    DurableClient('c1', '127.0.0.1', 1, delivery_log={str(path)!r})\n"
        "except OSError as exc:\n"
        "    print('OSError', exc.errno)\n"
        "    sys.exit(0)\n"
        "print('created')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert done.stdout.split() == ["OSError", str(errno.EFBIG)], (done.stdout, done.stderr)
    assert path.read_bytes() == b'{"kind": "send", "cut'
