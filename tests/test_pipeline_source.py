"""The ``amqtt-durable`` Spark data source against real brokers: batch ranges, streaming into
Parquet with a checkpoint (query restart, broker SIGKILL), trimmed offsets, errors, partitioning.

Spark tests share the session-wide ``spark`` fixture (one local[2] SparkSession). Reader
methods are also called directly (no Spark): planning and ``read_range`` are plain Python.
"""

from __future__ import annotations

import logging
import shutil
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql.streaming.datasource import ReadAllAvailable

from conftest import SPARK_TIMEOUT, Broker, Client, free_port
from durable_pipeline.errors import SourceError
from durable_pipeline.source import (
    STORE_KEY,
    AmqttDurableDataSource,
    BrokerLink,
    IdRange,
    Options,
    RangeGroup,
    _schema,
    read_range,
)

pytestmark = pytest.mark.slow  # Spark: a JVM and Python workers, seconds per test

FILTER = "telemetry/#"
QUERY_WAIT = 60.0
"""awaitTermination bound for a query that must stop on its own (an error)."""


def test_spark_tests_have_room_for_the_jvm_start(request: pytest.FixtureRequest) -> None:
    """Every collected test using the ``spark`` fixture has at least SPARK_TIMEOUT, not the suite's 120 s
    (the first one in a worker also starts the JVM), or a timeout of its own that leaves the set-up out."""
    spark_tests = [item for item in request.session.items if "spark" in getattr(item, "fixturenames", ())]
    if not spark_tests:
        pytest.skip("no test using the spark fixture is selected")
    for item in spark_tests:
        marker = item.get_closest_marker("timeout")
        assert marker is not None, item.nodeid
        assert marker.kwargs.get("func_only") or marker.args[0] >= SPARK_TIMEOUT, item.nodeid


def test_spark_tests_come_first_so_one_worker_starts_a_jvm_for_them(request: pytest.FixtureRequest) -> None:
    """conftest.pytest_collection_modifyitems: every collected test using the ``spark`` fixture comes before every
    other, in the order collected (xdist's worksteal then leaves them with the worker the collection's start went
    to)."""
    items = request.session.items
    uses_spark = ["spark" in getattr(item, "fixturenames", ()) for item in items]
    if not any(uses_spark):
        pytest.skip("no test using the spark fixture is selected")
    first_other = uses_spark.index(False) if False in uses_spark else len(items)
    assert all(uses_spark[:first_other]) and not any(uses_spark[first_other:]), [
        item.nodeid for item, spark in zip(items[first_other:], uses_spark[first_other:], strict=True) if spark
    ]


def streams(max_count: int = 100_000) -> list[dict[str, Any]]:
    return [{"filter": FILTER, "max_count": max_count}]


def options(port: int, **extra: Any) -> dict[str, str]:
    return {"port": str(port), "filter": FILTER, **{k: str(v) for k, v in extra.items()}}


def publish(client: Client, topic: str, first: int, last: int) -> None:
    """Payloads name their topic and id: ``telemetry/a:7`` is the 7th event published to telemetry/a."""
    client.publish(topic, [f"{topic}:{i}".encode() for i in range(first, last + 1)])


def read_direct(opts: dict[str, str], topic: str, start: int, end: int) -> list[dict[str, Any]]:
    """read(partition) as an executor runs it, in this process."""
    rows: list[dict[str, Any]] = []
    for batch in read_range(Options.parse(opts), IdRange(topic, start, end)):
        rows.extend(batch.to_pylist())
    return rows


def batch_df(spark: Any, opts: dict[str, str]) -> Any:
    reader = spark.read.format("amqtt-durable")
    for key, value in opts.items():
        reader = reader.option(key, value)
    return reader.load()


