"""Blind pass over docs/streams.md, docs/delivery-log.md and docs/store-layout.md: promises the
other files leave open, each checked from the pages alone against a real broker process, real
LevelDB stores written with plyvel, SDK and paho clients and the `amqtt-durable` CLI."""

from __future__ import annotations

import json
import logging
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import plyvel
import pytest

from conftest import WAIT, Broker, Client, run_cli
from durable_client import DurableClient, Event, RequestTimeout

pytestmark = pytest.mark.timeout(60)

STREAMS = [{"filter": "telemetry/#", "max_count": 100, "max_age": 0}]
U16 = struct.Struct(">H")
U64 = struct.Struct(">Q")
EVENT_HEAD = struct.Struct(">dB")
"""store.py's docstring: a stream event's value is published_at:f64 qos:u8 payload."""


class Seen:
    """Stream events a listener got, and WARNING lines of the SDK's logger, each waited on with a bound."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.warnings: list[str] = []
        self._cond = threading.Condition()

    def __call__(self, event: Event) -> None:
        with self._cond:
            self.events.append(event)
            self._cond.notify_all()

    def warned(self, message: str) -> None:
        with self._cond:
            self.warnings.append(message)
            self._cond.notify_all()

    def wait(self, predicate: Callable[[Seen], bool], timeout: float = WAIT) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self), timeout)


@pytest.fixture
def seen() -> Iterator[Seen]:
    found = Seen()

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno == logging.WARNING:
                found.warned(record.getMessage())

    handler = Handler()
    sdk_log = logging.getLogger("durable_client")
    sdk_log.addHandler(handler)
    try:
        yield found
    finally:
        sdk_log.removeHandler(handler)


def refusals(seen: Seen) -> list[str]:
    return [w for w in seen.warnings if w.startswith("the broker refused 'stream_subscribe'")]


# ------------------------------------------------------------------------------ streams.md


def test_a_stream_subscribe_left_without_an_answer_raises_request_timeout_and_stays_registered(
    broker_factory: Callable[..., Broker],
    sdk: Callable[..., DurableClient],
    clients: Callable[..., Client],
    seen: Seen,
) -> None:
    """streams.md: "`timeout` bounds the wait for the broker's answer"; without one in time it
    raises `RequestTimeout` and keeps the stream, and the positions its `after` gave, registered as
    if called before `connect()`: the broker may have opened it (its events reach the listener), it
    opens at each connect, and a refusal arriving later is the WARNING `the broker refused
    'stream_subscribe' ...` (a broker stopped with SIGSTOP answers nothing)."""
    broker = broker_factory(streams=STREAMS)
    topic = "telemetry/late/x"
    publisher = clients(broker.port, "bsl-late-pub", clean_session=True)
    publisher.publish(topic, [b"one", b"two"])
    reader = sdk(broker.port, "bsl-late", durable_session=False)
    reader.connect(timeout=WAIT)
    with broker.paused():
        for topic_filter, after in (("telemetry/late/#", {topic: 1}), ("nothing-logged/#", None)):
            started = time.monotonic()
            with pytest.raises(RequestTimeout):
                reader.subscribe_stream(topic_filter, seen, after=after, timeout=0.5)
            assert time.monotonic() - started < 0.5 + 2.0, "the wait is bounded by timeout"
    assert seen.wait(lambda s: len(s.events) >= 1 and len(refusals(s)) >= 1), (seen.events, seen.warnings)
    assert [(e.topic, e.seq, e.payload) for e in seen.events] == [(topic, 2, b"two")], "after={topic: 1} was kept"
    assert "unknown_stream" in refusals(seen)[0], refusals(seen)
    broker.stop()
    broker.start()  # the client reconnects: both streams are requested again
    clients(broker.port, "bsl-late-pub2", clean_session=True).publish(topic, [b"three"])
    assert seen.wait(lambda s: len(s.events) >= 2 and len(refusals(s)) >= 2), (seen.events, seen.warnings)
    assert [(e.seq, e.payload) for e in seen.events] == [(2, b"two"), (3, b"three")]


@pytest.mark.parametrize("max_age", [0, 3600], ids=["no-age-limit", "age-limit-an-hour"])
def test_a_max_count_lowered_across_a_restart_holds_from_the_start_without_a_publish(
    broker_factory: Callable[..., Broker],
    sdk: Callable[..., DurableClient],
    clients: Callable[..., Client],
    max_age: int,
) -> None:
    """streams.md: `max_count`: "events kept per topic (oldest go first)". A broker restarted with a
    lower `max_count` keeps that many from its start: a reader that comes before any new publish
    gets the newest `max_count` events only (it took a publish to trim the log, with an age limit
    its first check a quarter of `max_age` later)."""
    broker = broker_factory(streams=[{"filter": "telemetry/#", "max_count": 100, "max_age": max_age}])
    topic = "telemetry/lowered"
    clients(broker.port, "bsl-lowered-pub", clean_session=True).publish(topic, [b"e%d" % i for i in range(1, 31)])
    broker.stop()
    broker.settings["streams"] = [{"filter": "telemetry/#", "max_count": 5, "max_age": max_age}]
    broker.start()
    reader = sdk(broker.port, "bsl-lowered", durable_session=False)
    reader.connect(timeout=WAIT)
    assert broker.wait_until(lambda: reader.stream_info(topic)[topic] == (26, 30), WAIT), reader.stream_info(topic)
    seen = Seen()
    reader.subscribe_stream("telemetry/#", seen)
    assert seen.wait(lambda s: len(s.events) >= 5)
    assert [(e.seq, e.payload) for e in seen.events] == [(i, b"e%d" % i) for i in range(26, 31)]


def test_a_topic_two_stream_filters_match_is_kept_by_the_first_of_them_in_the_list(
    broker_factory: Callable[..., Broker], sdk: Callable[..., DurableClient], clients: Callable[..., Client]
) -> None:
    """streams.md / configuration.md `streams`: "A topic that the filters of two entries match is
    logged under the first of them in the list (its `max_count` and `max_age`)", the more specific
    filter listed later included."""
    broker = broker_factory(
        streams=[
            {"filter": "telemetry/a/#", "max_count": 2},
            {"filter": "telemetry/#", "max_count": 3},
            {"filter": "telemetry/b/#", "max_count": 4},
        ]
    )
    publisher = clients(broker.port, "bsl-first-pub", clean_session=True)
    for topic in ("telemetry/a/x", "telemetry/b/x", "telemetry/c/x"):
        publisher.publish(topic, [b"p%d" % i for i in range(1, 6)])
    reader = sdk(broker.port, "bsl-first", durable_session=False)
    reader.connect(timeout=WAIT)
    assert dict(reader.stream_info("telemetry/#")) == {
        "telemetry/a/x": (4, 5),
        "telemetry/b/x": (3, 5),
        "telemetry/c/x": (3, 5),
    }


def test_a_filter_wider_than_the_configured_streams_reads_the_logged_topics_it_matches(
    broker_factory: Callable[..., Broker], sdk: Callable[..., DurableClient], clients: Callable[..., Client]
) -> None:
    """streams.md: `unknown_stream` is "for a filter no configured stream covers, i.e. that matches
    no topic a configured filter matches: a wider filter such as `#` or `+/a` is taken and reads the
    logged topics it matches"."""
    broker = broker_factory(streams=STREAMS)
    publisher = clients(broker.port, "bsl-wide-pub", clean_session=True)
    publisher.publish("telemetry/a", [b"logged"])
    publisher.publish("other/a", [b"not logged"])
    reader = sdk(broker.port, "bsl-wide", durable_session=False)
    reader.connect(timeout=WAIT)
    assert dict(reader.stream_info("+/a")) == {"telemetry/a": (1, 1)}
    everything, by_level = Seen(), Seen()
    reader.subscribe_stream("#", everything)
    assert everything.wait(lambda s: len(s.events) >= 1)
    reader.unsubscribe("#")
    reader.subscribe_stream("+/a", by_level, after={"telemetry/a": 0})
    assert by_level.wait(lambda s: len(s.events) >= 1)
    publisher.publish("other/a", [b"still not logged"])
    publisher.publish("telemetry/a", [b"second"])
    assert by_level.wait(lambda s: len(s.events) >= 2)
    assert [(e.topic, e.seq, e.payload) for e in everything.events] == [("telemetry/a", 1, b"logged")]
    assert [(e.topic, e.seq, e.payload) for e in by_level.events] == [
        ("telemetry/a", 1, b"logged"),
        ("telemetry/a", 2, b"second"),
    ]


