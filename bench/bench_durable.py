#!/usr/bin/env python3
"""Side-by-side benchmark: stock amqtt 0.12.1 vs amqtt-durable (LevelDB durable sessions).

Run with the project venv, e.g.

    .venv/bin/python bench/bench_durable.py                 # full run (N=20,000, big=1,000,000)
    .venv/bin/python bench/bench_durable.py --quick         # smoke run with small numbers
    .venv/bin/python bench/bench_durable.py --only abc --out out/bench.md

Scenarios (QoS1, 64-byte payloads, at most --inflight unacknowledged PUBLISHes):
  a  live throughput through a durable subscription: msgs/s end to end, p50/p99 latency
  b  offline enqueue: PUBACKs/s while the durable subscriber is disconnected
  c  replay on reconnect: msgs/s until all N arrived, CONNECT -> first replayed message
  d  durability: N queued offline, SIGKILL the broker, restart, count what arrives
  e  big backlog (--big messages) queued offline: peak broker RSS during enqueue and after
     restart, start-up time with the backlog (ours); stock RSS for the same backlog if it
     finishes within --stock-big-timeout

Stock amqtt only queues for offline clients whose session is not anonymous, so the stock
broker runs with allow_anonymous=false + FileAuthPlugin and every client logs in with a
username/password (to both brokers).  Both brokers run as separate subprocesses on their own
ephemeral 127.0.0.1 port; only those PIDs are ever signalled.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    BrokerProcess,
    Credentials,
    Deadline,
    Publisher,
    PublishResult,
    RssMonitor,
    Subscriber,
    changed_files,
    dir_size,
    fingerprint_digest,
    free_port,
    listener_config,
    log,
    machine_info,
    percentile,
    run_cleanup_connect,
    source_fingerprint,
    write_config,
    write_password_file,
)

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = ROOT / ".venv" / "bin"
PLUGIN_DIR = ROOT / "plugin" / "amqtt_durable"
STOCK = "stock"
OURS = "ours"
BROKER_TITLES = {STOCK: "stock amqtt", OURS: "amqtt-durable"}
USERNAME = "bench"
PASSWORD = "bench-password"
SETTLE_S = 0.5  # let the broker process a DISCONNECT before publishing to the now-offline session

Value = float | int | str | None


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    unit: str
    better: str  # "higher", "lower" or "" (informational)
    scenario: str  # letter the metric belongs to ("" = always shown)


METRICS: list[Metric] = [
    Metric("startup_empty", "start-up time, empty store (spawn -> CONNACK)", "s", "lower", ""),
    Metric("preflight", "preflight: 10 msgs queued offline, reconnect", "", "", ""),
    Metric("a_rate", "(a) live throughput, durable subscriber, end to end", "msgs/s", "higher", "a"),
    Metric("a_p50", "(a) latency p50", "ms", "lower", "a"),
    Metric("a_p99", "(a) latency p99", "ms", "lower", "a"),
    Metric("a_recv", "(a) received", "", "", "a"),
    Metric("b_rate", "(b) offline enqueue, PUBACKs", "msgs/s", "higher", "b"),
    Metric("b_acked", "(b) PUBACKed", "", "", "b"),
    Metric("c_rate", "(c) replay on reconnect (CONNECT -> all N)", "msgs/s", "higher", "c"),
    Metric("c_first", "(c) CONNECT -> first replayed message", "ms", "lower", "c"),
    Metric("c_recv", "(c) received after reconnect", "", "", "c"),
    Metric("d_survived", "(d) messages delivered after SIGKILL + restart", "msgs", "higher", "d"),
    Metric("d_detail", "(d) details", "", "", "d"),
    Metric("e_enq_rate", "(e) big backlog enqueue, PUBACKs", "msgs/s", "higher", "e"),
    Metric("e_enq_time", "(e) big backlog enqueue duration", "s", "lower", "e"),
    Metric("e_rss_idle", "(e) RSS before enqueue", "MiB", "lower", "e"),
    Metric("e_rss_enq", "(e) peak RSS during enqueue", "MiB", "lower", "e"),
    Metric("e_store", "(e) store size on disk", "MiB", "", "e"),
    Metric("e_stop", "(e) stop before restart", "", "", "e"),
    Metric("e_startup", "(e) start-up time with backlog (spawn -> CONNACK)", "s", "lower", "e"),
    Metric("e_rss_ready", "(e) peak RSS, restart until CONNACK", "MiB", "lower", "e"),
    Metric("e_first", "(e) after restart: CONNECT -> first replayed message", "ms", "lower", "e"),
    Metric("e_rss_replay", "(e) peak RSS, restart + replay probe", "MiB", "lower", "e"),
    Metric("e_probe", "(e) replay probe after restart", "", "", "e"),
]
METRIC_BY_KEY = {m.key: m for m in METRICS}


@dataclass
class Results:
    values: dict[str, dict[str, Value]] = field(default_factory=lambda: {STOCK: {}, OURS: {}})
    notes: list[str] = field(default_factory=list)

    def set(self, broker: str, key: str, value: Value) -> None:
        if key not in METRIC_BY_KEY:
            raise KeyError(key)
        self.values[broker][key] = value

    def note(self, text: str) -> None:
        log(f"NOTE: {text}")
        self.notes.append(text)


def fmt_value(value: Value) -> str:
    if value is None:
        return "—"
    if isinstance(value, str):
        return value.replace("|", "\\|")
    if isinstance(value, int):
        return f"{value:,}"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def fmt_ratio(ours: Value, stock: Value) -> str:
    if isinstance(ours, int | float) and isinstance(stock, int | float) and stock:
        return f"{ours / stock:.2f}x"
    return "—"


def mib(n_bytes: int) -> float:
    return n_bytes / 2**20


# --------------------------------------------------------------------------- run context


@dataclass
class Ctx:
    args: argparse.Namespace
    tmp: Path
    creds: Credentials
    results: Results
    brokers: dict[str, BrokerProcess]
    store_dir: Path | None
    counter: int = 0

    def tag(self) -> bytes:
        self.counter += 1
        return os.urandom(2) + self.counter.to_bytes(2, "big")

    def ids(self, scenario: str, broker: str, tag: bytes) -> tuple[str, str, str]:
        suffix = f"{scenario}-{broker}-{tag.hex()}"
        return f"bench/{suffix}", f"sub-{suffix}", f"pub-{suffix}"


def durable_subscribe_then_disconnect(ctx: Ctx, b: BrokerProcess, *, sub_id: str, topic: str, tag: bytes,
                                      n: int, deadline: Deadline) -> None:
    sub = Subscriber(b.port, sub_id, clean=False, creds=ctx.creds, tag=tag, n=n)
    try:
        sub.connect(deadline.remaining())
        sub.subscribe(topic, deadline.remaining())
    finally:
        sub.close()
    time.sleep(SETTLE_S)


def publish(ctx: Ctx, b: BrokerProcess, *, pub_id: str, topic: str, tag: bytes, n: int, deadline: Deadline,
            progress: float = 0.0) -> PublishResult:
    pub = Publisher(b.port, pub_id, ctx.creds, ctx.args.inflight)
    try:
        pub.connect(deadline.remaining())
        return pub.publish_seq(topic, tag, n, deadline.remaining(), progress_every=progress)
    finally:
        pub.close()


def reconnect_and_receive(ctx: Ctx, b: BrokerProcess, *, sub_id: str, tag: bytes, n: int, deadline: Deadline,
                          idle: float | None) -> Subscriber:
    sub = Subscriber(b.port, sub_id, clean=False, creds=ctx.creds, tag=tag, n=n)
    try:
        sub.connect(deadline.remaining())
        sub.wait_all(deadline.remaining(), idle=idle)
    finally:
        sub.close()
    return sub


def drop_session(ctx: Ctx, b: BrokerProcess, sub_id: str, timeout: float = 30.0) -> None:
    try:
        run_cleanup_connect(b.port, sub_id, ctx.creds, timeout)
    except Exception as exc:
        ctx.results.note(f"{b.name}: could not drop session {sub_id}: {exc}")


def recv_summary(sub: Subscriber, n: int) -> str:
    parts = [f"{sub.unique:,}/{n:,}"]
    if sub.duplicates:
        parts.append(f"{sub.duplicates:,} dup")
    if sub.foreign:
        parts.append(f"{sub.foreign:,} foreign")
    parts.append(f"session_present={int(bool(sub.session_present))}")
    return ", ".join(parts)


# --------------------------------------------------------------------------- scenarios


def preflight(ctx: Ctx, b: BrokerProcess) -> None:
    """Verify that the broker queues QoS1 messages for an offline durable session at all."""
    n = 10
    deadline = Deadline(60)
    tag = ctx.tag()
    topic, sub_id, pub_id = ctx.ids("pre", b.name, tag)
    durable_subscribe_then_disconnect(ctx, b, sub_id=sub_id, topic=topic, tag=tag, n=n,
                                      deadline=deadline)
    pr = publish(ctx, b, pub_id=pub_id, topic=topic, tag=tag, n=n, deadline=deadline)
    sub = reconnect_and_receive(ctx, b, sub_id=sub_id, tag=tag, n=n, deadline=deadline, idle=5.0)
    drop_session(ctx, b, sub_id)
    ok = sub.session_present and sub.unique == n and pr.acked == n
    ctx.results.set(b.name, "preflight", ("ok: " if ok else "FAILED: ") + recv_summary(sub, n))
    if not ok:
        ctx.results.note(f"{b.name}: preflight offline queueing FAILED ({recv_summary(sub, n)}, "
                         f"{pr.acked}/{n} acked) - its offline numbers are not meaningful")


def warmup(ctx: Ctx, b: BrokerProcess) -> None:
    n = 500
    deadline = Deadline(60)
    tag = ctx.tag()
    topic, sub_id, pub_id = ctx.ids("warm", b.name, tag)
    sub = Subscriber(b.port, sub_id, clean=True, creds=ctx.creds, tag=tag, n=n)
    try:
        sub.connect(deadline.remaining())
        sub.subscribe(topic, deadline.remaining())
        publish(ctx, b, pub_id=pub_id, topic=topic, tag=tag, n=n, deadline=deadline)
        sub.wait_all(deadline.remaining(), idle=5.0)
    finally:
        sub.close()


def scenario_a(ctx: Ctx, b: BrokerProcess) -> None:
    n = ctx.args.n
    r = ctx.results
    deadline = Deadline(ctx.args.timeout)
    tag = ctx.tag()
    topic, sub_id, pub_id = ctx.ids("a", b.name, tag)
    sub = Subscriber(b.port, sub_id, clean=False, creds=ctx.creds, tag=tag, n=n, record_latency=True)
    try:
        sub.connect(deadline.remaining())
        sub.subscribe(topic, deadline.remaining())
        pr = publish(ctx, b, pub_id=pub_id, topic=topic, tag=tag, n=n, deadline=deadline)
        sub.wait_all(deadline.remaining(), idle=ctx.args.idle)
    finally:
        sub.close()
    drop_session(ctx, b, sub_id)
    if sub.unique:
        r.set(b.name, "a_rate", sub.unique / ((sub.t_last_ns - pr.t_first_send_ns) / 1e9))
        lat = sorted(sub.latencies_ns)
        p50, p99 = percentile(lat, 50), percentile(lat, 99)
        r.set(b.name, "a_p50", None if p50 is None else p50 / 1e6)
        r.set(b.name, "a_p99", None if p99 is None else p99 / 1e6)
    r.set(b.name, "a_recv", recv_summary(sub, n) + ("" if pr.acked == n else f", only {pr.acked:,} PUBACKed"))
    if sub.unique < n:
        r.note(f"{b.name} (a): only {sub.unique:,} of {n:,} messages arrived within the time bound")


def scenario_bc(ctx: Ctx, b: BrokerProcess) -> None:
    n = ctx.args.n
    r = ctx.results
    deadline = Deadline(ctx.args.timeout)
    tag = ctx.tag()
    topic, sub_id, pub_id = ctx.ids("bc", b.name, tag)
    durable_subscribe_then_disconnect(ctx, b, sub_id=sub_id, topic=topic, tag=tag, n=n,
                                      deadline=deadline)
    pr = publish(ctx, b, pub_id=pub_id, topic=topic, tag=tag, n=n, deadline=deadline)
    r.set(b.name, "b_rate", pr.ack_rate if pr.acked else None)
    r.set(b.name, "b_acked", f"{pr.acked:,}/{n:,}" + (" (timed out)" if pr.timed_out else "")
          + (f" ({pr.error})" if pr.error else ""))
    if pr.acked < n:
        r.note(f"{b.name} (b): only {pr.acked:,} of {n:,} PUBACKs within the time bound")
    deadline = Deadline(ctx.args.timeout)
    sub = reconnect_and_receive(ctx, b, sub_id=sub_id, tag=tag, n=n, deadline=deadline, idle=ctx.args.idle)
    drop_session(ctx, b, sub_id)
    if sub.unique:
        r.set(b.name, "c_rate", sub.unique / ((sub.t_last_ns - sub.t_connect_ns) / 1e9))
        r.set(b.name, "c_first", (sub.t_first_ns - sub.t_connect_ns) / 1e6)
    r.set(b.name, "c_recv", recv_summary(sub, n))
    if sub.unique < n or not sub.session_present:
        r.note(f"{b.name} (c): reconnect got {recv_summary(sub, n)}")


def scenario_d(ctx: Ctx, b: BrokerProcess) -> None:
    n = ctx.args.n
    r = ctx.results
    deadline = Deadline(ctx.args.timeout)
    tag = ctx.tag()
    topic, sub_id, pub_id = ctx.ids("d", b.name, tag)
    durable_subscribe_then_disconnect(ctx, b, sub_id=sub_id, topic=topic, tag=tag, n=n,
                                      deadline=deadline)
    pr = publish(ctx, b, pub_id=pub_id, topic=topic, tag=tag, n=n, deadline=deadline)
    if pr.acked < n:
        r.note(f"{b.name} (d): only {pr.acked:,} of {n:,} PUBACKs before the kill")
    pid = b.pid
    b.kill()
    log(f"  {b.name}: SIGKILLed pid {pid}, restarting")
    startup = b.start(ctx.args.startup_timeout)
    deadline = Deadline(ctx.args.timeout)
    sub = reconnect_and_receive(ctx, b, sub_id=sub_id, tag=tag, n=n, deadline=deadline, idle=ctx.args.idle)
    drop_session(ctx, b, sub_id)
    r.set(b.name, "d_survived", sub.unique)
    r.set(b.name, "d_detail", f"{recv_summary(sub, n)}; {pr.acked:,} PUBACKed before kill; "
          f"restart {startup:.2f}s")


def scenario_e(ctx: Ctx, b: BrokerProcess) -> None:
    big = ctx.args.big
    r = ctx.results
    is_ours = b.name == OURS
    timeout = ctx.args.big_timeout if is_ours else ctx.args.stock_big_timeout
    tag = ctx.tag()
    topic, sub_id, pub_id = ctx.ids("e", b.name, tag)
    r.set(b.name, "e_rss_idle", mib(b.rss()))
    durable_subscribe_then_disconnect(ctx, b, sub_id=sub_id, topic=topic, tag=tag, n=big,
                                      deadline=Deadline(60))
    log(f"  {b.name}: enqueueing {big:,} messages offline (bound {timeout:.0f}s)")
    with RssMonitor(b.pid) as mon:
        pr = publish(ctx, b, pub_id=pub_id, topic=topic, tag=tag, n=big, deadline=Deadline(timeout),
                     progress=15.0)
    if pr.acked < big:
        why = f"took longer than {timeout:.0f}s ({pr.acked:,} of {big:,} PUBACKed)"
        if pr.error:
            why = f"failed after {pr.acked:,} PUBACKs: {pr.error}"
        r.set(b.name, "e_rss_enq", f"not measured: {why}")
        r.note(f"{b.name} (e): big enqueue {why}; peak RSS seen so far {mib(mon.peak):,.0f} MiB")
        restart_clean(ctx, b)
        return
    r.set(b.name, "e_enq_rate", pr.ack_rate)
    r.set(b.name, "e_enq_time", pr.seconds)
    r.set(b.name, "e_rss_enq", mib(mon.peak))
    if not is_ours:
        r.set(b.name, "e_startup", "n/a (backlog is not persisted)")
        restart_clean(ctx, b)
        return
    if ctx.store_dir is not None:
        r.set(b.name, "e_store", mib(dir_size(ctx.store_dir)))
    r.set(b.name, "e_stop", b.stop(timeout=ctx.args.stop_timeout))
    b.spawn()
    with RssMonitor(b.pid) as mon_restart:
        startup = b.wait_ready(ctx.args.startup_timeout)
        r.set(b.name, "e_startup", startup)
        mon_restart.stop()
        ready_peak = mon_restart.peak
    r.set(b.name, "e_rss_ready", mib(ready_peak))
    with RssMonitor(b.pid) as mon_replay:
        sub = Subscriber(b.port, sub_id, clean=False, creds=ctx.creds, tag=tag, n=big)
        try:
            sub.connect(60)
            # without session_present nothing can be replayed; do not wait for it
            got_first = bool(sub.session_present) and sub.wait_first(ctx.args.timeout)
            if got_first:
                sub.wait_all(ctx.args.probe_seconds)
        finally:
            sub.close()
    r.set(b.name, "e_rss_replay", mib(max(ready_peak, mon_replay.peak)))
    if sub.unique:
        r.set(b.name, "e_first", (sub.t_first_ns - sub.t_connect_ns) / 1e6)
    probe_s = (time.perf_counter_ns() - sub.t_connect_ns) / 1e9
    r.set(b.name, "e_probe", f"{recv_summary(sub, big)} in the first {probe_s:.1f}s")
    if not sub.session_present or not sub.unique:
        r.note(f"{b.name} (e): after restart the backlog was not replayed: {recv_summary(sub, big)}")
    log(f"  {b.name}: dropping the big session")
    drop_session(ctx, b, sub_id, timeout=ctx.args.startup_timeout)


def restart_clean(ctx: Ctx, b: BrokerProcess) -> None:
    """Restart a broker to free a huge in-memory backlog (stock) or after an aborted run."""
    how = b.stop(timeout=ctx.args.stop_timeout)
    log(f"  {b.name}: stopped ({how}), restarting")
    b.start(ctx.args.startup_timeout)


SCENARIOS: list[tuple[str, Callable[[Ctx, BrokerProcess], None]]] = [
    ("a", scenario_a),
    ("bc", scenario_bc),
    ("d", scenario_d),
    ("e", scenario_e),
]


# --------------------------------------------------------------------------- setup / report


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=None,
                   help="messages per scenario a-d (default 20000; quick 2000)")
    p.add_argument("--inflight", type=int, default=100,
                   help="max unacknowledged QoS1 PUBLISHes (default 100)")
    p.add_argument("--big", type=int, default=None,
                   help="backlog for scenario e (default 1000000; quick 20000)")
    p.add_argument("--quick", action="store_true", help="smoke run: small numbers and short time bounds")
    p.add_argument("--only", default="abcde", help="scenario letters to run, e.g. 'ad' (default abcde)")
    p.add_argument("--out", type=Path, default=None, help="also write the markdown report to this file")
    p.add_argument("--timeout", type=float, default=None,
                   help="time bound per phase of scenarios a-d in seconds (default max(60, N/100))")
    p.add_argument("--idle", type=float, default=None,
                   help="stop receiving after this many seconds without a new message (default 10; quick 5)")
    p.add_argument("--big-timeout", type=float, default=None,
                   help="time bound for our big enqueue (default max(600, big/250) s)")
    p.add_argument("--stock-big-timeout", type=float, default=None,
                   help="time bound for stock's big enqueue (default 600 s; quick 120 s)")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="time bound for a broker start (s)")
    p.add_argument("--stop-timeout", type=float, default=60.0, help="graceful stop before SIGKILL (s)")
    p.add_argument("--probe-seconds", type=float, default=5.0,
                   help="(e) how long to receive replayed messages after the restart (default 5)")
    p.add_argument("--ours-cmd", default=None,
                   help="command prefix for our broker (default: .venv/bin/amqtt-durable broker)")
    p.add_argument("--ours-standin", action="store_true",
                   help="development only: run stock amqtt (file auth) in place of amqtt-durable")
    p.add_argument("--keep-tmp", action="store_true", help="keep the temporary folder (configs, logs, store)")
    args = p.parse_args(argv)
    if args.n is None:
        args.n = 2000 if args.quick else 20_000
    if args.big is None:
        args.big = 20_000 if args.quick else 1_000_000
    if args.timeout is None:
        args.timeout = max(60.0, args.n / 100)
    if args.idle is None:
        args.idle = 5.0 if args.quick else 10.0
    if args.big_timeout is None:
        args.big_timeout = max(600.0, args.big / 250)
    if args.stock_big_timeout is None:
        args.stock_big_timeout = 120.0 if args.quick else 600.0
    letters = set(args.only.lower())
    if not letters or letters - set("abcde"):
        p.error("--only takes letters from 'abcde'")
    args.only = "".join(sorted(letters))
    if args.n < 1 or args.big < 1 or args.inflight < 1:
        p.error("--n, --big and --inflight must be positive")
    if args.n >= 2**32 or args.big >= 2**32:
        p.error("--n and --big must fit in 32 bits")
    return args


def build_brokers(args: argparse.Namespace, tmp: Path) -> tuple[dict[str, BrokerProcess], Path | None]:
    pw_file = tmp / "passwords.txt"
    write_password_file(pw_file, USERNAME, PASSWORD)
    creds = Credentials(USERNAME, PASSWORD)
    stock_plugins = {
        "amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": False},
        "amqtt.plugins.authentication.FileAuthPlugin": {"password_file": str(pw_file)},
    }
    brokers: dict[str, BrokerProcess] = {}

    stock_port = free_port()
    stock_cfg = tmp / "stock.yaml"
    write_config(stock_cfg, {"listeners": listener_config(stock_port), "plugins": stock_plugins})
    brokers[STOCK] = BrokerProcess(STOCK, [str(VENV_BIN / "amqtt"), "-c", str(stock_cfg)], stock_port,
                                   tmp / "stock.log", creds)

    ours_port = free_port()
    while ours_port == stock_port:  # bounded in practice: the kernel hands out a different port next time
        ours_port = free_port()
    ours_cfg = tmp / "ours.yaml"
    store: Path | None = None
    if args.ours_standin:
        write_config(ours_cfg, {"listeners": listener_config(ours_port), "plugins": stock_plugins})
        argv = [str(VENV_BIN / "amqtt"), "-c", str(ours_cfg)]
    else:
        store = tmp / "store"
        depth = max(2_000_000, 2 * args.big)
        write_config(ours_cfg, {
            "listeners": listener_config(ours_port),
            "plugins": {
                "amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True},
                "amqtt_durable.DurableSessionsPlugin": {
                    "store": str(store),
                    "max_depth": depth,
                    "max_depth_disconnected": depth,
                    "recovery_buffer": 100,
                    "session_expiry": 3600,
                },
            },
        })
        prefix = shlex.split(args.ours_cmd) if args.ours_cmd else [str(VENV_BIN / "amqtt-durable"), "broker"]
        argv = [*prefix, "-c", str(ours_cfg)]
    brokers[OURS] = BrokerProcess(OURS, argv, ours_port, tmp / "ours.log", creds)
    return brokers, store


def render(args: argparse.Namespace, info: dict[str, str], command: str, results: Results, *,
           started: datetime, elapsed: float) -> str:
    ours_title = BROKER_TITLES[OURS] + (" (STAND-IN: stock amqtt)" if args.ours_standin else "")
    lines = [
        "# amqtt-durable benchmark",
        "",
        f"- date: {started.isoformat(timespec='seconds')}, wall time {elapsed:.0f}s",
        f"- command: `{command}`",
        f"- machine: nproc={info['nproc']}, RAM {info['ram']}, CPU {info['cpu']}, {info['os']}",
        f"- python: {info['python']}",
        f"- packages: {info['packages']}",
        f"- amqtt-durable source: {PLUGIN_DIR.relative_to(ROOT)}/*.py sha256 {info['plugin_digest']}",
        f"- workload: N={args.n:,} QoS1 messages of 64 bytes per scenario, "
        f"at most {args.inflight} in flight, big backlog={args.big:,}, "
        f"scenarios={args.only}{' (--quick)' if args.quick else ''}",
        "- brokers run as separate processes on 127.0.0.1; stock uses allow_anonymous=false + FileAuthPlugin "
        "(needed for it to queue offline); the order alternates per scenario",
        "",
        f"| metric | unit | {BROKER_TITLES[STOCK]} | {ours_title} | ours/stock | better |",
        "|---|---|---:|---:|---:|---|",
    ]
    wanted = set(args.only) | {""}
    for m in METRICS:
        if m.scenario not in wanted:
            continue
        s, o = results.values[STOCK].get(m.key), results.values[OURS].get(m.key)
        if s is None and o is None:
            continue
        ratio = fmt_ratio(o, s) if m.better else "—"
        lines.append(f"| {m.label} | {m.unit} | {fmt_value(s)} | {fmt_value(o)} | {ratio} | {m.better} |")
    if results.notes:
        lines += ["", "Notes:", ""]
        lines += [f"- {n}" for n in results.notes]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace, tmp: Path, results: Results, info: dict[str, str]) -> None:
    brokers, store = build_brokers(args, tmp)
    ctx = Ctx(args, tmp, brokers[STOCK].creds, results, brokers, store)
    source_at_start = source_fingerprint(PLUGIN_DIR)
    info["plugin_digest"] = fingerprint_digest(source_at_start)
    try:
        for name, b in brokers.items():
            log(f"starting {name}: {shlex.join(b.argv)} (port {b.port})")
            results.set(name, "startup_empty", b.start(args.startup_timeout))
        for name, b in brokers.items():
            log(f"{name}: warm-up and preflight")
            warmup(ctx, b)
            preflight(ctx, b)
        index = 0
        for letters, fn in SCENARIOS:
            if not set(letters) & set(args.only):
                continue
            order = [STOCK, OURS] if index % 2 == 0 else [OURS, STOCK]
            index += 1
            for name in order:
                b = brokers[name]
                if not b.alive():
                    results.note(f"{name}: broker was not running before scenario {letters}; restarting it")
                    b.start(args.startup_timeout)
                log(f"scenario {letters}: {name}")
                t0 = time.perf_counter()
                try:
                    fn(ctx, b)
                except Exception as exc:
                    results.note(f"{name} scenario ({letters}) failed: {type(exc).__name__}: {exc}")
                    log(traceback.format_exc())
                    log(f"last lines of {b.log_path.name}:\n{b.log_tail()}")
                log(f"scenario {letters}: {name} done in {time.perf_counter() - t0:.1f}s")
        for name, b in brokers.items():
            if b.proc is not None and b.proc.poll() is not None:
                results.note(f"{name}: broker exited unexpectedly with {b.proc.returncode}; "
                             f"last log line: {b.last_log_line()!r}")
        if not args.ours_standin and (changed := changed_files(source_at_start, source_fingerprint(PLUGIN_DIR))):
            results.note("WARNING: the amqtt-durable source changed during this run "
                         f"({', '.join(changed)}); broker restarts picked up new code, so the 'ours' "
                         "numbers (and any store-format errors after a restart) mix plugin versions")
    finally:
        for name, b in brokers.items():
            how = b.stop(timeout=min(args.stop_timeout, 30.0))
            log(f"stopped {name}: {how}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = shlex.join([sys.executable, *(sys.argv if argv is None else ["bench/bench_durable.py", *argv])])
    ours_bin = VENV_BIN / "amqtt-durable"
    if not args.ours_standin and not args.ours_cmd and not ours_bin.exists():
        print(f"{ours_bin} does not exist; install the plugin (make setup) or use --ours-standin",
              file=sys.stderr)
        return 2
    info = machine_info()
    info["plugin_digest"] = "n/a"
    results = Results()
    if args.ours_standin:
        results.note("STAND-IN RUN: the 'ours' column is stock amqtt, not amqtt-durable")
    started = datetime.now(UTC)
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="bench_durable_"))
    try:
        run(args, tmp, results, info)
    except KeyboardInterrupt:
        results.note("interrupted")
    except Exception as exc:
        results.note(f"benchmark aborted: {type(exc).__name__}: {exc}")
        log(traceback.format_exc())
    finally:
        if args.keep_tmp:
            log(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    report = render(args, info, command, results, started=started, elapsed=time.perf_counter() - t0)
    print(report)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report, encoding="utf-8")
        log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
