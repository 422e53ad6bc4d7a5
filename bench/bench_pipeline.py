#!/usr/bin/env python3
"""Spark pipeline benchmark: the delivery audit as the logs grow, and the ``amqtt-durable`` streaming
source against the broker's plain durable replay, side by side in one run.

Run with the project venv, e.g.

    .venv/bin/python bench/bench_pipeline.py --out /tmp/pipeline.md   # 1M/3M/10M records, N=200,000
    .venv/bin/python bench/bench_pipeline.py --quick                   # audit 100k/300k/1M, N=20,000
    .venv/bin/python bench/bench_pipeline.py --only stream --runs 5

One SparkSession from ``durable_pipeline.spark.get_session("local[2]")`` (its defaults) serves
both parts, the streaming part first. get_session's default heap (1g) is enough for the 10M
audit since it caches on disk (bench/RESULTS.md); --driver-memory sets another heap.

1. Audit. Synthetic delivery logs (``durable_pipeline.synthetic.write_logs``, Parquet, a ring of
   devices sending --messages each, with planted loss, duplicates and reordering) of about 1M, 3M
   and 10M records; ``run_audit`` on each, timed from the call to its return (the Parquet file is
   written before and is not timed). One small audit first in the same session (warm-up, reported
   apart). The audit's counts must equal the planted truth, per device and in total, every time.
   Time growth is compared with the growth of the record count (the ideal: linear).

2. Streaming source. One amqtt-durable broker (broker.yaml's settings, store in a temporary
   folder, metrics off, ``streams: [{filter: "bench/#", max_count: big}]``). Each round gets its own
   topics ``bench/<round>/t0..`` : a raw durable subscriber (clean_session=False, QoS 1) subscribes
   to ``bench/<round>/#`` and disconnects, then N events are published over --topics topics (raw
   QoS 1 publisher, 64-byte payloads) and land both in the stream logs and in that session's queue.
   Then, in an order rotating per round:
     source  ``spark.readStream.format("amqtt-durable")`` on ``bench/<round>/#`` into Parquet with a
             checkpoint, Trigger.AvailableNow: events/s from start() until the query ended (all N
             committed to Parquet); the Parquet must hold exactly N rows, N distinct (topic, id),
             ids 1..n of each topic.
     plain   the raw subscriber reconnects (session present) and drains its N queued events:
             events/s from CONNECT to the last one (as bench_durable.py's scenario c).
     direct  (diagnostic) the source's own executor-side reader, ``read_range``, called in this
             process without Spark, one topic after the other: what one read task can do.
   With --source-variant (repeatable) a round runs one source query per variant, each with its own
   source options (e.g. numPartitions=1) and a fresh checkpoint, on the same events: the source is
   stateless, so every variant reads exactly the N events the plain subscriber drains in that round.
   A warm-up round with a few events goes first (reported apart). Ratios per round and of the medians.

The broker is pinned to CPU 0 and the raw subscriber to CPU 1 (--pin); Spark local[2] is not pinned
(it uses both CPUs, the broker's included). Everything talks to 127.0.0.1 only; every wait is
bounded (Spark jobs are cancelled after --job-timeout); only processes started here are signalled,
by PID (the broker, the subscriber processes; the Spark JVM is stopped through spark.stop()).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import statistics
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psutil
import yaml
from _common import (
    BROKER_YAML,
    CLIENT_START_S,
    PIPELINE_DIR,
    PLUGIN_DIR,
    PROTOCOL_DIR,
    RESULT_MARGIN_S,
    ROOT,
    SDK_DIR,
    SETTLE_S,
    VENV_BIN,
    BenchError,
    BrokerProcess,
    Deadline,
    add_pin_arguments,
    changed_files,
    check_pin_arguments,
    describe_pinning,
    fmt_number,
    git_revision,
    listener_config,
    log,
    machine_info,
    recv_summary,
    run_in_temp_folder,
    source_fingerprint,
    use_code_snapshot,
    write_config,
    write_report,
)
from _rawmqtt import (
    HOST,
    PAYLOAD_SIZE,
    ClientProcess,
    Login,
    PublishEncoder,
    PublishResult,
    RawConnection,
    ReceiveResult,
    SubSpec,
    _publish,
    session_roundtrip,
    subscriber_main,
)

from amqtt_durable.process import free_port

WATCHED = {"plugin": PLUGIN_DIR, "SDK": SDK_DIR, "protocol": PROTOCOL_DIR, "pipeline": PIPELINE_DIR}
PLUGIN_KEY = "amqtt_durable.DurableSessionsPlugin"
STREAM_FILTER = "bench/#"
MASTER = "local[2]"
LOSE = DUPLICATE = REORDER = 0.001  # planted faults: fractions of each device's deliveries
WARMUP_RECORDS = 10_000
WARMUP_EVENTS = 2_000
SOURCE, PLAIN, DIRECT = "source", "plain", "direct"
KINDS = (SOURCE, PLAIN, DIRECT)
TITLES = {
    SOURCE: 'Spark readStream.format("amqtt-durable") -> Parquet, AvailableNow (start -> all N committed)',
    PLAIN: "plain durable MQTT subscriber, reconnect and drain (CONNECT -> all N)",
    DIRECT: "diagnostic: the source's read_range in one process, no Spark, topics one after the other",
}
TRUTH_FIELDS = ("expected", "received", "lost", "duplicated", "out_of_order", "replayed")


# --------------------------------------------------------------------------- results


@dataclass
class AuditRun:
    label: str
    target: int
    devices: int
    messages: int
    records: int = 0
    planted: str = ""
    generate_s: float | None = None
    audit_s: float | None = None
    cpu_s: float | None = None  # CPU seconds of Spark (JVM, Python workers) and this process during run_audit
    problems: list[str] = field(default_factory=list)

    @property
    def rate(self) -> float | None:
        return self.records / self.audit_s if self.audit_s and not self.problems else None


@dataclass
class StreamRound:
    label: str
    n: int
    counts: dict[str, int]  # topic -> events published to it
    order: list[str] = field(default_factory=list)
    publish: PublishResult | None = None
    seconds: dict[str, float] = field(default_factory=dict)  # kind -> measured seconds
    plain: ReceiveResult | None = None
    source_detail: dict[str, dict[str, float]] = field(default_factory=dict)  # kind -> the query's progress
    cpu: dict[str, tuple[float, float | None]] = field(default_factory=dict)  # kind -> (broker s, reader s)
    problems: defaultdict[str, list[str]] = field(default_factory=lambda: defaultdict(list))

    def rate(self, kind: str) -> float | None:
        secs = self.seconds.get(kind)
        if not secs or self.problems[kind]:
            return None
        if kind == PLAIN:
            assert self.plain is not None
            return self.plain.unique / secs
        return self.n / secs


@dataclass
class Report:
    audit_warmup: AuditRun | None = None
    audits: list[AuditRun] = field(default_factory=list)
    stream_warmup: StreamRound | None = None
    rounds: list[StreamRound] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    breakdown: dict[str, Any] = field(default_factory=dict)

    def note(self, text: str) -> None:
        log(f"NOTE: {text}")
        self.notes.append(text)

    def failures(self) -> list[str]:
        out = [f"audit {run.label}: {p}" for run in self._audit_runs() for p in run.problems]
        for rnd in self._rounds():
            out += [f"{kind} {rnd.label}: {p}" for kind, found in rnd.problems.items() for p in found]
        return out

    def _audit_runs(self) -> list[AuditRun]:
        return ([self.audit_warmup] if self.audit_warmup else []) + self.audits

    def _rounds(self) -> list[StreamRound]:
        return ([self.stream_warmup] if self.stream_warmup else []) + self.rounds


# --------------------------------------------------------------------------- Spark helpers


@contextlib.contextmanager
def job_deadline(spark: Any, seconds: float, what: str) -> Iterator[None]:
    """Cancel every Spark job of the session if the block still runs after `seconds` (bounds run_audit)."""
    fired = threading.Event()

    def cancel() -> None:
        fired.set()
        log(f"{what}: still running after {seconds:.0f}s, cancelling its Spark jobs")
        spark.sparkContext.cancelAllJobs()

    timer = threading.Timer(seconds, cancel)
    timer.daemon = True
    timer.start()
    try:
        yield
    except Exception as exc:
        if fired.is_set():
            raise BenchError(f"{what}: cancelled after {seconds:.0f}s") from exc
        raise
    finally:
        timer.cancel()


class CpuMeter:
    """CPU seconds (user + system, every thread) of the broker, of this process and of the others it started.

    The others are Spark's: the JVM, its Python workers and the data source's planner. Sampled every
    `interval` seconds while the block runs, per process, so processes that come and go within the
    block are counted (up to their last sample). CPU time is less sensitive than wall time to the
    other load of a shared machine, and says which side of a reader does the work.
    """

    def __init__(self, broker_pid: int | None = None, interval: float = 0.1) -> None:
        self.broker_pid = broker_pid
        self.interval = interval
        self.me = psutil.Process()
        self.first: dict[tuple[int, float], float] = {}
        self.last: dict[tuple[int, float], float] = {}
        self._started = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-meter", daemon=True)
        self.broker = self.own = self.others = 0.0

    def _sample(self) -> None:
        procs = [self.me]
        with contextlib.suppress(psutil.Error):
            procs += self.me.children(recursive=True)
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                key = (proc.pid, proc.create_time())
                t = proc.cpu_times()
                used = t.user + t.system
                self.first.setdefault(key, used if not self._started else 0.0)
                self.last[key] = used

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> CpuMeter:
        self._sample()
        self._started = True
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        self._sample()
        for key, used in self.last.items():
            delta = used - self.first[key]
            if key[0] == self.broker_pid:
                self.broker += delta
            elif key[0] == self.me.pid:
                self.own += delta
            else:
                self.others += delta


def context_stopped(spark: Any) -> bool:
    try:
        return bool(spark.sparkContext._jsc.sc().isStopped())
    except Exception:
        return True


def first_line(exc: BaseException) -> str:
    """The exception's first line, and its context's (an error while handling the first can hide it)."""
    parts: list[str] = []
    seen: BaseException | None = exc
    while seen is not None and len(parts) < 3:
        lines = [line.strip(": ") for line in str(seen).strip().splitlines() if line.strip(": ")]
        java = next((line for line in lines[1:] if "Exception" in line or "Error" in line), "")
        parts.append(f"{type(seen).__name__}: {lines[0] if lines else ''}" + (f" [{java[:200]}]" if java else ""))
        seen = seen.__context__
    return " <- while handling: ".join(parts)[:700]


# --------------------------------------------------------------------------- 1. audit


def audit_once(spark: Any, args: argparse.Namespace, tmp: Path, label: str, *, target: int, seed: int) -> AuditRun:
    from durable_pipeline.audit import run_audit  # noqa: PLC0415 - imported after the snapshot is on sys.path
    from durable_pipeline.synthetic import write_logs  # noqa: PLC0415

    messages = args.messages
    devices = max(1, round(target / (2 * messages + 6)))  # a device pair writes about 2 * messages + 6 records
    run = AuditRun(label, target, devices, messages)
    path = tmp / "logs" / f"{label}.parquet"
    try:
        t0 = time.perf_counter()
        logs = write_logs(path, devices, messages, lose=LOSE, duplicate=DUPLICATE, reorder=REORDER, seed=seed)
        run.generate_s = time.perf_counter() - t0
        run.records = logs.records
        truth = logs.total
        run.planted = f"{truth.lost:,} / {truth.duplicated:,} / {truth.out_of_order:,}"
        log(f"audit {label}: {logs.records:,} records ({devices:,} devices x {messages:,} messages, "
            f"{path.stat().st_size / 1e6:.0f} MB Parquet) written in {run.generate_s:.1f}s; auditing")
        t0 = time.perf_counter()
        with CpuMeter() as cpu, job_deadline(spark, args.job_timeout, f"audit {label}"):
            result = run_audit(spark, [str(path)], tmp / "audit" / label, "exactly-once")
        run.audit_s = time.perf_counter() - t0
        run.cpu_s = cpu.others + cpu.own
        run.problems += compare_with_truth(result, logs)
        log(f"audit {label}: {run.audit_s:.1f}s ({run.cpu_s:.1f} CPU s), {run.records / run.audit_s:,.0f} records/s; "
            f"{'counts = planted truth' if not run.problems else 'WRONG: ' + '; '.join(run.problems)}")
    except Exception as exc:
        run.problems.append(f"failed: {first_line(exc)}")
        log(traceback.format_exc())
    finally:
        path.unlink(missing_ok=True)
    return run


def compare_with_truth(result: Any, logs: Any) -> list[str]:
    """Every difference between what run_audit found and what write_logs planted."""
    problems: list[str] = []
    if result.records != logs.records:
        problems.append(f"audit read {result.records:,} records, {logs.records:,} were written")
    total = logs.total
    for name in TRUTH_FIELDS:
        if getattr(result.total, name) != getattr(total, name):
            problems.append(f"total {name}: audit {getattr(result.total, name):,}, planted {getattr(total, name):,}")
    if result.total.unknown:
        problems.append(f"{result.total.unknown:,} unknown receives (none planted)")
    found = {d.device: tuple(getattr(d, name) for name in TRUTH_FIELDS) for d in result.devices}
    planted = {name: tuple(getattr(t, f) for f in TRUTH_FIELDS) for name, t in logs.devices.items()}
    wrong = sorted(name for name in found.keys() | planted.keys() if found.get(name) != planted.get(name))
    if wrong:
        problems.append(f"{len(wrong)} devices differ from the truth, e.g. {wrong[0]}: "
                        f"audit {found.get(wrong[0])}, planted {planted.get(wrong[0])} ({', '.join(TRUTH_FIELDS)})")
    return problems


def run_audits(spark: Any, args: argparse.Namespace, tmp: Path, report: Report) -> None:
    log("audit warm-up")
    report.audit_warmup = audit_once(spark, args, tmp, "warm-up", target=WARMUP_RECORDS, seed=99)
    for i, target in enumerate(args.sizes):
        if context_stopped(spark):
            report.note(f"the SparkContext is gone (stopped after a failure): audit of {target:,} records not run")
            continue
        report.audits.append(audit_once(spark, args, tmp, f"{target:,}", target=target, seed=i + 1))
        if context_stopped(spark):
            report.note(f"the audit of {target:,} records took the SparkContext down; see the log above")


# --------------------------------------------------------------------------- 2. streaming source


class SeqEncoder(PublishEncoder):
    """Pre-encoded PUBLISHes whose payload sequence numbers start at `first_seq`.

    The raw subscriber counts one tag's sequence numbers 0..N-1, so the topics of a round share
    the tag and each gets its own range of numbers.
    """

    def __init__(self, topic: str, tag: bytes, n: int, first_seq: int) -> None:
        super().__init__(topic, tag, n)
        seq_at = self.size - PAYLOAD_SIZE + 4  # payload: 4-byte tag, uint32 sequence number, ...
        for k in range(n):
            struct.pack_into("!I", self.buf, k * self.size + seq_at, first_seq + k)


def split(n: int, parts: int) -> list[int]:
    return [n // parts + (1 if k < n % parts else 0) for k in range(parts)]


def build_broker(args: argparse.Namespace, tmp: Path, snapshot: Path | None) -> BrokerProcess:
    """broker.yaml's settings with our port, the store in `tmp`, metrics off and a stream log on bench/#."""
    config = yaml.safe_load(BROKER_YAML.read_text(encoding="utf-8"))
    port = free_port()
    config["listeners"] = listener_config(port)
    plugin = config["plugins"][PLUGIN_KEY]
    depth = max(int(plugin.get("max_depth_disconnected", 1_000_000)), args.n)
    plugin.update({
        "store": str(tmp / "store"),
        "metrics_interval": 0,
        "max_depth_disconnected": depth,
        "streams": [{"filter": STREAM_FILTER, "max_count": max(1_000_000, args.n)}],
    })
    path = tmp / "broker.json"
    write_config(path, config)
    if snapshot is not None:
        env: dict[str, str] | None = {**os.environ, "PYTHONPATH": str(snapshot)}
        prefix = [str(VENV_BIN / "python"), "-m", "amqtt_durable.cli", "broker"]
    else:
        env, prefix = None, [str(VENV_BIN / "amqtt-durable"), "broker"]
    cpus = tuple(args.broker_cpus) if args.pin else None
    return BrokerProcess("broker", [*prefix, "-c", str(path)], port, tmp / "broker.log", Login(), cpus, env)


