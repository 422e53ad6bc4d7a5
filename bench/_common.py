"""Helpers for the benchmarks (the bench_*.py files, which share constants and helpers only through this module):
the repository's paths, broker processes (on amqtt_durable.process's ChildProcess), RSS sampling, the load
clients' results, configuration files, the code under test (snapshot copies, git revision), CPU pinning options,
the run's temporary folder and its report.

The MQTT load clients (raw sockets, one process each) are in _rawmqtt.py.

Everything here talks to 127.0.0.1 only, every wait is bounded by a deadline,
and only processes started by this module are ever signalled (by their PID).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import platform
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from functools import partial
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import psutil
from _rawmqtt import DISCONNECT, HOST, ClientProcess, Login, PublishResult, ReceiveResult, connect_packet
from pwdlib.hashers.argon2 import Argon2Hasher

from amqtt_durable.process import ChildExitedError, ChildProcess

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = ROOT / ".venv" / "bin"
PLUGIN_DIR = ROOT / "plugin" / "amqtt_durable"
SDK_DIR = ROOT / "client_sdk" / "durable_client"
PROTOCOL_DIR = ROOT / "client_sdk" / "durable_protocol"
PIPELINE_DIR = ROOT / "pipeline" / "durable_pipeline"
BROKER_YAML = ROOT / "broker.yaml"
STOCK = "stock"
OURS = "ours"
MOSQUITTO = "mosquitto"
BROKER_TITLES = {STOCK: "stock amqtt", OURS: "amqtt-durable", MOSQUITTO: "Mosquitto"}
MOSQUITTO_PACKAGE = "mosquitto"  # the Debian package (persistence on), the third broker of the comparisons
SETTLE_S = 0.5  # let the broker process a DISCONNECT before publishing to the now-offline session
CLIENT_START_S = 60.0  # spawn a client process, pre-encode, connect
RESULT_MARGIN_S = 30.0  # a client process reports this long after its own time bound at the latest


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
    """sha256 of every .py file of a package folder, its subpackages' included (amqtt_durable/replication),
    by path inside it (to notice code changing under a running benchmark, and to tell versions apart)."""
    if not package_dir.is_dir():
        return {}
    return {
        path.relative_to(package_dir).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(package_dir.rglob("*.py"))
        if "__pycache__" not in path.parts
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
    for dist in ("amqtt", "psutil", "plyvel", "amqtt-durable"):
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


# --------------------------------------------------------------------------- client results


def run_publisher(pub: ClientProcess, timeout: float, *, ready_seen: bool = False) -> PublishResult:
    """Wait until the publisher process is connected, let it go, return its result."""
    if not ready_seen:
        pub.expect("ready", CLIENT_START_S)
    pub.send("go")
    result: PublishResult = pub.expect("result", timeout + RESULT_MARGIN_S)
    return result


def recv_summary(res: ReceiveResult, n: int) -> str:
    parts = [f"{res.unique:,}/{n:,}"]
    for count, what in ((res.duplicates, "dup"), (res.dup_flags, "DUP=1"), (res.retained, "RETAIN=1"),
                        (res.reordered, "out of order"), (res.foreign, "foreign"), (res.other_packets, "other pkts")):
        if count:
            parts.append(f"{count:,} {what}")
    parts.append(f"session_present={int(res.session_present)}")
    if res.unique < n:
        parts.append(f"{res.publishes:,} PUBLISH received, {res.pubacks_sent:,} PUBACKs sent, ended: {res.end}")
    if res.error:
        parts.append(f"error: {res.error}")
    return ", ".join(parts)


def pub_summary(pr: PublishResult) -> str:
    text = f"{pr.acked:,}/{pr.requested:,}"
    if pr.timed_out:
        text += " (timed out)"
    if pr.error:
        text += f" ({pr.error})"
    if pr.stray_acks:
        text += f", {pr.stray_acks:,} stray PUBACKs"
    if pr.other_packets:
        text += f", {pr.other_packets:,} other packets"
    if pr.flush_error:
        text += f", flush: {pr.flush_error}"
    return text


def fmt_number(value: float | int) -> str:
    if isinstance(value, int):
        return f"{value:,}"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


# --------------------------------------------------------------------------- start-up probe


def probe_connack(port: int, login: Login, timeout: float) -> int:
    """Open a TCP connection, send CONNECT (clean session), return the CONNACK return code."""
    client_id = f"bench-probe-{os.getpid()}-{time.monotonic_ns()}"
    with socket.create_connection((HOST, port), timeout=timeout) as s:
        s.settimeout(timeout)
        s.sendall(connect_packet(client_id, login))
        data = b""
        while len(data) < 4:
            chunk = s.recv(4 - len(data))
            if not chunk:
                raise ConnectionError("connection closed before CONNACK")
            data += chunk
        if data[0] != 0x20 or data[1] != 0x02:
            raise BenchError(f"unexpected reply to CONNECT: {data!r}")
        with contextlib.suppress(OSError):
            s.sendall(DISCONNECT)
        return data[3]


# --------------------------------------------------------------------------- broker processes


def _broker_preexec(cpus: tuple[int, ...] | None) -> None:
    """Run in the broker's process before exec."""
    # A benchmark started in the background (`cmd &`) inherits SIGINT=ignored, and so would the broker:
    # stock amqtt would then ignore the graceful stop.  Give the broker the default disposition.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    # affinity set before exec, so the broker's own threads (LevelDB compaction...) inherit it
    if cpus:
        os.sched_setaffinity(0, set(cpus))


