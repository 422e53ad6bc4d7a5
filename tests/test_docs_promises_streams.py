"""Promises of docs/streams.md, docs/delivery-log.md, docs/store-layout.md and docs/sdk.md (the
asyncio client's event loop) that no other test states, each against a real broker.

Each test names the page and the promise it checks.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import logging
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import plyvel
import pytest
from test_sdk import Recorder, Signals

import durable_client
from amqtt_durable.store import MSG_ID_RESERVE
from conftest import WAIT, Broker, Client, payloads
from durable_client import (
    AsyncDurableClient,
    ConnectionInfo,
    ControlRequestFailed,
    DurableClient,
    DurableClientError,
    Event,
)
from durable_client.delivery_log import message_id
from durable_fleet.runner import device_names
from durable_fleet.schedule import load_schedule

# ------------------------------------------------------------------------------ streams.md


def test_a_memory_reader_starts_at_the_first_retained_event_and_a_trimmed_range_is_a_warning_with_the_ids(
    broker_factory: Callable[..., Broker],
    clients: Callable[..., Client],
    sdk: Callable[..., DurableClient],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """streams.md: "with persistence="memory" it starts again from the first retained event.
    Events retention removed before the client read them are reported (a WARNING with the ids)"."""
    broker = broker_factory(streams=[{"filter": "g/#", "max_count": 2}])
    publisher = clients(broker.port, "g-pub", clean_session=True)
    publisher.publish("g/a", payloads(4))  # ids 1..4; retention keeps 3 and 4

    caplog.set_level(logging.WARNING, logger="durable_client")
    fresh = Recorder()
    reader = sdk(broker.port, "g-fresh", durable_session=False)
    reader.subscribe_stream("g/#", fresh)
    reader.connect()
    assert [(e.seq, e.payload) for e in fresh.wait(2)] == [(3, b"m0000002"), (4, b"m0000003")]
    assert not [r for r in caplog.records if "trimmed" in r.getMessage()], "a reader with no position misses nothing"

    behind = Recorder()
    late = sdk(broker.port, "g-late", durable_session=False)
    late.connect()
    late.subscribe_stream("g/#", behind, after={"g/a": 0})  # it processed nothing: wants id 1 on
    assert [e.seq for e in behind.wait(2)] == [3, 4]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("stream g/a: ids 1 to 2 were trimmed" in text for text in warnings), warnings


# ------------------------------------------------------------------------------ delivery-log.md


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_a_stateless_devices_log_has_non_durable_subscribes_raw_receives_at_0_0_and_stream_ids_at_epoch_0(
    broker_factory: Callable[..., Broker],
    clients: Callable[..., Client],
    sdk: Callable[..., DurableClient],
    tmp_path: Path,
) -> None:
    """delivery-log.md: `durable` is false for "every subscription of a stateless client";
    `seq`, `epoch` are "for a stream event the stream log id and epoch 0; both 0 for raw events";
    `published_at` for raw events is "the receive time"; `id` is the first 16 bytes of SHA-256
    over the topic, a NUL byte and the payload, in hex; "A stream subscription (`subscribe_stream()`)
    writes none" [no `subscribe`]; "`unsubscribe` is written when the application unsubscribes (a
    stream's filter too)"."""
    broker = broker_factory(streams=[{"filter": "st/#", "max_count": 100}])
    publisher = clients(broker.port, "dl-pub", clean_session=True)
    publisher.publish("st/a", [b"s1", b"s2"])  # stream ids 1 and 2, logged before the reader comes

    raw, streamed = Recorder(), Recorder()
    log_path = tmp_path / "stateless.jsonl"
    device = sdk(broker.port, "dl-stateless", durable_session=False, delivery_log=log_path)
    device.subscribe("raw/#", listener=raw)
    device.subscribe_stream("st/#", streamed)
    device.connect()
    assert [e.seq for e in streamed.wait(2)] == [1, 2]
    before = time.time()
    publisher.publish("raw/x", [b"r1"])
    raw.wait(1)
    after = time.time()
    device.unsubscribe("st/#")
    device.close()

    logged = records(log_path)
    assert {r["device"] for r in logged} == {"dl-stateless"}
    subscribes = [r for r in logged if r["kind"] == "subscribe"]
    assert subscribes == [{**subscribes[0], "topic": "raw/#", "qos": 1, "durable": False}], "no stream's"
    assert [r["topic"] for r in logged if r["kind"] == "unsubscribe"] == ["st/#"], "a stream's filter too"
    receives = {r["topic"] + ":" + str(r["seq"]): r for r in logged if r["kind"] == "receive"}
    assert set(receives) == {"st/a:1", "st/a:2", "raw/x:0"}
    assert receives["st/a:1"]["epoch"] == receives["st/a:2"]["epoch"] == 0
    assert receives["st/a:2"]["id"] == message_id("st/a", b"s2")
    # the formula the page gives, computed here independently of the SDK
    assert receives["raw/x:0"]["id"] == hashlib.sha256(b"raw/x\x00r1").digest()[:16].hex()
    assert receives["raw/x:0"]["epoch"] == 0
    assert before <= receives["raw/x:0"]["published_at"] <= after, "a raw event's published_at is its receive time"
    assert not any(r["kind"] in ("live", "session_end") for r in logged), "a stateless client has no marker, no session"


