#!/usr/bin/env python3
"""Fleet benchmark (issue 5): the largest fleet, devices x messages/s, that holds on this machine with
zero loss through the fault mix, and the broker's CPU and RSS at that point.

Run with the project venv, e.g.

    .venv/bin/python bench/bench_fleet.py --out /tmp/fleet.json          # the ladder below, 60 s per step
    .venv/bin/python bench/bench_fleet.py --quick                        # one step, 10 devices x 50 msg/s, 20 s
    .venv/bin/python bench/bench_fleet.py --steps 20x100,50x250 --duration 30 --runs-dir /tmp/bench_fleet

Each step is one in-process run of the fleet harness (``durable_fleet.runner.run_fleet``, what
``amqtt-durable fleet`` runs): the repo's broker.yaml started by the harness (own port and store),
DEVICES simulated devices (cpl1, cpl2 and paho dealt 1:1:1) behind the fault proxy in
max(8, DEVICES // 50) processes, RATE messages/s from max(2, RATE // 500) publishers (QoS 1, every
10th message a broadcast to every device, so a step asks for RATE * (0.9 + 0.1 * DEVICES) deliveries/s),
for --duration seconds, then the drain (--drain-timeout) and the Spark delivery audit. One SparkSession
(``get_session("local[2]")``) audits every step and is stopped at the end.

Faults: --faults per 60 s of --duration (default drop=3, stall=3, broker_kill=1, device_restart=3),
scaled to the duration (at least one of each kind asked for), from ``random_schedule`` with a fixed
seed per step (--seed plus the step's size), keep-alive --keepalive; runs shorter than 60 s also get
the schedule's lead-in (5 s) and fault-free tail (15 s) scaled down.

Steps climb in the order given (default 20x100, 50x250, 100x500, 200x1000, 400x2000, 800x4000). A step
holds when the harness says ok (every device got every acknowledged message in order, CPL-2 devices
each exactly once) and the drain finished (no note that it ended with receives missing). The ladder
stops at the first step that does not hold; that step is reported too, with what failed and whether the
machine's CPUs were saturated (mean above 95% of all cores over its publishing phase). A step that holds
with less than 95% of its offered messages acknowledged held at a lower rate than asked (the publishers
were slowed down by PUBACKs that came late); the answer then names the largest step that held at full rate too.

Per step: messages sent (acknowledged by the broker: a publisher logs a send at its PUBACK) and their
share of the offered RATE * duration; receives the devices processed (duplicates included) per second of
the run; broker CPU mean (weighted by the samples' intervals) and peak, in % of one core (100 = one
core), over the harness's 1 s samples of the publishing phase, and the broker's peak RSS and the peak
durable queue depth ($SYS metric) over all samples; the CPU of everything this benchmark runs (this
process and all its children: broker, devices, publishers, proxy, Spark) and of the rest of the
machine (other users, kernel threads), sampled here every second over the same phase; the drain time,
from the last acknowledged send in the publishers' logs to the last receive in any device log (an upper
bound: a late duplicate receive counts too); replay
latency p50/p99 from the harness's live view; wall time of the whole step.

Every wait is bounded: the harness bounds the start (--ready-timeout), the publishing (--duration) and
the drain (--drain-timeout); the audit's Spark jobs are cancelled after --audit-timeout. Everything
talks to 127.0.0.1 only; only processes started here are signalled (the harness signals its own by PID;
the Spark JVM is stopped through spark.stop()). A run folder is removed after a step that holds and kept
(with report.html) after one that does not; --runs-dir puts them in a persistent folder.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psutil
from _common import (
    BROKER_YAML,
    PROTOCOL_DIR,
    ROOT,
    changed_files,
    git_revision,
    log,
    machine_info,
    source_fingerprint,
    use_code_snapshot,
)

WATCHED = {
    "plugin": ROOT / "plugin" / "amqtt_durable",
    "SDK": ROOT / "client_sdk" / "durable_client",
    "protocol": PROTOCOL_DIR,
    "pipeline": ROOT / "pipeline" / "durable_pipeline",
    "fleet": ROOT / "fleet" / "durable_fleet",
}
MASTER = "local[2]"
DEFAULT_STEPS = "20x100,50x250,100x500,200x1000,400x2000,800x4000"
QUICK_STEPS = "10x50"
DEFAULT_FAULTS = "drop=3,stall=3,broker_kill=1,device_restart=3"
FAULTS_PER_S = 60.0
"""--faults counts are per this many seconds of publishing."""
PREFIX = "dev-"
BROADCAST_EVERY = 10
"""The harness's default: every 10th message goes to every device."""
STOP_SLACK_S = 120.0
"""Bound of the harness's own stops (fault driver join, worker SIGTERMs, broker stop) in the audit deadline."""
DRAIN_NOTE = "the drain ended"
TAIL_CHUNK = 64 * 1024
FULL_RATE = 0.95
"""A step carried its offered rate when the publishers got at least this share of RATE * duration acknowledged."""
MIN_INTERVAL = 0.5
"""Shortest span between two harness samples whose broker CPU figure counts (see broker_cpu)."""
SATURATED = 0.95
"""The machine counts as CPU-saturated above this share of all its cores over the publishing phase."""


