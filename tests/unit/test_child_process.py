"""ChildProcess.await_ready: the two ways a child fails to come up, with real child processes;
free_port's slices of the ports (parallel test workers)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from amqtt_durable.process import PORT_SLICE_ENV, ChildExitedError, ChildProcess, free_port

pytestmark = pytest.mark.timeout(30)


def python_child(tmp_path: Path, code: str) -> ChildProcess:
    return ChildProcess([sys.executable, "-c", code], tmp_path / "child.log", wait=5.0)


def test_a_child_that_exits_while_awaited_names_its_status_and_log(tmp_path: Path) -> None:
    child = python_child(tmp_path, "raise SystemExit(3)").start()
    with pytest.raises(ChildExitedError, match=r"the tool exited with status 3; see .*child\.log"):
        child.await_ready("the tool", lambda: False, timeout=20.0, waiting_for="answer")


def test_a_child_never_ready_is_stopped_and_the_error_says_what_was_awaited(tmp_path: Path) -> None:
    child = python_child(tmp_path, "import time; time.sleep(60)").start()
    with pytest.raises(RuntimeError, match=r"the tool did not answer within 0\.3 s; see .*child\.log"):
        child.await_ready("the tool", lambda: False, timeout=0.3, waiting_for="answer")
    assert not child.running


def test_a_ready_child_is_returned_running(tmp_path: Path) -> None:
    marker = tmp_path / "up"
    code = f"import pathlib, time; pathlib.Path({str(marker)!r}).touch(); time.sleep(60)"
    child = python_child(tmp_path, code).start()
    try:
        assert child.await_ready("the tool", marker.exists, timeout=20.0, waiting_for="answer") is child
        assert child.running
    finally:
        child.stop()


def test_free_port_hands_out_only_the_ports_of_its_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two processes with slices 0/2 and 1/2 (two pytest-xdist workers) never get the same port."""
    for index in (0, 1):
        monkeypatch.setenv(PORT_SLICE_ENV, f"{index}/2")
        ports = [free_port() for _ in range(30)]
        assert all(port // 2 % 2 == index for port in ports), ports
    for wrong in ("2/2", "1", "a/2", "-1/2"):
        monkeypatch.setenv(PORT_SLICE_ENV, wrong)
        with pytest.raises(ValueError, match=f"{PORT_SLICE_ENV}=.*expected i/n"):
            free_port()
