"""Blind tests of docs/pipeline.md and docs/fleet.md, written from the pages alone as a user runs them: the
``amqtt-durable`` source through Spark's own reader API against a real broker (its schema as documented, its
defaults, a bad value of each documented option), the ``durable-pipeline`` command as a child process, and the
audit of delivery logs the SDK wrote against a real broker. Each test quotes the promise it checks."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fleet_helpers import processes_in, signal_fleet_when

from conftest import WAIT, Broker, Client, exit_status, run_cli
from durable_client import DurableClient, Event

PIPELINE = str(Path(sys.executable).with_name("durable-pipeline"))
FILTER = "telemetry/#"


def load(spark: Any, opts: dict[str, Any], stream: bool = False) -> Any:
    """``spark.read`` (or ``readStream``) ``.format("amqtt-durable")`` with every option set, loaded."""
    reader = (spark.readStream if stream else spark.read).format("amqtt-durable")
    for key, value in opts.items():
        reader = reader.option(key, value)
    return reader.load()


def to_parquet(frame: Any, folder: Path) -> Any:
    """The streaming query of pipeline.md's example: ``frame`` into Parquet under ``folder``, with a checkpoint."""
    return (
        frame.writeStream.format("parquet")
        .option("path", str(folder / "events"))
        .option("checkpointLocation", str(folder / "checkpoint"))
        .start()
    )


def publish(client: Client, topic: str, count: int, qos: int = 1) -> None:
    client.publish(topic, [f"{topic}:{i}".encode() for i in range(1, count + 1)], qos=qos)


@pytest.fixture
def stream_broker(broker_factory: Callable[..., Broker]) -> Broker:
    return broker_factory(streams=[{"filter": FILTER}])


@pytest.fixture
def publisher(stream_broker: Broker, clients: Callable[..., Client]) -> Client:
    return clients(stream_broker.port, "blind-pub", clean_session=True)


# ------------------------------------------------------------------ the source, through Spark
@pytest.mark.slow
def test_the_columns_are_topic_id_payload_binary_qos_published_at(
    spark: Any, stream_broker: Broker, publisher: Client
) -> None:
    """pipeline.md: `.load()   # topic, id, payload (binary), qos, published_at`; "startingOffsets (`earliest`
    default ...)", "endingOffsets (batch: `latest` ...)": a batch read without either reads every event, ids
    1, 2, 3, ... per topic (streams.md), each with the QoS it was published at."""
    before = time.time()
    publish(publisher, "telemetry/a", 3, qos=1)
    publish(publisher, "telemetry/b", 2, qos=2)
    after = time.time()
    frame = load(spark, {"port": stream_broker.port, "filter": FILTER})
    assert frame.columns == ["topic", "id", "payload", "qos", "published_at"]
    assert frame.schema["payload"].dataType.typeName() == "binary"
    assert frame.schema["topic"].dataType.typeName() == "string"
    assert frame.schema["id"].dataType.typeName() in {"long", "integer"}
    assert frame.schema["qos"].dataType.typeName() in {"integer", "byte", "short", "long"}
    rows = sorted(frame.collect(), key=lambda r: (r.topic, r.id))
    assert [(r.topic, r.id, bytes(r.payload), r.qos) for r in rows] == [
        ("telemetry/a", 1, b"telemetry/a:1", 1),
        ("telemetry/a", 2, b"telemetry/a:2", 1),
        ("telemetry/a", 3, b"telemetry/a:3", 1),
        ("telemetry/b", 1, b"telemetry/b:1", 2),
        ("telemetry/b", 2, b"telemetry/b:2", 2),
    ]
    for row in rows:
        stamp = row.published_at.timestamp() if hasattr(row.published_at, "timestamp") else row.published_at
        assert before - 1 <= stamp <= after + 1, row
    explicit = load(spark, {"port": stream_broker.port, "filter": FILTER, "endingOffsets": "latest"})
    assert explicit.count() == 5


@pytest.mark.slow
def test_ids_per_partition_and_num_partitions_set_the_read_tasks(
    spark: Any, stream_broker: Broker, publisher: Client
) -> None:
    """pipeline.md: "Partitions per topic, and per id range within a topic (`idsPerPartition`, default
    100000)"; "`numPartitions` (instead of `idsPerPartition`) sets the number of read tasks per micro-batch";
    "`numPartitions` (default: per topic and `idsPerPartition`; not with `idsPerPartition`)"."""
    publish(publisher, "telemetry/a", 25)
    publish(publisher, "telemetry/b", 5)
    base = {"port": stream_broker.port, "filter": FILTER}
    default = load(spark, base)
    assert default.rdd.getNumPartitions() == 2, "one per topic"
    split = load(spark, {**base, "idsPerPartition": 10})
    assert split.rdd.getNumPartitions() == 3 + 1, "telemetry/a in 10-id ranges, telemetry/b in one"
    assert sorted((r.topic, r.id) for r in split.collect()) == sorted(
        [("telemetry/a", i) for i in range(1, 26)] + [("telemetry/b", i) for i in range(1, 6)]
    )
    one = load(spark, {**base, "numPartitions": 1})
    assert one.rdd.getNumPartitions() == 1
    assert one.count() == 30
    three = load(spark, {**base, "numPartitions": 3})
    assert three.rdd.getNumPartitions() == 3
    assert three.rdd.glom().map(len).collect() == [10, 10, 10], "the batch's ids dealt into tasks of equal size"


