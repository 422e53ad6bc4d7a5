"""The ``amqtt-durable`` Spark data source: the broker's stream logs as a batch or streaming DataFrame.

The broker appends every message of a configured stream (its ``streams`` setting) to a log
per topic, ids 1, 2, 3, ... (docs/protocol.md, "Streams"). Offsets are ``{topic: last id
included}``, so a micro-batch is an id range per topic, and a range reads the same events
however often it is read: Spark's checkpoint plus a file sink give exactly-once.

Where things run. Planning (``initialOffset``/``latestOffset``/``partitions``, the batch
``partitions``) runs in a Python process next to the driver and asks the broker with a
stateless ``DurableClient``. ``read(partition)`` runs in Python workers on the executors:
each partition opens its own raw connection (``durable_pipeline.bulk``, no SDK client),
reads its range in id order from the position it presents (``stream_subscribe`` with
``after``), and closes. Only options and plain ranges travel to the executors (pickled),
never a connection.

Failures. A read task reconnects by itself (broker restart, dropped link, failover to the
next address) and resumes after the last id it took; a task that still gets no event within
``timeout`` seconds fails with SourceError, and Spark runs the range again (or the query
stops and resumes from its checkpoint when restarted). Ids retention trimmed before they
were read are data loss: SourceError, or with ``failOnDataLoss=false`` skipped, counted and
logged (a WARNING per micro-batch on the driver, and per task on the executor).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from paho.mqtt.client import topic_matches_sub
from pyspark.sql.datasource import DataSource, DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import (
    BinaryType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from durable_client import (
    ConnectFailed,
    ControlRequestFailed,
    DurableClient,
    RequestTimeout,
    Unconnected,
)
from durable_client._options import MAX_FAILOVER
from durable_protocol import int_digits
from durable_protocol.hostport import join_host_port, parse_host, split_host_port

from .bulk import BulkRangeReader, arrow_batch
from .errors import SourceError

log = logging.getLogger("durable_pipeline.source")

FORMAT: Final = "amqtt-durable"
STORE_KEY: Final = "_durable/store"
"""Offset entry holding the broker store's id (no stream topic can be under _durable/)."""
SCHEMA_DDL: Final = "topic string, id long, payload binary, qos int, published_at timestamp"
DEFAULT_WINDOW: Final = 1000
"""The broker's limit: a read task waits on the window's round trip, so the largest one (bench/RESULTS.md)."""
MAX_WINDOW: Final = 1000
"""The broker's limit on events in flight per topic (durable_protocol.MAX_STREAM_WINDOW)."""
DEFAULT_IDS_PER_PARTITION: Final = 100_000
DEFAULT_TIMEOUT: Final = 30.0
RECONNECT_MAX_DELAY: Final = 1.0
"""A reader's client retries at least every second: a restarted broker is found again well within ``timeout``."""
ROWS_PER_BATCH: Final = 4096
"""Rows per Arrow batch handed to Spark: big enough to amortise, small enough to stream."""
STALL_CHECK: Final = 0.5
"""A read with no event for this long asks the broker whether retention trimmed what it waits for."""
"""Room for the probe's ``after`` positions in one request (the broker takes at most 64 KiB)."""


def _schema() -> StructType:
    """SCHEMA_DDL as a StructType (built by hand: parsing DDL needs a SparkSession, workers have none)."""
    return StructType(
        [
            StructField("topic", StringType()),
            StructField("id", LongType()),
            StructField("payload", BinaryType()),
            StructField("qos", IntegerType()),
            StructField("published_at", TimestampType()),
        ]
    )