def test_a_durable_devices_log_says_session_present_and_the_markers_replayed_count(
    broker: Broker, clients: Callable[..., Client], sdk: Callable[..., DurableClient], tmp_path: Path
) -> None:
    """delivery-log.md: `session_present` (connect) is "what CONNACK said"; `replayed_count`
    (live) is "the marker's replayed count"; `replayed` is true for events delivered before the
    marker; `durable` is false for a non-durable subscription; session epochs start at 1."""
    log_path = tmp_path / "durable.jsonl"
    first = sdk(broker.port, "dl-durable", delivery_log=log_path)
    first.subscribe("d/#")
    first.subscribe("n/#", durable=False)
    first.connect()
    first.close(keep_session=True)
    publisher = clients(broker.port, "dl-pub2", clean_session=True)
    publisher.publish("d/x", payloads(3))

    signals, recorder = Signals(), Recorder()
    again = sdk(broker.port, "dl-durable", delivery_log=log_path, **signals.kwargs())
    again.subscribe("d/#", listener=recorder)
    again.connect()
    again.ready_for_events()
    assert signals.live.wait(WAIT)
    recorder.wait(3)
    again.close(keep_session=True)

    logged = records(log_path)
    connects = [r["session_present"] for r in logged if r["kind"] == "connect"]
    assert connects == [False, True]
    durable_of = {r["topic"]: r["durable"] for r in logged if r["kind"] == "subscribe"}
    assert durable_of == {"d/#": True, "n/#": False}
    lives = [r for r in logged if r["kind"] == "live"]
    assert lives[-1]["replayed_count"] == signals.markers[-1].replayed == 3
    receives = [r for r in logged if r["kind"] == "receive"]
    assert [(r["replayed"], r["redelivered"]) for r in receives] == [(True, False)] * 3
    assert all(r["epoch"] >= 1 and r["seq"] >= 1 for r in receives)


# ------------------------------------------------------------------------------ store-layout.md