@pytest.mark.slow
def test_a_host_name_and_a_host_with_spaces_around_it_are_read_from(
    spark: Any, stream_broker: Broker, publisher: Client
) -> None:
    """pipeline.md: "`host` (a host name or an IP address ... (spaces around it are stripped)"."""
    publish(publisher, "telemetry/a", 4)
    for host in ("localhost", "  127.0.0.1 "):
        frame = load(spark, {"host": host, "port": stream_broker.port, "filter": FILTER, "timeout": 10})
        assert sorted(r.id for r in frame.collect()) == [1, 2, 3, 4], host


@pytest.mark.slow
def test_an_ipv6_host_in_brackets_is_taken_as_a_host(spark: Any) -> None:
    """pipeline.md: "`host` (a host name or an IP address, an IPv6 one bare or in brackets, `::1` or `[::1]`":
    no broker listens there, so the read fails as an unreachable broker does ("a `SourceError` that says what to
    do", naming the address as host:port writes it), not as a bad `host` option (the bare form, without Spark:
    test_pipeline_source)."""
    host = "[::1]"
    from conftest import free_port  # noqa: PLC0415

    port = free_port()
    with pytest.raises(Exception, match="SourceError") as raised:
        load(spark, {"host": host, "port": port, "filter": FILTER, "timeout": 1}).collect()
    text = str(raised.value)
    assert "option host" not in text, text[-1500:]
    assert f"[::1]:{port}" in text, text[-1500:]


@pytest.mark.slow
def test_a_bad_value_of_a_documented_option_is_a_source_error_naming_it(spark: Any, stream_broker: Broker) -> None:
    """pipeline.md, Options: "... is a `SourceError` naming the option". Read through Spark as a user does, against
    a running broker that has the stream: only the option is wrong (each option's bad values, without Spark:
    test_pipeline_source)."""
    for option, value in (("port", "abc"), ("window", "1001"), ("endingOffsets", "earliest")):
        opts = {"port": str(stream_broker.port), "filter": FILTER, "timeout": "5", option: value}
        with pytest.raises(Exception, match="SourceError") as raised:
            load(spark, opts).collect()
        assert f"option {option} " in str(raised.value), str(raised.value)[-2000:]


@pytest.mark.slow
def test_an_unknown_option_names_itself_and_the_options_there_are(spark: Any, stream_broker: Broker) -> None:
    """pipeline.md: "Unknown options ... each give a `SourceError` that says what to do"; "Spark hands them to the
    source in lower case, so an unknown one is named in lower case, beside the list of" the options."""
    with pytest.raises(Exception, match="SourceError") as raised:
        load(spark, {"port": stream_broker.port, "filter": FILTER, "maxEventsPerBatch": "5"}).collect()
    text = str(raised.value)
    assert "maxeventsperbatch" in text, "named in lower case"
    assert "maxEventsPerTrigger" in text, "what to do: the options there are"


@pytest.mark.slow
def test_a_missing_filter_is_a_source_error_naming_it(spark: Any, stream_broker: Broker) -> None:
    """pipeline.md: "`filter` (required)"."""
    with pytest.raises(Exception, match="SourceError") as raised:
        load(spark, {"port": stream_broker.port}).collect()
    assert "filter" in str(raised.value)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_starting_offsets_latest_reads_only_what_comes_after_the_query_starts(
    spark: Any, stream_broker: Broker, publisher: Client, tmp_path: Path
) -> None:
    """pipeline.md: "`startingOffsets` (`earliest` default, `latest`, or JSON ...)": a streaming query from
    `latest` skips what the stream log held when it started and writes what comes after, once."""
    publish(publisher, "telemetry/a", 5)
    query = to_parquet(
        load(spark, {"port": stream_broker.port, "filter": FILTER, "startingOffsets": "latest"}, stream=True), tmp_path
    )
    try:
        query.processAllAvailable()
        publisher.publish("telemetry/a", [b"late-1", b"late-2"])
        query.processAllAvailable()
    finally:
        query.stop()
    rows = spark.read.parquet(str(tmp_path / "events")).collect()
    assert sorted((r.id, bytes(r.payload)) for r in rows) == [(6, b"late-1"), (7, b"late-2")]


