#!/usr/bin/env python3
"""Benchmark (f), reconnect storm: many durable sessions, each with a queued backlog, reconnect at once.

    .venv/bin/python bench/bench_storm.py                      # 1,000 sessions x 1,000 messages (issue 14)
    .venv/bin/python bench/bench_storm.py --quick              # 200 sessions x 100 messages
    .venv/bin/python bench/bench_storm.py --sessions 500 --messages 200 --runs 3

Per broker (stock amqtt, amqtt-durable, Mosquitto; the brokers of bench_durable.py, same configs, run
interleaved, who goes first rotating per run): every session subscribes durably (QoS1) to its own topic and
disconnects; one publisher queues --messages to each; then all sessions open their connections at the same
moment (t0).  Measured: t0 -> every message delivered (and the msgs/s that makes), the slowest session's
t0 -> first message (and the median one), and a probe publisher connected during the storm (QoS1, one
message at a time): how many PUBACKs it got while the storm ran and its slowest PUBLISH -> PUBACK.

The load client is one asyncio process with raw sockets (bench/_storm.py), pinned away from the brokers
like bench_durable.py's clients; its own ceiling is not measured separately, so a broker that drains
faster than one Python process can read is client-bound (the note says so when the figures come close).
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    BROKER_TITLES,
    CLIENT_START_S,
    MOSQUITTO,
    OURS,
    RESULT_MARGIN_S,
    STOCK,
    BrokerProcess,
    add_pin_arguments,
    check_pin_arguments,
    describe_pinning,
    ensure_mosquitto,
    fmt_number,
    log,
    machine_info,
    mosquitto_version,
    run_in_temp_folder,
    write_report,
)
from _harness import build_brokers
from _rawmqtt import ClientProcess
from _storm import StormResult, StormSpec, storm_main


@dataclass
class Cells:
    results: dict[str, list[StormResult]] = field(default_factory=lambda: {STOCK: [], OURS: [], MOSQUITTO: []})
    notes: list[str] = field(default_factory=list)

    def note(self, text: str) -> None:
        log(f"NOTE: {text}")
        self.notes.append(text)


def run_once(args: argparse.Namespace, b: BrokerProcess, run: int, cpus: tuple[int, ...] | None) -> StormResult:
    spec = StormSpec(b.port, b.login, f"storm{run}-{b.name}", args.sessions, args.messages, args.inflight,
                     args.timeout, probe=True, cpus=cpus)
    with ClientProcess(f"{b.name} storm", storm_main, spec) as client:
        client.expect("ready", CLIENT_START_S)
        result: StormResult = client.expect("result", 3 * args.timeout + RESULT_MARGIN_S)
    return result


def run(args: argparse.Namespace, tmp: Path, cells: Cells, info: dict[str, str]) -> None:
    brokers, _store = build_brokers(args, tmp, mosquitto=info.get("mosquitto_bin"))
    brokers = {name: b for name, b in brokers.items() if name in args.brokers}
    cpus = args.client_cpus if args.pin else None
    try:
        for name, b in brokers.items():
            log(f"starting {name}: {shlex.join(b.argv)} (port {b.port})")
            b.start(args.startup_timeout)
        names = list(brokers)
        for rep in range(args.runs):
            shift = rep % len(names)
            for name in names[shift:] + names[:shift]:
                b = brokers[name]
                if not b.alive():
                    b.start(args.startup_timeout)
                log(f"run {rep + 1}: {name}: {args.sessions:,} sessions x {args.messages:,} messages")
                t0 = time.perf_counter()
                try:
                    res = run_once(args, b, rep, cpus)
                except Exception as exc:
                    cells.note(f"{name} run {rep + 1} failed: {type(exc).__name__}: {exc}")
                    log(f"last lines of {b.log_path.name}:\n{b.log_tail()}")
                    log(f"  {name}: {b.stop(timeout=30.0)}")
                    continue
                cells.results[name].append(res)
                log(f"  {name}: {res.summary()}; storm {res.storm_s} s, slowest first "
                    f"{res.slowest_first_ms} ms ({time.perf_counter() - t0:.1f}s with set-up)")
                if res.error or res.received < res.expected:
                    cells.note(f"{name} run {rep + 1}: {res.summary()}")
                # stop it: a broker still working off a failed storm would steal the next one's CPU, and the
                # next run starts it again, so runs are independent (the sessions stay stored)
                log(f"  {name}: {b.stop(timeout=30.0)}")
    finally:
        for name, b in brokers.items():
            log(f"stopped {name}: {b.stop(timeout=30.0)}")


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _cell(values: list[float]) -> str:
    if not values:
        return "—"
    med = statistics.median(values)
    return fmt_number(med) if len(values) == 1 else f"{fmt_number(med)} ({fmt_number(min(values))}-" \
                                                     f"{fmt_number(max(values))})"


def _ratio(ours: float | None, other: float | None) -> str:
    return f"{ours / other:.2f}x" if ours is not None and other else "—"


ROWS: list[tuple[str, str, str, str]] = [  # label, unit, better, metric
    ("all delivered (t0 -> last message of the last session)", "s", "lower", "storm_s"),
    ("drain rate (all messages / that time)", "msgs/s", "higher", "rate"),
    ("fastest session: t0 -> first message", "ms", "lower", "fastest_first_ms"),
    ("slowest session: t0 -> first message", "ms", "lower", "slowest_first_ms"),
    ("median session: t0 -> first message", "ms", "lower", "median_first_ms"),
    ("slowest session: deliveries (to all sessions) before its first message", "% of all", "lower",
     "slowest_first_rank"),
    ("median session: deliveries before its first message", "% of all", "lower", "median_first_rank"),
    ("slowest session: t0 -> CONNACK", "ms", "lower", "slowest_connack_ms"),
    ("median session: t0 -> all its messages", "ms", "lower", "median_complete_ms"),
    ("probe publisher: PUBACKs during the storm (one at a time)", "", "", "probe_acks"),
    ("probe publisher: slowest PUBLISH -> PUBACK during the storm", "ms", "lower", "probe_max_ms"),
    ("probe publisher: median PUBLISH -> PUBACK during the storm", "ms", "lower", "probe_median_ms"),
    ("probe publisher: most sessions' first messages between one PUBLISH and its PUBACK", "", "lower",
     "probe_max_firsts"),
    ("enqueue of the backlog (PUBACKs + flush), not part of the storm", "s", "lower", "enqueue_s"),
]


def metric(res: StormResult, key: str) -> float | None:
    if key == "fastest_first_ms":
        return res.first_ms[0] if res.first_ms else None
    if key == "median_first_ms":
        return _median(res.first_ms)
    if key in ("slowest_first_rank", "median_first_rank"):
        if len(res.first_rank) != res.sessions:
            return None
        rank = res.first_rank[-1] if key == "slowest_first_rank" else _median([float(r) for r in res.first_rank])
        return None if rank is None else 100.0 * rank / res.expected
    if key == "slowest_connack_ms":
        return res.connack_ms[-1] if len(res.connack_ms) == res.sessions else None
    if key == "median_complete_ms":
        return _median(res.complete_ms) if len(res.complete_ms) == res.sessions else None
    value = getattr(res, key)
    return None if value is None else float(value)


def render(args: argparse.Namespace, info: dict[str, str], command: str, cells: Cells, *,
           started: datetime, elapsed: float) -> str:
    lines = [
        "# amqtt-durable reconnect storm benchmark (f)",
        "",
        f"- date: {started.isoformat(timespec='seconds')}, wall time {elapsed:.0f}s",
        f"- command: `{command}`",
        f"- machine: nproc={info['nproc']}, RAM {info['ram']}, CPU {info['cpu']}, {info['os']}",
        f"- packages: {info['packages']}; {info['mosquitto']}",
        f"- workload: {args.sessions:,} durable sessions x {args.messages:,} queued QoS1 messages of 64 bytes "
        f"({args.sessions * args.messages:,} in all), each session on its own topic, all reconnecting at once; "
        f"{args.runs} run(s) per broker, brokers interleaved, broker restarted between runs; cells show median "
        "(min-max) over the runs",
        f"- load client: one asyncio process, raw sockets; {describe_pinning(args, 'the client process')}",
        "",
        f"| metric | unit | {BROKER_TITLES[STOCK]} | {BROKER_TITLES[OURS]} | {BROKER_TITLES[MOSQUITTO]} "
        "| ours/stock | ours/Mosquitto | better |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for label, unit, better, key in ROWS:
        per = {name: [v for r in runs if (v := metric(r, key)) is not None] for name, runs in cells.results.items()}
        meds = {name: _median(v) for name, v in per.items()}
        lines.append(f"| {label} | {unit} | {_cell(per[STOCK])} | {_cell(per[OURS])} | {_cell(per[MOSQUITTO])} "
                     f"| {_ratio(meds[OURS], meds[STOCK])} | {_ratio(meds[OURS], meds[MOSQUITTO])} | {better} |")
    lines.append("| outcome (per run) |  | " + " | ".join(
        "<br>".join(r.summary() for r in cells.results[name]).replace("|", "\\|") or "—"
        for name in (STOCK, OURS, MOSQUITTO)) + " |  |  |  |")
    if cells.notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in cells.notes]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=None, help="durable sessions (default 1000; quick 200)")
    p.add_argument("--messages", type=int, default=None, help="queued messages per session (default 1000; quick 100)")
    p.add_argument("--quick", action="store_true", help="small numbers for a smoke run")
    p.add_argument("--runs", type=int, default=1, help="storms per broker (default 1)")
    p.add_argument("--inflight", type=int, default=100, help="the enqueueing publisher's window (default 100)")
    p.add_argument("--timeout", type=float, default=None,
                   help="time bound of each phase in seconds (default max(120, sessions*messages/1000))")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="time bound for a broker start (s)")
    p.add_argument("--mosquitto", action=argparse.BooleanOptionalAction, default=True,
                   help="run Mosquitto as a third broker, installing the Debian package when missing (default on)")
    p.add_argument("--brokers", default=f"{STOCK},{OURS},{MOSQUITTO}",
                   help="brokers to run, comma-separated (default stock,ours,mosquitto)")
    p.add_argument("--out", type=Path, default=None, help="also write the markdown report to this file")
    add_pin_arguments(p, "the brokers", "the load client")
    p.add_argument("--keep-tmp", action="store_true", help="keep the temporary folder (configs, logs, store)")
    args = p.parse_args(argv)
    args.sessions = args.sessions or (200 if args.quick else 1000)
    args.messages = args.messages or (100 if args.quick else 1000)
    args.brokers = [b for b in args.brokers.split(",") if b]
    if not args.brokers or set(args.brokers) - {STOCK, OURS, MOSQUITTO}:
        p.error(f"--brokers takes names from {STOCK},{OURS},{MOSQUITTO}")
    args.timeout = args.timeout or max(120.0, args.sessions * args.messages / 1000)
    if min(args.sessions, args.messages, args.runs, args.inflight) < 1 or args.inflight >= 65535:
        p.error("--sessions, --messages, --runs and --inflight must be positive, --inflight below 65535")
    check_pin_arguments(p, args)
    # what bench_durable's broker set-up reads: our broker from a snapshot of the plugin, queues as large
    # as one session's backlog
    args.big, args.snapshot, args.ours_cmd, args.ours_standin = args.messages, True, None, False
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = shlex.join([sys.executable, *(sys.argv if argv is None else ["bench/bench_storm.py", *argv])])
    info = machine_info()
    cells = Cells()
    if args.mosquitto:
        binary, why = ensure_mosquitto()
        if binary is None:
            cells.note(f"MOSQUITTO SKIPPED: {why}; its column is empty")
            info["mosquitto"] = f"Mosquitto: skipped ({why})"
        else:
            info["mosquitto_bin"] = binary
            info["mosquitto"] = f"Mosquitto: {mosquitto_version(binary)}, persistence on"
    else:
        info["mosquitto"] = "Mosquitto: not run (--no-mosquitto)"
    started = datetime.now(UTC)
    t0 = time.perf_counter()
    run_in_temp_folder("bench_storm_", args.keep_tmp, lambda tmp: run(args, tmp, cells, info), cells.note)
    write_report(render(args, info, command, cells, started=started, elapsed=time.perf_counter() - t0), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
