"""The delivery audit: did every acknowledged send reach every durable subscriber, once, in order?

What is computed is defined in docs/delivery-log.md ("What the audit computes"); how:

1. **Expected.** Durable subscriptions (``durable`` not false) of QoS >= 1 are matched to the
   topics sent on (:mod:`durable_pipeline.topics`: distinct topics x distinct filters), giving
   per (receiver, topic) the earliest time a matching filter was subscribed. Sends of QoS >= 1
   (the acknowledged ones) on that topic at or after that time are expected by that receiver.
   QoS 0 promises nothing, so it is never expected (its receives still count as received).
2. **Pairing (multiset).** Per (receiver, topic, id) the k-th receive (by receive time, then
   seq) is paired with the k-th expected send (by send time): an expected send left without a
   receive is *lost*; a receive beyond the number of sends of that (topic, id) by anyone is
   *duplicated*; a receive of an id no log sent is *unknown* (a publisher without a log, or a
   changed payload). Sent twice and received once is therefore one lost.
3. **Order.** Per (receiver, topic, sender), paired receives in receive order: a receive whose
   send time is below the latest send time received before it is *out of order* (duplicates
   and unpaired receives are left out).
4. **Latency and drain.** Replay latency = receive time minus the paired send's time, for
   receives flagged ``replayed``; time to drain = from a ``connect`` to the next record of that
   device when that is a ``live`` (plain clients have no ``live``: no figure).

Everything runs as Spark DataFrames; only per-device rows and the histogram bins reach the
driver. Times come from the devices' own clocks: a skew between a publisher and a receiver
shows up in the latency (even negative) and, at a subscription's edge, in what is expected.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal, get_args

import pyarrow as pa
import pyarrow.parquet as pq
from pyspark import StorageLevel
from pyspark.sql import Column, DataFrame, Row, SparkSession, Window
from pyspark.sql import functions as sf

from .errors import AuditInputError
from .logs import DeliveryLogs, read_logs
from .report import write_report
from .topics import topic_filter_pairs

Guarantee = Literal["exactly-once", "at-least-once"]
GUARANTEES: tuple[str, ...] = get_args(Guarantee)
ALL = "ALL"
"""The ``device`` of the summary's total row (its ``scope`` is ``all``; a device may be named ALL)."""
COUNT_COLUMNS = ("expected", "received", "lost", "duplicated", "out_of_order", "unknown", "replayed")
FIGURE_COLUMNS = ("replay_p50_ms", "replay_p99_ms", "replay_max_ms", "drain_p50_s", "drain_max_s")
BINS_PER_DECADE = 10
"""Replay latency histogram: log-spaced bins, 10 per factor of ten, from 0.01 ms."""
MIN_LATENCY_MS = 0.01


@dataclass(frozen=True)
class DeviceStats:
    """One row of the summary: a receiving device, or every device (``device == "ALL"``)."""

    device: str
    expected: int
    received: int
    lost: int
    duplicated: int
    out_of_order: int
    unknown: int
    """Receives of an id that no log sent."""
    replayed: int
    """Receives flagged ``replayed`` (delivered before the replay marker)."""
    replay_p50_ms: float | None
    replay_p99_ms: float | None
    replay_max_ms: float | None
    drain_p50_s: float | None
    drain_max_s: float | None


@dataclass(frozen=True)
class LatencyBin:
    """Replayed receives whose latency is in [low_ms, high_ms); the first bin also holds lower ones."""

    low_ms: float
    high_ms: float
    count: int


@dataclass(frozen=True)
class AuditResult:
    """What ``run_audit`` found; ``ok`` says whether the guarantee asked for holds."""

    ok: bool
    expect: Guarantee
    check_order: bool
    total: DeviceStats
    devices: list[DeviceStats]
    latency_bins: list[LatencyBin]
    records: int
    inputs: list[str]
    failures: list[str]
    """Why the guarantee does not hold (empty when ``ok``)."""
    notes: list[str]
    """What a reader should know that does not decide the verdict (unknown receives, no sends)."""
    summary_path: Path
    report_path: Path
    charts: list[Path] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        order = "" if self.check_order else " (order not checked)"
        if self.ok:
            return f"{self.expect} holds{order}"
        return f"{self.expect} does NOT hold{order}: " + "; ".join(self.failures)