class Streaming:
    """A streaming query from the source into Parquet, with a checkpoint, restartable."""

    def __init__(self, spark: Any, folder: Path, opts: dict[str, str]) -> None:
        self.spark = spark
        self.out = folder / "events"
        self.checkpoint = folder / "checkpoint"
        self.opts = opts
        self.query: Any = None

    def start(self) -> Any:
        reader = self.spark.readStream.format("amqtt-durable")
        for key, value in self.opts.items():
            reader = reader.option(key, value)
        self.query = (
            reader.load()
            .writeStream.format("parquet")
            .option("path", str(self.out))
            .option("checkpointLocation", str(self.checkpoint))
            .start()
        )
        return self.query

    def stop(self) -> None:
        if self.query is not None:
            self.query.stop()

    def written(self) -> Counter[tuple[str, int]]:
        """(topic, id) -> how many times it landed in the sink, each payload checked against its id."""
        rows = self.spark.read.parquet(str(self.out)).select("topic", "id", "payload").collect()
        for row in rows:
            assert bytes(row.payload) == f"{row.topic}:{row.id}".encode()
        return Counter((row.topic, row.id) for row in rows)


def expected(**ranges: tuple[int, int]) -> Counter[tuple[str, int]]:
    """expected(a=(1, 5)) -> each of telemetry/a ids 1..5 once."""
    return Counter((f"telemetry/{t}", i) for t, (low, high) in ranges.items() for i in range(low, high + 1))


@pytest.fixture
def stream_broker(broker_factory: Callable[..., Broker]) -> Broker:
    return broker_factory(streams=streams())


@pytest.fixture
def publisher(stream_broker: Broker, clients: Callable[..., Client]) -> Client:
    return clients(stream_broker.port, "publisher", clean_session=True)


@pytest.fixture
def streaming(spark: Any, tmp_path: Path) -> Iterator[Callable[[dict[str, str]], Streaming]]:
    made: list[Streaming] = []

    def make(opts: dict[str, str]) -> Streaming:
        made.append(Streaming(spark, tmp_path, opts))
        return made[-1]

    yield make
    for query in made:
        query.stop()


# ----------------------------------------------------------------- batch
def test_batch_reads_exactly_the_id_range(spark: Any, stream_broker: Broker, publisher: Client) -> None:
    publish(publisher, "telemetry/a", 1, 30)
    publish(publisher, "telemetry/b", 1, 5)
    df = batch_df(
        spark,
        options(stream_broker.port, startingOffsets='{"telemetry/a": 10}', endingOffsets='{"telemetry/a": 20}'),
    )
    assert df.schema == _schema()
    rows = df.orderBy("id").collect()
    assert [(r.topic, r.id, bytes(r.payload)) for r in rows] == [
        ("telemetry/a", i, f"telemetry/a:{i}".encode()) for i in range(11, 21)
    ]
    assert {r.qos for r in rows} == {1}, "the publish QoS, carried in the stream frame's flags"
    assert all(r.published_at is not None for r in rows)
    assert rows == sorted(rows, key=lambda r: r.published_at)


def test_two_topics_are_read_in_parallel_partitions(spark: Any, stream_broker: Broker, publisher: Client) -> None:
    publish(publisher, "telemetry/a", 1, 25)
    publish(publisher, "telemetry/b", 1, 5)
    opts = options(stream_broker.port, idsPerPartition=10)
    planned = AmqttDurableDataSource(opts).reader(_schema()).partitions()
    assert [(p.topic, p.start, p.end) for p in planned] == [
        ("telemetry/a", 0, 10), ("telemetry/a", 10, 20), ("telemetry/a", 20, 25), ("telemetry/b", 0, 5),
    ]
    df = batch_df(spark, opts)
    assert df.rdd.getNumPartitions() == 4
    rows = df.collect()
    assert Counter((r.topic, r.id) for r in rows) == expected(a=(1, 25), b=(1, 5))
    assert batch_df(spark, {**opts, "startingOffsets": "latest"}).count() == 0  # nothing planned


