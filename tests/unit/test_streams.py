"""Stream logs (ids, reopen, retention) and the per-connection StreamSender, over a real LevelDB.

Senders write to the shared recording transport (recording_transport.py), which parses the
PUBLISH packets back (fixed header, remaining length, topic, payload); ``Recorder`` decodes
their stream frames, so the tests assert what a client would get. "Nothing more was sent" is
checked after a few loop passes (``asyncio.sleep(0)``): sends are scheduled with
``call_soon``, never with a timer, so a pass is enough; the retransmit tests wait on the
transport's event with a deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import pytest

from amqtt_durable import stream_log as streams_module
from amqtt_durable.config import StreamConfig
from amqtt_durable.store import GroupCommitter, open_store
from amqtt_durable.stream_log import StreamLogs, event_key, mark_key
from amqtt_durable.stream_sender import StreamSender
from durable_client.protocol import FLAG_QOS_SHIFT, FLAG_REDELIVERED, STREAM_TOPIC_PREFIX, ProtocolError, decode_frame
from recording_transport import RecordingTransport, Sent

WAIT = 5.0
STREAMS = [StreamConfig("s/#", max_count=100)]


# ---------------------------------------------------------------------- helpers
def make_logs(db: Any, streams: list[StreamConfig] | None = None) -> tuple[StreamLogs, GroupCommitter]:
    committer = GroupCommitter(db, sync=False, batch_size=5000, batch_delay_ms=0.0, pending_threshold=1)
    logs = StreamLogs(db, committer, STREAMS if streams is None else streams)
    logs.load()
    return logs, committer


def put(logs: StreamLogs, committer: GroupCommitter, topic: str, payload: bytes = b"x", at: float | None = None) -> int:
    """Append and write synchronously (storage tests run without a loop)."""
    event_id = logs.append(topic, payload, 1, time.time() if at is None else at)
    assert event_id is not None
    committer.flush_now()
    logs.appended(topic, event_id)
    return event_id


async def publish(logs: StreamLogs, committer: GroupCommitter, topic: str, payload: bytes = b"x") -> int:
    """The engine's path: append into the batch, commit, ``appended`` once it is written."""
    event_id = logs.append(topic, payload, 1, time.time())
    assert event_id is not None
    await committer.commit(lambda: logs.appended(topic, event_id))
    return event_id


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(test())


async def passes(count: int = 3) -> None:
    for _ in range(count):
        await asyncio.sleep(0)


@dataclass(frozen=True)
class Got:
    topic: str
    id: int
    flags: int
    payload: bytes
    published_at: float


def stream_event(packet: Sent) -> Got:
    """A stream sender's packet: a QoS 0 PUBLISH (no DUP, no RETAIN) of a framed stream event."""
    assert (packet.packet_type, packet.flags) == (3, 0), "a QoS 0 PUBLISH without DUP or RETAIN"
    assert packet.topic.startswith(STREAM_TOPIC_PREFIX)
    frame, body = decode_frame(packet.payload)
    assert frame.epoch == 0
    assert frame.qos == 1, "the publish QoS the event was logged with (publish() logs at QoS 1)"
    flags = frame.flags & ~(0x03 << FLAG_QOS_SHIFT)
    return Got(packet.topic[len(STREAM_TOPIC_PREFIX) :], frame.seq, flags, body, frame.published_at)


class Recorder(RecordingTransport):
    """The shared recording transport, its PUBLISH packets decoded as stream events."""

    @property
    def got(self) -> list[Got]:
        return [stream_event(packet) for packet in self.packets]

    async def wait_got(self, count: int) -> list[Got]:
        await self.wait_for(lambda packets: len(packets) >= count, WAIT)
        return self.got

    def ids(self, topic: str | None = None) -> list[int]:
        return [g.id for g in self.got if topic is None or g.topic == topic]


def sender_for(
    logs: StreamLogs,
    *,
    window: int = 10,
    ack_timeout: float = 60.0,
    may_receive: Callable[[str], Awaitable[bool]] | None = None,
) -> tuple[StreamSender, Recorder]:
    recorder = Recorder()
    sender = StreamSender(logs, recorder, default_window=window, ack_timeout=ack_timeout, may_receive=may_receive)
    return sender, recorder


