#!/usr/bin/env python3
"""Where an AvailableNow query of the Spark source spends its wall time (issue 13, point 4).

One broker (bench_pipeline.py's configuration: a stream log on bench/#), N events published once
over --topics topics; then, in one SparkSession (local[2]), the same events read again and again
by fresh AvailableNow queries (new checkpoint each: the source is stateless, a range reads the
same events however often it is read), one per variant, the variants interleaved for --repeat
rounds. A variant is a sink (parquet or noop) and source options. Per query it prints:

- wall time from ``start()`` to the query's end, and the query's own phases summed over its
  micro-batches (progress ``durationMs``; "outside" = start-up and stop outside the triggers);
- per read task (timed inside the Python worker by wrapping the source's ``read``): when the task
  began after ``start()``, its worker's pid (a pid seen again = a reused worker), the seconds in
  the reader (socket + frames), in the Arrow conversion, and outside the generator (Spark taking
  the batches: the JVM side and the sink), and its batches and rows.

    PYTHONPATH=... .venv/bin/python bench/profile_spark_source.py --n 200000 --topics 4 --repeat 2

Only 127.0.0.1; the broker is stopped by PID at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_pipeline import CpuMeter, StreamRound, build_broker, publish_round, split, wait_for_logs

from durable_pipeline.source import AmqttDurableDataSource, AmqttDurableStreamReader, Options

TASKS_LOG = Path(tempfile.gettempdir()) / "profile_spark_source_tasks.jsonl"


def _event(name: str, t0: float, **extra: Any) -> None:
    """One driver-side call: which process, when it began and ended (epoch seconds)."""
    import os  # noqa: PLC0415

    import psutil  # noqa: PLC0415

    with TASKS_LOG.open("a", encoding="utf-8") as f:
        f.write(json.dumps({"call": name, "pid": os.getpid(), "proc_start": psutil.Process().create_time(),
                            "began": t0, "ended": time.time(), **extra}) + "\n")


def _timed_call(name: str) -> Any:
    def wrap(self: Any, *args: Any) -> Any:
        t0 = time.time()
        try:
            return getattr(AmqttDurableStreamReader, name)(self, *args)
        finally:
            _event(name, t0)

    return wrap


class TimedStreamReader(AmqttDurableStreamReader):
    initialOffset = _timed_call("initialOffset")  # noqa: N815
    latestOffset = _timed_call("latestOffset")  # noqa: N815
    prepareForTriggerAvailableNow = _timed_call("prepareForTriggerAvailableNow")  # noqa: N815
    partitions = _timed_call("partitions")
    commit = _timed_call("commit")
    stop = _timed_call("stop")

    def read(self, partition: Any) -> Iterator[Any]:
        import durable_pipeline.source as src  # noqa: PLC0415 - in the worker

        called = time.time()
        arrow = [0.0]
        real = src.arrow_batch

        def timed_arrow(*args: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return real(*args)
            finally:
                arrow[0] += time.perf_counter() - t0

        src.arrow_batch = timed_arrow  # type: ignore[assignment]
        inner = super().read(partition)
        inside = outside = 0.0
        batches = rows = 0
        first = None
        try:
            while True:
                t0 = time.perf_counter()
                try:
                    batch = next(inner)
                except StopIteration:
                    inside += time.perf_counter() - t0
                    break
                t1 = time.perf_counter()
                inside += t1 - t0
                batches += 1
                rows += batch.num_rows
                first = first or time.time()
                yield batch
                outside += time.perf_counter() - t1
        finally:
            src.arrow_batch = real  # type: ignore[assignment]
            import os  # noqa: PLC0415

            with TASKS_LOG.open("a", encoding="utf-8") as f:
                f.write(json.dumps({"pid": os.getpid(), "called": called, "first": first, "ended": time.time(),
                                    "reader": inside - arrow[0], "arrow": arrow[0], "outside": outside,
                                    "batches": batches, "rows": rows, "part": repr(partition)}) + "\n")


class TimedSource(AmqttDurableDataSource):
    @classmethod
    def name(cls) -> str:
        return "amqtt-durable-timed"

    def streamReader(self, schema: Any) -> TimedStreamReader:  # noqa: N802
        return TimedStreamReader(Options.parse(self.options))


VARIANTS: dict[str, tuple[str, dict[str, str]]] = {
    "parquet": ("parquet", {}),
    "noop": ("noop", {}),
}


def run_query(spark: Any, broker_pid: int, port: int, topic_filter: str, sink: str,  # noqa: PLR0917
              options: dict[str, str], folder: Path, n: int) -> dict[str, Any]:
    TASKS_LOG.unlink(missing_ok=True)
    reader = (spark.readStream.format("amqtt-durable-timed").option("host", "127.0.0.1").option("port", str(port))
              .option("filter", topic_filter))
    for key, value in options.items():
        reader = reader.option(key, value)
    writer = reader.load().writeStream.format(sink).option("checkpointLocation", str(folder / "cp"))
    if sink == "parquet":
        writer = writer.option("path", str(folder / "out"))
    jvm = spark.sparkContext._gateway.proc.pid
    with CpuMeter(broker_pid, interval=0.05) as cpu:
        t0 = time.time()
        query = writer.trigger(availableNow=True).start()
        started = time.time()
        try:
            if not query.awaitTermination(600):
                raise SystemExit("query did not end in 600 s")
            ended = time.time()
            progress = query.recentProgress
        finally:
            query.stop()
    used = {"broker": cpu.broker, "driver": cpu.own, "jvm": 0.0, "python": 0.0}
    for key, last in cpu.last.items():
        if key[0] not in (broker_pid, cpu.me.pid):
            used["jvm" if key[0] == jvm else "python"] += last - cpu.first[key]
    phases: dict[str, float] = {}
    for p in progress:
        for phase, ms in (p.durationMs or {}).items():
            phases[phase] = phases.get(phase, 0.0) + ms / 1000.0
    entries = [json.loads(line) for line in TASKS_LOG.read_text(encoding="utf-8").splitlines()] \
        if TASKS_LOG.exists() else []
    tasks = [e for e in entries if "call" not in e]
    calls = [e for e in entries if "call" in e]
    rows = sum(t["rows"] for t in tasks)
    if rows != n:
        raise SystemExit(f"read {rows} rows, expected {n}")
    return {"wall": ended - t0, "start_call": started - t0, "phases": phases, "batches": len(progress),
            "outside": (ended - t0) - phases.get("triggerExecution", 0.0), "tasks": tasks, "calls": calls,
            "cpu": used, "t0": t0, "ended": ended}


def describe(name: str, res: dict[str, Any], n: int) -> list[str]:
    ph = res["phases"]
    keys = ("latestOffset", "queryPlanning", "walCommit", "addBatch", "commitOffsets", "triggerExecution")
    out = [f"{name}: {res['wall']:.2f} s, {n / res['wall']:,.0f} events/s; start() returned after "
           f"{res['start_call']:.2f} s; {res['batches']} progress reports; CPU s "
           + ", ".join(f"{k} {v:.2f}" for k, v in res["cpu"].items()) + "; "
           + ", ".join(f"{k} {ph.get(k, 0):.2f}" for k in keys) + f"; outside triggers {res['outside']:.2f}"]
    for c in sorted(res["calls"], key=lambda c: c["began"]):
        out.append(f"   {c['call']}: pid {c['pid']} (process started +{c['proc_start'] - res['t0']:.2f} s), "
                   f"+{c['began'] - res['t0']:.2f} to +{c['ended'] - res['t0']:.2f} s")
    tasks = sorted(res["tasks"], key=lambda t: t["called"])
    for t in tasks:
        out.append(f"   task {t['part']}: pid {t['pid']}, called at +{t['called'] - res['t0']:.2f} s, first batch "
                   f"+{(t['first'] or t['called']) - res['t0']:.2f}, ended +{t['ended'] - res['t0']:.2f}; reader "
                   f"{t['reader']:.2f} s, arrow {t['arrow']:.2f} s, outside (Spark) {t['outside']:.2f} s; "
                   f"{t['batches']} batches, {t['rows']} rows")
    if tasks:
        out.append(f"   tasks: first called +{tasks[0]['called'] - res['t0']:.2f} s, last ended "
                   f"+{max(t['ended'] for t in tasks) - res['t0']:.2f} s, query end +{res['ended'] - res['t0']:.2f}; "
                   f"sum reader {sum(t['reader'] for t in tasks):.2f}, arrow {sum(t['arrow'] for t in tasks):.2f}, "
                   f"outside {sum(t['outside'] for t in tasks):.2f}")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=200_000)
    p.add_argument("--topics", type=int, default=4)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--variants", default="parquet,noop",
                   help="comma-separated; name=sink:key=value;key=value adds one (e.g. n1=parquet:numPartitions=1)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    variants = dict(VARIANTS)
    chosen = []
    for spec in args.variants.split(","):
        if "=" in spec.split(":")[0]:
            name, _, rest = spec.partition("=")
            sink, _, opts = rest.partition(":")
            variants[name] = (sink, dict(kv.split("=", 1) for kv in opts.split(";") if kv))
        else:
            name = spec
        chosen.append(name)
    from durable_pipeline.spark import get_session  # noqa: PLC0415

    lines: list[str] = []
    with tempfile.TemporaryDirectory(prefix="profile-spark-source-") as folder:
        tmp = Path(folder)
        bargs = argparse.Namespace(n=args.n, pin=False, broker_cpus=None, inflight=100, timeout=600.0)
        broker = build_broker(bargs, tmp, None)
        broker.start(120.0)
        try:
            topics = [f"bench/p/t{k}" for k in range(args.topics)]
            rnd = StreamRound("p", args.n, dict(zip(topics, split(args.n, args.topics), strict=True)))
            publish_round(bargs, broker.port, rnd, b"prof")
            wait_for_logs(Options(port=broker.port, filter="bench/p/#"), rnd, 60.0)
            t0 = time.perf_counter()
            spark = get_session("local[2]")
            lines.append(f"session start {time.perf_counter() - t0:.1f} s")
            spark.dataSource.register(TimedSource)
            try:
                walls: dict[str, list[float]] = {name: [] for name in chosen}
                k = 0
                for rep in range(args.repeat + 1):  # round 0 warms up
                    for name in chosen:
                        k += 1
                        sink, opts = variants[name]
                        res = run_query(spark, broker.pid, broker.port, "bench/p/#", sink, opts, tmp / f"q{k}", args.n)
                        label = f"{'warm-up ' if rep == 0 else ''}{name} (sink {sink}, options {opts})"
                        text = describe(label, res, args.n)
                        print("\n".join(text), flush=True)
                        if rep:
                            walls[name].append(res["wall"])
                            lines += text
                lines.append("")
                for name, ws in walls.items():
                    if ws:
                        lines.append(f"{name}: median {statistics.median(ws):.2f} s = "
                                     f"{args.n / statistics.median(ws):,.0f} events/s over {len(ws)}")
            finally:
                spark.stop()
        finally:
            broker.stop(timeout=30.0)
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
