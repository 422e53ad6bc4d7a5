"""Child processes a tool SIGKILLs and starts again, and the ports they listen on: the broker
(``amqtt-durable broker`` on the same port and store) for the fleet harness, the pipeline demo,
the benchmarks and the tests, the fleet's worker processes, and a one-member etcd (the
coordinator of a replicated pair) for the fleet's HA runs and the tests.

Only processes started here are ever signalled, by their own PID; every wait has a deadline.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Self

import yaml

from .cli import PLUGIN_PATH, plugin_entries

HOST = "127.0.0.1"
POLL = 0.05
"""Seconds between two readiness checks of a child that is starting."""
log = logging.getLogger(__name__)


PORT_SLICE_ENV = "AMQTT_DURABLE_PORT_SLICE"
"""``i/n`` (0 <= i < n) in the environment: ``free_port`` hands out only ports of the ``i``-th of
``n`` equal, disjoint blocks of its pool (``port_block``), so ``n`` processes that start children
side by side, each with its own ``i`` (the test suite's pytest-xdist workers: tests/conftest.py),
never hand out the same port; a port one of them is about to bind (or bind again, a broker
restarting) stays its own. Children inherit it, and draw from their parent's block."""
PORT_FLOOR = 10000
"""The lowest port ``free_port`` hands out: the ports below it are left to the services that
expect them (etcd's 2379, Spark's 4040, 8080, ...)."""
EPHEMERAL_FALLBACK = (32768, 65535)
"""The ephemeral range assumed where the kernel's cannot be read: Linux's default (32768-60999)
and IANA's (49152-65535, BSD, macOS, Windows) both lie in it."""
PR_SET_PDEATHSIG = 1
"""Linux's prctl option: the signal the kernel sends a process when the thread that started it ends."""
MIN_POOL = 1024
"""Fewer ports than this outside the ephemeral range, and ``port_pool`` gives up avoiding it."""


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's ephemeral port range, first and last (Linux: net.ipv4.ip_local_port_range), from
    which it picks the local port of every outgoing connection and of every bind to port 0;
    ``EPHEMERAL_FALLBACK`` when it cannot be read."""
    try:
        first, last = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return EPHEMERAL_FALLBACK
    return (first, last) if 0 < first <= last <= 65535 else EPHEMERAL_FALLBACK


def port_pool(ephemeral: tuple[int, int]) -> range:
    """The ports ``free_port`` draws from: those from ``PORT_FLOOR`` up to the ephemeral range, or,
    with fewer than ``MIN_POOL`` there, those above it. No outgoing connection and no bind to port
    0, of any process, is ever given one of them, so a port handed out stays free until a child
    binds it (unless someone binds it by number). Where the ephemeral range leaves no room on
    either side, all of ``PORT_FLOOR``-65535: then an outgoing connection may take a port handed
    out before its child binds it."""
    first, last = ephemeral
    below, above = range(PORT_FLOOR, first), range(max(PORT_FLOOR, last + 1), 65536)
    for pool in (below, above):
        if len(pool) >= MIN_POOL:
            return pool
    return range(PORT_FLOOR, 65536)


def port_slice() -> tuple[int, int] | None:
    """``(i, n)`` from ``AMQTT_DURABLE_PORT_SLICE``; None when it is not set; ValueError naming it when malformed."""
    value = os.environ.get(PORT_SLICE_ENV)
    if not value:
        return None
    index, _, count = value.partition("/")
    if not (index.isdigit() and count.isdigit() and int(index) < int(count)):
        raise ValueError(f"{PORT_SLICE_ENV}={value!r}: expected i/n with 0 <= i < n")
    return int(index), int(count)


def port_block(pool: range, part: tuple[int, int] | None) -> range:
    """Block ``i`` of the ``n`` equal, disjoint, consecutive blocks ``pool`` is cut into (``part``
    ``(i, n)``); all of ``pool`` for None. ValueError when a block would hold no port."""
    if part is None:
        return pool
    index, count = part
    block = pool[index * len(pool) // count : (index + 1) * len(pool) // count]
    if not block:
        raise ValueError(f"{PORT_SLICE_ENV}={index}/{count}: {len(pool)} ports cannot be cut into {count} blocks")
    return block


def bindable(port: int, host: str = HOST) -> bool:
    """Whether a plain socket can bind ``host``:``port`` now. Without SO_REUSEADDR, so a port any
    socket is bound to (listening or not) fails, and so does one a closed connection still holds in
    TIME_WAIT: a port that passes can be bound by any server, whether it sets SO_REUSEADDR (asyncio,
    amqtt, etcd) or not."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((host, port))
    except OSError:
        return False
    return True


class PortCursor:
    """Hands out the ports of ``block`` in turn, from ``start`` (an index into it), ``stride`` indexes
    apart, wrapping round at its end: ``stride`` shares no factor with the block's length, so a port
    comes back only after every other port of the block was handed out, and the port of a broker
    that stopped (and may start again) is not given to a new one. A port that is not ``bindable``
    is passed over (``free``: whether a port can be bound now); RuntimeError when none of the block
    is. Thread-safe."""

    def __init__(
        self, block: range, start: int = 0, stride: int = 1, free: Callable[[int, str], bool] | None = None
    ) -> None:
        if not block:
            raise ValueError("a PortCursor needs at least one port")
        if math.gcd(stride, len(block)) != 1:
            raise ValueError(f"a stride of {stride} would skip ports of a block of {len(block)}")
        self.block = block
        self._next = start % len(block)
        self._stride = stride % len(block) or 1
        self._lock = threading.Lock()
        self._free = bindable if free is None else free

    def take(self, host: str = HOST) -> int:
        with self._lock:
            for _ in range(len(self.block)):  # each port of the block at most once
                port = self.block[self._next]
                self._next = (self._next + self._stride) % len(self.block)
                if self._free(port, host):
                    return port
        raise RuntimeError(
            f"no free port on {host} among the {len(self.block)} ports {self.block[0]}-{self.block[-1]}:"
            " every one is bound or held by a connection in TIME_WAIT; stop what holds them, or give"
            f" this process a larger block ({PORT_SLICE_ENV})"
        )


def _random_stride(length: int) -> int:
    """A stride that visits every index of ``length`` before any again (no factor shared with it)."""
    first = random.randrange(length)
    return next(stride for stride in range(first, first + length) if math.gcd(stride, length) == 1)


_cursors: dict[range, PortCursor] = {}
_cursors_lock = threading.Lock()


def free_port(host: str = HOST) -> int:
    """A TCP port that ``host`` (127.0.0.1) can bind now, for a child process to listen on: from
    ``port_pool`` (outside the kernel's ephemeral range, so no outgoing connection takes it
    meanwhile), in this process's block of it (``AMQTT_DURABLE_PORT_SLICE``), handed out in turn by
    one ``PortCursor`` per block. The cursor starts at a random port of the block and steps a random
    stride, so two processes drawing from one block (a test and a child it started, or two test
    runs side by side) are unlikely to meet, and two that meet once part at the next port: with one
    stride for all, they went on side by side, each taking the port the other had just handed to a
    broker still starting (two runs of the suite at once: "Address already in use")."""
    block = port_block(port_pool(ephemeral_ports()), port_slice())
    with _cursors_lock:
        cursor = _cursors.get(block)
        if cursor is None:
            cursor = _cursors[block] = PortCursor(block, random.randrange(len(block)), _random_stride(len(block)))
    return cursor.take(host)


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


@contextlib.contextmanager
def _stop_signals_held() -> Iterator[None]:
    """SIGTERM and SIGINT noted, not acted on, for the block (the spawn of a child and the keeping
    of its handle on its ``ChildProcess``), then raised again, each distinct one in the order they
    came: a harness stopped by one (``amqtt-durable fleet`` turns SIGTERM into SystemExit) never
    unwinds from inside ``subprocess.Popen`` with the child running and no handle. That helps a
    caller that holds the ``ChildProcess`` before ``start`` (it can stop the child) and
    ``BrokerProcess.start``/``EtcdProcess.start`` (they stop it on any exception). Only in the main
    thread, which runs Python's signal handlers, and only a signal whose handler is neither ignored
    (SIG_IGN: holding it would swap it for a handler, which ``exec`` resets to the default, and the
    child would no longer inherit the ignoring) nor set outside Python. Each handler swapped is put
    back on the way out, whatever happens meanwhile (a signal while they are swapped included)."""
    noted: list[int] = []
    try:
        with contextlib.ExitStack() as restore:
            if threading.current_thread() is threading.main_thread():
                for stop in (signal.SIGTERM, signal.SIGINT):
                    handler = signal.getsignal(stop)
                    if handler is None or handler == signal.SIG_IGN:
                        continue
                    restore.callback(signal.signal, stop, handler)  # put back even if a signal comes now
                    signal.signal(stop, lambda signum, _frame: noted.append(signum))
            yield
    finally:
        with contextlib.ExitStack() as each:  # every one raised, even if an earlier handler raises
            for signum in reversed(dict.fromkeys(noted)):
                each.callback(signal.raise_signal, signum)


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
        with self.log_path.open("ab") as out, _stop_signals_held():
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
        within ``timeout`` seconds. Both name ``name``, what was awaited and the log. Any other
        exception while waiting (a signal's SystemExit, KeyboardInterrupt) stops the child first:
        the caller, which never got this handle back, could not.
        """
        try:
            became_ready = self.wait_until(ready, timeout)
        except ChildExitedError as exc:
            raise ChildExitedError(f"{name} exited with status {self.exit_status}; see {self.log_path}") from exc
        except BaseException:  # SIGTERM's SystemExit, Ctrl-C, ... while it got ready: the child goes too
            self.stop()
            raise
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
        stop_all([self], self.wait)

    def _reap(self, timeout: float) -> bool:
        assert self.proc is not None
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True


def stop_all(children: Iterable[ChildProcess], wait: float) -> None:
    """``stop_signal`` to every child at once, then SIGKILL to each still running ``wait`` seconds later:
    they stop in parallel, and one that ignores its signal holds the caller up ``wait``, not its own."""
    children = list(children)
    for child in children:
        child.terminate()
    deadline = time.monotonic() + wait
    for child in children:
        child.wait_stopped(deadline)


class BrokerProcess(ChildProcess):
    """One broker configuration, written to ``folder/broker.yaml`` at each start; output in ``folder/broker.log``.

    ``config`` may change between two starts (a test adding a plugin); the port and the store
    stay, so ``restart`` brings the same broker back. The broker stops by itself when the process
    that started it is gone (--parent-pid), so a tool killed without cleaning up leaves no broker behind.
    ``ready_wait`` bounds a start; ``wait`` is the stop's, also for a broker stopped while it starts
    (a start interrupted, or not ready in time): a slow start never lengthens a stop.
    """

    def __init__(self, config: Mapping[str, Any], folder: Path, port: int, *, ready_wait: float = 60.0,
                 wait: float = 15.0, env: Mapping[str, str] | None = None) -> None:
        self.port = port
        self.ready_wait = ready_wait
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
        """Start and return once ready; RuntimeError naming the log if not within ``ready_wait`` seconds.
        On any exception (a signal's SystemExit while it spawns included) the broker is stopped first."""
        try:
            self.spawn()
            return self.await_ready("the broker", self.ready, self.ready_wait, f"open {HOST}:{self.port}")
        except BaseException:
            self.stop()
            raise

    def restart(self, kill: bool = True) -> Self:
        """SIGKILL (or stop, with ``kill`` False) and start again on the same port and store."""
        self.kill() if kill else self.stop()
        return self.start()


def _parent_death_signal() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the kernel send the child SIGTERM when the thread that started it
    ends (Linux's ``prctl(PR_SET_PDEATHSIG)``);
    None where there is no such call. libc is loaded here, in the parent, so the child after
    ``fork`` only calls it. The child ends there instead when the parent is already gone."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def ask() -> None:
        # The child still runs the parent's Python handlers until exec: a SIGTERM to one of them (a
        # noting or exiting handler) would only set a flag and the exec would go on.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the call: no signal will come
            os._exit(1)

    return ask


class EtcdProcess(ChildProcess):
    """One etcd member (Debian's ``etcd`` binary from etcd-server) on two free 127.0.0.1 ports,
    its data in ``folder/data``, its output in ``folder/etcd.log``. Short heartbeat and election
    timeouts: it elects itself in a fraction of a second, and its shortest lease is about a second.

    ``start`` returns once the member answers a read through its v3 JSON gateway; RuntimeError
    (naming the remedy or the log) when the binary is missing or the member never gets ready.
    On Linux the member gets SIGTERM from the kernel when the thread that started it ends (a
    tool SIGKILLed included), so a tool killed without cleaning up leaves no etcd behind; start
    it from a thread that lives as long as it should.
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
            preexec_fn=_parent_death_signal(),
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
        """Start and return once ready; on any exception (a signal's SystemExit while it spawns
        included) the member is stopped first."""
        try:
            super().start()
            return self.await_ready("etcd", self.ready, self.ready_wait, "become ready")
        except BaseException:
            self.stop()
            raise