# ---------------------------------------------------------------- storage: ids
def test_append_read_and_ids(db: Any) -> None:
    logs, committer = make_logs(db)
    assert logs.append("other/t", b"p", 1, 1.0) is None  # no stream covers it
    assert logs.logged("other/t") is None
    assert logs.logged("s/a") == STREAMS[0]
    assert [put(logs, committer, "s/a", b"p%d" % i, at=100.0 + i) for i in range(3)] == [1, 2, 3]
    assert put(logs, committer, "s/b") == 1  # ids are per topic
    events = logs.read("s/a", 0, 10)
    assert [(e.topic, e.id, e.qos, e.published_at, e.payload) for e in events] == [
        ("s/a", 1, 1, 100.0, b"p0"),
        ("s/a", 2, 1, 101.0, b"p1"),
        ("s/a", 3, 1, 102.0, b"p2"),
    ]
    assert [e.id for e in logs.read("s/a", 1, 1)] == [2]
    assert logs.read("s/a", 3, 10) == []
    assert logs.read("nope", 0, 10) == []
    assert logs.bounds("s/a") == (1, 3)
    assert db.get(mark_key("s/a")) == (3).to_bytes(8, "big")


def test_nothing_is_readable_before_its_batch_is_written(db: Any) -> None:
    logs, committer = make_logs(db)
    put(logs, committer, "s/a")
    assert logs.append("s/a", b"pending", 0, 1.0) == 2
    assert logs.append("s/new", b"pending", 0, 1.0) == 1
    assert [e.id for e in logs.read("s/a", 0, 10)] == [1]
    assert logs.bounds("s/a") == (1, 1)
    assert logs.bounds("s/new") is None
    assert "s/new" not in logs.topics("#")
    committer.flush_now()
    logs.appended("s/a", 2)
    logs.appended("s/new", 1)
    assert [e.payload for e in logs.read("s/a", 1, 10)] == [b"pending"]
    assert logs.bounds("s/new") == (1, 1)


def test_ids_continue_after_reopen(store_path: str, db: Any) -> None:
    logs, committer = make_logs(db)
    # Topics that are prefixes of each other: the per-topic seek must not mix them up.
    counts = {"s/a": 3, "s/a/b": 2, "s/ab": 4, "s/a\x01": 1, "s/": 5}
    for topic, count in counts.items():
        for _ in range(count):
            put(logs, committer, topic, topic.encode())
    db.close()
    db = open_store(store_path)
    try:
        reopened, committer = make_logs(db)
        for topic, count in counts.items():
            assert reopened.bounds(topic) == (1, count), topic
            assert {e.payload for e in reopened.read(topic, 0, 100)} == {topic.encode()}
        assert put(reopened, committer, "s/a") == 4
        assert put(reopened, committer, "s/new") == 1
    finally:
        db.close()


def test_ids_never_reused_after_age_retention_removed_everything(store_path: str, db: Any) -> None:
    logs, committer = make_logs(db, [StreamConfig("s/#", max_age=10.0)])
    now = time.time()
    for _ in range(3):
        put(logs, committer, "s/a", at=now - 100)
    assert logs.trim_expired(now) == 3
    committer.flush_now()
    assert db.get(event_key("s/a", 3)) is None
    assert logs.bounds("s/a") == (4, 3)  # empty: first == last + 1
    db.close()
    db = open_store(store_path)
    try:
        reopened, committer = make_logs(db, [StreamConfig("s/#", max_age=10.0)])
        assert reopened.bounds("s/a") == (4, 3)
        assert reopened.topics("s/#") == {"s/a": (4, 3)}
        assert put(reopened, committer, "s/a", at=now) == 4
        assert reopened.bounds("s/a") == (4, 4)
    finally:
        db.close()


def test_count_retention_on_append(db: Any) -> None:
    logs, committer = make_logs(db, [StreamConfig("s/#", max_count=3)])
    for _ in range(5):
        put(logs, committer, "s/a")
    assert logs.bounds("s/a") == (3, 5)
    assert db.get(event_key("s/a", 1)) is None
    assert db.get(event_key("s/a", 2)) is None
    assert [e.id for e in logs.read("s/a", 0, 10)] == [3, 4, 5]
    assert [e.id for e in logs.read("s/a", 1, 10)] == [3, 4, 5]


