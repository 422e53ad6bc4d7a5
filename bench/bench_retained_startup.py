#!/usr/bin/env python3
"""Broker start-up with 100,000 retained messages in the store (issue 10): target at most 3 s.

Run with the project venv, e.g.

    .venv/bin/python bench/bench_retained_startup.py --out /tmp/retained.md   # 100,000 topics, 5 runs
    .venv/bin/python bench/bench_retained_startup.py --quick                  # 10,000 topics, 3 runs

A broker (`amqtt-durable broker`, store in a temporary folder, metrics off) is filled through
MQTT: one raw client publishes --topics retained QoS 1 messages (one per topic, --payload bytes,
at most --inflight unacknowledged); its last PUBACK means all of them are stored. The broker is
then SIGKILLed. Start-up is the time from spawning `amqtt-durable broker` to the first CONNACK of
a probe client (amqtt opens its listeners only after the plugin has filled amqtt's retained table
from the store), measured --runs times on that store and on an empty one, alternating; stock
amqtt keeps no retained message across a restart, so the comparison is ours with an empty store.
After each start on the full store, a clean subscriber to the last topic checks that its retained
message came back, and the broker's RSS is read. Only 127.0.0.1 is used; every wait is bounded;
only the processes started here are signalled, by PID.
"""

from __future__ import annotations

import argparse
import statistics
import sys
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
from _rawmqtt import PT_PUBLISH, Login, RawConnection, publish_packet, take_pubacks

from amqtt_durable.process import free_port

TARGET_S = 3.0
START_TIMEOUT = 120.0
TOPIC = "bench/retained/{:06d}"


def broker_process(tmp: Path, name: str, store: Path) -> BrokerProcess:
    port = free_port()
    config = tmp / f"{name}.yaml"
    write_config(
        config,
        {
            "listeners": listener_config(port),
            "plugins": {
                "amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True},
                "amqtt_durable.DurableSessionsPlugin": {"store": str(store), "metrics_interval": 0},
            },
        },
    )
    argv = [sys.executable, "-m", "amqtt_durable.cli", "broker", "-c", str(config)]
    return BrokerProcess(name, argv, port, tmp / f"{name}.log", Login())


def fill(broker: BrokerProcess, topics: int, payload_size: int, inflight: int) -> float:
    """Publish one retained QoS 1 message per topic; returns the seconds until the last PUBACK."""
    conn = RawConnection(broker.port, 30.0)
    try:
        conn.connect("bench-retained-filler", Login(), clean=True, timeout=30.0)
        outstanding = bytearray(65536)
        started = time.perf_counter()
        sent = acked = 0
        deadline = started + 60.0 + topics / 500
        while acked < topics:
            if time.perf_counter() > deadline:
                raise BenchError(f"filling: {acked} of {topics} retained publishes acknowledged in time")
            batch = bytearray()
            while sent < topics and sent - acked < inflight:
                packet_id = sent % 65535 + 1
                outstanding[packet_id] = 1
                payload = f"{sent:06d}".encode().ljust(payload_size, b".")
                batch += publish_packet(TOPIC.format(sent), packet_id, payload, qos=1, retain=True)
                sent += 1
            if batch:
                conn.sock.sendall(batch)
            conn.sock.settimeout(10.0)
            data = conn.sock.recv(1 << 18)
            if not data:
                raise BenchError("filling: the broker closed the connection")
            conn.buf += data
            done, _stray, _other, _read = take_pubacks(conn.buf, outstanding)
            acked += done
        return time.perf_counter() - started
    finally:
        conn.close()


def check_restored(broker: BrokerProcess, topics: int, payload_size: int) -> None:
    """A clean subscriber to the last topic gets its retained message back."""
    last = topics - 1
    conn = RawConnection(broker.port, 30.0)
    try:
        conn.connect("bench-retained-check", Login(), clean=True, timeout=30.0)
        conn.subscribe(TOPIC.format(last), 30.0)
        body = conn.expect(PT_PUBLISH, 30.0)
        expected = f"{last:06d}".encode().ljust(payload_size, b".")
        if not body.endswith(expected):
            raise BenchError(f"the retained message of {TOPIC.format(last)} did not come back: {body[-40:]!r}")
    finally:
        conn.close()


