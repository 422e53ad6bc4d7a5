#!/usr/bin/env python3
"""A many-filter SUBSCRIBE against many retained topics: how long the broker stalls its other clients.

Run with the project venv, e.g.

    .venv/bin/python bench/bench_retained_subscribe.py --base /work/wt/retained-index-base --out /tmp/rs.md

Each code tree (--base, the code before, and this checkout) runs its own broker (`amqtt-durable
broker`, store in a temporary folder, metrics off, `max_subscriptions_per_client: 0`), filled through
MQTT with --topics retained QoS 1 messages ``fleet/<i>/state``. Then, --runs times per attacker kind
(a durable session, a clean one), a new attacker connection sends ONE SUBSCRIBE of --filters
filters ``other/<k>/+`` (matching nothing) of which every --every-th is ``fleet/<i>/+`` (matching one
retained topic each), and counts the retained messages it gets. Meanwhile a probe client publishes
QoS 1 messages one at a time and times each PUBACK. Reported: SUBSCRIBE -> SUBACK, and the probe's
longest PUBACK wait from the SUBSCRIBE until the attacker has all its retained messages (the stall
every other client sees), against the probe's median while nothing else happens. The brokers run
alternately, each once per attacker kind and run. Only 127.0.0.1 is used; every wait is bounded;
only the processes started here are signalled, by PID.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    ROOT,
    BenchError,
    BrokerProcess,
    git_revision,
    listener_config,
    log,
    machine_info,
    run_in_temp_folder,
    write_config,
    write_report,
)
from _rawmqtt import PT_PUBACK, PT_PUBLISH, PT_SUBACK, Login, RawConnection, publish_packet, take_pubacks

from amqtt_durable.process import free_port
from amqtt_durable.wire import encode_packet, encode_string, split_packets

START_TIMEOUT = 120.0
TOPIC = "fleet/{:06d}/state"


def broker_process(tmp: Path, name: str, code: Path) -> BrokerProcess:
    port = free_port()
    config = tmp / f"{name}.yaml"
    plugins = {
        "amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True},
        "amqtt_durable.DurableSessionsPlugin": {
            "store": str(tmp / f"{name}-store"), "metrics_interval": 0, "max_subscriptions_per_client": 0,
        },
    }
    write_config(config, {"listeners": listener_config(port), "plugins": plugins})
    paths = [str(code / part) for part in ("plugin", "client_sdk", "pipeline", "fleet")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    argv = [sys.executable, "-m", "amqtt_durable.cli", "broker", "-c", str(config)]
    return BrokerProcess(name, argv, port, tmp / f"{name}.log", Login(), env=env)


def fill(broker: BrokerProcess, topics: int, inflight: int = 1000) -> None:
    conn = RawConnection(broker.port, 30.0)
    try:
        conn.connect("bench-filler", Login(), clean=True, timeout=30.0)
        outstanding = bytearray(65536)
        deadline = time.monotonic() + 60.0 + topics / 500
        sent = acked = 0
        while acked < topics:
            if time.monotonic() > deadline:
                raise BenchError(f"filling: {acked} of {topics} acknowledged in time")
            batch = bytearray()
            while sent < topics and sent - acked < inflight:
                packet_id = sent % 65535 + 1
                outstanding[packet_id] = 1
                batch += publish_packet(TOPIC.format(sent), packet_id, b"state-%06d" % sent, qos=1, retain=True)
                sent += 1
            if batch:
                conn.sock.sendall(batch)
            conn.sock.settimeout(10.0)
            data = conn.sock.recv(1 << 18)
            if not data:
                raise BenchError("filling: the broker closed the connection")
            conn.buf += data
            acked += take_pubacks(conn.buf, outstanding)[0]
    finally:
        conn.close()


class Probe(threading.Thread):
    """Publishes QoS 1 one at a time; records (send time, seconds to PUBACK)."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.conn = RawConnection(port, 30.0)
        self.conn.connect("bench-probe", Login(), clean=True, timeout=30.0)
        self.samples: list[tuple[float, float]] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            packet_id = 0
            while not self.stop.is_set():
                packet_id = packet_id % 65535 + 1
                sent = time.perf_counter()
                self.conn.sock.sendall(publish_packet("probe/t", packet_id, b"p", qos=1))
                self.conn.expect(PT_PUBACK, 120.0)
                self.samples.append((sent, time.perf_counter() - sent))
                time.sleep(0.002)  # a client publishing now and then, not a load
        except BaseException as exc:  # reported by the main thread
            self.error = exc

    def worst(self, start: float, end: float) -> float:
        """The longest PUBACK wait of a publish sent in [start, end], or waiting across start (once a
        publish sent after ``end`` has its PUBACK: the one waiting across ``end`` is then recorded)."""
        deadline = time.monotonic() + 30.0
        while not (self.samples and self.samples[-1][0] > end) and time.monotonic() < deadline:
            if self.error is not None or not self.is_alive():
                raise BenchError(f"the probe stopped: {self.error!r}")
            time.sleep(0.01)
        waits = [wait for sent, wait in self.samples if start <= sent + wait and sent <= end]
        return max(waits, default=0.0)