# ==================================================================== options
@dataclass(frozen=True)
class Options:
    """The source's options, checked once on the driver; pickled to the executors with each reader."""

    host: str = "127.0.0.1"
    port: int = 1883
    filter: str = ""
    starting: str | dict[str, int] = "earliest"
    """``earliest``, ``latest`` or {topic: last id already processed}."""
    ending: str | dict[str, int] = "latest"
    """Batch only: ``latest`` or {topic: last id to read}."""
    fail_on_data_loss: bool = True
    window: int = DEFAULT_WINDOW
    max_events_per_trigger: int | None = None
    ids_per_partition: int = DEFAULT_IDS_PER_PARTITION
    num_partitions: int | None = None
    """Read tasks per micro-batch (or batch read), its ids dealt evenly; None: per topic and idsPerPartition."""
    timeout: float = DEFAULT_TIMEOUT
    failover: tuple[tuple[str, int], ...] = ()
    """The other brokers of a replication group: the reader moves on to the one that is primary."""

    @property
    def address(self) -> str:
        return ", ".join(join_host_port(host, port) for host, port in ((self.host, self.port), *self.failover))

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> Options:
        """From Spark's options (names are case-insensitive); SourceError names the option that is wrong."""
        raw = {str(k).lower(): str(v) for k, v in options.items()}
        known = {
            "host", "port", "filter", "startingoffsets", "endingoffsets", "failondataloss", "window",
            "maxeventspertrigger", "idsperpartition", "numpartitions", "timeout", "failover", "path",
        }
        unknown = sorted(set(raw) - known)
        if unknown:
            raise SourceError(
                f"unknown option(s) {', '.join(unknown)} for the {FORMAT} source; it takes host, port, filter, "
                "startingOffsets, endingOffsets, failOnDataLoss, window, maxEventsPerTrigger, idsPerPartition, "
                "numPartitions, timeout, failover"
            )
        topic_filter = raw.get("filter", "").strip()
        if not topic_filter:
            raise SourceError(
                f"the {FORMAT} source needs the option 'filter': the topic filter of a stream configured in the "
                "broker's `streams` setting, e.g. .option('filter', 'telemetry/#')"
            )
        max_events = raw.get("maxeventspertrigger")
        num_partitions = raw.get("numpartitions")
        if num_partitions is not None and "idsperpartition" in raw:
            raise SourceError(
                "set one of the options numPartitions (read tasks per micro-batch) and idsPerPartition (ids per "
                "read task), not both"
            )
        return cls(
            host=_host_option(raw, "host"),
            port=_int_option(raw, "port", 1883, low=1, high=65535),
            filter=topic_filter,
            starting=_offsets_option(raw, "startingOffsets", ("earliest", "latest"), topic_filter),
            ending=_offsets_option(raw, "endingOffsets", ("latest",), topic_filter),
            fail_on_data_loss=_bool_option(raw, "failOnDataLoss", True),
            window=_int_option(raw, "window", DEFAULT_WINDOW, low=1, high=MAX_WINDOW),
            max_events_per_trigger=(
                None if max_events is None else _int_option(raw, "maxEventsPerTrigger", 0, low=1)
            ),
            ids_per_partition=_int_option(raw, "idsPerPartition", DEFAULT_IDS_PER_PARTITION, low=1),
            num_partitions=None if num_partitions is None else _int_option(raw, "numPartitions", 0, low=1),
            timeout=_float_option(raw, "timeout", DEFAULT_TIMEOUT),
            failover=_addresses_option(raw, "failover"),
        )


def _host_option(raw: dict[str, str], name: str) -> str:
    """A host name or an IP address without a port (durable_protocol.hostport.parse_host, as the
    SDK takes its ``host``): an IPv6 address bare or in brackets, kept without them (the read
    tasks connect to it as it is)."""
    text = raw.get(name.lower(), "127.0.0.1")
    try:
        return parse_host(text.strip())
    except ValueError as exc:
        raise SourceError(
            f"option {name} must be a host name or an IP address, without a port (that is the option port; an IPv6 "
            f"address bare or in brackets: ::1 or [::1]), got {text!r}: {exc}"
        ) from None


def _int_option(raw: dict[str, str], name: str, default: int, *, low: int, high: int | None = None) -> int:
    text = raw.get(name.lower())
    if text is None:
        return default
    bounds = f"from {low} to {high}" if high is not None else f"{low} or more"
    digits = text.strip().lstrip("+-")
    if len(digits) > int_digits() and digits.isdigit():  # counted before int() converts them
        raise SourceError(
            f"option {name} must be a whole number {bounds}, got one of {len(digits)} digits; "
            f"the limit is {int_digits()}"
        )
    try:
        value = int(text.strip())
    except ValueError:
        value = low - 1
    if value < low or (high is not None and value > high):
        raise SourceError(f"option {name} must be a whole number {bounds}, got {text!r}")
    return value


def _float_option(raw: dict[str, str], name: str, default: float) -> float:
    text = raw.get(name.lower())
    if text is None:
        return default
    try:
        value = float(text.strip())
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise SourceError(f"option {name} must be a number of seconds, more than 0, got {text!r}")
    return value