def test_num_partitions_deals_the_ids_into_that_many_tasks(
    spark: Any, stream_broker: Broker, publisher: Client
) -> None:
    publish(publisher, "telemetry/a", 1, 25)
    publish(publisher, "telemetry/b", 1, 5)

    def planned(**extra: Any) -> list[list[tuple[str, int, int]]]:
        parts = AmqttDurableDataSource(options(stream_broker.port, **extra)).reader(_schema()).partitions()
        assert all(isinstance(p, RangeGroup) for p in parts)
        return [[(r.topic, r.start, r.end) for r in p.ranges] for p in parts]  # type: ignore[attr-defined]

    assert planned(numPartitions=2) == [
        [("telemetry/a", 0, 15)], [("telemetry/a", 15, 25), ("telemetry/b", 0, 5)],
    ]
    assert planned(numPartitions=1) == [[("telemetry/a", 0, 25), ("telemetry/b", 0, 5)]]
    assert planned(numPartitions=4) == [
        [("telemetry/a", 0, 8)], [("telemetry/a", 8, 16)], [("telemetry/a", 16, 23)],
        [("telemetry/a", 23, 25), ("telemetry/b", 0, 5)],
    ]
    assert len(planned(numPartitions=100)) == 30  # never an empty task
    assert planned(numPartitions=3, startingOffsets='{"telemetry/a": 20}') == [
        [("telemetry/a", 20, 24)], [("telemetry/a", 24, 25), ("telemetry/b", 0, 2)], [("telemetry/b", 2, 5)],
    ]
    for parts in (1, 2, 4):
        df = batch_df(spark, options(stream_broker.port, numPartitions=parts))
        assert df.rdd.getNumPartitions() == parts
        assert Counter((r.topic, r.id) for r in df.collect()) == expected(a=(1, 25), b=(1, 5))


def test_a_task_of_several_ranges_reads_on_across_a_broker_sigkill(
    stream_broker: Broker, publisher: Client, caplog: pytest.LogCaptureFixture
) -> None:
    """read(partition) of a RangeGroup in this process: the broker killed and restarted in its first range."""
    publish(publisher, "telemetry/a", 1, 100)
    publish(publisher, "telemetry/b", 1, 60)
    group = RangeGroup([IdRange("telemetry/a", 10, 100), IdRange("telemetry/b", 0, 60)])
    batches = read_range(Options.parse(options(stream_broker.port, window=10)), group)
    seen = [(row["topic"], row["id"]) for row in next(batches).to_pylist()]
    assert len(seen) <= 10
    with caplog.at_level(logging.INFO, logger="durable_pipeline"):
        stream_broker.kill()
        stream_broker.start()
        for batch in batches:
            seen.extend((row["topic"], row["id"]) for row in batch.to_pylist())
    assert seen == [("telemetry/a", i) for i in range(11, 101)] + [("telemetry/b", i) for i in range(1, 61)]
    assert "reconnected to 127.0.0.1" in caplog.text


# ------------------------------------------------------------- streaming
@pytest.mark.parametrize("split", [{"idsPerPartition": 15}, {"numPartitions": 2}])
def test_streaming_into_parquet_is_exactly_once_across_a_query_restart(
    stream_broker: Broker, publisher: Client, streaming: Callable[[dict[str, str]], Streaming],
    split: dict[str, int],
) -> None:
    publish(publisher, "telemetry/a", 1, 40)
    publish(publisher, "telemetry/b", 1, 10)
    job = streaming(options(stream_broker.port, maxEventsPerTrigger=25, **split))
    job.start().processAllAvailable()
    assert job.written() == expected(a=(1, 40), b=(1, 10))
    job.stop()
    publish(publisher, "telemetry/a", 41, 60)
    publish(publisher, "telemetry/c", 1, 7)  # a topic that appears while the query is stopped
    job.start().processAllAvailable()
    publish(publisher, "telemetry/b", 11, 15)
    job.query.processAllAvailable()
    assert job.written() == expected(a=(1, 60), b=(1, 15), c=(1, 7))


