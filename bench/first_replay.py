#!/usr/bin/env python3
"""CONNECT -> first replayed message, many times over (issue 14: the first replayed message's latency).

    .venv/bin/python bench/first_replay.py --n 20000 --rounds 10

Our broker (bench_durable.py's configuration, from a snapshot of plugin/, pinned to --broker-cpus), and
Mosquitto with --mosquitto, each get --rounds times what scenario (c) of bench_durable.py does once: a durable
subscriber subscribes and disconnects, a raw publisher queues --n messages, the subscriber reconnects
(bench_durable.py's subscriber process, the same clock points) and drains the queue.  Printed per broker:
CONNECT -> CONNACK and CONNECT -> first replayed PUBLISH (as the subscriber's recv returns it), every round
and the median, and the replay rate.  Many rounds against one broker give a median that one benchmark run
(three rounds, with a fresh broker each) does not.

``--base DIR`` adds a second broker of ours, run from a snapshot of DIR's plugin (another worktree, say main's),
measured in the same rounds, interleaved: on a shared machine two figures compare only when taken together.
``--ours-cmd`` runs our broker under another command (say, a launcher that time-stamps its steps).
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common
from _common import (
    CLIENT_START_S,
    MOSQUITTO,
    OURS,
    RESULT_MARGIN_S,
    add_pin_arguments,
    check_pin_arguments,
    ensure_mosquitto,
    log,
    run_in_temp_folder,
    run_publisher,
)
from _harness import build_brokers
from _rawmqtt import ClientProcess, PubSpec, ReceiveResult, SubSpec, publisher_main, session_roundtrip, subscriber_main

SETTLE_S = 0.3  # after the set-up's DISCONNECT, as bench_durable.py waits
BASE = "base"


def one_round(args: argparse.Namespace, port: int, login: object, name: str) -> ReceiveResult:
    cpus = args.client_cpus if args.pin else None
    topic, sub_id, pub_id = f"first/{name}", f"first-sub-{name}", f"first-pub-{name}"
    tag = name.encode()[-4:].rjust(4, b"_")
    session_roundtrip(port, sub_id, login, clean=False, topic=topic, timeout=60.0)  # type: ignore[arg-type]
    time.sleep(SETTLE_S)
    spec = PubSpec(port, pub_id, login, topic, tag, args.n, 100, 600.0, 0.0, cpus,  # type: ignore[arg-type]
                   flush_topic=f"first-flush/{name}")
    with ClientProcess("publisher", publisher_main, spec) as pub:
        pr = run_publisher(pub, 600.0)
    if pr.acked < args.n:
        raise RuntimeError(f"{name}: only {pr.acked:,}/{args.n:,} queued")
    sspec = SubSpec(port, sub_id, login, False, tag, args.n, 600.0, idle=10.0, need_session=True,  # type: ignore[arg-type]
                    cpus=cpus)
    with ClientProcess("subscriber", subscriber_main, sspec) as sub:
        sub.expect("ready", CLIENT_START_S)
        res: ReceiveResult = sub.expect("result", 600.0 + RESULT_MARGIN_S)
    session_roundtrip(port, sub_id, login, clean=True, topic=None, timeout=60.0)  # type: ignore[arg-type]
    if res.error or res.unique < args.n:
        raise RuntimeError(f"{name}: {res.error or f'{res.unique:,}/{args.n:,} received'}")
    return res


def run(args: argparse.Namespace, tmp: Path, out: dict[str, list[tuple[float, float, float]]]) -> None:
    binary = ensure_mosquitto()[0] if args.mosquitto else None
    brokers, _store = build_brokers(args, tmp, mosquitto=binary)
    names = [OURS] + ([MOSQUITTO] if MOSQUITTO in brokers else [])
    if args.base is not None:
        folder = tmp / BASE
        folder.mkdir()
        packages = [args.base / p.relative_to(_common.ROOT) for p in (_common.PLUGIN_DIR, _common.PROTOCOL_DIR)]
        snap = _common.snapshot_packages(packages, folder / "snapshot")
        base_args = argparse.Namespace(**{**vars(args), "ours_cmd": shlex.join(
            ["env", f"PYTHONPATH={snap}", str(_common.VENV_BIN / "python"), "-m", "amqtt_durable.cli", "broker"])})
        brokers[BASE] = build_brokers(base_args, folder)[0][OURS]
        brokers[BASE].name = BASE
        names.insert(1, BASE)
    for name in names:
        brokers[name].start(300.0)
    try:
        for i in range(args.rounds):
            for name in names if i % 2 == 0 else reversed(names):
                b = brokers[name]
                res = one_round(args, b.port, b.login, f"{name[:1]}{i:03d}")
                connack = (res.t_connack_ns - res.t_connect_ns) / 1e6
                first = (res.t_first_ns - res.t_connect_ns) / 1e6
                rate = res.unique / ((res.t_last_ns - res.t_connect_ns) / 1e9)
                out.setdefault(name, []).append((connack, first, rate))
                log(f"  {name} round {i}: CONNACK {connack:.3f} ms, first {first:.3f} ms, replay {rate:,.0f} msgs/s")
    finally:
        for name in names:
            log(f"stopped {name}: {brokers[name].stop(30.0)}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=20_000, help="messages queued per round (default 20000)")
    p.add_argument("--rounds", type=int, default=10, help="reconnects per broker (default 10)")
    p.add_argument("--mosquitto", action=argparse.BooleanOptionalAction, default=False,
                   help="also measure Mosquitto, rounds interleaved (default off)")
    p.add_argument("--base", type=Path, default=None,
                   help="also measure our broker as in this folder (a worktree: DIR/plugin), rounds interleaved")
    p.add_argument("--ours-cmd", default=None, help="command prefix for our broker (default: a snapshot of plugin/)")
    add_pin_arguments(p, "the brokers", "the load clients")
    args = p.parse_args(argv)
    check_pin_arguments(p, args)
    args.big, args.snapshot, args.ours_standin = 1, args.ours_cmd is None, False
    out: dict[str, list[tuple[float, float, float]]] = {}
    run_in_temp_folder("first_replay_", False, lambda tmp: run(args, tmp, out), log)
    for name, rows in out.items():
        connack, first, rate = (statistics.median(col) for col in zip(*rows, strict=True))
        print(f"{name}: {len(rows)} rounds, median CONNACK {connack:.3f} ms, first replayed {first:.3f} ms "
              f"(min {min(r[1] for r in rows):.3f}, max {max(r[1] for r in rows):.3f}), replay {rate:,.0f} msgs/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
