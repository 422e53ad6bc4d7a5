#!/usr/bin/env python3
"""Primary-backup replication (issue 12), side by side in one run: a single broker, a sync pair and
an async pair under bench_durable.py's live workload, then failover time, loss across failovers
and catch-up of a new backup.

    .venv/bin/python bench/bench_replication.py --out /tmp/replication.md   # full run
    .venv/bin/python bench/bench_replication.py --quick                      # small numbers, a smoke run
    .venv/bin/python bench/bench_replication.py --only c --failovers 5
    .venv/bin/python bench/bench_replication.py --only ab --setups single,sync --baseline main   # a change vs main

Scenarios (QoS 1, 64-byte payloads; every broker is an `amqtt-durable broker` process with its own
store, on its own 127.0.0.1 ports):
  a  live throughput and p50/p99 latency, N messages through a durable subscription (bench_durable's
     scenario a: same raw load clients, same plugin settings): the single broker vs the primary of a
     sync pair (fixed roles, the backup a separate broker process with its own store), median of --runs;
     for reference a single broker with sync: true (a PUBACK after a local fsync, as a sync pair's
     backup fsyncs each batch before it confirms it)
  b  the same for an async pair (measured in the same rounds as a, the set-ups interleaved); and a sync
     pair whose replication channel is mutual TLS (replication.tls, docs/replication.md: certificates of a
     throwaway cluster CA made with trustme, as tests/test_replication_tls.py makes them): the cost of TLS
  c  failover with etcd (role auto): SIGKILL of the primary -> first message delivered by the new
     primary to a waiting SDK client (durable_client.DurableClient with failover=[...]), median of
     --failovers, split into lease (kill -> the backup logs "took the leader lease" / its STATUS says
     primary), promotion (-> CONNACK 0 on its MQTT port) and client (-> the message arrives); with
     lease_ttl 2 / loop_wait 0.3 / demote_margin 0.5 and with the defaults 5 / 1 / 1
  d  sync mode, --loss-failovers failovers under load: a publisher keeps publishing (QoS 1) to whichever
     broker is primary, recording each PUBACKed payload; after each failover the killed broker comes
     back as a backup and catches up before the next; at the end a durable subscriber drains its queue
     from the last primary: acknowledged payloads missing (target 0) and duplicates
  e  catch-up of a new, empty backup joining a primary that holds --backlog queued messages while a
     publisher keeps publishing (--e-rate msgs/s): from the backup's connect (its row appears in the
     primary's STATUS) to in_sync, in messages/s and snapshot rows/s

Only processes this script started (brokers, etcd, load clients) are ever signalled, by their PID;
every wait has a deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import shlex
import ssl
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    CLIENT_START_S,
    OURS,
    PROTOCOL_DIR,
    ROOT,
    SDK_DIR,
    BenchError,
    BrokerProcess,
    add_pin_arguments,
    check_pin_arguments,
    dir_size,
    fmt_number,
    git_revision,
    log,
    machine_info,
    probe_connack,
    pub_summary,
    recv_summary,
    ref_revision,
    run_in_temp_folder,
    run_publisher,
    snapshot_packages,
    use_code_snapshot,
    write_report,
)
from _hapub import FollowPubResult, FollowPubSpec, drain, follow_publisher_main
from _harness import PASSWORD, USERNAME, Ctx, Results, Runs, build_brokers, drop_session, live_run, warmup
from _rawmqtt import (
    PT_PUBACK,
    ClientProcess,
    Login,
    PubSpec,
    RawConnection,
    RawMqttError,
    publish_packet,
    publisher_main,
    session_roundtrip,
)

from amqtt_durable.errors import DurableError
from amqtt_durable.process import HOST, EtcdProcess, free_port
from amqtt_durable.replication.framing import Frame
from amqtt_durable.replication.tool import ask
from durable_client import DurableClient, Event

LOGIN = Login(USERNAME, PASSWORD)
SERVING, REFUSING = 0, 3  # CONNACK return codes: accepted; server unavailable (a backup)
POLL = 0.02  # seconds between two probes of a failover in progress
FAILOVER_WAIT = 60.0
SYNC_WAIT = 300.0  # a backup catching up (snapshot of a growing store)
FAST = {"lease_ttl": 2, "loop_wait": 0.3, "demote_margin": 0.5}
DEFAULT = {"lease_ttl": 5, "loop_wait": 1.0, "demote_margin": 1.0}
TIMINGS = {"fast": FAST, "default": DEFAULT}
SDK_RECONNECT = (0.1, 0.5)  # the failover client's reconnect_min_delay / reconnect_max_delay
SETUPS = {"single": "single broker", "sync": "sync pair (primary)", "async": "async pair (primary)",
          "tls": "sync pair, mutual TLS (primary)", "fsync": "single broker, sync: true"}
"""The set-ups of a/b; "tls" is the sync pair with replication.tls; the last one (each commit fsynced, not a
target's) says what a local fsync costs."""
BASELINE = {"base-single": "single broker (baseline code)", "base-sync": "sync pair (primary, baseline code)",
            "base-async": "async pair (primary, baseline code)"}
"""With --baseline REF: the single broker and the sync pair again (and the async pair when "async" is among the
set-ups), run from the code of git REF, interleaved with the others (a change measured against the code it
replaces in one run)."""
WATCHED = {"plugin": ROOT / "plugin" / "amqtt_durable", "SDK": SDK_DIR, "protocol": PROTOCOL_DIR}


# --------------------------------------------------------------------------- nodes


@dataclass
class Node:
    """One broker process of a replication group, and its replication address."""

    name: str
    broker: BrokerProcess
    listen: str
    tls: ssl.SSLContext | None = None
    """A client context of its replication.tls, for the tools' questions (STATUS)."""

    @property
    def port(self) -> int:
        return self.broker.port


def make_node(ctx: Ctx, name: str, replication: dict[str, Any] | None, cpus: tuple[int, ...],
              tls: dict[str, str] | None = None, *, code: Path | None = None, **plugin: Any) -> Node:
    """An amqtt-durable broker with bench_durable's plugin settings (build_brokers) plus ``replication``
    (and ``tls``, its replication.tls); ``code``: a folder of package copies to run it from (--baseline)."""
    folder = ctx.tmp / name
    folder.mkdir()
    listen = f"{HOST}:{free_port()}"
    settings = dict(plugin)
    if replication is not None:
        settings["replication"] = {"name": name, "listen": listen, **replication, **({"tls": tls} if tls else {})}
    if ctx.args.recovery_buffer is not None:
        plugin = {"recovery_buffer": ctx.args.recovery_buffer, **plugin}
    args = argparse.Namespace(**{**vars(ctx.args), "broker_cpus": cpus})
    broker = build_brokers(args, folder, settings)[0][OURS]
    broker.name = name
    if code is not None:  # first on PYTHONPATH, before the code under test
        broker.child.env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
            str(code), os.environ.get("PYTHONPATH")]))}
    return Node(name, broker, listen, None if tls is None else tls_client(tls))