@pytest.mark.slow
def test_a_batch_json_range_on_one_topic_of_several_reads_that_range_only(
    spark: Any, stream_broker: Broker, publisher: Client
) -> None:
    """pipeline.md: "`startingOffsets` ... JSON `{"topic": last id already processed}`" and "Batch reads of an
    id range: ... reads exactly ids 11 to 20", with another topic under the filter beside it."""
    publish(publisher, "telemetry/a", 25)
    publish(publisher, "telemetry/b", 25)
    frame = load(
        spark,
        {
            "port": stream_broker.port,
            "filter": FILTER,
            "startingOffsets": json.dumps({"telemetry/a": 10}),
            "endingOffsets": json.dumps({"telemetry/a": 20}),
        },
    )
    ids = sorted((r.topic, r.id) for r in frame.collect())
    assert [i for t, i in ids if t == "telemetry/a"] == list(range(11, 21))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_stream_from_json_offsets_with_max_events_per_trigger_reads_each_event_once_in_small_batches(
    spark: Any, stream_broker: Broker, publisher: Client, tmp_path: Path
) -> None:
    """pipeline.md: "`startingOffsets` (... or JSON `{"topic": last id already processed}`)",
    "`maxEventsPerTrigger`", "Exactly once ... into a file sink with a checkpoint"."""
    publish(publisher, "telemetry/a", 25)
    opts = {"startingOffsets": json.dumps({"telemetry/a": 3}), "maxEventsPerTrigger": 10}
    query = to_parquet(load(spark, {"port": stream_broker.port, "filter": FILTER, **opts}, stream=True), tmp_path)
    try:
        query.processAllAvailable()
        batches = [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]]
    finally:
        query.stop()
    assert max(batches) <= 10 and sum(batches) == 22, batches
    ids = sorted(r.id for r in spark.read.parquet(str(tmp_path / "events")).collect())
    assert ids == list(range(4, 26))


@pytest.mark.slow
def test_the_readers_move_on_to_a_failover_address_when_the_host_is_down(
    spark: Any, stream_broker: Broker, publisher: Client
) -> None:
    """pipeline.md: "`failover` (`host:port,host:port` ...: the other brokers of a replication group ...; the
    readers move on to whichever is primary": the `host`/`port` broker is down, the one under `failover` is up
    (a broker without replication serves as its own primary)."""
    from conftest import free_port  # noqa: PLC0415

    publish(publisher, "telemetry/a", 6)
    frame = load(
        spark,
        {"port": free_port(), "failover": f"127.0.0.1:{stream_broker.port}", "filter": FILTER, "timeout": 10},
    )
    assert sorted(r.id for r in frame.collect()) == [1, 2, 3, 4, 5, 6]


@pytest.mark.slow
def test_ending_offsets_on_a_streaming_query_is_refused(spark: Any, stream_broker: Broker, tmp_path: Path) -> None:
    """pipeline.md: "`endingOffsets` is refused on a streaming query (it is for batch reads)"."""
    with pytest.raises(Exception, match="SourceError") as raised:
        opts = {"port": stream_broker.port, "filter": FILTER, "endingOffsets": "latest"}
        query = to_parquet(load(spark, opts, stream=True), tmp_path)
        try:
            query.awaitTermination(60)
        finally:
            query.stop()
    assert "endingOffsets" in str(raised.value)


@pytest.mark.slow
def test_a_filter_inside_a_configured_stream_reads_only_its_topics(
    spark: Any, stream_broker: Broker, publisher: Client
) -> None:
    """pipeline.md: "an unknown stream (a filter no `streams` entry covers)" is the error, so a filter a
    `streams` entry covers (`telemetry/#` covers `telemetry/a` and `telemetry/+`) is read, its topics only."""
    publish(publisher, "telemetry/a", 3)
    publish(publisher, "telemetry/b", 2)
    publish(publisher, "telemetry/b/deep", 2)
    one = load(spark, {"port": stream_broker.port, "filter": "telemetry/a"})
    assert sorted((r.topic, r.id) for r in one.collect()) == [("telemetry/a", i) for i in (1, 2, 3)]
    level = load(spark, {"port": stream_broker.port, "filter": "telemetry/+"})
    assert sorted({r.topic for r in level.collect()}) == ["telemetry/a", "telemetry/b"]
    assert level.count() == 5


@pytest.mark.slow
@pytest.mark.parametrize("value", ['{"telemetry/a": -1}', '{"telemetry/a": "ten"}', '{"telemetry/a": 1.5}'])
def test_a_json_offset_that_is_not_an_id_is_a_source_error(spark: Any, stream_broker: Broker, value: str) -> None:
    """pipeline.md: "`startingOffsets` (... JSON `{"topic": last id already processed}`)": ids are 1, 2, 3, ...
    (0: nothing processed yet), so a negative, a string or a fraction is a bad option, named."""
    with pytest.raises(Exception, match="SourceError") as raised:
        load(spark, {"port": stream_broker.port, "filter": FILTER, "startingOffsets": value}).collect()
    assert "startingOffsets" in str(raised.value)