def publish_round(args: argparse.Namespace, port: int, rnd: StreamRound, tag: bytes) -> PublishResult:
    """Publish the round's events, topic after topic, over one raw connection from this process."""
    conn = RawConnection(port, 30.0)
    acked = sent = 0
    t_first = t_last = 0
    errors: list[str] = []
    try:
        conn.connect(f"pub-{rnd.label}-{tag.hex()}", Login(), clean=True, timeout=30.0)
        first_seq = 0
        deadline = Deadline(args.timeout)
        for topic, count in rnd.counts.items():
            enc = SeqEncoder(topic, tag, count, first_seq)
            pr = _publish(conn, enc, args.inflight, max(1.0, deadline.remaining()), 0.0)
            first_seq += count
            acked, sent = acked + pr.acked, sent + pr.sent
            t_first = t_first or pr.t_first_send_ns
            t_last = pr.t_last_ack_ns
            if pr.acked < count:
                errors.append(f"{topic}: {pr.acked:,}/{count:,} PUBACKed" + (f" ({pr.error})" if pr.error else ""))
                break
    finally:
        conn.close()
    return PublishResult(rnd.n, sent, acked, t_first, t_last, timed_out=bool(errors) and acked < rnd.n,
                         error="; ".join(errors) or None)


def wait_for_logs(opts: Any, rnd: StreamRound, timeout: float) -> None:
    """Until the broker's stream logs of the round hold every published event (bounded)."""
    from durable_pipeline.source import BrokerLink  # noqa: PLC0415

    link = BrokerLink(opts)
    deadline = Deadline(timeout)
    bounds: dict[str, tuple[int, int]] = {}
    try:
        while not deadline.expired():
            bounds = link.stream_info(opts.filter)
            if all(bounds.get(topic, (1, 0))[1] >= count for topic, count in rnd.counts.items()):
                return
            time.sleep(0.05)
    finally:
        link.close()
    raise BenchError(f"the stream logs hold {bounds} after {timeout:.0f}s, expected {rnd.counts}")