def test_queue_entries_a_crash_left_of_a_deleted_session_are_removed_at_start_up_with_a_warning_counting_them(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    """store-layout.md: "Deleting a session writes its record's removal first; if a crash
    interrupts the deletion of a long queue, the next start-up removes the rest (a WARNING says
    how many entries)"."""
    subscriber = clients(broker.port, "half-deleted")
    subscriber.subscribe("h/#")
    subscriber.disconnect()
    clients(broker.port, "h-pub", clean_session=True).publish("h/x", payloads(3))
    broker.stop()
    db = plyvel.DB(broker.store)
    try:  # what a crash right after the record's removal leaves
        assert len(list(db.iterator(prefix=b"q", include_value=False))) == 3
        db.delete(b"s" + b"half-deleted", sync=True)
    finally:
        db.close()
    broker.start()
    broker.stop()
    said = "store: deleted 3 queue entries of a session whose deletion a crash or a stop cut short"
    assert [" WARNING " in line for line in broker.log().splitlines() if said in line] == [True], broker.log()
    db = plyvel.DB(broker.store)
    try:
        assert list(db.iterator(prefix=b"q", include_value=False)) == []
        assert list(db.iterator(prefix=b"m", include_value=False)) == [], "their bodies go with them"
    finally:
        db.close()


# ------------------------------------------------------------------------------ sdk.md


def test_an_async_client_is_tied_to_the_event_loop_of_its_first_coroutine_whichever_it_is(broker: Broker) -> None:
    """sdk.md: "One loop per client: the first coroutine called ties it to its event loop"."""
    client = AsyncDurableClient("one-loop", port=broker.port, reconnect_max_delay=0.5)
    home, other = asyncio.new_event_loop(), asyncio.new_event_loop()
    try:
        home.run_until_complete(client.ready_for_events())  # not connect(): any coroutine ties it
        with pytest.raises(DurableClientError, match="one event loop only"):
            other.run_until_complete(client.connect())
        home.run_until_complete(client.connect())
        calls: list[Callable[[], Any]] = [
            lambda: client.publish("loop/x", b"1"),
            client.stream_info,
            lambda: client.unsubscribe("loop/#"),
            client.ready_for_events,
            lambda: client.subscribe("loop/#"),
        ]
        for call in calls:
            with pytest.raises(DurableClientError, match="one event loop only"):
                other.run_until_complete(call())
        assert client.connected, "a refused call changed nothing"
        other.run_until_complete(client.close(keep_session=False))  # close() works from any loop
        assert not client.connected
    finally:
        home.run_until_complete(client.close(keep_session=False))
        home.close()
        other.close()


def test_a_real_store_holds_the_keys_and_values_the_store_docstring_documents(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """store-layout.md and store.py's docstring: bodies stored once under b"m" (time, qos, tlen,
    topic, payload), a reference count under b"c" only for a body queued for 2+ sessions (entry
    flag SHARED), queue entries b"q" + sid + seq -> msg_id qos flags size, totals b"t" -> depth
    bytes dropped, session records as JSON under b"s", the sid mark b"n", the message id mark b"M"
    (written ahead, MSG_ID_RESERVE ids at a time), the store id b"i",
    stream events under b"e" + tlen + topic + id with the id mark b"L", the retained message
    under b"r", the version b"1" under b"v"."""
    broker = broker_factory(streams=[{"filter": "s/#"}])
    for client_id, filters in (("A", ["t/#"]), ("C", ["t/#", "u/#"])):
        subscriber = clients(broker.port, client_id)
        for topic_filter in filters:
            subscriber.subscribe(topic_filter)
        subscriber.disconnect()
    publisher = clients(broker.port, "P", clean_session=True)
    publisher.publish("t/x", [b"shared"])
    publisher.publish("u/x", [b"single"])
    publisher.publish("r/x", [b"ret"], retain=True)
    publisher.publish("s/a", [b"ev"])
    broker.stop()

    db = plyvel.DB(broker.store)
    try:
        keys = dict(db.iterator())
    finally:
        db.close()
    u64 = struct.Struct(">Q").pack
    assert keys[b"v"] == b"1"
    assert len(keys[b"i"]) == 8
    assert keys[b"n"] == u64(2), "two sessions were ever made"
    assert keys[b"M"] == u64(MSG_ID_RESERVE), "the first message moved the mark ahead by MSG_ID_RESERVE"
    sid = {cid: json.loads(keys[b"s" + cid.encode()])["sid"] for cid in ("A", "C")}
    assert json.loads(keys[b"sC"])["subscriptions"] == {"t/#": 1, "u/#": 1}
    bodies = {key: value for key, value in keys.items() if key[:1] == b"m"}
    assert len(bodies) == 2, "the shared message is stored once"
    by_topic: dict[str, tuple[int, int, bytes]] = {}
    for key, value in bodies.items():
        published_at, qos, tlen = struct.unpack_from(">dBH", value)
        topic = value[11 : 11 + tlen].decode()
        by_topic[topic] = (struct.unpack(">Q", key[1:])[0], qos, value[11 + tlen :])
        assert qos == 1 and abs(published_at - time.time()) < 60
    shared_id, _, shared_payload = by_topic["t/x"]
    single_id, _, single_payload = by_topic["u/x"]
    assert (shared_payload, single_payload) == (b"shared", b"single")
    assert keys[b"c" + u64(shared_id)] == struct.pack(">I", 2)
    assert b"c" + u64(single_id) not in keys, "a body with one queue entry has no count"
    entry = struct.Struct(">QBBI").unpack
    assert entry(keys[b"q" + u64(sid["A"]) + u64(1)]) == (shared_id, 1, 0x04, 6)  # SHARED
    assert entry(keys[b"q" + u64(sid["C"]) + u64(2)]) == (single_id, 1, 0x00, 6)
    assert struct.unpack(">QQQ", keys[b"t" + u64(sid["C"])]) == (2, 12, 0)
    event = keys[b"e" + struct.pack(">H", 3) + b"s/a" + u64(1)]
    assert event[8:] == b"\x01ev"
    assert keys[b"Ls/a"] == u64(1)
    assert keys[b"rr/x"][8:] == b"\x01ret"


def test_stream_info_gives_each_logs_first_and_last_id_and_refuses_a_filter_no_stream_covers(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], sdk: Callable[..., DurableClient]
) -> None:
    """streams.md: "`stream_info` (see the protocol) lists each log's first and last id"; sdk.md's
    ControlRequestFailed (`code`, `message`) when the broker refuses a request."""
    broker = broker_factory(streams=[{"filter": "si/#", "max_count": 2}])
    clients(broker.port, "si-pub", clean_session=True).publish("si/a", payloads(3))
    clients(broker.port, "si-pub2", clean_session=True).publish("si/b", payloads(1))
    reader = sdk(broker.port, "si-reader", durable_session=False)
    reader.connect()
    bounds = reader.stream_info("si/#")
    assert dict(bounds) == {"si/a": (2, 3), "si/b": (1, 1)}
    assert isinstance(bounds.store, int)
    assert reader.stream_info("si/b") == {"si/b": (1, 1)}
    with pytest.raises(ControlRequestFailed) as refused:
        reader.stream_info("other/#")
    assert refused.value.code == "unknown_stream" and refused.value.message


def test_on_connected_gets_the_epoch_and_the_granted_session_expiry_capped_by_the_broker(
    broker_factory: Callable[..., Broker], sdk: Callable[..., DurableClient]
) -> None:
    """sdk.md: `on_connected(info)` (`session_present`, `epoch`, granted `session_expiry`);
    "`session_expiry=seconds` overrides the broker's `session_expiry` for this client, capped by
    the broker's `max_session_expiry`"; session epochs start at 1."""
    broker = broker_factory(session_expiry=300, max_session_expiry=60)
    infos: list[ConnectionInfo] = []
    capped = sdk(broker.port, "exp-capped", session_expiry=3600, on_connected=infos.append)
    capped.connect()
    capped.close(keep_session=True)
    again = sdk(broker.port, "exp-capped", session_expiry=30, on_connected=infos.append)
    again.connect()
    again.close(keep_session=False)
    default = sdk(broker.port, "exp-default", on_connected=infos.append)
    default.connect()
    default.close(keep_session=False)
    assert [(i.session_present, i.session_expiry) for i in infos] == [(False, 60.0), (True, 30.0), (False, None)]
    assert infos[0].epoch == infos[1].epoch and infos[0].epoch is not None and infos[0].epoch >= 1
    assert infos[2].epoch is not None and infos[2].epoch > infos[0].epoch


def test_events_trimmed_while_a_reader_was_behind_are_a_broker_warning_naming_the_ids(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], sdk: Callable[..., DurableClient]
) -> None:
    """streams.md: "Events retention removed before the client read them are reported (a WARNING
    with the ids)": also those trimmed while the reader was connected but behind."""
    broker = broker_factory(streams=[{"filter": "tw/#", "max_count": 2}])
    publisher = clients(broker.port, "tw-pub", clean_session=True)
    release, first_seen, recorder = threading.Event(), threading.Event(), Recorder()

    def slow(event: Event) -> None:
        first_seen.set()
        assert release.wait(WAIT), "the test never released the listener"
        recorder(event)

    reader = sdk(broker.port, "tw-reader", durable_session=False)
    reader.subscribe_stream("tw/#", slow)  # window 1: one event in flight, the next after its ack
    reader.connect()
    publisher.publish("tw/a", payloads(1))
    assert first_seen.wait(WAIT)
    publisher.publish("tw/a", payloads(5, "n"))  # ids 2..6; retention keeps 5 and 6 while id 1 is in flight
    release.set()
    assert [e.seq for e in recorder.wait(3)] == [1, 5, 6]
    assert "stream tw/a: ids 2 to 4 were trimmed by retention before they were sent; resuming at id 5" in broker.log()