def cluster_tls(folder: Path) -> dict[str, str]:
    """replication.tls of a throwaway cluster: a CA and one certificate for 127.0.0.1 that every member
    presents (trustme, as tests/replication_helpers.cluster_pki)."""
    import trustme  # noqa: PLC0415 - a test dependency, needed by the TLS set-up only

    ca = trustme.CA()
    paths = {"ca": str(folder / "ca.pem"), "cert": str(folder / "node.pem")}
    ca.cert_pem.write_to_path(paths["ca"])
    ca.issue_cert(HOST).private_key_and_cert_chain_pem.write_to_path(paths["cert"])
    return paths


def tls_client(tls: dict[str, str]) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.load_cert_chain(tls["cert"])
    context.load_verify_locations(cafile=tls["ca"])
    return context


def connack(port: int) -> int | None:
    try:
        return probe_connack(port, LOGIN, timeout=2.0)
    except (OSError, ConnectionError, BenchError):
        return None


def wait_until(check: Callable[[], bool], timeout: float, poll: float = 0.05) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(poll)  # bounded by `end`
    return False


def start_node(node: Node, code: int, timeout: float = 120.0) -> float:
    """Spawn and wait until a CONNECT gets ``code`` (0 serving, 3 a backup); seconds since spawn."""
    node.broker.spawn()

    def answered() -> bool:
        if not node.broker.alive():
            raise BenchError(f"{node.name} exited during start-up", node.broker.log_tail())
        return connack(node.port) == code

    if not wait_until(answered, timeout):
        raise BenchError(f"{node.name}: no CONNACK {code} within {timeout:.0f}s", node.broker.log_tail())
    return time.perf_counter() - node.broker.spawn_time


def status(node: Node) -> dict[str, Any] | None:
    try:
        return asyncio.run(ask(node.listen, Frame.STATUS, tls=node.tls))
    except DurableError:
        return None


def backup_row(st: dict[str, Any] | None, name: str) -> dict[str, Any] | None:
    if st is None or st.get("role") != "primary":
        return None
    return next((row for row in st.get("backups", []) if row["name"] == name), None)


def wait_in_sync(primary: Node, backup: Node, timeout: float = SYNC_WAIT) -> None:
    """The backup says caught_up and the primary's row for it says in_sync."""
    seen: list[object] = []

    def level() -> bool:
        b, p = status(backup), status(primary)
        seen[:] = [b, p]
        row = backup_row(p, backup.name)
        return bool(b and b.get("caught_up")) and row is not None and row["state"] == "in_sync"

    if not wait_until(level, timeout, poll=0.1):
        raise BenchError(f"{backup.name} not in sync with {primary.name} within {timeout:.0f}s; last {seen}",
                         backup.broker.log_tail())


def stop_nodes(nodes: list[Node]) -> None:
    for node in nodes:
        how = node.broker.stop(timeout=15.0)
        log(f"  stopped {node.name}: {how}")


def publish_one(port: int, topic: str, payload: bytes, timeout: float = 10.0) -> None:
    conn = RawConnection(port, timeout)
    try:
        conn.connect(f"bench-one-{time.monotonic_ns()}", LOGIN, clean=True, timeout=timeout)
        conn.sock.sendall(publish_packet(topic, 1, payload))
        conn.expect(PT_PUBACK, timeout)
    finally:
        conn.close()


# --------------------------------------------------------------------------- results


@dataclass
class FailoverRound:
    total: float | None = None  # kill -> the marker reaches the SDK client
    lease_log: float | None = None  # kill -> the backup's log line "took the leader lease"
    lease_status: float | None = None  # kill -> its STATUS answers role primary
    connack: float | None = None  # kill -> CONNACK 0 on its MQTT port
    client_connected: float | None = None  # kill -> the SDK client's on_connected
    problem: str = ""


@dataclass
class LossResult:
    failovers: int = 0
    failover_s: list[float] = field(default_factory=list)  # kill -> CONNACK 0 from the new primary
    catchup_s: list[float] = field(default_factory=list)  # restart of the killed broker -> in sync
    pub: FollowPubResult | None = None
    acked: int = 0
    missing: int = 0
    missing_examples: list[int] = field(default_factory=list)
    duplicates: int = 0
    unacked_delivered: int = 0
    received: int = 0
    drain_end: str = ""
    session_present: bool = False


@dataclass
class CatchupResult:
    backlog: int = 0
    fill_rate: float = 0.0
    store_mb: float = 0.0
    connect_to_in_sync: float | None = None
    spawn_to_caught_up: float | None = None
    snapshot_s: float | None = None
    snapshot_rows: int = 0
    messages: int = 0  # backlog + messages acknowledged by the time the backup was in sync
    published_during: int = 0
    states: list[str] = field(default_factory=list)


@dataclass
class Report:
    ctx_notes: Results
    live: dict[str, dict[str, Runs]] = field(default_factory=dict)
    failover: dict[str, list[FailoverRound]] = field(default_factory=dict)
    loss: LossResult | None = None
    catchup: CatchupResult | None = None

    def note(self, text: str) -> None:
        self.ctx_notes.note(text)

    def add(self, setup: str, key: str, value: float | int | str | None) -> None:
        self.live.setdefault(setup, {}).setdefault(key, Runs()).values.append("—" if value is None else value)


# --------------------------------------------------------------------------- a, b: live throughput


def setup_labels(args: argparse.Namespace) -> dict[str, str]:
    """The a/b set-ups of this run (--setups, plus the --baseline ones), in the order they run."""
    labels = {key: SETUPS[key] for key in args.setups}
    if args.baseline:
        labels |= {key: f"{text[:-1]} {args.baseline})" for key, text in BASELINE.items()
                   if key != "base-async" or "async" in args.setups}
    return labels