def run_source(spark: Any, args: argparse.Namespace, broker_pid: int, rnd: StreamRound, kind: str, *, port: int,
               folder: Path) -> None:
    """readStream -> Parquet with a checkpoint, AvailableNow; timed from start() to the query's end.

    The variant's option ``sink=noop`` (the bench's, not the source's) writes to Spark's noop sink
    instead: the read without the Parquet write, checked by the rows the query's progress counted.
    """
    from pyspark.sql import functions as sf  # noqa: PLC0415

    out, checkpoint = folder / "events", folder / "checkpoint"
    reader = (spark.readStream.format("amqtt-durable").option("host", HOST).option("port", str(port))
              .option("filter", f"bench/{rnd.label}/#"))
    source_options = dict(args.source_variants[kind])
    sink = source_options.pop("sink", "parquet")
    for key, value in source_options.items():
        reader = reader.option(key, value)
    problems = rnd.problems[kind]
    query = None
    try:
        with CpuMeter(broker_pid) as cpu:
            t0 = time.perf_counter()
            writer = reader.load().writeStream.format(sink).option("checkpointLocation", str(checkpoint))
            if sink == "parquet":
                writer = writer.option("path", str(out))
            query = writer.trigger(availableNow=True).start()
            ended = query.awaitTermination(args.timeout)  # raises the query's error, if it failed
            elapsed = time.perf_counter() - t0
        if not ended:
            problems.append(f"the query did not end within {args.timeout:.0f}s")
            return
        progress = query.recentProgress
    finally:
        if query is not None:
            query.stop()
    rnd.seconds[kind] = elapsed
    rnd.cpu[kind] = (cpu.broker, cpu.others + cpu.own)
    rnd.source_detail[kind] = source_breakdown(progress, elapsed)
    if sink != "parquet":
        if rnd.source_detail[kind]["rows"] != rnd.n:
            problems.append(f"the query's progress counted {rnd.source_detail[kind]['rows']:,.0f} rows, expected "
                            f"{rnd.n:,}")
        return
    with job_deadline(spark, args.job_timeout, "checking the source's Parquet"):
        rows = (spark.read.parquet(str(out)).groupBy("topic")
                .agg(sf.count(sf.lit(1)).alias("rows"), sf.countDistinct("id").alias("ids"),
                     sf.min("id").alias("low"), sf.max("id").alias("high")).collect())
    got = {row["topic"]: (row["rows"], row["ids"], row["low"], row["high"]) for row in rows}
    want = {topic: (count, count, 1, count) for topic, count in rnd.counts.items()}
    if got != want:
        total, distinct = sum(v[0] for v in got.values()), sum(v[1] for v in got.values())
        problems.append(f"Parquet holds {total:,} rows, {distinct:,} distinct (topic, id), expected exactly "
                        f"{rnd.n:,}; per topic (rows, distinct ids, min id, max id) {got}, expected {want}")


