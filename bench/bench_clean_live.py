#!/usr/bin/env python3
"""Live delivery to a CLEAN subscriber (clean_session=1): this code vs a baseline revision vs stock amqtt.

Run with the project venv, e.g.

    .venv/bin/python bench/bench_clean_live.py --baseline 21b4973 --n 20000 --runs 5 --out /tmp/clean.md

bench_durable.py's scenario a measures live delivery to a durable subscriber; a clean one takes
another path in the plugin (it writes the QoS 1/2 messages itself and awaits their acks). Here,
per --qos level and run, a subscriber process connects with clean_session=1 and subscribes, a
publisher process publishes --n messages of 64 bytes at that QoS (at most --inflight unacknowledged),
and the subscriber acks each one as it arrives (PUBACK; PUBREC, then PUBCOMP, at QoS 2). Reported:
msgs/s from the first send to the last message received, and p50/p99 latency of a message (send ->
arrival), for three set-ups run alternately, which goes first rotating per run: amqtt-durable from
this checkout's plugin (a copy taken at start), amqtt-durable from --baseline's plugin (copies out
of git), stock amqtt (no plugin, as in bench_durable.py). A machine shared with other work moves the
absolute figures; the per-run ratios of neighbouring runs are what to read.

The load clients, brokers and configs are bench_durable.py's (_rawmqtt.py, _harness.py); every
broker listens on 127.0.0.1, every wait is bounded, only processes started here are signalled, by PID.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    OURS,
    PLUGIN_DIR,
    PROTOCOL_DIR,
    ROOT,
    STOCK,
    BrokerProcess,
    add_pin_arguments,
    check_pin_arguments,
    describe_pinning,
    git_revision,
    log,
    machine_info,
    pub_summary,
    recv_summary,
    ref_revision,
    run_in_temp_folder,
    snapshot_packages,
    write_report,
)
from _harness import Ctx, Results, build_brokers, durable_broker, live_rate, live_run, warmup

BASE = "base"
LABELS = {OURS: "this", BASE: "base", STOCK: "stock"}


@dataclass
class Sample:
    """One live run of one set-up."""

    rate: float | None
    p50: float | None
    p99: float | None
    complete: bool


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def fmt(value: float | None, digits: int = 0) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def one_run(ctx: Ctx, b: BrokerProcess, qos: int) -> Sample:
    n = ctx.args.n
    if not b.alive():
        ctx.results.note(f"{b.name}: broker was not running before a QoS {qos} run; restarting it")
        b.start(ctx.args.startup_timeout)
    try:
        pr, res, _ = live_run(ctx, b, scenario=f"clean{qos}", n=n, clean=True, record_latency=True, qos=qos)
    except Exception as exc:
        ctx.results.note(f"{b.name} QoS {qos}: run failed: {type(exc).__name__}: {exc}")
        log(traceback.format_exc())
        return Sample(None, None, None, complete=False)
    rate = live_rate(pr, res)
    log(
        f"  {b.name} QoS {qos}: {fmt(rate)} msgs/s, p50 {fmt(res.p50_ms, 2)} ms, p99 {fmt(res.p99_ms, 2)} ms; "
        f"{recv_summary(res, n)}"
    )
    complete = res.unique >= n and pr.acked >= n
    if not complete:
        ctx.results.note(f"{b.name} QoS {qos}: {recv_summary(res, n)}; publisher {pub_summary(pr)}")
    return Sample(rate, res.p50_ms, res.p99_ms, complete)


def measure(ctx: Ctx, brokers: dict[str, BrokerProcess]) -> dict[int, list[tuple[list[str], float, dict[str, Sample]]]]:
    """--runs rounds per QoS; per round every set-up once, the first one rotating; the 1-min load average."""
    rounds: dict[int, list[tuple[list[str], float, dict[str, Sample]]]] = {}
    names = list(brokers)
    for rep in range(ctx.args.runs):
        for qos in ctx.args.qos:
            shift = rep % len(names)
            order = names[shift:] + names[:shift]
            load = os.getloadavg()[0]
            log(f"QoS {qos} run {rep + 1}/{ctx.args.runs} (load {load:.2f}): {' > '.join(order)}")
            samples = {name: one_run(ctx, brokers[name], qos) for name in order}
            rounds.setdefault(qos, []).append((order, load, samples))
    return rounds


def render(
    args: argparse.Namespace,
    rounds: dict[int, list[tuple[list[str], float, dict[str, Sample]]]],
    titles: dict[str, str],
) -> list[str]:
    lines: list[str] = []
    for qos, rows in rounds.items():
        lines += [
            f"QoS {qos}, per run (msgs/s; latency p50 / p99 in ms; runs in the order shown):",
            "",
            "| run | load | order | this msgs/s | base msgs/s | stock msgs/s | this/base | this/stock "
            "| p50 this / base / stock | p99 this / base / stock |",
            "|---:|---:|---|---:|---:|---:|---:|---:|---|---|",
        ]
        for i, (order, load, s) in enumerate(rows, 1):
            this, base, stock = s[OURS], s[BASE], s[STOCK]
            lines.append(
                f"| {i} | {load:.2f} | {' > '.join(LABELS[name] for name in order)} "
                f"| {fmt(this.rate)} | {fmt(base.rate)} | {fmt(stock.rate)} "
                f"| {fmt(ratio(this.rate, base.rate), 2)} | {fmt(ratio(this.rate, stock.rate), 2)} "
                f"| {fmt(this.p50, 2)} / {fmt(base.p50, 2)} / {fmt(stock.p50, 2)} "
                f"| {fmt(this.p99, 2)} / {fmt(base.p99, 2)} / {fmt(stock.p99, 2)} |"
            )
        lines += [
            "",
            f"QoS {qos}, median (min-max) over the runs:",
            "",
            "| | this | base | stock | this/base | this/stock |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for label, key, digits in (("msgs/s", "rate", 0), ("p50 ms", "p50", 2), ("p99 ms", "p99", 2)):
            cells = [spread([getattr(s[name], key) for _, _, s in rows], digits) for name in (OURS, BASE, STOCK)]
            per_run = [
                [ratio(getattr(s[OURS], key), getattr(s[other], key)) for _, _, s in rows] for other in (BASE, STOCK)
            ]
            lines.append(f"| {label} | {' | '.join(cells)} | {spread(per_run[0], 2)} | {spread(per_run[1], 2)} |")
        slower = sum(1 for _, _, s in rows if (r := ratio(s[OURS].rate, s[BASE].rate)) is not None and r < 0.85)
        lines += [
            "",
            f"QoS {qos}: this/base msgs/s below 0.85 in {slower} of {len(rows)} runs "
            "(ratio columns: median (min-max) of the per-run ratios).",
            "",
        ]
    lines.append("Set-ups: " + "; ".join(f"{LABELS[k]}: {v}" for k, v in titles.items()) + ".")
    return lines


def short(revision: str) -> str:
    """A `<hash> <subject>` line cut for the report."""
    return revision if len(revision) <= 70 else revision[:69] + "…"


def spread(values: list[float | None], digits: int) -> str:
    nums = [v for v in values if v is not None]
    if not nums:
        return "—"
    missing = f", {len(values) - len(nums)} missing" if len(nums) < len(values) else ""
    return f"{fmt(statistics.median(nums), digits)} ({fmt(min(nums), digits)}-{fmt(max(nums), digits)}{missing})"


def run(args: argparse.Namespace, tmp: Path, results: Results, body: list[str]) -> None:
    stock_and_this, _ = build_brokers(args, tmp)
    base_code = snapshot_packages([PLUGIN_DIR, PROTOCOL_DIR], tmp / "baseline", git_root=ROOT, ref=args.baseline)
    base, _ = durable_broker(args, tmp, BASE, code=base_code)
    brokers = {OURS: stock_and_this[OURS], BASE: base, STOCK: stock_and_this[STOCK]}
    titles = {
        OURS: f"amqtt-durable, this checkout's plugin ({short(git_revision(ROOT, ['plugin']))})",
        BASE: f"amqtt-durable at {args.baseline} ({short(ref_revision(ROOT, args.baseline))})",
        STOCK: "stock amqtt, no plugin (allow_anonymous=false + FileAuthPlugin)",
    }
    ctx = Ctx(args, tmp, base.login, results, brokers, None, args.client_cpus if args.pin else None)
    try:
        for name, b in brokers.items():
            log(f"starting {name}: {shlex.join(b.argv)} (port {b.port})")
            b.start(args.startup_timeout)
            warmup(ctx, b)
        body.extend(render(args, measure(ctx, brokers), titles))
    finally:
        for name, b in brokers.items():
            log(f"stopped {name}: {b.stop(timeout=30.0)}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", required=True, metavar="REF", help="git revision whose plugin is the 'base' set-up")
    p.add_argument("--n", type=int, default=20_000, help="messages per run (default 20000)")
    p.add_argument("--runs", type=int, default=5, help="runs per set-up and QoS (default 5)")
    p.add_argument(
        "--qos",
        type=lambda text: sorted({int(q) for q in text.split(",")}),
        default=[1, 2],
        help="QoS levels, comma-separated from 1,2 (default 1,2)",
    )
    p.add_argument("--inflight", type=int, default=100, help="max unacknowledged PUBLISHes (default 100)")
    p.add_argument("--timeout", type=float, default=None, help="time bound per run (default max(60, N/100) s)")
    p.add_argument(
        "--idle",
        type=float,
        default=10.0,
        help="the subscriber stops after this many seconds without a new message (default 10)",
    )
    p.add_argument("--startup-timeout", type=float, default=120.0, help="time bound for a broker start (s)")
    add_pin_arguments(p, "the brokers", "the load clients")
    p.add_argument("--keep-tmp", action="store_true", help="keep the temporary folder (configs, logs, stores)")
    p.add_argument("--out", type=Path, default=None, help="also write the markdown report to this file")
    args = p.parse_args(argv)
    if args.n < 1 or args.runs < 1 or not 1 <= args.inflight < 65535:
        p.error("--n and --runs must be positive, --inflight within 1-65534")
    if not args.qos or set(args.qos) - {1, 2}:
        p.error("--qos takes 1, 2 or 1,2")
    check_pin_arguments(p, args)
    if args.timeout is None:
        args.timeout = max(60.0, args.n / 100)
    # what build_brokers and durable_broker read: ours from a copy of this checkout's plugin, no backlog
    args.big, args.ours_standin, args.ours_cmd, args.snapshot = 0, False, None, True
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = shlex.join([sys.executable, *(sys.argv if argv is None else ["bench/bench_clean_live.py", *argv])])
    info = machine_info()
    results = Results()
    body: list[str] = []
    started = datetime.now(UTC)
    load_start = os.getloadavg()
    t0 = time.perf_counter()
    run_in_temp_folder("bench_clean_", args.keep_tmp, lambda tmp: run(args, tmp, results, body), results.note)
    load_end = os.getloadavg()
    report = [
        "## Live delivery to a clean subscriber: this code vs baseline vs stock amqtt",
        "",
        f"- date: {started.isoformat(timespec='seconds')}, wall time {time.perf_counter() - t0:.0f}s",
        f"- command: `{command}`",
        f"- machine: nproc={info['nproc']}, CPU {info['cpu']}, {info['os']}; load average (1/5/15 min) "
        f"{' / '.join(f'{x:.2f}' for x in load_start)} at the start, {' / '.join(f'{x:.2f}' for x in load_end)} "
        "at the end",
        f"- workload: {args.n:,} messages of 64 bytes per run, QoS {','.join(map(str, args.qos))}, at most "
        f"{args.inflight} in flight, subscriber clean_session=1; {describe_pinning(args, 'client processes')}",
        "",
        *body,
        *(f"\nNOTE: {note}" for note in results.notes),
    ]
    write_report("\n".join(report) + "\n", args.out)
    return 1 if results.notes else 0


if __name__ == "__main__":
    sys.exit(main())