def _addresses_option(raw: dict[str, str], name: str) -> tuple[tuple[str, int], ...]:
    """``host:port,host:port``: the other brokers of a replication group (an IPv6 address in
    brackets, ``[::1]:1883``, which are taken off: durable_protocol.hostport), at most the SDK's
    MAX_FAILOVER of them."""
    text = raw.get(name.lower(), "").strip()
    addresses = []
    for entry in filter(None, (part.strip() for part in text.split(","))):
        try:
            addresses.append(split_host_port(entry))
        except ValueError as exc:
            raise SourceError(
                f"option {name} takes host:port entries separated by commas ({exc}), got {entry!r} in {text!r}"
            ) from None
    if len(addresses) > MAX_FAILOVER:  # the SDK's limit: its client would raise a bare ValueError
        raise SourceError(
            f"option {name} holds at most {MAX_FAILOVER} host:port entries (the group's other brokers), "
            f"got {len(addresses)}"
        )
    return tuple(addresses)


def _bool_option(raw: dict[str, str], name: str, default: bool) -> bool:
    text = raw.get(name.lower())
    if text is None:
        return default
    if text.strip().lower() in ("true", "false"):
        return text.strip().lower() == "true"
    raise SourceError(f"option {name} must be true or false, got {text!r}")


def _offsets_option(
    raw: dict[str, str], name: str, words: tuple[str, ...], topic_filter: str
) -> str | dict[str, int]:
    text = raw.get(name.lower(), words[0]).strip()
    if text.lower() in words:
        return text.lower()
    usage = f"option {name} must be {' or '.join(words)} or a JSON object {{topic: last id}}, got {text!r}"

    def parse_id(written: str) -> int:
        count = len(written.lstrip("-"))  # JSON writes no "+"
        if count > int_digits():  # counted before int() is asked to convert them
            raise SourceError(f"{usage}: an id of {count} digits; the limit is {int_digits()}")
        return int(written)

    try:
        value = json.loads(text, parse_int=parse_id)
    except ValueError:
        raise SourceError(usage) from None
    except RecursionError:
        raise SourceError(f"{usage}: JSON nested too deeply") from None
    if not isinstance(value, dict):
        raise SourceError(usage)
    for topic, last_id in value.items():
        if not isinstance(last_id, int) or isinstance(last_id, bool) or last_id < 0:
            raise SourceError(f"{usage}: the id of {topic!r} is not a whole number, 0 or more")
        if not topic or "+" in topic or "#" in topic or not topic_matches_sub(topic_filter, topic):
            raise SourceError(
                f"option {name} names {topic!r}, which is not a topic the filter {topic_filter!r} matches"
            )
    return dict(value)


# ================================================================ partitions
class IdRange(InputPartition):
    """One task's work: ids ``start + 1`` to ``end`` (inclusive) of one topic's log."""

    def __init__(self, topic: str, start: int, end: int) -> None:
        super().__init__((topic, start, end))
        self.topic = topic
        self.start = start
        self.end = end

    def __repr__(self) -> str:
        return f"IdRange({self.topic!r}, {self.start + 1}..{self.end})"


class RangeGroup(InputPartition):
    """One task's work with numPartitions: several ranges (of one topic or more), read one after the other."""

    def __init__(self, ranges: Sequence[IdRange]) -> None:
        super().__init__(tuple((r.topic, r.start, r.end) for r in ranges))
        self.ranges = list(ranges)

    def __repr__(self) -> str:
        return f"RangeGroup({', '.join(map(repr, self.ranges))})"


