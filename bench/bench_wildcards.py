#!/usr/bin/env python3
"""What one client's wildcard subscriptions cost everyone: stock amqtt 0.12.1 vs amqtt-durable.

Run with the project venv, e.g.

    .venv/bin/python bench/bench_wildcards.py --out bench/last-wildcards.md   # N=10,000, 10,000 filters
    .venv/bin/python bench/bench_wildcards.py --quick                          # smoke run

Broker QoS 1 throughput (bench_durable.py's scenario a: a raw publisher and a raw subscriber
process, 64-byte payloads, --inflight unacknowledged PUBLISHes, msgs/s end to end) while an
"attacker" connection holds --filters wildcard subscriptions (``flood/<i>/+``, none of which
matches the measured topic):

  none     no attacker (the baseline)
  durable  the attacker holds them in a durable session (clean_session=false)
  clean    the attacker holds them in a clean session

each with a durable (clean_session=false) and a clean measured subscriber. Each broker runs once
per attacker kind (the attackers stay connected), and each of --runs repetitions measures every
cell, brokers interleaved, so load drifting on a shared machine hits all cells alike. The report
gives medians, each broker's figure against its own baseline, and ours against stock.
Target: the attacker costs ours less than 10% of its baseline throughput (attacked / baseline
>= 0.90).

Brokers, load clients, CPU pinning and the scenario-a measurement are bench_durable.py's and
_common.py's; our broker runs with max_subscriptions_per_client: 0 so that the attacker gets
all its filters.
"""

from __future__ import annotations

import argparse
import os
import shlex
import struct
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    BROKER_TITLES,
    OURS,
    PLUGIN_DIR,
    ROOT,
    STOCK,
    BenchError,
    BrokerProcess,
    add_pin_arguments,
    check_pin_arguments,
    describe_pinning,
    fingerprint_digest,
    fmt_number,
    git_revision,
    log,
    machine_info,
    recv_summary,
    run_in_temp_folder,
    source_fingerprint,
    write_report,
)
from _harness import (
    Ctx,
    Results,
    build_brokers,
    drop_session,
    fmt_runs,
    live_run,
    plugin_source_dir,
    warmup,
)
from _rawmqtt import PT_SUBACK, RawConnection

from amqtt_durable.wire import encode_packet, encode_string

ATTACKS = ("none", "durable", "clean")
SUBSCRIBERS = ("durable", "clean")
FILTERS_PER_SUBSCRIBE = 500
TARGET = 0.90  # attacked / baseline throughput of ours