@pytest.mark.slow
def test_earliest_on_a_trimmed_log_starts_at_its_oldest_event_without_data_loss(
    spark: Any, broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """pipeline.md: "`startingOffsets` (`earliest` default ...)"; configuration.md: each log "kept up to
    `max_count` events": what retention trimmed before the query started is not data loss to a query from
    `earliest` (there is nothing earlier to read), so the default failOnDataLoss=true reads the log as it is."""
    broker = broker_factory(streams=[{"filter": FILTER, "max_count": 5}])
    publish(clients(broker.port, "blind-trim-pub", clean_session=True), "telemetry/a", 20)
    frame = load(spark, {"port": broker.port, "filter": FILTER})
    assert sorted(r.id for r in frame.collect()) == [16, 17, 18, 19, 20]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_reading_a_stream_leaves_no_durable_session_on_the_broker(
    spark: Any, stream_broker: Broker, publisher: Client, tmp_path: Path
) -> None:
    """pipeline.md: "each reads its range over a raw MQTT connection of its own (no session, no SDK client)";
    "Offsets carry the broker store's id": the source is stateless towards the broker, its position is Spark's
    checkpoint. After a batch read and a streaming query, `amqtt-durable inspect STORE --json` (operations.md)
    lists no session, and the stream log is unchanged (read again from the start, all of it)."""
    publish(publisher, "telemetry/a", 12)
    assert load(spark, {"port": stream_broker.port, "filter": FILTER, "idsPerPartition": 5}).count() == 12
    query = to_parquet(load(spark, {"port": stream_broker.port, "filter": FILTER}, stream=True), tmp_path)
    try:
        query.processAllAvailable()
    finally:
        query.stop()
    assert load(spark, {"port": stream_broker.port, "filter": FILTER}).count() == 12
    stream_broker.stop()
    shown = run_cli("inspect", str(stream_broker.store), "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout) == [], shown.stdout


# ------------------------------------------------------------------ the audit of logs the SDK wrote
def sdk_run(port: int, logs: Path) -> int:
    """A subscriber (SDK, CPL-2, delivery log: exactly-once across its restart) subscribed at QoS 1, away for part
    of the run; a publisher (SDK, delivery log) sending at QoS 1 while it is there and while it is away. Returns
    how many messages were sent."""
    state = logs.parent / "state"
    received: list[Event] = []
    arrived = threading.Condition()

    def on_event(event: Event) -> None:
        with arrived:
            received.append(event)
            arrived.notify_all()

    def subscriber() -> DurableClient:
        live = threading.Event()
        client = DurableClient(
            "blind-sub", "127.0.0.1", port, persistence="disk", state_dir=str(state),
            delivery_log=str(logs / "sub.jsonl"), on_live=lambda _marker: live.set(),
        )
        client.subscribe("plant/+/temp", qos=1, listener=on_event)
        client.connect(timeout=WAIT)
        client.ready_for_events()
        # Before the marker an event counts as replayed (sdk.md): the live ones are published after it.
        assert live.wait(WAIT), "no marker"
        return client

    first = subscriber()
    publisher = DurableClient("blind-pub", "127.0.0.1", port, delivery_log=str(logs / "pub.jsonl"))
    publisher.connect(timeout=WAIT)
    for i in range(10):
        publisher.publish(f"plant/{i % 2}/temp", f"live-{i}".encode(), qos=1, timeout=WAIT)
    with arrived:
        assert arrived.wait_for(lambda: len(received) == 10, WAIT), [e.payload for e in received]
    first.close(keep_session=True)  # away: the broker queues what follows
    for i in range(10):
        publisher.publish(f"plant/{i % 2}/temp", f"away-{i}".encode(), qos=1, timeout=WAIT)
    back = subscriber()
    with arrived:
        assert arrived.wait_for(lambda: len(received) >= 20, WAIT), [e.payload for e in received]
    assert [e.replayed for e in received] == [False] * 10 + [True] * 10, [(e.payload, e.replayed) for e in received]
    back.close(keep_session=True)
    publisher.close(keep_session=False)
    return 20


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_audit_judges_logs_the_sdk_wrote_against_a_real_broker(
    spark: Any, broker: Broker, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """pipeline.md: "`.venv/bin/durable-pipeline audit out/logs --out out/audit --expect exactly-once`"; "the SDK
    writes them with `DurableClient(..., delivery_log=PATH)`"; "`summary.parquet`, `report.html` and the PNGs
    go there"; "Exit status 0 when the guarantee holds (exactly-once: nothing lost, nothing duplicated;
    at-least-once: nothing lost ...), 1 when it does not, 2 on bad input (... corrupt files ...), with the file
    and the problem named"; "Reads delivery logs (JSON lines or Parquet, files or folders)"; "An input is a local
    path or a URI of any Hadoop file system Spark is configured for: ... `file:///abs/path`"; "A file is told JSON
    lines or Parquet by its extension, a final `.gz` aside (`.jsonl`, `.json`, `.ndjson`; ...)". The command's
    main() in this process, with the session's Spark (test_pipeline_demo runs the console script)."""
    import gzip  # noqa: PLC0415

    import pyarrow.parquet as pq  # noqa: PLC0415

    from durable_pipeline.cli import main  # noqa: PLC0415 - pyspark loads only for Spark tests

    logs = tmp_path / "logs"
    logs.mkdir()
    sent = sdk_run(broker.port, logs)
    assert sum(1 for r in records(logs / "pub.jsonl") if r["kind"] == "send") == sent

    def audit(*inputs: str, out: str, expect: str) -> tuple[int, list[str]]:
        status = main(["audit", *inputs, "--out", str(tmp_path / out), "--expect", expect])
        return status, capsys.readouterr().out.splitlines()

    def overall(lines: list[str]) -> list[str]:
        return next(line.split() for line in lines if line.split()[:1] == ["ALL"])

    status, lines = audit(str(logs), out="audit", expect="exactly-once")
    assert status == 0, lines
    out = tmp_path / "audit"
    assert (out / "summary.parquet").exists() and (out / "report.html").is_file()
    assert list(out.glob("*.png")), "PNG charts"
    assert any("exactly-once holds" in line for line in lines), lines
    assert overall(lines)[:4] == ["ALL", str(sent), str(sent), "0"], lines
    # "Per receiving device and overall it reports expected vs received, lost, duplicated, out of order, replay
    # latency p50/p99 and time to drain, into `summary.parquet`": the subscriber was away for 10 of them.
    rows = pq.read_table(out / "summary.parquet").to_pylist()
    device = next(r for r in rows if r["device"] == "blind-sub")
    assert (device["expected"], device["received"], device["lost"], device["duplicated"]) == (sent, sent, 0, 0)
    assert device["replay_p50_ms"] is not None and device["replay_p99_ms"] is not None, device
    assert device["drain_p50_s"] is not None, device

    # Several inputs: the publisher's log by a file URI, the subscriber's gzipped as .ndjson.gz elsewhere.
    packed = tmp_path / "elsewhere" / "sub.ndjson.gz"
    packed.parent.mkdir()
    packed.write_bytes(gzip.compress((logs / "sub.jsonl").read_bytes()))
    status, lines = audit((logs / "pub.jsonl").resolve().as_uri(), str(packed), out="a0", expect="exactly-once")
    assert status == 0, lines
    assert overall(lines)[:4] == ["ALL", str(sent), str(sent), "0"], lines

    # A receive the SDK logged, logged twice, is a duplicate: exactly-once fails, at-least-once holds.
    text = (logs / "sub.jsonl").read_text(encoding="utf-8")
    receive = next(line for line in text.splitlines() if json.loads(line)["kind"] == "receive")
    with (logs / "sub.jsonl").open("a", encoding="utf-8") as log:
        log.write(receive + "\n")
    status, lines = audit(str(logs), out="a1", expect="exactly-once")
    assert status == 1, lines
    assert overall(lines)[:6] == ["ALL", str(sent), str(sent + 1), "0", "1", "0"], lines
    status, lines = audit(str(logs), out="a2", expect="at-least-once")
    assert status == 0, lines
    # A last line cut short by a crash is a corrupt file: bad input, the file named.
    with (logs / "sub.jsonl").open("a", encoding="utf-8") as log:
        log.write(receive[: len(receive) // 2])
    status = main(["audit", str(logs), "--out", str(tmp_path / "a3"), "--expect", "at-least-once"])
    err = capsys.readouterr().err
    assert status == 2, err
    assert "sub.jsonl" in err, err


def next_connection(port: int, client_id: str, topic_filter: str, count: int) -> list[bytes]:
    """The session's next client: what it processes until it has ``count`` events (or WAIT passed); it ends the
    session."""
    again: list[bytes] = []
    arrived = threading.Condition()

    def collect(event: Event) -> None:
        with arrived:
            again.append(bytes(event.payload))
            arrived.notify_all()

    client = DurableClient(client_id, "127.0.0.1", port)
    client.subscribe(topic_filter, qos=1, listener=collect)
    client.connect(timeout=WAIT)
    client.ready_for_events()
    try:
        with arrived:
            arrived.wait_for(lambda: len(again) >= count, WAIT)
            return list(again)
    finally:
        client.close(keep_session=False)


@pytest.mark.timeout(120)
def test_a_client_closed_while_events_arrive_processes_nothing_after_close_and_nothing_twice(broker: Broker) -> None:
    """sdk.md: "the SDK sends PUBACK only after every listener for the event ... has returned"; "`close(keep_session=
    True)` leaves the session queueing on the broker"; "no later event is processed: those still arriving are
    left unacknowledged, so a durable session's next connection gets them". A client with the default in-memory
    marks closed while a burst arrives: no listener runs once close() returned, and what ran before it was
    acknowledged, so the session's next client processes each event the first did not, and none twice."""
    calls: list[bytes] = []

    def slow(event: Event) -> None:
        calls.append(bytes(event.payload))
        time.sleep(0.002)  # a listener that takes a little time: the burst is still arriving at close()

    first = DurableClient("blind-close", "127.0.0.1", broker.port)
    first.subscribe("burst/#", qos=1, listener=slow)
    first.connect(timeout=WAIT)
    first.ready_for_events()
    publisher = DurableClient("blind-close-pub", "127.0.0.1", broker.port)
    publisher.connect(timeout=WAIT)
    sent = [f"m{i:03d}".encode() for i in range(60)]
    try:
        for payload in sent:
            publisher.publish("burst/x", payload, qos=1, timeout=WAIT)
        first.close(keep_session=True)
        first_got = list(calls)
        again = next_connection(broker.port, "blind-close", "burst/#", len(sent) - len(first_got))
        assert calls == first_got, "a listener ran after close() returned"
        assert sorted(first_got + again) == sent, "each event processed once across the two clients"
    finally:
        publisher.close(keep_session=False)


def closed_by_its_listener(port: int, client_id: str, sent: list[bytes], **listeners: int) -> list[tuple[str, bytes]]:
    """A client whose subscriptions (name: a filter on cmd/...) record each call; the listener named first closes
    the client on "stop". ``sent`` is queued first and comes as one replay burst. Returns the calls once the
    client's on_disconnected came (its DISCONNECT written, after the acknowledgements)."""
    calls: list[tuple[str, bytes]] = []
    gone = threading.Event()
    holder: dict[str, DurableClient] = {}
    names = list(listeners)

    def listener(name: str) -> Callable[[Event], None]:
        def on_event(event: Event) -> None:
            calls.append((name, bytes(event.payload)))
            if name == names[0] and event.payload == b"stop":
                holder["client"].close(keep_session=True)

        return on_event

    client = DurableClient(client_id, "127.0.0.1", port, on_disconnected=lambda _reason: gone.set())
    holder["client"] = client
    for name in names:
        client.subscribe("cmd/#" if listeners[name] else "cmd/x", qos=1, listener=listener(name))
    client.connect(timeout=WAIT)
    publisher = DurableClient(f"{client_id}-pub", "127.0.0.1", port)
    publisher.connect(timeout=WAIT)
    try:
        for payload in sent:
            publisher.publish("cmd/x", payload, qos=1, timeout=WAIT)
    finally:
        publisher.close(keep_session=False)
    client.ready_for_events()
    # sdk.md: close() from a listener returns at once; wait for on_disconnected before the next connection.
    assert gone.wait(WAIT), calls
    return calls


@pytest.mark.timeout(120)
def test_a_client_closed_from_its_listener_processes_no_later_event(broker: Broker) -> None:
    """sdk.md: "The event being processed when `close()` is called finishes ... and is acknowledged before the
    DISCONNECT; no later event is processed" (here close() is called by the listener itself, on a "stop" command,
    amid a replay)."""
    sent = [b"a", b"b", b"stop", *(f"after-{i}".encode() for i in range(30))]
    calls = closed_by_its_listener(broker.port, "blind-stop", sent, only=1)
    assert [p for _, p in calls] == [b"a", b"b", b"stop"], "no listener ran after close()"
    again = next_connection(broker.port, "blind-stop", "cmd/#", 30)
    assert again == sent[3:], "the rest, once, for the next connection; stop was acknowledged"


@pytest.mark.timeout(120)
def test_close_from_one_listener_of_an_event_lets_its_other_listeners_run(broker: Broker) -> None:
    """sdk.md: the event being processed when `close()` is called "finishes (each of its listeners) and is
    acknowledged". Two subscriptions match cmd/x; the first one's listener closes the client on "stop"."""
    sent = [b"stop", b"after"]
    calls = closed_by_its_listener(broker.port, "blind-two", sent, first=1, second=0)
    assert calls == [("first", b"stop"), ("second", b"stop")], calls
    assert next_connection(broker.port, "blind-two", "cmd/#", 1) == [b"after"], "stop was acknowledged"


# ------------------------------------------------------------------ durable-pipeline and fleet on the command line
def pipeline_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PIPELINE, *args], capture_output=True, text=True, timeout=4 * WAIT, check=False, cwd=cwd)


@pytest.mark.parametrize(
    "args",
    [
        ["demo", "--devices", "0"],
        ["demo", "--events", "many"],
        ["demo", "--devices", "-3"],
        ["demo", "--master", "local[0]"],
        ["demo", "--nonsense"],
        ["audit", "logs", "--out", "o", "--expect", "twice"],
        ["audit", "logs", "--out", "o", "--expect", "exactly-once", "--master", "nowhere"],
        ["nonsense"],
    ],
)
def test_bad_options_of_durable_pipeline_exit_2_before_anything_runs(tmp_path: Path, args: list[str]) -> None:
    """pipeline.md: demo: "Exit status ... 2 for bad options"; audit: "2 on bad input", "a master URL Spark does
    not take is bad input, found before Spark starts". Nothing is made in the working folder."""
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "x.jsonl").write_text("{}\n", encoding="utf-8")
    done = pipeline_cli(*args, cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip(), "the problem is named"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs"], "nothing started, nothing written"


def test_the_documented_flags_are_in_the_commands_help() -> None:
    """pipeline.md: demo "--events, --devices, --master" and `--out`; audit: "`--expect` and `--out` (both
    required), `--ignore-order`, `--count-qos0`, `--master` (default `local[2,4]`...)"."""
    demo = pipeline_cli("demo", "--help")
    assert demo.returncode == 0
    for flag in ("--out", "--events", "--devices", "--master"):
        assert flag in demo.stdout, flag
    audit = pipeline_cli("audit", "--help")
    assert audit.returncode == 0
    for flag in ("--out", "--expect", "--ignore-order", "--count-qos0", "--master", "exactly-once", "at-least-once"):
        assert flag in audit.stdout, flag
    assert "local[2,4]" in audit.stdout


def test_fleet_ha_with_port_is_refused_it_needs_a_config(tmp_path: Path) -> None:
    """fleet.md: "`--ha` needs `--config` (not `--port`)"; "A bad ... option ... stops the run before it starts,
    with exit status 2"."""
    done = run_cli("fleet", "--ha", "--port", "1883", "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--ha" in done.stderr and "--port" in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()


def fleet_in_process(tmp_path: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """``amqtt-durable fleet ARGS --out tmp_path/out`` through the command's main() in this process, in tmp_path
    with the shipped broker.yaml: its exit status and stderr."""
    from durable_fleet.console import main  # noqa: PLC0415 - the fleet's imports only for these tests

    (tmp_path / "broker.yaml").write_text(
        (Path(__file__).parent.parent / "broker.yaml").read_text(encoding="utf-8"), encoding="utf-8"
    )
    return exit_status(lambda: main(["fleet", *args, "--out", str(tmp_path / "out")])), capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--rate", "0"], "--rate"),
        (["--rate", "fast"], "--rate"),
        (["--duration", "0"], "--duration"),
        (["--processes", "0"], "--processes"),
        (["--publishers", "0"], "--publishers"),
        (["--keepalive", "0"], "--keepalive"),
        (["--drain-timeout", "-1"], "--drain-timeout"),
        (["--mix", "cpl3=1"], "cpl3"),
        (["--faults", "drop=-1"], "drop"),
        (["--seed", "x"], "--seed"),
        (["--schedule", "no-such-schedule.yaml"], "no-such-schedule.yaml"),
        (["-c", "no-such-broker.yaml"], "no-such-broker.yaml"),
    ],
)
def test_fleet_bad_options_exit_2_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, args: list[str], named: str
) -> None:
    """fleet.md: "A bad schedule, option or broker.yaml stops the run before it starts, with exit status 2 and
    the file, fault number and field named" (in a process of its own: test_fleet_ha_with_port_is_refused)."""
    monkeypatch.chdir(tmp_path)
    status, err = fleet_in_process(tmp_path, capsys, *args)
    assert status == 2, err
    assert named in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("faults", "named"),
    [
        (["{at: 5s, kind: drop, device: dev-005, for: 2s}"], "fault 1: device"),  # --devices 5: dev-000 .. dev-004
        (["{at: 5s, kind: drop, device: dev-03, for: 2s}"], "fault 1: device"),  # fewer than three digits
        (["{at: 25s, kind: drop, device: dev-001, for: 10s}"], "fault 1: for"),  # heals after the run's 30 s
        (["{at: 5 parsecs, kind: drop, device: dev-001, for: 1s}"], "fault 1: at"),
        (["{at: 5s, kind: drop, for: 1s}"], "fault 1: device"),
        (["{at: 5s, kind: device_restart, device: all, for: 1s}"], "fault 1: device"),  # all: drop and stall only
        (["{at: 5s, kind: broker_kill, device: dev-001, for: 1s}"], "fault 1: device"),  # it hits the broker
        (["{at: 5s, kind: drop, device: dev-001, for: 5s}", "{at: 6s, kind: drop, device: all, for: 1s}"],
         "fault 2: at"),  # all shares every device
        (["{at: 5s, kind: stall, device: dev-001, for: 5s}", "{at: 6s, kind: stall, device: dev-001, for: 1s}"],
         "fault 2: at"),
        (["{at: 5s, kind: broker_kill, for: 5s}", "{at: 6s, kind: broker_kill, for: 1s}"], "fault 2: at"),
    ],
)
def test_a_scripted_fault_the_run_cannot_apply_is_refused_naming_fault_and_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], faults: list[str], named: str
) -> None:
    """fleet.md: "devices are named `--prefix` + an index of at least three digits"; a schedule is refused when "a
    `drop`, `stall` or `device_restart` has no `device`, or one that is not one of the run's `--devices`;
    `device: all` (every device) is for `drop` and `stall` only", "a `broker_kill` ... has a `device`", "a fault
    does not end (`at` plus `for`) within `--duration`", "two faults of one kind on a common target overlap:
    `all` shares every device, and every `broker_kill` hits the broker"; "A bad schedule ... stops the run before
    it starts, with exit status 2 and the file, fault number and field named"."""
    schedule = tmp_path / "faults.yaml"
    schedule.write_text("faults:\n" + "".join(f"  - {fault}\n" for fault in faults), encoding="utf-8")
    status, err = fleet_in_process(
        tmp_path, capsys, "-c", str(tmp_path / "broker.yaml"), "--schedule", str(schedule), "--devices", "5",
        "--duration", "30s",
    )
    assert status == 2, err
    assert "faults.yaml" in err and named in err, err
    assert not (tmp_path / "out").exists()