def test_lowered_max_count_is_enforced_by_trim(store_path: str, db: Any) -> None:
    logs, committer = make_logs(db, [StreamConfig("s/#", max_count=100)])
    for _ in range(10):
        put(logs, committer, "s/a")
    db.close()
    db = open_store(store_path)
    try:
        reopened, committer = make_logs(db, [StreamConfig("s/#", max_count=3)])
        assert reopened.trim_expired(time.time()) == 7
        committer.flush_now()
        assert reopened.bounds("s/a") == (8, 10)
        assert [e.id for e in reopened.read("s/a", 0, 100)] == [8, 9, 10]
    finally:
        db.close()


def test_age_retention_with_trim_expired(db: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    logs, committer = make_logs(db, [StreamConfig("s/#", max_age=10.0), StreamConfig("k/#")])
    now = time.time()
    for _ in range(5):
        put(logs, committer, "s/a", at=now - 100)
    put(logs, committer, "s/a", at=now - 1)
    put(logs, committer, "k/a", at=now - 1000)  # no age limit on k/#
    monkeypatch.setattr(streams_module, "TRIM_BUDGET", 2)  # bounded work per call
    assert logs.trim_expired(now) == 2
    assert logs.trim_expired(now) == 2
    assert logs.trim_expired(now) == 1
    assert logs.trim_expired(now) == 0
    committer.flush_now()
    assert logs.bounds("s/a") == (6, 6)
    assert [e.id for e in logs.read("s/a", 0, 10)] == [6]
    assert logs.bounds("k/a") == (1, 1)
    assert logs.trim_expired(now + 20) == 1  # the young one ages too
    committer.flush_now()
    assert logs.bounds("s/a") == (7, 6)


def test_trim_interval() -> None:
    def interval(*ages: float) -> float | None:
        return StreamLogs(None, None, [StreamConfig(f"t{i}/#", max_age=a) for i, a in enumerate(ages)]).trim_interval()  # type: ignore[arg-type]

    assert interval() is None
    assert interval(0.0) is None
    assert interval(8.0, 0.0, 100.0) == 2.0
    assert interval(1.0) == 0.5
    assert interval(10_000.0) == 60.0


def test_topics_and_bounds(db: Any) -> None:
    logs, committer = make_logs(db, [StreamConfig("s/#"), StreamConfig("k/+")])
    put(logs, committer, "s/a")
    put(logs, committer, "s/a")
    put(logs, committer, "s/b/c")
    put(logs, committer, "k/x")
    assert logs.append("k/x/y", b"", 0, 1.0) is None
    assert logs.topics("#") == {"s/a": (1, 2), "s/b/c": (1, 1), "k/x": (1, 1)}
    assert logs.topics("s/+") == {"s/a": (1, 2)}
    assert logs.topics("s/a") == {"s/a": (1, 2)}
    assert logs.topics("s/zz") == {}
    assert logs.topics("+/x") == {"k/x": (1, 1)}
    assert logs.bounds("s/b/c") == (1, 1)
    assert logs.bounds("k/y") is None


# ----------------------------------------------------------------------- sender
def test_resume_from_the_middle_gets_exactly_the_rest(db: Any) -> None:
    async def main() -> None:
        logs, committer = make_logs(db)
        for i in range(5):
            await publish(logs, committer, "s/a", b"p%d" % i)
        await publish(logs, committer, "s/b")
        sender, recorder = sender_for(logs, window=10)
        reply = await sender.subscribe("s/a", {"s/a": 2})
        assert reply == {"topics": {"s/a": {"first": 1, "last": 5}}, "gaps": {}, "ahead": {}}
        got = await recorder.wait_got(3)
        await passes()
        assert [(g.topic, g.id, g.flags, g.payload) for g in got] == [
            ("s/a", 3, 0, b"p2"),
            ("s/a", 4, 0, b"p3"),
            ("s/a", 5, 0, b"p4"),
        ]
        assert recorder.writes == 1  # one read and one write per refill
        sender.stop()

    run(main)


def test_from_nothing_starts_at_the_first_retained_event(db: Any) -> None:
    async def main() -> None:
        logs, committer = make_logs(db, [StreamConfig("s/#", max_count=3)])
        for _ in range(5):
            await publish(logs, committer, "s/a")
        sender, recorder = sender_for(logs)
        reply = await sender.subscribe("s/#", {})
        assert reply == {"topics": {"s/a": {"first": 3, "last": 5}}, "gaps": {}, "ahead": {}}  # not in after: no gap
        await recorder.wait_got(3)
        await passes()
        assert recorder.ids() == [3, 4, 5]
        sender.stop()

    run(main)


def test_window_1_sends_one_then_waits_for_the_ack(db: Any) -> None:
    async def main() -> None:
        logs, committer = make_logs(db)
        for _ in range(3):
            await publish(logs, committer, "s/a")
        sender, recorder = sender_for(logs, window=10)
        await sender.subscribe("s/a", window=1)
        await recorder.wait_got(1)
        await publish(logs, committer, "s/a")
        await passes()
        assert recorder.ids() == [1]
        sender.ack("s/a", 1)
        await recorder.wait_got(2)
        await passes()
        assert recorder.ids() == [1, 2]
        sender.ack("s/a", 2)
        sender.ack("s/a", 3)
        await recorder.wait_got(4)
        sender.ack("s/a", 4)
        await passes()
        assert recorder.ids() == [1, 2, 3, 4]
        assert sender.cursors == {"s/a": (5, 0)}
        sender.stop()

    run(main)


def test_window_3_and_cumulative_ack(db: Any) -> None:
    async def main() -> None:
        logs, committer = make_logs(db)
        for _ in range(8):
            await publish(logs, committer, "s/a")
        sender, recorder = sender_for(logs, window=3)
        await sender.subscribe("s/a")
        await recorder.wait_got(3)
        await passes()
        assert recorder.ids() == [1, 2, 3]
        sender.ack("s/a", 1)
        await recorder.wait_got(4)
        await passes()
        assert recorder.ids() == [1, 2, 3, 4]
        sender.ack("s/a", 4)  # acknowledges 2, 3 and 4 at once
        await recorder.wait_got(7)
        await passes()
        assert recorder.ids() == [1, 2, 3, 4, 5, 6, 7]
        sender.ack("s/a", 2)  # an old ack changes nothing
        await passes()
        assert sender.cursors == {"s/a": (8, 3)}
        sender.ack("s/a", 100)  # beyond what was sent: only what was sent is acknowledged
        await recorder.wait_got(8)
        assert sender.cursors == {"s/a": (9, 1)}
        sender.stop()

    run(main)


def test_retransmit_after_ack_timeout_with_the_redelivered_flag(db: Any) -> None:
    async def main() -> None:
        logs, committer = make_logs(db)
        await publish(logs, committer, "s/a", b"one")
        await publish(logs, committer, "s/a", b"two")
        sender, recorder = sender_for(logs, window=2, ack_timeout=0.05)
        await sender.subscribe("s/a")
        got = await recorder.wait_got(4)
        assert [(g.id, g.flags, g.payload) for g in got[:4]] == [
            (1, 0, b"one"),
            (2, 0, b"two"),
            (1, FLAG_REDELIVERED, b"one"),
            (2, FLAG_REDELIVERED, b"two"),
        ]
        assert got[2].published_at == got[0].published_at
        sender.ack("s/a", 1)
        got = await recorder.wait_got(len(recorder.got) + 1)  # unlimited retries: 2 keeps coming
        assert got[-1].id == 2
        assert got[-1].flags == FLAG_REDELIVERED
        sender.ack("s/a", 2)
        assert sender.cursors == {"s/a": (3, 0)}
        sender.stop()

    run(main)


def test_progress_after_backed_off_resends_brings_the_next_resend_back_to_ack_timeout(db: Any) -> None:
    """protocol.md: "any progress starts again at stream_ack_timeout": an ack after resends that waited
    longer and longer leaves what is still in flight due ack_timeout after it, not after the longer wait
    its last resend was given (it was: 2 waited out 0.05 x 2**4 after the ack)."""

    async def main() -> None:
        logs, committer = make_logs(db)
        await publish(logs, committer, "s/a")
        await publish(logs, committer, "s/a")
        sender, recorder = sender_for(logs, window=2, ack_timeout=0.05)
        await sender.subscribe("s/a")
        await recorder.wait_for(lambda _: recorder.ids().count(1) >= 5, WAIT)  # sent, then 4 resends
        loop = asyncio.get_running_loop()
        sender.ack("s/a", 1)
        acked_at = loop.time()
        cursor = sender._cursors["s/a"]  # the due times are what this test is about
        assert list(cursor.inflight) == [2]
        assert cursor.inflight[2] <= acked_at + 0.05
        assert cursor.timer is not None and cursor.timer.when() <= acked_at + 0.05
        sender.stop()

    run(main)


def test_gaps_reported_after_trimming(db: Any) -> None:
    async def main() -> None:
        logs, committer = make_logs(db, [StreamConfig("s/#", max_count=3)])
        for _ in range(6):
            await publish(logs, committer, "s/a")
        await publish(logs, committer, "s/b")
        sender, recorder = sender_for(logs)
        reply = await sender.subscribe("s/#", {"s/a": 1, "s/b": 0})
        assert reply == {
            "topics": {"s/a": {"first": 4, "last": 6}, "s/b": {"first": 1, "last": 1}},
            "gaps": {"s/a": [2, 3]},
            "ahead": {},
        }
        await recorder.wait_got(4)
        await passes()
        assert recorder.ids("s/a") == [4, 5, 6]
        assert recorder.ids("s/b") == [1]
        sender.stop()

    run(main)


def test_cursor_skips_events_trimmed_while_it_waited(db: Any, caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        logs, committer = make_logs(db, [StreamConfig("s/#", max_count=2)])
        await publish(logs, committer, "s/a")
        sender, recorder = sender_for(logs, window=1)
        await sender.subscribe("s/a")
        await recorder.wait_got(1)
        for _ in range(5):  # ids 2..6; 1..4 fall out
            await publish(logs, committer, "s/a")
        with caplog.at_level(logging.WARNING, logger="amqtt_durable.streams"):
            sender.ack("s/a", 1)
        await recorder.wait_got(2)
        assert recorder.ids() == [1, 5]
        assert "ids 2 to 4 were trimmed" in caplog.text
        sender.stop()

    run(main)


def test_in_flight_event_trimmed_before_its_resend_frees_its_slot(db: Any) -> None:
    async def main() -> None:
        logs, committer = make_logs(db, [StreamConfig("s/#", max_count=2)])
        await publish(logs, committer, "s/a")
        sender, recorder = sender_for(logs, window=1, ack_timeout=0.05)
        await sender.subscribe("s/a")
        await recorder.wait_got(1)
        for _ in range(5):  # ids 2..6 while 1 waits for its ack; 1..4 fall out
            await publish(logs, committer, "s/a")
        await passes()
        assert recorder.ids() == [1]  # the window is still taken by 1
        got = await recorder.wait_got(3)  # 1 cannot be resent: 5 goes out, then 5 again
        assert [(g.id, g.flags) for g in got[:3]] == [(1, 0), (5, 0), (5, FLAG_REDELIVERED)]
        sender.stop()

    run(main)


def test_unknown_stream_and_bad_filter(db: Any) -> None:
    async def main() -> None:
        logs, committer = make_logs(db)
        await publish(logs, committer, "s/a")
        sender, _ = sender_for(logs)
        with pytest.raises(ProtocolError) as err:
            await sender.subscribe("other/#")
        assert err.value.code == "unknown_stream"
        with pytest.raises(ProtocolError) as err:
            await sender.subscribe("$SYS/#")
        assert err.value.code == "unknown_stream"
        for bad in ("s/#/x", "s/a+", ""):
            with pytest.raises(ProtocolError) as err:
                await sender.subscribe(bad)
            assert err.value.code == "bad_filter"
        with pytest.raises(ProtocolError) as err:
            sender.ack("s/a", 1)  # no open stream on it
        assert err.value.code == "unknown_stream"
        reply = await sender.subscribe("#")  # overlaps s/#: accepted
        assert reply["topics"] == {"s/a": {"first": 1, "last": 1}}
        assert sender.unsubscribe("never") is False
        sender.stop()

    run(main)


def test_new_topic_after_subscribe_opens_a_cursor(db: Any) -> None:
    async def main() -> None:
        logs, committer = make_logs(db)
        sender, recorder = sender_for(logs)
        reply = await sender.subscribe("s/#", {"s/later": 1})
        assert reply == {"topics": {}, "gaps": {}, "ahead": {}}
        await publish(logs, committer, "s/new", b"hello")
        assert logs.append("other/x", b"", 0, time.time()) is None
        got = await recorder.wait_got(1)
        assert [(g.topic, g.id, g.payload) for g in got] == [("s/new", 1, b"hello")]
        # a position presented before the topic existed is honoured when it appears
        await publish(logs, committer, "s/later")
        await publish(logs, committer, "s/later")
        await recorder.wait_got(2)
        await passes()
        assert recorder.ids("s/later") == [2]
        sender.stop()

    run(main)


def test_overlapping_subscriptions_share_one_cursor_and_unsubscribe_stops_sends(db: Any) -> None:
    async def main() -> None:
        logs, committer = make_logs(db)
        await publish(logs, committer, "s/a")
        sender, recorder = sender_for(logs)
        await sender.subscribe("s/#")
        reply = await sender.subscribe("s/+", {"s/a": 0})
        assert reply["topics"] == {"s/a": {"first": 1, "last": 1}}
        await recorder.wait_got(1)
        await publish(logs, committer, "s/a")
        await recorder.wait_got(2)
        await passes()
        assert recorder.ids() == [1, 2]  # no duplicate delivery
        assert list(sender.cursors) == ["s/a"]
        assert sender.unsubscribe("s/#") is True
        assert list(sender.cursors) == ["s/a"]  # s/+ still covers it
        await publish(logs, committer, "s/a")
        await recorder.wait_got(3)
        assert sender.unsubscribe("s/+") is True
        assert sender.cursors == {}
        await publish(logs, committer, "s/a")
        await publish(logs, committer, "s/other")
        await passes()
        assert recorder.ids() == [1, 2, 3]
        with pytest.raises(ProtocolError):
            sender.ack("s/a", 3)
        sender.stop()

    run(main)


def test_stop_cancels_timers_and_forgets_positions(db: Any) -> None:
    async def main() -> None:
        logs, committer = make_logs(db)
        await publish(logs, committer, "s/a")
        sender, recorder = sender_for(logs, ack_timeout=30.0)
        await sender.subscribe("s/a")
        await recorder.wait_got(1)
        timer = sender._cursors["s/a"].timer
        assert timer is not None
        assert not timer.cancelled()
        sender.stop()
        assert timer.cancelled()
        assert sender.cursors == {}
        await publish(logs, committer, "s/a")
        await publish(logs, committer, "s/b")
        await passes()
        assert recorder.ids() == [1]
        assert logs._senders == set()
        assert logs._watchers == {}

    run(main)


def test_may_receive_refusal(db: Any) -> None:
    async def main() -> None:
        logs, committer = make_logs(db)
        await publish(logs, committer, "s/a")
        await publish(logs, committer, "s/secret")
        asked: list[str] = []

        async def may_receive(topic: str) -> bool:
            asked.append(topic)
            await asyncio.sleep(0)
            return "secret" not in topic

        sender, recorder = sender_for(logs, may_receive=may_receive)
        reply = await sender.subscribe("s/#")
        assert reply["topics"] == {"s/a": {"first": 1, "last": 1}}
        await publish(logs, committer, "s/secret")  # refused once: not asked again
        await publish(logs, committer, "s/secret2")  # a new topic is checked too
        await publish(logs, committer, "s/b")
        await recorder.wait_got(2)
        await passes(6)
        assert [(g.topic, g.id) for g in recorder.got] == [("s/a", 1), ("s/b", 1)]
        assert sorted(asked) == ["s/a", "s/b", "s/secret", "s/secret2"]
        sender.stop()

    run(main)


def test_closed_transport_gets_nothing(db: Any) -> None:
    async def main() -> None:
        logs, committer = make_logs(db)
        await publish(logs, committer, "s/a")
        sender, recorder = sender_for(logs)
        recorder.closed = True
        await sender.subscribe("s/a")
        await passes()
        assert recorder.got == []
        sender.stop()

    run(main)


def test_a_position_past_the_end_of_a_log_is_reported_as_ahead(db: Any) -> None:
    async def main() -> None:
        logs, committer = make_logs(db, [StreamConfig("s/#")])
        for _ in range(2):
            await publish(logs, committer, "s/a")
        sender, recorder = sender_for(logs)
        reply = await sender.subscribe("s/#", {"s/a": 50})
        assert reply["ahead"] == {"s/a": 2}, "ids are never reused: the store was wiped or replaced"
        await passes()
        assert recorder.ids("s/a") == []
        sender.stop()

    run(main)