def test_each_kind_of_record_has_exactly_the_columns_the_table_gives_it_and_a_listeners_publish_is_logged(
    broker: Broker, sdk: Callable[..., DurableClient], tmp_path: Path
) -> None:
    """delivery-log.md: the columns per kind ("a record leaves out the ones that do not apply to
    its kind"); a `send` is written at the PUBACK (QoS 1) or when handed to the socket (QoS 0,
    and any publish made from inside a listener)."""
    log_path = tmp_path / "kinds.jsonl"
    signals = Signals()
    replied = threading.Event()

    def reply(event: Event) -> None:
        if event.topic == "k/in":
            device.publish("k/out", b"from-listener")  # returns without waiting for its PUBACK
            replied.set()

    device = sdk(broker.port, "kinds", delivery_log=log_path, **signals.kwargs())
    device.subscribe("k/in", listener=reply)
    device.connect()
    device.ready_for_events()
    assert signals.live.wait(WAIT)
    device.publish("k/in", b"go")  # QoS 1: logged at its PUBACK
    assert replied.wait(WAIT)
    device.publish("k/zero", b"z", qos=0)
    device.unsubscribe("k/in")
    device.close(keep_session=False)

    common = {"kind", "device", "time"}
    columns = {
        "send": common | {"topic", "id", "qos"},
        "receive": common | {"topic", "id", "qos", "replayed", "redelivered", "seq", "epoch", "published_at"},
        "subscribe": common | {"topic", "qos", "durable"},
        "unsubscribe": common | {"topic"},
        "session_end": common,
        "connect": common | {"session_present"},
        "live": common | {"replayed_count"},
    }
    logged = records(log_path)
    assert {r["kind"] for r in logged} == set(columns)
    for record in logged:
        assert set(record) == columns[record["kind"]], record
    sends = {(r["topic"], r["qos"]) for r in logged if r["kind"] == "send"}
    assert sends == {("k/in", 1), ("k/out", 1), ("k/zero", 0)}