def test_reader_resumes_across_a_broker_sigkill(
    stream_broker: Broker, publisher: Client, caplog: pytest.LogCaptureFixture
) -> None:
    """read(partition) in this process: half the range read, the broker killed and restarted, the rest."""
    publish(publisher, "telemetry/a", 1, 200)
    batches = read_range(Options.parse(options(stream_broker.port, window=10)), IdRange("telemetry/a", 0, 200))
    seen = [row["id"] for row in next(batches).to_pylist()]
    assert len(seen) <= 10  # the window: the rest is still on the broker
    with caplog.at_level(logging.INFO, logger="durable_pipeline"):  # before the kill: it may reconnect at once
        stream_broker.kill()
        stream_broker.start()
        for batch in batches:
            seen.extend(row["id"] for row in batch.to_pylist())
    assert seen == list(range(1, 201))
    assert "reconnected to 127.0.0.1" in caplog.text


@pytest.mark.parametrize("split", [{}, {"numPartitions": 1}])
def test_streaming_is_exactly_once_across_a_broker_sigkill(
    spark: Any, stream_broker: Broker, clients: Callable[..., Client],
    streaming: Callable[[dict[str, str]], Streaming], split: dict[str, int],
) -> None:
    from pyspark.sql.streaming import StreamingQueryListener  # noqa: PLC0415 - Spark tests only

    progressed = threading.Event()

    class Progress(StreamingQueryListener):  # type: ignore[misc]
        def onQueryStarted(self, event: Any) -> None:  # noqa: N802 - Spark's name
            pass

        def onQueryProgress(self, event: Any) -> None:  # noqa: N802
            if event.progress.numInputRows > 0:
                progressed.set()

        def onQueryIdle(self, event: Any) -> None:  # noqa: N802
            pass

        def onQueryTerminated(self, event: Any) -> None:  # noqa: N802
            pass

    publisher = clients(stream_broker.port, "publisher", clean_session=True)
    publish(publisher, "telemetry/a", 1, 600)
    publish(publisher, "telemetry/b", 1, 300)
    listener = Progress()
    spark.streams.addListener(listener)
    try:
        # 300 a trigger: the kill still falls mid-query (after the first batch with rows, 600 events to go), in 4
        # micro-batches instead of 10 (each costs a plan, a Parquet commit and a checkpoint)
        job = streaming(options(stream_broker.port, maxEventsPerTrigger=300, window=20, timeout=20, **split))
        job.start()
        assert progressed.wait(QUERY_WAIT), "no micro-batch with rows"
        stream_broker.kill()  # mid-query: between or during micro-batches
        stream_broker.start()
        publisher = clients(stream_broker.port, "publisher-2", clean_session=True)
        publish(publisher, "telemetry/a", 601, 650)
        job.query.processAllAvailable()
        assert job.query.exception() is None
        assert job.written() == expected(a=(1, 650), b=(1, 300))
    finally:
        spark.streams.removeListener(listener)


# -------------------------------------------------------- trimmed offsets
def test_trimmed_offsets_fail_by_default_and_are_skipped_and_counted_on_request(
    spark: Any, broker_factory: Callable[..., Broker], clients: Callable[..., Client],
    caplog: pytest.LogCaptureFixture,
) -> None:
    broker = broker_factory(streams=streams(max_count=5))
    publish(clients(broker.port, "publisher", clean_session=True), "telemetry/a", 1, 20)  # the log keeps 16..20
    start = '{"telemetry/a": 3}'
    with pytest.raises(Exception, match=r"telemetry/a .*ids 4 to 15 \(12 events\).*failOnDataLoss=false"):
        batch_df(spark, options(broker.port, startingOffsets=start)).collect()
    lenient = options(broker.port, startingOffsets=start, failOnDataLoss="false")
    rows = batch_df(spark, lenient).orderBy("id").collect()
    assert [r.id for r in rows] == [16, 17, 18, 19, 20]
    # The count, as the driver logs it (a Spark job logs it from its planner process).
    reader = AmqttDurableDataSource(lenient).reader(_schema())
    with caplog.at_level(logging.WARNING, logger="durable_pipeline"):
        reader.partitions()
    assert reader.skipped == {"telemetry/a": 12}
    assert "stream telemetry/a at" in caplog.text and "skipped ids 4 to 15 (12 events)" in caplog.text
    # An executor that finds its range trimmed after planning does the same.
    with pytest.raises(SourceError, match="ids 4 to 15"):
        read_direct(options(broker.port), "telemetry/a", 3, 18)
    assert [r["id"] for r in read_direct(lenient, "telemetry/a", 3, 18)] == [16, 17, 18]


