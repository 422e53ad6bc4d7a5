#!/usr/bin/env python3
"""Our broker's CPU per reconnecting durable session with no backlog (issue 14, point 3).

    .venv/bin/python bench/connect_cpu.py --sessions 1000 --rounds 2

Our broker (bench_storm.py's configuration, from a snapshot of plugin/) gets --sessions durable sessions
(as bench_storm.py sets them up); then, per round, all of them reconnect at once, wait for CONNACK (accepted,
session present) and DISCONNECT.  Printed per round: the broker's user+system CPU time (/proc) over the round
and one second after it (so the disconnects are in), per connection, and the round's wall time.  CPU time is
what other processes on a shared machine disturb least; wall time is what they disturb most.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import OURS, add_pin_arguments, check_pin_arguments, log, run_in_temp_folder
from _harness import build_brokers
from _rawmqtt import DISCONNECT, HOST, RawMqttError, connect_packet
from _storm import StormSpec, session_id, set_up_sessions
from profile_storm import cpu_seconds


async def reconnect_all(spec: StormSpec) -> None:
    async def one(index: int) -> asyncio.StreamWriter:
        reader, writer = await asyncio.open_connection(HOST, spec.port)
        writer.write(connect_packet(session_id(spec, index), spec.login, clean=False))
        connack = await asyncio.wait_for(reader.readexactly(4), spec.timeout)
        if connack[2:4] != b"\x01\x00":
            raise RawMqttError(f"session {index}: CONNACK {connack!r}, not accepted with session present")
        return writer

    writers = await asyncio.gather(*(one(i) for i in range(spec.sessions)))
    for writer in writers:
        writer.write(DISCONNECT)
        writer.close()
    for writer in writers:
        with contextlib.suppress(OSError):
            await writer.wait_closed()


def run(args: argparse.Namespace, tmp: Path, out: list[tuple[float, float]]) -> None:
    brokers, _store = build_brokers(args, tmp)
    b = brokers[OURS]
    b.start(300.0)
    try:
        spec = StormSpec(b.port, b.login, "cpu", args.sessions, 1, timeout=args.timeout)
        asyncio.run(set_up_sessions(spec))
        time.sleep(1.0)  # the set-up's disconnects are handled
        for _ in range(args.rounds):
            cpu0, t0 = cpu_seconds(b.pid), time.perf_counter()
            asyncio.run(reconnect_all(spec))
            wall = time.perf_counter() - t0
            time.sleep(1.0)  # the broker ends the connections
            out.append(((cpu_seconds(b.pid) - cpu0) * 1e6 / args.sessions, wall))
            log(f"  {out[-1][0]:,.0f} µs of broker CPU per connection; round {wall:.2f} s")
    finally:
        log(f"stopped ours: {b.stop(30.0)}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=1000, help="durable sessions (default 1000)")
    p.add_argument("--rounds", type=int, default=2, help="reconnect rounds (default 2)")
    p.add_argument("--timeout", type=float, default=120.0, help="time bound of each phase (s)")
    add_pin_arguments(p, "the broker", "the load client")
    args = p.parse_args(argv)
    check_pin_arguments(p, args)
    args.big, args.snapshot, args.ours_cmd, args.ours_standin = 1, True, None, False
    out: list[tuple[float, float]] = []
    run_in_temp_folder("connect_cpu_", False, lambda tmp: run(args, tmp, out), log)
    print(" ".join(f"{us:.0f} µs/connection (round {wall:.2f} s)" for us, wall in out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