def _take_packets(conn: RawConnection) -> tuple[bool, int]:
    """The complete packets in the buffer: (a SUBACK among them, PUBLISHes); QoS 1 ones are acked."""
    packets, used = split_packets(conn.buf)
    acks = bytearray()
    suback = False
    publishes = 0
    for first, begin, _end in packets:
        if first >> 4 == PT_SUBACK:
            suback = True
        elif first >> 4 == PT_PUBLISH:
            publishes += 1
            if (first >> 1) & 3 == 1:
                pid_at = begin + 2 + ((conn.buf[begin] << 8) | conn.buf[begin + 1])
                acks += b"\x40\x02" + conn.buf[pid_at:pid_at + 2]
    del conn.buf[:used]
    if acks:
        conn.sock.sendall(acks)
    return suback, publishes


def attack(port: int, client_id: str, clean: bool, filters: list[str], expected: int) -> tuple[float, float, int]:
    """One SUBSCRIBE of all ``filters``; returns (start, SUBACK seconds, seconds to all retained)."""
    conn = RawConnection(port, 30.0)
    try:
        conn.connect(client_id, Login(), clean=clean, timeout=30.0)
        body = bytearray(b"\x00\x01")
        for topic_filter in filters:
            body += encode_string(topic_filter) + b"\x01"
        packet = encode_packet(0x82, bytes(body))
        start = time.perf_counter()
        conn.sock.sendall(packet)
        received = 0
        suback = 0.0
        end_at = time.monotonic() + 300.0
        while (not suback or received < expected) and time.monotonic() < end_at:
            got_suback, publishes = _take_packets(conn)
            received += publishes
            if got_suback:
                suback = time.perf_counter() - start
            if suback and received >= expected:
                break
            conn.sock.settimeout(max(0.1, end_at - time.monotonic()))  # the old code stalls for long
            data = conn.sock.recv(1 << 18)
            if not data:
                raise BenchError(f"{client_id}: connection closed")
            conn.buf += data
        if received != expected:
            raise BenchError(f"{client_id}: {received} retained messages, expected {expected}")
        return start, suback, time.perf_counter() - start
    finally:
        conn.close()