def plan(
    opts: Options, start: Mapping[str, int], end: Mapping[str, int], bounds: Mapping[str, tuple[int, int]]
) -> tuple[list[IdRange] | list[RangeGroup], dict[str, tuple[int, int]]]:
    """The ranges to read between two offsets, and the ids skipped per topic: {topic: (first, last)}.

    ``bounds`` is stream_info's {topic: (first retained, last)}: ids below ``first`` were trimmed,
    which is SourceError unless ``opts.fail_on_data_loss`` is off. Each topic's range is cut into
    pieces of at most ``opts.ids_per_partition`` ids, read in parallel; with ``opts.num_partitions``
    the ids of all topics, in topic order, are dealt instead into that many groups of equal size
    (one id more in the first ones; fewer groups when there are fewer ids).
    """
    ranges: list[IdRange] = []
    skipped: dict[str, tuple[int, int]] = {}
    for topic in sorted(end):
        if topic == STORE_KEY:
            continue
        low, high = start.get(topic, 0), end[topic]
        if high <= low:
            continue
        first = bounds.get(topic, (high + 1, high))[0]
        if low + 1 < first:
            missing_to = min(first - 1, high)
            if opts.fail_on_data_loss:
                raise SourceError(_data_loss_message(opts, topic, low + 1, missing_to, first))
            skipped[topic] = (low + 1, missing_to)
            low = missing_to
        if opts.num_partitions is not None:
            ranges.append(IdRange(topic, low, high))
            continue
        while low < high:
            piece = min(high, low + opts.ids_per_partition)
            ranges.append(IdRange(topic, low, piece))
            low = piece
    if opts.num_partitions is None:
        return ranges, skipped
    return _deal(ranges, opts.num_partitions), skipped


def _deal(ranges: list[IdRange], parts: int) -> list[RangeGroup]:
    """The ranges' ids, in order, cut into ``parts`` groups of equal size (a range may be cut between two)."""
    total = sum(r.end - r.start for r in ranges)
    parts = min(parts, total)
    groups: list[RangeGroup] = []
    todo = iter(ranges)
    current: IdRange | None = None
    for k in range(parts):
        want = total // parts + (1 if k < total % parts else 0)
        pieces: list[IdRange] = []
        while want:
            current = current or next(todo)
            take = min(want, current.end - current.start)
            pieces.append(IdRange(current.topic, current.start, current.start + take))
            want -= take
            rest = IdRange(current.topic, current.start + take, current.end)
            current = rest if rest.end > rest.start else None
        groups.append(RangeGroup(pieces))
    return groups


def _with_store(offsets: dict[str, int], bounds: Mapping[str, tuple[int, int]]) -> dict[str, int]:
    """Offsets carry the broker store's id: positions are only meaningful within one store."""
    store = getattr(bounds, "store", None)
    return offsets if store is None else {**offsets, STORE_KEY: int(store)}


def _data_loss_message(opts: Options, topic: str, first_missing: int, last_missing: int, log_first: int) -> str:
    count = last_missing - first_missing + 1
    return (
        f"stream {topic} at {opts.address}: ids {first_missing} to {last_missing} ({count} events) were trimmed by "
        f"the broker's retention before this query read them (the log now starts at id {log_first}). Set the "
        "option failOnDataLoss=false to skip them and go on, or give the stream more retention (max_count/max_age "
        "in the broker's `streams` setting)"
    )


def _log_skip(opts: Options, topic: str, first: int, last: int, total: int | None = None) -> None:
    log.warning(
        "%s source: stream %s at %s: skipped ids %d to %d (%d events), trimmed by the broker's retention before "
        "they were read (failOnDataLoss=false)%s",
        FORMAT, topic, opts.address, first, last, last - first + 1,
        "" if total is None else f"; {total} events skipped by this query so far",
    )


# ================================================================ broker link
def _client_id() -> str:
    """Unique per reader (the broker drops an older connection with the same id); 22 characters."""
    return "spark-" + uuid.uuid4().hex[:16]


def _unreachable(opts: Options, why: object) -> str:
    return (
        f"cannot reach the amqtt-durable broker at {opts.address} within {opts.timeout:g} s: start the broker "
        f"(amqtt-durable broker -c broker.yaml), or set the options host and port to where it listens [{why}]"
    )


