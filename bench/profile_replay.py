#!/usr/bin/env python3
"""Profile our broker's replay path with py-spy (issue 14, point 1): where each microsecond per message goes.

    .venv/bin/python bench/profile_replay.py --n 200000 --out bench/PROFILE-replay.md

Our broker (bench_durable.py's configuration, from a snapshot of plugin/, pinned to --broker-cpus) gets a
durable subscriber, which disconnects; a raw publisher queues --n messages; then the subscriber reconnects
and drains them twice: once without the profiler (the replay time per message), once, with a fresh backlog,
while `py-spy record` samples the broker (collapsed stacks).  The report attributes the
samples to functions (self and inclusive) and scales them to microseconds per replayed message.

Needs py-spy (the bench extra) and ptrace permission on the broker's PID (root, or ptrace_scope 0).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
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
    recv_summary,
    run_in_temp_folder,
    run_publisher,
    write_report,
)
from _harness import build_brokers
from _rawmqtt import ClientProcess, PubSpec, ReceiveResult, SubSpec, publisher_main, session_roundtrip, subscriber_main

TOP = 30
# Stages of the replay path: a sample goes to the first stage, walking its stack from the leaf to the root,
# one of whose patterns (substrings of "path:function") a frame contains; the rest is the event loop itself.
STAGES: list[tuple[str, tuple[str, ...]]] = [
    ("store read: iterate queue entries, get + decode bodies",
     ("read_entries", "iter_entries", "Body.decode", "Entry.decode", "seq_of_entry_key", "body_key", "read_stored",
      "read_entry_run", "check_bodies")),
    ("ack bookkeeping: remove_entry, release_body, pending removals, flush_soon",
     ("remove_entr", "release_bod", "PendingRemovals", "GroupCommitter.flush_soon", "GroupCommitter.delete",
      "Pump._acked", "Pump.take_pubacks", "Pump.end_ack_run", "erase_entries", "erase_bodies", "advance_sent_mark")),
    ("store write: the write batches of removals", ("GroupCommitter._write", "GroupCommitter._start_flush",
                                                    "GroupCommitter._finish", "GroupCommitter.commit")),
    ("PUBLISH: build packets + write to the transport",
     ("Pump._send", "PublishRun", "encode_publish", "remaining_length", "packet_id_for", "Pump._take_sendable",
      "Pump._payload", "HandlerTransport._flush", "HandlerTransport.drain", "HandlerTransport.write",
      "Transport.write")),
    ("PUBACK: read + parse + dispatch", ("FastReader", "take_ack", "StreamReader", "_read_ready",
                                         "data_received")),
    ("pump control: window, wake-ups, refill", ("Pump.", "Event.set", "Event.wait")),
]


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """User + system CPU time so far (Linux /proc) of process ``pid``, or of its thread ``tid``."""
    where = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    fields = Path(where).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def broker_cpu(pid: int) -> tuple[float, float]:
    """(the whole broker process, its main thread: the event loop) CPU seconds so far."""
    return cpu_seconds(pid), cpu_seconds(pid, pid)


def replay_once(args: argparse.Namespace, port: int, login: object, name: str, *,
                tmp: Path, profile_to: Path | None, pid: int) -> tuple[ReceiveResult, Path | None, tuple[float, float]]:
    """Queue --n messages and drain them; also returns the broker's CPU seconds (process, main thread)
    from the subscriber's start to its result (the broker does nothing else meanwhile)."""
    cpus = args.client_cpus if args.pin else None
    topic, sub_id, pub_id = f"prof/{name}", f"prof-sub-{name}", f"prof-pub-{name}"
    tag = name.encode()[:4].ljust(4, b"_")
    session_roundtrip(port, sub_id, login, clean=False, topic=topic, timeout=60.0)  # type: ignore[arg-type]
    time.sleep(0.5)
    spec = PubSpec(port, pub_id, login, topic, tag, args.n, 100, 600.0, 0.0, cpus,  # type: ignore[arg-type]
                   flush_topic=f"prof-flush/{name}")
    with ClientProcess("publisher", publisher_main, spec) as pub:
        pr = run_publisher(pub, 600.0)
    log(f"  queued {pr.acked:,}/{args.n:,}")
    spy = None
    if profile_to is not None:
        spy = subprocess.Popen([args.py_spy, "record", "--pid", str(pid), "--rate", str(args.rate),
                                "--format", "raw", "--output", str(profile_to)],
                               stdout=subprocess.DEVNULL, stderr=(tmp / "py-spy.log").open("wb"))
        time.sleep(2.0)  # py-spy attaches
    sspec = SubSpec(port, sub_id, login, False, tag, args.n, 600.0, idle=10.0, need_session=True,  # type: ignore[arg-type]
                    cpus=cpus)
    cpu_before = broker_cpu(pid)
    with ClientProcess("subscriber", subscriber_main, sspec) as sub:
        sub.expect("ready", CLIENT_START_S)
        res: ReceiveResult = sub.expect("result", 600.0 + RESULT_MARGIN_S)
    cpu_after = broker_cpu(pid)
    if spy is not None:
        spy.send_signal(signal.SIGINT)  # our own py-spy child, by its PID: it writes the profile and exits
        try:
            spy.wait(60.0)
        except subprocess.TimeoutExpired:
            spy.kill()
            spy.wait(10.0)
    session_roundtrip(port, sub_id, login, clean=True, topic=None, timeout=60.0)  # type: ignore[arg-type]
    return res, profile_to, (cpu_after[0] - cpu_before[0], cpu_after[1] - cpu_before[1])


