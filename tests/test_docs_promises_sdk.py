"""Promises of docs/sdk.md and docs/protocol.md (the SDK's API and the control requests' refusals)
that no other test states, each against a real broker.

Each test names the page and the promise it checks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_hostile_owner import acl_broker, login
from test_hostile_wire import wait_until
from test_mixed_clients import RECEIVE_ACL_PLUGIN
from test_protocol import ack_each, request, stream_events
from test_sdk import Recorder

from amqtt_durable.inspect_store import summarize
from amqtt_durable.process import free_port
from conftest import HOST, WAIT, Broker, Client, connack_code
from durable_client import AsyncDurableClient, CacheEntry, ConnectFailed, ConnectionInfo, DurableClient
from durable_client.protocol import CONTROL_TOPIC, MARKER_TOPIC, REPLY_TOPIC


def raw_request(client: Client, payload: bytes) -> dict[str, Any]:
    """Publish ``payload`` on the control topic as it is; the next reply, as JSON."""
    seen = sum(1 for m in client.wait_messages(0) if m.topic == REPLY_TOPIC)
    client.paho.publish(CONTROL_TOPIC, payload, qos=0)
    assert client.wait_for(lambda ms: sum(1 for m in ms if m.topic == REPLY_TOPIC) > seen), "no reply"
    reply: dict[str, Any] = json.loads([m.payload for m in client.messages if m.topic == REPLY_TOPIC][seen])
    return reply


# ------------------------------------------------------------------------------ protocol.md


@pytest.mark.parametrize(
    "case",
    [
        ({"op": "hello", "req": 3}, "unsupported_version", "hello", 3),  # `v` missing
        ({"v": "1", "op": "hello", "req": 4}, "unsupported_version", "hello", 4),  # `v` not the number 1
        ({"v": 2, "op": "hello", "req": 5}, "unsupported_version", "hello", 5),
        ({"v": 1, "req": 6}, "unknown_op", None, 6),  # `op` missing
        ({"v": 1, "op": "explode", "req": 7}, "unknown_op", None, 7),
        ({"v": 1, "op": "interest", "req": 8}, "malformed", "interest", 8),  # a field the op needs
        ({"v": 1, "op": "hello", "req": "9"}, "malformed", None, None),  # `req` not an integer
    ],
)
def test_a_request_without_v_or_op_is_refused_as_the_protocol_page_says(
    shared_broker: Broker,
    clients: Callable[..., Client],
    case_tag: str,
    case: tuple[dict[str, Any], str, str | None, int | None],
) -> None:
    """protocol.md, Requests and Replies: `v` missing or not 1 is `unsupported_version`, `op`
    missing or unknown is `unknown_op`, a missing field the op needs is `malformed`; the
    refusal echoes `req` and a known `op`, both null when `req` is not an integer."""
    request_fields, code, op, req = case
    client = clients(shared_broker.port, f"proto-refusals-{case_tag}")
    reply = raw_request(client, json.dumps(request_fields).encode())
    assert reply["ok"] is False and reply["error"]["code"] == code, reply
    assert (reply["op"], reply["req"]) == (op, req), reply
    assert client.paho.is_connected(), "a refused request leaves the connection up"


# ------------------------------------------------------------------------------ sdk.md


def test_a_cache_entry_has_value_seq_epoch_published_at_and_state(
    broker: Broker, sdk: Callable[..., DurableClient], clients: Callable[..., Client]
) -> None:
    """sdk.md, The last-value cache: `cache.entry(topic)` gives value, seq, epoch, published_at
    and state; `cache.invalidate(topic)` leaves an `invalid` entry that a new subscription's
    retained (initial) value fills; an empty live payload destroys the entry; `in` and
    iteration see valid entries only."""
    connected: list[Any] = []
    recorder = Recorder()
    live = threading.Event()
    dashboard = sdk(broker.port, "cache-entry", on_connected=connected.append, on_live=lambda _marker: live.set())
    dashboard.subscribe("ce/a", listener=recorder)
    dashboard.connect()
    dashboard.ready_for_events()
    # Before the marker, an event counts as replayed and leaves the cache alone (sdk.md).
    assert live.wait(10)
    publisher = clients(broker.port, "pub", clean_session=True)

    before = time.time()
    publisher.publish("ce/a", [b"live-1"], retain=True)
    (event,) = recorder.wait(1)
    entry = dashboard.cache.entry("ce/a")
    assert isinstance(entry, CacheEntry)
    assert (entry.value, entry.seq, entry.epoch, entry.state) == (b"live-1", event.seq, connected[0].epoch, "valid")
    assert before - 1 <= entry.published_at <= time.time() + 1
    assert "ce/a" in dashboard.cache and list(dashboard.cache) == ["ce/a"]

    dashboard.cache.invalidate("ce/a")
    invalid = dashboard.cache.entry("ce/a")
    assert invalid is not None and (invalid.value, invalid.state) == (None, "invalid")
    assert dashboard.cache.get("ce/a") is None and "ce/a" not in dashboard.cache and list(dashboard.cache) == []

    dashboard.subscribe("ce/+", listener=recorder)  # a new subscription: the retained value comes as initial value
    assert recorder.wait_until(lambda events: any(e.retained for e in events))
    assert dashboard.cache.get("ce/a") == b"live-1", "an invalidated entry takes the initial value"

    publisher.publish("ce/a", [b""])
    assert recorder.wait_until(lambda events: events[-1].payload == b"" and not events[-1].replayed)
    destroyed = dashboard.cache.entry("ce/a")
    assert destroyed is not None and (destroyed.value, destroyed.state) == (None, "destroyed")
    assert dashboard.cache.get("ce/a") is None and "ce/a" not in dashboard.cache


@pytest.mark.parametrize("bad_filter", ["a/#/b", "a/b#", "a+/b", "a/\x00", "a/\ud800"])
def test_an_invalid_filter_is_refused_before_connect_and_connect_still_works(
    shared_broker: Broker, sdk: Callable[..., DurableClient], case_tag: str, bad_filter: str
) -> None:
    """sdk.md, Subscriptions: subscriptions may be made before connect(). An invalid filter is
    refused there at once with ValueError, as when connected, and the client connects as usual
    (before, it was accepted and connect() failed after its timeout: paho raised on the network
    thread while sending the SUBSCRIBE)."""
    client = sdk(shared_broker.port, f"early-bad-filter-{case_tag}")
    with pytest.raises(ValueError, match="not a valid MQTT topic filter"):
        client.subscribe(bad_filter)
    with pytest.raises(ValueError, match="not a valid MQTT topic filter"):
        client.subscribe_stream(bad_filter, lambda _event: None)
    client.subscribe(f"fine/{case_tag}/#")
    client.connect(timeout=5)
    assert client.connected
    with pytest.raises(ValueError, match="not a valid MQTT topic filter"):
        client.subscribe(bad_filter)


# ------------------------------------------------------------------------------ streams.md + ACL


def test_the_topic_acl_refuses_a_stream_subscription_with_not_authorized(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """protocol.md, error `not_authorized` (a topic ACL plugin refused it); streams.md: topic ACL
    plugins apply to streams as to subscriptions. amqtt's ACL plugin lets bob subscribe to bob/#
    only: a stream_subscribe of secret/# is refused and changes nothing; bob/# is served; a
    stream_info of secret/# is refused too."""
    broker = acl_broker(broker_factory, streams=[{"filter": "#"}])
    login(clients, broker, "pub", "pub").publish("secret/1", [b"alice's"])
    bob = login(clients, broker, "bob-reader", "bob", clean_session=True)
    refused = request(bob, "stream_subscribe", filter="secret/#", window=10)
    assert (refused.ok, refused.error_code) == (False, "not_authorized"), refused
    assert bob.paho.is_connected()
    login(clients, broker, "pub", "pub").publish("bob/1", [b"bob's"])
    granted = request(bob, "stream_subscribe", filter="bob/#", window=10)
    assert granted.ok and granted.fields["topics"] == {"bob/1": {"first": 1, "last": 1}}, granted
    assert bob.wait_for(lambda _: len(stream_events(bob)) >= 1)
    assert [(topic, payload) for topic, _frame, payload in stream_events(bob)] == [("bob/1", b"bob's")]
    info = request(bob, "stream_info", filter="secret/#")
    assert (info.ok, info.error_code) == (False, "not_authorized"), "stream_info obeys the ACL as stream_subscribe"