def run(args: argparse.Namespace, tmp: Path, notes: list[str]) -> list[str]:
    full_store, empty_store = tmp / "full", tmp / "empty"
    filler = broker_process(tmp, "filler", full_store)
    filler.start(START_TIMEOUT)
    log(f"filling {args.topics:,} retained topics")
    fill_s = fill(filler, args.topics, args.payload, args.inflight)
    filler.kill()
    log(f"filled in {fill_s:.1f} s ({args.topics / fill_s:,.0f} retained publishes/s); broker SIGKILLed")

    full = broker_process(tmp, "full", full_store)
    empty = broker_process(tmp, "empty", empty_store)
    times: dict[str, list[float]] = {"full": [], "empty": []}
    rss: dict[str, list[int]] = {"full": [], "empty": []}
    for run_no in range(args.runs + 1):  # the first round warms the page cache and the bytecode caches
        for name, broker in (("empty", empty), ("full", full)):
            seconds = broker.start(START_TIMEOUT)
            if name == "full":
                check_restored(broker, args.topics, args.payload)
            memory = broker.rss()
            broker.kill()
            if run_no:
                times[name].append(seconds)
                rss[name].append(memory)
            log(f"round {run_no}: {name} store: start-up {seconds:.2f} s, RSS {memory / 1e6:.0f} MB")

    median_full, median_empty = statistics.median(times["full"]), statistics.median(times["empty"])
    verdict = "met" if max(times["full"]) <= TARGET_S else "NOT MET"
    if verdict != "met":
        notes.append(f"start-up with {args.topics:,} retained topics took up to {max(times['full']):.2f} s")
    return [
        f"{args.topics:,} retained topics ({args.payload}-byte payloads) filled through MQTT in {fill_s:.1f} s "
        f"({args.topics / fill_s:,.0f} retained QoS 1 publishes/s, {args.inflight} in flight).",
        "",
        "| Store | Start-up median (s) | min | max | RSS median (MB) |",
        "|---|---|---|---|---|",
        *(
            f"| {label} | {statistics.median(times[name]):.2f} | {min(times[name]):.2f} | {max(times[name]):.2f} "
            f"| {statistics.median(rss[name]) / 1e6:.0f} |"
            for name, label in (("full", f"{args.topics:,} retained"), ("empty", "empty"))
        ),
        "",
        f"Ratio of the medians (retained / empty): {median_full / median_empty:.2f}x "
        f"({median_full - median_empty:+.2f} s). Target: every start-up with {args.topics:,} retained topics "
        f"within {TARGET_S:.0f} s{'' if args.topics == 100_000 else ' (the bar is set for 100,000)'}: {verdict}.",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--topics", type=int, default=100_000, help="retained topics in the store (default 100000)")
    parser.add_argument("--payload", type=int, default=32, help="payload bytes of each (default 32)")
    parser.add_argument("--runs", type=int, default=5, help="timed start-ups of each store (default 5)")
    parser.add_argument("--inflight", type=int, default=1000, help="unacknowledged publishes while filling")
    parser.add_argument("--quick", action="store_true", help="10,000 topics, 3 runs")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    parser.add_argument("--out", type=Path, help="also write the report to this file")
    args = parser.parse_args()
    if args.quick:
        args.topics, args.runs = 10_000, 3
    if args.topics < 1 or args.runs < 1 or not 1 <= args.inflight <= 65535 or args.payload < 6:
        parser.error("--topics and --runs must be >= 1, --inflight 1..65535, --payload >= 6")
    notes: list[str] = []
    body: list[str] = []

    def bench(tmp: Path) -> None:
        body.extend(run(args, tmp, notes))

    run_in_temp_folder("bench-retained-", args.keep, bench, notes.append)
    info = machine_info()
    report = [
        "## Start-up with retained messages (issue 10)",
        "",
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {git_revision(ROOT, ['plugin'])}; "
        + ", ".join(f"{k} {v}" for k, v in info.items()),
        "",
        f"Command: `.venv/bin/python bench/bench_retained_startup.py {' '.join(sys.argv[1:])}`".rstrip(),
        "",
        *body,
        *(f"\nNOTE: {note}" for note in notes),
    ]
    write_report("\n".join(report) + "\n", args.out)
    return 1 if notes else 0


if __name__ == "__main__":
    sys.exit(main())
