#!/usr/bin/env python3
"""Profile our broker during a reconnect storm with py-spy (issue 14, point 3): where a CONNECT's time goes.

    .venv/bin/python bench/profile_storm.py --sessions 1000 --messages 100 --out /tmp/profile_storm.md

Our broker (bench_storm.py's configuration, from a snapshot of plugin/, pinned to --broker-cpus) gets the
sessions and their backlog as in bench_storm.py; then `py-spy record` attaches and the storm runs (all
sessions reconnect at once, every message PUBACKed).  Only the storm is sampled.  The report sorts the
samples into the stages of a connection (reading the CONNECT, amqtt's set-up, our CONNACK-time step, our
attach, replay, PUBACK intake, background writes) and scales them to microseconds per CONNECT.

Needs py-spy (the bench extra) and ptrace permission on the broker's PID (root, or ptrace_scope 0).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from multiprocessing.connection import Connection
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    CLIENT_START_S,
    OURS,
    RESULT_MARGIN_S,
    VENV_BIN,
    add_pin_arguments,
    check_pin_arguments,
    log,
    machine_info,
    run_in_temp_folder,
    write_report,
)
from _harness import build_brokers
from _rawmqtt import ClientProcess
from _storm import StormResult, StormSpec, enqueue, set_up_sessions, storm
from profile_replay import frame_name

TOP = 40
# A sample goes to the first stage (in this order) one of whose patterns (substrings of "path:function")
# a frame of its stack contains; the rest is the event loop itself.
STAGES: list[tuple[str, tuple[str, ...]]] = [
    ("asyncio accept, transport and StreamReader set-up", ("_accept_connection", "connection_made")),
    ("Session(): amqtt's transitions.Machine (Session._init_states)", ("Session._init_states",
                                                                        "_init_session_states")),
    ("init_from_connect: CONNECT decode, Session and handler queues (the rest)",
     ("BrokerProtocolHandler.init_from_connect",)),
    ("our init_from_connect wrapper (owner, will ACL, pre-authentication)", ("init_from_connect",)),
    ("our per-connection set-up (_wrap_handler, FastReader, OrderedAcks, control channel)",
     ("AmqttHooks.initialize_client_session",)),
    ("INFO log lines per connection", ("Logger.info",)),
    ("authentication (map_plugin_auth)", ("AmqttHooks.authenticate",)),
    ("session state connect()", ("_handle_client_session;transitions/", "SessionStates.connect", "Event.trigger")),
    ("our _connect_durable (engine.connect, session-present)", ("_connect_durable",)),
    ("CONNACK write (connack_authorize)", ("connack_authorize",)),
    ("handler.start", ("BrokerProtocolHandler.start", "ProtocolHandler.start")),
    ("our attach: commit request, _save_record, Pump set-up", ("SessionLifecycle.attach",)),
    ("amqtt's message loop set-up (ensure_future, asyncio.wait)", ("Broker._client_message_loop",)),
    ("rest of the connection task", ("Broker.stream_connected",)),
    ("replay: the pumps (store reads, PUBLISH build and write)", ("Pump.",)),
    ("PUBACK intake (FastReader, take_acks, ack bookkeeping)", ("FastReader",)),
    ("store writes (group commit flushes)", ("GroupCommitter",)),
]


OTHER = "event loop itself, other tasks"


def stage_of(frames: list[str]) -> str:
    joined = ";".join(frames)
    for stage, patterns in STAGES:
        if any(p in joined for p in patterns):
            return stage
    return OTHER


def analyse(raw: Path) -> tuple[int, Counter[str], Counter[str], Counter[str]]:
    total = 0
    own: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    stages: Counter[str] = Counter()
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [frame_name(f) for f in stack.split(";") if not f.startswith(("process ", "thread "))]
        if not frames:
            continue
        total += count
        own[frames[-1]] += count
        stages[stage_of(frames)] += count
        for name in set(frames):
            if "amqtt" in name:
                incl[name] += count
    return total, own, incl, stages


def profiled_storm_main(spec: StormSpec, pipe: Connection) -> None:
    """Child process: set-up and enqueue, report ("enqueued"), wait for "go", storm, report ("result")."""
    if spec.cpus:
        with contextlib.suppress(AttributeError, OSError):
            os.sched_setaffinity(0, set(spec.cpus))
    pipe.send(("ready", None))

    async def main() -> StormResult:
        result = StormResult(spec.sessions, spec.messages)
        await set_up_sessions(spec)
        await enqueue(spec, result)
        pipe.send(("enqueued", result.enqueue_s))
        loop = asyncio.get_running_loop()
        if not await loop.run_in_executor(None, pipe.poll, 120.0):
            raise TimeoutError("no go within 120 s")
        pipe.recv()
        await storm(spec, result)
        return result

    try:
        result = asyncio.run(main())
    except Exception as exc:
        pipe.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    with contextlib.suppress(OSError):
        pipe.send(("result", result))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of the process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def render(args: argparse.Namespace, info: dict[str, str], command: str, res: StormResult, raw: Path, *,
           cpu_s: float) -> str:
    total, own, incl, stages = analyse(raw)
    # µs of broker CPU per CONNECT that one sample stands for: the broker's CPU time over the storm (from
    # /proc, so time other processes took from it does not count) shared out by the samples, which
    # py-spy also takes while the broker is runnable but off the CPU
    per = cpu_s * 1e6 / max(1, total) / args.sessions
    lines = [
        "# Reconnect storm profile (py-spy)",
        "",
        f"- command: `{command}`",
        f"- machine: nproc={info['nproc']}, CPU {info['cpu']}, {info['os']}; {info['python']}",
        f"- storm: {args.sessions:,} sessions x {args.messages:,} queued messages reconnecting at once; "
        f"with py-spy at {args.rate} Hz (the broker is paused per sample, so the storm is slower): "
        f"{res.summary()}, all delivered in {res.storm_s} s, slowest first message {res.slowest_first_ms} ms",
        f"- {total:,} samples of the broker's busy threads ({total / args.rate:.2f} s at {args.rate} Hz); the broker "
        f"used {cpu_s:.2f} s of CPU from go to result (/proc) = {cpu_s * 1e6 / args.sessions:,.0f} µs per CONNECT "
        f"(all of it, replay included); one sample = {per:.2f} µs per CONNECT",
        "",
        "## Per stage (the first 14 are the CONNECT path)",
        "",
        "| stage | samples | share | µs per CONNECT |",
        "|---|---:|---:|---:|",
        *[f"| {n} | {stages[n]:,} | {100 * stages[n] / total:.1f}% | {stages[n] * per:,.0f} |"
          for n in [name for name, _ in STAGES] + [OTHER]],
        "",
        f"## Inclusive time of amqtt and amqtt_durable functions (top {TOP})",
        "",
        "| function | samples | share | µs per CONNECT |",
        "|---|---:|---:|---:|",
        *[f"| `{n}` | {c:,} | {100 * c / total:.1f}% | {c * per:,.0f} |" for n, c in incl.most_common(TOP)],
        "",
        f"## Self time (top {TOP})",
        "",
        "| function | samples | share | µs per CONNECT |",
        "|---|---:|---:|---:|",
        *[f"| `{n}` | {c:,} | {100 * c / total:.1f}% | {c * per:,.0f} |" for n, c in own.most_common(TOP)],
    ]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace, tmp: Path, out: dict[str, str], info: dict[str, str], command: str) -> None:
    brokers, _store = build_brokers(args, tmp)
    b = brokers[OURS]
    log(f"starting ours: {shlex.join(b.argv)}")
    b.start(300.0)
    raw = tmp / "storm.raw.txt"
    spy = None
    try:
        spec = StormSpec(b.port, b.login, "prof", args.sessions, args.messages, 100, args.timeout, probe=True,
                         cpus=args.client_cpus if args.pin else None)
        with ClientProcess("storm", profiled_storm_main, spec) as client:
            client.expect("ready", CLIENT_START_S)
            enqueue_s = client.expect("enqueued", args.timeout + RESULT_MARGIN_S)
            log(f"  enqueued in {enqueue_s:.1f} s; attaching py-spy to {b.pid}")
            time.sleep(1.0)  # the broker finishes writing the backlog
            spy = subprocess.Popen([args.py_spy, "record", "--pid", str(b.pid), "--rate", str(args.rate),
                                    "--format", "raw", "--output", str(raw)],
                                   stdout=subprocess.DEVNULL, stderr=(tmp / "py-spy.log").open("wb"))
            time.sleep(2.0)  # py-spy attaches
            cpu_before = cpu_seconds(b.pid)
            client.send("go")
            res: StormResult = client.expect("result", args.timeout + RESULT_MARGIN_S)
            cpu_s = cpu_seconds(b.pid) - cpu_before
        log(f"  storm: {res.summary()}; {res.storm_s} s, slowest first {res.slowest_first_ms} ms")
    finally:
        if spy is not None:
            spy.send_signal(signal.SIGINT)  # our own py-spy child, by its PID: it writes the profile and exits
            try:
                spy.wait(60.0)
            except subprocess.TimeoutExpired:
                spy.kill()
                spy.wait(10.0)
        log(f"stopped ours: {b.stop(30.0)}")
    if args.keep_raw and raw.exists():
        shutil.copy(raw, args.keep_raw)
    out["report"] = render(args, info, command, res, raw, cpu_s=cpu_s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=1000, help="durable sessions (default 1000)")
    p.add_argument("--messages", type=int, default=100, help="queued messages per session (default 100)")
    p.add_argument("--timeout", type=float, default=300.0, help="time bound of each phase (s)")
    p.add_argument("--rate", type=int, default=500, help="py-spy samples per second (default 500)")
    p.add_argument("--py-spy", default=str(VENV_BIN / "py-spy"), help="the py-spy executable")
    p.add_argument("--keep-raw", type=Path, default=None, help="copy py-spy's collapsed stacks to this file")
    p.add_argument("--out", type=Path, default=None, help="also write the markdown report to this file")
    add_pin_arguments(p, "the broker", "the load client")
    args = p.parse_args(argv)
    check_pin_arguments(p, args)
    args.big, args.snapshot, args.ours_cmd, args.ours_standin = args.messages, True, None, False
    command = shlex.join([sys.executable, *(sys.argv if argv is None else ["bench/profile_storm.py", *argv])])
    info = machine_info()
    out: dict[str, str] = {}
    notes: list[str] = []
    run_in_temp_folder("profile_storm_", False, lambda tmp: run(args, tmp, out, info, command), notes.append)
    write_report(out.get("report", "profile failed: " + "; ".join(notes) + "\n"), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