# --------------------------------------------------------------------------- results


@dataclass
class StepResult:
    devices: int
    rate: float
    processes: int
    publishers: int
    seed: int
    out: str
    deliveries_per_s: float
    faults_planned: int = 0
    faults_applied: int = 0
    sent: int = 0
    holds: bool = False
    why: str = ""
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    failing_devices: list[dict[str, Any]] = field(default_factory=list)
    broker_cpu_mean: float | None = None
    broker_cpu_peak: float | None = None
    broker_rss_peak_mb: float | None = None
    queue_peak: int | None = None
    tree_cpu_mean: float | None = None
    """CPU of this benchmark's process tree over the publishing phase (100 = one core)."""
    other_cpu_mean: float | None = None
    """CPU of everything else on the machine over the publishing phase (100 = one core)."""
    machine_cpu_mean: float | None = None
    drain_s: float | None = None
    """Last receive in any device log minus the last acknowledged send in the publishers' logs."""
    drain_done: bool = True
    """False when the harness's drain timed out with receives missing."""
    drain_samples_s: float | None = None
    """Coarse, from the harness's samples: the sample that saw zero missing minus the first with the final sent."""
    latency_p50_ms: float | None = None
    latency_p99_ms: float | None = None
    latency_n: int = 0
    run_s: float | None = None
    wall_s: float | None = None
    load_before: str = ""
    kept: bool = False
    offered: int = 0
    """RATE * duration: what the publishers were asked to send."""
    receives_per_s: float | None = None
    """Receives the devices processed (duplicates included) per second of the run (publishing and drain)."""
    samples: list[dict[str, Any]] = field(default_factory=list)
    cpu_samples: list[dict[str, float]] = field(default_factory=list)

    @property
    def carried(self) -> float:
        """Share of the offered messages the broker acknowledged (the publishers log a send at its PUBACK)."""
        return self.sent / self.offered if self.offered else 0.0