class BrokerProcess:
    """One broker subprocess that we started (any command: stock amqtt or ours), run by the shared
    amqtt_durable.process.ChildProcess; only ever signalled through its own PID.

    What the benchmarks add: a name for the report, readiness as CONNACK(0) to `login`, the seconds
    start-up took, a graceful stop by SIGINT that says how it went, the RSS and the log's tail.
    """

    def __init__(self, name: str, argv: list[str], port: int, log_path: Path, login: Login,  # noqa: PLR0917 - the call sites pass these by position
                 cpus: tuple[int, ...] | None = None, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.port = port
        self.login = login
        self.cpus = cpus  # CPU affinity of the broker (and every thread it starts)
        self.child = ChildProcess(argv, log_path, wait=10.0, env=env, preexec_fn=partial(_broker_preexec, cpus))
        self.child.stop_signal = signal.SIGINT  # the broker's KeyboardInterrupt path
        self.spawn_time = 0.0
        self.starts = 0

    @property
    def argv(self) -> list[str]:
        return self.child.argv

    @property
    def log_path(self) -> Path:
        return self.child.log_path

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        """The process of the last start; None once it was stopped or killed."""
        return self.child.proc

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise BenchError(f"{self.name}: broker is not running")
        return self.proc.pid

    def alive(self) -> bool:
        return self.child.running

    def spawn(self) -> None:
        if self.alive():
            raise BenchError(f"{self.name}: already running (pid {self.pid})")
        self.starts += 1
        with self.log_path.open("ab") as out:
            out.write(f"\n===== start #{self.starts}: {shlex.join(self.argv)}\n".encode())
        self.spawn_time = time.perf_counter()
        self.child.start()

    def wait_ready(self, timeout: float) -> float:
        """Wait until the port answers CONNECT with CONNACK(0); return seconds since spawn."""
        deadline = Deadline(timeout)
        last_err: Exception | None = None
        attempts = 0

        def accepted() -> bool:
            nonlocal attempts, last_err
            attempts += 1
            try:
                rc = probe_connack(self.port, self.login, timeout=max(0.1, min(5.0, deadline.remaining())))
            except (OSError, ConnectionError) as exc:
                last_err = exc
                return False
            if rc != 0:
                raise BenchError(f"{self.name}: CONNACK return code {rc} (authentication/config problem?)")
            return True

        try:
            if self.child.wait_until(accepted, timeout, poll=0.02):
                return time.perf_counter() - self.spawn_time
        except ChildExitedError:
            raise BenchError(f"{self.name}: broker exited with {self.child.exit_status} during start-up; "
                             f"last log line: {self.last_log_line()!r}", self.log_tail()) from None
        raise BenchError(
            f"{self.name}: not ready within {timeout:.0f}s ({attempts} attempts, last error {last_err!r})",
            self.log_tail(),
        )

    def start(self, timeout: float) -> float:
        self.spawn()
        return self.wait_ready(timeout)

    def kill(self) -> None:
        """SIGKILL exactly the process we started."""
        self.child.kill()
        self._forget()

    def stop(self, timeout: float = 30.0) -> str:
        """Graceful stop via SIGINT (the broker's KeyboardInterrupt path); SIGKILL if it does not exit."""
        if self.proc is None:
            return "not running"
        if not self.alive():
            self._forget()
            return "already exited"
        t0 = time.perf_counter()
        self.child.terminate()
        if self.child.wait_stopped(time.monotonic() + timeout):
            how = f"SIGINT, exited in {time.perf_counter() - t0:.2f}s"
        else:
            how = f"SIGINT ignored for {timeout:.0f}s, SIGKILLed"
        self._forget()
        return how

    def _forget(self) -> None:
        """Drop the process once it has ended (reaped by the child helper)."""
        if self.proc is not None and self.proc.poll() is not None:
            self.child.proc = None

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


# --------------------------------------------------------------------------- Mosquitto


def mosquitto_binary() -> str | None:
    """The mosquitto executable (Debian puts it in /usr/sbin, often not on a user's PATH)."""
    return shutil.which("mosquitto") or shutil.which("mosquitto", path="/usr/sbin:/usr/local/sbin")


def ensure_mosquitto() -> tuple[str | None, str]:
    """Find mosquitto, installing the Debian package (apt-get, with sudo when not root) when it is missing.

    Returns (path, "") or (None, why it is unavailable); never raises, so a benchmark can skip its columns.
    """
    found = mosquitto_binary()
    if found:
        return found, ""
    if shutil.which("apt-get") is None:
        return None, "mosquitto is not installed and apt-get is not available"
    prefix: list[str] = []
    if os.geteuid() != 0:
        if shutil.which("sudo") is None:
            return None, "mosquitto is not installed; installing it needs root (no sudo here)"
        prefix = ["sudo", "-n"]
    log(f"installing {MOSQUITTO_PACKAGE} ({shlex.join([*prefix, 'apt-get', 'install', '-y', MOSQUITTO_PACKAGE])})")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", MOSQUITTO_PACKAGE]):
        try:
            done = subprocess.run([*prefix, *cmd], env=env, capture_output=True, text=True, timeout=600, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return None, f"{shlex.join(cmd)} failed: {exc}"
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["?"]
            return None, f"{shlex.join(cmd)} exited with {done.returncode}: {tail[0]}"
    found = mosquitto_binary()
    return (found, "") if found else (None, f"{MOSQUITTO_PACKAGE} installed but no mosquitto executable found")


def mosquitto_version(binary: str) -> str:
    """'mosquitto version 2.0.11' from `mosquitto -h` (which exits non-zero by design)."""
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        out = subprocess.run([binary, "-h"], capture_output=True, text=True, timeout=10, check=False).stdout
        return next((line.strip() for line in out.splitlines() if "version" in line), "mosquitto ?")
    return "mosquitto ?"


def mosquitto_broker(binary: str, folder: Path, port: int, login: Login, *, max_queued: int,
                     cpus: tuple[int, ...] | None = None) -> BrokerProcess:
    """A Mosquitto subprocess on 127.0.0.1:`port` with persistence on, configured in `folder` (created).

    Anonymous logins are allowed (the bench's username/password is accepted and ignored); the per-client
    queue holds `max_queued` messages, so offline backlogs of that size are kept in full.  Stopped by
    SIGINT (Mosquitto writes its persistence file on a graceful stop) or SIGKILL, by PID only.
    """
    folder.mkdir(parents=True, exist_ok=True)
    conf = folder / "mosquitto.conf"
    lines = [
        f"listener {port} {HOST}",
        "allow_anonymous true",
        "persistence true",
        f"persistence_location {folder}/",
        "persistence_file mosquitto.db",
        "autosave_interval 1800",
        f"max_queued_messages {max_queued}",
        "max_queued_bytes 0",
        "max_inflight_messages 100",
        "log_dest stderr",
        "log_type error",
        "log_type warning",
    ]
    if os.geteuid() == 0:
        lines.append("user root")  # else mosquitto drops to the 'mosquitto' user, who cannot write `folder`
    conf.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return BrokerProcess(MOSQUITTO, [binary, "-c", str(conf)], port, folder / "mosquitto.log", login, cpus)


# --------------------------------------------------------------------------- code under test


def snapshot_packages(package_dirs: Sequence[Path], dest: Path, *, git_root: Path | None = None,
                      ref: str = "HEAD") -> Path:
    """Copy package folders into `dest` and return `dest`, for PYTHONPATH / sys.path.

    A benchmark that imports the copy measures one version of the code even when the working
    tree changes during the run (folders on PYTHONPATH or sys.path come before the editable
    install). With `git_root` the copies are the folders as committed in HEAD (`git archive`),
    so the code under test is exactly the reported revision (or git ``ref``); otherwise the working
    tree's (without __pycache__).
    """
    dest.mkdir(parents=True, exist_ok=True)
    if git_root is None:
        for package_dir in package_dirs:
            shutil.copytree(package_dir, dest / package_dir.name, ignore=shutil.ignore_patterns("__pycache__"))
        return dest
    for package_dir in package_dirs:
        rel = package_dir.resolve().relative_to(git_root.resolve()).as_posix()
        archive = subprocess.run(["git", "-C", str(git_root), "archive", "--format=tar", ref, rel],
                                 capture_output=True, timeout=60, check=True).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            members = [m for m in tar.getmembers() if m.isfile() and m.name.startswith(rel + "/")]
            if not members:
                raise BenchError(f"{rel} is not in git {ref}")
            for member in members:
                member.name = f"{package_dir.name}/{member.name[len(rel) + 1:]}"
            tar.extractall(dest, members=members, filter="data")
    return dest


def ref_revision(root: Path, ref: str = "HEAD") -> str:
    """`<short hash> <subject>` of git ``ref``."""
    try:
        return subprocess.run(["git", "-C", str(root), "log", "-1", "--format=%h %s", ref], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def git_revision(root: Path, watched: Sequence[str]) -> str:
    """`<short hash> <subject>` of HEAD, plus a warning when any of the `watched` paths has uncommitted changes."""
    head = ref_revision(root)
    try:
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", *watched],
                               capture_output=True, text=True, timeout=10, check=True).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    changed = sorted({line[3:].split("/")[0] for line in dirty if line.strip()})
    return head + (f" + uncommitted changes in {', '.join(changed)}" if changed else "")


# --------------------------------------------------------------------------- options, run, report


def parse_cpus(text: str) -> tuple[int, ...]:
    return tuple(sorted({int(part) for part in text.split(",") if part.strip()}))


def add_pin_arguments(parser: argparse.ArgumentParser, brokers: str, clients: str) -> None:
    """--pin, --broker-cpus and --client-cpus; `brokers` and `clients` name what they pin, for the help."""
    parser.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                        help=f"pin {brokers} to --broker-cpus and {clients} to --client-cpus (default on)")
    parser.add_argument("--broker-cpus", type=parse_cpus, default=(0,), help=f"CPUs for {brokers} (default 0)")
    parser.add_argument("--client-cpus", type=parse_cpus, default=(1,), help=f"CPUs for {clients} (default 1)")


def check_pin_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """With --pin, both CPU sets must be non-empty and usable by this process (else a usage error)."""
    if args.pin:
        usable = os.sched_getaffinity(0)
        if not args.broker_cpus or not args.client_cpus or not set(args.broker_cpus + args.client_cpus) <= usable:
            parser.error(f"--broker-cpus/--client-cpus must be non-empty subsets of the usable CPUs {sorted(usable)}")


def describe_pinning(args: argparse.Namespace, clients: str) -> str:
    """The report's words for --pin/--broker-cpus/--client-cpus."""
    if not args.pin:
        return "no CPU pinning"
    return (f"broker pinned to CPU {','.join(map(str, args.broker_cpus))}, {clients} to CPU "
            f"{','.join(map(str, args.client_cpus))}")


def run_in_temp_folder(prefix: str, keep: bool, body: Callable[[Path], None], note: Callable[[str], None]) -> None:
    """Run `body` in a new temporary folder, removed afterwards unless `keep`.

    An interruption or a failure of `body` ends up as a note (the report is still written).
    """
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        body(tmp)
    except KeyboardInterrupt:
        note("interrupted")
    except Exception as exc:
        note(f"benchmark aborted: {type(exc).__name__}: {exc}")
        log(traceback.format_exc())
    finally:
        if keep:
            log(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def write_report(report: str, out: Path | None) -> None:
    """Print the markdown report; with `out` (--out), also write it to that file."""
    print(report)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(report, encoding="utf-8")
        log(f"wrote {out}")


def use_code_snapshot(code: str, watched: dict[str, Path], tmp: Path, git_root: Path,
                      note: Callable[[str], None]) -> tuple[Path | None, dict[str, dict[str, str]], str]:
    """Copy the ``watched`` packages (``code``: head = as committed, worktree, live = no copy) and
    put the copy first on sys.path and PYTHONPATH, which the broker, workers and Spark inherit.

    Returns the snapshot folder (None for live), the fingerprints at the start (to notice the
    working tree changing during the run) and the fingerprint line of the code under test; notes
    uncommitted changes that a head run leaves out.
    """
    at_start = {name: source_fingerprint(folder) for name, folder in watched.items()}
    snapshot = None
    if code != "live":
        snapshot = snapshot_packages(list(watched.values()), tmp / "snapshot",
                                     git_root=git_root if code == "head" else None)
        sys.path.insert(0, str(snapshot))
        os.environ["PYTHONPATH"] = os.pathsep.join([str(snapshot), *filter(None, [os.environ.get("PYTHONPATH")])])
    used = at_start if snapshot is None else {
        name: source_fingerprint(snapshot / folder.name) for name, folder in watched.items()}
    where = {"head": "copies as committed in git HEAD, taken at start",
             "worktree": "copies of the working tree, taken at start",
             "live": "the working tree, as imported"}[code]
    fingerprints = ", ".join(f"{name} {fingerprint_digest(fp)}" for name, fp in used.items())
    differ = [f"{name}: {file}" for name in watched for file in changed_files(used[name], at_start[name])]
    if code == "head" and differ:
        note(f"the working tree differed from git HEAD at the start ({', '.join(differ)}: uncommitted work "
             "of others); the run used the committed code")
    return snapshot, at_start, f"{fingerprints} (sha256 of the *.py files); ran from {where}"

