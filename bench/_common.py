"""Helpers for bench_durable.py: broker processes, MQTT clients, RSS sampling.

Everything here talks to 127.0.0.1 only, every wait is bounded by a deadline,
and only processes started by this module are ever signalled (by their PID).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import shlex
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import psutil
from paho.mqtt.enums import CallbackAPIVersion
from pwdlib.hashers.argon2 import Argon2Hasher

HOST = "127.0.0.1"
PAYLOAD_SIZE = 64
# payload layout: 4-byte run tag, uint32 sequence number, int64 send time (perf_counter_ns), zero padding
_HEADER = struct.Struct("!4sIq")
_PADDING = bytes(PAYLOAD_SIZE - _HEADER.size)


def log(msg: str) -> None:
    """Progress output goes to stderr so stdout carries only the report."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class BenchError(RuntimeError):
    """A benchmark step failed (timeout, broker died, protocol error); `detail` holds e.g. a log tail."""

    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail


class Deadline:
    """A point in time after which a wait must give up."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.end = time.monotonic() + seconds

    def remaining(self) -> float:
        return max(0.0, self.end - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self.end


def free_port() -> int:
    """An ephemeral TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        port: int = s.getsockname()[1]
        return port


def make_payload(tag: bytes, seq: int) -> bytes:
    return _HEADER.pack(tag, seq, time.perf_counter_ns()) + _PADDING


def parse_payload(data: bytes) -> tuple[bytes, int, int] | None:
    if len(data) != PAYLOAD_SIZE:
        return None
    tag, seq, sent_ns = _HEADER.unpack_from(data)
    return tag, seq, sent_ns


def percentile(sorted_values: Sequence[int], pct: float) -> float | None:
    """Nearest-rank percentile of an already sorted sequence."""
    if not sorted_values:
        return None
    rank = max(1, round(pct / 100.0 * len(sorted_values) + 0.5 - 1e-9))
    return float(sorted_values[min(rank, len(sorted_values)) - 1])


def dir_size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += (Path(root) / name).stat().st_size
    return total


def source_fingerprint(package_dir: Path) -> dict[str, str]:
    """sha256 of every .py file of a package folder (to notice code changing under a running benchmark)."""
    if not package_dir.is_dir():
        return {}
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(package_dir.glob("*.py"))
    }


def fingerprint_digest(fingerprint: dict[str, str]) -> str:
    joined = "".join(f"{name}:{digest}\n" for name, digest in sorted(fingerprint.items()))
    return hashlib.sha256(joined.encode()).hexdigest()[:12] if fingerprint else "n/a"


def changed_files(before: dict[str, str], after: dict[str, str]) -> list[str]:
    return sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name))


def machine_info() -> dict[str, str]:
    vm = psutil.virtual_memory()
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        usable = os.cpu_count() or 0
    cpu_model = platform.processor() or "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as fh:
        for line in fh:
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    versions: dict[str, str] = {}
    for dist in ("amqtt", "paho-mqtt", "psutil", "plyvel", "amqtt-durable"):
        try:
            versions[dist] = version(dist)
        except PackageNotFoundError:
            versions[dist] = "not installed"
    return {
        "nproc": str(usable),
        "cpu": cpu_model,
        "ram": f"{vm.total / 2**30:.1f} GiB",
        "python": f"{platform.python_implementation()} {platform.python_version()} ({sys.executable})",
        "os": f"{platform.system()} {platform.release()}",
        "packages": ", ".join(f"{k} {v}" for k, v in versions.items()),
    }


# --------------------------------------------------------------------------- raw MQTT probe


def _mqtt_str(value: str) -> bytes:
    raw = value.encode()
    return struct.pack("!H", len(raw)) + raw


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n % 128, n // 128
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def connect_packet(client_id: str, username: str | None, password: str | None, clean: bool = True) -> bytes:
    flags = 0x02 if clean else 0
    payload = _mqtt_str(client_id)
    if username is not None:
        flags |= 0x80
        payload += _mqtt_str(username)
        if password is not None:
            flags |= 0x40
            payload += _mqtt_str(password)
    variable = _mqtt_str("MQTT") + bytes([4, flags]) + struct.pack("!H", 30)
    body = variable + payload
    return b"\x10" + _varint(len(body)) + body


def probe_connack(port: int, username: str | None, password: str | None, timeout: float) -> int:
    """Open a TCP connection, send CONNECT (clean session), return the CONNACK return code."""
    client_id = f"bench-probe-{os.getpid()}-{time.monotonic_ns()}"
    with socket.create_connection((HOST, port), timeout=timeout) as s:
        s.settimeout(timeout)
        s.sendall(connect_packet(client_id, username, password))
        data = b""
        while len(data) < 4:
            chunk = s.recv(4 - len(data))
            if not chunk:
                raise ConnectionError("connection closed before CONNACK")
            data += chunk
        if data[0] != 0x20 or data[1] != 0x02:
            raise BenchError(f"unexpected reply to CONNECT: {data!r}")
        with contextlib.suppress(OSError):
            s.sendall(b"\xe0\x00")  # DISCONNECT
        return data[3]


