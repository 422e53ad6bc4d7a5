"""``amqtt-durable fleet``: prove the delivery guarantees on a simulated fleet behind faults.

Exit status: 0 when every device got every acknowledged message in order (and CPL-2 devices
each exactly once), 1 when not (or when the broker did not come back after its SIGKILL), 2 for
bad input (options, schedule file, broker.yaml, --out) or a run that could not be carried out (a
broker that does not start, devices never ready, a worker process that died), 3 for a fault of
the harness itself (traceback printed).
"""

from __future__ import annotations

import argparse
import random
import re
import signal
import sys
import traceback
from pathlib import Path
from typing import cast
from urllib.parse import quote

from amqtt_durable.cli import load_broker_config, plugin_section
from amqtt_durable.config import MAX_KEEPALIVE, DurableConfig
from amqtt_durable.errors import ConfigError
from amqtt_durable.settings import WrittenFloat
from durable_pipeline.errors import PipelineError
from durable_pipeline.spark import check_master, check_out_folder
from durable_protocol.hostport import parse_host

from .errors import BrokerLostError, FleetError, ScheduleError
from .model import ALL_FAULT_KINDS, DEVICE_KINDS, DeviceKind, FaultKind
from .runner import FleetOptions, device_names, run_fleet
from .schedule import load_schedule, parse_duration, random_schedule

MAX_RATE = 10_000_000
"""The highest --rate (messages per second, exclusive) the command takes."""

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 3
DEFAULT_FAULTS = "drop=3,stall=3,broker_kill=1,device_restart=3"
DEFAULT_FAULTS_RUNNING_BROKER = "drop=3,stall=3,device_restart=3"
"""With --port the broker is not ours to kill."""
DEFAULT_FAULTS_HA = "drop=3,stall=3,primary_kill=1,partition=1,device_restart=3"
"""With --ha the faults on the brokers hit whichever is primary."""
PREFIX = re.compile(r"[A-Za-z0-9_.:-]*")
MAX_DEVICE_NAME = 255 - len(".jsonl")
"""The longest device name (percent-encoded, as the SDK names a state folder): its delivery log is NAME.jsonl, and
file names are at most 255 bytes on most file systems."""