def test_subscribing_a_held_stream_filter_again_replaces_its_listener_and_sends_nothing(
    broker_factory: Callable[..., Broker], sdk: Callable[..., DurableClient], clients: Callable[..., Client]
) -> None:
    """streams.md: "Called again for a filter the client holds, it replaces that filter's listener
    and returns at once: nothing is sent" (so it returns while the broker, stopped with SIGSTOP,
    answers nothing)."""
    broker = broker_factory(streams=STREAMS)
    publisher = clients(broker.port, "bsl-again-stream-pub", clean_session=True)
    publisher.publish("telemetry/held", [b"first"])
    reader = sdk(broker.port, "bsl-again-stream", durable_session=False)
    reader.connect(timeout=WAIT)
    before, after = Seen(), Seen()
    reader.subscribe_stream("telemetry/#", before)
    assert before.wait(lambda s: len(s.events) == 1)
    with broker.paused():
        reader.subscribe_stream("telemetry/#", after, window=10, timeout=0.5)  # no RequestTimeout
    publisher.publish("telemetry/held", [b"second"])
    assert after.wait(lambda s: len(s.events) == 1)
    assert [e.payload for e in before.events] == [b"first"]
    assert [(e.seq, e.payload) for e in after.events] == [(2, b"second")]


# ------------------------------------------------------------------------------ delivery-log.md