def source_breakdown(progress: list[Any], elapsed: float) -> dict[str, float]:
    """Seconds per phase, summed over the query's micro-batches (durationMs of each progress report)."""
    detail: dict[str, float] = {"batches": float(len(progress)), "total": elapsed,
                                "rows": float(sum(p.numInputRows for p in progress))}
    for p in progress:
        for phase, ms in (p.durationMs or {}).items():
            detail[phase] = detail.get(phase, 0.0) + ms / 1000.0
    detail["outside triggers"] = elapsed - detail.get("triggerExecution", 0.0)
    return detail


def run_plain(args: argparse.Namespace, broker_pid: int, rnd: StreamRound, *, port: int, sub_id: str,
              tag: bytes) -> None:
    spec = SubSpec(port, sub_id, Login(), False, tag, rnd.n, args.timeout, idle=args.idle, need_session=True,
                   cpus=tuple(args.client_cpus) if args.pin else None)
    with ClientProcess("plain subscriber", subscriber_main, spec) as sub:
        sub.expect("ready", CLIENT_START_S)
        with CpuMeter(broker_pid) as cpu:
            res: ReceiveResult = sub.expect("result", spec.timeout + RESULT_MARGIN_S)
    rnd.cpu[PLAIN] = (cpu.broker, None)  # the raw subscriber's own CPU is not taken
    rnd.plain = res
    problems = rnd.problems[PLAIN]
    if res.error:
        problems.append(f"subscriber error: {res.error}")
    if not res.session_present or res.unique < rnd.n or res.duplicates or res.foreign:
        problems.append(recv_summary(res, rnd.n))
    if res.unique and res.t_last_ns > res.t_connect_ns:
        rnd.seconds[PLAIN] = (res.t_last_ns - res.t_connect_ns) / 1e9