def test_the_example_schedule_is_the_page_s_and_needs_its_devices_and_duration(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """fleet.md: "as in `examples/fleet_schedule.yaml` (`amqtt-durable fleet --schedule
    examples/fleet_schedule.yaml`)" with the page's YAML block; a fleet without its dev-010 or shorter than its
    last fault's end (26.5 s) refuses it (the page's command is accepted: test_docs_promises_fleet; every fault
    kind runs in test_fleet)."""
    import yaml  # noqa: PLC0415

    monkeypatch.chdir(tmp_path)
    root = Path(__file__).parent.parent
    example = root / "examples" / "fleet_schedule.yaml"
    page = (root / "docs" / "fleet.md").read_text(encoding="utf-8")
    block = page.split("(`amqtt-durable fleet --schedule examples/fleet_schedule.yaml`)", 1)[1]
    block = block.split("```yaml\n", 1)[1].split("```", 1)[0]
    assert yaml.safe_load(block) == yaml.safe_load(example.read_text(encoding="utf-8"))
    status, err = fleet_in_process(tmp_path, capsys, "--schedule", str(example), "--devices", "10")
    assert (status, "fault 4: device" in err) == (2, True), err  # dev-010 is the 11th device
    status, err = fleet_in_process(tmp_path, capsys, "--schedule", str(example), "--duration", "26s")
    assert (status, "fault 4: for" in err) == (2, True), err
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_sigterm_or_ctrl_c_mid_run_stops_the_broker_and_every_process_the_fleet_started(
    tmp_path: Path, stop: signal.Signals
) -> None:
    """fleet.md: "SIGTERM or Ctrl-C stops the broker and every process it started", here once the broker, the
    device processes and the publishers all run; faults "random with `--seed` (printed ...)": this run has
    none, and no --seed, yet says the seed it drew."""
    args = ["--devices", "4", "--processes", "2", "--duration", "60s", "--faults", "", "--quiet"]

    def running(out: Path) -> bool:
        return (out / "logs" / "pub-0.jsonl").exists() and len(processes_in(out)) >= 4  # broker, 2 + publishers

    signal_fleet_when(tmp_path, args, running, stop)
    err = (tmp_path / "harness.err").read_text(encoding="utf-8")
    assert re.search(r"\(random, --seed \d+\)", err), err


STARTING = {
    "the broker": lambda out: (out / "broker.log").exists(),  # opened just before the broker's spawn
    "the device processes": lambda out: (out / "workers" / "devices-0.log").exists(),  # just before the first's
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("starting", list(STARTING))
def test_ctrl_c_while_the_fleet_starts_stops_what_it_started_so_far(tmp_path: Path, starting: str) -> None:
    """fleet.md: "SIGTERM or Ctrl-C stops the broker and every process it started", at the earliest moments:
    the Ctrl-C comes as the harness spawns the broker, or the first device process (a child spawned then is
    still stopped, and the harness exits)."""
    args = ["--devices", "4", "--processes", "2", "--duration", "60s", "--faults", "", "--quiet"]
    signal_fleet_when(tmp_path, args, STARTING[starting], signal.SIGINT)


@pytest.mark.slow  # 15 s: the broker's STOP_WAIT
def test_ctrl_c_stops_a_broker_that_ignores_its_sigterm_within_the_stop_wait(tmp_path: Path) -> None:
    """fleet.md: Ctrl-C "stops the broker": a broker that does not end on SIGTERM (here stopped with
    SIGSTOP, as a wedged one) is SIGKILLed after the harness's STOP_WAIT, not after the minute a broker
    gets to start, so the harness exits within signal_fleet_when's bound. The publishers send at QoS 0: at
    QoS 1 they wait up to 10 s for the PUBACKs the stopped broker never sends before the harness stops it."""
    args = ["--devices", "4", "--processes", "2", "--duration", "60s", "--faults", "", "--quiet", "--qos", "0"]

    def running_then_broker_stopped(out: Path) -> bool:
        if not ((out / "logs" / "pub-0.jsonl").exists() and len(processes_in(out)) >= 4):
            return False
        for pid in processes_in(out):  # the broker runs: it is one of them
            if b"amqtt_durable.cli\0broker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGSTOP)  # this test's own grandchild, by PID
        return True

    signal_fleet_when(tmp_path, args, running_then_broker_stopped, signal.SIGINT)