@dataclass
class Report:
    steps: list[StepResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    aborted: bool = False

    def note(self, text: str) -> None:
        log(f"NOTE: {text}")
        self.notes.append(text)

    def largest(self, *, full_rate: bool = False) -> StepResult | None:
        holding = [step for step in self.steps if step.holds and (not full_rate or step.carried >= FULL_RATE)]
        return holding[-1] if holding else None


# --------------------------------------------------------------------------- measuring


class TreeCpu:
    """Every `interval` s: CPU of this process and all its descendants, and of the whole machine (100 = one core).

    Processes are keyed by (pid, create time), so the harness's restarted workers and broker are counted from
    their start; one first seen that started before the previous sample is only a baseline. Also notes when the
    first publisher process started: the harness starts the publishers when it starts its clock (t0).
    """

    def __init__(self, interval: float = 1.0) -> None:
        self.interval = interval
        self.me = psutil.Process()
        self.samples: list[tuple[float, float, float]] = []  # (unix time, machine %, tree %)
        self.publishers_started: float | None = None
        self._used: dict[tuple[int, float], float] = {}
        self._checked: set[tuple[int, float]] = set()
        self._last = time.time()
        self._machine = psutil.cpu_times()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tree-cpu", daemon=True)
        self._read(self._last)

    def _read(self, since: float) -> float:
        total = 0.0
        used: dict[tuple[int, float], float] = {}
        procs = [self.me]
        with contextlib.suppress(psutil.Error):
            procs += self.me.children(recursive=True)
        for proc in procs:
            try:
                key = (proc.pid, proc.create_time())
                times = proc.cpu_times()
            except psutil.Error:
                continue
            now_used = times.user + times.system
            before = self._used.get(key)
            if before is None:
                before = 0.0 if key[1] >= since - 0.02 else now_used
                self._publisher(proc, key)
            total += now_used - before
            used[key] = now_used
        self._used = used
        return total

    def _publisher(self, proc: psutil.Process, key: tuple[int, float]) -> None:
        if key in self._checked:
            return
        self._checked.add(key)
        with contextlib.suppress(psutil.Error):
            cmdline = proc.cmdline()
            if any(part.endswith("publisher-0.json") for part in cmdline) and "durable_fleet.worker" in cmdline:
                self.publishers_started = key[1]

    def _sample(self) -> None:
        now = time.time()
        tree = self._read(self._last)
        machine = psutil.cpu_times()
        busy = _busy(machine) - _busy(self._machine)
        elapsed = max(now - self._last, 1e-6)
        self.samples.append((now, 100.0 * busy / elapsed, 100.0 * tree / elapsed))
        self._last, self._machine = now, machine

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> TreeCpu:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10.0)


def _busy(times: Any) -> float:
    return float(sum(times) - times.idle - getattr(times, "iowait", 0.0))


def mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def percentile(values: list[float], pct: float) -> float | None:
    """Nearest-rank percentile."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(pct / 100.0 * len(ordered) + 0.5 - 1e-9)))
    return ordered[rank - 1]


def broker_cpu(samples: list[tuple[float, float | None]], duration: float) -> tuple[float | None, float | None]:
    """Mean (weighted by each sample's interval) and peak of the broker's CPU over the publishing phase.

    The harness's figure for a sample is the broker's CPU time since the previous sample over the time
    between them; samples less than MIN_INTERVAL apart (the drain's last ones) are left out: over a few
    milliseconds the kernel's 10 ms CPU-time ticks make it anything from 0 to several hundred percent.
    """
    spans = [(now - before, cpu) for (before, _), (now, cpu) in itertools.pairwise(samples)
             if cpu is not None and now <= duration + 0.5 and now - before >= MIN_INTERVAL]
    total = sum(span for span, _ in spans)
    if not spans or total <= 0:
        return None, None
    return sum(span * cpu for span, cpu in spans) / total, max(cpu for _, cpu in spans)


def last_record_time(path: Path, kind: str) -> float | None:
    """Time of the last record of `kind` in a delivery log, read from the end (whole file at most)."""
    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            chunk = TAIL_CHUNK
            while True:
                start = max(0, size - chunk)
                handle.seek(start)
                lines = handle.read(size - start).split(b"\n")
                if start > 0:
                    lines = lines[1:]  # maybe cut short
                for line in reversed(lines):
                    with contextlib.suppress(ValueError):
                        record = json.loads(line)
                        if isinstance(record, dict) and record.get("kind") == kind:
                            return float(record["time"])
                if start == 0:
                    return None
                chunk *= 4
    except OSError:
        return None


def drain_from_logs(out: Path, publishers: int) -> float | None:
    """Last receive in any device log minus the last acknowledged send (both Unix times on this machine)."""
    logs = out / "logs"
    sends = [last_record_time(logs / f"pub-{i}.jsonl", "send") for i in range(publishers)]
    receives = [last_record_time(path, "receive") for path in logs.glob(f"{PREFIX}*.jsonl")]
    last_send = max((t for t in sends if t is not None), default=None)
    last_receive = max((t for t in receives if t is not None), default=None)
    if last_send is None or last_receive is None:
        return None
    return max(0.0, last_receive - last_send)


def drain_from_samples(result: Any, duration: float) -> float | None:
    """From the 1 s samples: the sample that saw zero missing (the drain loop's last but one) minus the first
    sample that already had the final sent count. Only when the drain finished."""
    samples = result.samples
    if len(samples) < 2 or any(note.startswith(DRAIN_NOTE) for note in result.notes):
        return None
    final = samples[-1].sent
    first_final = next(s.time for s in samples if s.sent == final)
    return max(0.0, samples[-2].time - first_final)


# --------------------------------------------------------------------------- one step


def step_faults(args: argparse.Namespace, devices: int, seed: int) -> list[Any]:
    from durable_fleet.schedule import DEFAULT_QUIET_TAIL, DEFAULT_START, random_schedule  # noqa: PLC0415

    scale = args.duration / FAULTS_PER_S
    counts = {kind: max(1, round(n * scale)) if n else 0 for kind, n in args.faults.items()}
    window = min(1.0, scale)
    names = [f"{PREFIX}{i:03d}" for i in range(devices)]
    return random_schedule(seed, duration=args.duration, devices=names, counts=counts,
                           keepalive=args.keepalive, start=DEFAULT_START * window,
                           quiet_tail=DEFAULT_QUIET_TAIL * window)


def run_step(spark: Any, config: dict[str, Any], args: argparse.Namespace, runs_dir: Path, *, devices: int,
             rate: float) -> StepResult:
    from durable_fleet.report import write_fleet_report  # noqa: PLC0415 - after the code snapshot is on sys.path
    from durable_fleet.runner import FleetOptions, run_fleet  # noqa: PLC0415

    processes = max(8, devices // 50)
    publishers = max(2, int(rate) // 500)
    seed = args.seed + 1000 * devices + int(rate)
    out = runs_dir / f"{devices}x{rate:g}"
    step = StepResult(devices, rate, processes, publishers, seed, str(out),
                      rate * (1 - 1 / BROADCAST_EVERY) + rate / BROADCAST_EVERY * devices,
                      load_before="{:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    faults = step_faults(args, devices, seed)
    step.faults_planned = len(faults)
    step.offered = round(rate * args.duration)
    options = FleetOptions(
        out=out, devices=devices, rate=rate, duration=args.duration, publishers=publishers, processes=processes,
        keepalive=args.keepalive, faults=faults, config=config, prefix=PREFIX, broadcast_every=BROADCAST_EVERY,
        drain_timeout=args.drain_timeout, ready_timeout=args.ready_timeout, master=MASTER, spark=spark,
        progress=None, schedule_note=f"random, seed {seed}",
    )
    bound = (args.ready_timeout + args.duration + max((f.duration for f in faults), default=0.0)
             + args.drain_timeout + STOP_SLACK_S + args.audit_timeout)
    log(f"step {devices}x{rate:g}: {processes} device processes, {publishers} publishers, {len(faults)} faults "
        f"(seed {seed}), {args.duration:g} s + drain up to {args.drain_timeout:g} s; load {step.load_before}; "
        f"audit cancelled after {bound:.0f} s of the step; out {out}")
    cancelled = threading.Event()

    def cancel() -> None:
        cancelled.set()
        log(f"step {devices}x{rate:g}: still running after {bound:.0f} s, cancelling its Spark jobs")
        spark.sparkContext.cancelAllJobs()

    timer = threading.Timer(bound, cancel)
    timer.daemon = True
    t0 = time.perf_counter()
    result = None
    cpu = TreeCpu()
    timer.start()
    try:
        with cpu:
            result = run_fleet(options)
    except Exception as exc:
        step.why = f"run failed: {type(exc).__name__}: {exc}" + (" (audit cancelled)" if cancelled.is_set() else "")
        step.failures.append(step.why)
        log(traceback.format_exc())
    finally:
        timer.cancel()
    step.wall_s = time.perf_counter() - t0
    if result is not None:
        fill_from_result(step, result, args)
    fill_cpu(step, cpu, args.duration)
    if not step.holds:
        step.kept = True
        if result is not None:
            with contextlib.suppress(Exception):
                write_fleet_report(result)
        log(f"step {devices}x{rate:g} does not hold: {step.why}; kept {out}")
    elif args.keep_all:
        step.kept = True
    else:
        shutil.rmtree(out, ignore_errors=True)
    return step


def fill_from_result(step: StepResult, result: Any, args: argparse.Namespace) -> None:
    step.sent = result.sent
    step.run_s = result.duration_s
    step.faults_applied = len(result.faults)
    step.failures = list(result.failures)
    step.notes = list(result.notes)
    drain_open = [note for note in result.notes if note.startswith(DRAIN_NOTE)]
    step.holds = bool(result.ok) and not drain_open
    step.drain_done = not drain_open
    why = [*drain_open, *result.failures]
    step.why = "; ".join(why) if why else ""
    step.failing_devices = [
        {"device": d.device, "kind": d.kind, "why": d.why, "expected": d.expected, "received": d.received,
         "lost": d.lost, "duplicated": d.duplicated, "out_of_order": d.out_of_order, "restarts": d.restarts,
         "drops": d.drops, "stalls": d.stalls}
        for d in result.devices if not d.ok
    ]
    step.broker_cpu_mean, step.broker_cpu_peak = broker_cpu(
        [(s.time, s.broker_cpu_percent) for s in result.samples], args.duration)
    rss = [s.broker_rss_bytes for s in result.samples if s.broker_rss_bytes is not None]
    step.broker_rss_peak_mb = max(rss) / 2**20 if rss else None
    if result.samples and result.duration_s:
        step.receives_per_s = result.samples[-1].received / result.duration_s
    step.queue_peak = max((s.queued for s in result.samples if s.queued is not None), default=None)
    latencies = [point.latency_ms for point in result.latencies]
    step.latency_n = len(latencies)
    step.latency_p50_ms = percentile(latencies, 50)
    step.latency_p99_ms = percentile(latencies, 99)
    step.drain_s = drain_from_logs(Path(step.out), step.publishers)
    step.drain_samples_s = drain_from_samples(result, args.duration)
    step.samples = [asdict(s) for s in result.samples]


def fill_cpu(step: StepResult, cpu: TreeCpu, duration: float) -> None:
    start = cpu.publishers_started
    step.cpu_samples = [{"time": t, "machine": m, "tree": tr} for t, m, tr in cpu.samples]
    if start is None:
        return
    # samples wholly inside the publishing phase: each covers the second before its time
    inside = [(m, tr) for t, m, tr in cpu.samples if start + 1.0 <= t <= start + duration]
    step.machine_cpu_mean = mean([m for m, _ in inside])
    step.tree_cpu_mean = mean([tr for _, tr in inside])
    step.other_cpu_mean = mean([max(0.0, m - tr) for m, tr in inside])


# --------------------------------------------------------------------------- report


def fmt(value: float | None, digits: int = 0) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def table(report: Report) -> list[str]:
    lines = [
        "| devices x msg/s | deliveries/s asked | procs / pubs | faults | sent (of offered) | receives/s | holds "
        "| broker CPU mean / peak % | bench tree CPU % | other load % | broker RSS peak MB | queue peak | drain s "
        "| replay p50 / p99 ms (n) | wall s |",
        "|---|--:|--:|--:|--:|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for s in report.steps:
        holds = "yes" if s.holds else "**no**: " + (s.why if len(s.why) <= 200 else s.why[:200] + " ...")
        lines.append(
            f"| {s.devices} x {s.rate:g} | {s.deliveries_per_s:,.0f} | {s.processes} / {s.publishers} "
            f"| {s.faults_applied}/{s.faults_planned} | {s.sent:,} ({100 * s.carried:.0f}%) | {fmt(s.receives_per_s)} "
            f"| {holds} "
            f"| {fmt(s.broker_cpu_mean)} / {fmt(s.broker_cpu_peak)} | {fmt(s.tree_cpu_mean)} | {fmt(s.other_cpu_mean)} "
            f"| {fmt(s.broker_rss_peak_mb)} | {fmt(s.queue_peak)} "
            f"| {fmt(s.drain_s, 1) if s.drain_done else 'not done'} "
            f"| {fmt(s.latency_p50_ms)} / {fmt(s.latency_p99_ms)} ({s.latency_n:,}) | {fmt(s.wall_s)} |"
        )
    return lines


def answer(report: Report) -> str:
    best = report.largest()
    if best is None:
        return "largest fleet that holds: none of the steps run held"
    line = (f"largest fleet that holds: {best.devices} devices x {best.rate:g} msg/s (broker CPU mean "
            f"{fmt(best.broker_cpu_mean)}% / peak {fmt(best.broker_cpu_peak)}%, RSS {fmt(best.broker_rss_peak_mb)} MB)")
    if best.carried < FULL_RATE:
        line += f"; but only {100 * best.carried:.0f}% of its offered messages were acknowledged"
        full = report.largest(full_rate=True)
        line += "\nlargest that holds at its offered rate (>= {:.0f}% acknowledged): {}".format(
            100 * FULL_RATE, "none" if full is None else
            f"{full.devices} devices x {full.rate:g} msg/s (broker CPU mean {fmt(full.broker_cpu_mean)}% / peak "
            f"{fmt(full.broker_cpu_peak)}%, RSS {fmt(full.broker_rss_peak_mb)} MB)")
    return line


def limit(report: Report, cores: int) -> str:
    """What stopped the ladder: the first step that does not hold, and whether the machine's CPUs were full."""
    failed = next((s for s in report.steps if not s.holds), None)
    if failed is None:
        return "limit: not reached (every step held)"
    if failed.machine_cpu_mean is None:
        return f"limit: {failed.devices} x {failed.rate:g} failed before any CPU figure: {failed.why[:300]}"
    full = failed.machine_cpu_mean >= SATURATED * 100 * cores
    return (f"limit: {failed.devices} x {failed.rate:g} does not hold; machine CPU mean {failed.machine_cpu_mean:.0f}% "
            f"of {100 * cores}% (this benchmark {fmt(failed.tree_cpu_mean)}%, the rest {fmt(failed.other_cpu_mean)}%, "
            f"broker {fmt(failed.broker_cpu_mean)}%): "
            + ("the CPUs were saturated" if full else "the CPUs were not saturated: look at the failure"))


def render(args: argparse.Namespace, info: dict[str, str], command: str, report: Report, *, started: datetime,
           elapsed: float) -> str:
    lines = [
        "# Fleet benchmark",
        "",
        f"- command: `{command}`",
        f"- date: {started.isoformat(timespec='seconds')}, wall time {elapsed:.0f}s",
        f"- machine: nproc={info['nproc']}, {info['cpu']}, RAM {info['ram']}, {info['os']}; nothing pinned: broker, "
        "devices, publishers, proxy, harness and Spark share the CPUs",
        f"- python: {info['python']}; {info['packages']}",
        f"- git: {info['git']}",
        f"- code under test: {info['code']}",
        f"- per step: {args.duration:g} s publishing (QoS 1, 64 B, every {BROADCAST_EVERY}th a broadcast), drain up to "
        f"{args.drain_timeout:g} s, faults {args.faults_text} per {FAULTS_PER_S:g} s scaled to the duration, "
        f"keep-alive {args.keepalive} s, device mix cpl1:cpl2:paho 1:1:1",
        "- CPU figures: 100 = one core; broker from the harness's 1 s samples of the publishing phase; bench tree = "
        "this process and all its children (broker included), other = the rest of the machine, both sampled here",
        "- drain: last receive in any device log minus last acknowledged send (upper bound; a late duplicate counts)",
        "",
        *table(report),
        "",
        answer(report),
        limit(report, int(info["nproc"] or 1)),
    ]
    failing = [s for s in report.steps if not s.holds]
    for s in failing:
        lines += ["", f"## {s.devices} x {s.rate:g}: does not hold (run folder {s.out})", ""]
        lines += [f"- failure: {text}" for text in s.failures]
        lines += [f"- note: {text}" for text in s.notes]
        lines += [f"- {d['device']} ({d['kind']}): {d['why']} (restarts {d['restarts']}, drops {d['drops']}, "
                  f"stalls {d['stalls']})" for d in s.failing_devices[:20]]
        if len(s.failing_devices) > 20:
            lines.append(f"- ... and {len(s.failing_devices) - 20} more devices")
    if report.notes:
        lines += ["", "## Notes", "", *[f"- {note}" for note in report.notes]]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- setup


def parse_steps(text: str) -> list[tuple[int, float]]:
    steps = []
    for part in filter(None, (item.strip() for item in text.split(","))):
        devices, sep, rate = part.lower().partition("x")
        try:
            steps.append((int(devices), float(rate)))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r} is not DEVICESxRATE, e.g. 20x100") from None
        if not sep or steps[-1][0] < 1 or not 0 < steps[-1][1] < 1e6:
            raise argparse.ArgumentTypeError(f"{part!r}: DEVICES >= 1 and 0 < RATE < 1e6")
    if not steps:
        raise argparse.ArgumentTypeError("no steps")
    return steps


def parse_faults(text: str) -> dict[str, int]:
    from durable_fleet.model import FAULT_KINDS  # noqa: PLC0415

    counts: dict[str, int] = {}
    for part in filter(None, (item.strip() for item in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep or name not in FAULT_KINDS or not value.isdigit():
            raise argparse.ArgumentTypeError(f"--faults: {part!r} is not KIND=COUNT, KIND one of {FAULT_KINDS}")
        counts[name] = int(value)
    return counts


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"smoke run: steps {QUICK_STEPS}, 20 s")
    p.add_argument("--steps", type=parse_steps, default=None,
                   help=f"DEVICESxRATE steps, ascending, comma-separated (default {DEFAULT_STEPS})")
    p.add_argument("--duration", type=float, default=None, help="publishing seconds per step (default 60; quick 20)")
    p.add_argument("--faults", default=DEFAULT_FAULTS,
                   help=f"fault counts per {FAULTS_PER_S:g} s of --duration, KIND=COUNT (default {DEFAULT_FAULTS})")
    p.add_argument("--seed", type=int, default=5, help="base seed; a step's is SEED + 1000 * devices + rate")
    p.add_argument("--keepalive", type=int, default=4, help="devices' MQTT keep-alive in seconds (default 4)")
    p.add_argument("--drain-timeout", type=float, default=60.0, help="drain bound per step in seconds (default 60)")
    p.add_argument("--ready-timeout", type=float, default=120.0,
                   help="bound of the devices' start per step in seconds (default 120)")
    p.add_argument("--audit-timeout", type=float, default=900.0,
                   help="the step's Spark jobs are cancelled this long after its other bounds (default 900 s)")
    p.add_argument("--all-steps", action="store_true", help="go on after a step that does not hold")
    p.add_argument("--runs-dir", type=Path, default=None,
                   help="folder for the run folders (default: a temporary one, removed when empty)")
    p.add_argument("--keep-all", action="store_true", help="keep the run folders of steps that hold too")
    p.add_argument("--code", choices=("head", "worktree", "live"), default="head",
                   help="code under test: plugin, SDK, pipeline and fleet copied at start from git HEAD (default: "
                        "exactly the reported revision) or from the working tree, or 'live': the working tree")
    p.add_argument("--out", type=Path, default=None, help="also write the raw results as JSON to this file")
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = parse_steps(QUICK_STEPS if args.quick else DEFAULT_STEPS)
    if args.duration is None:
        args.duration = 20.0 if args.quick else 60.0
    if not 0 < args.duration <= 3600 or args.keepalive < 1 or args.drain_timeout <= 0 or args.ready_timeout <= 0:
        p.error("0 < --duration <= 3600, --keepalive >= 1, --drain-timeout and --ready-timeout > 0")
    args.faults_text = args.faults
    return args


def run(args: argparse.Namespace, tmp: Path, info: dict[str, str], report: Report,
        after_step: Callable[[], None]) -> None:
    _, at_start, info["code"] = use_code_snapshot(args.code, WATCHED, tmp, ROOT, report.note)
    import durable_fleet  # noqa: PLC0415 - after the snapshot is on sys.path
    from amqtt_durable.cli import load_broker_config  # noqa: PLC0415
    from durable_pipeline.spark import get_session  # noqa: PLC0415

    info["fleet_from"] = str(Path(durable_fleet.__file__).parent)
    args.faults = parse_faults(args.faults_text)
    config = load_broker_config(str(BROKER_YAML))
    runs_dir = args.runs_dir or Path(tempfile.mkdtemp(prefix="bench_fleet_runs_"))
    runs_dir.mkdir(parents=True, exist_ok=True)
    log(f"starting Spark ({MASTER}); durable_fleet from {info['fleet_from']}; run folders in {runs_dir}")
    spark = get_session(MASTER, "bench-fleet")
    try:
        for devices, rate in args.steps:
            step = run_step(spark, config, args, runs_dir, devices=devices, rate=rate)
            report.steps.append(step)
            after_step()
            log(f"step {devices}x{rate:g}: {'holds' if step.holds else 'does NOT hold'}; sent {step.sent:,}, broker "
                f"CPU {fmt(step.broker_cpu_mean)}/{fmt(step.broker_cpu_peak)}%, RSS {fmt(step.broker_rss_peak_mb)} MB, "
                f"tree CPU {fmt(step.tree_cpu_mean)}%, other {fmt(step.other_cpu_mean)}%, wall {fmt(step.wall_s)} s")
            if not step.holds and not args.all_steps:
                break
    finally:
        try:
            spark.stop()
            log("Spark stopped")
        except Exception as exc:
            report.note(f"spark.stop() failed: {type(exc).__name__}: {exc}")
        if args.runs_dir is None:
            with contextlib.suppress(OSError):
                runs_dir.rmdir()  # only when empty: failing steps' folders stay
    for name, folder in WATCHED.items():
        if changed := changed_files(at_start[name], source_fingerprint(folder)):
            report.note(f"the {name} source changed in the working tree during the run ({', '.join(changed)})"
                        + ("; the run used the copy taken at start" if args.code != "live" else ""))


def write_json(args: argparse.Namespace, info: dict[str, str], command: str, report: Report, *,
               started: datetime, elapsed: float) -> None:
    """The raw results (--out): also written after every step, so an interrupted ladder keeps what it measured."""
    if args.out is None:
        return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    raw = {
        "command": command, "started": started.isoformat(timespec="seconds"), "elapsed_s": elapsed,
        "machine": info, "settings": {
            "steps": [f"{d}x{r:g}" for d, r in args.steps], "duration_s": args.duration,
            "faults_per_60s": args.faults_text, "seed": args.seed, "keepalive": args.keepalive,
            "drain_timeout_s": args.drain_timeout, "ready_timeout_s": args.ready_timeout, "code": args.code},
        "answer": answer(report), "limit": limit(report, int(info["nproc"] or 1)),
        "steps": [{**asdict(step), "carried": step.carried} for step in report.steps], "notes": report.notes,
    }
    args.out.write_text(json.dumps(raw, indent=1) + "\n", encoding="utf-8")
    log(f"wrote {args.out}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = shlex.join([".venv/bin/python", "bench/bench_fleet.py", *(sys.argv[1:] if argv is None else argv)])
    info = machine_info()
    try:
        info["packages"] += f", pyspark {version('pyspark')}, paho-mqtt {version('paho-mqtt')}"
    except PackageNotFoundError:
        info["packages"] += ", pyspark not installed"
    info["git"] = git_revision(ROOT, ["plugin", "client_sdk", "pipeline", "fleet", "bench", "broker.yaml"])
    info["code"] = "?"
    report = Report()
    started = datetime.now(UTC)
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="bench_fleet_"))
    try:
        run(args, tmp, info, report, lambda: write_json(args, info, command, report, started=started,
                                                        elapsed=time.perf_counter() - t0))
    except KeyboardInterrupt:
        report.aborted = True
        report.note("interrupted")
    except Exception as exc:
        report.aborted = True
        report.note(f"benchmark aborted: {type(exc).__name__}: {exc}")
        log(traceback.format_exc())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    elapsed = time.perf_counter() - t0
    print(render(args, info, command, report, started=started, elapsed=elapsed))
    write_json(args, info, command, report, started=started, elapsed=elapsed)
    return 0 if report.largest() is not None and not report.aborted else 1


if __name__ == "__main__":
    sys.exit(main())