class BrokerLink:
    """A stateless DurableClient for planning and reading, each wait bounded by ``opts.timeout``.

    It reconnects by itself; ``stream_info`` waits (within the timeout) for a connection that
    is being repaired instead of failing at the first broker restart.
    """

    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self._changed = threading.Condition()
        self.client = DurableClient(
            _client_id(),
            opts.host,
            opts.port,
            durable_session=False,
            failover=opts.failover,
            reconnect_max_delay=RECONNECT_MAX_DELAY,
            on_connected=lambda _info: self._notify(),
        )
        try:
            self.client.connect(timeout=opts.timeout)
        except ConnectFailed as exc:
            self.client.close(timeout=1.0)
            raise SourceError(_unreachable(opts, exc)) from None

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def wait_connected(self, deadline: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: self.client.connected, max(0.0, deadline - time.monotonic()))

    def stream_info(self, topic_filter: str) -> dict[str, tuple[int, int]]:
        """{topic: (first retained id, last id)}; SourceError when the broker stays away for ``timeout``."""
        deadline = time.monotonic() + self.opts.timeout
        while True:
            try:
                return self.client.stream_info(topic_filter, timeout=max(0.1, deadline - time.monotonic()))
            except ControlRequestFailed as exc:
                if exc.code == "unknown_stream":
                    raise SourceError(
                        f"no stream log covers the filter {topic_filter!r} at {self.opts.address}: name it (or a "
                        "filter covering it) in the broker's `streams` setting, or set the option filter to a "
                        "configured stream"
                    ) from None
                raise SourceError(
                    f"the broker at {self.opts.address} refused stream_info({topic_filter!r}): {exc}"
                ) from None
            except (Unconnected, RequestTimeout) as exc:
                if time.monotonic() >= deadline or not self.wait_connected(deadline):
                    raise SourceError(_unreachable(self.opts, exc)) from None

    def close(self) -> None:
        self.client.close(timeout=5.0)  # a stateless client has no session to end: this does not raise


def _open_checked(opts: Options) -> tuple[BrokerLink, dict[str, tuple[int, int]]]:
    """Connect, check the filter names a stream, and return the logs' bounds now."""
    link = BrokerLink(opts)
    try:
        bounds = link.stream_info(opts.filter)
    except BaseException:
        link.close()
        raise
    return link, bounds


def _start_offsets(opts: Options, bounds: Mapping[str, tuple[int, int]]) -> dict[str, int]:
    """startingOffsets resolved: ``earliest`` = before each log's first retained id; listed topics as given."""
    if opts.starting == "latest":
        return {topic: last for topic, (_first, last) in sorted(bounds.items())}
    offsets = {topic: first - 1 for topic, (first, _last) in bounds.items()}
    if isinstance(opts.starting, dict):
        offsets.update(opts.starting)
    return dict(sorted(offsets.items()))


def _check_schema(schema: StructType) -> None:
    if schema != _schema():
        raise SourceError(
            f"the {FORMAT} source has the fixed schema `{SCHEMA_DDL}`; drop .schema(...) from the read, got {schema}"
        )


# ================================================================ data source
class AmqttDurableDataSource(DataSource):
    """``spark.read`` / ``spark.readStream`` ``.format("amqtt-durable")``: the broker's stream logs.

    Options: ``filter`` (required: the topic filter of a configured stream), ``host``
    (127.0.0.1), ``port`` (1883), ``startingOffsets`` (``earliest`` | ``latest`` | JSON
    {topic: last id already processed}; topics not listed start at their log's first
    retained id, topics appearing later at id 1), ``endingOffsets`` (batch: ``latest`` | JSON
    {topic: last id}, then only the topics listed are read), ``failOnDataLoss`` (true),
    ``window`` (events in flight per topic, 1000), ``maxEventsPerTrigger`` (no cap),
    ``idsPerPartition`` (100000), ``numPartitions`` (read tasks per micro-batch; by default one per topic and
    per idsPerPartition ids), ``timeout`` (seconds for broker waits, 30), ``failover``
    (``host:port,...``: the other brokers of a replication group).
    """

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> str:
        return SCHEMA_DDL

    def reader(self, schema: StructType) -> AmqttDurableReader:
        _check_schema(schema)
        return AmqttDurableReader(Options.parse(self.options))

    def streamReader(self, schema: StructType) -> AmqttDurableStreamReader:  # noqa: N802 - Spark's name
        _check_schema(schema)
        if any(str(key).lower() == "endingoffsets" for key in self.options):
            raise SourceError(
                f"endingOffsets is for batch reads (spark.read); a streaming {FORMAT} query reads until stopped"
            )
        return AmqttDurableStreamReader(Options.parse(self.options))


