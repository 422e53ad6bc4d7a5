#!/usr/bin/env python3
"""Side-by-side benchmark: stock amqtt 0.12.1 vs amqtt-durable (LevelDB durable sessions) vs Mosquitto.

Run with the project venv, e.g.

    .venv/bin/python bench/bench_durable.py --out bench/last-run.md   # full run (N=20,000, big=1,000,000)
    .venv/bin/python bench/bench_durable.py --quick                    # smoke run with small numbers
    .venv/bin/python bench/bench_durable.py --only abc --runs 5

Scenarios (QoS1, 64-byte payloads, at most --inflight unacknowledged PUBLISHes):
  a  live throughput through a durable subscription: msgs/s end to end, p50/p99 latency
  b  offline enqueue: PUBACKs/s while the durable subscriber is disconnected
  c  replay on reconnect: msgs/s until all N arrived, CONNECT -> first replayed message
  d  durability: N queued offline, SIGKILL the broker, restart, count what arrives
  e  big backlog (--big messages) queued offline: peak broker RSS during enqueue and after
     restart, start-up time with the backlog (ours); stock RSS for the same backlog if it
     finishes within --stock-big-timeout
a and b/c run --runs times per broker (median, min-max reported), interleaving the brokers;
which broker goes first rotates per run and scenario.

The load clients are raw MQTT 3.1.1 over plain sockets (_rawmqtt.py), publisher and subscriber
each in its own process, so neither an MQTT library nor the benchmark process is in the measured
path.  Their ceiling is measured first against a trivial in-bench sink ("client ceiling").

Mosquitto (Debian package, persistence on, installed by ensure_mosquitto in _common.py when missing; skipped
with a note when that fails, or with --no-mosquitto) is the third broker: same clients, same run, interleaved,
its own generated config in the temp folder (listener on 127.0.0.1, persistence in the temp folder, a
per-client queue as large as the backlogs, the same 100-message in-flight window as ours).

Stock amqtt only queues for offline clients whose session is not anonymous, so the stock
broker runs with allow_anonymous=false + FileAuthPlugin and every client logs in with a
username/password (to both brokers).  Both brokers run as separate subprocesses on their own
127.0.0.1 port from free_port (all three brokers); only those PIDs (and our client processes) are ever signalled.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    BROKER_TITLES,
    CLIENT_START_S,
    MOSQUITTO,
    OURS,
    PLUGIN_DIR,
    RESULT_MARGIN_S,
    ROOT,
    SETTLE_S,
    STOCK,
    VENV_BIN,
    BrokerProcess,
    RssMonitor,
    add_pin_arguments,
    changed_files,
    check_pin_arguments,
    describe_pinning,
    dir_size,
    ensure_mosquitto,
    fingerprint_digest,
    fmt_number,
    git_revision,
    log,
    machine_info,
    mosquitto_version,
    pub_summary,
    recv_summary,
    run_in_temp_folder,
    run_publisher,
    source_fingerprint,
    write_report,
)
from _harness import (
    METRICS,
    Ctx,
    Results,
    Runs,
    Value,
    build_brokers,
    drop_session,
    fmt_runs,
    live_rate,
    live_run,
    plugin_source_dir,
    start_publisher,
    sub_spec,
    warmup,
)
from _rawmqtt import (
    ClientProcess,
    PublishResult,
    PubSpec,
    ReceiveResult,
    SubSpec,
    publisher_main,
    session_roundtrip,
    sink_main,
    subscriber_main,
)

MB = 1_000_000


# --------------------------------------------------------------------------- results


def fmt_value(value: Value) -> str:
    if value is None:
        return "—"
    if isinstance(value, Runs):
        nums = value.numbers()
        if nums and len(nums) == len(value.values):
            med = value.median()
            assert med is not None
            if len(nums) == 1:
                return fmt_number(med)
            return f"{fmt_number(med)} ({fmt_number(min(nums))}-{fmt_number(max(nums))})"
        texts = [v if isinstance(v, str) else fmt_number(v) for v in value.values]
        if len(set(texts)) == 1:
            return f"{texts[0]} (all {len(texts)} runs)".replace("|", "\\|")
        return " / ".join(texts).replace("|", "\\|")
    if isinstance(value, str):
        return value.replace("|", "\\|")
    return fmt_number(value)


def number_of(value: Value) -> float | None:
    if isinstance(value, Runs):
        return value.median()
    if isinstance(value, int | float):
        return float(value)
    return None


def fmt_ratio(ours: Value, stock: Value) -> str:
    o, s = number_of(ours), number_of(stock)
    if o is not None and s:
        ratio = o / s
        return f"{ratio:.2f}x" if ratio >= 0.1 else f"{ratio:.2g}x"
    return "—"


def mb(n_bytes: int) -> float:
    return n_bytes / MB


# --------------------------------------------------------------------------- run context


def durable_subscribe_then_disconnect(ctx: Ctx, b: BrokerProcess, *, sub_id: str, topic: str) -> None:
    session_roundtrip(b.port, sub_id, ctx.login, clean=False, topic=topic, timeout=60.0)
    time.sleep(SETTLE_S)


def publish(ctx: Ctx, b: BrokerProcess, *, pub_id: str, topic: str, tag: bytes, n: int, timeout: float,
            progress: float = 0.0) -> PublishResult:
    with start_publisher(ctx, b, pub_id=pub_id, topic=topic, tag=tag, n=n, timeout=timeout,
                         progress=progress) as pub:
        pr = run_publisher(pub, timeout)
    if pr.flush_error:
        ctx.results.note(f"{b.name}: publisher {pub_id}: {pr.flush_error}")
    return pr


def receive(ctx: Ctx, b: BrokerProcess, spec: SubSpec) -> ReceiveResult:
    """Run a subscriber process to completion (reconnect to a stored session and count what arrives)."""
    with ClientProcess(f"{b.name} subscriber", subscriber_main, spec) as sub:
        sub.expect("ready", CLIENT_START_S)
        result: ReceiveResult = sub.expect("result", spec.timeout + RESULT_MARGIN_S)
    if result.error:
        ctx.results.note(f"{b.name}: subscriber {spec.client_id} ended with an error: {result.error}")
    return result


def reconnect_and_receive(ctx: Ctx, b: BrokerProcess, *, sub_id: str, tag: bytes, n: int) -> ReceiveResult:
    return receive(ctx, b, sub_spec(ctx, b, sub_id=sub_id, tag=tag, n=n, timeout=ctx.args.timeout,
                                    idle=ctx.args.idle, need_session=True))


# --------------------------------------------------------------------------- client ceiling


def measure_ceiling(ctx: Ctx) -> None:
    """Raw publisher and subscriber against a trivial sink that acks / sources as fast as it can."""
    c = ctx.results.ceiling
    c.n = ctx.args.ceiling_n
    sink_cpus = None if ctx.client_cpus is None else ctx.args.broker_cpus
    try:
        with ClientProcess("sink", sink_main, (ctx.args.inflight, sink_cpus)) as sink:
            port: int = sink.expect("ready", CLIENT_START_S)
            for i in range(ctx.args.runs):
                tag = ctx.tag()
                spec = PubSpec(port, f"ceiling-pub-{i}", ctx.login, "ceiling/in", tag, c.n, ctx.args.inflight, 120.0,
                               cpus=ctx.client_cpus)
                with ClientProcess("ceiling publisher", publisher_main, spec) as pub:
                    pr = run_publisher(pub, 120.0)
                if pr.acked < c.n or pr.error:
                    raise RuntimeError(f"publisher against the sink: {pub_summary(pr)}")
                c.pub_rates.append(pr.ack_rate)
                sspec = SubSpec(port, f"ceiling-sub-{i}", ctx.login, True, tag, c.n, 120.0, idle=10.0,
                                subscribe=f"ceiling/{c.n}/{tag.hex()}", cpus=ctx.client_cpus)
                with ClientProcess("ceiling subscriber", subscriber_main, sspec) as sub:
                    sub.expect("ready", CLIENT_START_S)
                    rr: ReceiveResult = sub.expect("result", 120.0 + RESULT_MARGIN_S)
                if rr.unique < c.n or rr.error:
                    raise RuntimeError(f"subscriber against the sink: {recv_summary(rr, c.n)}")
                c.sub_rates.append(rr.unique / max(1e-9, (rr.t_last_ns - rr.t_connack_ns) / 1e9))
                log(f"  ceiling run {i + 1}: publisher {c.pub_rates[-1]:,.0f} PUBACKs/s, "
                    f"subscriber {c.sub_rates[-1]:,.0f} msgs/s")
            sink.send("stop")
    except Exception as exc:
        c.error = f"{type(exc).__name__}: {exc}"
        ctx.results.note(f"client ceiling measurement failed: {c.error}")


# --------------------------------------------------------------------------- scenarios


def preflight(ctx: Ctx, b: BrokerProcess) -> None:
    """Verify that the broker queues QoS1 messages for an offline durable session at all."""
    n = 10
    tag = ctx.tag()
    topic, sub_id, pub_id = ctx.ids("pre", b.name, tag)
    durable_subscribe_then_disconnect(ctx, b, sub_id=sub_id, topic=topic)
    pr = publish(ctx, b, pub_id=pub_id, topic=topic, tag=tag, n=n, timeout=60.0)
    res = receive(ctx, b, sub_spec(ctx, b, sub_id=sub_id, tag=tag, n=n, timeout=60.0, idle=5.0))
    drop_session(ctx, b, sub_id)
    ok = res.session_present and res.unique == n and pr.acked == n
    ctx.results.set(b.name, "preflight", ("ok: " if ok else "FAILED: ") + recv_summary(res, n))
    if not ok:
        ctx.results.note(f"{b.name}: preflight offline queueing FAILED ({recv_summary(res, n)}, "
                         f"{pr.acked}/{n} acked) - its offline numbers are not meaningful")


def scenario_a(ctx: Ctx, b: BrokerProcess) -> None:
    n = ctx.args.n
    r = ctx.results
    pr, res, sub_id = live_run(ctx, b, scenario="a", n=n, clean=False, record_latency=True)
    drop_session(ctx, b, sub_id)
    rate = live_rate(pr, res)
    r.add(b.name, "a_rate", rate)
    r.add(b.name, "a_p50", res.p50_ms)
    r.add(b.name, "a_p99", res.p99_ms)
    r.add(b.name, "a_recv", recv_summary(res, n) + ("" if pr.acked == n else f", PUBACKed {pub_summary(pr)}"))
    log(f"  {b.name} (a): {rate or 0:,.0f} msgs/s, p50 {res.p50_ms} ms, p99 {res.p99_ms} ms; "
        f"{recv_summary(res, n)}; ended: {res.end}")
    if res.unique < n:
        r.note(f"{b.name} (a): only {res.unique:,} of {n:,} messages arrived: {recv_summary(res, n)}")


def scenario_bc(ctx: Ctx, b: BrokerProcess) -> None:
    n = ctx.args.n
    r = ctx.results
    tag = ctx.tag()
    topic, sub_id, pub_id = ctx.ids("bc", b.name, tag)
    durable_subscribe_then_disconnect(ctx, b, sub_id=sub_id, topic=topic)
    pr = publish(ctx, b, pub_id=pub_id, topic=topic, tag=tag, n=n, timeout=ctx.args.timeout)
    r.add(b.name, "b_rate", pr.ack_rate if pr.acked else None)
    r.add(b.name, "b_routed", pr.routed_rate)
    r.add(b.name, "b_acked", pub_summary(pr))
    if pr.acked < n:
        r.note(f"{b.name} (b): only {pub_summary(pr)} PUBACKs within the time bound")
    res = reconnect_and_receive(ctx, b, sub_id=sub_id, tag=tag, n=n)
    drop_session(ctx, b, sub_id)
    c_rate = c_first = None
    if res.unique:
        c_rate = res.unique / ((res.t_last_ns - res.t_connect_ns) / 1e9)
        c_first = (res.t_first_ns - res.t_connect_ns) / 1e6
    r.add(b.name, "c_rate", c_rate)
    r.add(b.name, "c_first", c_first)
    r.add(b.name, "c_recv", recv_summary(res, n))
    log(f"  {b.name} (b): {pr.ack_rate:,.0f} PUBACKs/s, {pr.routed_rate or 0:,.0f}/s routed; "
        f"(c): {c_rate or 0:,.0f} msgs/s, first after {c_first} ms; {recv_summary(res, n)}; ended: {res.end}")
    if res.unique < n or not res.session_present:
        r.note(f"{b.name} (c): reconnect got {recv_summary(res, n)}")


def scenario_d(ctx: Ctx, b: BrokerProcess) -> None:
    n = ctx.args.n
    r = ctx.results
    tag = ctx.tag()
    topic, sub_id, pub_id = ctx.ids("d", b.name, tag)
    durable_subscribe_then_disconnect(ctx, b, sub_id=sub_id, topic=topic)
    pr = publish(ctx, b, pub_id=pub_id, topic=topic, tag=tag, n=n, timeout=ctx.args.timeout)
    if pr.acked < n:
        r.note(f"{b.name} (d): only {pub_summary(pr)} PUBACKs before the kill")
    pid = b.pid
    b.kill()
    log(f"  {b.name}: SIGKILLed pid {pid}, restarting")
    startup = b.start(ctx.args.startup_timeout)
    res = reconnect_and_receive(ctx, b, sub_id=sub_id, tag=tag, n=n)
    drop_session(ctx, b, sub_id)
    r.set(b.name, "d_survived", res.unique)
    r.set(b.name, "d_detail", f"{recv_summary(res, n)} ({100 * res.unique / n:.0f}%); "
          f"{pr.acked:,} PUBACKed before kill; restart {startup:.2f}s")


def scenario_e(ctx: Ctx, b: BrokerProcess) -> None:
    big = ctx.args.big
    r = ctx.results
    persists = b.name != STOCK  # ours and Mosquitto keep the backlog over a graceful restart
    timeout = ctx.args.big_timeout if persists else ctx.args.stock_big_timeout
    tag = ctx.tag()
    topic, sub_id, pub_id = ctx.ids("e", b.name, tag)
    r.set(b.name, "e_rss_idle", mb(b.rss()))
    durable_subscribe_then_disconnect(ctx, b, sub_id=sub_id, topic=topic)
    log(f"  {b.name}: enqueueing {big:,} messages offline (bound {timeout:.0f}s)")
    with start_publisher(ctx, b, pub_id=pub_id, topic=topic, tag=tag, n=big, timeout=timeout,
                         progress=15.0) as pub:
        pub.expect("ready", CLIENT_START_S)  # pre-encoding happens before this, outside the measurement
        with RssMonitor(b.pid) as mon:
            pr = run_publisher(pub, timeout, ready_seen=True)
    if pr.flush_error:
        r.note(f"{b.name} (e): {pr.flush_error}")
    if pr.acked < big:
        why = f"took longer than {timeout:.0f}s ({pub_summary(pr)} PUBACKed)"
        if pr.error:
            why = f"failed after {pr.acked:,} PUBACKs: {pr.error}"
        r.set(b.name, "e_rss_enq", f"not measured: {why}")
        r.note(f"{b.name} (e): big enqueue {why}; peak RSS seen so far {mb(mon.peak):,.0f} MB")
        restart_clean(ctx, b)
        return
    r.set(b.name, "e_enq_rate", pr.ack_rate)
    r.set(b.name, "e_enq_time", pr.seconds)
    r.set(b.name, "e_routed_time", pr.routed_seconds)
    r.set(b.name, "e_rss_enq", mb(mon.peak))
    log(f"  {b.name}: {big:,} enqueued in {pr.seconds:.1f}s ({pr.ack_rate:,.0f}/s), peak RSS {mb(mon.peak):.0f} MB")
    if not persists:
        r.set(b.name, "e_startup", "n/a (backlog is not persisted)")
        r.set(b.name, "e_stop", restart_clean(ctx, b))
        return
    if b.name == OURS and ctx.store_dir is not None:
        r.set(b.name, "e_store", mb(dir_size(ctx.store_dir)))
    r.set(b.name, "e_stop", b.stop(timeout=ctx.args.stop_timeout))
    if b.name == MOSQUITTO:  # Mosquitto writes its persistence file (in its own folder) on the graceful stop
        r.set(b.name, "e_store", mb(dir_size(b.log_path.parent)))
    b.spawn()
    with RssMonitor(b.pid) as mon_restart:
        startup = b.wait_ready(ctx.args.startup_timeout)
        r.set(b.name, "e_startup", startup)
        mon_restart.stop()
        ready_peak = mon_restart.peak
    r.set(b.name, "e_rss_ready", mb(ready_peak))
    probe = ctx.args.probe_seconds
    with RssMonitor(b.pid) as mon_replay:
        res = receive(ctx, b, sub_spec(ctx, b, sub_id=sub_id, tag=tag, n=big, timeout=ctx.args.timeout + probe,
                                       need_session=True, after_first=probe or None))
    r.set(b.name, "e_rss_replay", mb(max(ready_peak, mon_replay.peak)))
    if res.unique:
        r.set(b.name, "e_first", (res.t_first_ns - res.t_connect_ns) / 1e6)
    probe_s = (max(res.t_last_ns, res.t_connack_ns) - res.t_connect_ns) / 1e9
    r.set(b.name, "e_probe", f"{recv_summary(res, big)} in {probe_s:.1f} s")
    if not res.session_present or not res.unique:
        r.note(f"{b.name} (e): after restart the backlog was not replayed: {recv_summary(res, big)}")
    log(f"  {b.name}: dropping the big session")
    drop_session(ctx, b, sub_id, timeout=ctx.args.startup_timeout)


def restart_clean(ctx: Ctx, b: BrokerProcess) -> str:
    """Restart a broker to free a huge in-memory backlog (stock) or after an aborted run; say how it stopped."""
    how = b.stop(timeout=ctx.args.stop_timeout)
    log(f"  {b.name}: stopped ({how}), restarting")
    b.start(ctx.args.startup_timeout)
    return how


# (letters, function, repeated --runs times?)
SCENARIOS: list[tuple[str, Callable[[Ctx, BrokerProcess], None], bool]] = [
    ("a", scenario_a, True),
    ("bc", scenario_bc, True),
    ("d", scenario_d, False),
    ("e", scenario_e, False),
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
    p.add_argument("--runs", type=int, default=3,
                   help="repetitions of the throughput scenarios a and b/c per broker (default 3; median reported)")
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
    p.add_argument("--probe-seconds", type=float, default=0.0,
                   help="(e) receive replayed messages after the restart only this long (default 0: drain all)")
    p.add_argument("--ceiling-n", type=int, default=None,
                   help="messages per client-ceiling run against the sink (default 200000; quick 50000)")
    add_pin_arguments(p, "the brokers", "the load clients")
    p.add_argument("--snapshot", action=argparse.BooleanOptionalAction, default=True,
                   help="run our broker from a copy of plugin/amqtt_durable taken at start, so edits to the source "
                        "during the run cannot mix plugin versions (default on)")
    p.add_argument("--ours-cmd", default=None,
                   help="command prefix for our broker (default: .venv/bin/amqtt-durable broker)")
    p.add_argument("--ours-standin", action="store_true",
                   help="development only: run stock amqtt (file auth) in place of amqtt-durable")
    p.add_argument("--keep-tmp", action="store_true", help="keep the temporary folder (configs, logs, store)")
    p.add_argument("--mosquitto", action=argparse.BooleanOptionalAction, default=True,
                   help="run Mosquitto as a third broker, installing the Debian package when missing (default on)")
    args = p.parse_args(argv)
    fill_defaults(args)
    letters = set(args.only.lower())
    if not letters or letters - set("abcde"):
        p.error("--only takes letters from 'abcde'")
    args.only = "".join(sorted(letters))
    if args.n < 1 or args.big < 1 or args.inflight < 1 or args.runs < 1 or args.ceiling_n < 1:
        p.error("--n, --big, --inflight, --runs and --ceiling-n must be positive")
    if args.inflight >= 65535:
        p.error("--inflight must be below 65535 (packet ids)")
    if max(args.n, args.big, args.ceiling_n) >= 2**32:
        p.error("--n, --big and --ceiling-n must fit in 32 bits")
    check_pin_arguments(p, args)
    return args


def fill_defaults(args: argparse.Namespace) -> None:
    """Sizes and timeouts left unset: by --quick, and the timeouts by the sizes."""
    quick = args.quick
    defaults = {"n": 2000 if quick else 20_000, "big": 20_000 if quick else 1_000_000,
                "ceiling_n": 50_000 if quick else 200_000, "idle": 5.0 if quick else 10.0,
                "stock_big_timeout": 120.0 if quick else 600.0}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.timeout is None:
        args.timeout = max(60.0, args.n / 100)
    if args.big_timeout is None:
        args.big_timeout = max(600.0, args.big / 250)


def render_ceiling(args: argparse.Namespace, results: Results) -> list[str]:
    c = results.ceiling
    if c.error or not c.pub_rates or not c.sub_rates:
        return [f"- client ceiling: not measured ({c.error or 'skipped'})"]
    lines = [
        f"- client ceiling (the raw load clients against a trivial in-bench Python sink that acks or sources "
        f"as fast as it can, {c.n:,} msgs, {args.inflight} in flight, median (min-max) of {len(c.pub_rates)}): "
        f"publisher {fmt_runs(c.pub_rates)} PUBACKs/s, subscriber {fmt_runs(c.sub_rates)} msgs/s. "
        "The sink is Python too, so these are lower bounds of what the clients can do."
    ]
    broker_rates = [number_of(results.values[b].get(k)) for b in results.values
                    for k in ("a_rate", "b_rate", "c_rate", "e_enq_rate")]
    fastest = max((v for v in broker_rates if v is not None), default=None)
    if fastest is not None:
        ceiling = min(statistics.median(c.pub_rates), statistics.median(c.sub_rates))
        lines.append(f"- the fastest broker figure in the table ({fastest:,.0f} msgs/s) is "
                     f"{100 * fastest / ceiling:.1f}% of the lower client ceiling, so the figures are broker-bound")
    return lines


def render(args: argparse.Namespace, info: dict[str, str], command: str, results: Results, *,
           started: datetime, elapsed: float) -> str:
    ours_title = BROKER_TITLES[OURS] + (" (STAND-IN: stock amqtt)" if args.ours_standin else "")
    pinning = describe_pinning(args, "client processes")
    lines = [
        "# amqtt-durable benchmark",
        "",
        f"- date: {started.isoformat(timespec='seconds')}, wall time {elapsed:.0f}s",
        f"- command: `{command}`",
        f"- machine: nproc={info['nproc']}, RAM {info['ram']}, CPU {info['cpu']}, {info['os']}",
        f"- python: {info['python']}",
        f"- packages: {info['packages']}",
        f"- amqtt-durable source: {PLUGIN_DIR.relative_to(ROOT)}/*.py sha256 {info['plugin_digest']} "
        f"(broker ran from {info.get('plugin_source', 'the working tree')}); git: {info.get('git', '?')}",
        f"- workload: N={args.n:,} QoS1 messages of 64 bytes per scenario, "
        f"at most {args.inflight} in flight, big backlog={args.big:,}, "
        f"scenarios={args.only}{' (--quick)' if args.quick else ''}",
        f"- load clients: raw MQTT 3.1.1 over sockets, publisher and subscriber each in its own process; {pinning}",
        f"- a and b/c: {args.runs} runs per broker, brokers interleaved; cells show median (min-max), "
        "ratios and targets use the medians; RSS in MB = 10^6 bytes",
        "- brokers run as separate processes on 127.0.0.1; stock uses allow_anonymous=false + FileAuthPlugin "
        "(needed for it to queue offline); which broker goes first rotates per run and scenario",
        f"- {info.get('mosquitto', 'Mosquitto: not run')}",
        *render_ceiling(args, results),
        "",
        f"| metric | unit | {BROKER_TITLES[STOCK]} | {ours_title} | {BROKER_TITLES[MOSQUITTO]} | ours/stock "
        "| ours/Mosquitto | better | target | met |",
        "|---|---|---:|---:|---:|---:|---:|---|---|---|",
    ]
    wanted = set(args.only) | {""}
    for m in METRICS:
        if m.scenario not in wanted:
            continue
        s, o = results.values[STOCK].get(m.key), results.values[OURS].get(m.key)
        q = results.values[MOSQUITTO].get(m.key)
        if s is None and o is None and q is None:
            continue
        ratio = fmt_ratio(o, s) if m.better else "—"
        ratio_q = fmt_ratio(o, q) if m.better else "—"
        target, met = "", ""
        if m.target is not None:
            target = m.target.text
            verdict = m.target.check(number_of(s), number_of(o), args)
            met = "n/a" if verdict is None else ("**met**" if verdict else "**not met**")
        lines.append(f"| {m.label} | {m.unit} | {fmt_value(s)} | {fmt_value(o)} | {fmt_value(q)} | {ratio} "
                     f"| {ratio_q} | {m.better} "
                     f"| {target} | {met} |")
    if results.notes:
        lines += ["", "Notes:", ""]
        lines += [f"- {n}" for n in results.notes]
    return "\n".join(lines) + "\n"


def run_scenarios(ctx: Ctx, brokers: dict[str, BrokerProcess]) -> None:
    """The scenarios of --only, interleaving the brokers: who goes first rotates per run and scenario."""
    args = ctx.args
    index = 0
    for letters, fn, repeated in SCENARIOS:
        if not set(letters) & set(args.only):
            continue
        for rep in range(args.runs if repeated else 1):
            names = list(brokers)  # stock, ours[, mosquitto]
            shift = (index + rep) % len(names)
            for name in names[shift:] + names[:shift]:
                run_one(ctx, brokers[name], letters, fn, f" run {rep + 1}" if repeated else "")
        index += 1


def run(args: argparse.Namespace, tmp: Path, results: Results, info: dict[str, str]) -> None:
    brokers, store = build_brokers(args, tmp, mosquitto=info.get("mosquitto_bin"))
    ctx = Ctx(args, tmp, brokers[STOCK].login, results, brokers, store, args.client_cpus if args.pin else None)
    source_dir = plugin_source_dir(args, tmp)
    source_at_start = source_fingerprint(source_dir)
    info["plugin_digest"] = fingerprint_digest(source_at_start)
    info["git"] = git_revision(ROOT, ["plugin"])
    info["plugin_source"] = ("a snapshot copy taken at start" if source_dir != PLUGIN_DIR else "the working tree")
    if source_dir != PLUGIN_DIR and (drift := changed_files(source_fingerprint(PLUGIN_DIR), source_at_start)):
        results.note(f"the working tree's amqtt_durable differs from the snapshot in {', '.join(drift)} "
                     "(edited while the snapshot was taken?)")
    try:
        log("client ceiling against the in-bench sink")
        measure_ceiling(ctx)
        for name, b in brokers.items():
            log(f"starting {name}: {shlex.join(b.argv)} (port {b.port})")
            results.set(name, "startup_empty", b.start(args.startup_timeout))
        for name, b in brokers.items():
            log(f"{name}: warm-up and preflight")
            warmup(ctx, b)
            preflight(ctx, b)
        run_scenarios(ctx, brokers)
        for name, b in brokers.items():
            if b.proc is not None and b.proc.poll() is not None:
                results.note(f"{name}: broker exited unexpectedly with {b.proc.returncode}; "
                             f"last log line: {b.last_log_line()!r}")
        if not args.ours_standin and (changed := changed_files(source_at_start, source_fingerprint(PLUGIN_DIR))):
            if source_dir != PLUGIN_DIR:
                results.note(f"the amqtt-durable working tree changed during this run ({', '.join(changed)}); "
                             "the broker ran from the snapshot, so all 'ours' numbers are from one version")
            else:
                results.note("WARNING: the amqtt-durable source changed during this run "
                             f"({', '.join(changed)}); broker restarts picked up new code, so the 'ours' "
                             "numbers (and any store-format errors after a restart) mix plugin versions")
    finally:
        for name, b in brokers.items():
            how = b.stop(timeout=min(args.stop_timeout, 30.0))
            log(f"stopped {name}: {how}")


def run_one(ctx: Ctx, b: BrokerProcess, letters: str, fn: Callable[[Ctx, BrokerProcess], None], what: str) -> None:
    results = ctx.results
    if not b.alive():
        results.note(f"{b.name}: broker was not running before scenario {letters}{what}; restarting it")
        b.start(ctx.args.startup_timeout)
    log(f"scenario {letters}{what}: {b.name}")
    t0 = time.perf_counter()
    try:
        fn(ctx, b)
    except Exception as exc:
        results.note(f"{b.name} scenario ({letters}){what} failed: {type(exc).__name__}: {exc}")
        log(traceback.format_exc())
        log(f"last lines of {b.log_path.name}:\n{b.log_tail()}")
    log(f"scenario {letters}{what}: {b.name} done in {time.perf_counter() - t0:.1f}s")


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
    if args.mosquitto:
        binary, why = ensure_mosquitto()
        if binary is None:
            results.note(f"MOSQUITTO SKIPPED: {why}; its columns are empty")
            info["mosquitto"] = f"Mosquitto: skipped ({why})"
        else:
            info["mosquitto_bin"] = binary
            info["mosquitto"] = (f"Mosquitto: {mosquitto_version(binary)} ({binary}), persistence on, "
                                 "max_inflight_messages 100, queue as large as the backlogs, anonymous")
    else:
        info["mosquitto"] = "Mosquitto: not run (--no-mosquitto)"
    if args.ours_standin:
        results.note("STAND-IN RUN: the 'ours' column is stock amqtt, not amqtt-durable")
    started = datetime.now(UTC)
    t0 = time.perf_counter()
    run_in_temp_folder("bench_durable_", args.keep_tmp, lambda tmp: run(args, tmp, results, info), results.note)
    write_report(render(args, info, command, results, started=started, elapsed=time.perf_counter() - t0), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