def run_direct(broker_pid: int, opts: Any, rnd: StreamRound) -> None:
    from durable_pipeline.source import IdRange, read_range  # noqa: PLC0415

    rows: dict[str, int] = {}
    with CpuMeter(broker_pid) as cpu:
        t0 = time.perf_counter()
        for topic, count in rnd.counts.items():
            ids = 0
            for batch in read_range(opts, IdRange(topic, 0, count)):
                ids += batch.num_rows
            rows[topic] = ids
        rnd.seconds[DIRECT] = time.perf_counter() - t0
    rnd.cpu[DIRECT] = (cpu.broker, cpu.own)
    if rows != rnd.counts:
        rnd.problems[DIRECT].append(f"read {rows}, expected {rnd.counts}")


def stream_round(spark: Any, args: argparse.Namespace, ctx: StreamCtx, label: str, *, n: int,
                 shift: int) -> StreamRound:
    from durable_pipeline.source import Options  # noqa: PLC0415

    broker = ctx.broker
    topics = [f"bench/{label}/t{k}" for k in range(args.topics)]
    rnd = StreamRound(label, n, dict(zip(topics, split(n, args.topics), strict=True)))
    rnd.order = list(args.kinds[shift % len(args.kinds):] + args.kinds[:shift % len(args.kinds)])
    ctx.counter += 1
    tag = os.urandom(2) + ctx.counter.to_bytes(2, "big")
    sub_id = f"plain-{label}-{tag.hex()}"
    opts = Options.parse({"host": HOST, "port": str(broker.port), "filter": f"bench/{label}/#"})
    if not broker.alive():
        ctx.report.note(f"the broker was not running before round {label}; restarting it. "
                        f"Last log line: {broker.last_log_line()!r}")
        broker.start(args.startup_timeout)
    try:
        session_roundtrip(broker.port, sub_id, Login(), clean=False, topic=f"bench/{label}/#", timeout=30.0)
        time.sleep(SETTLE_S)  # the broker has processed the DISCONNECT: what follows is queued, not sent
        rnd.publish = publish_round(args, broker.port, rnd, tag)
        if rnd.publish.error or rnd.publish.acked < n:
            raise BenchError(f"publishing failed: {rnd.publish.error or rnd.publish.acked}")
        wait_for_logs(opts, rnd, 60.0)
        log(f"round {label}: {n:,} events published over {len(topics)} topics at "
            f"{rnd.publish.ack_rate:,.0f} PUBACKs/s; order {', '.join(rnd.order)}")
        for kind in rnd.order:
            try:
                if kind in args.source_variants:
                    run_source(spark, args, broker.pid, rnd, kind, port=broker.port,
                               folder=ctx.tmp / "stream" / label / f"s{list(args.source_variants).index(kind)}")
                elif kind == PLAIN:
                    run_plain(args, broker.pid, rnd, port=broker.port, sub_id=sub_id, tag=tag)
                else:
                    run_direct(broker.pid, opts, rnd)
            except Exception as exc:
                rnd.problems[kind].append(f"failed: {first_line(exc)}")
                log(traceback.format_exc())
            rate = rnd.rate(kind)
            log(f"  {label} {kind}: {rate or 0:,.0f} events/s ({rnd.seconds.get(kind, 0):.2f}s)"
                + (f" PROBLEMS: {'; '.join(rnd.problems[kind])}" if rnd.problems[kind] else ""))
    except Exception as exc:
        for kind in args.kinds:
            if kind not in rnd.seconds and not rnd.problems[kind]:
                rnd.problems[kind].append(f"round aborted: {first_line(exc)}")
        log(traceback.format_exc())
    finally:
        with contextlib.suppress(Exception):
            session_roundtrip(broker.port, sub_id, Login(), clean=True, topic=None, timeout=30.0)
    return rnd


@dataclass
class StreamCtx:
    tmp: Path
    broker: BrokerProcess
    report: Report
    counter: int = 0


def run_stream(spark: Any, args: argparse.Namespace, tmp: Path, snapshot: Path | None, report: Report) -> None:
    broker = build_broker(args, tmp, snapshot)
    ctx = StreamCtx(tmp, broker, report)
    try:
        log(f"starting the broker: {shlex.join(broker.argv)} (port {broker.port})")
        broker.start(args.startup_timeout)
        log("streaming warm-up round")
        report.stream_warmup = stream_round(spark, args, ctx, "warm", n=min(WARMUP_EVENTS, args.n), shift=0)
        for i in range(args.runs):
            report.rounds.append(stream_round(spark, args, ctx, f"r{i + 1}", n=args.n, shift=i))
        if not broker.alive():
            report.note(f"the broker exited unexpectedly; last log line: {broker.last_log_line()!r}")
    finally:
        log(f"stopped the broker: {broker.stop(timeout=30.0)}")
        tail = broker.log_tail()
        if any(word in tail for word in ("Traceback", "ERROR")):
            report.note(f"the broker log has errors; its tail:\n{tail}")


# --------------------------------------------------------------------------- report


def fmt_ratio(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.2f}x" if value >= 0.1 else f"{value:.2g}x"


def median_of(values: list[float | None]) -> float | None:
    nums = [v for v in values if v is not None]
    return statistics.median(nums) if nums else None


def fmt_runs(values: list[float | None]) -> str:
    nums = [v for v in values if v is not None]
    if not nums:
        return "—"
    text = fmt_number(statistics.median(nums))
    if len(nums) > 1:
        text += f" ({fmt_number(min(nums))}-{fmt_number(max(nums))})"
    if len(nums) < len(values):
        text += f" [{len(values) - len(nums)} of {len(values)} without a value]"
    return text


