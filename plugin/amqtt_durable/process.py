"""``amqtt-durable broker`` as a child process: for tools that must SIGKILL and restart a real
broker on the same port and store (the fleet harness, the pipeline demo)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from .cli import PLUGIN_PATH

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def local_config(config: Mapping[str, Any], port: int, **plugin_settings: Any) -> dict[str, Any]:
    """``config`` with one TCP listener on 127.0.0.1:``port`` and ``plugin_settings`` over ours.

    Plugins given as a list (amqtt accepts both) come back as a mapping; every other key and
    every other plugin setting is kept, so a run exercises the user's own limits and policies.
    """
    plugins = config.get("plugins")
    entries: dict[str, Any] = dict(plugins) if isinstance(plugins, Mapping) else {}
    if isinstance(plugins, list):
        for item in plugins:
            entries.update(item if isinstance(item, Mapping) else {item: None})
    entries[PLUGIN_PATH] = {**(entries.get(PLUGIN_PATH) or {}), **plugin_settings}
    return {**config, "listeners": {"default": {"type": "tcp", "bind": f"{HOST}:{port}"}}, "plugins": entries}


class BrokerProcess:
    """One broker configuration, run as ``python -m amqtt_durable.cli broker``; its output goes
    to ``folder/broker.log`` (appended across restarts)."""

    def __init__(self, config: Mapping[str, Any], folder: Path, port: int, *, wait: float = 60.0) -> None:
        self.port = port
        self.folder = folder
        self.wait = wait
        self.config_path = folder / "broker.yaml"
        self.log_path = folder / "broker.log"
        self.config_path.write_text(yaml.safe_dump(dict(config)), encoding="utf-8")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def start(self) -> None:
        """Start and return once the port takes connections; RuntimeError naming the log if not."""
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "amqtt_durable.cli", "broker", "-c", str(self.config_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + self.wait
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the broker exited with status {self.proc.returncode}; see {self.log_path}")
            try:
                socket.create_connection((HOST, self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.05)  # the port is not open yet; bounded by the deadline
        self.stop()
        raise RuntimeError(f"the broker did not open {HOST}:{self.port} within {self.wait} s; see {self.log_path}")

    def kill(self) -> None:
        """SIGKILL: no shutdown, no flush; what the store holds is what survives."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(self.wait)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(self.wait)
        except subprocess.TimeoutExpired:
            self.kill()
