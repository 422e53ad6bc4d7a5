"""Child processes a tool SIGKILLs and starts again, and the ports they listen on: the broker
(``amqtt-durable broker`` on the same port and store) for the fleet harness, the pipeline demo,
the benchmarks and the tests, the fleet's worker processes, and a one-member etcd (the
coordinator of a replicated pair) for the fleet's HA runs and the tests.

Only processes started here are ever signalled, by their own PID; every wait has a deadline.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Self

import yaml

from .cli import PLUGIN_PATH, plugin_entries

HOST = "127.0.0.1"
POLL = 0.05
"""Seconds between two readiness checks of a child that is starting."""
log = logging.getLogger(__name__)


PORT_SLICE_ENV = "AMQTT_DURABLE_PORT_SLICE"
"""``i/n`` (0 <= i < n) in the environment: ``free_port`` hands out only ports with
``port // 2 % n == i``, so ``n`` processes that start children side by side, each with its own
``i`` (the test suite's pytest-xdist workers: tests/conftest.py), never hand out the same port;
a port one of them is about to bind (or bind again, a broker restarting) stays its own."""
PORT_TRIES = 200
"""Ports ``free_port`` asks the kernel for before giving up on finding one in its slice."""


def port_slice() -> tuple[int, int] | None:
    """``(i, n)`` from ``AMQTT_DURABLE_PORT_SLICE``; None when it is not set; ValueError naming it when malformed."""
    value = os.environ.get(PORT_SLICE_ENV)
    if not value:
        return None
    index, _, count = value.partition("/")
    if not (index.isdigit() and count.isdigit() and int(index) < int(count)):
        raise ValueError(f"{PORT_SLICE_ENV}={value!r}: expected i/n with 0 <= i < n")
    return int(index), int(count)


def free_port() -> int:
    """An ephemeral TCP port on 127.0.0.1 that was free a moment ago (in this process's slice of
    the ports when ``AMQTT_DURABLE_PORT_SLICE`` is set)."""
    wanted = port_slice()
    for _ in range(PORT_TRIES):
        with socket.socket() as sock:
            sock.bind((HOST, 0))
            port = int(sock.getsockname()[1])
        if wanted is None or port // 2 % wanted[1] == wanted[0]:
            return port
    raise RuntimeError(f"no free port in slice {wanted} of {PORT_SLICE_ENV} after {PORT_TRIES} tries")


def port_open(port: int) -> bool:
    """Whether 127.0.0.1:``port`` accepts a TCP connection now."""
    try:
        socket.create_connection((HOST, port), timeout=1).close()
    except OSError:
        return False
    return True


def local_config(config: Mapping[str, Any], port: int, **plugin_settings: Any) -> dict[str, Any]:
    """``config`` with one TCP listener on 127.0.0.1:``port`` and ``plugin_settings`` over ours.

    Plugins given as a list come back as a mapping; every other key and every other plugin
    setting is kept, so a run exercises the user's own limits and policies.
    """
    entries = plugin_entries(config)
    entries[PLUGIN_PATH] = {**(entries.get(PLUGIN_PATH) or {}), **plugin_settings}
    return {**config, "listeners": {"default": {"type": "tcp", "bind": f"{HOST}:{port}"}}, "plugins": entries}


class ChildExitedError(RuntimeError):
    """The child ended while we waited for it to become ready: its log says why."""


class ChildProcess:
    """One command, started again after each kill; output appended to ``log_path``.

    ``stop`` is ``stop_signal`` (SIGTERM) then, after ``wait`` seconds, SIGKILL; nothing here
    raises for a child that is slow to die, so a caller's clean-up always reaches its other children.
    ``env`` (None: ours) and ``preexec_fn`` are passed to the child as ``subprocess.Popen`` does.
    """

    stop_signal = signal.SIGTERM

    def __init__(self, argv: Sequence[str], log_path: Path, *, wait: float = 15.0,
                 env: Mapping[str, str] | None = None, preexec_fn: Callable[[], None] | None = None) -> None:
        self.argv = list(argv)
        self.log_path = log_path
        self.wait = wait
        self.env = env
        self.preexec_fn = preexec_fn
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

    def start(self) -> Self:
        if self.running:
            raise RuntimeError(f"{self.argv[2:]} is running already (pid {self.pid})")
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         env=self.env, preexec_fn=self.preexec_fn)  # noqa: PLW1509 - no locks taken
        return self

    def wait_until(self, ready: Callable[[], bool], timeout: float, *, poll: float = POLL) -> bool:
        """Check ``ready`` every ``poll`` seconds until it holds (True) or ``timeout`` passes (False).

        ChildExitedError, naming the exit status and the log, if the child ends first.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.running:
                raise ChildExitedError(f"{self.argv[2:]} exited with status {self.exit_status}; see {self.log_path}")
            if ready():
                return True
            time.sleep(min(poll, max(0.0, deadline - time.monotonic())))  # not ready yet; bounded by the deadline
        return False

    def await_ready(self, name: str, ready: Callable[[], bool], timeout: float, waiting_for: str) -> Self:
        """Return once the started child is ``ready``; else stop it and raise.

        ChildExitedError if the child ends first; RuntimeError if ``ready`` does not hold
        within ``timeout`` seconds. Both name ``name``, what was awaited and the log.
        """
        try:
            became_ready = self.wait_until(ready, timeout)
        except ChildExitedError as exc:
            raise ChildExitedError(f"{name} exited with status {self.exit_status}; see {self.log_path}") from exc
        if not became_ready:
            self.stop()
            raise RuntimeError(f"{name} did not {waiting_for} within {timeout:g} s; see {self.log_path}")
        return self

    def kill(self) -> None:
        """SIGKILL: no shutdown, no flush; what the child wrote to disk is what survives."""
        if self.proc is not None and self.running:
            os.kill(self.proc.pid, signal.SIGKILL)
            self._reap(self.wait)

    def terminate(self) -> None:
        """``stop_signal`` without waiting: ``wait_stopped`` waits (many children stop in parallel)."""
        if self.proc is not None and self.running:
            os.kill(self.proc.pid, self.stop_signal)

    def wait_stopped(self, deadline: float) -> bool:
        """Wait until ``deadline`` (time.monotonic) for the child to end, else SIGKILL it (False)."""
        if self.proc is not None and not self._reap(max(0.0, deadline - time.monotonic())):
            log.warning("%s did not stop in time; killed", self.log_path.stem)
            self.kill()
            return False
        return True

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
    """One broker configuration, written to ``folder/broker.yaml`` at each start; output in ``folder/broker.log``.

    ``config`` may change between two starts (a test adding a plugin); the port and the store
    stay, so ``restart`` brings the same broker back. The broker stops by itself when the process
    that started it is gone (--parent-pid), so a tool killed without cleaning up leaves no broker behind.
    """

    def __init__(self, config: Mapping[str, Any], folder: Path, port: int, *, wait: float = 60.0,
                 env: Mapping[str, str] | None = None) -> None:
        self.port = port
        self.config: dict[str, Any] = dict(config)
        self.config_path = folder / "broker.yaml"
        argv = [sys.executable, "-m", "amqtt_durable.cli", "broker", "-c", str(self.config_path)]
        super().__init__([*argv, "--parent-pid", str(os.getpid())], folder / "broker.log", wait=wait, env=env)

    def write_config(self) -> Path:
        self.config_path.write_text(yaml.safe_dump(self.config), encoding="utf-8")
        return self.config_path

    def spawn(self) -> subprocess.Popen[bytes]:
        """Write the configuration and start the broker, without waiting for it."""
        self.write_config()
        super().start()
        assert self.proc is not None
        return self.proc

    def ready(self) -> bool:
        """Ready = the port takes connections; a subclass may ask more (a CONNACK)."""
        return port_open(self.port)

    def start(self) -> Self:
        """Start and return once ready; RuntimeError naming the log if not within ``wait`` seconds."""
        self.spawn()
        return self.await_ready("the broker", self.ready, self.wait, f"open {HOST}:{self.port}")

    def restart(self, kill: bool = True) -> Self:
        """SIGKILL (or stop, with ``kill`` False) and start again on the same port and store."""
        self.kill() if kill else self.stop()
        return self.start()


class EtcdProcess(ChildProcess):
    """One etcd member (Debian's ``etcd`` binary from etcd-server) on two free 127.0.0.1 ports,
    its data in ``folder/data``, its output in ``folder/etcd.log``. Short heartbeat and election
    timeouts: it elects itself in a fraction of a second, and its shortest lease is about a second.

    ``start`` returns once the member answers a read through its v3 JSON gateway; RuntimeError
    (naming the remedy or the log) when the binary is missing or the member never gets ready.
    """

    ready_wait = 20.0

    def __init__(self, folder: Path, *, binary: str | None = None) -> None:
        found = binary or shutil.which("etcd")
        if found is None:
            raise RuntimeError("etcd is not installed: run 'make setup' (apt-get install etcd-server)")
        self.client_port, self.peer_port = free_port(), free_port()
        self.url = f"http://{HOST}:{self.client_port}"
        peer = f"http://{HOST}:{self.peer_port}"
        folder.mkdir(parents=True, exist_ok=True)
        super().__init__(
            [
                found,
                "--name", "amqtt-durable",
                "--data-dir", str(folder / "data"),
                "--listen-client-urls", self.url,
                "--advertise-client-urls", self.url,
                "--listen-peer-urls", peer,
                "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"amqtt-durable={peer}",
                "--heartbeat-interval", "50",
                "--election-timeout", "500",
            ],
            folder / "etcd.log",
            wait=10.0,
        )  # fmt: skip

    def ready(self) -> bool:
        """The member answers a read through the v3 gateway (it has a leader)."""
        request = urllib.request.Request(f"{self.url}/v3/kv/range", data=json.dumps({"key": "eA=="}).encode())
        try:
            with urllib.request.urlopen(request, timeout=1) as reply:
                return bool(reply.status == 200)
        except OSError:
            return False

    def start(self) -> Self:
        super().start()
        return self.await_ready("etcd", self.ready, self.ready_wait, "become ready")