def ab_nodes(ctx: Ctx, wanted: dict[str, str]) -> dict[str, tuple[Node, Node | None]]:
    """Each a/b set-up's broker, or primary and backup (not started)."""
    args = ctx.args
    setups: dict[str, tuple[Node, Node | None]] = {}
    if "single" in wanted:
        setups["single"] = (make_node(ctx, "single", None, args.broker_cpus), None)
    if "base-single" in wanted:
        setups["base-single"] = (make_node(ctx, "base-single", None, args.broker_cpus, code=args.baseline_path), None)
    tls = cluster_tls(ctx.tmp) if "tls" in wanted else None
    for setup, mode in (("sync", "sync"), ("async", "async"), ("tls", "sync"), ("base-sync", "sync"),
                        ("base-async", "async")):
        if setup not in wanted:
            continue
        with_tls = tls if setup == "tls" else None
        code = args.baseline_path if setup.startswith("base-") else None
        primary = make_node(ctx, f"{setup}-primary", {"role": "primary", "mode": mode}, args.broker_cpus, with_tls,
                            code=code)
        backup = make_node(ctx, f"{setup}-backup", {"role": "backup", "mode": mode, "primary": primary.listen},
                           args.backup_cpus, with_tls, code=code)
        setups[setup] = (primary, backup)
    if "fsync" in wanted:
        setups["fsync"] = (make_node(ctx, "single-fsync", None, args.broker_cpus, sync=True), None)
    return setups


def scenario_ab(ctx: Ctx, report: Report) -> None:
    args = ctx.args
    wanted = setup_labels(args)
    setups = ab_nodes(ctx, wanted)
    nodes = [n for pair in setups.values() for n in pair if n is not None]
    try:
        for primary, backup in setups.values():
            if backup is None:
                primary.broker.start(args.startup_timeout)
                continue
            start_node(primary, SERVING)
            start_node(backup, REFUSING)
            wait_in_sync(primary, backup)
        for primary, _ in setups.values():
            warmup(ctx, primary.broker)
        names = [name for name in wanted if name in setups]
        for rep in range(args.runs):
            shift = rep % len(names)
            for setup in names[shift:] + names[:shift]:
                log(f"scenario a/b run {rep + 1}: {setup}")
                live_once(ctx, report, setup, *setups[setup])
    finally:
        stop_nodes(nodes)


def cpu_seconds(node: Node | None) -> float | None:
    """User + system CPU time the broker process has used so far."""
    if node is None or not node.broker.alive():
        return None
    try:
        times = psutil.Process(node.broker.pid).cpu_times()
    except psutil.Error:
        return None
    return float(times.user + times.system)


def live_once(ctx: Ctx, report: Report, setup: str, primary: Node, backup: Node | None) -> None:
    n = ctx.args.n
    if backup is not None:
        wait_in_sync(primary, backup, 60.0)
    cpu_before = [cpu_seconds(node) for node in (primary, backup)]
    batch_before = (status(primary) or {}).get("batch") if backup is not None else None
    pr, res, sub_id = live_run(ctx, primary.broker, scenario="a", n=n, clean=False, record_latency=True)
    cpu_used = [None if b is None or (a := cpu_seconds(node)) is None else a - b
                for b, node in zip(cpu_before, (primary, backup), strict=True)]
    batches = None if batch_before is None else (status(primary) or {}).get("batch", batch_before) - batch_before
    drop_session(ctx, primary.broker, sub_id)
    report.add(setup, "per_batch", n / batches if batches else None)
    rate = None
    if res.unique and res.t_last_ns > pr.t_first_send_ns:
        rate = res.unique / ((res.t_last_ns - pr.t_first_send_ns) / 1e9)
    report.add(setup, "rate", rate)
    report.add(setup, "pub_rate", pr.ack_rate if pr.acked else None)
    report.add(setup, "cpu_primary", None if cpu_used[0] is None else cpu_used[0] / n * 1e6)
    report.add(setup, "cpu_backup", None if cpu_used[1] is None else cpu_used[1] / n * 1e6)
    report.add(setup, "p50", res.p50_ms)
    report.add(setup, "p99", res.p99_ms)
    report.add(setup, "recv", recv_summary(res, n) + ("" if pr.acked == n else f", PUBACKed {pub_summary(pr)}"))
    log(f"  {setup}: {rate or 0:,.0f} msgs/s, p50 {res.p50_ms} ms, p99 {res.p99_ms} ms; {recv_summary(res, n)}")
    if res.unique < n:
        report.note(f"{setup} (a/b): only {res.unique:,} of {n:,} arrived: {recv_summary(res, n)}")
    if backup is not None:
        row = backup_row(status(primary), backup.name)
        if row is None or row["state"] != "in_sync":
            report.note(f"{setup}: after a run the primary's row for its backup was {row} (not in_sync: the run's "
                        "sync acknowledgements may not have waited for it)")


# --------------------------------------------------------------------------- c: failover time


class FailoverClient:
    """An SDK client with the group's two addresses, waiting for messages on fo/#."""

    def __init__(self, first: Node, other: Node) -> None:
        self.arrived: dict[bytes, float] = {}
        self.connected: list[float] = []
        self.changed = threading.Condition()

        def on_event(event: Event) -> None:
            with self.changed:
                self.arrived.setdefault(event.payload, time.monotonic())
                self.changed.notify_all()

        self.client = DurableClient(
            "bench-failover", HOST, first.port, failover=[(HOST, other.port)],
            reconnect_min_delay=SDK_RECONNECT[0], reconnect_max_delay=SDK_RECONNECT[1],
            on_connected=lambda _info: self.connected.append(time.monotonic()),
        )  # fmt: skip
        self.client.subscribe("fo/#", qos=1, listener=on_event)
        self.client.connect(timeout=30.0)
        self.client.ready_for_events()

    def wait(self, payload: bytes, timeout: float) -> float | None:
        with self.changed:
            self.changed.wait_for(lambda: payload in self.arrived, timeout)
            return self.arrived.get(payload)

    def close(self) -> None:
        self.client.close(keep_session=False)


