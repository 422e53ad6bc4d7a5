"""Child processes a tool SIGKILLs and starts again: the broker (``amqtt-durable broker`` on the
same port and store; the fleet harness, the pipeline demo) and the fleet's worker processes."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from .cli import PLUGIN_PATH, plugin_entries

HOST = "127.0.0.1"
log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def local_config(config: Mapping[str, Any], port: int, **plugin_settings: Any) -> dict[str, Any]:
    """``config`` with one TCP listener on 127.0.0.1:``port`` and ``plugin_settings`` over ours.

    Plugins given as a list come back as a mapping; every other key and every other plugin
    setting is kept, so a run exercises the user's own limits and policies.
    """
    entries = plugin_entries(config)
    entries[PLUGIN_PATH] = {**(entries.get(PLUGIN_PATH) or {}), **plugin_settings}
    return {**config, "listeners": {"default": {"type": "tcp", "bind": f"{HOST}:{port}"}}, "plugins": entries}


class ChildProcess:
    """One command, started again after each kill; output appended to ``log_path``.

    ``stop`` is SIGTERM then, after ``wait`` seconds, SIGKILL; nothing here raises for a child
    that is slow to die, so a caller's clean-up always reaches its other children.
    """

    def __init__(self, argv: Sequence[str], log_path: Path, *, wait: float = 15.0) -> None:
        self.argv = list(argv)
        self.log_path = log_path
        self.wait = wait
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.running else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def exit_status(self) -> int | None:
        """The status of a child that ended by itself or was stopped; None while it runs."""
        return None if self.proc is None else self.proc.poll()

    def start(self) -> None:
        if self.running:
            raise RuntimeError(f"{self.argv[2:]} is running already (pid {self.pid})")
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT)

    def kill(self) -> None:
        """SIGKILL: no shutdown, no flush; what the child wrote to disk is what survives."""
        if self.proc is not None and self.running:
            os.kill(self.proc.pid, signal.SIGKILL)
            self._reap(self.wait)

    def terminate(self) -> None:
        """SIGTERM without waiting: ``wait_stopped`` waits (many children stop in parallel)."""
        if self.proc is not None and self.running:
            os.kill(self.proc.pid, signal.SIGTERM)

    def wait_stopped(self, deadline: float) -> None:
        """Wait until ``deadline`` (time.monotonic) for the child to end, then SIGKILL it."""
        if self.proc is not None and not self._reap(max(0.0, deadline - time.monotonic())):
            log.warning("%s did not stop in time; killed", self.log_path.stem)
            self.kill()

    def stop(self) -> None:
        self.terminate()
        self.wait_stopped(time.monotonic() + self.wait)

    def _reap(self, timeout: float) -> bool:
        assert self.proc is not None
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True


class BrokerProcess(ChildProcess):
    """One broker configuration, written to ``folder/broker.yaml``; output in ``folder/broker.log``.

    The broker stops by itself when the process that started it is gone (--parent-pid), so a
    tool killed without cleaning up leaves no broker behind.
    """

    def __init__(self, config: Mapping[str, Any], folder: Path, port: int, *, wait: float = 60.0) -> None:
        self.port = port
        self.config_path = folder / "broker.yaml"
        self.config_path.write_text(yaml.safe_dump(dict(config)), encoding="utf-8")
        argv = [sys.executable, "-m", "amqtt_durable.cli", "broker", "-c", str(self.config_path)]
        super().__init__([*argv, "--parent-pid", str(os.getpid())], folder / "broker.log", wait=wait)

    def start(self) -> None:
        """Start and return once the port takes connections; RuntimeError naming the log if not."""
        super().start()
        deadline = time.monotonic() + self.wait
        while time.monotonic() < deadline:
            if not self.running:
                raise RuntimeError(f"the broker exited with status {self.exit_status}; see {self.log_path}")
            try:
                socket.create_connection((HOST, self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.05)  # the port is not open yet; bounded by the deadline
        self.stop()
        raise RuntimeError(f"the broker did not open {HOST}:{self.port} within {self.wait} s; see {self.log_path}")
