"""Recovery buffer and DUP, SIGKILL in flight and mid-replay, many sessions across a restart,
take-over, session expiry (also across a restart) and queue limits with their expansion."""

from __future__ import annotations

import json
import re
import select
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from test_scale import RawClient, RawMessage, create_sessions, offline_backlog

from amqtt_durable.inspect_store import summarize
from conftest import WAIT, Broker, Client, mqtt_packet, mqtt_string, payloads, seen_away

EXPIRED_TOPIC = "$SYS/broker/durable/expired"


def texts(messages: Sequence[mqtt.MQTTMessage]) -> list[bytes]:
    return [m.payload for m in messages]


def warnings(broker: Broker, fragment: str) -> list[str]:
    return [line for line in broker.log().splitlines() if " WARNING amqtt_durable: " in line and fragment in line]


def drop_warnings(broker: Broker, client_id: str) -> list[str]:
    return warnings(broker, f"session {client_id}: queue full")


def expired_events(monitor: Client) -> list[dict[str, Any]]:
    with monitor._cond:
        return [json.loads(m.payload) for m in monitor.messages if m.topic == EXPIRED_TOPIC]


def wait_expired(monitor: Client, client_id: str, timeout: float) -> dict[str, Any]:
    assert monitor.wait_for(
        lambda ms: any(m.topic == EXPIRED_TOPIC and json.loads(m.payload)["client_id"] == client_id for m in ms),
        timeout,
    ), f"no {EXPIRED_TOPIC} event for {client_id} within {timeout}s"
    return next(e for e in expired_events(monitor) if e["client_id"] == client_id)


def ack_in_order(sub: Client, start: int, stop: int) -> None:
    """Acknowledge messages start..stop-1 of ``sub``, each once it has arrived (manual_ack clients)."""
    for index in range(start, stop):
        got = sub.wait_messages(index + 1)
        assert len(got) > index, f"message #{index} never arrived; got {len(got)}"
        sub.paho.ack(got[index].mid, got[index].qos)


def assert_silent(raws: Sequence[RawClient], timeout: float) -> None:
    """Nothing more arrives on any of these connections within ``timeout`` (one wait for all of them)."""
    assert all(not raw._buf for raw in raws), "unexpected extra data already buffered"
    readable, _, _ = select.select([raw.sock for raw in raws], [], [], timeout)
    assert not readable, f"{len(readable)} connection(s) got more than their messages (or were closed)"


# ------------------------------------------------------------------------------------------ recovery buffer