def test_a_stream_subscription_sends_only_the_topics_the_reader_may_receive(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], tmp_path: Path
) -> None:
    """configuration.md, Topic ACL and read access; streams.md: ACL plugins apply to streams as
    to subscriptions. With a RECEIVE ACL (bob reads b/ only), bob's stream_subscribe of # opens
    and sends the b/ logs only, not the a/ ones, and stream_info does not name the a/ logs to bob
    (their topics and sizes are not his to see)."""
    (tmp_path / "receive_acl.py").write_text(RECEIVE_ACL_PLUGIN)
    broker = broker_factory(start=False, streams=[{"filter": "#"}])
    broker.pythonpath.append(str(tmp_path))
    broker.extra_plugins["receive_acl.ReceiveAcl"] = {"receive": {"alice": ["a/"], "bob": ["b/"]}}
    broker.start()
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("a/1", [b"for alice"])
    publisher.publish("b/1", [b"for bob"])
    bob = clients(broker.port, "bob-reader", clean_session=True, username="bob")
    reply = request(bob, "stream_subscribe", filter="#", window=10)
    assert reply.ok and reply.fields["topics"] == {"b/1": {"first": 1, "last": 1}}, reply
    publisher.publish("a/1", [b"alice again"])
    publisher.publish("b/1", [b"bob again"])
    assert bob.wait_for(lambda _: len(stream_events(bob)) >= 2)
    assert [(t, p) for t, _f, p in stream_events(bob)] == [("b/1", b"for bob"), ("b/1", b"bob again")]
    info = request(bob, "stream_info")
    assert info.ok and set(info.fields["topics"]) == {"b/1"}, "stream_info names only logs bob may receive"
    assert info.fields["filter"] == "#", "the default filter, echoed"
    alice = clients(broker.port, "alice-reader", clean_session=True, username="alice")
    assert set(request(alice, "stream_info").fields["topics"]) == {"a/1"}