def test_an_event_the_broker_sends_again_after_a_listener_raised_is_one_receive_record_marked_redelivered(
    broker: Broker, sdk: Callable[..., DurableClient], clients: Callable[..., Client], tmp_path: Path
) -> None:
    """delivery-log.md: `redelivered`: "sent before by the broker"; a `receive` is written "once
    the listeners have returned, just before the acknowledgement: it is the record of processing"
    (an event whose listener raised was not processed: no record of that first try)."""
    log_path = tmp_path / "device.jsonl"
    tries: list[bytes] = []
    done = threading.Event()

    def fails_once(event: Event) -> None:
        tries.append(event.payload)
        if len(tries) == 1:
            raise RuntimeError("not this time")
        done.set()

    reader = sdk(broker.port, "bsl-again", delivery_log=str(log_path))
    reader.subscribe("again/#", qos=1, listener=fails_once)
    reader.connect(timeout=WAIT)
    reader.ready_for_events()
    clients(broker.port, "bsl-again-pub", clean_session=True).publish("again/x", [b"payload"])
    assert done.wait(WAIT), tries
    reader.close()
    receives = [r for r in map(json.loads, log_path.read_text().splitlines()) if r["kind"] == "receive"]
    assert tries == [b"payload", b"payload"]
    assert [(r["topic"], r["redelivered"], r["seq"], r["epoch"]) for r in receives] == [("again/x", True, 1, 1)]


# ------------------------------------------------------------------------------ store-layout.md


def legacy_key(raw: bytes, event_id: int) -> bytes:
    """An earlier release's event key: `l`, topic, NUL, id (8 bytes, big-endian)."""
    return b"l" + raw + b"\x00" + U64.pack(event_id)


def event_key(raw: bytes, event_id: int) -> bytes:
    """This release's event key (store.py's layout, which store-layout.md links): `e`, the topic's
    byte length (2 bytes), the topic, the id (8 bytes), big-endian."""
    return b"e" + U16.pack(len(raw)) + raw + U64.pack(event_id)


def store_with_events(
    store: str,
    events: dict[str, list[bytes]],
    *,
    compression: str | None = "snappy",
    key: Callable[[bytes, int], bytes] = legacy_key,
) -> None:
    """A store of version 1 with a store id and stream events (published at 1000 + id, QoS 1) under
    ``key`` (an earlier release's by default) and each topic's highest id under `L` + topic."""
    db = plyvel.DB(store, create_if_missing=True, compression=compression)
    try:
        db.put(b"v", b"1")
        db.put(b"i", U64.pack(4242))
        for topic, payloads in events.items():
            raw = topic.encode("utf-8")
            for event_id, payload in enumerate(payloads, start=1):
                db.put(key(raw, event_id), EVENT_HEAD.pack(1000.0 + event_id, 1) + payload)
            db.put(b"L" + raw, U64.pack(len(payloads)))
    finally:
        db.close()


