"""durable_client._receiver: dispatch, dedup and exactly-once, driven without a network."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from durable_client._paho import Inbound
from durable_client._receiver import Outcome, Receiver
from durable_client._registry import Registry, StreamSubscription, Subscription
from durable_client.cache import LastValueCache
from durable_client.events import Event
from durable_client.persistence import DiskState, MemoryState, SessionState
from durable_client.protocol import (
    FLAG_REDELIVERED,
    FLAG_REPLAYED,
    FLAG_RETAINED,
    MARKER_TOPIC,
    REPLY_TOPIC,
    STREAM_TOPIC_PREFIX,
    LiveSubscription,
    Marker,
    ProtocolError,
    Reply,
    encode_error,
    encode_frame,
    encode_marker,
    encode_reply,
)


class Harness:
    def __init__(self, *, framed: bool = True, state: SessionState | None = None) -> None:
        self.state = state or MemoryState()
        self.cache = LastValueCache()
        self.registry = Registry()
        self.replies: list[Reply] = []
        self.markers: list[Marker] = []
        self.seen: list[tuple[str, Event]] = []
        self.receiver = Receiver(
            framed=framed,
            state=self.state,
            cache=self.cache,
            registry=self.registry,
            on_reply=self.replies.append,
            on_marker=self.markers.append,
            clock=lambda: 42.0,
        )
        self._mid = 0

    def listen(self, topic_filter: str, name: str | None = None, *, fail_on: int | None = None) -> None:
        label = name or topic_filter

        def listener(event: Event) -> None:
            if fail_on is not None and event.seq == fail_on:
                raise RuntimeError(f"listener {label} cannot take seq {event.seq}")
            self.seen.append((label, event))

        self.registry.put(Subscription(topic_filter, 1, True, listener))

    def listen_stream(self, topic_filter: str, *, fail_on: int | None = None) -> None:
        def listener(event: Event) -> None:
            if fail_on is not None and event.seq == fail_on:
                raise RuntimeError("stream listener failed")
            self.seen.append((topic_filter, event))

        self.registry.put_stream(StreamSubscription(topic_filter, listener, None))

    def message(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False, dup: bool = False) -> Inbound:
        self._mid += 1
        return Inbound(topic, payload, qos, retain, dup, self._mid)

    def event(
        self, topic: str, seq: int, payload: bytes = b"v", *, epoch: int = 1, flags: int = 0, dup: bool = False
    ) -> Outcome:
        data = encode_frame(flags, epoch, seq, 1000.0 + seq) + payload
        return self.receiver.handle(self.message(topic, data, dup=dup))

    def stream(self, topic: str, event_id: int, payload: bytes = b"v", flags: int = 0) -> Outcome:
        data = encode_frame(flags, 0, event_id, 2000.0 + event_id) + payload
        return self.receiver.handle(self.message(STREAM_TOPIC_PREFIX + topic, data, qos=0))

    def seqs(self) -> list[int]:
        return [event.seq for _, event in self.seen]


ACK = Outcome(ack=True)


# ------------------------------------------------------------ session events
def test_event_reaches_listener_then_mark_then_ack() -> None:
    h = Harness()
    h.listen("a/#")
    assert h.event("a/b", 5, b"\x00payload", flags=FLAG_REDELIVERED) == ACK
    ((_, event),) = h.seen
    assert event == Event("a/b", b"\x00payload", 1, 5, 1, 1005.0, False, False, True, False)
    assert h.state.get_mark(1) == 5
    assert h.receiver.counters.processed == 1 and h.receiver.counters.received == 1


def test_every_matching_listener_in_registration_order() -> None:
    h = Harness()
    h.listen("a/#", "first")
    h.listen("x/y", "unrelated")
    h.listen("a/+", "second")
    h.event("a/b", 1)
    assert [name for name, _ in h.seen] == ["first", "second"]


def test_event_without_listener_still_counts_and_feeds_the_cache() -> None:
    h = Harness()
    assert h.event("a/b", 1, b"value") == ACK
    assert h.cache.get("a/b") == b"value" and h.state.get_mark(1) == 1


def test_duplicates_are_acked_and_skip_listeners() -> None:
    h = Harness()
    h.listen("#")
    for seq in (1, 2, 3):
        h.event("t", seq)
    assert h.event("t", 2, dup=True) == ACK
    assert h.event("t", 3, flags=FLAG_REDELIVERED) == ACK
    assert h.seqs() == [1, 2, 3]
    assert h.receiver.counters.duplicates_dropped == 2 and h.receiver.counters.processed == 3
    assert h.receiver.counters.received == 5


def test_gaps_in_seqs_are_normal() -> None:
    h = Harness()
    h.listen("#")
    for seq in (3, 10, 11, 40):
        assert h.event("t", seq) == ACK
    assert h.seqs() == [3, 10, 11, 40]


def test_a_new_epoch_starts_a_new_mark() -> None:
    h = Harness()
    h.listen("#")
    h.event("t", 50, epoch=1)
    assert h.event("t", 1, epoch=2) == ACK  # the session was recreated: low seqs are new
    assert h.seqs() == [50, 1] and h.state.get_mark(2) == 1


def test_failing_listener_stops_the_connection_until_redelivery(caplog: pytest.LogCaptureFixture) -> None:
    h = Harness()
    h.listen("#", fail_on=2)
    assert h.event("t", 1) == ACK
    with caplog.at_level(logging.ERROR, logger="durable_client"):
        assert h.event("t", 2) == Outcome(reconnect=True)
    assert "cannot take seq 2" in caplog.text and "seq 2" in caplog.text
    assert h.state.get_mark(1) == 1  # not recorded
    assert h.receiver.failed
    # Everything after it on this connection is ignored: not processed, not acknowledged.
    assert h.event("t", 3) == Outcome()
    assert h.receiver.handle(h.message(REPLY_TOPIC, encode_reply("ready", 1))) == Outcome()
    assert h.seqs() == [1]
    assert h.receiver.counters.redeliveries_requested == 1
    # Next connection: the broker re-sends from the failed event, with DUP.
    h.receiver.new_connection()
    h.seen.clear()
    h.listen("#")  # the application fixed its listener
    for seq in (1, 2, 3):
        assert h.event("t", seq, dup=True) == ACK
    assert h.seqs() == [2, 3]
    assert h.state.get_mark(1) == 3


def test_second_listener_failing_means_the_first_sees_it_again() -> None:
    # At-least-once per listener when one of several fails: documented, tested so it stays visible.
    h = Harness()
    h.listen("#", "ok")
    h.listen("t", "bad", fail_on=1)
    assert h.event("t", 1).reconnect
    h.receiver.new_connection()
    h.listen("t", "fixed")  # the same filter again replaces its listener
    h.event("t", 1, dup=True)
    assert [name for name, _ in h.seen] == ["ok", "ok", "fixed"]


def test_cache_rules_applied_per_flag() -> None:
    h = Harness()
    h.event("live", 1, b"L")
    h.event("old", 2, b"R", flags=FLAG_REPLAYED)
    h.event("init", 3, b"I", flags=FLAG_RETAINED | FLAG_REPLAYED)
    assert (h.cache.get("live"), h.cache.get("old"), h.cache.get("init")) == (b"L", None, b"I")


def test_unframed_message_on_a_durable_session_is_delivered_raw(caplog: pytest.LogCaptureFixture) -> None:
    h = Harness()
    h.listen("#")
    with caplog.at_level(logging.WARNING, logger="durable_client"):
        assert h.receiver.handle(h.message("t", b"short")) == ACK
    assert [(e.payload, e.seq, e.epoch) for _, e in h.seen] == [(b"short", 0, 0)]
    assert "has no SDK frame" in caplog.text and h.state.epoch is None


# ------------------------------------------------------------- persistence
def test_exactly_once_across_a_restart_with_disk_state(tmp_path: Path) -> None:
    first = Harness(state=DiskState(tmp_path, "c"))
    first.listen("#")
    for seq in (1, 2, 3):
        first.event("t", seq)
    first.state.close()  # the process ends; events 2 and 3 were never acknowledged, say
    second = Harness(state=DiskState(tmp_path, "c"))
    second.listen("#")
    for seq in (2, 3, 4):
        second.event("t", seq, dup=True)
    assert second.seqs() == [4]
    assert second.receiver.counters.duplicates_dropped == 2
    second.state.close()


# ----------------------------------------------------------------- streams
def test_stream_events_dedup_by_topic_and_ack_with_stream_ack() -> None:
    h = Harness()
    h.listen("s/#", "session listener")  # session listeners do not see stream events
    h.listen_stream("s/#")
    assert h.stream("s/a", 1, b"one") == Outcome(ack=True, stream_ack=("s/a", 1))
    assert h.stream("s/b", 1) == Outcome(ack=True, stream_ack=("s/b", 1))
    assert h.stream("s/a", 1, flags=FLAG_REDELIVERED) == Outcome(ack=True, stream_ack=("s/a", 1))
    assert h.stream("s/a", 2) == Outcome(ack=True, stream_ack=("s/a", 2))
    assert [(e.topic, e.seq) for _, e in h.seen] == [("s/a", 1), ("s/b", 1), ("s/a", 2)]
    name, event = h.seen[0]
    assert name == "s/#"
    assert event == Event("s/a", b"one", 0, 1, 0, 2001.0, False, False, False, True)
    assert h.state.positions() == {"s/a": 2, "s/b": 1}
    assert h.receiver.counters.duplicates_dropped == 1
    assert h.cache.get("s/a") == b"v"


def test_failing_stream_listener_asks_for_redelivery() -> None:
    h = Harness(framed=False)
    h.listen_stream("s/#", fail_on=2)
    h.stream("s/a", 1)
    assert h.stream("s/a", 2) == Outcome(reconnect=True)
    assert h.state.position("s/a") == 1 and h.stream("s/a", 3) == Outcome()


# ------------------------------------------------------ stateless (raw) path
def test_raw_events_have_no_seq_no_dedup_and_are_acked_at_once(caplog: pytest.LogCaptureFixture) -> None:
    h = Harness(framed=False)
    h.listen("#", fail_on=0)
    payload = encode_frame(0, 1, 1, 0.0)  # looks like a frame: raw all the same
    with caplog.at_level(logging.ERROR, logger="durable_client"):
        assert h.receiver.handle(h.message("t", payload)) == ACK
    assert "cannot be redelivered" in caplog.text and not h.receiver.failed
    h.seen.clear()
    h.listen("#")
    h.receiver.handle(h.message("t", b"x", retain=True))
    h.receiver.handle(h.message("t", b"x", dup=True))
    assert [e for _, e in h.seen] == [
        Event("t", b"x", 1, 0, 0, 42.0, False, True, False, False),
        Event("t", b"x", 1, 0, 0, 42.0, False, False, True, False),
    ]
    assert h.receiver.counters.duplicates_dropped == 0


# ------------------------------------------------------- replies, markers
def test_replies_go_to_the_reply_handler() -> None:
    h = Harness()
    assert h.receiver.handle(h.message(REPLY_TOPIC, encode_reply("hello", 1, epoch=3), qos=0)) == ACK
    error = encode_error("ready", 2, ProtocolError("no_session", "no"))
    h.receiver.handle(h.message(REPLY_TOPIC, error, qos=0))
    assert [(r.op, r.ok, r.fields.get("epoch"), r.error_code) for r in h.replies] == [
        ("hello", True, 3, None),
        ("ready", False, None, "no_session"),
    ]


def test_malformed_reply_and_marker_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    h = Harness()
    with caplog.at_level(logging.ERROR, logger="durable_client"):
        assert h.receiver.handle(h.message(REPLY_TOPIC, b"{", qos=0)) == ACK
        assert h.receiver.handle(h.message(MARKER_TOPIC, b"[]", qos=0)) == ACK
    assert h.replies == [] and h.markers == []
    assert "malformed reply" in caplog.text and "malformed marker" in caplog.text


def test_marker_reaches_on_live_once_and_clears_tombstones() -> None:
    h = Harness()
    h.event("t", 1, b"")  # a live delete: tombstone
    assert h.cache.entry("t") is not None
    marker = Marker(1, 0, None, None, (LiveSubscription("#", 1, True),))
    assert h.receiver.handle(h.message(MARKER_TOPIC, encode_marker(marker), qos=0)) == ACK
    assert h.markers == [marker]
    assert h.cache.entry("t") is None


def test_unknown_sdk_topic_is_acked_and_ignored() -> None:
    h = Harness()
    h.listen("#")
    assert h.receiver.handle(h.message("$durable/v2/new", b"x")) == ACK
    assert h.seen == [] and h.replies == []