def test_stream_unsubscribe_stops_a_filter_s_topics_unless_another_open_one_covers_them(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """protocol.md, stream_unsubscribe: its topics that no other open stream_subscribe of the
    connection covers send nothing more, and an ack on them gets `unknown_stream`; the reply
    echoes the filter. A topic another open filter covers goes on."""
    broker = broker_factory(streams=[{"filter": "u/#"}])
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("u/a", [b"a1"])
    publisher.publish("u/b", [b"b1"])
    reader = clients(broker.port, "reader", clean_session=True)
    opened = request(reader, "stream_subscribe", filter="u/#", window=10)
    assert opened.ok and opened.fields["filter"] == "u/#", opened
    assert request(reader, "stream_subscribe", filter="u/b", window=10).ok
    assert reader.wait_for(lambda _: len(stream_events(reader)) >= 2)
    reply = request(reader, "stream_unsubscribe", filter="u/#")
    assert reply.ok and reply.fields == {"filter": "u/#"}, reply
    refused = request(reader, "stream_ack", topic="u/a", id=1)
    assert (refused.ok, refused.error_code) == (False, "unknown_stream"), refused
    ack_each(reader, "u/b", range(1, 2))
    publisher.publish("u/a", [b"a2"])
    publisher.publish("u/b", [b"b2"])
    assert reader.wait_for(lambda _: any(payload == b"b2" for _t, _f, payload in stream_events(reader)))
    assert sorted((t, p) for t, _f, p in stream_events(reader)) == [("u/a", b"a1"), ("u/b", b"b1"), ("u/b", b"b2")]


def test_after_its_session_expired_a_restarted_cpl2_client_is_told_and_starts_its_marks_again(
    broker_factory: Callable[..., Broker],
    sdk: Callable[..., DurableClient],
    clients: Callable[..., Client],
    tmp_path: Path,
) -> None:
    """sdk.md, Subscriptions, reconnection and closing: `on_session_lost()` is called when the
    broker no longer has a session the client had (it expired); the client then starts as new,
    subscribes again and resets its marks. So the new session's events (sequence ids from 1
    again, in a new epoch) are processed, not dropped as duplicates of the old session's."""
    broker = broker_factory(session_expiry=0.5)
    watcher = clients(broker.port, "watcher", clean_session=True)
    watcher.subscribe("$SYS/broker/durable/expired", 1)
    publisher = clients(broker.port, "pub", clean_session=True)
    state = tmp_path / "state"

    first_events = Recorder()
    first = sdk(broker.port, "lost-dev", persistence="disk", state_dir=state)
    first.subscribe("lost/t", listener=first_events)
    first.connect()
    first.ready_for_events()
    publisher.publish("lost/t", [b"one", b"two", b"three"])
    old = first_events.wait(3)
    first.close(keep_session=True)
    assert watcher.wait_for(lambda ms: any(b'"lost-dev"' in m.payload for m in ms)), "the session expired"

    lost: list[bool] = []
    again = Recorder()
    second = sdk(
        broker.port, "lost-dev", persistence="disk", state_dir=state, on_session_lost=lambda: lost.append(True)
    )
    second.subscribe("lost/t", listener=again)
    second.connect()
    second.ready_for_events()
    assert lost == [True]
    publisher.publish("lost/t", [b"four"])
    (event,) = again.wait(1)
    assert event.payload == b"four" and event.epoch != old[0].epoch and event.seq <= old[-1].seq
    assert second.stats.duplicates_dropped == 0


def test_connect_fails_at_once_with_connect_failed_when_the_broker_refuses_the_client(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """sdk.md: without `failover` a CONNACK 3 (a replication backup refuses clients) at connect()
    fails at once with `ConnectFailed`; so does a CONNACK 5 (guarantees.md, Owner: another user's
    CONNECT of a durable session's client id). connect() may then be called again."""
    backup = broker_factory(
        start=False,
        replication={"role": "backup", "primary": f"{HOST}:{free_port()}", "listen": f"{HOST}:{free_port()}"},
    )
    backup.spawn()
    assert backup.wait_until(lambda: connack_code(backup.port) == 3, WAIT), backup.log()
    refused = DurableClient("sdk-refused", port=backup.port)
    started = time.monotonic()
    with pytest.raises(ConnectFailed, match="refused"):
        refused.connect(timeout=WAIT)
    assert time.monotonic() - started < WAIT / 3, "at once, not after the timeout"

    broker = broker_factory()
    clients(broker.port, "owned-dev", username="alice")
    intruder = DurableClient("owned-dev", port=broker.port, username="bob")
    started = time.monotonic()
    with pytest.raises(ConnectFailed, match="refused"):
        intruder.connect(timeout=WAIT)
    assert time.monotonic() - started < WAIT / 3
    with pytest.raises(ConnectFailed):
        intruder.connect(timeout=WAIT)
    intruder.close()
    refused.close()


def test_a_plain_async_for_left_early_does_not_acknowledge_and_async_with_does(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    """sdk.md, asyncio: inside `async with client.events() as events`, leaving the loop without an
    exception (`break`) acknowledges the event the body was on; a plain `async for event in
    client.events()` left early does not: that event comes again."""
    publisher = clients(broker.port, "pub", clean_session=True)

    async def main() -> list[bytes]:
        seen: list[bytes] = []
        async with AsyncDurableClient("async-leave", port=broker.port, reconnect_max_delay=0.5) as client:
            await client.subscribe("leave/t")
            await client.ready_for_events()
            await asyncio.to_thread(publisher.publish, "leave/t", [b"one", b"two", b"three"])
            async for event in client.events():
                seen.append(event.payload)
                break  # a plain async for: "one" is not acknowledged
            async with client.events() as events:
                async for event in events:
                    seen.append(event.payload)
                    if event.payload == b"two":
                        break  # inside async with: "two" is acknowledged
            async with client.events() as events:
                async for event in events:
                    seen.append(event.payload)
                    break
        return seen

    seen = asyncio.run(asyncio.wait_for(main(), 2 * WAIT))
    assert seen == [b"one", b"one", b"two", b"three"]


def test_a_durable_session_without_hello_is_not_held_and_gets_a_marker_on_ready_its_events_unframed(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    """protocol.md: without a `hello` a durable session is a plain MQTT session (no frames, no
    hold); `ready` still gets it a marker (its events unframed), after which live messages follow."""
    device = clients(broker.port, "plain-ready")
    device.subscribe("pr/t", 1)
    device.disconnect()
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("pr/t", [b"q1", b"q2"])
    device.connect()
    assert device.wait_for(lambda ms: len(ms) >= 2), "no hold: the queue comes at once"
    reply = request(device, "ready")
    assert reply.ok and reply.fields == {"already": False}, reply
    assert device.wait_for(lambda ms: any(m.topic == MARKER_TOPIC for m in ms))
    publisher.publish("pr/t", [b"live"])
    assert device.wait_for(lambda ms: any(m.payload == b"live" for m in ms))
    data = [(m.topic, m.payload) for m in device.messages if m.topic != REPLY_TOPIC]
    assert [payload for topic, payload in data if topic == "pr/t"] == [b"q1", b"q2", b"live"], "unframed"
    assert [topic for topic, _ in data] == ["pr/t", "pr/t", MARKER_TOPIC, "pr/t"]
    marker = json.loads(next(payload for topic, payload in data if topic == MARKER_TOPIC))
    assert marker["live"] == [{"filter": "pr/t", "qos": 1, "durable": True}]


def test_another_client_subscribed_to_durable_dollar_topics_receives_nothing(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """protocol.md, Topics: replies, markers and stream events are written to the one connection
    concerned, never routed; subscribing to them explicitly receives nothing."""
    broker = broker_factory(streams=[{"filter": "sx/#"}])
    spies = [clients(broker.port, "spy-clean", clean_session=True), clients(broker.port, "spy-durable")]
    for spy in spies:
        spy.subscribe([("$durable/#", 1), ("$durable/v1/reply", 1), ("$durable/v1/stream/sx/a", 1)])
    device = clients(broker.port, "sdk-dev")
    assert request(device, "hello").ok
    device.subscribe("sx/#", 1)
    assert request(device, "ready").ok
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("sx/a", [b"x"])
    assert request(device, "stream_subscribe", filter="sx/#").ok
    assert device.wait_for(lambda _: len(stream_events(device)) == 1)
    assert device.wait_for(lambda ms: any(m.topic == MARKER_TOPIC for m in ms))
    spies[0].subscribe("fence", 1)
    publisher.publish("fence", [b"f"])
    assert spies[0].wait_for(lambda ms: any(m.topic == "fence" for m in ms))
    assert [m.topic for m in spies[0].messages] == ["fence"]
    assert spies[1].messages == []


def test_when_one_listener_raises_every_listener_of_the_event_is_called_again(
    broker: Broker, sdk: Callable[..., DurableClient], clients: Callable[..., Client]
) -> None:
    """sdk.md, Sequence ids and exactly-once: a listener that raises gets the same event again,
    redelivered, in order; all listeners of the event are called again, also those that had
    returned. Each event is processed (all listeners returned) once."""
    first, failing = Recorder(), Recorder(fail_once_on=b"e2")
    device = sdk(broker.port, "two-listeners")
    device.subscribe("two/#", listener=first)
    device.subscribe("two/+", listener=failing)
    device.connect()
    device.ready_for_events()
    clients(broker.port, "pub", clean_session=True).publish("two/t", [b"e1", b"e2", b"e3"])
    assert [e.payload for e in failing.wait(3)] == [b"e1", b"e2", b"e3"]
    assert failing.attempts == [b"e1", b"e2", b"e2", b"e3"]
    assert first.attempts == [b"e1", b"e2", b"e2", b"e3"], "the listener that had returned is called again"
    assert failing.events[1].redelivered and not failing.events[0].redelivered
    assert device.stats.processed == 3 and device.stats.redeliveries_requested == 1


def test_a_hello_without_session_expiry_puts_the_broker_default_back(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """protocol.md, hello: `session_expiry` sets the session's expiry override (granted in the
    reply); a later hello without it removes the override (reply null), so the broker's
    `session_expiry` decides again."""
    broker = broker_factory(session_expiry=0.5)
    watcher = clients(broker.port, "watcher", clean_session=True)
    watcher.subscribe("$SYS/broker/durable/expired", 1)
    device = clients(broker.port, "hello-expiry")
    assert request(device, "hello", session_expiry=3600).fields["session_expiry"] == 3600
    assert request(device, "hello").fields["session_expiry"] is None
    device.disconnect()
    assert watcher.wait_for(lambda ms: any(b'"hello-expiry"' in m.payload for m in ms)), "expired after 0.5 s"


class Connections:
    """An SDK client's on_connected: every connection's info; ``reconnected`` set at the second."""

    def __init__(self) -> None:
        self.infos: list[ConnectionInfo] = []
        self.reconnected = threading.Event()

    def on_connected(self, info: ConnectionInfo) -> None:
        self.infos.append(info)
        if len(self.infos) == 2:
            self.reconnected.set()


def test_a_refused_subscription_is_a_warning_not_an_error_and_is_sent_again_on_reconnect(
    broker_factory: Callable[..., Broker],
    sdk: Callable[..., DurableClient],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """sdk.md, Subscriptions: a SUBACK refusing a filter (max_subscriptions_per_client here)
    does not raise; a WARNING says so, and the subscription is sent again after a reconnect."""
    broker = broker_factory(max_subscriptions_per_client=1)
    connections = Connections()

    def refusals() -> int:
        return sum("refused the subscription to over/t" in r.getMessage() for r in caplog.records)

    device = sdk(broker.port, "refused-sub", on_connected=connections.on_connected)
    device.subscribe("ok/t")
    device.connect()
    with caplog.at_level(logging.WARNING, logger="durable_client"):
        device.subscribe("over/t")  # over the limit: SUBACK 0x80, no exception
        assert wait_until(lambda: refusals() == 1, WAIT)
        broker.restart()
        assert connections.reconnected.wait(WAIT)
        assert wait_until(lambda: refusals() == 2, WAIT), "sent again (and refused again) after the reconnect"


def test_an_unsubscribe_lost_with_its_connection_is_sent_again_after_the_reconnect(
    broker: Broker, sdk: Callable[..., DurableClient], clients: Callable[..., Client]
) -> None:
    """sdk.md, Subscriptions: unsubscribe() removes the subscription. An UNSUBSCRIBE whose
    connection ends before its UNSUBACK (here the broker stops as it arrives) may never have been
    handled: the client sends it again on the next connection, so the broker does not keep the
    filter (and queue for it) for ever. Before, the client counted it sent and forgot it."""
    fence = Recorder()
    connections = Connections()

    device = sdk(broker.port, "unsub-lost", on_connected=connections.on_connected)
    device.subscribe("gone/t")
    device.subscribe("fence/t", listener=fence)
    device.connect()
    device.ready_for_events()
    device.unsubscribe("gone/t")
    broker.restart()
    assert connections.reconnected.wait(WAIT)
    assert connections.infos[1].session_present
    assert wait_until(lambda: not getattr(device._registry, "_unsubscribing", {}), WAIT), "no UNSUBACK"
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("gone/t", [b"not for us any more"])
    publisher.publish("fence/t", [b"fence"])
    fence.wait(1)
    assert device.stats.received == 1, "the broker still routed gone/t to the session"


def test_unsubscribe_then_close_leaves_the_session_without_the_filter(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    """sdk.md: unsubscribe() removes a subscription; close(keep_session=True) keeps the session.
    The UNSUBSCRIBE goes out right before the DISCONNECT, and the broker must store it (it
    dropped 4 in 10 when the socket closed before it had handled the packet)."""
    for round_ in range(5):
        client_id = f"unsub-then-close-{round_}"
        device = DurableClient(client_id, port=broker.port)
        device.subscribe("utc/gone")
        device.subscribe("utc/kept")
        device.connect()
        device.ready_for_events()
        device.unsubscribe("utc/gone")
        device.close(keep_session=True)
        raw = clients(broker.port, client_id)
        assert request(raw, "hello").fields["subscriptions"] == {"utc/kept": 1}, f"round {round_}"
        raw.disconnect()


def earlier_run(client: DurableClient, dropped: str) -> None:
    """A run that leaves durable subscriptions to ``dropped`` and kept/# in the broker's session."""
    client.subscribe(dropped, qos=1)
    client.subscribe("kept/#", qos=1)
    client.connect(timeout=WAIT)
    client.close(keep_session=True)


@pytest.mark.parametrize("connected", [True, False], ids=["connected", "before-connect"])
def test_unsubscribe_removes_a_durable_subscription_an_earlier_run_made(
    broker: Broker, sdk: Callable[..., DurableClient], connected: bool
) -> None:
    """A durable subscription outlives its client's process; a later run of the same client id
    that calls unsubscribe() on it (connected, or before connect(): sent on connecting) removes
    it from the broker's session. Before, unsubscribe() of a filter this run had not subscribed
    was a no-op and the broker queued for it for ever."""
    earlier_run(sdk(broker.port, "unsub-earlier"), "old/#")
    later = sdk(broker.port, "unsub-earlier")
    if connected:
        later.connect(timeout=WAIT)
        later.unsubscribe("old/#")
    else:
        later.unsubscribe("old/#")
        later.connect(timeout=WAIT)
    registry = later._registry  # its UNSUBACK arrived: nothing awaits one or waits to be sent
    assert wait_until(lambda: not registry._unsubscribing and not registry._unsubscribed, WAIT)
    later.close(keep_session=True)
    broker.stop()
    (session,) = summarize(broker.store)
    assert session.subscriptions == {"kept/#": 1}


def test_one_unsubscribe_removes_a_stream_and_a_durable_subscription_an_earlier_run_made(
    broker_factory: Callable[..., Broker], sdk: Callable[..., DurableClient]
) -> None:
    """sdk.md, Subscriptions: unsubscribe() also removes a durable subscription that only an
    earlier run made, in the same call when the filter is a stream subscription of this run too.
    Before, that call closed the stream only and a second unsubscribe() was needed."""
    broker = broker_factory(streams=[{"filter": "both/#"}])
    earlier_run(sdk(broker.port, "unsub-both"), "both/#")
    later = sdk(broker.port, "unsub-both")
    later.subscribe_stream("both/#", lambda _event: None)
    later.connect(timeout=WAIT)
    later.unsubscribe("both/#")
    registry = later._registry  # its UNSUBACK arrived: nothing awaits one or waits to be sent
    assert wait_until(lambda: not registry._unsubscribing and not registry._unsubscribed, WAIT)
    later.close(keep_session=True)
    broker.stop()
    (session,) = summarize(broker.store)
    assert session.subscriptions == {"kept/#": 1}