def run(args: argparse.Namespace, tmp: Path) -> list[str]:
    trees = {"before": args.base.resolve(), "after": ROOT}
    brokers = {name: broker_process(tmp, name, code) for name, code in trees.items()}
    probes: dict[str, Probe] = {}
    filters = [
        f"fleet/{(k * 7919) % args.topics:06d}/+" if k % args.every == 0 else f"other/{k}/+"
        for k in range(args.filters)
    ]
    expected = sum(1 for f in filters if f.startswith("fleet/"))
    cells: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    try:
        for name, broker in brokers.items():
            broker.start(START_TIMEOUT)
            fill(broker, args.topics)
            probes[name] = Probe(broker.port)
            probes[name].start()
            log(f"{name}: {args.topics:,} retained topics stored")
        time.sleep(1.0)  # the probes' quiet baseline
        for run_no in range(args.runs):
            for kind in ("durable", "clean"):
                for name, broker in brokers.items():
                    start, suback, done = attack(
                        broker.port, f"attacker-{kind}-{run_no}", kind == "clean", filters, expected
                    )
                    worst = probes[name].worst(start, start + done)
                    cells.setdefault((kind, name), []).append((suback, done, worst))
                    log(f"run {run_no} {kind} {name}: SUBACK {suback:.3f} s, all retained {done:.3f} s, "
                        f"probe's longest PUBACK wait {worst * 1000:.1f} ms")
                    time.sleep(0.3)
    finally:
        for name, probe in probes.items():
            probe.stop.set()
            probe.join(10.0)
            if probe.error is not None:
                log(f"{name} probe: {probe.error!r}")
        for broker in brokers.values():
            broker.kill()
    return report_lines(args, expected, cells, probes)


def report_lines(
    args: argparse.Namespace, expected: int, cells: dict[tuple[str, str], list[tuple[float, float, float]]],
    probes: dict[str, Probe],
) -> list[str]:
    quiet = {name: statistics.median(wait for _, wait in probe.samples[:200]) for name, probe in probes.items()}
    lines = [
        f"{args.topics:,} retained topics; one SUBSCRIBE of {args.filters} filters ({expected} match one retained "
        f"topic each, the rest none); {args.runs} runs per cell, median (min-max).",
        "",
        "| attacker | code | SUBSCRIBE -> SUBACK (s) | -> all retained (s) | probe's longest PUBACK wait (ms) |",
        "|---|---|---:|---:|---:|",
    ]

    def cell(values: list[float], scale: float = 1.0, digits: int = 3) -> str:
        values = [v * scale for v in values]
        return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"

    for (kind, name), rows in cells.items():
        lines.append(
            f"| {kind} | {name} | {cell([r[0] for r in rows])} | {cell([r[1] for r in rows])} "
            f"| {cell([r[2] for r in rows], 1000, 1)} |"
        )
    lines += ["", "Probe's median PUBACK wait before the attacks: "
              + ", ".join(f"{name} {wait * 1000:.2f} ms" for name, wait in quiet.items()) + "."]
    for kind in ("durable", "clean"):
        before = statistics.median(r[2] for r in cells[(kind, "before")])
        after = statistics.median(r[2] for r in cells[(kind, "after")])
        lines.append(f"{kind} attacker: the stall before/after = {before / max(after, 1e-9):.0f}x.")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, required=True, help="a checkout of the code before (its plugin/ is run)")
    parser.add_argument("--topics", type=int, default=50_000, help="retained topics (default 50000)")
    parser.add_argument("--filters", type=int, default=500, help="filters in the one SUBSCRIBE (default 500)")
    parser.add_argument("--every", type=int, default=50, help="every n-th filter matches one topic (default 50)")
    parser.add_argument("--runs", type=int, default=3, help="attacks per cell (default 3)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    parser.add_argument("--out", type=Path, help="also write the report to this file")
    args = parser.parse_args()
    notes: list[str] = []
    body: list[str] = []
    run_in_temp_folder("bench-retsub-", args.keep, lambda tmp: body.extend(run(args, tmp)), notes.append)
    report = [
        "## Many-filter SUBSCRIBE against many retained topics",
        "",
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC, after: {git_revision(ROOT, ['plugin'])}, "
        f"before: {git_revision(args.base, ['plugin'])}; " + ", ".join(f"{k} {v}" for k, v in machine_info().items()),
        "",
        f"Command: `.venv/bin/python bench/bench_retained_subscribe.py {' '.join(sys.argv[1:])}`",
        "",
        *body,
        *(f"\nNOTE: {note}" for note in notes),
    ]
    write_report("\n".join(report) + "\n", args.out)
    return 1 if notes else 0


if __name__ == "__main__":
    sys.exit(main())
