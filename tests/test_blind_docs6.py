"""Black-box tests written from README.md, docs/protocol.md, streams.md, delivery-log.md and
store-layout.md alone, against a real broker over TCP: the edges earlier rounds left open (which
filters a stream covers, the resend back-off starting over, the age check's period, the hello
reply of a connection without a durable session). Each test quotes the promise it checks."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from packet_relay import Packet, PacketRelay
from raw_mqtt_helpers import ConnectionClosedError, raw_connect, read_packet
from test_blind_streams_log import Seen
from test_hostile_wire import wait_until
from test_protocol import request

from conftest import WAIT, Broker, Client, mqtt_packet, mqtt_string, payloads, probe_connack, seen_away
from durable_client import DurableClient, Event
from durable_client.protocol import CONTROL_TOPIC, encode_request

pytestmark = pytest.mark.timeout(60)

STREAM_PREFIX = "$durable/v1/stream/"


def stream_sends(client: Client, topic: str) -> list[tuple[float, int, bool]]:
    """Install a hook recording (arrival time, id, redelivered) of each stream event of ``topic``."""
    seen: list[tuple[float, int, bool]] = []

    def hook(message: mqtt.MQTTMessage) -> None:
        if message.topic == STREAM_PREFIX + topic:
            frame = message.payload
            seen.append((time.monotonic(), int.from_bytes(frame[10:18], "big"), bool(frame[1] & 0x04)))

    client.on_message_hook = hook
    return seen


# ------------------------------------------------------------------------------ protocol.md


def test_hello_reply_gives_the_brokers_max_packet_size_with_or_without_a_durable_session(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """protocol.md, `hello`: the reply holds `protocol`, `epoch` (null without a durable session),
    `session_expiry` (null ... without a durable session), `subscriptions` (null without a durable
    session), `max_packet_size` (the broker's setting: a packet whose remaining length is larger
    closes the connection). Nothing makes `max_packet_size` depend on the session."""
    broker = broker_factory(max_packet_size=5000)
    clean = clients(broker.port, "d6-mps-clean", clean_session=True)
    reply = request(clean, "hello", session_expiry=60)
    assert reply.ok, reply
    assert reply.fields["protocol"] == 1
    assert (reply.fields["epoch"], reply.fields["session_expiry"], reply.fields["subscriptions"]) == (None, None, None)
    assert reply.fields["max_packet_size"] == 5000
    durable = clients(broker.port, "d6-mps-durable")
    durable.subscribe("d6/x", 1)
    reply = request(durable, "hello")
    assert reply.ok and reply.fields["max_packet_size"] == 5000
    assert reply.fields["subscriptions"] == {"d6/x": 1}
    assert isinstance(reply.fields["epoch"], int) and reply.fields["epoch"] >= 1
    # a PUBLISH whose remaining length passes it closes the connection
    durable.paho.publish("d6/big", b"x" * 5000, qos=0)
    assert durable.wait_disconnected(WAIT), "a packet over max_packet_size closes the connection"


def test_stream_info_without_a_filter_reads_every_log_and_echoes_hash(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """protocol.md, `stream_info`: `filter` (optional, default `#`); reply: `filter` (echoed), `topics`
    ({topic: {first, last, count}}) of the logs matching the filter, and `store`."""
    broker = broker_factory(streams=[{"filter": "si/#"}, {"filter": "sj/+"}])
    publisher = clients(broker.port, "d6-si-pub", clean_session=True)
    publisher.publish("si/a", payloads(2))
    publisher.publish("sj/b", payloads(3))
    publisher.publish("other", payloads(1))
    reader = clients(broker.port, "d6-si-reader", clean_session=True)
    reply = request(reader, "stream_info")
    assert reply.ok, reply
    assert reply.fields["filter"] == "#"
    assert reply.fields["topics"] == {
        "si/a": {"first": 1, "last": 2, "count": 2},
        "sj/b": {"first": 1, "last": 3, "count": 3},
    }
    assert isinstance(reply.fields["store"], int)


@pytest.mark.parametrize(
    ("topic_filter", "expected"),
    [
        ("+/a", {"tel/a"}),  # wider than tel/#, it matches tel/a: covered
        ("tel/none/+", set()),  # inside tel/#, no log yet: covered, nothing listed
        ("#", {"tel/a", "tel/b/c"}),
        ("+/+/c", {"tel/b/c"}),
        ("other/#", None),  # matches no topic tel/# matches
        ("te/#", None),
        ("$SYS/#", None),  # tel/# matches no $SYS topic
        ("+/#", {"tel/a", "tel/b/c"}),
    ],
)
def test_stream_info_takes_a_filter_when_some_topic_matches_it_and_a_configured_one(
    broker_factory: Callable[..., Broker],
    clients: Callable[..., Client],
    topic_filter: str,
    expected: set[str] | None,
) -> None:
    """protocol.md: `stream_info` "A filter no configured stream covers is refused with
    `unknown_stream`"; streams.md: a filter no configured stream covers is one "that matches no topic
    a configured filter matches: a wider filter such as `#` or `+/a` is taken and reads the logged
    topics it matches"."""
    broker = broker_factory(streams=[{"filter": "tel/#"}])
    publisher = clients(broker.port, "d6-cover-pub", clean_session=True)
    publisher.publish("tel/a", [b"1"])
    publisher.publish("tel/b/c", [b"2"])
    reader = clients(broker.port, "d6-cover-reader", clean_session=True)
    info = request(reader, "stream_info", filter=topic_filter)
    opened = request(reader, "stream_subscribe", filter=topic_filter)
    if expected is None:
        assert (info.ok, info.error_code) == (False, "unknown_stream"), info
        assert (opened.ok, opened.error_code) == (False, "unknown_stream"), opened
        return
    assert info.ok, info
    assert set(info.fields["topics"]) == expected
    assert opened.ok, opened
    assert set(opened.fields["topics"]) == expected