# --------------------------------------------------------------------------- broker processes


@dataclass
class Credentials:
    username: str | None = None
    password: str | None = None


@dataclass
class BrokerProcess:
    """One broker subprocess that we started; only ever signalled through its own PID."""

    name: str
    argv: list[str]
    port: int
    log_path: Path
    creds: Credentials
    proc: subprocess.Popen[bytes] | None = None
    spawn_time: float = 0.0
    starts: int = 0
    _log_fh: Any = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise BenchError(f"{self.name}: broker is not running")
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def spawn(self) -> None:
        if self.alive():
            raise BenchError(f"{self.name}: already running (pid {self.pid})")
        self.starts += 1
        self._log_fh = open(self.log_path, "ab")  # noqa: SIM115 - closed in _reap
        self._log_fh.write(f"\n===== start #{self.starts}: {shlex.join(self.argv)}\n".encode())
        self._log_fh.flush()
        self.spawn_time = time.perf_counter()
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log_fh,
            stderr=subprocess.STDOUT,
        )

    def wait_ready(self, timeout: float) -> float:
        """Wait until the port answers CONNECT with CONNACK(0); return seconds since spawn."""
        deadline = Deadline(timeout)
        last_err: Exception | None = None
        attempts = 0
        while not deadline.expired():
            attempts += 1
            if self.proc is None or self.proc.poll() is not None:
                rc = None if self.proc is None else self.proc.returncode
                raise BenchError(f"{self.name}: broker exited with {rc} during start-up; "
                                 f"last log line: {self.last_log_line()!r}", self.log_tail())
            try:
                rc = probe_connack(self.port, self.creds.username, self.creds.password,
                                   timeout=max(0.1, min(5.0, deadline.remaining())))
            except (OSError, ConnectionError) as exc:
                last_err = exc
                time.sleep(min(0.02, deadline.remaining()))
                continue
            if rc != 0:
                raise BenchError(f"{self.name}: CONNACK return code {rc} (authentication/config problem?)")
            return time.perf_counter() - self.spawn_time
        raise BenchError(
            f"{self.name}: not ready within {timeout:.0f}s ({attempts} attempts, last error {last_err!r})",
            self.log_tail(),
        )

    def start(self, timeout: float) -> float:
        self.spawn()
        return self.wait_ready(timeout)

    def kill(self) -> None:
        """SIGKILL exactly the process we started."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self._reap(10.0)

    def stop(self, timeout: float = 30.0) -> str:
        """Graceful stop via SIGINT (the broker's KeyboardInterrupt path); SIGKILL if it does not exit."""
        if self.proc is None:
            return "not running"
        if self.proc.poll() is not None:
            self._reap(1.0)
            return "already exited"
        t0 = time.perf_counter()
        os.kill(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout=timeout)
            how = f"SIGINT, exited in {time.perf_counter() - t0:.2f}s"
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            how = f"SIGINT ignored for {timeout:.0f}s, SIGKILLed"
        self._reap(10.0)
        return how

    def _reap(self, timeout: float) -> None:
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=timeout)
            if self.proc.poll() is not None:
                self.proc = None
        if self._log_fh is not None and self.proc is None:
            self._log_fh.close()
            self._log_fh = None

    def rss(self) -> int:
        return process_tree_rss(self.pid)

    def last_log_line(self) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return next((line for line in reversed(text) if line.strip()), "")

    def log_tail(self, lines: int = 25) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(f"    {self.name}| {line}" for line in text[-lines:])


def process_tree_rss(pid: int) -> int:
    """RSS of the process plus any children it spawned (normally none)."""
    proc = psutil.Process(pid)
    total: int = proc.memory_info().rss
    for child in proc.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            total += child.memory_info().rss
    return total


class RssMonitor:
    """Samples the RSS of one PID every `interval` seconds in a daemon thread; tracks the peak."""

    def __init__(self, pid: int, interval: float = 0.1) -> None:
        self.pid = pid
        self.interval = interval
        self.peak = 0
        self.last = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"rss-{pid}", daemon=True)

    def _sample(self) -> None:
        try:
            rss = process_tree_rss(self.pid)
        except psutil.Error:
            return
        self.last = rss
        self.peak = max(self.peak, rss)
        self.samples += 1

    def _run(self) -> None:
        self._sample()
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> RssMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join(timeout=5.0)
            self._sample()


# --------------------------------------------------------------------------- configuration files