def test_streaming_skips_trimmed_ids_when_told(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client],
    streaming: Callable[[dict[str, str]], Streaming],
) -> None:
    broker = broker_factory(streams=streams(max_count=5))
    publish(clients(broker.port, "publisher", clean_session=True), "telemetry/a", 1, 20)
    job = streaming(options(broker.port, startingOffsets='{"telemetry/a": 3}', failOnDataLoss="false"))
    job.start().processAllAvailable()
    assert job.written() == expected(a=(16, 20))
    reader = AmqttDurableDataSource(options(broker.port, failOnDataLoss="false")).streamReader(_schema())
    try:
        assert reader.partitions({"telemetry/a": 3}, {"telemetry/a": 20})[0].start == 15
        assert reader.skipped_total == 12
    finally:
        reader.stop()


# ------------------------------------------------------------------ errors
def test_unknown_stream_is_named(stream_broker: Broker) -> None:
    opts = {**options(stream_broker.port), "filter": "nope/#"}
    with pytest.raises(SourceError, match=r"no stream log covers the filter 'nope/#'.*`streams` setting"):
        AmqttDurableDataSource(opts).reader(_schema()).partitions()
    reader = AmqttDurableDataSource(opts).streamReader(_schema())
    with pytest.raises(SourceError, match="'nope/#'"):
        reader.initialOffset()
    reader.stop()


def test_unreachable_broker_is_named() -> None:
    port = free_port()
    opts = options(port, timeout=1)
    with pytest.raises(SourceError, match=rf"127\.0\.0\.1:{port}.*start the broker"):
        AmqttDurableDataSource(opts).reader(_schema()).partitions()


def test_options_are_checked() -> None:
    with pytest.raises(SourceError, match="needs the option 'filter'"):
        Options.parse({})
    with pytest.raises(SourceError, match="unknown option"):
        Options.parse({"filter": FILTER, "startingOffset": "latest"})
    with pytest.raises(SourceError, match="startingOffsets must be"):
        Options.parse({"filter": FILTER, "startingOffsets": "[1]"})
    with pytest.raises(SourceError, match="not a topic the filter"):
        Options.parse({"filter": FILTER, "startingOffsets": '{"other/a": 1}'})
    with pytest.raises(SourceError, match="window must be a whole number from 1 to 1000"):
        Options.parse({"filter": FILTER, "window": "0"})
    with pytest.raises(SourceError, match="failOnDataLoss must be true or false"):
        Options.parse({"filter": FILTER, "failOnDataLoss": "yes"})
    with pytest.raises(SourceError, match="numPartitions must be a whole number 1 or more"):
        Options.parse({"filter": FILTER, "numPartitions": "0"})
    with pytest.raises(SourceError, match=r"set one of the options numPartitions .* and idsPerPartition"):
        Options.parse({"filter": FILTER, "numPartitions": "2", "idsPerPartition": "10"})
    assert Options.parse({"filter": FILTER, "numpartitions": "3"}).num_partitions == 3
    parsed = Options.parse({"FILTER": FILTER, "startingoffsets": '{"telemetry/a": 4}', "maxEventsPerTrigger": "9"})
    assert (parsed.starting, parsed.max_events_per_trigger, parsed.ending) == ({"telemetry/a": 4}, 9, "latest")


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("port", "abc"), ("port", "0"), ("port", "65536"), ("window", "1001"), ("window", "many"),
        ("timeout", "0"), ("timeout", "-1"), ("timeout", "soon"), ("idsPerPartition", "0"), ("idsPerPartition", "ten"),
        ("maxEventsPerTrigger", "0"), ("maxEventsPerTrigger", "x"), ("startingOffsets", "newest"),
        ("startingOffsets", "{not json"), ("endingOffsets", "earliest"), ("endingOffsets", "[1, 2]"),
    ],
)
def test_a_bad_value_of_an_option_is_a_source_error_naming_the_option(option: str, value: str) -> None:
    """pipeline.md, Options: a bad value "is a `SourceError` naming the option" (through Spark: test_blind_pipeline)."""
    with pytest.raises(SourceError) as raised:
        Options.parse({"filter": FILTER, option: value})
    assert str(raised.value).startswith(f"option {option} must be "), raised.value
    assert repr(value) in str(raised.value), "the value given is shown"