def run_audit(
    spark: SparkSession,
    inputs: Sequence[str],
    out_dir: str | Path,
    expect: Guarantee,
    check_order: bool = True,
) -> AuditResult:
    """Audit the delivery logs ``inputs``; write summary.parquet and report.html to ``out_dir``.

    exactly-once holds when nothing is lost and nothing duplicated; at-least-once when nothing is
    lost; both also need every receive in order unless ``check_order`` is false. Raises
    AuditInputError for inputs that cannot be audited (see :mod:`durable_pipeline.logs`).
    """
    if expect not in GUARANTEES:
        raise ValueError(f"expect must be one of {', '.join(GUARANTEES)}, not {expect!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    logs = read_logs(spark, inputs)
    try:
        return _audit(logs, list(inputs), out, expect, check_order)
    finally:
        logs.records.unpersist()


def _audit(logs: DeliveryLogs, inputs: list[str], out: Path, expect: Guarantee, check_order: bool) -> AuditResult:

    records = logs.records
    if not logs.kinds["subscribe"]:
        raise AuditInputError(
            "the logs hold no subscribe records, so no device expects any message: include the subscribers' "
            "delivery logs (the SDK writes a subscribe record per subscription)"
        )
    pairs = _paired(records).persist(StorageLevel.MEMORY_AND_DISK)
    try:
        rows = _summary(records, pairs).collect()  # one row per receiving device
        bins = _latency_bins(pairs)
    finally:
        pairs.unpersist()
    devices = sorted((_stats(row) for row in rows if row["scope"] == "device"), key=lambda s: s.device)
    totals = [_stats(row) for row in rows if row["scope"] == "all"]
    total = totals[0] if totals else _empty(ALL)
    summary_path = _write_summary(total, devices, out / "summary.parquet")
    failures = _failures(total, devices, expect, check_order)
    notes = _notes(total, logs.kinds)

    result = AuditResult(
        ok=not failures,
        expect=expect,
        check_order=check_order,
        total=total,
        devices=devices,
        latency_bins=bins,
        records=logs.count,
        inputs=inputs,
        failures=failures,
        notes=notes,
        summary_path=summary_path,
        report_path=out / "report.html",
    )
    charts = write_report(result, out)
    return replace(result, charts=charts)


def _expected(records: DataFrame) -> tuple[DataFrame, DataFrame]:
    """(expected sends per receiver, sends per (topic, id)); see the module docstring, step 1."""

    sends = records.where(sf.col("kind") == "send").select(
        sf.col("device").alias("sender"),
        "topic",
        "id",
        sf.col("time").alias("send_time"),
        sf.coalesce(sf.col("qos"), sf.lit(1)).alias("qos"),
    )
    subs = (
        records.where(
            (sf.col("kind") == "subscribe")
            & sf.coalesce(sf.col("durable"), sf.lit(True))
            & (sf.coalesce(sf.col("qos"), sf.lit(1)) >= 1)
        )
        .groupBy(sf.col("device").alias("receiver"), sf.col("topic").alias("filter"))
        .agg(sf.min("time").alias("sub_time"))
    )
    acknowledged = sends.where(sf.col("qos") >= 1)
    matched = topic_filter_pairs(acknowledged, subs)
    first_sub = matched.join(subs, "filter").groupBy("receiver", "topic").agg(sf.min("sub_time").alias("sub_time"))
    expected = (
        acknowledged.join(first_sub, "topic")
        .where(sf.col("send_time") >= sf.col("sub_time"))
        .select("receiver", "topic", "id", "sender", "send_time")
    )
    sent = sends.groupBy("topic", "id").agg(sf.count(sf.lit(1)).alias("sent"))
    return expected, sent


def _paired(records: DataFrame) -> DataFrame:
    """One row per expected send and/or receive, with the flags of steps 2 and 3 (module docstring)."""

    expected, sent = _expected(records)
    by_message = ["receiver", "topic", "id"]
    sends = expected.withColumn(
        "k", sf.row_number().over(Window.partitionBy(*by_message).orderBy("send_time", "sender"))
    )
    receives = records.where(sf.col("kind") == "receive").select(
        sf.col("device").alias("receiver"),
        "topic",
        "id",
        sf.col("time").alias("recv_time"),
        sf.coalesce(sf.col("seq"), sf.lit(0)).alias("seq"),
        sf.coalesce(sf.col("replayed"), sf.lit(False)).alias("replayed"),
    )
    receives = receives.withColumn(
        "k", sf.row_number().over(Window.partitionBy(*by_message).orderBy("recv_time", "seq"))
    )
    joined = sends.join(receives, [*by_message, "k"], "full").join(sent, ["topic", "id"], "left")
    has_send = sf.col("send_time").isNotNull()
    has_recv = sf.col("recv_time").isNotNull()
    paired = has_send & has_recv
    flagged = joined.select(
        "receiver",
        "topic",
        "sender",
        "send_time",
        "recv_time",
        "seq",
        has_send.alias("is_expected"),
        has_recv.alias("is_received"),
        paired.alias("is_paired"),
        (has_send & ~has_recv).alias("is_lost"),
        (has_recv & ~has_send & sf.col("sent").isNotNull() & (sf.col("k") > sf.col("sent"))).alias("is_duplicate"),
        (has_recv & sf.col("sent").isNull()).alias("is_unknown"),
        (has_recv & sf.col("replayed")).alias("is_replayed"),
        sf.when(paired & sf.col("replayed"), (sf.col("recv_time") - sf.col("send_time")) * 1000.0).alias("latency_ms"),
    )
    before = (
        Window.partitionBy("receiver", "topic", "sender")
        .orderBy("recv_time", "seq")
        .rowsBetween(Window.unboundedPreceding, -1)
    )
    latest_before = sf.max(sf.when(sf.col("is_paired"), sf.col("send_time"))).over(before)
    return flagged.withColumn(
        "is_out_of_order", sf.col("is_paired") & sf.coalesce(sf.col("send_time") < latest_before, sf.lit(False))
    )


def _labelled(grouped: DataFrame) -> DataFrame:
    """A rollup's rows labelled: ``scope`` device or all, ``device`` the receiver or ALL."""

    total = sf.col("_gid") == 1
    return grouped.select(
        sf.when(total, "all").otherwise("device").alias("scope"),
        sf.when(total, ALL).otherwise(sf.col("receiver")).alias("device"),
        *[c for c in grouped.columns if c not in ("_gid", "receiver")],
    )


def _summary(records: DataFrame, pairs: DataFrame) -> DataFrame:
    """Per receiving device and ALL: the counts, replay latency and time-to-drain figures."""

    def count_of(flag: str) -> Column:
        return sf.sum(sf.col(flag).cast("long"))

    counts = _labelled(
        pairs.rollup("receiver").agg(
            sf.grouping_id().alias("_gid"),
            count_of("is_expected").alias("expected"),
            count_of("is_received").alias("received"),
            count_of("is_lost").alias("lost"),
            count_of("is_duplicate").alias("duplicated"),
            count_of("is_out_of_order").alias("out_of_order"),
            count_of("is_unknown").alias("unknown"),
            count_of("is_replayed").alias("replayed"),
            sf.percentile_approx("latency_ms", [0.5, 0.99], 10000).alias("_latency"),
            sf.max("latency_ms").alias("replay_max_ms"),
        )
    )
    counts = counts.select(
        "*",
        sf.col("_latency").getItem(0).alias("replay_p50_ms"),
        sf.col("_latency").getItem(1).alias("replay_p99_ms"),
    ).drop("_latency")
    drain = _labelled(
        _drains(records)
        .rollup("receiver")
        .agg(
            sf.grouping_id().alias("_gid"),
            sf.percentile_approx("drain_s", 0.5, 10000).alias("drain_p50_s"),
            sf.max("drain_s").alias("drain_max_s"),
        )
    )
    devices = (
        records.where(sf.col("kind").isin("subscribe", "receive"))
        .select("device")
        .distinct()
        .withColumn("scope", sf.lit("device"))
    )
    keys = devices.unionByName(records.sparkSession.createDataFrame([("all", ALL)], "scope string, device string"))
    summary = keys.join(counts, ["scope", "device"], "left").join(drain, ["scope", "device"], "left")
    summary = summary.fillna(0, subset=list(COUNT_COLUMNS))
    return summary.select(
        "scope",
        "device",
        *[sf.col(c).cast("long").alias(c) for c in COUNT_COLUMNS],
        *[sf.col(c).cast("double").alias(c) for c in FIGURE_COLUMNS],
    )


def _write_summary(total: DeviceStats, devices: list[DeviceStats], path: Path) -> Path:
    """summary.parquet: one file (pyarrow), the devices by name then the ALL row (scope ``all``)."""

    rows = [*devices, total]
    columns: dict[str, object] = {"scope": ["device"] * len(devices) + ["all"], "device": [r.device for r in rows]}
    for name in COUNT_COLUMNS:
        columns[name] = pa.array([getattr(r, name) for r in rows], type=pa.int64())
    for name in FIGURE_COLUMNS:
        columns[name] = pa.array([getattr(r, name) for r in rows], type=pa.float64())
    pq.write_table(pa.table(columns), path)
    return path


def _drains(records: DataFrame) -> DataFrame:
    """(receiver, drain_s): each connect followed (next record of the device) by a live."""

    window = Window.partitionBy("device").orderBy("time", "kind")  # at equal times, connect before live
    events = records.where(sf.col("kind").isin("connect", "live")).select("device", "time", "kind")
    following = events.select(
        "*",
        sf.lead("kind").over(window).alias("next_kind"),
        sf.lead("time").over(window).alias("next_time"),
    )
    return following.where((sf.col("kind") == "connect") & (sf.col("next_kind") == "live")).select(
        sf.col("device").alias("receiver"), (sf.col("next_time") - sf.col("time")).alias("drain_s")
    )


def _latency_bins(pairs: DataFrame) -> list[LatencyBin]:
    """The replay latency histogram, binned in Spark (log-spaced), a few rows collected."""

    index = sf.floor(sf.log10(sf.greatest(sf.col("latency_ms"), sf.lit(MIN_LATENCY_MS))) * BINS_PER_DECADE)
    rows = pairs.where(sf.col("latency_ms").isNotNull()).groupBy(index.alias("bin")).count().orderBy("bin").collect()
    return [
        LatencyBin(
            low_ms=math.pow(10, int(row["bin"]) / BINS_PER_DECADE),
            high_ms=math.pow(10, (int(row["bin"]) + 1) / BINS_PER_DECADE),
            count=int(row["count"]),
        )
        for row in rows
    ]


def _stats(row: Row) -> DeviceStats:
    def figure(name: str) -> float | None:
        value = row[name]
        return None if value is None or math.isnan(value) else float(value)

    return DeviceStats(
        str(row["device"]),
        *(int(row[name]) for name in COUNT_COLUMNS),
        *(figure(name) for name in FIGURE_COLUMNS),
    )


def _empty(device: str) -> DeviceStats:
    return DeviceStats(device, *([0] * len(COUNT_COLUMNS)), *([None] * len(FIGURE_COLUMNS)))


def _failures(total: DeviceStats, devices: list[DeviceStats], expect: Guarantee, check_order: bool) -> list[str]:
    def spread(attr: str) -> str:
        hit = sum(1 for device in devices if getattr(device, attr))
        return f"{hit} device{'s' if hit != 1 else ''}"

    failures: list[str] = []
    if total.lost:
        failures.append(f"{total.lost} of {total.expected} expected messages never received ({spread('lost')})")
    if expect == "exactly-once" and total.duplicated:
        failures.append(f"{total.duplicated} receives more than sent ({spread('duplicated')})")
    if check_order and total.out_of_order:
        failures.append(f"{total.out_of_order} received out of order ({spread('out_of_order')})")
    return failures


def _notes(total: DeviceStats, kinds: dict[str, int]) -> list[str]:
    notes: list[str] = []
    if not kinds.get("send"):
        notes.append("no send records: nothing could be expected; include the publishers' delivery logs")
    elif total.expected == 0:
        notes.append("no send matched a durable QoS>=1 subscription made before it: nothing was expected")
    if total.unknown:
        notes.append(
            f"{total.unknown} receives of messages that no log sent (a publisher without a delivery log, "
            "or a payload changed on the way)"
        )
    if total.replay_p50_ms is not None and total.replay_p50_ms < 0:
        notes.append("negative replay latency: the publishers' and receivers' clocks disagree")
    return notes