class AmqttDurableReader(DataSourceReader):
    """Batch: the ranges between startingOffsets and endingOffsets, planned once."""

    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.skipped: dict[str, int] = {}
        """Ids skipped per topic by the last partitions() (trimmed, with failOnDataLoss=false)."""

    def partitions(self) -> Sequence[InputPartition]:
        opts = self.opts
        link, bounds = _open_checked(opts)
        link.close()
        start = _start_offsets(opts, bounds)
        if isinstance(opts.ending, dict):
            end = dict(opts.ending)
            for topic, last_id in sorted(end.items()):
                log_last = bounds.get(topic, (1, 0))[1]
                if last_id > log_last:
                    raise SourceError(
                        f"endingOffsets asks for {topic} up to id {last_id}, but its log at {opts.address} ends at "
                        f"id {log_last}: lower it, or use endingOffsets=latest"
                    )
                if last_id < start.get(topic, 0):
                    raise SourceError(
                        f"endingOffsets for {topic} ({last_id}) is below its startingOffsets ({start[topic]})"
                    )
        else:
            end = {topic: max(last, start.get(topic, 0)) for topic, (_first, last) in bounds.items()}
        ranges, skipped = plan(opts, start, end, bounds)
        self.skipped = {topic: last - first + 1 for topic, (first, last) in skipped.items()}
        for topic, (first, last) in skipped.items():
            _log_skip(opts, topic, first, last)
        return ranges

    def read(self, partition: InputPartition) -> Iterator[Any]:
        return read_range(self.opts, partition)


class AmqttDurableStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Micro-batches: from the last offset to what the broker's logs hold now (capped by maxEventsPerTrigger).

    Lives in the driver's Python planner for the whole query and keeps one stateless
    connection for stream_info, so an idle query polling for data opens no new connection
    per poll; the copy pickled for ``read`` never connects (see ``__getstate__``).
    """

    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.skipped_total = 0
        """Ids skipped by this query run so far (trimmed, with failOnDataLoss=false)."""
        self._link: BrokerLink | None = None
        self._target: dict[str, int] | None = None
        self._ahead_warned: set[str] = set()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_link"] = None
        return state

    def _bounds(self) -> dict[str, tuple[int, int]]:
        if self._link is None:
            self._link, bounds = _open_checked(self.opts)
            return bounds
        return self._link.stream_info(self.opts.filter)

    def initialOffset(self) -> dict[str, int]:  # noqa: N802 - Spark's name
        bounds = self._bounds()
        return _with_store(_start_offsets(self.opts, bounds), bounds)

    def getDefaultReadLimit(self) -> ReadLimit:  # noqa: N802 - Spark's name
        if self.opts.max_events_per_trigger is None:
            return ReadAllAvailable()
        return ReadMaxRows(self.opts.max_events_per_trigger)

    def prepareForTriggerAvailableNow(self) -> None:  # noqa: N802 - Spark's name
        self._target = {topic: last for topic, (_first, last) in self._bounds().items()}

    def latestOffset(self, start: dict[str, int], limit: ReadLimit) -> dict[str, int]:  # noqa: N802 - Spark's name
        bounds = self._bounds()
        start = self._same_store(start, bounds)
        end = _with_store(dict(start), bounds)
        backlog: dict[str, tuple[int, int]] = {}  # topic -> (readable from after this id, up to this id)
        for topic, (first, last) in bounds.items():
            if self._target is not None:
                last = min(last, self._target.get(topic, 0))  # noqa: PLW2901 - capped for availableNow
            position = start.get(topic, 0)
            if last > position:
                backlog[topic] = (max(position, first - 1), last)
            elif last < position and topic not in self._ahead_warned and self._target is None:
                self._ahead_warned.add(topic)
                log.warning(
                    "%s source: stream %s at %s ends at id %d, before this query's offset %d (was the broker's "
                    "store wiped or replaced?): nothing is read from it until its log passes that offset",
                    FORMAT, topic, self.opts.address, last, position,
                )
        budget = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        # The smallest backlogs first, each taking at most an even share of what is left: a busy
        # topic cannot starve the others, and the whole budget is used when there is that much.
        for left, topic in enumerate(sorted(backlog, key=lambda t: (backlog[t][1] - backlog[t][0], t))):
            low, high = backlog[topic]
            if budget is None:
                end[topic] = high
                continue
            take = min(high - low, -(-budget // (len(backlog) - left)))
            if take > 0:
                end[topic] = low + take
                budget -= take
        return dict(sorted(end.items()))

    def _same_store(self, start: dict[str, int], bounds: Mapping[str, tuple[int, int]]) -> dict[str, int]:
        """The offset's positions, or none when the broker's store changed since (ids restart there)."""
        before, now = start.get(STORE_KEY), getattr(bounds, "store", None)
        if before is None or now is None or before == now:
            return start
        if self.opts.fail_on_data_loss:
            raise SourceError(
                f"the broker at {self.opts.address} has another store than when this query's offsets were taken "
                f"(store id {now}, was {before}): it was wiped or replaced, so events of the old store not yet read "
                "are lost and the new store's ids start again. Set failOnDataLoss=false to read the new store from "
                "its first events, or start the query with a new checkpoint"
            )
        log.warning(
            "%s source: the broker at %s has another store (id %d, was %d): reading the new store's logs from "
            "their first retained events; what the old store held and this query had not read is lost",
            FORMAT, self.opts.address, now, before,
        )
        return {STORE_KEY: before}

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> Sequence[InputPartition]:
        if start.get(STORE_KEY) != end.get(STORE_KEY):
            start = {}  # the store changed (failOnDataLoss=false): the new store's logs from their start
        if all(end[topic] <= start.get(topic, 0) for topic in end if topic != STORE_KEY):
            return []
        ranges, skipped = plan(self.opts, start, end, self._bounds())
        for topic, (first, last) in skipped.items():
            self.skipped_total += last - first + 1
            _log_skip(self.opts, topic, first, last, self.skipped_total)
        return ranges

    def read(self, partition: InputPartition) -> Iterator[Any]:
        return read_range(self.opts, partition)

    def commit(self, end: dict[str, int]) -> None:
        """Nothing to tell the broker: it keeps no position for stateless readers."""

    def stop(self) -> None:
        if self._link is not None:
            self._link.close()
            self._link = None


# ================================================================ executor side
def read_range(opts: Options, partition: InputPartition) -> Iterator[Any]:
    """Arrow batches of exactly the ids ``start + 1`` to ``end`` of the partition's topic, in order (a RangeGroup: its
    ranges one after the other)."""
    if isinstance(partition, RangeGroup):
        return (batch for part in partition.ranges for batch in _RangeReader(opts, part).batches())
    if not isinstance(partition, IdRange):
        if partition.value is None:  # Spark's stand-in when partitions() planned nothing
            return iter(())
        raise SourceError(f"the {FORMAT} source cannot read the partition {partition!r}")
    return _RangeReader(opts, partition).batches()


class _RangeReader:
    """One partition: a bulk reader (durable_pipeline.bulk: a raw connection, no SDK client, no thread)
    over the range, its columns turned into Arrow batches of at most ROWS_PER_BATCH rows.

    The broker's window bounds what is in flight; the reader acknowledges (one cumulative
    stream_ack per socket read) before it hands a batch to Spark, so the broker refills the
    window while Spark takes the batch.
    """

    def __init__(self, opts: Options, part: IdRange) -> None:
        self.opts = opts
        self.part = part
        self.skipped = 0
        self._window = min(opts.window, part.end - part.start, MAX_WINDOW)

    def batches(self) -> Iterator[Any]:
        import pyarrow as pa  # noqa: PLC0415 - executors only
        from pyspark.sql.pandas.types import to_arrow_schema  # noqa: PLC0415

        arrow_schema = to_arrow_schema(_schema(), timezone="UTC")
        opts, part = self.opts, self.part
        reader = BulkRangeReader(
            [(opts.host, opts.port), *opts.failover], part.topic, part.start + 1, part.end,
            window=self._window, timeout=opts.timeout, client_id=_client_id(), on_lost=self._lost,
            describe=opts.address, reconnect_max_delay=RECONNECT_MAX_DELAY,
        )
        for cols in reader.batches(ROWS_PER_BATCH, STALL_CHECK):
            yield arrow_batch(pa, arrow_schema, part.topic, cols)

    def _lost(self, first_missing: int, last_missing: int, log_first: int) -> int:
        """Trimmed ids: SourceError, or (failOnDataLoss=false) counted; returns the next id to expect."""
        if self.opts.fail_on_data_loss:
            raise SourceError(_data_loss_message(self.opts, self.part.topic, first_missing, last_missing, log_first))
        self.skipped += last_missing - first_missing + 1
        _log_skip(self.opts, self.part.topic, first_missing, last_missing)
        return last_missing + 1