def test_the_failover_option_takes_ipv6_addresses_in_brackets() -> None:
    """``failover`` is host:port as the replication settings write it (one parser): the brackets of
    ``[::1]:1883`` were kept in the host, which then could not be resolved. The addresses are
    shown as they are written (one writer, durable_protocol.hostport.join_host_port)."""
    parsed = Options.parse({"filter": FILTER, "failover": "[::1]:1883, h2:1884, [2001:db8::10]:1885"})
    assert parsed.failover == (("::1", 1883), ("h2", 1884), ("2001:db8::10", 1885))
    # and shown with them in the source's messages (before: "::1:1883", the port not told apart)
    assert parsed.address == "127.0.0.1:1883, [::1]:1883, h2:1884, [2001:db8::10]:1885", parsed.address
    for bad in ("::1:1883", "[::1:1883", "h2:0", "h2:65536"):
        with pytest.raises(SourceError, match="option failover takes host:port entries"):
            Options.parse({"filter": FILTER, "failover": f"h1:1883,{bad}"})


def test_the_failover_option_holds_at_most_the_sdks_limit() -> None:
    """pipeline.md: ``failover`` holds at most 1000 addresses (the SDK's limit). Before, 1001 were
    parsed and the driver's client then raised the SDK's bare ValueError, not a SourceError."""
    entries = [f"h{n}:1883" for n in range(1001)]
    assert len(Options.parse({"filter": FILTER, "failover": ",".join(entries[:1000])}).failover) == 1000
    with pytest.raises(SourceError, match=r"^option failover holds at most 1000 host:port entries.*got 1001$"):
        Options.parse({"filter": FILTER, "failover": ",".join(entries)})


@pytest.mark.parametrize("bad", ["localhost:1883", "[127.0.0.1]", "my host", ""])
def test_a_bad_host_option_is_a_source_error_naming_it(bad: str) -> None:
    """pipeline.md: a bad option is a SourceError naming it. ``host`` is checked as the SDK checks its
    own (durable_protocol.hostport.parse_host); before, it surfaced as the SDK's bare ValueError."""
    with pytest.raises(SourceError, match=r"^option host must be a host name or an IP address"):
        BrokerLink(Options.parse({"host": bad, "port": "1", "filter": "a/#", "timeout": "0.5"}))


def test_an_ipv6_host_in_brackets_is_kept_without_them_for_the_read_tasks() -> None:
    """The read tasks (bulk.py) connect to ``opts.host`` as it is: ``[::1]`` must reach them as ``::1``
    (before, the driver's SDK took the brackets off but socket.create_connection(("[::1]", port)) failed)."""
    assert Options.parse({"filter": FILTER, "host": "[::1]"}).host == "::1"
    assert Options.parse({"filter": FILTER, "host": " ::1 "}).host == "::1"
    assert Options.parse({"filter": FILTER}).host == "127.0.0.1"


def test_errors_reach_the_spark_user(spark: Any, stream_broker: Broker, streaming: Callable[..., Streaming]) -> None:
    with pytest.raises(Exception, match="no stream log covers the filter 'nope/#'"):
        batch_df(spark, {**options(stream_broker.port), "filter": "nope/#"}).collect()
    port = free_port()
    job = streaming(options(port, timeout=1))
    job.start()
    with pytest.raises(Exception, match=rf"127\.0\.0\.1:{port}.*start the broker"):
        job.query.awaitTermination(QUERY_WAIT)
    assert not job.query.isActive


