"""The delivery audit: did every acknowledged send reach every durable subscriber, once, in order?

What is computed is defined in docs/delivery-log.md ("What the audit computes"); how:

1. **Expected.** A subscription's *window* opens at a durable (``durable`` not false) QoS >= 1
   ``subscribe`` of a filter and closes at the device's next ``unsubscribe`` of that filter, its
   next ``session_end``, or its next ``subscribe`` of that filter that is non-durable or QoS 0; a
   later durable QoS >= 1 ``subscribe`` opens a new one. The windows are matched to the topics
   sent on (:mod:`durable_pipeline.topics`: distinct topics x distinct filters) and merged per
   (receiver, topic); a send of QoS >= 1 (an acknowledged one) on that topic at a time inside a
   window, start included, end excluded, is expected by that receiver. QoS 0 promises nothing,
   so it is never expected (its receives still count as received). With ``count_qos0`` QoS 0
   counts as QoS 1 in sends and durable subscriptions alike, so a run that published at QoS 0
   through connection drops shows what it lost there (non-durable subscriptions still expect
   nothing).
2. **Pairing (multiset).** A receive repeating an earlier receive's (epoch, seq), with seq > 0,
   of the same (receiver, topic, id) is the same delivery again (a broker redelivery the SDK
   processed twice): a *duplicate* (the topic is in the key for stream events, whose seq is per
   stream topic; a redelivery is the same message, so the id too). The other receives are paired
   with the expected sends per (receiver, topic, id) as a multiset in time order: the first n
   receives of an id (n its expected sends) are paired, the rest are *duplicated* when the
   receiver got that (topic, id) more often than anyone sent it, and *unknown* when no log sent
   it; an expected send left without a receive is *lost*. Sent twice and received once is
   therefore one lost. Which send a receive is paired with matters only when an id is expected
   more than once (the same payload sent again): in those (receiver, topic) streams the receives
   are taken in receive order and each is paired with the earliest unpaired send of its id not
   older than the latest send paired so far from the same publisher (in order), else with the
   earliest unpaired one (out of order). So ON, OFF, ON received as OFF, ON pairs the ON with
   the second ON (the first is lost, nothing is out of order). That walk runs per stream in a
   Python worker (``applyInPandas``, :func:`match_in_order`); streams without a repeated id pair
   the k-th receive with the k-th send in Spark alone.
3. **Order.** Per (receiver, topic, sender), paired receives in receive order: a receive whose
   send time is below the latest send time received before it is *out of order* (duplicates
   and unpaired receives are left out).
4. **Latency and drain.** Replay latency = receive time minus the paired send's time, for
   receives flagged ``replayed``; time to drain = from a ``connect`` to the next record of that
   device when that is a ``live`` (plain clients have no ``live``: no figure).

Everything runs in Spark (DataFrames, and step 2's walk in Python workers); only per-device
rows and the histogram bins reach the driver. Times come from the devices' own clocks: a skew
between a publisher and a receiver shows up in the latency (even negative) and, at a
subscription's edges, in what is expected.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, get_args

import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql import Column, DataFrame, Row, SparkSession, Window
from pyspark.sql import functions as sf

from .errors import AuditInputError
from .logs import CACHE_LEVEL, DeliveryLogs, read_logs, unpersist
from .report import write_report
from .spark import check_out_folder
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
    count_qos0: bool
    """QoS 0 sends were expected and QoS 0 durable subscriptions opened windows."""
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
        flags = ((not self.check_order, "order not checked"), (self.count_qos0, "QoS 0 counted"))
        asked = [text for on, text in flags if on]
        scope = f" ({', '.join(asked)})" if asked else ""
        if self.ok:
            return f"{self.expect} holds{scope}"
        return f"{self.expect} does NOT hold{scope}: " + "; ".join(self.failures)


def run_audit(
    spark: SparkSession,
    inputs: Sequence[str],
    out_dir: str | Path,
    expect: Guarantee,
    check_order: bool = True,
    *,
    count_qos0: bool = False,
) -> AuditResult:
    """Audit the delivery logs ``inputs``; write summary.parquet and report.html to ``out_dir``.

    exactly-once holds when nothing is lost and nothing duplicated; at-least-once when nothing is
    lost; both also need every receive in order unless ``check_order`` is false. ``count_qos0``
    expects QoS 0 sends too (module docstring, step 1): for a run meant to show QoS 0 loss. Raises
    AuditInputError for inputs that cannot be audited (see :mod:`durable_pipeline.logs`), for
    ``out_dir`` naming a file or a URI (it is a local folder), and for an audit that would check nothing
    (no subscribe or no send records, or nothing expected): it must not pass.
    """
    if expect not in GUARANTEES:
        raise ValueError(f"expect must be one of {', '.join(GUARANTEES)}, not {expect!r}")
    check_out_folder(out_dir)
    out = _out_folder(Path(out_dir))
    logs = read_logs(spark, inputs)
    try:
        return _audit(logs, list(inputs), out, expect, check_order=check_order, count_qos0=count_qos0)
    finally:
        unpersist([logs.cached])


def _out_folder(out: Path) -> Path:
    """``out`` made (with its parents) as a folder; AuditInputError when a file is in the way."""
    if out.exists() and not out.is_dir():
        raise AuditInputError(f"--out {out} is not a folder (a file of that name exists): name a folder for the report")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a parent that is a file, no permission
        raise AuditInputError(f"--out {out} cannot be made a folder ({exc}): name a folder for the report") from exc
    return out


def _audit(
    logs: DeliveryLogs, inputs: list[str], out: Path, expect: Guarantee, *, check_order: bool, count_qos0: bool
) -> AuditResult:

    records = logs.records
    if not logs.kinds["subscribe"]:
        raise AuditInputError(
            "the logs hold no subscribe records, so no device expects any message: include the subscribers' "
            "delivery logs (the SDK writes a subscribe record per subscription)"
        )
    if not logs.kinds["send"]:
        raise AuditInputError(
            "no send records: was the publisher's delivery_log written? Without the sends nothing can be "
            "expected, so nothing could be checked; include the publishers' delivery logs"
        )
    cached: list[DataFrame] = []
    pairs = _paired(records, cached, count_qos0).persist(CACHE_LEVEL)
    cached.append(pairs)
    try:
        rows = _summary(records, pairs).collect()  # one row per receiving device
        totals = [_stats(row) for row in rows if row["scope"] == "all"]
        total = totals[0] if totals else _empty(ALL)
        if total.expected == 0:
            qos = "" if count_qos0 else " QoS>=1"
            raise AuditInputError(
                f"nothing was expected: none of the {logs.kinds['send']} send records is a{qos} send on a topic "
                f"that a durable{qos} subscription matched while it was open (from its subscribe to an "
                "unsubscribe or session_end), so nothing could be checked; check the subscribers' logs are "
                "included and the devices' clocks"
            )
        bins = _latency_bins(pairs)
    finally:
        unpersist(cached)
    devices = sorted((_stats(row) for row in rows if row["scope"] == "device"), key=lambda s: s.device)
    summary_path = _write_summary(total, devices, out / "summary.parquet")
    failures = _failures(total, devices, expect, check_order)
    notes = _notes(total)

    result = AuditResult(
        ok=not failures,
        expect=expect,
        check_order=check_order,
        count_qos0=count_qos0,
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


INFINITY = float("inf")
"""The end of a window no unsubscribe or session_end closed."""


def _windows(records: DataFrame, count_qos0: bool) -> DataFrame:
    """(receiver, filter, start, end): when each durable QoS >= 1 subscription (any QoS with
    ``count_qos0``) was open (step 1).

    Per (device, filter), the events in time order (a closing one first at equal times): each
    opening ``subscribe`` runs to the next closing event; the opens before one close share it
    and make one window, from the first of them.
    """

    min_qos = 0 if count_qos0 else 1
    subscribes = records.where(sf.col("kind") == "subscribe").select(
        sf.col("device").alias("receiver"),
        sf.col("topic").alias("filter"),
        "time",
        (sf.coalesce(sf.col("durable"), sf.lit(True)) & (sf.coalesce(sf.col("qos"), sf.lit(1)) >= min_qos)).alias(
            "opens"
        ),
    )
    unsubscribes = records.where(sf.col("kind") == "unsubscribe").select(
        sf.col("device").alias("receiver"), sf.col("topic").alias("filter"), "time", sf.lit(False).alias("opens")
    )
    session_ends = (
        records.where(sf.col("kind") == "session_end")
        .select(sf.col("device").alias("receiver"), "time")
        .join(subscribes.select("receiver", "filter").distinct(), "receiver")
        .select("receiver", "filter", "time", sf.lit(False).alias("opens"))
    )
    events = subscribes.unionByName(unsubscribes).unionByName(session_ends)
    later = (
        Window.partitionBy("receiver", "filter")
        .orderBy("time", "opens")  # false first: at equal times the close, then the (re)open
        .rowsBetween(1, Window.unboundedFollowing)
    )
    next_close = sf.min(sf.when(~sf.col("opens"), sf.col("time"))).over(later)
    ends = events.select("receiver", "filter", "time", "opens", next_close.alias("end"))
    return (
        ends.where("opens")
        .groupBy("receiver", "filter", sf.coalesce(sf.col("end"), sf.lit(INFINITY)).alias("end"))
        .agg(sf.min("time").alias("start"))
    )


def _expected(records: DataFrame, count_qos0: bool) -> tuple[DataFrame, DataFrame]:
    """(expected sends per receiver, sends per (topic, id)); see the module docstring, step 1."""

    sends = records.where(sf.col("kind") == "send").select(
        sf.col("device").alias("sender"),
        "topic",
        "id",
        sf.col("time").alias("send_time"),
        sf.coalesce(sf.col("qos"), sf.lit(1)).alias("qos"),
    )
    windows = _windows(records, count_qos0)
    acknowledged = sends if count_qos0 else sends.where(sf.col("qos") >= 1)
    matched = topic_filter_pairs(acknowledged, windows).join(windows, "filter")
    # the windows of all the filters matching a topic, merged per (receiver, topic): disjoint, so a
    # send falls in at most one of them
    by_start = Window.partitionBy("receiver", "topic").orderBy("start", "end")
    reach = sf.max("end").over(by_start.rowsBetween(Window.unboundedPreceding, -1))
    apart = matched.select("*", sf.coalesce(sf.col("start") > reach, sf.lit(True)).cast("int").alias("new"))
    merged = (
        apart.select("*", sf.sum("new").over(by_start.rowsBetween(Window.unboundedPreceding, 0)).alias("run"))
        .groupBy("receiver", "topic", "run")
        .agg(sf.min("start").alias("start"), sf.max("end").alias("end"))
    )
    expected = (
        acknowledged.join(merged, "topic")
        .where((sf.col("send_time") >= sf.col("start")) & (sf.col("send_time") < sf.col("end")))
        .select("receiver", "topic", "id", "sender", "send_time")
    )
    sent = sends.groupBy("topic", "id").agg(sf.count(sf.lit(1)).alias("sent"))
    return expected, sent


def _paired(records: DataFrame, cached: list[DataFrame], count_qos0: bool) -> DataFrame:
    """One row per expected send and/or receive, with the flags of steps 2 and 3 (module docstring).

    Frames persisted on the way are appended to ``cached``: the caller unpersists them once the
    result has been used.
    """

    expected, sent = _expected(records, count_qos0)
    by_message = ["receiver", "topic", "id"]
    sends = expected.withColumn(
        "k", sf.row_number().over(Window.partitionBy(*by_message).orderBy("send_time", "sender")).cast("long")
    ).persist(CACHE_LEVEL)
    cached.append(sends)
    receives = records.where(sf.col("kind") == "receive").select(
        sf.col("device").alias("receiver"),
        "topic",
        "id",
        sf.col("time").alias("recv_time"),
        sf.coalesce(sf.col("seq"), sf.lit(0)).alias("seq"),
        sf.coalesce(sf.col("epoch"), sf.lit(0)).alias("epoch"),
        sf.coalesce(sf.col("replayed"), sf.lit(False)).alias("replayed"),
    )
    # The same delivery again: (epoch, seq) of an earlier receive of that (receiver, topic, id). The
    # topic is in it for stream events (epoch 0, seq per stream topic), the id makes this window
    # share the next one's partitioning (a redelivery is the same message).
    by_delivery = Window.partitionBy(*by_message).orderBy("epoch", "seq", "recv_time")
    again = (
        (sf.col("seq") > 0)
        & (sf.lag("epoch").over(by_delivery) == sf.col("epoch"))
        & (sf.lag("seq").over(by_delivery) == sf.col("seq"))
    )
    receives = receives.select("*", sf.coalesce(again, sf.lit(False)).alias("again")).drop("epoch")
    # k: the rank among the receives of that (receiver, topic, id) that are not a delivery again
    # (those rank after them and are paired with nothing)
    by_time = Window.partitionBy(*by_message).orderBy("again", "recv_time", "seq")
    fresh = receives.withColumn("k", sf.row_number().over(by_time).cast("long"))
    # streams where an id is expected more than once: which send a receive is, is walked in Python
    repeated = sends.where(sf.col("k") == 2).select("receiver", "topic").distinct()
    if repeated.isEmpty():
        received = fresh.withColumn("send_k", sf.when(~sf.col("again"), sf.col("k")))
    else:
        stream = ["receiver", "topic"]
        walk_sends = sends.join(repeated, stream, "left_semi")
        walk_receives = fresh.join(repeated, stream, "left_semi")

        def renamed(frame: DataFrame, *columns: str) -> DataFrame:  # new column ids: no ambiguous self-join
            return frame.select(*[sf.col(name).alias(name) for name in (*stream, "id", *columns)])

        walked = (
            renamed(walk_sends, "sender", "send_time", "k")
            .groupBy(*stream)
            .cogroup(renamed(walk_receives.where(~sf.col("again")), "recv_time", "seq", "k").groupBy(*stream))
            .applyInPandas(_pair_stream, PAIRED_SCHEMA)
        )
        received = (
            fresh.join(repeated, stream, "left_anti")
            .withColumn("send_k", sf.when(~sf.col("again"), sf.col("k")))
            .unionByName(walk_receives.join(walked, [*by_message, "k"], "left"))
        )
    joined = sends.withColumnRenamed("k", "send_k").join(received, [*by_message, "send_k"], "full")
    joined = joined.join(sent, ["topic", "id"], "left")
    has_send = sf.col("send_time").isNotNull()
    has_recv = sf.col("recv_time").isNotNull()
    paired = has_send & has_recv
    again = sf.coalesce(sf.col("again"), sf.lit(False))
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
        (
            has_recv & ~has_send & (again | (sf.col("sent").isNotNull() & (sf.col("k") > sf.col("sent"))))
        ).alias("is_duplicate"),
        (has_recv & ~again & sf.col("sent").isNull()).alias("is_unknown"),
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


PAIRED_SCHEMA = "receiver string, topic string, id string, k long, send_k long"
"""What :func:`_pair_stream` returns: per receive (its k), the k of the send it is paired with."""


def _pair_stream(sends: Any, receives: Any) -> Any:
    """``applyInPandas`` over one (receiver, topic) stream (two pandas DataFrames, one returned):
    :func:`match_in_order` on its rows."""

    receives = receives.sort_values(["recv_time", "seq"], kind="stable")
    columns = [sends[name].tolist() for name in ("id", "sender", "send_time", "k")]
    picked = match_in_order(receives["id"].tolist(), zip(*columns, strict=True))
    out = receives[["receiver", "topic", "id", "k"]].copy()
    out["send_k"] = picked
    out["send_k"] = out["send_k"].astype("Int64")  # None where the receive is not paired
    return out


@dataclass
class _Sends:
    """One publisher's sends of one id to one receiver, by time; ``used`` once paired."""

    times: list[float] = field(default_factory=list)
    ks: list[int] = field(default_factory=list)
    used: list[bool] = field(default_factory=list)
    first_unused: int = 0