def write_password_file(path: Path, username: str, password: str) -> None:
    """Write an amqtt FileAuthPlugin password file: `username:hash` lines, hashes verified by pwdlib.

    The argon2 cost is deliberately minimal so that password checking does not distort the
    CONNECT-to-first-message timings of the stock broker.
    """
    hasher = Argon2Hasher(time_cost=1, memory_cost=8, parallelism=1)
    path.write_text(f"{username}:{hasher.hash(password)}\n", encoding="utf-8")


def write_config(path: Path, config: dict[str, Any]) -> None:
    """JSON is valid YAML, so this avoids a YAML emitter dependency."""
    path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def listener_config(port: int) -> dict[str, Any]:
    return {"default": {"type": "tcp", "bind": f"{HOST}:{port}"}}


# --------------------------------------------------------------------------- paho clients


def _new_client(client_id: str, clean: bool, creds: Credentials) -> mqtt.Client:
    client = mqtt.Client(
        callback_api_version=CallbackAPIVersion.VERSION2,
        client_id=client_id,
        clean_session=clean,
        protocol=mqtt.MQTTv311,
    )
    if creds.username is not None:
        client.username_pw_set(creds.username, creds.password)
    return client


class _Conn:
    """Common connect / disconnect handling for the threaded paho clients."""

    def __init__(self, port: int, client_id: str, clean: bool, creds: Credentials) -> None:
        self.port = port
        self.client_id = client_id
        self.client = _new_client(client_id, clean, creds)
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = self._on_disconnect
        self.connack = threading.Event()
        self.disconnected = threading.Event()
        self.session_present: bool | None = None
        self.connack_rc: str | None = None
        self.refused = False
        self.t_connect_ns = 0
        self.t_connack_ns = 0
        self._looping = False

    def _on_connect(self, _c: mqtt.Client, _u: Any, flags: Any, reason_code: Any, _p: Any) -> None:
        self.t_connack_ns = time.perf_counter_ns()
        self.session_present = bool(flags.session_present)
        self.connack_rc = str(reason_code)
        self.refused = bool(reason_code.is_failure)
        self.connack.set()

    def _on_disconnect(self, _c: mqtt.Client, _u: Any, _f: Any, _rc: Any, _p: Any) -> None:
        self.disconnected.set()

    def connect(self, timeout: float) -> None:
        self.client.connect_timeout = max(1.0, min(timeout, 30.0))
        self.t_connect_ns = time.perf_counter_ns()
        self.client.connect(HOST, self.port, keepalive=60)
        self.client.loop_start()
        self._looping = True
        if not self.connack.wait(timeout):
            raise BenchError(f"{self.client_id}: no CONNACK within {timeout:.0f}s")
        if self.refused:
            raise BenchError(f"{self.client_id}: connection refused: {self.connack_rc}")

    @property
    def connack_ms(self) -> float:
        return (self.t_connack_ns - self.t_connect_ns) / 1e6

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.disconnect()
        if self._looping:
            self._looping = False
            self.client.loop_stop()


class Subscriber(_Conn):
    """Counts unique sequence numbers of messages carrying our run tag."""

    def __init__(self, port: int, client_id: str, *, clean: bool, creds: Credentials, tag: bytes, n: int,
                 record_latency: bool = False) -> None:
        super().__init__(port, client_id, clean, creds)
        self.client.on_message = self._on_message
        self.client.on_subscribe = self._on_subscribe
        self.tag = tag
        self.n = n
        self.seen = bytearray(n)
        self.unique = 0
        self.duplicates = 0
        self.foreign = 0
        self.total = 0
        self.record_latency = record_latency
        self.latencies_ns: array[int] = array("q")
        self.t_first_ns = 0
        self.t_last_ns = 0  # time the n-th unique message arrived (or the latest unique one)
        self.all_received = threading.Event()
        self.suback = threading.Event()
        self.suback_codes: list[int] = []
        self._progress = threading.Event()

    def _on_subscribe(self, _c: mqtt.Client, _u: Any, _mid: int, codes: Any, _p: Any) -> None:
        self.suback_codes = [int(getattr(c, "value", c)) for c in codes]
        self.suback.set()

    def _on_message(self, _c: mqtt.Client, _u: Any, msg: mqtt.MQTTMessage) -> None:
        now = time.perf_counter_ns()
        self.total += 1
        parsed = parse_payload(bytes(msg.payload))
        if parsed is None or parsed[0] != self.tag or parsed[1] >= self.n:
            self.foreign += 1
            return
        _tag, seq, sent_ns = parsed
        if self.t_first_ns == 0:
            self.t_first_ns = now
        if self.seen[seq]:
            self.duplicates += 1
            return
        self.seen[seq] = 1
        self.unique += 1
        self.t_last_ns = now
        if self.record_latency:
            self.latencies_ns.append(now - sent_ns)
        self._progress.set()
        if self.unique >= self.n:
            self.all_received.set()

    def subscribe(self, topic: str, timeout: float) -> None:
        self.suback.clear()
        rc, _mid = self.client.subscribe(topic, qos=1)
        if rc != mqtt.MQTT_ERR_SUCCESS:
            raise BenchError(f"{self.client_id}: subscribe failed rc={rc}")
        if not self.suback.wait(timeout):
            raise BenchError(f"{self.client_id}: no SUBACK within {timeout:.0f}s")
        if not self.suback_codes or self.suback_codes[0] != 1:
            raise BenchError(f"{self.client_id}: SUBACK codes {self.suback_codes}, expected granted QoS 1")

    def wait_all(self, timeout: float, idle: float | None = None) -> bool:
        """Wait until all n arrived, `timeout` passed, or (if idle) nothing new arrived for `idle` seconds."""
        deadline = Deadline(timeout)
        last_progress = time.monotonic()
        while not self.all_received.is_set() and not deadline.expired():
            if self._progress.wait(min(0.2, deadline.remaining())):
                self._progress.clear()
                last_progress = time.monotonic()
            elif idle is not None and time.monotonic() - last_progress >= idle:
                break
            if self.disconnected.is_set() and not self.all_received.is_set():
                break
        return self.all_received.is_set()

    def wait_first(self, timeout: float) -> bool:
        deadline = Deadline(timeout)
        while self.unique == 0 and not deadline.expired() and not self.disconnected.is_set():
            self._progress.wait(min(0.05, deadline.remaining()))
        return self.unique > 0