def frame_name(frame: str) -> str:
    """'deliver (amqtt_durable/engine.py:123)' -> 'amqtt_durable/engine.py:deliver'."""
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    for marker in ("site-packages/", "/plugin/", "/lib/python3.11/"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{path}:{name}"


OURS_PREFIX = "amqtt_durable/"
ENTRY_PREFIX = "amqtt_durable/cli.py:"


def stage_of(frames: list[str]) -> str:
    for frame in reversed(frames):
        for stage, patterns in STAGES:
            if any(pattern in frame for pattern in patterns):
                return stage
    return "event loop itself: select, callbacks, tasks"


def analyse(raw: Path) -> tuple[int, Counter[str], Counter[str], Counter[str], Counter[str]]:
    """Samples; self time per leaf function; per nearest amqtt_durable function (the deepest of ours in
    the stack, so time in the stdlib, plyvel or amqtt below it counts to it); inclusive per function of ours."""
    total = 0
    own: Counter[str] = Counter()
    nearest: Counter[str] = Counter()
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
        ours = [f for f in frames if f.startswith(OURS_PREFIX)]
        inner = [f for f in ours if not f.startswith(ENTRY_PREFIX)]  # cli.py only runs the loop
        nearest[inner[-1] if inner else f"(event loop itself) {frames[-1]}"] += count
        for name in set(ours):
            incl[name] += count
    return total, own, nearest, incl, stages


def render(args: argparse.Namespace, info: dict[str, str], command: str, *, base: ReceiveResult,
           prof: ReceiveResult, raw: Path | None, base_cpu: tuple[float, float], prof_cpu: tuple[float, float]) -> str:
    secs = (base.t_last_ns - base.t_connect_ns) / 1e9
    us_per_msg = secs * 1e6 / max(1, base.unique)
    psecs = (prof.t_last_ns - prof.t_connect_ns) / 1e9
    lines = [
        "# Replay profile (py-spy)",
        "",
        f"- command: `{command}`",
        f"- machine: nproc={info['nproc']}, CPU {info['cpu']}, {info['os']}; {info['python']}",
        f"- replay of {args.n:,} queued 64-byte QoS1 messages to one reconnecting durable subscriber "
        f"(100 in flight), broker pinned to CPU {args.broker_cpus}",
        f"- without the profiler: {recv_summary(base, args.n)} in {secs:.2f} s = {base.unique / secs:,.0f} msgs/s "
        f"= **{us_per_msg:.2f} µs per message** (wall, broker-bound)",
        f"- with py-spy at {args.rate} Hz (the broker is paused per sample, so this run is slower; only the "
        f"shares are used): {recv_summary(prof, args.n)} in {psecs:.2f} s",
        f"- broker CPU (/proc, user + system) from the subscriber's start to its result, per message: "
        f"**{base_cpu[0] * 1e6 / args.n:.2f} µs** without the profiler (main thread {base_cpu[1] * 1e6 / args.n:.2f}), "
        f"{prof_cpu[0] * 1e6 / args.n:.2f} µs with it (main thread {prof_cpu[1] * 1e6 / args.n:.2f})",
    ]
    if raw is None or not raw.exists():
        return "\n".join([*lines, "", "py-spy produced no profile."]) + "\n"
    total, own, nearest, incl, stages = analyse(raw)
    lines += [
        f"- {total:,} samples of the broker's busy threads (idle waits excluded) = **{total * 1000 / args.n:.2f} "
        f"per 1,000 messages**; µs/msg = share of samples x {us_per_msg:.2f} µs",
        "",
        "## Per stage of the replay path",
        "",
        "| stage | samples | share | µs/msg |",
        "|---|---:|---:|---:|",
        *[f"| {n} | {c:,} | {100 * c / total:.1f}% | {us_per_msg * c / total:.2f} |" for n, c in stages.most_common()],
        "",
        f"## Self time (top {TOP})",
        "",
        "| function | samples | share | µs/msg |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| `{n}` | {c:,} | {100 * c / total:.1f}% | {us_per_msg * c / total:.2f} |"
              for n, c in own.most_common(TOP)]
    lines += ["", f"## Per nearest amqtt_durable function (top {TOP}): its own code plus the stdlib, plyvel and "
              "amqtt code it calls", "", "| function | samples | share | µs/msg |", "|---|---:|---:|---:|"]
    lines += [f"| `{n}` | {c:,} | {100 * c / total:.1f}% | {us_per_msg * c / total:.2f} |"
              for n, c in nearest.most_common(TOP)]
    lines += ["", f"## Inclusive time of amqtt_durable functions (top {TOP})", "",
              "| function | samples | share | µs/msg |", "|---|---:|---:|---:|"]
    lines += [f"| `{n}` | {c:,} | {100 * c / total:.1f}% | {us_per_msg * c / total:.2f} |"
              for n, c in incl.most_common(TOP)]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace, tmp: Path, out: dict[str, str], info: dict[str, str], command: str) -> None:
    brokers, _store = build_brokers(args, tmp)
    b = brokers[OURS]
    log(f"starting ours: {shlex.join(b.argv)}")
    b.start(300.0)
    try:
        base, _, base_cpu = replay_once(args, b.port, b.login, "base", tmp=tmp, profile_to=None, pid=b.pid)
        log(f"  replay without profiler: {recv_summary(base, args.n)}")
        prof, raw, prof_cpu = replay_once(args, b.port, b.login, "prof", tmp=tmp, profile_to=tmp / "replay.raw.txt",
                                          pid=b.pid)
        log(f"  replay with profiler: {recv_summary(prof, args.n)}")
        if args.keep_raw and raw is not None and raw.exists():
            shutil.copy(raw, args.keep_raw)
        out["report"] = render(args, info, command, base=base, prof=prof, raw=raw, base_cpu=base_cpu,
                               prof_cpu=prof_cpu)
    finally:
        log(f"stopped ours: {b.stop(30.0)}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=200_000, help="messages replayed (default 200000)")
    p.add_argument("--rate", type=int, default=500, help="py-spy samples per second (default 500)")
    p.add_argument("--py-spy", default=str(VENV_BIN / "py-spy"), help="the py-spy executable")
    p.add_argument("--keep-raw", type=Path, default=None, help="copy py-spy's collapsed stacks to this file")
    p.add_argument("--out", type=Path, default=None, help="also write the markdown report to this file")
    add_pin_arguments(p, "the broker", "the load clients")
    args = p.parse_args(argv)
    check_pin_arguments(p, args)
    args.big, args.snapshot, args.ours_cmd, args.ours_standin = args.n, True, None, False
    command = shlex.join([sys.executable, *(sys.argv if argv is None else ["bench/profile_replay.py", *argv])])
    info = machine_info()
    out: dict[str, str] = {}
    notes: list[str] = []
    run_in_temp_folder("profile_replay_", False, lambda tmp: run(args, tmp, out, info, command), notes.append)
    write_report(out.get("report", "profile failed: " + "; ".join(notes) + "\n"), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