def test_unacked_messages_resent_first_with_dup_after_abnormal_disconnect(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    broker = broker_factory(recovery_buffer=10)
    first = clients(broker.port, "rb-1", manual_ack=True)
    assert first.subscribe("rb/t", 1) == [1]
    pub = clients(broker.port, "pub", clean_session=True)
    sent = payloads(25)
    pub.publish("rb/t", sent, qos=1)
    got = first.wait_messages(10)
    assert texts(got) == sent[:10]
    assert not any(m.dup for m in got), "a first delivery must not carry DUP"
    assert not first.wait_for(lambda ms: len(ms) > 10, timeout=1.0), "recovery_buffer=10 bounds the in-flight window"
    first.drop()

    second = clients(broker.port, "rb-1")
    assert second.session_present is True
    got = second.wait_messages(25)
    assert texts(got) == sent, "unacknowledged messages first, in order, then the rest; nothing lost"
    assert [m.dup for m in got] == [True] * 10 + [False] * 15, "exactly the sent-but-unacked ones carry DUP"
    assert not second.wait_for(lambda ms: len(ms) > 25, timeout=0.5)


def test_in_flight_window_slides_with_acks(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    broker = broker_factory(recovery_buffer=10)
    sub = clients(broker.port, "win", manual_ack=True)
    sub.subscribe("win/t", 1)
    pub = clients(broker.port, "pub", clean_session=True)
    sent = payloads(30)
    pub.publish("win/t", sent, qos=1)
    acked = 0
    for ack_now in (4, 10, 16):
        window_end = acked + 10
        assert len(sub.wait_messages(window_end)) == window_end
        assert not sub.wait_for(lambda ms, end=window_end: len(ms) > end, timeout=0.4), (
            f"more than 10 unacknowledged messages in flight after {acked} acks"
        )
        ack_in_order(sub, acked, acked + ack_now)
        acked += ack_now
    assert acked == 30
    assert texts(sub.wait_messages(30)) == sent
    assert not any(m.dup for m in sub.messages)
    assert not sub.wait_for(lambda ms: len(ms) > 30, timeout=0.3)


def test_acks_read_before_a_take_over_are_honoured(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """A client that acks, disconnects and reconnects at once is a take-over for amqtt.

    Every PUBACK the broker has read from the old connection removes its message, even though
    amqtt cancels the old connection's ack waiters. PUBACKs still unread in the old socket when
    amqtt closes it are lost with it: those messages come again, but only DUP-flagged.
    """
    broker = broker_factory(recovery_buffer=10)
    sub = clients(broker.port, "quick", manual_ack=True)
    sub.subscribe("quick/t", 1)
    pub = clients(broker.port, "pub", clean_session=True)
    sub.on_message_hook = lambda message: sub.paho.ack(message.mid, message.qos)  # ack on receipt
    expected: list[bytes] = []
    for round_no in range(5):
        sent = payloads(10, f"r{round_no}-")
        expected += sent
        pub.publish("quick/t", sent, qos=1)
        assert sub.wait_for(lambda ms, want=set(sent): want <= {m.payload for m in ms})
        sub.disconnect()  # the PUBACKs, then DISCONNECT, on one TCP stream
        assert sub.connect() is True
    redelivered = [m for m in sub.messages if m.dup]
    assert [m.payload for m in sub.messages if not m.dup] == expected, "every message once without DUP, in order"
    assert all(m.payload in expected for m in redelivered)
    assert "ignored: no message sent to this connection awaits it" not in broker.log(), (
        "a PUBACK the broker read was not matched to the message it acknowledges"
    )


def test_in_flight_messages_resent_with_dup_after_sigkill(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    broker = broker_factory(recovery_buffer=10)
    first = clients(broker.port, "crash-1", manual_ack=True)
    first.subscribe("cr/t", 1)
    pub = clients(broker.port, "pub", clean_session=True)
    sent = payloads(40)
    pub.publish("cr/t", sent[:25], qos=1)
    assert texts(first.wait_messages(10)) == sent[:10]
    assert not first.wait_for(lambda ms: len(ms) > 10, timeout=0.5)
    broker.kill()  # 10 in flight and unacknowledged, 15 queued behind the window
    assert first.wait_disconnected()
    broker.start()

    again = clients(broker.port, "crash-1")
    assert again.session_present is True
    got = again.wait_messages(25)
    assert texts(got) == sent[:25], "in-flight messages first, then the queued ones, in order, nothing lost"
    assert all(m.dup for m in got[:10]), "messages in flight at the crash must be re-sent with DUP=1"
    clients(broker.port, "pub-2", clean_session=True).publish("cr/t", sent[25:], qos=1)
    assert texts(again.wait_messages(40)) == sent
    assert not again.wait_for(lambda ms: len(ms) > 40, timeout=0.5)


def read_publishes(raw: RawClient, count: int) -> list[RawMessage]:
    """The next ``count`` PUBLISHes of ``raw``, not acknowledged; PUBACKs of its own publishes are skipped."""
    out: list[RawMessage] = []
    while len(out) < count:
        first, body = raw.read_packet()
        if first >> 4 == 4:
            continue
        assert first >> 4 == 3, f"expected PUBLISH, got packet type {first >> 4}"
        end = 2 + int.from_bytes(body[:2], "big")
        packet_id = int.from_bytes(body[end : end + 2], "big")
        out.append(RawMessage(body[2:end].decode(), body[end + 2 :], 1, bool(first & 0x08), False, packet_id))
    return out


def test_a_backlog_message_never_leaves_before_its_sent_mark_is_stored(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """A live publish queued for a connected session raises its sent mark in the publish's own batch.
    The pump took that mark for stored as soon as it was queued, so acks arriving before the batch was
    written let it send backlog messages the stored mark did not cover: killed then, the broker
    re-sent them after the restart without DUP. The batch is held back here by sync: true with a long
    batch_delay_ms (nothing else asks for a write meanwhile); the kill lands as the refill arrives."""
    broker = broker_factory(recovery_buffer=10, sync=True, batch_delay_ms=10_000, pending_threshold=30)
    raw = RawClient(broker.port, "gap")
    raw.connect()
    raw.subscribe("gap/t", 1)
    raw.disconnect(wait_closed=True)
    sent = payloads(30)  # exactly pending_threshold: their batch is written at once
    clients(broker.port, "pub", clean_session=True).publish("gap/t", sent, qos=1)

    raw = RawClient(broker.port, "gap")
    assert raw.connect() is True
    window = read_publishes(raw, 10)  # its sent mark (1 + 10) was stored by the attach
    assert [m.payload for m in window] == sent[:10] and not any(m.dup for m in window)
    # One read for the broker: a live publish of this session's own topic (queued behind the backlog,
    # its batch waiting for company), then the PUBACKs of half the window.
    live = mqtt_packet(0x32, mqtt_string("gap/t") + (1).to_bytes(2, "big") + b"live")
    raw.send(live + b"".join(mqtt_packet(0x40, m.packet_id.to_bytes(2, "big")) for m in window[:5]))
    refill = read_publishes(raw, 5)
    assert [m.payload for m in refill] == sent[10:15] and not any(m.dup for m in refill)
    broker.kill()
    raw.close()
    broker.start()

    again = RawClient(broker.port, "gap")
    assert again.connect() is True
    backlog: list[RawMessage] = []
    while len(backlog) <= len(sent) and sent[-1] not in (m.payload for m in backlog):
        backlog += again.receive(1)  # acknowledged: the window moves on
    first = backlog[0].payload
    assert first in sent[:6], "what the kill may have cost is acks, never messages"
    assert [m.payload for m in backlog] == sent[sent.index(first) :], "in order, nothing lost"
    seen = {m.payload for m in window + refill}
    assert [m.payload for m in backlog if m.payload in seen and not m.dup] == [], (
        "a message sent before the crash came again without DUP"
    )
    again.close()


# ---------------------------------------------------------------------------------- SIGKILL mid-replay


@pytest.mark.slow
def test_sigkill_in_the_middle_of_a_replay_loses_nothing(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    broker = broker_factory()
    sent = payloads(20_000)
    assert offline_backlog(broker, "replay", "rp/t", sent) == len(sent)

    first = clients(broker.port, "replay", auto_start=False)
    halfway = threading.Event()
    first.on_message_hook = lambda _m: halfway.set() if len(first.messages) > 2000 else None
    assert first.connect() is True
    assert halfway.wait(WAIT), f"replay too slow: {len(first.messages)} messages"
    broker.kill()
    assert first.wait_disconnected()
    before = list(first.messages)
    broker.start()

    second = clients(broker.port, "replay")
    assert second.session_present is True
    assert second.wait_for(lambda ms: bool(ms) and ms[-1].payload == sent[-1], timeout=60), (
        f"replay after the crash did not reach the last message: {len(second.messages)} received"
    )
    after = list(second.messages)

    assert 2000 < len(before) < len(sent), "the kill must land in the middle of the replay"
    assert texts(before) == sent[: len(before)], "first connection: in order, no gap"
    assert not any(m.dup for m in before)
    resume = int(after[0].payload[1:])
    assert resume <= len(before), f"messages {len(before)}..{resume - 1} were lost across the crash"
    assert texts(after) == sent[resume:], "second connection: in order, no gap, through the last message"
    duplicates = after[: len(before) - resume]
    assert all(m.dup for m in duplicates), "a message delivered before the crash may come again only with DUP=1"
    # Acks are committed in batches, so the last few before the kill may be lost; a replay from far back
    # would mean acknowledged messages are not removed from the store.
    assert len(duplicates) <= 1000, f"{len(duplicates)} messages sent again although most were acknowledged"
    assert not second.wait_for(lambda ms: len(ms) > len(after), timeout=0.5)


# ------------------------------------------------------------------------------ many sessions, restart


def test_restart_with_200_sessions_holding_queues(broker_factory: Callable[..., Broker]) -> None:
    broker = broker_factory()
    client_ids = [f"many-{i:03d}" for i in range(200)]
    create_sessions(broker.port, client_ids, lambda cid: f"many/{cid}")
    pub = RawClient(broker.port, "pub", clean_session=True)
    pub.connect()
    # Interleaved across topics, so each queue's order comes from the store, not from the publish order alone.
    items = [(f"many/{cid}", f"{cid}:{n:02d}".encode()) for n in range(20) for cid in client_ids]
    assert pub.publish_many(items) == len(items)
    pub.disconnect()
    broker.kill()
    broker.start()

    subs = [RawClient(broker.port, cid) for cid in client_ids]
    for sub in subs:
        assert sub.connect() is True, f"{sub.client_id}: session lost in the restart"
    for sub in subs:
        got = sub.receive(20)
        expected = [(f"many/{sub.client_id}", f"{sub.client_id}:{n:02d}".encode()) for n in range(20)]
        assert [(m.topic, m.payload) for m in got] == expected, sub.client_id
    assert_silent(subs, 0.5)
    for sub in subs:
        sub.disconnect()


# ------------------------------------------------------------------------------------------- take-over


def test_take_over_moves_session_to_new_connection(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    broker = broker_factory(recovery_buffer=10)
    old = clients(broker.port, "tk", manual_ack=True)
    old.subscribe("tk/t", 1)
    pub = clients(broker.port, "pub", clean_session=True)
    sent = payloads(30)
    pub.publish("tk/t", sent[:20], qos=1)
    assert texts(old.wait_messages(10)) == sent[:10]  # 10 in flight, 10 queued behind the window

    new = clients(broker.port, "tk")
    assert new.session_present is True
    assert old.wait_disconnected(), "the old connection must be closed by the take-over"
    pub.publish("tk/t", sent[20:], qos=1)
    got = new.wait_messages(30)
    assert texts(got) == sent, "in-flight, queued and new messages all reach the new connection, in order"
    assert [m.dup for m in got] == [True] * 10 + [False] * 20
    assert not new.wait_for(lambda ms: len(ms) > 30, timeout=0.5)
    assert len(old.messages) == 10, "the old connection must not get anything after the take-over"


# ---------------------------------------------------------------------------------------------- expiry


def test_disconnected_session_expires(broker_factory: Callable[..., Broker], clients: Callable[..., Client]) -> None:
    broker = broker_factory(session_expiry=1)
    monitor = clients(broker.port, "monitor", clean_session=True)
    assert monitor.subscribe(EXPIRED_TOPIC, 1) == [1]
    dev = clients(broker.port, "dev-exp")
    dev.subscribe("ex/t", 1)
    dev.disconnect()
    gone = time.monotonic()
    pub = clients(broker.port, "pub", clean_session=True)
    pub.publish("ex/t", payloads(3), qos=1)

    event = wait_expired(monitor, "dev-exp", timeout=6)
    waited = time.monotonic() - gone
    assert 0.9 <= waited <= 4.0, f"session_expiry=1 but the session expired after {waited:.2f}s"
    assert event["messages_dropped"] == 3
    assert warnings(broker, "durable session dev-exp expired"), broker.log()

    again = clients(broker.port, "dev-exp")
    assert again.session_present is False
    pub.publish("ex/t", [b"after"], qos=1)  # the expired session's subscription is gone too
    assert not again.wait_for(lambda ms: len(ms) > 0, timeout=0.5)


@pytest.mark.slow
def test_expiry_deadline_survives_restart(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    broker = broker_factory(session_expiry=3, metrics_interval=0.05)
    early = clients(broker.port, "exp-early")
    early.subscribe("ea/t", 1)
    before = time.time()
    early.disconnect()
    seen_away(clients, broker, 1)  # else the broker may be killed before it handled the DISCONNECT
    after = time.time()
    clients(broker.port, "pub", clean_session=True).publish("ea/t", payloads(2), qos=1)
    broker.kill()
    stored = {row.client_id: row for row in summarize(broker.store)}
    assert stored["exp-early"].expires_at is not None
    assert before + 2.95 <= stored["exp-early"].expires_at <= after + 3.05, "the deadline must be persisted"

    broker.start()  # before exp-early's deadline
    monitor = clients(broker.port, "monitor", clean_session=True)
    monitor.subscribe(EXPIRED_TOPIC, 1)
    late = clients(broker.port, "exp-late")
    late.subscribe("el/t", 1)
    late.disconnect()
    event = wait_expired(monitor, "exp-early", timeout=6)
    seen = time.time()
    assert before + 2.9 <= seen <= after + 4.5, f"exp-early expired {seen - after:.2f}s after disconnect, not ~3s"
    assert before - 0.05 <= event["disconnected_at"] <= after + 0.05, "the restart must not reset the deadline"
    assert event["messages_dropped"] == 2

    broker.kill()
    stored = {row.client_id: row for row in summarize(broker.store)}
    assert "exp-early" not in stored
    deadline = stored["exp-late"].expires_at
    assert deadline is not None
    # The scenario needs wall-clock time to pass while the broker is down; there is nothing to synchronise with.
    time.sleep(max(0.0, deadline - time.time()) + 0.1)
    broker.start()
    again = clients(broker.port, "exp-late")
    assert again.session_present is False, "a session whose deadline passed while the broker was down must be gone"
    assert warnings(broker, "durable session exp-late expired"), broker.log()


# ---------------------------------------------------------------------------------------- queue limits


@pytest.mark.parametrize(("overflow", "kept"), [("drop-oldest", slice(100, 300)), ("drop-newest", slice(0, 200))])
def test_disconnected_queue_limit_and_overflow(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], overflow: str, kept: slice
) -> None:
    broker = broker_factory(
        max_depth=50, max_depth_disconnected=200, overflow=overflow, drop_log_interval=60, metrics_interval=0.05
    )
    sub = clients(broker.port, "lim")
    sub.subscribe("lim/t", 1)
    sub.disconnect()
    seen_away(clients, broker, 1)  # else the publish may be read first, while the session is still connected
    sent = payloads(300)
    clients(broker.port, "pub", clean_session=True).publish("lim/t", sent, qos=1)
    assert sub.connect() is True
    assert texts(sub.wait_messages(200)) == sent[kept]
    assert not sub.wait_for(lambda ms: len(ms) > 200, timeout=0.5)
    lines = drop_warnings(broker, "lim")
    assert len(lines) == 1, f"100 drops within drop_log_interval must give one WARNING: {lines}"
    assert re.search(r"\blimit\b\D*\b200\b", lines[0]) and f"overflow {overflow}" in lines[0], lines[0]


def test_drop_newest_count_survives_a_sigkill_right_after_the_puback(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """A publish every queue drops (drop-newest) is acknowledged only once its drop count is
    stored: before, no commit followed such a publish, and a SIGKILL right after its PUBACK lost
    the count inspect shows."""
    broker = broker_factory(max_depth=3, max_depth_disconnected=3, overflow="drop-newest", metrics_interval=0.05)
    sub = clients(broker.port, "counted")
    sub.subscribe("count/t", 1)
    sub.disconnect()
    seen_away(clients, broker, 1)
    pub = clients(broker.port, "pub", clean_session=True)
    pub.publish("count/t", payloads(3), qos=1)  # committed and acknowledged: the queue is full
    pub.publish("count/t", payloads(2, "over"), qos=1)  # each acknowledged on its own, both dropped
    broker.kill()
    (row,) = [row for row in summarize(broker.store) if row.client_id == "counted"]
    assert (row.depth, row.dropped) == (3, 2)


def test_expanded_limit_holds_after_reconnect_until_80_percent(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    broker = broker_factory(
        max_depth=50, max_depth_disconnected=200, overflow="drop-newest", recovery_buffer=10, drop_log_interval=60,
        metrics_interval=0.05,
    )
    sub = clients(broker.port, "grow", manual_ack=True)
    sub.subscribe("g/t", 1)
    sub.disconnect()
    seen_away(clients, broker, 1)  # else the publish may be read first, while the session is still connected
    pub = clients(broker.port, "pub", clean_session=True)
    backlog = payloads(180, "old")
    pub.publish("g/t", backlog, qos=1)

    assert sub.connect() is True  # 180 queued: above 160 (80 % of 200), so the expanded limit stays
    sub.wait_messages(10)
    live = payloads(20, "new")
    pub.publish("g/t", live, qos=1)  # 200 queued, far above max_depth=50: kept
    pub.publish("g/t", [b"over-200"], qos=1)  # the expanded limit itself still holds
    # Nothing is acknowledged yet, so the queue holds exactly 200. An ack of message k lets message k+10 out,
    # so its arrival proves the broker has processed the ack.
    ack_in_order(sub, 0, 39)
    assert len(sub.wait_messages(49)) >= 49
    pub.publish("g/t", [b"at-161"], qos=1)  # 161 queued, still above 80 %: accepted
    ack_in_order(sub, 39, 41)
    assert len(sub.wait_messages(51)) >= 51  # 160 queued: the limit is back to max_depth
    pub.publish("g/t", [b"at-160"], qos=1)  # 160 >= 50: dropped

    expected = [*backlog, *live, b"at-161"]
    ack_in_order(sub, 41, len(expected))
    assert texts(sub.wait_messages(len(expected))) == expected, "reverting the limit must not purge the backlog"
    assert not sub.wait_for(lambda ms: len(ms) > len(expected), timeout=0.5)
    lines = drop_warnings(broker, "grow")
    assert len(lines) == 1 and re.search(r"\blimit\b\D*\b200\b", lines[0]), lines