def match_in_order(receive_ids: Sequence[str], sends: Iterable[tuple[str, str, float, int]]) -> list[int | None]:
    """Step 2's walk over one (receiver, topic) stream: per receive, the ``k`` of its send, or None.

    ``receive_ids`` in receive order; ``sends`` as (id, sender, send time, k). A receive takes
    the earliest unpaired send of its id that is not older than the latest send paired so far
    from that sender (in order), else the earliest unpaired send of its id (out of order), else
    none. Each sender's paired sends only grow older than its cursor, so a search is a bisection.
    """

    queues: dict[tuple[str, str], _Sends] = {}
    senders: dict[str, list[str]] = {}
    unpaired: dict[str, int] = {}
    for message, sender, time, k in sorted(sends, key=lambda send: (send[2], send[1])):
        queue = queues.get((message, sender))
        if queue is None:
            queue = queues[message, sender] = _Sends()
            senders.setdefault(message, []).append(sender)
        queue.times.append(time)
        queue.ks.append(k)
        queue.used.append(False)
        unpaired[message] = unpaired.get(message, 0) + 1
    cursor: dict[str, float] = {}
    picked: list[int | None] = []
    for message in receive_ids:
        if not unpaired.get(message):
            picked.append(None)
            continue
        candidates = [(sender, queues[message, sender]) for sender in senders[message]]
        best = _earliest(candidates, lambda sender, queue: _next_in_order(queue, cursor.get(sender, -INFINITY)))
        if best is None:  # out of order: the earliest unpaired send
            best = _earliest(candidates, lambda _, queue: _first_unused(queue))
        if best is None:  # not reached: unpaired[message] > 0
            picked.append(None)
            continue
        time, sender, queue, i = best
        queue.used[i] = True
        unpaired[message] -= 1
        cursor[sender] = max(cursor.get(sender, -INFINITY), time)
        picked.append(queue.ks[i])
    return picked