@dataclass
class PublishResult:
    requested: int
    sent: int
    acked: int
    t_first_send_ns: int
    t_last_ack_ns: int
    timed_out: bool
    error: str | None = None

    @property
    def seconds(self) -> float:
        return max(1e-9, (self.t_last_ack_ns - self.t_first_send_ns) / 1e9)

    @property
    def ack_rate(self) -> float:
        return self.acked / self.seconds


class Publisher(_Conn):
    """QoS1 publisher that never has more than `inflight` unacknowledged PUBLISHes outstanding."""

    def __init__(self, port: int, client_id: str, creds: Credentials, inflight: int) -> None:
        super().__init__(port, client_id, True, creds)
        self.inflight = inflight
        self.client.max_inflight_messages_set(inflight)
        self.client.max_queued_messages_set(0)
        self.client.on_publish = self._on_publish
        self._window = threading.BoundedSemaphore(inflight)
        self._lock = threading.Lock()
        self._acked = 0
        self._target = 0
        self._t_last_ack_ns = 0
        self._done = threading.Event()

    def _on_publish(self, _c: mqtt.Client, _u: Any, _mid: int, _rc: Any, _p: Any) -> None:
        with self._lock:
            self._acked += 1
            self._t_last_ack_ns = time.perf_counter_ns()
            if self._acked >= self._target:
                self._done.set()
        with contextlib.suppress(ValueError):
            self._window.release()

    def publish_seq(self, topic: str, tag: bytes, n: int, timeout: float,
                    progress_every: float = 0.0) -> PublishResult:
        """Publish n QoS1 messages (seq 0..n-1) and wait for all PUBACKs, bounded by `timeout`."""
        deadline = Deadline(timeout)
        with self._lock:
            self._acked = 0
            self._target = n
            self._done.clear()
        sent = 0
        error: str | None = None
        t_first = time.perf_counter_ns()
        next_report = time.monotonic() + progress_every if progress_every else float("inf")
        for seq in range(n):
            if not self._window.acquire(timeout=deadline.remaining()):
                break
            if self.disconnected.is_set():
                error = "publisher disconnected"
                break
            info = self.client.publish(topic, make_payload(tag, seq), qos=1)
            if info.rc != mqtt.MQTT_ERR_SUCCESS:
                error = f"publish rc={info.rc}"
                break
            sent += 1
            if time.monotonic() >= next_report:
                next_report = time.monotonic() + progress_every
                log(f"    ... {sent:,} sent, {self._acked:,} acked")
        if error is None and sent == n:
            self._done.wait(deadline.remaining())
        with self._lock:
            acked = self._acked
            t_last = self._t_last_ack_ns or time.perf_counter_ns()
        timed_out = acked < n and error is None
        return PublishResult(n, sent, acked, t_first, t_last, timed_out=timed_out, error=error)


def run_cleanup_connect(port: int, client_id: str, creds: Credentials, timeout: float) -> None:
    """Connect once with clean_session=True to drop a persistent session, then disconnect."""
    conn = _Conn(port, client_id, True, creds)
    try:
        conn.connect(timeout)
    finally:
        conn.close()