def test_an_earlier_releases_stream_events_are_converted_at_start_and_u0000_topics_dropped_with_a_count(
    broker_factory: Callable[..., Broker], sdk: Callable[..., DurableClient], clients: Callable[..., Client]
) -> None:
    """store-layout.md: "A store written by an earlier release (events keyed by topic, a NUL byte
    and the id) is converted when the broker opens it"; "events and id marks of topics no client
    may publish to (U+0000 in them ...) are dropped, with a WARNING that counts them". The
    converted events keep their ids and publish times, and ids go on after them."""
    broker = broker_factory(start=False, streams=STREAMS)
    store_with_events(broker.store, {"telemetry/old": [b"o1", b"o2", b"o3"], "telemetry/old\x00forged": [b"evil"]})
    broker.start()
    (warning,) = [line for line in broker.log().splitlines() if "U+0000" in line]
    assert " WARNING " in warning and "3 events moved" in warning and "1 events and 1 id marks" in warning, warning
    reader = sdk(broker.port, "bsl-legacy", durable_session=False)
    reader.connect(timeout=WAIT)
    info = reader.stream_info("telemetry/#")
    assert (dict(info), info.store) == ({"telemetry/old": (1, 3)}, 4242)
    seen = Seen()
    reader.subscribe_stream("telemetry/#", seen)
    clients(broker.port, "bsl-legacy-pub", clean_session=True).publish("telemetry/old", [b"o4"])
    assert seen.wait(lambda s: len(s.events) >= 4), seen.events
    got = [(e.topic, e.seq, e.payload) for e in seen.events]
    assert got == [("telemetry/old", i, f"o{i}".encode()) for i in range(1, 5)], got
    assert [e.published_at for e in seen.events[:3]] == [1001.0, 1002.0, 1003.0]


def test_events_that_aged_past_max_age_while_the_broker_was_down_are_gone_from_its_start(
    broker_factory: Callable[..., Broker], sdk: Callable[..., DurableClient]
) -> None:
    """streams.md: "Retention holds from the broker's start: what a store holds ... older than
    `max_age` (aged while the broker was down), is removed as the broker starts, not at the next
    ... age check" (with `max_age` a day, that check is a minute away). The store's events were
    published in 1970, written under this release's keys (so only retention is tested); their ids
    are not reused."""
    broker = broker_factory(start=False, streams=[{"filter": "telemetry/#", "max_count": 100, "max_age": 86400}])
    store_with_events(broker.store, {"telemetry/aged": [b"a1", b"a2", b"a3"]}, key=event_key)
    broker.start()
    reader = sdk(broker.port, "bsl-aged", durable_session=False)
    reader.connect(timeout=WAIT)
    topic = "telemetry/aged"
    assert broker.wait_until(lambda: reader.stream_info(topic)[topic] == (4, 3), WAIT), reader.stream_info(topic)


def test_a_damaged_event_of_an_earlier_release_stops_the_start_and_repair_keeps_the_readable_ones(
    broker_factory: Callable[..., Broker], sdk: Callable[..., DurableClient]
) -> None:
    """store-layout.md: "the old events are read with checksums verified, so a damaged one stops the
    start (corrupted store: run repair) instead of being copied into a sound key"; after `amqtt-durable
    repair` the broker starts and converts what LevelDB's repair kept, each event under its own id.
    One byte of an uncompressed table is flipped inside an event's payload."""
    broker = broker_factory(start=False, streams=STREAMS)
    payloads = [bytes([65 + i % 26]) * 1000 for i in range(1, 41)]  # id i: 1,000 times one letter
    store_with_events(broker.store, {"telemetry/old": payloads}, compression=None)
    db = plyvel.DB(broker.store, compression=None)
    db.compact_range()  # into a table file, whose blocks carry checksums
    db.close()
    (table,) = Path(broker.store).glob("*.ldb")
    data = bytearray(table.read_bytes())
    data[data.index(payloads[20]) + 500] ^= 0xFF  # inside event 21's payload
    table.write_bytes(bytes(data))

    process = broker.spawn()
    assert process.wait(WAIT) == 1, broker.log()
    assert f"run 'amqtt-durable repair {broker.store}'" in broker.log()

    result = run_cli("repair", broker.store)
    assert result.returncode == 0, result.stdout + result.stderr
    broker.start()
    reader = sdk(broker.port, "bsl-damaged", durable_session=False)
    reader.connect(timeout=WAIT)
    seen = Seen()
    reader.subscribe_stream("telemetry/#", seen)
    last_id = reader.stream_info("telemetry/old")["telemetry/old"][1]
    assert last_id == 40, "the id mark is kept"
    assert seen.wait(lambda s: bool(s.events) and s.events[-1].seq == last_id), [e.seq for e in seen.events]
    kept = {e.seq: e.payload for e in seen.events}
    assert 21 not in kept and 0 < len(kept) < 40, sorted(kept)
    assert all(payload == payloads[seq - 1] for seq, payload in kept.items()), "each event under its own id"