# ------------------------------------------------------------------------------ fleet.md


def test_fleet_devices_are_named_prefix_and_an_index_of_at_least_three_digits(tmp_path: Path) -> None:
    """fleet.md: devices are named `--prefix` + an index of at least three digits, `dev-000` ...
    `dev-999`, `dev-1000` ..., and a schedule names them so."""
    names = device_names("dev-", 1001)
    assert names[:2] == ["dev-000", "dev-001"] and names[-2:] == ["dev-999", "dev-1000"]
    script = tmp_path / "faults.yaml"
    script.write_text("faults:\n  - {at: 5s, kind: drop, device: dev-1000, for: 1s}\n", encoding="utf-8")
    assert [f.target for f in load_schedule(script, devices=names, duration=45.0)] == ["dev-1000"]


@pytest.mark.parametrize("window", [0, 1001, 2.0, True, "5"])
def test_a_stream_window_other_than_a_whole_number_from_1_to_1000_is_a_value_error(window: object) -> None:
    """streams.md: `window` is "a whole number from 1 to 1000, `None` for the broker's
    `stream_window`; anything else raises `ValueError`" (before connect(), nothing is sent)."""
    reader = DurableClient("window-check", durable_session=False)
    with pytest.raises(ValueError, match="window must be a whole number from 1 to 1000"):
        reader.subscribe_stream("w/#", lambda event: None, window=window)  # type: ignore[arg-type]
    reader.subscribe_stream("w/#", lambda event: None, window=1000)
    reader.close()


def test_every_sdk_error_the_page_lists_is_a_durable_client_error() -> None:
    """sdk.md: "Errors: `DurableClientError` > `Unconnected`, `ConnectFailed`,
    `ControlRequestFailed` (`code`, `message`), `RequestTimeout`, `PersistenceError`,
    `EventNotProcessedError`"."""
    for name in (
        "Unconnected", "ConnectFailed", "ControlRequestFailed", "RequestTimeout", "PersistenceError",
        "EventNotProcessedError",
    ):
        assert issubclass(getattr(durable_client, name), durable_client.DurableClientError), name
    refused = durable_client.ControlRequestFailed("stream_info", "unknown_stream", "no stream covers x/#")
    assert (refused.code, refused.message) == ("unknown_stream", "no stream covers x/#")


def test_a_listener_that_keeps_failing_is_retried_with_a_growing_reconnect_delay(
    broker: Broker, clients: Callable[..., Client], sdk: Callable[..., DurableClient]
) -> None:
    """sdk.md: "A listener that keeps failing is retried with a growing reconnect delay".

    The sdk fixture's delays run from 0.05 s to 0.5 s. Were the delay reset at every reconnect,
    twelve attempts would come within 11 x (0.05 s + a reconnect), well under 1.2 s; growing (full
    jitter under a ceiling doubling from 0.05 s to 0.5 s) they take 2.6 s on average, and below
    1.2 s only with odds far under one in a thousand."""
    attempts: list[float] = []
    cond = threading.Condition()

    def failing(event: Event) -> None:
        with cond:
            attempts.append(time.monotonic())
            cond.notify_all()
        raise RuntimeError("this listener always fails (on purpose)")

    device = sdk(broker.port, "always-fails")
    device.subscribe("fail/x", listener=failing)
    device.connect()
    device.ready_for_events()
    clients(broker.port, "fail-pub", clean_session=True).publish("fail/x", [b"poison"])
    with cond:
        assert cond.wait_for(lambda: len(attempts) >= 12, 3 * WAIT), f"{len(attempts)} attempts"
    assert attempts[11] - attempts[0] > 1.2, [round(b - a, 3) for a, b in itertools.pairwise(attempts)]
    assert device.stats.redeliveries_requested >= 12