def number(text: str) -> float:
    """argparse's type of a number option: its errors quote it as typed (``--rate 0``: ``got 0``, not 0.0)."""
    return WrittenFloat(text)


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _weights(text: str, valid: tuple[str, ...], what: str) -> dict[str, int]:
    """'a=2,b=1' -> {'a': 2, 'b': 1}; every name must be one of ``valid``."""
    weights: dict[str, int] = {}
    for part in filter(None, (item.strip() for item in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep or name not in valid or not value.isdigit():
            raise argparse.ArgumentTypeError(
                f"{what}: {part!r} is not NAME=COUNT with NAME one of {', '.join(valid)} and COUNT a whole number"
            )
        weights[name] = int(value)
    return weights


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="amqtt-durable fleet",
        description="Run simulated devices behind a TCP fault proxy, apply a fault schedule, then audit "
        "every delivery with Spark. Defaults finish in under 2 minutes on 2 cores.",
    )
    target = parser.add_mutually_exclusive_group()
    target.add_argument("-c", "--config", type=Path, default=Path("broker.yaml"),
                        help="broker.yaml of the broker to start (default: %(default)s); the harness gives it its own "
                        "127.0.0.1 port, a store under OUT/store and metrics every second")
    target.add_argument("--port", type=int, help="target a running broker on --host:PORT instead (no broker kills)")
    parser.add_argument("--host", default="127.0.0.1", help="host of the running broker given by --port")
    parser.add_argument("--ha", action="store_true",
                        help="start a replicated pair from --config instead of one broker: a real etcd (Debian's "
                        "etcd-server) and two brokers in sync mode; devices and publishers reach whichever is primary "
                        "through the harness's proxies; enables the faults primary_kill, partition and group_kill")
    parser.add_argument("--out", type=Path, default=Path("fleet-out"), help="output folder (default: %(default)s)")
    parser.add_argument("--devices", type=int, default=20, help="simulated devices (default: %(default)s)")
    parser.add_argument("--mix", default="cpl1=1,cpl2=1,paho=1",
                        help="device kinds by weight: cpl1 (SDK, memory), cpl2 (SDK, fsync'd journal), paho (plain "
                        "paho, clean_session=False) (default: %(default)s)")
    parser.add_argument("--processes", type=int, default=8,
                        help="device processes; a device_restart kills the target's whole process "
                        "(default: %(default)s)")
    parser.add_argument("--rate", type=number, default=100.0,
                        help="messages per second from all publishers together (default: %(default)s)")
    parser.add_argument("--publishers", type=int, default=2, help="publisher processes (default: %(default)s)")
    parser.add_argument("--qos", type=int, choices=(0, 1), default=1,
                        help="publish QoS; with 0 the audit counts QoS 0 sends too, so drops show up as loss")
    parser.add_argument("--duration", type=_duration, default=45.0,
                        help="publishing time, e.g. 45s or 10m (default: 45s)")
    parser.add_argument("--keepalive", type=int, default=4,
                        help="devices' MQTT keep-alive, 1 to 65535 s; stalls outlast it (default: %(default)s)")
    schedule = parser.add_mutually_exclusive_group()
    schedule.add_argument("--schedule", type=Path,
                          help="scripted faults: a YAML/JSON file (format: docs/fleet.md, 'Scripted schedule')")
    schedule.add_argument("--faults",
                          help="random faults per kind, KIND=COUNT: drop, stall, broker_kill, device_restart; with "
                          "--ha, primary_kill, partition and group_kill instead of broker_kill "
                          f"(default: {DEFAULT_FAULTS}; with --port: {DEFAULT_FAULTS_RUNNING_BROKER}; with --ha: "
                          f"{DEFAULT_FAULTS_HA})")
    parser.add_argument("--seed", type=int, help="seed of the random schedule (default: a random one, printed)")
    parser.add_argument("--drain-timeout", type=_duration, default=60.0,
                        help="after publishing, how long to wait for devices to catch up (default: 60s)")
    parser.add_argument("--prefix", default="dev-", help="device client-id prefix (default: %(default)s)")
    parser.add_argument("--broadcast-every", type=int, default=10,
                        help="every N-th message goes to all devices (fleet/broadcast), 0 for none "
                        "(default: %(default)s)")
    parser.add_argument("--master", default="local[2]", help="Spark master of the audit (default: %(default)s)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def _check_numbers(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    for name in ("devices", "processes", "publishers", "keepalive"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be 1 or more, got {getattr(args, name)}")
    if args.keepalive > MAX_KEEPALIVE:  # an MQTT CONNECT carries it in 16 bits: every device would be refused
        parser.error(f"--keepalive must be a whole number of seconds from 1 to {MAX_KEEPALIVE}, got {args.keepalive}")
    if not 0 < args.rate < MAX_RATE:
        parser.error(f"--rate must be a positive number of messages per second below {MAX_RATE:,}, got {args.rate}")
    if args.duration <= 0:
        parser.error("--duration must be more than 0")
    if args.broadcast_every < 0:
        parser.error(f"--broadcast-every must be 0 or more, got {args.broadcast_every}")
    if not PREFIX.fullmatch(args.prefix):
        parser.error(f"--prefix {args.prefix!r}: use letters, digits and _ . : - only (it is in topic names)")
    longest = f"{args.prefix}{args.devices - 1:03d}"  # names a delivery log NAME.jsonl and a cpl2 state folder
    counted = len(quote(longest, safe=""))
    if counted > MAX_DEVICE_NAME:
        parser.error(
            f"--prefix is too long for --devices {args.devices}: device {longest[-20:]!r} ({counted} characters, "
            f"':' counted as 3) would name files longer than a file name may be; keep its name within "
            f"{MAX_DEVICE_NAME} characters"
        )
    try:
        check_master(args.master)  # the audit's; Spark starts only after the run
        check_out_folder(args.out)  # a local folder: the audit writes under it
    except PipelineError as exc:
        parser.error(str(exc))
    _check_target(args, parser)


def _check_target(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.port is not None and not 0 < args.port < 65536:
        parser.error(f"--port must be a TCP port from 1 to 65535, got {args.port}")
    if args.port is None and args.host != "127.0.0.1":
        parser.error("--host names a running broker: give its --port too")
    try:  # the proxy and the publishers connect to it: refused now, not by every connection of the run
        args.host = parse_host(args.host)
    except ValueError as exc:
        parser.error(f"--host must be a host name or an IP address, got {args.host!r}: {exc}")
    if args.ha and args.port is not None:
        parser.error("--ha starts a replicated pair from --config; it cannot target a running broker (--port)")


def _mix_and_faults(
    args: argparse.Namespace, parser: argparse.ArgumentParser
) -> tuple[dict[DeviceKind, int], dict[FaultKind, int]]:
    if args.faults is None:
        args.faults = (
            DEFAULT_FAULTS_HA if args.ha else DEFAULT_FAULTS if args.port is None else DEFAULT_FAULTS_RUNNING_BROKER
        )
    try:
        mix = cast(dict[DeviceKind, int], _weights(args.mix, DEVICE_KINDS, "--mix"))
        counts = cast(dict[FaultKind, int], _weights(args.faults, ALL_FAULT_KINDS, "--faults"))
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    if sum(mix.values()) == 0:
        parser.error("--mix gives every device kind weight 0")
    return mix, counts


def options_from(args: argparse.Namespace, parser: argparse.ArgumentParser) -> FleetOptions:
    """Check what argparse cannot and build the run's options; exits 2 with the problem named."""
    _check_numbers(args, parser)
    mix, counts = _mix_and_faults(args, parser)
    config = None
    if args.port is None:
        path = str(args.config)
        try:
            config = load_broker_config(path)
        except ConfigError as exc:  # a bad setting names its file too (-c defaults to ./broker.yaml)
            parser.error(str(exc) if f"'{path}'" in exc.problem else f"{path}: {exc}")
        limit = DurableConfig.from_mapping(plugin_section(config)).max_keepalive
        if limit and args.keepalive > limit:
            parser.error(
                f"--keepalive {args.keepalive} is above the max_keepalive ({limit}) of {path}: every device "
                f"would get CONNACK 2; give --keepalive {limit} or less"
            )
    names = device_names(args.prefix, args.devices)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    try:
        if args.schedule is not None:
            faults = load_schedule(args.schedule, devices=names, duration=args.duration, ha=args.ha,
                                   running_broker=args.port is not None)
            note = f"from {args.schedule}"
        else:
            faults = random_schedule(seed, duration=args.duration, devices=names, counts=counts,
                                     keepalive=args.keepalive, ha=args.ha)
            note = f"random, --seed {seed}"
    except (ScheduleError, ValueError) as exc:
        parser.error(str(exc))
    if config is None and any(fault.kind == "broker_kill" for fault in faults):
        parser.error("broker_kill faults need a broker the harness starts (--config), not --port; "
                     "use --faults without broker_kill")
    return FleetOptions(
        out=args.out, devices=args.devices, mix=mix, rate=args.rate, duration=args.duration, qos=args.qos,
        publishers=args.publishers, processes=args.processes, keepalive=args.keepalive, faults=faults,
        config=config, host=args.host, port=args.port, prefix=args.prefix, drain_timeout=args.drain_timeout,
        master=args.master, progress=None if args.quiet else sys.stderr, schedule_note=note,
        broadcast_every=args.broadcast_every, ha=args.ha,
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        options = options_from(args, parser)
    except SystemExit as exc:
        return int(exc.code or 0)
    from .report import format_summary, write_fleet_report  # noqa: PLC0415 - matplotlib only for a real run

    # SIGTERM (a cancelled CI job) unwinds like Ctrl-C, so the broker and every worker are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    print(f"fleet: {options.devices} devices, {options.rate:g} messages/s for {options.duration:g} s, "
          f"{len(options.faults)} faults ({options.schedule_note}); output in {options.out}", file=sys.stderr)
    try:
        result = run_fleet(options)
    except BrokerLostError as exc:
        print(f"FAIL: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except (FleetError, PipelineError) as exc:
        print(f"amqtt-durable fleet: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception:
        traceback.print_exc()
        print("amqtt-durable fleet: the harness failed (a bug of the harness, not a verdict)", file=sys.stderr)
        return EXIT_INTERNAL
    write_fleet_report(result)
    print(format_summary(result))
    return 0 if result.ok else EXIT_FAILED

if __name__ == "__main__":
    sys.exit(main())