class Watcher:
    """Polls a backup while its primary dies: when its STATUS says primary, when its MQTT port
    first answers CONNACK 0 (and then publishes ``marker`` there)."""

    def __init__(self, node: Node, marker: bytes, timeout: float) -> None:
        self.node, self.marker = node, marker
        self.end = time.monotonic() + timeout
        self.t_role: float | None = None
        self.t_connack: float | None = None
        self.error = ""
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._role, daemon=True),
                        threading.Thread(target=self._serve, daemon=True)]
        for thread in self.threads:
            thread.start()

    def _role(self) -> None:
        while not self.stop.is_set() and time.monotonic() < self.end:
            st = status(self.node)
            if st is not None and st["role"] == "primary":
                self.t_role = time.monotonic()
                return
            self.stop.wait(POLL)

    def _serve(self) -> None:
        while not self.stop.is_set() and time.monotonic() < self.end:
            conn: RawConnection | None = None
            try:
                conn = RawConnection(self.node.port, 2.0)
                conn.connect(f"bench-watch-{time.monotonic_ns()}", LOGIN, clean=True, timeout=2.0)
            except (OSError, RawMqttError):
                if conn is not None:
                    conn.close(graceful=False)
                self.stop.wait(POLL)
                continue
            self.t_connack = time.monotonic()
            try:
                conn.sock.sendall(publish_packet("fo/x", 1, self.marker))
                conn.expect(PT_PUBACK, 10.0)
            except (OSError, RawMqttError) as exc:
                self.error = f"marker publish: {exc}"
            finally:
                conn.close()
            return

    def join(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(15.0)


def lease_log_time(path: Path, offset: int) -> float | None:
    """Wall-clock time of the first "took the leader lease" line written after ``offset``."""
    with contextlib.suppress(OSError), path.open("rb") as fh:
        fh.seek(offset)
        for raw in fh:
            line = raw.decode(errors="replace")
            if "took the leader lease" in line and line.startswith("["):
                with contextlib.suppress(ValueError):
                    return datetime.strptime(line[1:24], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return None


def one_failover(client: FailoverClient, primary: Node, backup: Node, number: int) -> FailoverRound:
    probe = f"probe-{number}".encode()
    publish_one(primary.port, "fo/x", probe)
    if client.wait(probe, 30.0) is None:
        return FailoverRound(problem=f"the SDK client did not get {probe!r} from {primary.name}")
    marker = f"failover-{number}".encode()
    watcher = Watcher(backup, marker, FAILOVER_WAIT)
    offset = backup.broker.log_path.stat().st_size
    connects = len(client.connected)
    t_wall, t_kill = time.time(), time.monotonic()
    primary.broker.kill()
    arrived = client.wait(marker, FAILOVER_WAIT)
    watcher.join()
    lease_wall = lease_log_time(backup.broker.log_path, offset)
    later = client.connected[connects:]
    result = FailoverRound(
        total=None if arrived is None else arrived - t_kill,
        lease_log=None if lease_wall is None else lease_wall - t_wall,
        lease_status=None if watcher.t_role is None else watcher.t_role - t_kill,
        connack=None if watcher.t_connack is None else watcher.t_connack - t_kill,
        client_connected=later[0] - t_kill if later else None,
        problem=watcher.error or ("" if arrived is not None else f"marker not delivered in {FAILOVER_WAIT:.0f}s"),
    )
    log(f"  failover {number + 1}: {primary.name} -> {backup.name}: total {result.total}, lease(log) "
        f"{result.lease_log}, role {result.lease_status}, CONNACK 0 {result.connack}, client {result.client_connected}")
    return result


def ha_settings(etcd: EtcdProcess, cluster: str, timing: dict[str, float], mode: str = "sync") -> dict[str, Any]:
    return {"role": "auto", "coordinator": [etcd.url], "cluster": cluster, "mode": mode, **timing}


@contextlib.contextmanager
def ha_pair(ctx: Ctx, etcd: EtcdProcess, label: str, timing: dict[str, float]) -> Iterator[tuple[Node, Node]]:
    """Two role-auto brokers of one cluster: the first bootstraps as primary, the second follows."""
    ha = ha_settings(etcd, label, timing)
    first = make_node(ctx, f"{label}-a", ha, ctx.args.broker_cpus)
    second = make_node(ctx, f"{label}-b", ha, ctx.args.backup_cpus)
    try:
        start_node(first, SERVING)
        start_node(second, REFUSING)
        wait_in_sync(first, second)
        yield first, second
    finally:
        stop_nodes([first, second])


def rejoin(old: Node, new: Node) -> float:
    """Restart the killed broker; it comes back as a backup of ``new``; seconds until in sync."""
    t0 = time.monotonic()
    start_node(old, REFUSING)
    wait_in_sync(new, old)
    return time.monotonic() - t0


def scenario_c(ctx: Ctx, report: Report, etcd: EtcdProcess) -> None:
    for label in ctx.args.timings:
        rounds: list[FailoverRound] = []
        report.failover[label] = rounds
        log(f"scenario c: {ctx.args.failovers} failovers, timing {label} {TIMINGS[label]}")
        with ha_pair(ctx, etcd, f"fo-{label}", TIMINGS[label]) as (first, second):
            client = FailoverClient(first, second)
            try:
                primary, backup = first, second
                for number in range(ctx.args.failovers):
                    rounds.append(one_failover(client, primary, backup, number))
                    rejoin(primary, backup)
                    primary, backup = backup, primary
            finally:
                client.close()


# --------------------------------------------------------------------------- d: loss across failovers


def acked_count(pub: ClientProcess) -> int:
    pub.send("count")
    count: int = pub.expect("count", 30.0)
    return count


def wait_progress(pub: ClientProcess, more: int, timeout: float) -> bool:
    """Wait until the publisher has ``more`` PUBACKs than now."""
    target = acked_count(pub) + more
    return wait_until(lambda: acked_count(pub) >= target, timeout, poll=0.1)


def failover_under_load(args: argparse.Namespace, report: Report, pub: ClientProcess, primary: Node, backup: Node,
                        *, rng: random.Random) -> None:
    loss = report.loss
    assert loss is not None
    if not wait_progress(pub, args.d_min_acks, 60.0):
        report.note(f"(d) the publisher did not get {args.d_min_acks} PUBACKs from {primary.name} within 60 s")
    time.sleep(rng.uniform(0.0, 0.3))  # a random point of the burst
    t_kill = time.monotonic()
    primary.broker.kill()
    if not wait_until(lambda: connack(backup.port) == SERVING, FAILOVER_WAIT, poll=POLL):
        raise BenchError(f"(d) {backup.name} did not take over within {FAILOVER_WAIT:.0f}s", backup.broker.log_tail())
    loss.failover_s.append(time.monotonic() - t_kill)
    loss.catchup_s.append(rejoin(primary, backup))
    loss.failovers += 1
    log(f"  (d) failover {loss.failovers}: {primary.name} -> {backup.name} in {loss.failover_s[-1]:.2f}s, "
        f"{primary.name} back in sync after {loss.catchup_s[-1]:.1f}s")


def count_loss(loss: LossResult, res: FollowPubResult, counts: bytearray) -> None:
    acked = res.acked
    loss.acked = res.acked_count
    missing = [seq for seq in range(len(acked)) if acked[seq] and not counts[seq]]
    loss.missing = len(missing)
    loss.missing_examples = missing[:10]
    loss.duplicates = sum(c - 1 for c in counts if c > 1)
    loss.unacked_delivered = sum(1 for seq in range(len(acked)) if not acked[seq] and counts[seq])
    loss.received = len(counts) - counts.count(0)


def scenario_d(ctx: Ctx, report: Report, etcd: EtcdProcess) -> None:
    args = ctx.args
    report.loss = loss = LossResult()
    rng = random.Random(args.seed)
    tag = ctx.tag()
    with ha_pair(ctx, etcd, "loss", FAST) as (first, second):
        session_roundtrip(first.port, "loss-sub", LOGIN, clean=False, topic="loss/#", timeout=30.0)
        spec = FollowPubSpec((first.port, second.port), "loss-pub", LOGIN, "loss/x", tag, args.d_cap,
                             args.inflight, args.d_rate, args.d_timeout, ctx.client_cpus)
        with ClientProcess("follow publisher", follow_publisher_main, spec) as pub:
            pub.expect("ready", CLIENT_START_S)
            pub.send("go")
            primary, backup = first, second
            try:
                for _ in range(args.loss_failovers):
                    failover_under_load(args, report, pub, primary, backup, rng=rng)
                    primary, backup = backup, primary
                wait_progress(pub, args.d_min_acks, 60.0)
            finally:
                pub.send("stop")
                res: FollowPubResult = pub.expect("result", 120.0)
        loss.pub = res
        log(f"  (d) publisher: {res.sent:,} sent, {res.acked_count:,} PUBACKed, {len(res.connects)} connections; "
            f"draining loss-sub from {primary.name}")
        drained = drain(primary.port, "loss-sub", LOGIN, tag, res.sent, wanted=res.sent, idle=args.idle,
                        timeout=max(300.0, res.sent / 500))
        loss.drain_end, loss.session_present = drained.end, drained.session_present
        count_loss(loss, res, drained.counts)
        log(f"  (d) {loss.received:,} distinct received, {loss.missing} acknowledged missing, "
            f"{loss.duplicates} duplicates ({drained.end})")


# --------------------------------------------------------------------------- e: catch-up of a new backup


def fill(ctx: Ctx, primary: Node, topic: str, n: int) -> float:
    tag = ctx.tag()
    timeout = max(600.0, n / 200)
    spec = PubSpec(primary.port, "fill-pub", LOGIN, topic, tag, n, ctx.args.inflight, timeout, 15.0,
                   ctx.client_cpus)
    with ClientProcess("fill publisher", publisher_main, spec) as pub:
        pr = run_publisher(pub, timeout)
    if pr.acked < n:
        raise BenchError(f"(e) filling the queue: {pub_summary(pr)}")
    return pr.ack_rate


class CatchupWatch:
    """Polls the primary's row for the new backup and the backup's own STATUS."""

    def __init__(self, primary: Node, backup: Node, out: CatchupResult) -> None:
        self.primary, self.backup, self.out = primary, backup, out
        self.t_row: float | None = None
        self.t_snapshot_done: float | None = None
        self.t_in_sync: float | None = None
        self.t_caught_up: float | None = None

    def poll(self) -> bool:
        now = time.monotonic()
        row = backup_row(status(self.primary), self.backup.name)
        if row is not None:
            if self.t_row is None:
                self.t_row = now
            state = row["state"]
            if not self.out.states or self.out.states[-1].split(" ")[0] != state:
                self.out.states.append(f"{state} at +{now - self.t_row:.2f}s")
            self.out.snapshot_rows = max(self.out.snapshot_rows, row["snapshot_rows"])  # kept after the snapshot
            if state != "snapshot" and self.t_snapshot_done is None:
                self.t_snapshot_done = now
            if state == "in_sync" and self.t_in_sync is None:
                self.t_in_sync = now
        if self.t_caught_up is None and (status(self.backup) or {}).get("caught_up"):
            self.t_caught_up = now
        return self.t_in_sync is not None and self.t_caught_up is not None


def scenario_e(ctx: Ctx, report: Report) -> None:
    args = ctx.args
    report.catchup = out = CatchupResult(backlog=args.backlog)
    primary = make_node(ctx, "e-primary", {"role": "primary", "mode": "sync"}, args.broker_cpus)
    backup = make_node(ctx, "e-backup", {"role": "backup", "mode": "sync", "primary": primary.listen},
                       args.backup_cpus)
    try:
        primary.broker.start(args.startup_timeout)
        session_roundtrip(primary.port, "catch-sub", LOGIN, clean=False, topic="catch/#", timeout=30.0)
        log(f"scenario e: queueing {args.backlog:,} messages on {primary.name}")
        out.fill_rate = fill(ctx, primary, "catch/fill", args.backlog)
        out.store_mb = dir_size(primary.broker.log_path.parent / "store") / 1e6
        spec = FollowPubSpec((primary.port,), "catch-pub", LOGIN, "catch/live", ctx.tag(), args.d_cap,
                             args.inflight, args.e_rate, SYNC_WAIT + 120.0, ctx.client_cpus)
        with ClientProcess("live publisher", follow_publisher_main, spec) as pub:
            pub.expect("ready", CLIENT_START_S)
            pub.send("go")
            wait_progress(pub, int(args.e_rate) or 100, 30.0)
            watch = CatchupWatch(primary, backup, out)
            log(f"  starting {backup.name} (empty store), publisher at {args.e_rate:g} msgs/s")
            t_spawn = time.monotonic()
            backup.broker.spawn()
            if not wait_until(lambda: watch.t_row is not None or watch.poll(), 60.0, poll=0.05):
                raise BenchError(f"(e) {backup.name} never connected to {primary.name}", backup.broker.log_tail())
            before = acked_count(pub)
            done = wait_until(watch.poll, SYNC_WAIT, poll=0.05)
            after = acked_count(pub)
            pub.send("stop")
            pub.expect("result", 60.0)
        if not done:
            raise BenchError(f"(e) {backup.name} not in sync within {SYNC_WAIT:.0f}s: {out.states}",
                             backup.broker.log_tail())
        assert watch.t_row is not None and watch.t_in_sync is not None and watch.t_caught_up is not None
        out.connect_to_in_sync = watch.t_in_sync - watch.t_row
        out.spawn_to_caught_up = watch.t_caught_up - t_spawn
        if watch.t_snapshot_done is not None:
            out.snapshot_s = watch.t_snapshot_done - watch.t_row
        out.published_during = after - before
        out.messages = args.backlog + after
        log(f"  (e) in sync after {out.connect_to_in_sync:.2f}s: {out.states}")
    finally:
        stop_nodes([primary, backup])


# --------------------------------------------------------------------------- report


def fmt(value: float | None, unit: str = "") -> str:
    return "—" if value is None else f"{fmt_number(value)}{unit}"


def fmt_list(values: list[float]) -> str:
    if not values:
        return "—"
    med = statistics.median(values)
    if len(values) == 1:
        return fmt_number(med)
    return f"{fmt_number(med)} ({fmt_number(min(values))}-{fmt_number(max(values))})"


def cell(runs: Runs | None) -> str:
    if runs is None:
        return "—"
    nums = runs.numbers()
    if nums and len(nums) == len(runs.values):
        return fmt_list(nums)
    texts = [str(v) for v in runs.values]
    if set(texts) == {"—"}:
        return "—"
    if len(set(texts)) == 1:
        return f"{texts[0]} (all {len(texts)} runs)".replace("|", "\\|")
    return " / ".join(texts).replace("|", "\\|")


def ratio_line(report: Report, setup: str, target: float, base: str = "single") -> tuple[str, str]:
    single = report.live.get(base, {}).get("rate")
    other = report.live.get(setup, {}).get("rate")
    s = single.median() if single else None
    o = other.median() if other else None
    if not s or o is None:
        return "—", "n/a"
    ratio = o / s
    return f"{ratio:.2f}x", "**met**" if ratio >= target else "**not met**"


def round_ratios(report: Report, setup: str, base: str) -> list[float]:
    """``setup``'s rate over ``base``'s, run by run (each run of the two close in time)."""
    a, b = report.live.get(setup, {}).get("rate"), report.live.get(base, {}).get("rate")
    if a is None or b is None:
        return []
    return [x / y for x, y in zip(a.values, b.values, strict=False)
            if isinstance(x, int | float) and isinstance(y, int | float) and y]


def render_ab(args: argparse.Namespace, report: Report) -> list[str]:
    labels = setup_labels(args)
    lines = [f"| metric | unit | {' | '.join(labels.values())} |", "|---|---|" + "---:|" * len(labels)]
    for key, label, unit in (("rate", "live throughput, end to end", "msgs/s"),
                             ("pub_rate", "publisher PUBACK rate", "msgs/s"),
                             ("cpu_primary", "CPU of the (primary) broker per message, live run", "µs"),
                             ("cpu_backup", "CPU of the backup broker per message, live run", "µs"),
                             ("per_batch", "messages per replicated batch (N / batches the primary numbered)", ""),
                             ("p50", "latency p50", "ms"), ("p99", "latency p99", "ms"), ("recv", "received", "")):
        cells = [cell(report.live.get(s, {}).get(key)) for s in labels]
        lines.append(f"| {label} | {unit} | {' | '.join(cells)} |")
    single_cpu = report.live.get("single", {}).get("cpu_primary")
    estimate = []
    for setup in labels:
        runs = report.live.get(setup, {}).get("cpu_primary")
        s, p = (single_cpu.median() if single_cpu else None), (runs.median() if runs else None)
        estimate.append("—" if not s or not p else f"{s / p:.2f}x")
    lines.append("| CPU-bound estimate: single's CPU per message / this broker's (a backup on a machine of its own, "
                 f"the broker's core the bottleneck) | | {' | '.join(estimate)} |")
    rows = [("(a) sync pair / single", "sync", "single", 0.7), ("(b) async pair / single", "async", "single", 0.9),
            ("sync pair / single broker with sync: true (both: a PUBACK waits for an fsync)", "sync", "fsync", 0.0),
            ("sync pair over mutual TLS / single", "tls", "single", 0.0),
            ("sync pair over mutual TLS / sync pair over plain TCP (the cost of replication.tls)", "tls", "sync", 0.0),
            (f"(a) at {args.baseline}: its sync pair / its single broker", "base-sync", "base-single", 0.7),
            (f"sync pair of this code / sync pair of {args.baseline}", "sync", "base-sync", 0.0),
            (f"(b) at {args.baseline}: its async pair / its single broker", "base-async", "base-single", 0.9),
            (f"async pair of this code / async pair of {args.baseline}", "async", "base-async", 0.0),
            (f"single broker of this code / single broker of {args.baseline}", "single", "base-single", 0.0)]
    lines += ["", "| ratio | of the medians | median of the per-run ratios (min-max) | target | met |",
              "|---|---:|---:|---|---|"]
    for text, setup, base, target in rows:
        if setup not in labels or base not in labels:
            continue
        value, met = ratio_line(report, setup, target, base=base)
        per_run = round_ratios(report, setup, base)
        spread = "—" if not per_run else (f"{statistics.median(per_run):.2f}x ({min(per_run):.2f}-"
                                          f"{max(per_run):.2f})")
        lines.append(f"| {text} | {value} | {spread} | {f'>= {target}x' if target else '(none)'} | "
                     f"{met if target else ''} |")
    return lines


def _vals(rounds: list[FailoverRound], get: Callable[[FailoverRound], float | None]) -> list[float]:
    return [v for v in map(get, rounds) if v is not None]


def render_c(report: Report) -> list[str]:
    lines = ["| timing (lease_ttl / loop_wait / demote_margin) | rounds ok | kill -> first message | "
             "lease: kill -> 'took the leader lease' (log) | kill -> STATUS role primary | "
             "promotion: lease (log) -> CONNACK 0 | kill -> CONNACK 0 | client: CONNACK 0 -> first message | "
             "kill -> SDK reconnected | target <= 3 s | met |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for label, rounds in report.failover.items():
        t = TIMINGS[label]
        total = _vals(rounds, lambda r: r.total)
        client = _vals(rounds, lambda r: None if r.total is None or r.connack is None else r.total - r.connack)
        promotion = _vals(rounds, lambda r: None if r.lease_log is None or r.connack is None
                          else r.connack - r.lease_log)
        med = statistics.median(total) if total else None
        met = "n/a" if med is None else "**met**" if med <= 3.0 else "**not met**"
        lines.append(
            f"| {label} ({t['lease_ttl']} / {t['loop_wait']} / {t['demote_margin']}) | {len(total)}/{len(rounds)} "
            f"| {fmt_list(total)} | {fmt_list(_vals(rounds, lambda r: r.lease_log))} "
            f"| {fmt_list(_vals(rounds, lambda r: r.lease_status))} | {fmt_list(promotion)} "
            f"| {fmt_list(_vals(rounds, lambda r: r.connack))} "
            f"| {fmt_list(client)} | {fmt_list(_vals(rounds, lambda r: r.client_connected))} | <= 3 s | {met} |"
        )
        for number, r in enumerate(rounds):
            if r.problem:
                report.note(f"(c) {label} round {number + 1}: {r.problem}")
    return lines


def render_d(report: Report) -> list[str]:
    loss = report.loss
    if loss is None or loss.pub is None:
        return ["(d) not measured"]
    pub = loss.pub
    met = "**met**" if loss.missing == 0 and loss.session_present else "**not met**"
    return [
        "| figure | value |", "|---|---:|",
        f"| failovers under load | {loss.failovers} |",
        f"| kill -> CONNACK 0 from the new primary, s | {fmt_list(loss.failover_s)} |",
        f"| killed broker restarted -> back in sync, s | {fmt_list(loss.catchup_s)} |",
        f"| published / PUBACKed | {pub.sent:,} / {pub.acked_count:,} |",
        f"| publisher connections (1 + reconnects) | {len(pub.connects)} |",
        f"| distinct payloads drained from the last primary | {loss.received:,} ({loss.drain_end}, "
        f"session_present={int(loss.session_present)}) |",
        f"| **acknowledged payloads missing** (target 0) | {loss.missing:,} {met} |",
        f"| duplicates (same payload twice) | {loss.duplicates:,} |",
        f"| delivered without a PUBACK (in flight at a kill) | {loss.unacked_delivered:,} |",
    ]


def render_e(report: Report) -> list[str]:
    c = report.catchup
    if c is None or c.connect_to_in_sync is None:
        return ["(e) not measured"]
    rate = c.messages / c.connect_to_in_sync
    rows = None if not c.snapshot_s else c.snapshot_rows / c.snapshot_s
    return [
        "| figure | value |", "|---|---:|",
        f"| queued on the primary before the backup joined | {c.backlog:,} (queued at {fmt_number(c.fill_rate)} "
        f"msgs/s; store {c.store_mb:.0f} MB) |",
        f"| backup's connect -> in_sync (primary's row) | {c.connect_to_in_sync:.2f} s |",
        f"| backup's spawn -> caught_up (its own STATUS) | {fmt(c.spawn_to_caught_up, ' s')} |",
        f"| snapshot phase | {fmt(c.snapshot_s, ' s')}, {c.snapshot_rows:,} rows |",
        f"| states seen | {', '.join(c.states)} |",
        f"| messages published (acknowledged) while it caught up | {c.published_during:,} |",
        f"| **catch-up rate** (backlog + everything acked by then) / (connect -> in_sync) | "
        f"{rate:,.0f} msgs/s ({c.messages:,} messages) |",
        f"| snapshot rate | {fmt(rows, ' rows/s')} |",
    ]


def render(args: argparse.Namespace, info: dict[str, str], command: str, report: Report, *,
           started: datetime, elapsed: float) -> str:
    pin = ("no CPU pinning" if not args.pin else
           f"single broker and primaries (and node a of c/d) on CPU {','.join(map(str, args.broker_cpus))}; "
           f"backups (and node b of c/d) on CPU {','.join(map(str, args.backup_cpus))}; load clients on CPU "
           f"{','.join(map(str, args.client_cpus))}")
    lines = [
        "# amqtt-durable replication benchmark (issue 12)", "",
        f"- date: {started.isoformat(timespec='seconds')}, wall time {elapsed:.0f}s",
        f"- command: `{command}`",
        f"- machine: nproc={info['nproc']}, RAM {info['ram']}, CPU {info['cpu']}, {info['os']}; "
        f"load average at start {info['load_start']}, at end {info['load_end']}",
        f"- python: {info['python']}", f"- packages: {info['packages']}",
        f"- code: {info.get('code', '?')}; git: {info.get('git', '?')}",
        f"- pinning: {pin}",
        f"- workload (a, b): N={args.n:,} QoS 1 messages of 64 bytes, at most {args.inflight} in flight, raw load "
        f"clients of bench_durable.py, {args.runs} runs per set-up interleaved; cells: median (min-max)",
        f"- c: SDK client DurableClient(failover=[...], reconnect_min_delay={SDK_RECONNECT[0]}, "
        f"reconnect_max_delay={SDK_RECONNECT[1]}); the marker is published by a raw client that polls the backup's "
        f"port every {POLL * 1000:.0f} ms until CONNACK 0; etcd: Debian's etcd-server, one member on 127.0.0.1",
        f"- d: sync mode, timing {FAST}, publisher {'unpaced' if not args.d_rate else f'{args.d_rate:g} msgs/s'} "
        f"with {args.inflight} in flight, a failover after >= {args.d_min_acks} new PUBACKs + 0-0.3 s",
        f"- scenarios: {args.only}{' (--quick)' if args.quick else ''}", "",
    ]
    if "a" in args.only or "b" in args.only:
        lines += ["## (a, b) live throughput: single broker vs sync, async and mutual-TLS sync pairs", "",
                  *render_ab(args, report), ""]
    if "c" in args.only:
        lines += ["## (c) failover time (median (min-max) in seconds)", "", *render_c(report), ""]
    if "d" in args.only:
        lines += ["## (d) acknowledged messages lost across failovers under load (sync mode)", "",
                  *render_d(report), ""]
    if "e" in args.only:
        lines += ["## (e) catch-up of a new backup under load", "", *render_e(report), ""]
    if report.ctx_notes.notes:
        lines += ["Notes:", "", *(f"- {n}" for n in report.ctx_notes.notes)]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- run


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=None, help="messages per live run of a/b (default 20000; quick 2000)")
    p.add_argument("--runs", type=int, default=None, help="live runs per set-up (default 3; quick 1)")
    p.add_argument("--inflight", type=int, default=100, help="max unacknowledged QoS 1 PUBLISHes (default 100)")
    p.add_argument("--failovers", type=int, default=None, help="failovers per timing in c (default 10; quick 3)")
    p.add_argument("--timings", default="fast,default",
                   help="c's timings, comma-separated: fast (2/0.3/0.5), default (5/1/1)")
    p.add_argument("--loss-failovers", type=int, default=None, help="failovers in d (default 10; quick 3)")
    p.add_argument("--d-rate", type=float, default=0.0, help="d's publisher rate in msgs/s (default 0: unpaced)")
    p.add_argument("--d-min-acks", type=int, default=None,
                   help="d: PUBACKs from the current primary before it is killed (default 2000; quick 300)")
    p.add_argument("--d-cap", type=int, default=3_000_000, help="most messages one d/e publisher may send")
    p.add_argument("--d-timeout", type=float, default=1800.0, help="time bound of d's publisher (s)")
    p.add_argument("--backlog", type=int, default=None, help="e: queued messages (default 200000; quick 20000)")
    p.add_argument("--e-rate", type=float, default=1000.0, help="e: publisher rate during catch-up (default 1000)")
    p.add_argument("--seed", type=int, default=12, help="d: seed of the kill points")
    p.add_argument("--quick", action="store_true", help="small numbers, for development")
    p.add_argument("--only", default="abcde", help="scenario letters to run (default abcde; a and b run together)")
    p.add_argument("--out", type=Path, default=None, help="also write the markdown report to this file")
    p.add_argument("--timeout", type=float, default=None, help="time bound per live phase (default max(60, N/100))")
    p.add_argument("--recovery-buffer", type=int, default=None,
                   help="the plugin's recovery_buffer, also the delivery window between two sent marks "
                        "(default: bench_durable's 100)")
    p.add_argument("--idle", type=float, default=10.0, help="receivers stop after this long without news (s)")
    p.add_argument("--startup-timeout", type=float, default=120.0, help="time bound for a broker start (s)")
    p.add_argument("--code", choices=("head", "worktree", "live"), default="worktree",
                   help="brokers and SDK from a copy of git HEAD or of the working tree taken at start (default "
                        "worktree), or 'live'")
    add_pin_arguments(p, "the single broker and the primaries", "the load clients")
    p.add_argument("--backup-cpus", type=lambda s: tuple(sorted({int(x) for x in s.split(",") if x.strip()})),
                   default=(1,), help="CPUs for the backups (default 1: beside the load clients, not on the "
                                      "primary's core, as if on another machine)")
    p.add_argument("--setups", default=",".join(SETUPS),
                   help=f"a/b set-ups to run, comma-separated (default all: {','.join(SETUPS)})")
    p.add_argument("--baseline", default=None, metavar="REF",
                   help="a/b: also run the single broker and the sync pair (and the async pair, when async is "
                        "among --setups) from the code of git REF (e.g. main), interleaved with the others")
    p.add_argument("--keep-tmp", action="store_true", help="keep the temporary folder (configs, logs, stores)")
    args = p.parse_args(argv)
    quick = args.quick
    for name, full, small in (("n", 20_000, 2000), ("runs", 3, 1), ("failovers", 10, 3), ("loss_failovers", 10, 3),
                              ("d_min_acks", 2000, 300), ("backlog", 200_000, 20_000)):
        if getattr(args, name) is None:
            setattr(args, name, small if quick else full)
    if args.timeout is None:
        args.timeout = max(60.0, args.n / 100)
    args.timings = [t.strip() for t in args.timings.split(",") if t.strip()]
    if not args.timings or set(args.timings) - set(TIMINGS):
        p.error(f"--timings takes names from {', '.join(TIMINGS)}")
    letters = set(args.only.lower())
    if not letters or letters - set("abcde"):
        p.error("--only takes letters from 'abcde'")
    args.only = "".join(sorted(letters))
    if min(args.n, args.runs, args.failovers, args.loss_failovers, args.backlog, args.inflight) < 1:
        p.error("sizes and counts must be positive")
    check_pin_arguments(p, args)
    args.setups = [t.strip() for t in args.setups.split(",") if t.strip()]
    if not args.setups or set(args.setups) - set(SETUPS):
        p.error(f"--setups takes names from {', '.join(SETUPS)}")
    args.baseline_path = None
    # what build_brokers reads: our broker only, run by this Python from the code copy on PYTHONPATH
    args.big, args.ours_standin, args.snapshot = args.backlog, False, False
    args.ours_cmd = shlex.join([sys.executable, "-m", "amqtt_durable.cli", "broker"])
    return args


def run(args: argparse.Namespace, tmp: Path, report: Report, info: dict[str, str]) -> None:
    _, _, info["code"] = use_code_snapshot(args.code, WATCHED, tmp, ROOT, report.note)
    if args.baseline:
        args.baseline_path = snapshot_packages(list(WATCHED.values()), tmp / "baseline", git_root=ROOT,
                                               ref=args.baseline)
        info["code"] += f"; baseline: copies of {args.baseline} ({ref_revision(ROOT, args.baseline)})"
    info["git"] = git_revision(ROOT, ["plugin", "client_sdk"])
    ctx = Ctx(args, tmp, LOGIN, report.ctx_notes, {}, None, args.client_cpus if args.pin else None)
    if "a" in args.only or "b" in args.only:
        guarded(report, "a/b", lambda: scenario_ab(ctx, report))
    if "e" in args.only:
        guarded(report, "e", lambda: scenario_e(ctx, report))
    if not set("cd") & set(args.only):
        return
    etcd = EtcdProcess(tmp / "etcd").start()
    try:
        if "c" in args.only:
            guarded(report, "c", lambda: scenario_c(ctx, report, etcd))
        if "d" in args.only:
            guarded(report, "d", lambda: scenario_d(ctx, report, etcd))
    finally:
        etcd.stop()


def guarded(report: Report, what: str, body: Callable[[], None]) -> None:
    t0 = time.perf_counter()
    try:
        body()
    except Exception as exc:
        report.note(f"scenario {what} failed: {type(exc).__name__}: {exc}")
        log(traceback.format_exc())
        if isinstance(exc, BenchError) and exc.detail:
            log(exc.detail)
    log(f"scenario {what} done in {time.perf_counter() - t0:.0f}s")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = shlex.join([sys.executable, *(sys.argv if argv is None else ["bench/bench_replication.py", *argv])])
    info = machine_info()
    info["load_start"] = " ".join(f"{v:.2f}" for v in os.getloadavg())
    report = Report(Results())
    started = datetime.now(UTC)
    t0 = time.perf_counter()
    run_in_temp_folder("bench_replication_", args.keep_tmp, lambda tmp: run(args, tmp, report, info), report.note)
    info["load_end"] = " ".join(f"{v:.2f}" for v in os.getloadavg())
    write_report(render(args, info, command, report, started=started, elapsed=time.perf_counter() - t0), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