@dataclass
class Cells:
    """msgs/s per (broker, subscriber kind, attack), one value per run."""

    rates: dict[tuple[str, str, str], list[float]] = field(default_factory=dict)
    setup_s: dict[tuple[str, str], float] = field(default_factory=dict)  # (broker, attack) -> seconds to subscribe

    def add(self, broker: str, subscriber: str, attack: str, rate: float) -> None:
        self.rates.setdefault((broker, subscriber, attack), []).append(rate)

    def median(self, broker: str, subscriber: str, attack: str) -> float | None:
        values = sorted(self.rates.get((broker, subscriber, attack), []))
        return values[len(values) // 2] if values else None


def subscribe_many_packet(packet_id: int, filters: list[str]) -> bytes:
    """One SUBSCRIBE with many filters at QoS 1."""
    body = struct.pack("!H", packet_id) + b"".join(encode_string(f) + b"\x01" for f in filters)
    return encode_packet(0x82, body)


class Attacker:
    """One connection holding `count` wildcard subscriptions, kept open while the throughput is measured."""

    def __init__(self, ctx: Ctx, b: BrokerProcess, *, durable: bool, count: int, timeout: float) -> None:
        self.ctx, self.b, self.durable = ctx, b, durable
        self.client_id = f"attacker-{b.name}-{'durable' if durable else 'clean'}-{ctx.tag().hex()}"
        self.conn = RawConnection(b.port, timeout)
        self.conn.connect(self.client_id, ctx.login, clean=not durable, timeout=timeout)
        t0 = time.perf_counter()
        for packet_id, start in enumerate(range(0, count, FILTERS_PER_SUBSCRIBE), start=1):
            filters = [f"flood/{i}/+" for i in range(start, min(count, start + FILTERS_PER_SUBSCRIBE))]
            self.conn.sock.sendall(subscribe_many_packet(packet_id, filters))
            codes = self.conn.expect(PT_SUBACK, timeout)[2:]
            if codes != b"\x01" * len(filters):
                raise BenchError(f"{b.name}: attacker's SUBSCRIBE {packet_id} not all granted: {codes[:8]!r}...")
        self.seconds = time.perf_counter() - t0

    def close(self) -> None:
        self.conn.close()
        if self.durable:
            drop_session(self.ctx, self.b, self.client_id)


def measure(ctx: Ctx, b: BrokerProcess, cells: Cells, subscriber: str, attack: str) -> None:
    n = ctx.args.stock_attacked_n if b.name == STOCK and attack != "none" else ctx.args.n
    pr, res, sub_id = live_run(ctx, b, scenario=f"w{attack[0]}{subscriber[0]}", n=n, clean=subscriber == "clean",
                               record_latency=False)
    if subscriber == "durable":
        drop_session(ctx, b, sub_id)
    if res.unique < n or not res.t_last_ns > pr.t_first_send_ns:
        ctx.results.note(f"{b.name} ({attack} attacker, {subscriber} subscriber): {recv_summary(res, n)}")
        return
    rate = res.unique / ((res.t_last_ns - pr.t_first_send_ns) / 1e9)
    cells.add(b.name, subscriber, attack, rate)
    log(f"  {b.name}, {attack} attacker, {subscriber} subscriber: {rate:,.0f} msgs/s")


def note_exited(results: Results, pairs: dict[str, dict[str, BrokerProcess]]) -> None:
    for attack, brokers in pairs.items():
        for name, b in brokers.items():
            if not b.alive():
                results.note(f"{name} ({attack}): broker exited unexpectedly; last log line: {b.last_log_line()!r}")


def measure_all(ctx: Ctx, brokers: dict[str, BrokerProcess], cells: Cells, attack: str, order: list[str]) -> None:
    """One repetition of every measured subscriber kind on both brokers of one attacker kind."""
    for subscriber in ctx.args.subscribers:
        for name in order:
            measure(ctx, brokers[name], cells, subscriber, attack)


def start_attacked(ctx: Ctx, brokers: dict[str, BrokerProcess], attack: str, cells: Cells) -> list[Attacker]:
    """Start the pair of brokers of one attacker kind, each with its attacker connected and warmed up."""
    args = ctx.args
    attackers = []
    for name, b in brokers.items():
        log(f"starting {name} for the {attack} attacker: {shlex.join(b.argv)} (port {b.port})")
        b.start(args.startup_timeout)
        if attack != "none":
            log(f"{name}: {attack} attacker subscribes to {args.filters:,} wildcard filters")
            attacker = Attacker(ctx, b, durable=attack == "durable", count=args.filters, timeout=args.setup_timeout)
            attackers.append(attacker)
            cells.setup_s[(name, attack)] = attacker.seconds
        warmup(ctx, b)  # a fresh broker's first run is slower, whatever it holds
    return attackers


def run(args: argparse.Namespace, tmp: Path, results: Results, cells: Cells, info: dict[str, str]) -> None:
    """One stock/ours broker pair per attack, the attackers kept connected throughout, so that every
    repetition measures all cells within a few minutes of each other (a shared machine's load drifts)."""
    pairs: dict[str, dict[str, BrokerProcess]] = {}
    ctxs: dict[str, Ctx] = {}
    for attack in args.attacks:
        folder = tmp / attack
        folder.mkdir()
        brokers, store = build_brokers(args, folder, {"max_subscriptions_per_client": 0})
        pairs[attack] = brokers
        ctxs[attack] = Ctx(args, folder, brokers[STOCK].login, results, brokers, store,
                           args.client_cpus if args.pin else None)
    info["plugin_digest"] = fingerprint_digest(source_fingerprint(plugin_source_dir(args, tmp / args.attacks[0])))
    info["git"] = git_revision(ROOT, ["plugin"])
    info["load_start"] = " ".join(f"{v:.2f}" for v in os.getloadavg())
    attackers: list[Attacker] = []
    try:
        for attack, brokers in pairs.items():
            attackers += start_attacked(ctxs[attack], brokers, attack, cells)
        for rep in range(args.runs):
            order = [STOCK, OURS] if rep % 2 == 0 else [OURS, STOCK]
            for attack, brokers in pairs.items():
                measure_all(ctxs[attack], brokers, cells, attack, order)
        note_exited(results, pairs)
    finally:
        info["load_end"] = " ".join(f"{v:.2f}" for v in os.getloadavg())
        for attacker in attackers:
            attacker.close()
        for attack, brokers in pairs.items():
            for name, b in brokers.items():
                log(f"stopped {name} ({attack}): {b.stop(timeout=30.0)}")


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "—"


def render(args: argparse.Namespace, info: dict[str, str], command: str, results: Results, cells: Cells, *,
           started: datetime, elapsed: float) -> str:
    lines = [
        "# Wildcard-subscription cost benchmark",
        "",
        f"- date: {started.isoformat(timespec='seconds')}, wall time {elapsed:.0f}s",
        f"- command: `{command}`",
        f"- machine: nproc={info['nproc']}, RAM {info['ram']}, CPU {info['cpu']}, {info['os']}",
        f"- packages: {info['packages']}",
        f"- amqtt-durable source: {PLUGIN_DIR.relative_to(ROOT)}/*.py sha256 {info.get('plugin_digest', '?')}; "
        f"git: {info.get('git', '?')}",
        f"- workload: N={args.n:,} QoS1 messages of 64 bytes per run ({args.stock_attacked_n:,} for stock under "
        f"attack, which is slow), at most {args.inflight} in flight, "
        f"{args.runs} runs per cell (median, min-max), brokers interleaved; the attacker holds "
        f"{args.filters:,} filters flood/<i>/+ (none matches the measured topic); "
        f"{describe_pinning(args, 'client processes')}; one broker pair per attacker kind, the attackers "
        "connected throughout, every cell measured once per repetition",
        f"- load average (1, 5, 15 min) at the start {info.get('load_start', '?')}, at the end "
        f"{info.get('load_end', '?')} (the machine is shared)",
        "",
        "| measured subscriber | attacker | stock msgs/s | ours msgs/s | ours/stock | stock vs its baseline "
        f"| ours vs its baseline | target (ours >= {TARGET:.2f}x of baseline) |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for subscriber in args.subscribers:
        base = {b: cells.median(b, subscriber, "none") for b in (STOCK, OURS)}
        for attack in args.attacks:
            med = {b: cells.median(b, subscriber, attack) for b in (STOCK, OURS)}
            runs = {b: fmt_runs(cells.rates.get((b, subscriber, attack), [])) for b in (STOCK, OURS)}
            met = ""
            if attack != "none":
                ours, ours_base = med[OURS], base[OURS]
                met = "n/a" if ours is None or not ours_base else (
                    "**met**" if ours / ours_base >= TARGET else "**not met**")
            vs_base = {b: "—" if attack == "none" else ratio(med[b], base[b]) for b in (STOCK, OURS)}
            lines.append(f"| {subscriber} | {attack} | {runs[STOCK]} | {runs[OURS]} | {ratio(med[OURS], med[STOCK])} "
                         f"| {vs_base[STOCK]} | {vs_base[OURS]} | {met} |")
    if cells.setup_s:
        lines += ["", "Time for the attacker to get its filters (SUBSCRIBE -> last SUBACK): " + "; ".join(
            f"{BROKER_TITLES[b]} {attack} {fmt_number(s)} s" for (b, attack), s in sorted(cells.setup_s.items()))]
    if results.notes:
        lines += ["", "Notes:", "", *[f"- {n}" for n in results.notes]]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=None, help="messages per run (default 10000; quick 2000)")
    p.add_argument("--stock-attacked-n", type=int, default=None,
                   help="messages per run for stock with an attacker, which routes slowly (default N/10)")
    p.add_argument("--filters", type=int, default=None, help="the attacker's wildcard filters (default 10000; "
                   "quick 2000)")
    p.add_argument("--runs", type=int, default=3, help="runs per cell and broker (default 3; median reported)")
    p.add_argument("--inflight", type=int, default=100, help="max unacknowledged QoS1 PUBLISHes (default 100)")
    p.add_argument("--attacks", default=",".join(ATTACKS), help=f"comma-separated, from {', '.join(ATTACKS)}")
    p.add_argument("--subscribers", default=",".join(SUBSCRIBERS),
                   help=f"measured subscriber kinds, comma-separated, from {', '.join(SUBSCRIBERS)}")
    p.add_argument("--quick", action="store_true", help="smoke run: small numbers")
    p.add_argument("--out", type=Path, default=None, help="also write the markdown report to this file")
    p.add_argument("--timeout", type=float, default=None, help="time bound per run (default max(120, N/20) s)")
    p.add_argument("--idle", type=float, default=10.0, help="stop receiving after this long without a message")
    p.add_argument("--setup-timeout", type=float, default=600.0, help="time bound per attacker SUBSCRIBE (s)")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="time bound for a broker start (s)")
    add_pin_arguments(p, "the brokers", "the load clients")
    p.add_argument("--keep-tmp", action="store_true", help="keep the temporary folder (configs, logs, store)")
    args = p.parse_args(argv)
    args.n = args.n or (2000 if args.quick else 10_000)
    args.stock_attacked_n = args.stock_attacked_n or max(1, args.n // 10)
    args.filters = args.filters or (2000 if args.quick else 10_000)
    args.timeout = args.timeout or max(120.0, args.n / 20)
    args.attacks = [a for a in args.attacks.split(",") if a]
    args.subscribers = [s for s in args.subscribers.split(",") if s]
    if "none" not in args.attacks or set(args.attacks) - set(ATTACKS):
        p.error(f"--attacks takes names from {', '.join(ATTACKS)} and must include none (the baseline)")
    if not args.subscribers or set(args.subscribers) - set(SUBSCRIBERS):
        p.error(f"--subscribers takes names from {', '.join(SUBSCRIBERS)}")
    if min(args.n, args.stock_attacked_n, args.filters, args.runs, args.inflight) < 1 or args.inflight >= 65535:
        p.error("--n, --stock-attacked-n, --filters, --runs and --inflight must be positive, --inflight below 65535")
    check_pin_arguments(p, args)
    # What bench_durable's broker set-up and clients read: our broker from a snapshot of the plugin.
    args.big, args.snapshot, args.ours_cmd, args.ours_standin = 0, True, None, False
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = shlex.join([sys.executable, *(sys.argv if argv is None else ["bench/bench_wildcards.py", *argv])])
    info = machine_info()
    results, cells = Results(), Cells()
    started = datetime.now(UTC)
    t0 = time.perf_counter()
    run_in_temp_folder("bench_wildcards_", args.keep_tmp, lambda tmp: run(args, tmp, results, cells, info),
                       results.note)
    write_report(render(args, info, command, results, cells, started=started, elapsed=time.perf_counter() - t0),
                 args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