# ----------------------------------------------------------- planning
def test_max_events_per_trigger_shares_the_budget_between_topics(stream_broker: Broker, publisher: Client) -> None:
    from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows  # noqa: PLC0415

    publish(publisher, "telemetry/a", 1, 50)
    publish(publisher, "telemetry/b", 1, 3)
    reader = AmqttDurableDataSource(options(stream_broker.port, maxEventsPerTrigger=20)).streamReader(_schema())
    try:
        start = reader.initialOffset()
        store = {STORE_KEY: start[STORE_KEY]}  # offsets carry the broker store's id
        assert start == {"telemetry/a": 0, "telemetry/b": 0, **store}
        assert reader.getDefaultReadLimit() == ReadMaxRows(20)
        assert reader.latestOffset(start, ReadMaxRows(20)) == {"telemetry/a": 17, "telemetry/b": 3, **store}
        assert reader.latestOffset({"telemetry/a": 17, "telemetry/b": 3, **store}, ReadMaxRows(20)) == {
            "telemetry/a": 37, "telemetry/b": 3, **store,
        }
        assert reader.latestOffset(start, ReadAllAvailable()) == {"telemetry/a": 50, "telemetry/b": 3, **store}
        assert reader.partitions(start, start) == []
        # Trigger.AvailableNow: what was there when the query started, nothing published after.
        reader.prepareForTriggerAvailableNow()
        publish(publisher, "telemetry/a", 51, 52)
        publish(publisher, "telemetry/c", 1, 1)
        assert reader.latestOffset(start, ReadAllAvailable()) == {"telemetry/a": 50, "telemetry/b": 3, **store}
    finally:
        reader.stop()


def test_a_wiped_store_is_data_loss_never_a_silent_skip(
    stream_broker: Broker, clients: Callable[..., Client]
) -> None:
    """Ids restart in a new store: the offsets of the old one must not silently skip its first ids."""
    publish(clients(stream_broker.port, "pub-old", clean_session=True), "telemetry/a", 1, 10)
    reader = AmqttDurableDataSource(options(stream_broker.port)).streamReader(_schema())
    offset = reader.latestOffset(reader.initialOffset(), ReadAllAvailable())
    reader.stop()
    assert offset["telemetry/a"] == 10
    stream_broker.kill()
    shutil.rmtree(stream_broker.store)
    stream_broker.start()
    publish(clients(stream_broker.port, "pub-new", clean_session=True), "telemetry/a", 1, 15)  # past the old offset

    strict = AmqttDurableDataSource(options(stream_broker.port)).streamReader(_schema())
    with pytest.raises(SourceError, match="another store"):
        strict.latestOffset(offset, ReadAllAvailable())
    strict.stop()
    lenient = AmqttDurableDataSource(options(stream_broker.port, failOnDataLoss="false")).streamReader(_schema())
    end = lenient.latestOffset(offset, ReadAllAvailable())
    ranges = lenient.partitions(offset, end)
    lenient.stop()
    assert [(r.topic, r.start, r.end) for r in ranges] == [("telemetry/a", 0, 15)], "the new store from its start"


@pytest.mark.parametrize(
    ("option", "value", "problem"),
    [
        ("startingOffsets", '{"telemetry/a": 1%s}' % ("0" * 4300), "an id of 4301 digits; the limit is 4300"),
        ("endingOffsets", '{"telemetry/a": -%s}' % ("9" * 4301), "an id of 4301 digits; the limit is 4300"),
        ("startingOffsets", "[" * 100_000, "JSON nested too deeply"),
        ("window", "1" + "0" * 5000, "got one of 5001 digits; the limit is 4300"),
        ("maxEventsPerTrigger", "+" + "9" * 4301, "got one of 4301 digits; the limit is 4300"),
    ],
)
def test_an_option_of_too_many_digits_or_too_deep_json_is_a_source_error_saying_so(
    option: str, value: str, problem: str
) -> None:
    """pipeline.md, Options: Python's own errors (ValueError past 4300 digits, RecursionError) became the
    generic message or a traceback."""
    with pytest.raises(SourceError) as raised:
        Options.parse({"filter": FILTER, option: value})
    assert str(raised.value).startswith(f"option {option} must be "), raised.value
    assert str(raised.value).endswith(problem), str(raised.value)[-200:]