@pytest.mark.slow
def test_a_resend_backs_off_doubling_and_progress_starts_it_again_at_stream_ack_timeout(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """protocol.md, Resends back off: "a resend waits `stream_ack_timeout`, then twice as long after each
    resend that brought no acknowledged progress ...; any progress starts again at `stream_ack_timeout`"."""
    timeout = 0.3
    broker = broker_factory(streams=[{"filter": "bo/#"}], stream_ack_timeout=timeout)
    clients(broker.port, "d6-bo-pub", clean_session=True).publish("bo/a", payloads(3))
    reader = clients(broker.port, "d6-bo-reader", clean_session=True)
    sends = stream_sends(reader, "bo/a")
    assert request(reader, "stream_subscribe", filter="bo/a", window=2).ok
    # never acknowledged: id 1 comes at the subscribe, then again after 0.3, 0.6, 1.2 s
    # ids 1 and 2 go out together: both 4 times before the ack (else 2's 4th send, seen after the ack,
    # would pass for the resend that progress brings)
    assert reader.wait_for(lambda _: all(sum(1 for _t, i, _r in sends if i == n) >= 4 for n in (1, 2)), timeout=WAIT)
    ones = [t for t, i, _r in sends if i == 1][:4]
    waits = [later - earlier for earlier, later in itertools.pairwise(ones)]
    for doubling, wait in enumerate(waits):  # never early; late by at most a loaded machine's second
        expected = timeout * 2**doubling
        assert 0.8 * expected <= wait <= expected + 1.0, f"waits between resends {waits}: each twice the last"
    next_backed_off = 2 * waits[-1]  # about 2.4 s
    acked_at = time.monotonic()
    reader.paho.publish(CONTROL_TOPIC, encode_request("stream_ack", topic="bo/a", id=1))
    assert reader.wait_for(lambda _: any(i == 3 for _t, i, _r in sends), timeout=WAIT), "the window refills at once"
    assert reader.wait_for(lambda _: any(i == 2 and t > acked_at for t, i, r in sends if r), timeout=WAIT)
    resent_at = next(t for t, i, r in sends if i == 2 and r and t > acked_at)
    assert resent_at - acked_at < min(next_backed_off, 1.5), (
        f"after progress the next resend came {resent_at - acked_at:.2f} s later, not about {timeout} s"
    )


# ------------------------------------------------------------------------------ streams.md


@pytest.mark.slow
def test_age_retention_removes_an_event_within_a_quarter_of_the_shortest_max_age_after_it_aged(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """streams.md: "logs with an age limit are checked every quarter of the shortest `max_age` (at least
    0.5 s, at most 60 s)"; an event is kept `max_age` seconds. With max_age 2 s beside one of 60 s, a
    2 s event goes between 2 s and 2.5 s after its publish (plus the machine's slack), the other stays."""
    broker = broker_factory(streams=[{"filter": "old/#", "max_age": 60}, {"filter": "young/#", "max_age": 2}])
    publisher = clients(broker.port, "d6-age-pub", clean_session=True)
    reader = clients(broker.port, "d6-age-reader", clean_session=True)
    publisher.publish("old/a", [b"kept"])
    before = time.monotonic()
    publisher.publish("young/a", [b"aged"])
    acked = time.monotonic()

    def count() -> int:
        return int(request(reader, "stream_info", filter="young/#").fields["topics"]["young/a"]["count"])

    assert wait_until(lambda: count() == 0, WAIT)
    gone = time.monotonic()
    assert gone - before >= 2.0, f"removed {gone - before:.2f} s after its publish: kept less than max_age"
    assert gone - acked <= 2.0 + 0.5 + 1.5, f"removed {gone - acked:.2f} s after its publish"
    info = request(reader, "stream_info", filter="old/#").fields["topics"]
    assert info == {"old/a": {"first": 1, "last": 1, "count": 1}}


# ------------------------------------------------------------------------------ delivery-log.md


def read_log(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def test_a_stream_subscription_writes_no_subscribe_record_and_its_unsubscribe_writes_one(
    broker_factory: Callable[..., Broker],
    clients: Callable[..., Client],
    sdk: Callable[..., DurableClient],
    tmp_path: Path,
) -> None:
    """delivery-log.md: "A stream subscription (`subscribe_stream()`) writes no `subscribe` record";
    "`unsubscribe` is written when the application unsubscribes (a stream's filter too)"; a stream event's
    `receive` has the stream log id as `seq` and epoch 0; `replayed` ("delivered before the replay marker
    (queued while the device was away or not ready)") is false: stream events are never held or queued."""
    broker = broker_factory(streams=[{"filter": "dl6/#"}])
    clients(broker.port, "d6-dl-pub", clean_session=True).publish("dl6/a", [b"one", b"two"])
    log_path = tmp_path / "reader.jsonl"
    got: list[int] = []
    reader = sdk(broker.port, "d6-dl-reader", durable_session=False, delivery_log=str(log_path))
    reader.subscribe_stream("dl6/#", lambda event: got.append(event.seq), window=10)
    reader.connect(timeout=WAIT)
    assert wait_until(lambda: len([r for r in read_log(log_path) if r["kind"] == "receive"]) == 2, WAIT)
    reader.unsubscribe("dl6/#")
    records = read_log(log_path)
    assert not [r for r in records if r["kind"] == "subscribe"], records
    receives = [(r["topic"], r["seq"], r["epoch"]) for r in records if r["kind"] == "receive"]
    assert receives == [("dl6/a", 1, 0), ("dl6/a", 2, 0)]
    for record in (r for r in records if r["kind"] == "receive"):  # never held, never queued: not replayed
        assert (record["replayed"], record["redelivered"], record["device"]) == (False, False, "d6-dl-reader")
        assert isinstance(record["published_at"], float) and record["published_at"] <= record["time"]
    unsubscribes = [r for r in records if r["kind"] == "unsubscribe"]
    assert [(r["topic"], r["device"]) for r in unsubscribes] == [("dl6/#", "d6-dl-reader")], records


@dataclass
class TailRun:
    """A CPL-2 stream reader of tail/# with a delivery log, run to a condition and closed, again and again
    (a restarted process: the same state folder and log); the broker's publisher beside it."""

    port: int
    publisher: Client
    sdk: Callable[..., DurableClient]
    log_path: Path
    state: Path

    def run(self, until: Callable[[Seen], bool]) -> list[Event]:
        seen = Seen()
        reader = self.sdk(
            self.port,
            "d6-tail",
            durable_session=False,
            persistence="disk",
            state_dir=str(self.state),
            delivery_log=str(self.log_path),
        )
        reader.subscribe_stream("tail/#", seen, window=10)
        reader.connect(timeout=WAIT)
        assert seen.wait(until)
        reader.close()
        return seen.events

    def template(self) -> dict[str, Any]:
        """A receive record the reader wrote, to write others like it."""
        return next(r for r in read_log(self.log_path) if r["kind"] == "receive")


@pytest.fixture
def tail(
    broker_factory: Callable[..., Broker],
    clients: Callable[..., Client],
    sdk: Callable[..., DurableClient],
    tmp_path: Path,
) -> TailRun:
    """A first run that processed tail/r ids 1 to 3."""
    broker = broker_factory(streams=[{"filter": "tail/#"}])
    publisher = clients(broker.port, "d6-tail-pub", clean_session=True)
    publisher.publish("tail/r", [b"r1", b"r2", b"r3"])
    run = TailRun(broker.port, publisher, sdk, tmp_path / "shared.jsonl", tmp_path / "state")
    run.run(lambda seen: len(seen.events) == 3)
    return run


def resumed_at(events: list[Event]) -> list[int]:
    return [event.seq for event in events]


def test_only_the_devices_very_last_receive_moves_a_stream_position_whatever_follows_it_in_the_log(
    tail: TailRun,
) -> None:
    """delivery-log.md: a `DurableClient` created with `persistence="disk"` and a delivery log "takes the last
    `receive` records of its own client id (`device`; a shared file is fine): ... the device's very last
    `receive`, when it is a stream event, moves that topic's position forward (only that one can be unmarked
    ...). ... other lines (another device's records too) and a last line cut short by a crash are ignored". A
    crash after the records of tail/r id 4 and tail/s id 1 (the device's last), another device's record and a
    line cut short after them: tail/s resumes after id 1, tail/r gets id 4 again."""
    tail.publisher.publish("tail/r", [b"r4", b"r5"])
    tail.publisher.publish("tail/s", [b"s1", b"s2"])
    template = tail.template()
    with tail.log_path.open("a") as out:  # processed, recorded, killed before the marks
        out.write(json.dumps({**template, "topic": "tail/r", "seq": 4, "time": time.time()}) + "\n")
        out.write(json.dumps({**template, "topic": "tail/s", "seq": 1, "time": time.time()}) + "\n")
        other = {**template, "device": "d6-other", "topic": "tail/s", "seq": 2, "time": time.time()}
        out.write(json.dumps(other) + "\n")
        out.write(json.dumps({**template, "topic": "tail/r", "seq": 5})[:40])  # the crash cut it short
    events = tail.run(lambda seen: len(seen.events) == 3)
    got = sorted((event.topic, event.seq) for event in events)
    assert got == [("tail/r", 4), ("tail/r", 5), ("tail/s", 2)], got


def test_only_publishes_under_durable_slash_are_control_traffic(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """protocol.md: "The broker takes every PUBLISH under `_durable/` off the message path ... A PUBLISH
    under `_durable/` other than `_durable/v1/ctl` gets the error `unknown_topic`". `_durable` itself,
    `_durablex/y` and `_DURABLE/v1/ctl` are not under `_durable/`: ordinary topics, routed and logged."""
    broker = broker_factory(streams=[{"filter": "#"}])
    watcher = clients(broker.port, "d6-under-watch", clean_session=True)
    watcher.subscribe("#", 1)
    sender = clients(broker.port, "d6-under-send", clean_session=True)
    hello = encode_request("hello", 10**9)  # a req id request() never uses
    ordinary = ["_durable", "_durablex/y", "_DURABLE/v1/ctl"]
    control = ["_durable/", "_durable/v1", "_durable/v1/ctl/", "_durable/v2/ctl"]
    for topic in ordinary + control:
        sender.paho.publish(topic, hello, qos=1)
    sender.publish("d6-fence", [b"f"])
    assert watcher.wait_for(lambda ms: any(m.topic == "d6-fence" for m in ms))
    assert [m.topic for m in watcher.messages] == [*ordinary, "d6-fence"]
    assert sender.wait_for(lambda ms: sum(1 for m in ms if m.topic == "$durable/v1/reply") == len(control))
    replies = [json.loads(m.payload) for m in sender.messages if m.topic == "$durable/v1/reply"]
    assert [r["error"]["code"] for r in replies] == ["unknown_topic"] * len(control)
    info = request(sender, "stream_info")
    assert set(info.fields["topics"]) == {*ordinary, "d6-fence"}


@pytest.fixture
def relays() -> Iterator[Callable[[int], PacketRelay]]:
    made: list[PacketRelay] = []

    def make(port: int) -> PacketRelay:
        made.append(PacketRelay(port))
        return made[-1]

    yield make
    for relay in made:
        relay.close()


def test_the_sdk_acknowledges_a_stream_at_least_every_64_events_and_not_one_ack_per_event(
    broker_factory: Callable[..., Broker],
    clients: Callable[..., Client],
    sdk: Callable[..., DurableClient],
    relays: Callable[[int], PacketRelay],
) -> None:
    """protocol.md, Acknowledgements are cumulative: "The SDK sends one per topic when its network loop finds
    nothing more to read (the window is used up, or the log is read to its end), and after every 64 events of a
    topic while events keep coming, instead of one per event"."""
    count = 400
    broker = broker_factory(streams=[{"filter": "ack6/#"}])
    clients(broker.port, "d6-ack-pub", clean_session=True).publish("ack6/a", payloads(count))
    relay = relays(broker.port)
    seen = Seen()
    reader = sdk(relay.port, "d6-ack-reader", durable_session=False)
    reader.subscribe_stream("ack6/#", seen, window=1000)
    reader.connect(timeout=WAIT)
    assert seen.wait(lambda found: len(found.events) == count)

    def is_ack(packet: Packet) -> bool:
        found = packet.control() if packet.direction == "up" else None
        return found is not None and found.get("op") == "stream_ack"

    relay.wait_seen(lambda p: is_ack(p) and p.control()["id"] == count)  # type: ignore[index]
    acked = [p.control()["id"] for p in relay.seen if is_ack(p)]  # type: ignore[index]
    assert acked == sorted(acked) and acked[-1] == count, acked
    assert len(acked) < count / 4, f"{len(acked)} acks for {count} events: cumulative, not one per event"
    steps = [later - earlier for earlier, later in itertools.pairwise([0, *acked])]
    assert max(steps) <= 64, f"acked ids {acked}: one at least every 64 events while they keep coming"
    assert [event.seq for event in seen.events] == list(range(1, count + 1))


@pytest.mark.parametrize(
    ("after_it", "resumes_at"),
    [
        (None, 5),  # the stream event is the device's very last receive: its position moves
        ({"topic": "plain6/x", "seq": 0, "epoch": 0}, 4),  # a raw event processed after it: its mark was written
        ({"topic": "plain6/x", "seq": 3, "epoch": 7}, 4),  # a session event (of another epoch) after it
    ],
    ids=["last", "raw-after", "session-after"],
)
def test_a_receive_of_any_kind_after_a_stream_event_shows_its_mark_was_written(
    tail: TailRun, after_it: dict[str, Any] | None, resumes_at: int
) -> None:
    """delivery-log.md: "the device's very last `receive`, when it is a stream event, moves that topic's
    position forward (only that one can be unmarked: a `receive` of the device after it, a raw event's or a
    session event's of any epoch too, shows that its mark was written, so then no position moves ...)"."""
    tail.publisher.publish("tail/r", [b"r4", b"r5"])
    template = tail.template()
    with tail.log_path.open("a") as out:
        out.write(json.dumps({**template, "seq": 4, "time": time.time()}) + "\n")
        if after_it is not None:
            out.write(json.dumps({**template, **after_it, "time": time.time()}) + "\n")
    events = tail.run(lambda seen: bool(seen.events) and seen.events[-1].seq == 5)
    assert resumed_at(events) == list(range(resumes_at, 6))


@pytest.mark.parametrize(("filler_kib", "resumes_at"), [(60, 5), (66, 4)])
def test_only_the_last_64_kib_of_the_log_are_read_before_connecting(
    tail: TailRun, filler_kib: int, resumes_at: int
) -> None:
    """delivery-log.md: "a `DurableClient` created with both reads the last 64 KiB of its existing log before it
    connects and takes the last `receive` records of its own client id (`device`; a shared file is fine)". An
    unmarked stream receive followed by 60 KiB of another device's records is read (its position moves); one
    followed by 66 KiB of them is not (the event comes again)."""
    tail.publisher.publish("tail/r", [b"r4", b"r5"])
    template = tail.template()
    other = json.dumps({**template, "device": "d6-other", "topic": "tail/o", "seq": 1, "time": time.time()}) + "\n"
    with tail.log_path.open("a") as out:
        out.write(json.dumps({**template, "seq": 4, "time": time.time()}) + "\n")
        out.write(other * (filler_kib * 1024 // len(other) + 1))
    events = tail.run(lambda seen: bool(seen.events) and seen.events[-1].seq == 5)
    assert resumed_at(events) == list(range(resumes_at, 6))


def test_a_stream_event_carries_its_publish_qos_epoch_0_and_never_the_retained_flag(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """protocol.md, Frames: flags "`0x02` retained (an initial value queued with a new subscription) ..., bits
    3-4 (`0x18`) the publish QoS of a stream event (stream events travel at QoS 0)"; epoch "0 for stream events";
    sequence id "the stream log id". A retained publish's stream event is no initial value: no `0x02`."""
    broker = broker_factory(streams=[{"filter": "fq6/#"}])
    publisher = clients(broker.port, "d6-fq-pub", clean_session=True)
    publisher.publish("fq6/a", [b"two"], qos=2, retain=True)
    publisher.publish("fq6/a", [b"zero"], qos=0)
    publisher.publish("fq6/a", [b"one"], qos=1, retain=True)
    assert wait_until(lambda: request(publisher, "stream_info").fields["topics"]["fq6/a"]["count"] == 3, WAIT)
    reader = clients(broker.port, "d6-fq-reader", clean_session=True)
    assert request(reader, "stream_subscribe", filter="fq6/#", window=10).ok
    assert reader.wait_for(lambda ms: len([m for m in ms if m.topic.startswith(STREAM_PREFIX)]) == 3)
    events = [m for m in reader.messages if m.topic.startswith(STREAM_PREFIX)]
    assert [(m.qos, m.retain) for m in events] == [(0, False)] * 3
    frames = [m.payload for m in events]
    assert [(f[0], f[1], f[2:10], int.from_bytes(f[10:18], "big"), f[26:]) for f in frames] == [
        (1, 2 << 3, bytes(8), 1, b"two"),
        (1, 0, bytes(8), 2, b"zero"),
        (1, 1 << 3, bytes(8), 3, b"one"),
    ]


def test_a_publish_is_in_its_stream_log_by_the_time_of_its_puback(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """streams.md: "Every publish to a logged topic is appended to its log in the same LevelDB commit that
    queues it, before the PUBACK": a `stream_info` sent after each PUBACK already counts that publish."""
    broker = broker_factory(streams=[{"filter": "pa6/#"}])
    publisher = clients(broker.port, "d6-pa-pub", clean_session=True)
    reader = clients(broker.port, "d6-pa-reader", clean_session=True)
    for index in range(1, 31):
        publisher.publish("pa6/a", [b"%d" % index], qos=1 + index % 2)
        info = request(reader, "stream_info", filter="pa6/a")
        assert info.fields["topics"] == {"pa6/a": {"first": 1, "last": index, "count": index}}, index


@pytest.mark.parametrize(
    ("fields", "code"),
    [
        ({"v": 1, "op": "hello", "req": 3, "session_expiry": -1}, "malformed"),
        ({"v": 1, "op": "hello", "req": 3, "client_id": "d6-someone-else"}, "not_your_session"),
        ({"v": 2, "op": "hello", "req": 3}, "unsupported_version"),
        ({"v": 1, "op": "hello", "req": "3"}, "malformed"),
        ({"v": 1, "op": "hello", "req": 3, "session_expiry": 60, "client_id": ""}, "malformed"),
    ],
)
def test_a_refused_hello_leaves_a_plain_durable_session_plain(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], fields: dict[str, Any], code: str
) -> None:
    """protocol.md: "A refused request changes nothing: the connection stays up and the session is untouched";
    "Without a `hello`, a durable session is a plain MQTT session: no frames, no hold, no marker". After a
    refused hello the session's messages still come at once and unframed, now and after a reconnect."""
    broker = broker_factory(metrics_interval=0.2)
    device = clients(broker.port, "d6-plain")
    device.subscribe("plain6/#", 1)
    device.paho.publish(CONTROL_TOPIC, json.dumps(fields).encode())
    assert device.wait_for(lambda ms: any(m.topic == "$durable/v1/reply" for m in ms))
    reply = json.loads(next(m.payload for m in device.messages if m.topic == "$durable/v1/reply"))
    assert (reply["ok"], reply["error"]["code"]) == (False, code), reply
    publisher = clients(broker.port, "d6-plain-pub", clean_session=True)
    publisher.publish("plain6/a", [b"at once"])
    assert device.wait_for(lambda ms: any(m.topic == "plain6/a" for m in ms)), "held, as an SDK session's would be"
    assert [m.payload for m in device.messages if m.topic == "plain6/a"] == [b"at once"], "framed"
    device.disconnect()
    seen_away(clients, broker, 1)
    publisher.publish("plain6/a", [b"queued"])
    device.messages.clear()
    assert device.connect() is True
    assert device.wait_for(lambda ms: any(m.topic == "plain6/a" for m in ms))
    assert [m.payload for m in device.messages if m.topic == "plain6/a"] == [b"queued"]


@pytest.mark.parametrize(("topic", "qos"), [("$durable/v1/ctl", 0), ("$durable/v1/ctl", 1), ("$SYS/d6", 1)])
def test_a_publish_to_a_dollar_topic_closes_the_connection_unanswered(
    broker_factory: Callable[..., Broker], topic: str, qos: int
) -> None:
    """protocol.md: "Client-to-broker control cannot use a `$` topic: amqtt closes connections that publish to
    one." Nothing answers it first: no reply, no PUBACK."""
    broker = broker_factory()
    sock = raw_connect(broker.port, "d6-dollar", clean=True)
    packet_id = b"\x00\x07" if qos else b""
    request_ = json.dumps({"v": 1, "op": "hello", "req": 1}).encode()
    sock.sendall(mqtt_packet(0x30 | qos << 1, mqtt_string(topic) + packet_id + request_))
    with pytest.raises(ConnectionClosedError):
        read_packet(sock)
    sock.close()
    assert probe_connack(broker.port), "the broker serves on"


def publish_raw(port: int, topic: str, count: int, chunk: int = 2000) -> None:
    """``count`` QoS 1 PUBLISHes on one raw connection, ``chunk`` per write, each chunk's PUBACKs read before
    the next (packet ids 1..chunk, reused per chunk once acknowledged)."""
    sock = raw_connect(port, "d6-bulk-pub", clean=True)
    topic_field = mqtt_string(topic)
    sent = 0
    while sent < count:
        size = min(chunk, count - sent)
        sock.sendall(
            b"".join(
                mqtt_packet(0x32, topic_field + (i + 1).to_bytes(2, "big") + b"m%07d" % (sent + i)) for i in range(size)
            )
        )
        acked = 0
        for _ in range(size):
            first, _body = read_packet(sock)
            acked += first == 0x40
        assert acked == size
        sent += size
    sock.close()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_queue_past_65535_messages_is_delivered_whole_in_order_and_unretained(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """README: stock amqtt "past 65,535 queued messages ... the rest are dropped silently (packet-id
    exhaustion)" and "queued messages are replayed with RETAIN=1"; a durable session's queue "survive[s]
    disconnects". 70,000 messages queued while a plain durable client is away all come, in order, RETAIN 0."""
    count = 70_000
    broker = broker_factory(metrics_interval=0.2)
    device = clients(broker.port, "d6-bulk")
    device.subscribe("bulk6/t", 1)
    device.disconnect()
    seen_away(clients, broker, 1)
    publish_raw(broker.port, "bulk6/t", count)
    device.messages.clear()
    assert device.connect() is True
    got = device.wait_messages(count, timeout=180)
    assert len(got) == count, f"{len(got)} of {count}"
    assert [m.payload for m in got] == [b"m%07d" % i for i in range(count)]
    assert not any(m.retain for m in got)
    assert {m.qos for m in got} == {1}


def stream_ids(client: Client, topic: str) -> list[int]:
    return [int.from_bytes(m.payload[10:18], "big") for m in client.messages if m.topic == STREAM_PREFIX + topic]


def test_a_topic_already_open_keeps_its_window_and_a_new_log_takes_the_first_matching_filters(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """protocol.md, `stream_subscribe`: "A topic already open on this connection (through an earlier
    `stream_subscribe`) keeps its position and its window: its `after` entry and this `window` are ignored for
    it ...; a topic whose log appears later opens with the window last given to the earliest-opened of the
    connection's open filters that match it"; at most `window` unacknowledged per topic."""
    broker = broker_factory(streams=[{"filter": "kw6/#"}])
    publisher = clients(broker.port, "d6-kw-pub", clean_session=True)
    publisher.publish("kw6/a", payloads(8))
    reader = clients(broker.port, "d6-kw-reader", clean_session=True)
    assert request(reader, "stream_subscribe", filter="kw6/#", window=1).ok
    assert request(reader, "stream_subscribe", filter="kw6/a", window=5).ok
    assert request(reader, "stream_subscribe", filter="kw6/+", window=4).ok
    assert request(reader, "stream_subscribe", filter="kw6/#", window=2).ok  # the same filter: its new window
    assert reader.wait_for(lambda _: len(stream_ids(reader, "kw6/a")) >= 1)
    assert not reader.wait_for(lambda _: len(stream_ids(reader, "kw6/a")) > 1, timeout=0.5), "window 1 kept"
    reader.paho.publish(CONTROL_TOPIC, encode_request("stream_ack", topic="kw6/a", id=1))
    assert reader.wait_for(lambda _: len(stream_ids(reader, "kw6/a")) >= 2)
    assert not reader.wait_for(lambda _: len(stream_ids(reader, "kw6/a")) > 2, timeout=0.5), "window 1 kept"
    assert stream_ids(reader, "kw6/a") == [1, 2]
    publisher.publish("kw6/b", payloads(8))  # a new log: kw6/# (opened first, window now 2) decides
    assert reader.wait_for(lambda _: len(stream_ids(reader, "kw6/b")) >= 2)
    assert not reader.wait_for(lambda _: len(stream_ids(reader, "kw6/b")) > 2, timeout=0.5), "window 2"
    assert stream_ids(reader, "kw6/b") == [1, 2]


def test_the_position_kept_for_a_topic_without_a_log_is_the_one_presented_last(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """protocol.md, `stream_subscribe`: "The position of a topic that has no log yet is kept until its log
    appears (a later `stream_subscribe` that presents one for it replaces it)"; the topic then sends from the id
    after that position."""
    broker = broker_factory(streams=[{"filter": "kp6/#"}])
    reader = clients(broker.port, "d6-kp-reader", clean_session=True)
    first = request(reader, "stream_subscribe", filter="kp6/#", after={"kp6/new": 5}, window=10)
    assert first.ok and first.fields["topics"] == {} and first.fields["ahead"] == {}, first
    assert request(reader, "stream_subscribe", filter="kp6/+", after={"kp6/new": 2}, window=10).ok
    clients(broker.port, "d6-kp-pub", clean_session=True).publish("kp6/new", payloads(6))
    assert reader.wait_for(lambda _: len(stream_ids(reader, "kp6/new")) >= 4)
    assert stream_ids(reader, "kp6/new")[:4] == [3, 4, 5, 6]


def test_an_open_stream_goes_on_after_its_connection_ends_its_durable_session(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """protocol.md: stream ops need no durable session ("A connection (with or without a durable session) opens a
    stream"; "The positions live on the client: when the connection ends the broker forgets them"): `end_session`
    deletes the session, its queue and subscriptions, not the connection's streams, which keep sending."""
    broker = broker_factory(streams=[{"filter": "es6/#"}])
    publisher = clients(broker.port, "d6-es-pub", clean_session=True)
    publisher.publish("es6/a", payloads(2))
    device = clients(broker.port, "d6-es")
    device.subscribe("es6/#", 1)
    assert request(device, "hello").ok
    assert request(device, "stream_subscribe", filter="es6/#", window=1).ok
    assert device.wait_for(lambda _: stream_ids(device, "es6/a") == [1])
    ended = request(device, "end_session")
    assert ended.ok and ended.fields["messages_dropped"] == 0, ended
    device.paho.publish(CONTROL_TOPIC, encode_request("stream_ack", topic="es6/a", id=1))
    assert device.wait_for(lambda _: stream_ids(device, "es6/a")[:2] == [1, 2])
    publisher.publish("es6/a", [b"after the end"])
    device.paho.publish(CONTROL_TOPIC, encode_request("stream_ack", topic="es6/a", id=2))
    assert device.wait_for(lambda _: stream_ids(device, "es6/a")[:3] == [1, 2, 3])
    assert request(device, "stream_info", filter="es6/#").fields["topics"]["es6/a"]["last"] == 3
    live = [m for m in device.messages if m.topic == "es6/a"]
    assert live == [], "the session (and its subscription) is gone: no session message"
    assert request(device, "ready").error_code == "no_session"
