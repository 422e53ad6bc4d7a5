"""Shared by the tests that run ``amqtt-durable fleet`` in a process of its own and signal it: which processes
it started are still there."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from conftest import WAIT


def signal_fleet_when(tmp_path: Path, args: list[str], ready: Callable[[Path], bool], stop: int) -> None:
    """``amqtt-durable fleet ARGS`` with the shipped broker.yaml and ``--out tmp_path/out``; once ``ready(out)``
    (polled, bounded), signal ``stop`` to the harness, and check that no process it started outlived it."""
    (tmp_path / "broker.yaml").write_text((Path(__file__).parent.parent / "broker.yaml").read_text())
    out = tmp_path / "out"
    with (tmp_path / "harness.err").open("wb") as err:
        harness = subprocess.Popen(
            [sys.executable, "-m", "durable_fleet.console", "fleet", *args, "--out", str(out)],
            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=err, preexec_fn=as_from_a_terminal,  # noqa: PLW1509 - no lock taken
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 6 * WAIT
        while not ready(out) and harness.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)  # polling for the processes the harness spawns; bounded by the deadline
        assert ready(out), (tmp_path / "harness.err").read_text()
        harness.send_signal(stop)
        harness.wait(4 * WAIT)
    finally:
        if harness.poll() is None:
            harness.kill()
            harness.wait(WAIT)
        left = kill_left(out)  # also when the test failed: a broker it SIGSTOPped would stay for ever
    assert left == [], f"processes the harness started outlived it: {left}"


def as_from_a_terminal() -> None:
    """A preexec_fn: the harness gets Ctrl-C's SIGINT as one started from a terminal does. A test process may
    ignore SIGINT (a suite started in the background of a script, ``cmd &``, as CI runs may be: the shell
    ignores it in the whole tree), and a harness that inherits that ignoring keeps it, by design
    (test_child_process): its Ctrl-C tests then waited out their 60 s on every xdist worker that had not run a
    Spark test first (SparkContext installs a SIGINT handler, which the exec of a child resets to the
    default)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def kill_left(folder: Path) -> list[bytes]:
    """SIGKILL, by PID, every process whose command line names ``folder`` (the test's own orphans, which
    outlived the harness) and return their command lines."""
    left = processes_in(folder)
    named = [Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:120] for pid in left]
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return named


def processes_in(folder: Path) -> list[int]:
    """PIDs of the processes whose command line names ``folder`` (this test's own children only:
    the folder is this test's tmp folder)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if str(folder).encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
    return found
