#!/usr/bin/env python3
"""Profile the Spark source's executor-side read (issue 13, point 4): where a read task's time per event goes.

One broker (bench_pipeline.py's configuration: a stream log on bench/#), N events published to one
topic, then ``read_range`` over ids 1..N in this process, no Spark: timed once without the profiler,
then again while ``py-spy record --rate R --format raw`` samples this process (every thread).
Prints events/s of both reads and the collapsed stacks' top functions (self and total share).

    .venv/bin/python bench/profile_source.py --n 60000 --out /tmp/source.txt

Needs py-spy (the bench extra) and ptrace permission on this process.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import VENV_BIN
from bench_pipeline import STREAM_FILTER, StreamRound, build_broker, publish_round


def read_once(opts: object, topic: str, n: int) -> float:
    from durable_pipeline.source import IdRange, read_range  # noqa: PLC0415

    t0 = time.perf_counter()
    rows = sum(batch.num_rows for batch in read_range(opts, IdRange(topic, 0, n)))  # type: ignore[arg-type]
    secs = time.perf_counter() - t0
    if rows != n:
        raise SystemExit(f"read {rows} rows, expected {n}")
    return n / secs


def summarise(raw: Path, top: int) -> list[str]:
    own: Counter[str] = Counter()
    total: Counter[str] = Counter()
    samples = 0
    for line in raw.read_text(encoding="utf-8").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        frames = [f.split(" (")[0] + " " + f.split("/")[-1].rstrip(")") if "(" in f else f for f in stack.split(";")]
        samples += count
        own[frames[-1]] += count
        for frame in set(frames):
            total[frame] += count
    out = [f"samples: {samples}", "", "self %  function"]
    out += [f"{100 * c / samples:5.1f}  {name}" for name, c in own.most_common(top)]
    out += ["", "total %  function"]
    out += [f"{100 * c / samples:5.1f}  {name}" for name, c in total.most_common(top)]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=60_000)
    p.add_argument("--rate", type=int, default=250)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    from durable_pipeline.source import Options  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="profile-source-") as folder:
        tmp = Path(folder)
        bargs = argparse.Namespace(n=args.n, pin=False, broker_cpus=None)
        broker = build_broker(bargs, tmp, None)
        broker.start(120.0)
        try:
            topic = "bench/p/t0"
            rnd = StreamRound("p", args.n, {topic: args.n})
            bargs.inflight, bargs.timeout = 100, 300.0
            publish_round(bargs, broker.port, rnd, b"prof")
            opts = Options(port=broker.port, filter=STREAM_FILTER)
            plain = read_once(opts, topic, args.n)
            raw = tmp / "stacks.txt"
            spy = subprocess.Popen([str(VENV_BIN / "py-spy"), "record", "--pid", str(os.getpid()), "--rate",
                                    str(args.rate), "--format", "raw", "--output", str(raw), "--threads"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)  # py-spy attaches
            profiled = read_once(opts, topic, args.n)
            spy.send_signal(signal.SIGINT)
            spy.wait(timeout=60)
        finally:
            broker.stop(timeout=30.0)
        lines = [f"read_range, {args.n} events, one topic: {plain:,.0f} events/s unprofiled, "
                 f"{profiled:,.0f} profiled", *summarise(raw, args.top)]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