def _next_in_order(queue: _Sends, cursor: float) -> int:
    """The earliest unpaired send at or after the sender's cursor."""
    i = bisect_left(queue.times, cursor)
    while i < len(queue.times) and queue.used[i]:  # only sends at the cursor's very time
        i += 1
    return i


def _first_unused(queue: _Sends) -> int:
    while queue.first_unused < len(queue.times) and queue.used[queue.first_unused]:
        queue.first_unused += 1
    return queue.first_unused


def _earliest(
    candidates: list[tuple[str, _Sends]], index_of: Callable[[str, _Sends], int]
) -> tuple[float, str, _Sends, int] | None:
    """Of each sender's candidate send, the earliest (ties by sender), as (time, sender, queue, index)."""
    best: tuple[float, str, _Sends, int] | None = None
    for sender, queue in candidates:
        i = index_of(sender, queue)
        if i < len(queue.times) and (best is None or (queue.times[i], sender) < best[:2]):
            best = (queue.times[i], sender, queue, i)
    return best


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


def _notes(total: DeviceStats) -> list[str]:
    notes: list[str] = []
    if total.unknown:
        notes.append(
            f"{total.unknown} receives of messages that no log sent (a publisher without a delivery log, "
            "or a payload changed on the way)"
        )
    if total.replay_p50_ms is not None and total.replay_p50_ms < 0:
        notes.append("negative replay latency: the publishers' and receivers' clocks disagree")
    return notes