def fmt_s(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def render_audit(args: argparse.Namespace, report: Report) -> list[str]:
    lines = [
        "## 1. Delivery audit (run_audit on synthetic Parquet logs)",
        "",
        f"Ring of devices, {args.messages:,} messages each, planted faults lose = duplicate = reorder = "
        f"{LOSE:g} of each device's deliveries; expect=exactly-once; one run per size, in one SparkSession "
        f"({MASTER}, get_session's defaults). Growth: run_audit time / the smallest size's; ideal: the record ratio; "
        "marginal: the extra records over the extra time, from the size above (what a record costs once the "
        "fixed cost of the audit's jobs and report is paid); CPU: user + system seconds of the Spark JVM, its "
        "Python workers and the driver during run_audit (less sensitive than wall time to the machine's other load).",
        "",
        "| records | devices x messages | planted lost / duplicated / out of order | write Parquet (s) "
        "| run_audit (s) | records/s | time growth | ideal (linear) | marginal records/s | CPU (s) | CPU growth "
        "| audit = planted truth |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    base = next((run for run in report.audits if run.audit_s and not run.problems), None)
    previous: AuditRun | None = None
    for run in report.audits:
        growth = ideal = marginal = cpu_growth = "—"
        if base is not None and run.cpu_s and base.cpu_s and not run.problems:
            cpu_growth = f"{run.cpu_s / base.cpu_s:.2f}x"
        if base is not None and run.audit_s and not run.problems:
            growth = f"{run.audit_s / base.audit_s:.2f}x" if base.audit_s else "—"
            ideal = f"{run.records / base.records:.2f}x"
            if previous is not None and previous.audit_s and run.audit_s > previous.audit_s:
                marginal = fmt_number((run.records - previous.records) / (run.audit_s - previous.audit_s))
            previous = run
        ok = "yes (per device and total)" if not run.problems else "**NO**: " + "; ".join(run.problems)
        lines.append(f"| {run.records or run.target:,} | {run.devices:,} x {run.messages:,} | {run.planted or '—'} "
                     f"| {fmt_s(run.generate_s)} | {fmt_s(run.audit_s)} | "
                     f"{fmt_number(run.rate) if run.rate else '—'} | {growth} | {ideal} | {marginal} "
                     f"| {fmt_s(run.cpu_s)} | {cpu_growth} | {ok.replace('|', '/')} |")
    w = report.audit_warmup
    if w is not None:
        ok = "counts = planted truth" if not w.problems else "**FAILED**: " + "; ".join(w.problems)
        lines += ["", f"- warm-up audit (first in the session, {w.records:,} records, not in the table): "
                  f"{fmt_s(w.audit_s)} s; {ok}"]
    return lines


def render_stream(args: argparse.Namespace, report: Report) -> list[str]:
    rounds = report.rounds
    kinds = list(args.kinds)
    sources = [k for k in kinds if k in args.source_variants]
    rates = {k: [rnd.rate(k) for rnd in rounds] for k in kinds}
    lines = [
        "## 2. Streaming source vs the broker's plain durable replay",
        "",
        f"N={args.n:,} events per round over {args.topics} topics (QoS 1, 64-byte payloads, raw publisher, at most "
        f"{args.inflight} in flight), stream log `{{filter: {STREAM_FILTER}, max_count: {max(1_000_000, args.n):,}}}`; "
        f"{args.runs} rounds, fresh topics and a fresh durable session each, the order rotating; median (min-max). "
        "Each source reader is a query with the source options its name gives (`source` alone: the source's "
        "defaults), reading the same events of the round (the stream logs) from a fresh checkpoint.",
        "",
        "| reader | events/s | vs plain | correctness |",
        "|---|---:|---:|---|",
    ]
    plain_median = median_of(rates.get(PLAIN, []))
    for kind in kinds:
        med = median_of(rates[kind])
        vs = fmt_ratio(med / plain_median) if med is not None and plain_median and kind != PLAIN else "—"
        failed = [f"{rnd.label}: {'; '.join(rnd.problems[kind])}" for rnd in rounds if rnd.problems[kind]]
        ok = f"ok in all {len(rounds)} rounds" if not failed else "**FAILED**: " + " / ".join(failed)
        title = TITLES[kind] if kind in TITLES else f"{TITLES[SOURCE]}, {kind.removeprefix(SOURCE).strip()}"
        lines.append(f"| {title} | {fmt_runs(rates[kind])} | {vs} | {ok.replace('|', '/')} |")
    compared = sources if PLAIN in kinds else []
    lines += ["", "| round | order | publish (PUBACKs/s) | " + " | ".join(f"{k} (s)" for k in kinds)
              + " | " + " | ".join(f"{k} events/s" for k in kinds)
              + "".join(f" | {k} / plain" for k in compared) + " |",
              "|---|---|---:|" + "---:|" * (2 * len(kinds) + len(compared))]
    for rnd in ([report.stream_warmup] if report.stream_warmup else []) + rounds:
        ratios = [(rnd.rate(k) / rnd.rate(PLAIN)) if rnd.rate(k) and rnd.rate(PLAIN) else None for k in compared]
        pub = fmt_number(rnd.publish.ack_rate) if rnd.publish and rnd.publish.acked else "—"
        label = f"{rnd.label} (warm-up, N={rnd.n:,})" if rnd is report.stream_warmup else rnd.label
        lines.append(f"| {label} | {', '.join(rnd.order)} | {pub} | "
                     + " | ".join(fmt_s(rnd.seconds.get(k)) for k in kinds) + " | "
                     + " | ".join(fmt_number(r) if (r := rnd.rate(k)) else "—" for k in kinds)
                     + "".join(f" | {fmt_ratio(r)}" for r in ratios) + " |")
    for kind in compared:
        per_round = [fmt_ratio(s / p) if s and p else "—" for s, p in zip(rates[kind], rates[PLAIN], strict=True)]
        med_s = median_of(rates[kind])
        lines += ["", f"- {kind} / plain replay: {fmt_ratio(med_s / plain_median if med_s and plain_median else None)}"
                  f" of the medians; per round {', '.join(per_round)}"]
    lines += ["", "CPU per event (µs, user + system over the reader's measured time, median of the rounds): the "
              "broker process, and the reader's side (source: the Spark JVM, its Python workers and planner, and "
              "the driver; direct: this process; plain: not taken, a minimal raw client).", "",
              "| reader | broker µs/event | reader side µs/event | total µs/event |", "|---|---:|---:|---:|"]
    for kind in kinds:
        broker = [rnd.cpu[kind][0] / rnd.n * 1e6 if kind in rnd.cpu and not rnd.problems[kind] else None
                  for rnd in rounds]
        reader = [c[1] / rnd.n * 1e6 if (c := rnd.cpu.get(kind)) and c[1] is not None and not rnd.problems[kind]
                  else None for rnd in rounds]
        total = [b + r if b is not None and r is not None else None for b, r in zip(broker, reader, strict=True)]
        lines.append(f"| {kind} | {fmt_runs(broker)} | {fmt_runs(reader) if kind != PLAIN else 'n/a'} | "
                     f"{fmt_runs(total) if kind != PLAIN else 'n/a'} |")
    for kind in sources:
        lines += render_source_detail(args, kind, [d for rnd in rounds if (d := rnd.source_detail.get(kind))])
    return lines


def render_source_detail(args: argparse.Namespace, kind: str, details: list[dict[str, float]]) -> list[str]:
    lines: list[str] = []
    if details:
        phases = [k for k in details[0] if k not in ("batches", "rows", "total")]
        parts = [f"{phase} {fmt_s(median_of([d.get(phase) for d in details]))}" for phase in phases]
        in_batches = median_of([args.n / d["addBatch"] if d.get("addBatch") else None for d in details])
        lines += ["", f"- {kind} query, seconds per phase summed over its micro-batches (median of the rounds; "
                  f"{fmt_number(median_of([d['batches'] for d in details]) or 0)} micro-batches, total "
                  f"{fmt_s(median_of([d['total'] for d in details]))} s): " + ", ".join(parts)
                  + "; 'outside triggers' is query start-up (and stop) before and after the micro-batches",
                  f"- {kind} inside its micro-batches (N / addBatch, the read and the Parquet write): "
                  f"{fmt_number(in_batches) if in_batches else '—'} events/s"]
    return lines


def render(args: argparse.Namespace, info: dict[str, str], command: str, report: Report, *,
           started: datetime, elapsed: float) -> str:
    lines = [
        "# Spark pipeline benchmark",
        "",
        f"- command: `{command}`",
        f"- date: {started.isoformat(timespec='seconds')}, wall time {elapsed:.0f}s",
        f"- machine: nproc={info['nproc']}, {info['cpu']}, RAM {info['ram']}, {info['os']}; "
        f"{describe_pinning(args, 'the raw subscriber')}; Spark {MASTER} not pinned",
        f"- python: {info['python']}; {info['packages']}",
        f"- Spark: {info['spark']}",
        f"- git: {info['git']}",
        f"- code under test: {info['code']}",
        "",
    ]
    if "audit" in args.only:
        lines += [*render_audit(args, report), ""]
    if "stream" in args.only:
        lines += [*render_stream(args, report), ""]
    if report.notes:
        lines += ["## Notes", "", *[f"- {note}" for note in report.notes], ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------- setup


def parse_sizes(text: str) -> list[int]:
    return [int(float(part)) for part in text.split(",") if part.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: audit 100k/300k/1M records, N=20,000")
    p.add_argument("--only", default="audit,stream", help="parts to run: audit, stream (default both)")
    p.add_argument("--sizes", type=parse_sizes, default=None,
                   help="audit sizes in records, comma-separated (default 1e6,3e6,1e7; quick 1e5,3e5,1e6)")
    p.add_argument("--messages", type=int, default=1000, help="messages per device in the synthetic logs (1000)")
    p.add_argument("--n", type=int, default=None, help="events per streaming round (default 200000; quick 20000)")
    p.add_argument("--topics", type=int, default=4, help="topics the events are spread over (default 4)")
    p.add_argument("--runs", type=int, default=3, help="streaming rounds (default 3; medians reported)")
    p.add_argument("--readers", default=",".join(KINDS),
                   help=f"streaming readers, comma-separated from {','.join(KINDS)} (default all)")
    p.add_argument("--source-variant", action="append", default=[], metavar="KEY=VALUE,...",
                   help="a source query per round with these amqtt-durable options (repeatable; 'default' = none; "
                        "sink=noop: Spark's noop sink instead of Parquet), e.g. --source-variant default "
                        "--source-variant numPartitions=1; default: one, the defaults into Parquet")
    p.add_argument("--inflight", type=int, default=100, help="max unacknowledged PUBLISHes (default 100)")
    p.add_argument("--timeout", type=float, default=None,
                   help="bound of each publish, query and drain (default max(120, N/200) s)")
    p.add_argument("--idle", type=float, default=10.0, help="the plain subscriber gives up after this long idle")
    p.add_argument("--job-timeout", type=float, default=1800.0,
                   help="Spark jobs of one audit are cancelled after this many seconds (default 1800)")
    p.add_argument("--driver-memory", default=None,
                   help="Spark driver (= executor in local mode) heap, e.g. 2g, passed in PYSPARK_SUBMIT_ARGS "
                        "(default: none, i.e. get_session's and Spark's default of 1g)")
    p.add_argument("--startup-timeout", type=float, default=120.0, help="time bound of the broker start (s)")
    add_pin_arguments(p, "the broker", "the raw subscriber")
    p.add_argument("--code", choices=("head", "worktree", "live"), default="head",
                   help="code under test: plugin, SDK and pipeline copied at start from git HEAD (default: exactly "
                        "the reported revision) or from the working tree, or 'live': the working tree as imported")
    p.add_argument("--out", type=Path, default=None, help="also write the markdown report to this file")
    p.add_argument("--keep-tmp", action="store_true", help="keep the temporary folder")
    args = p.parse_args(argv)
    args.only = [part.strip() for part in args.only.split(",") if part.strip()]
    if not args.only or set(args.only) - {"audit", "stream"}:
        p.error("--only takes audit and/or stream")
    args.kinds = [part.strip() for part in args.readers.split(",") if part.strip()]
    if not args.kinds or set(args.kinds) - set(KINDS):
        p.error(f"--readers takes readers from {','.join(KINDS)}")
    args.source_variants = {}
    for variant in args.source_variant or ["default"]:
        pairs = [] if variant.strip() == "default" else [kv.strip() for kv in variant.split(",") if kv.strip()]
        if not all("=" in kv for kv in pairs):
            p.error("--source-variant takes 'default' or KEY=VALUE,KEY=VALUE")
        args.source_variants[" ".join([SOURCE, *pairs])] = dict(kv.split("=", 1) for kv in pairs)
    if SOURCE in args.kinds:
        at = args.kinds.index(SOURCE)
        args.kinds[at:at + 1] = list(args.source_variants)
    if args.sizes is None:
        args.sizes = [100_000, 300_000, 1_000_000] if args.quick else [1_000_000, 3_000_000, 10_000_000]
    if args.n is None:
        args.n = 20_000 if args.quick else 200_000
    if args.timeout is None:
        args.timeout = max(120.0, args.n / 200)
    if (args.n < args.topics or args.topics < 1 or args.runs < 1 or args.messages < 2 or not args.sizes
            or min(args.sizes) < 1 or not 1 <= args.inflight < 65535 or args.n >= 2**32):
        p.error("--n >= --topics >= 1, --runs >= 1, --messages >= 2, sizes >= 1, --inflight from 1 to 65534")
    check_pin_arguments(p, args)
    return args


def java_version() -> str:
    try:
        out = subprocess.run(["java", "-version"], capture_output=True, text=True, timeout=60, check=False).stderr
    except OSError:
        return "java not found"
    return out.splitlines()[0] if out else "?"


def worker_module(spark: Any) -> str:
    """Where Spark's Python workers import durable_pipeline from."""
    rdd = spark.sparkContext.parallelize([0], 1)
    return str(rdd.map(lambda _: __import__("durable_pipeline").__file__).collect()[0])


def run(args: argparse.Namespace, tmp: Path, info: dict[str, str], report: Report) -> None:
    snapshot, at_start, info["code"] = use_code_snapshot(args.code, WATCHED, tmp, ROOT, report.note)
    import durable_pipeline  # noqa: PLC0415 - after the snapshot is on sys.path
    from durable_pipeline.spark import get_session  # noqa: PLC0415

    if args.driver_memory:
        os.environ["PYSPARK_SUBMIT_ARGS"] = f"--driver-memory {args.driver_memory} pyspark-shell"
    log(f"starting Spark ({MASTER})")
    t0 = time.perf_counter()
    spark = get_session(MASTER)
    startup = time.perf_counter() - t0
    try:
        conf = spark.sparkContext.getConf()
        info["spark"] = (f"pyspark {spark.version}, {java_version()}, master {MASTER}, session start {startup:.1f}s; "
                         f"driver memory {conf.get('spark.driver.memory', 'default (1g)')}, "
                         f"shuffle partitions {spark.conf.get('spark.sql.shuffle.partitions')}; durable_pipeline "
                         f"imported from {Path(durable_pipeline.__file__).parent} (driver), "
                         f"{Path(worker_module(spark)).parent} (Python workers)")
        # The streaming part first: an audit that runs out of heap takes the SparkContext down with it.
        if "stream" in args.only:
            run_stream(spark, args, tmp, snapshot, report)
        if "audit" in args.only:
            run_audits(spark, args, tmp, report)
    finally:
        try:
            spark.stop()
            log("Spark stopped")
        except Exception as exc:  # the JVM is gone already (it exits after an OutOfMemoryError)
            report.note(f"spark.stop() failed: {first_line(exc)}")
    for name, folder in WATCHED.items():
        if changed := changed_files(at_start[name], source_fingerprint(folder)):
            report.note(f"the {name} source changed in the working tree during the run ({', '.join(changed)}); "
                        + ("the run used the copy taken at start" if snapshot else "WARNING: runs may mix versions"))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = shlex.join([".venv/bin/python", "bench/bench_pipeline.py", *(sys.argv[1:] if argv is None else argv)])
    info = machine_info()
    try:
        info["packages"] += f", pyspark {version('pyspark')}, pyarrow {version('pyarrow')}"
    except PackageNotFoundError:
        info["packages"] += ", pyspark not installed"
    info["git"] = git_revision(ROOT, ["plugin", "client_sdk", "pipeline", "bench", "broker.yaml"])
    info["code"] = info["spark"] = "?"
    report = Report()
    started = datetime.now(UTC)
    t0 = time.perf_counter()
    run_in_temp_folder("bench_pipeline_", args.keep_tmp, lambda tmp: run(args, tmp, info, report), report.note)
    write_report(render(args, info, command, report, started=started, elapsed=time.perf_counter() - t0), args.out)
    failures = report.failures()
    for failure in failures:
        print(f"FAILURE: {failure}", file=sys.stderr)
    complete = ("stream" not in args.only or len(report.rounds) == args.runs) and (
        "audit" not in args.only or len(report.audits) == len(args.sizes))
    return 0 if not failures and complete else 1


if __name__ == "__main__":
    sys.exit(main())
