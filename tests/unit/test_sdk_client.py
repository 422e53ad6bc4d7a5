"""durable_client.client: connection set-up, session loss, replay of subscriptions, close.

The client's network callbacks are driven by hand against a recording link, so every rule
of a (re)connection is checked without a broker or a thread.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from durable_client import (
    ConnectFailed,
    ConnectionInfo,
    ControlRequestFailed,
    DurableClient,
    Event,
    Marker,
    RequestTimeout,
    Unconnected,
)
from durable_client._paho import ConnAck, Inbound
from durable_client.client import _FirstConnect
from durable_client.persistence import DiskState
from durable_client.protocol import (
    CONTROL_TOPIC,
    MARKER_TOPIC,
    REPLY_TOPIC,
    STREAM_TOPIC_PREFIX,
    ProtocolError,
    Request,
    encode_error,
    encode_frame,
    encode_marker,
    encode_reply,
    parse_request,
)


class FakeHandle:
    def __init__(self, done: bool) -> None:
        self.queued = True
        self.done = done
        self.too_large = False
        self.refused = False
        self.mid = 0

    def is_for(self, info: object) -> bool:
        return info is self

    def wait(self, timeout: float) -> bool:
        return self.done


def _open_streams(request: Request) -> bytes | None:
    """The broker's answer to what waits for one by default: stream_subscribe succeeds, and so
    does interest (a change of durability only waits for its reply)."""
    if request.op == "stream_subscribe":
        return encode_reply("stream_subscribe", request.req, topics={}, gaps={})
    if request.op == "interest":
        return encode_reply("interest", request.req, filter=request.filter, durable=request.durable)
    return None


class FakeLink:
    """Records what the client sends; ``respond`` may answer a request at once."""

    def __init__(self) -> None:
        self.sent: list[tuple[Any, ...]] = []
        self.socket_open = True
        self.puback = True
        self.respond: Callable[[Request], bytes | None] | None = _open_streams
        self.client: DurableClient | None = None
        self.suback = True
        """Confirm each SUBSCRIBE from another thread, as the network thread would (subscribe() waits)."""
        self._subacks: list[threading.Thread] = []
        self._mid = 100
        self.unqueued: set[str] = set()
        """Ops whose request paho does not queue (the connection was just lost: Unconnected)."""

    def publish(
        self,
        topic: str,
        payload: bytes,
        qos: int,
        retain: bool = False,
        registered: Callable[[FakeHandle], None] | None = None,
    ) -> FakeHandle:
        if topic == CONTROL_TOPIC:
            request = parse_request(payload)
            if request.op in self.unqueued:
                handle = FakeHandle(False)
                handle.queued = False
                return handle
            self.sent.append(("request", request))
            if self.respond is not None and self.client is not None:
                answer = self.respond(request)
                if answer is not None:
                    self.client._handle_message(Inbound(REPLY_TOPIC, answer, 0, False, False, 0))
        else:
            self.sent.append(("publish", topic, payload, qos, retain))
        handle = FakeHandle(self.puback or qos == 0)
        if registered is not None:
            registered(handle)
            if handle.done and self.client is not None:
                self.client._handle_published(handle.mid, handle)  # its PUBACK, as the link tells it
        return handle

    def subscribe(self, topic_filter: str, qos: int) -> int:
        self._mid += 1
        self.sent.append(("subscribe", topic_filter, qos))
        if self.suback and self.client is not None:
            # Blocks on the registry lock until the caller has stored the mid, as a real SUBACK would.
            suback = threading.Thread(target=self.client._handle_subscribed, args=(self._mid, True))
            self._subacks.append(suback)
            suback.start()
        return self._mid

    def settle(self) -> None:
        """Wait until every SUBACK the link sent has been handled (a deferred ``ready`` went out)."""
        for suback in self._subacks:
            suback.join(5.0)

    def unsubscribe(self, topic_filter: str) -> int:
        self._mid += 1
        self.sent.append(("unsubscribe", topic_filter))
        return self._mid

    def ack(self, mid: int, qos: int) -> None:
        if qos > 0:  # as PahoLink: QoS 0 has nothing to acknowledge
            self.sent.append(("ack", mid))

    def ack_many(self, mids: list[int]) -> None:
        for mid in mids:
            self.ack(mid, 1)

    def wake(self) -> None:
        self.sent.append(("wake",))

    def drop(self) -> None:
        self.sent.append(("drop",))

    def release_resends(self, limit: int | None) -> list[tuple[str, int]]:
        return []  # paho holds nothing here to send again

    def disconnect(self) -> None:
        self.sent.append(("disconnect",))

    # ------------------------------------------------------------- reading
    def requests(self, op: str | None = None) -> list[Request]:
        return [s[1] for s in self.sent if s[0] == "request" and (op is None or s[1].op == op)]

    def wire(self) -> list[tuple[Any, ...]]:
        """What was sent, requests shown as (op, filter/durable), hello left out."""
        out: list[tuple[Any, ...]] = []
        for item in self.sent:
            if item[0] == "request":
                request: Request = item[1]
                if request.op == "interest":
                    out.append(("interest", request.filter, request.durable))
                elif request.op == "stream_subscribe":
                    out.append(("stream_subscribe", request.filter, request.after))
                elif request.op != "hello":
                    out.append((request.op,))
            else:
                out.append(item)
        return out

    def clear(self) -> None:
        self.sent.clear()


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def connected(self, info: ConnectionInfo) -> None:
        self.calls.append(("connected", info))

    def disconnected(self, reason: str) -> None:
        self.calls.append(("disconnected", reason))

    def session_lost(self) -> None:
        self.calls.append(("session_lost",))

    def live(self, marker: Marker) -> None:
        self.calls.append(("live", marker))

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def make(recorder: Recorder) -> Iterator[Callable[..., tuple[DurableClient, FakeLink]]]:
    made: list[DurableClient] = []

    def factory(**kwargs: Any) -> tuple[DurableClient, FakeLink]:
        client = DurableClient(
            "c1",
            on_connected=recorder.connected,
            on_disconnected=recorder.disconnected,
            on_session_lost=recorder.session_lost,
            on_live=recorder.live,
            **kwargs,
        )
        link = FakeLink()
        link.client = client
        client._link = link  # type: ignore[assignment]
        made.append(client)
        return client, link

    yield factory
    for client in made:
        client.close()


def connect(
    client: DurableClient,
    link: FakeLink,
    *,
    session_present: bool,
    epoch: int | None = 12,
    subscriptions: dict[str, int] | None = None,
) -> None:
    """One CONNACK + hello reply (``subscriptions``: what the broker's session holds, if said),
    as the network thread would see them."""
    client._handle_connack(ConnAck(True, session_present, "Success"))
    hello = link.requests("hello")[-1]
    held = {} if subscriptions is None else {"subscriptions": subscriptions}
    reply = encode_reply("hello", hello.req, protocol=1, epoch=epoch, session_expiry=None, **held)
    client._handle_message(Inbound(REPLY_TOPIC, reply, 0, False, False, 0))


def lose(client: DurableClient, link: FakeLink) -> None:
    client._handle_lost("Unspecified error")
    link.clear()


def event(client: DurableClient, topic: str, seq: int, *, epoch: int = 12, mid: int = 1, flags: int = 0) -> None:
    payload = encode_frame(flags, epoch, seq, 1.0) + b"p"
    client._handle_message(Inbound(topic, payload, 1, False, False, mid))
    client._end_burst()  # the network loop's end of a burst: the PUBACKs gathered go out


# ------------------------------------------------------------------- set-up
def test_hello_after_connack_and_connected_after_its_reply(make: Any, recorder: Recorder) -> None:
    client, link = make(session_expiry=3600)
    client._handle_connack(ConnAck(True, False, "Success"))
    (hello,) = link.requests()
    assert hello.op == "hello" and hello.session_expiry == 3600.0 and hello.req is not None
    assert not client.connected and client.cache.stale
    reply = encode_reply("hello", hello.req, protocol=1, epoch=12, session_expiry=3600.0)
    client._handle_message(Inbound(REPLY_TOPIC, reply, 0, False, False, 0))
    assert client.connected and not client.cache.stale
    assert recorder.calls == [("connected", ConnectionInfo(False, 12, 3600.0))]
    assert client._state.epoch == 12


def test_reply_to_another_request_does_not_finish_the_handshake(make: Any) -> None:
    client, _link = make()
    client._handle_connack(ConnAck(True, False, "Success"))
    client._handle_message(Inbound(REPLY_TOPIC, encode_reply("hello", 999, epoch=1), 0, False, False, 0))
    assert not client.connected


def test_refused_connack_fails_connect_at_once(make: Any) -> None:
    client, _link = make()
    client._first = first = _FirstConnect()
    client._handle_connack(ConnAck(False, False, "Not authorized"))
    assert first.done.is_set() and isinstance(first.error, ConnectFailed)
    assert "refused the connection: Not authorized" in str(first.error)
    assert client._stop.is_set()


def test_hello_error_fails_connect_and_later_drops(make: Any, caplog: pytest.LogCaptureFixture) -> None:
    client, link = make()
    client._first = first = _FirstConnect()
    client._handle_connack(ConnAck(True, False, "Success"))
    error = encode_error("hello", link.requests("hello")[-1].req, ProtocolError("unsupported_version", "v1 only"))
    client._handle_message(Inbound(REPLY_TOPIC, error, 0, False, False, 0))
    assert isinstance(first.error, ConnectFailed) and "unsupported_version: v1 only" in str(first.error)
    # The same error on a reconnect (connect() returned long ago): drop and retry.
    client._stop.clear()
    client._handle_connack(ConnAck(True, False, "Success"))
    error = encode_error("hello", link.requests("hello")[-1].req, ProtocolError("unsupported_version", "v1 only"))
    with caplog.at_level(logging.ERROR, logger="durable_client"):
        client._handle_message(Inbound(REPLY_TOPIC, error, 0, False, False, 0))
    assert link.sent[-1] == ("drop",) and not client.connected


# ------------------------------------------------------------ subscriptions
def test_subscribe_variants_on_the_wire(make: Any) -> None:
    client, link = make()
    connect(client, link, session_present=False)
    link.clear()
    client.subscribe("d/#")
    client.subscribe("q2", qos=2)
    client.subscribe("n/#", durable=False)
    client.subscribe("n/#", durable=True)  # turns durable: interest only, no new SUBSCRIBE
    client.subscribe("d/#", qos=0)  # QoS change: SUBSCRIBE again
    client.subscribe("d/#", qos=0, listener=lambda e: None)  # listener change: nothing to send
    assert link.wire() == [
        ("subscribe", "d/#", 1),
        ("subscribe", "q2", 1),  # QoS 2 becomes 1 on a durable session
        ("interest", "n/#", False),
        ("subscribe", "n/#", 1),
        ("interest", "n/#", True),
        ("subscribe", "d/#", 0),
    ]


def test_reconnect_with_session_present_replays_only_what_the_broker_dropped(make: Any) -> None:
    client, link = make()
    connect(client, link, session_present=False)
    client.subscribe("d/#")
    client.subscribe("n/#", durable=False)
    client.subscribe_stream("s/#", lambda e: None, window=5)
    client.ready_for_events()
    for subscription in client._registry.subscriptions():
        client._handle_subscribed(subscription.mid or 0, True)
    client._state.record_stream("s/a", 7)
    client._state.record_stream("other/x", 3)
    lose(client, link)
    connect(client, link, session_present=True)
    link.settle()
    assert link.wire() == [
        ("interest", "n/#", False),
        ("subscribe", "n/#", 1),
        ("stream_subscribe", "s/#", {"s/a": 7}),
        ("ready",),
    ]
    assert link.requests("stream_subscribe")[0].window == 5


def test_unconfirmed_durable_subscription_is_sent_again(make: Any) -> None:
    client, link = make()
    connect(client, link, session_present=False)
    link.suback = False
    with pytest.raises(RequestTimeout):
        client.subscribe("d/#", timeout=0.05)  # no SUBACK before the connection died
    lose(client, link)
    connect(client, link, session_present=True)
    assert link.wire() == [("subscribe", "d/#", 1)]


def test_subscription_turned_durable_while_away_is_sent_again(make: Any) -> None:
    client, link = make()
    connect(client, link, session_present=False)
    client.subscribe("n/#", durable=False)
    client._handle_subscribed(client._registry.subscriptions()[0].mid or 0, True)
    lose(client, link)  # the broker dropped the non-durable subscription
    client.subscribe("n/#", durable=True)
    connect(client, link, session_present=True)
    assert link.wire() == [("interest", "n/#", True), ("subscribe", "n/#", 1)]


def test_subscription_turned_durable_while_away_says_so_before_the_hello(make: Any) -> None:
    """protocol.md, `interest`: the broker drops a non-durable subscription when the connection that
    sent it ends, and until that end has run the newer connection's hello may still list it (an
    older connection the broker still counts as open, taken over). Made durable again while away,
    the SDK saw it in the hello's list and sent nothing: the older connection's end then dropped it.
    Now ``interest durable: true`` goes before the hello (the broker applies requests in order), once."""
    client, link = make()
    connect(client, link, session_present=False)
    client.subscribe("n/#", durable=False)
    client._handle_subscribed(client._registry.subscriptions()[0].mid or 0, True)
    lose(client, link)
    client.subscribe("n/#", durable=True)
    connect(client, link, session_present=True, subscriptions={"n/#": 1})
    assert [request.op for request in link.requests()] == ["interest", "hello"]
    assert link.wire() == [("interest", "n/#", True)]  # held by the broker: no SUBSCRIBE
    lose(client, link)
    connect(client, link, session_present=True, subscriptions={"n/#": 1})
    assert link.wire() == [], "said once"


def test_refused_suback_is_logged_and_retried(make: Any, caplog: pytest.LogCaptureFixture) -> None:
    client, link = make()
    connect(client, link, session_present=False)
    link.suback = False
    with pytest.raises(RequestTimeout):
        client.subscribe("secret/#", timeout=0.05)
    sub = client._registry.get("secret/#")
    assert sub is not None and sub.mid is not None
    with caplog.at_level(logging.WARNING, logger="durable_client"):
        client._handle_subscribed(sub.mid, False)
    assert "refused the subscription to secret/#" in caplog.text
    causes = ("topic ACL", "max_subscriptions_per_client", "max_subscription_bytes_per_client", "store", "primary")
    assert all(cause in caplog.text for cause in causes), "the causes of a 0x80"
    lose(client, link)
    connect(client, link, session_present=True)
    assert link.wire() == [("subscribe", "secret/#", 1)]


def test_subscriptions_made_while_disconnected_go_out_on_connect(make: Any) -> None:
    client, link = make()
    client.subscribe("early/#", durable=False)
    client.ready_for_events()
    assert link.sent == []
    connect(client, link, session_present=False)
    link.settle()
    assert link.wire() == [("interest", "early/#", False), ("subscribe", "early/#", 1), ("ready",)]


def test_ready_waits_for_the_subacks_and_unsubacks_of_the_connections_set_up(make: Any) -> None:
    """sdk.md, the marker lists the live subscriptions: the broker handles a SUBSCRIBE after control
    requests that arrived before it (protocol.md), so a `ready` sent along with the set-up's
    SUBSCRIBEs and UNSUBSCRIBEs got a marker without them (a new session's `live` was empty)."""
    client, link = make()
    link.suback = False
    client.subscribe("a/#")
    client.unsubscribe("old/#")
    client.ready_for_events()
    connect(client, link, session_present=True, subscriptions={"old/#": 1})
    assert link.wire() == [("unsubscribe", "old/#"), ("subscribe", "a/#", 1)]
    subscription = client._registry.get("a/#")
    assert subscription is not None and subscription.mid is not None
    unsubscribe_mid = subscription.mid - 1  # the UNSUBSCRIBE went just before
    client._handle_subscribed(subscription.mid, True)
    assert ("ready",) not in link.wire()  # the UNSUBACK is still due
    client._handle_unsubscribed(unsubscribe_mid)
    assert link.wire()[-1] == ("ready",)
    client.ready_for_events()  # one ready per connection
    assert link.wire().count(("ready",)) == 1


def test_unsubscribe_while_disconnected_is_sent_on_reconnect(make: Any) -> None:
    client, link = make()
    connect(client, link, session_present=False)
    client.subscribe("d/#")
    client.subscribe_stream("s/#", lambda e: None)
    lose(client, link)
    client.unsubscribe("d/#")
    client.unsubscribe("s/#")
    client.unsubscribe("never/subscribed")
    client.unsubscribe("earlier/run")  # the broker's session holds it: an earlier run subscribed it
    connect(client, link, session_present=True, subscriptions={"d/#": 1, "earlier/run": 1})
    assert link.wire() == [("unsubscribe", "d/#"), ("unsubscribe", "earlier/run")]


def test_a_reconnect_sends_the_unsubscribes_still_due_before_the_subscribes(make: Any) -> None:
    """The broker applies them in order: a filter unsubscribed frees its place under
    max_subscriptions_per_client before the SUBSCRIBEs arrive (sent after them, a subscription
    refused for want of room stayed refused although the UNSUBSCRIBE made room)."""
    client, link = make()
    connect(client, link, session_present=False)
    client.subscribe("a/#")
    client.subscribe("b/#")
    lose(client, link)
    client.unsubscribe("a/#")
    client.subscribe("c/#")
    connect(client, link, session_present=True, subscriptions={"a/#": 1})
    assert link.wire() == [("unsubscribe", "a/#"), ("subscribe", "b/#", 1), ("subscribe", "c/#", 1)]


def test_unsubscribe_when_connected_of_a_subscription_an_earlier_run_made(make: Any) -> None:
    client, link = make()
    connect(client, link, session_present=True, subscriptions={"earlier/run": 1})
    link.clear()
    client.unsubscribe("never/subscribed")
    client.unsubscribe("earlier/run")
    assert link.wire() == [("unsubscribe", "earlier/run")]


def test_unsubscribe_when_connected_to_a_new_session_of_a_filter_it_does_not_hold_is_a_no_op(make: Any) -> None:
    """The hello of a new session lists what the broker holds (nothing): that list decides, as for
    a present session (it was taken for "not said", and an UNSUBSCRIBE went out)."""
    client, link = make()
    connect(client, link, session_present=False, subscriptions={})
    link.clear()
    client.unsubscribe("never/subscribed")
    client.unsubscribe("earlier/run")
    assert link.wire() == []
    assert client._registry.broker_held == set()


def test_an_unsubscribe_deferred_across_a_lost_session_is_sent_if_the_new_hello_names_the_filter(
    make: Any, tmp_path: Any
) -> None:
    """Session present but its epoch changed (lost): the pending UNSUBSCRIBE was dropped even though
    the broker's session names the filter; a lost session without a list holds nothing."""
    client, link = make(persistence="disk", state_dir=tmp_path)
    connect(client, link, session_present=True, epoch=12, subscriptions={})
    lose(client, link)
    client.unsubscribe("x")
    client.unsubscribe("y")
    connect(client, link, session_present=True, epoch=13, subscriptions={"x": 1})
    assert ("unsubscribe", "x") in link.wire()
    assert ("unsubscribe", "y") not in link.wire()
    lose(client, link)
    client.unsubscribe("z")
    connect(client, link, session_present=True, epoch=14)  # lost, and no list: nothing to remove
    assert ("unsubscribe", "z") not in link.wire()


def test_one_unsubscribe_removes_a_stream_and_the_durable_subscription_an_earlier_run_made(make: Any) -> None:
    """sdk.md: a filter that is a stream subscription of this run and a durable subscription the
    broker's session names (an earlier run's) goes with one call; a second call sends nothing."""
    client, link = make()
    connect(client, link, session_present=True, subscriptions={"s/#": 1})
    client.subscribe_stream("s/#", lambda e: None)
    link.clear()
    client.unsubscribe("s/#")
    assert link.wire() == [("stream_unsubscribe",), ("unsubscribe", "s/#")]
    link.clear()
    client.unsubscribe("s/#")
    assert link.wire() == []


def test_unsubscribe_when_connected(make: Any) -> None:
    client, link = make()
    connect(client, link, session_present=False)
    client.subscribe("d/#")
    client.subscribe_stream("s/#", lambda e: None)
    link.clear()
    client.unsubscribe("d/#")
    client.unsubscribe("s/#")
    assert link.wire() == [("unsubscribe", "d/#"), ("stream_unsubscribe",)]


def test_sdk_topics_cannot_be_subscribed_or_published(make: Any) -> None:
    client, link = make()
    connect(client, link, session_present=False)
    for bad in ("_durable/v1/ctl", "$durable/v1/reply", ""):
        with pytest.raises(ValueError):
            client.subscribe(bad)
    with pytest.raises(ValueError, match="control channel"):
        client.publish("_durable/v1/ctl", b"{}")


def test_a_subacks_delivery_log_record_is_written_when_the_deferred_ready_cannot_be_sent(
    make: Any, tmp_path: Path
) -> None:
    """The SUBACK that lets the deferred ``ready`` go out is recorded (``subscribe``) first: a
    connection lost just then (paho does not queue the ``ready``: Unconnected) skipped the record."""
    log_path = tmp_path / "log.jsonl"
    client, link = make(delivery_log=str(log_path))
    link.suback = False
    client.subscribe("d/#")
    client.ready_for_events()
    connect(client, link, session_present=False)
    assert link.wire() == [("subscribe", "d/#", 1)], "ready waits for the SUBACK"
    link.unqueued.add("ready")
    with pytest.raises(Unconnected):
        client._handle_subscribed(client._registry.subscriptions()[0].mid or 0, True)
    client.close()
    assert [json.loads(line)["kind"] for line in log_path.read_text().splitlines()] == ["connect", "subscribe"]


# ------------------------------------------------------------- session loss
def test_session_present_zero_after_a_session_means_lost(make: Any, recorder: Recorder) -> None:
    client, link = make()
    connect(client, link, session_present=False)
    client.subscribe("d/#")
    client.subscribe("n/#", durable=False)
    client.ready_for_events()
    for subscription in client._registry.subscriptions():
        client._handle_subscribed(subscription.mid or 0, True)
    event(client, "d/x", 5)
    lose(client, link)
    recorder.calls.clear()
    connect(client, link, session_present=False, epoch=13)
    link.settle()
    assert recorder.names() == ["session_lost", "connected"]
    assert link.wire() == [
        ("subscribe", "d/#", 1),
        ("interest", "n/#", False),
        ("subscribe", "n/#", 1),
        ("ready",),
    ]
    assert (client._state.epoch, client._state.get_mark(13)) == (13, 0)


def test_new_epoch_with_session_present_means_lost(make: Any, recorder: Recorder) -> None:
    client, link = make()
    connect(client, link, session_present=False, epoch=12)
    client.subscribe("d/#")
    client._handle_subscribed(client._registry.subscriptions()[0].mid or 0, True)
    lose(client, link)
    recorder.calls.clear()
    connect(client, link, session_present=True, epoch=20)
    assert recorder.names() == ["session_lost", "connected"]
    assert link.wire() == [("subscribe", "d/#", 1)]


def test_first_connect_of_a_process_is_not_a_loss(make: Any, recorder: Recorder) -> None:
    client, link = make()
    connect(client, link, session_present=False)
    assert recorder.names() == ["connected"]


def test_disk_state_from_a_previous_run_detects_a_loss(make: Any, recorder: Recorder, tmp_path: Path) -> None:
    previous = DiskState(tmp_path, "c1")
    previous.record(12, 40)
    previous.close()
    client, link = make(persistence="disk", state_dir=tmp_path)
    assert client.persistence_level == "disk"
    connect(client, link, session_present=False, epoch=30)
    assert recorder.names() == ["session_lost", "connected"]


def test_disk_state_with_the_same_session_keeps_its_mark(make: Any, recorder: Recorder, tmp_path: Path) -> None:
    previous = DiskState(tmp_path, "c1")
    previous.record(12, 40)
    previous.close()
    client, link = make(persistence="disk", state_dir=tmp_path, fsync_batch=1)  # an fsync (and ack) per event
    connect(client, link, session_present=True, epoch=12)
    assert recorder.names() == ["connected"]
    seen: list[int] = []
    client.subscribe("#", listener=lambda e: seen.append(e.seq))
    event(client, "t", 40, mid=1)
    event(client, "t", 41, mid=2)
    assert seen == [41] and ("ack", 1) in link.sent and ("ack", 2) in link.sent


# ------------------------------------------------------------------ messages
def test_failed_listener_drops_the_connection_without_ack(make: Any) -> None:
    client, link = make()
    connect(client, link, session_present=False)

    def listener(e: Event) -> None:
        raise ValueError("boom")

    client.subscribe("#", listener=listener)
    link.clear()
    event(client, "t", 1, mid=7)
    event(client, "t", 2, mid=8)
    assert link.sent == [("drop",)]
    assert client.stats.redeliveries_requested == 1


def test_stream_events_are_acknowledged_by_one_cumulative_stream_ack_per_quiet_loop(make: Any) -> None:
    client, link = make(durable_session=False)
    connect(client, link, session_present=False, epoch=None)
    seen: list[Event] = []
    client.subscribe_stream("s/#", seen.append)
    link.clear()
    for event_id in (4, 5, 6):
        data = encode_frame(0, 0, event_id, 1.0) + b"x"
        client._handle_message(Inbound(STREAM_TOPIC_PREFIX + "s/a", data, 0, False, False, 0))
    assert link.requests("stream_ack") == [], "held until the network loop finds nothing more to read"
    client._stream_acks.flush()  # what the network loop does after a pass that read nothing
    (ack,) = link.requests("stream_ack")
    assert (ack.topic, ack.id, ack.req) == ("s/a", 6, None), "one ack covers every id up to it"
    assert [(e.topic, e.seq, e.stream) for e in seen] == [("s/a", 4, True), ("s/a", 5, True), ("s/a", 6, True)]


def test_a_long_run_of_stream_events_is_acknowledged_every_64_without_a_quiet_loop(make: Any) -> None:
    client, link = make(durable_session=False)
    connect(client, link, session_present=False, epoch=None)
    client.subscribe_stream("s/#", lambda event: None)
    link.clear()
    for event_id in range(1, 130):
        data = encode_frame(0, 0, event_id, 1.0) + b"x"
        client._handle_message(Inbound(STREAM_TOPIC_PREFIX + "s/a", data, 0, False, False, 0))
    assert [ack.id for ack in link.requests("stream_ack")] == [64, 128]
    client._handle_lost("gone")
    client._stream_acks.flush()
    assert [ack.id for ack in link.requests("stream_ack")] == [64, 128], "a lost connection's acks are dropped"


def test_marker_calls_on_live(make: Any, recorder: Recorder) -> None:
    client, link = make()
    connect(client, link, session_present=False)
    recorder.calls.clear()
    marker = Marker(12, 0, None, None, ())
    client._handle_message(Inbound(MARKER_TOPIC, encode_marker(marker), 0, False, False, 0))
    assert recorder.calls == [("live", marker)]


def test_error_reply_without_a_waiter_is_logged(make: Any, caplog: pytest.LogCaptureFixture) -> None:
    client, link = make()
    connect(client, link, session_present=False)
    error = encode_error("interest", 77, ProtocolError("bad_filter", "filter 'a/#/b' is not valid"))
    with caplog.at_level(logging.WARNING, logger="durable_client"):
        client._handle_message(Inbound(REPLY_TOPIC, error, 0, False, False, 0))
    assert "bad_filter" in caplog.text and "is not valid" in caplog.text


def test_raising_callbacks_do_not_break_the_client(make: Any, caplog: pytest.LogCaptureFixture) -> None:
    def bad(*args: Any) -> None:
        raise RuntimeError("callback bug")

    client = DurableClient("c2", on_connected=bad, on_live=bad)
    link = FakeLink()
    client._link = link  # type: ignore[assignment]
    with caplog.at_level(logging.ERROR, logger="durable_client"):
        connect(client, link, session_present=False)
        client._handle_message(Inbound(MARKER_TOPIC, encode_marker(Marker(1, 0, None, None, ())), 0, False, False, 0))
    assert client.connected
    assert [r.exc_info[1].args for r in caplog.records if r.exc_info and r.exc_info[1]] == [("callback bug",)] * 2
    client.close()


# ------------------------------------------------------------- stateless
def test_stateless_client_resubscribes_everything_plainly(make: Any) -> None:
    client, link = make(durable_session=False)
    connect(client, link, session_present=False, epoch=None)
    client.subscribe("a/#", qos=2, durable=False)
    client.subscribe("b/#")
    client.ready_for_events()  # no session to hold: nothing sent
    for subscription in client._registry.subscriptions():
        client._handle_subscribed(subscription.mid or 0, True)
    lose(client, link)
    connect(client, link, session_present=False, epoch=None)
    assert link.wire() == [("subscribe", "a/#", 2), ("subscribe", "b/#", 1)]
    seen: list[Event] = []
    client.subscribe("raw", listener=seen.append)
    client._handle_message(Inbound("raw", b"plain", 1, False, False, 9))
    client._end_burst()
    assert [(e.payload, e.seq, e.epoch) for e in seen] == [(b"plain", 0, 0)]
    assert link.sent[-1] == ("ack", 9)


# ------------------------------------------------------------------- publish
def test_publish_needs_a_connection(make: Any) -> None:
    client, link = make()
    with pytest.raises(Unconnected, match="not connected"):
        client.publish("t", b"x")
    connect(client, link, session_present=False)
    client.publish("t", "text", qos=1)
    assert link.sent[-1] == ("publish", "t", b"text", 1, False)
    lose(client, link)
    with pytest.raises(Unconnected):
        client.publish("t", b"x")


def test_publish_without_puback_times_out(make: Any) -> None:
    client, link = make()
    connect(client, link, session_present=False)
    link.puback = False
    with pytest.raises(RequestTimeout, match="no PUBACK") as info:
        client.publish("t", b"x", timeout=0.01)
    assert isinstance(info.value, TimeoutError)
    client.publish("t", b"x", qos=0)  # QoS 0 does not wait
    with pytest.raises(TypeError, match="bytes or str"):
        client.publish("t", 5, qos=0)  # type: ignore[arg-type]


# -------------------------------------------------------------- requests
def test_subscribe_stream_waits_for_the_reply(make: Any, caplog: pytest.LogCaptureFixture) -> None:
    client, link = make()
    connect(client, link, session_present=False)

    def respond(request: Request) -> bytes | None:
        if request.op == "stream_subscribe" and request.filter == "s/#":
            return encode_reply("stream_subscribe", request.req, topics={}, gaps={"s/a": [1, 9]})
        if request.op == "stream_subscribe":
            return encode_error("stream_subscribe", request.req, ProtocolError("unknown_stream", "no stream"))
        return None

    link.respond = respond
    with caplog.at_level(logging.WARNING, logger="durable_client"):
        client.subscribe_stream("s/#", lambda e: None)
    assert "ids 1 to 9 were trimmed" in caplog.text
    with pytest.raises(ControlRequestFailed) as info:
        client.subscribe_stream("nope/#", lambda e: None)
    assert (info.value.code, info.value.op) == ("unknown_stream", "stream_subscribe")
    assert [s.filter for s in client._registry.streams()] == ["s/#"]


def test_request_timeout_and_lost_connection(make: Any) -> None:
    client, link = make()
    connect(client, link, session_present=False)
    link.respond = None  # the broker never answers
    with pytest.raises(RequestTimeout, match="stream_subscribe"):
        client.subscribe_stream("s/#", lambda e: None, timeout=0.01)
    assert client._waiters == {}

    def lose_on_request(request: Request) -> None:
        client._handle_lost("Connection lost")

    link.respond = lose_on_request  # type: ignore[assignment]
    with pytest.raises(Unconnected, match="lost before the reply"):
        client.subscribe_stream("t/#", lambda e: None)


# ------------------------------------------------------------------ close
def test_close_keep_session_false_ends_the_session(make: Any) -> None:
    client, link = make()
    connect(client, link, session_present=False)
    event(client, "t", 5)
    link.respond = lambda r: encode_reply("end_session", r.req, messages_dropped=3) if r.op == "end_session" else None
    client.close(keep_session=False)
    assert link.requests("end_session") and client._state.epoch is None
    with pytest.raises(Unconnected):
        client.publish("t", b"x")
    with pytest.raises(Unconnected):
        client.subscribe("t")
    client.close()  # idempotent


def test_a_connack_handled_after_close_processes_no_event(make: Any) -> None:
    """sdk.md: "no later event is processed" once close() is called. A reconnect's CONNACK read after close()
    (the network thread's last pass, before its DISCONNECT) cleared the receiver's failed state, so an event
    read after it ran its listener; now the CONNACK is ignored: no listener, no acknowledgement, no hello."""
    client, link = make()
    connect(client, link, session_present=False)
    seen: list[int] = []
    client.subscribe("#", listener=lambda e: seen.append(e.seq))
    lose(client, link)
    client.close()
    client._handle_connack(ConnAck(True, True, "Success"))
    event(client, "t", 1, mid=3)
    assert seen == [] and ("ack", 3) not in link.sent
    assert not link.requests("hello")


def test_close_reports_a_refused_end_session_after_closing(make: Any) -> None:
    client, link = make()
    connect(client, link, session_present=False)
    link.respond = lambda r: encode_error(r.op, r.req, ProtocolError("no_session", "gone")) if r.op else None
    with pytest.raises(ControlRequestFailed, match="no_session"):
        client.close(keep_session=False)
    with pytest.raises(Unconnected):
        client.ready_for_events()


def test_close_while_disconnected_cannot_end_the_session(make: Any) -> None:
    client, _link = make()
    with pytest.raises(Unconnected, match="was not ended"):
        client.close(keep_session=False)
    with pytest.raises(Unconnected):
        client.connect()


def test_lost_connection_marks_the_cache_stale_and_tells_the_application(make: Any, recorder: Recorder) -> None:
    client, link = make()
    connect(client, link, session_present=False)
    event(client, "t", 1)
    recorder.calls.clear()
    client._handle_lost("Connection lost")
    assert recorder.calls == [("disconnected", "Connection lost")]
    assert client.cache.stale and client.cache.get("t") == b"p" and not client.connected
    connect(client, link, session_present=True)
    assert client.stats.reconnects == 1 and client.stats.processed == 1


def test_constructor_checks(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="client_id"):
        DurableClient("")
    with pytest.raises(ValueError, match="state_dir"):
        DurableClient("c", persistence="disk")
    with pytest.raises(ValueError, match="reconnect_max_delay"):
        DurableClient("c", reconnect_min_delay=5, reconnect_max_delay=1)
    seen: list[OSError] = []
    blocker = tmp_path / "file"
    blocker.write_text("x")
    client = DurableClient("c", persistence="disk", state_dir=blocker / "s", on_persistence_fallback=seen.append)
    assert client.persistence_level == "memory" and len(seen) == 1
    client.close()


# ------------------------------------------------------- stream positions
def test_subscribe_stream_after_overrides_the_clients_positions(make: Any) -> None:
    client, link = make(durable_session=False)
    connect(client, link, session_present=False, epoch=None)
    client._state.record_stream("s/a", 40)
    client._state.record_stream("s/b", 8)
    seen: list[Event] = []
    client.subscribe_stream("s/#", seen.append, after={"s/a": 10, "s/c": 0})
    assert link.wire() == [("stream_subscribe", "s/#", {"s/a": 10, "s/b": 8, "s/c": 0})]
    # The presented position is the dedup mark too: id 11 is new, id 10 a duplicate.
    for seq in (10, 11):
        client._handle_message(Inbound(STREAM_TOPIC_PREFIX + "s/a", encode_frame(0, 0, seq, 1.0) + b"x", 0, False,
                                       False, 0))
    assert [e.seq for e in seen] == [11]
    # A reconnect resumes from the positions reached since.
    lose(client, link)
    connect(client, link, session_present=False, epoch=None)
    assert link.wire() == [("stream_subscribe", "s/#", {"s/a": 11, "s/b": 8, "s/c": 0})]


def test_subscribe_stream_after_is_checked(make: Any) -> None:
    client, link = make(durable_session=False)
    connect(client, link, session_present=False, epoch=None)
    with pytest.raises(ValueError, match="not matched by the stream filter"):
        client.subscribe_stream("s/#", lambda e: None, after={"t/a": 1})
    with pytest.raises(ValueError, match="without wildcards"):
        client.subscribe_stream("s/#", lambda e: None, after={"s/+": 1})
    with pytest.raises(ValueError, match="0 or more"):
        client.subscribe_stream("s/#", lambda e: None, after={"s/a": -1})
    with pytest.raises(ValueError, match="0 or more"):
        client.subscribe_stream("s/#", lambda e: None, after={"s/a": True})
    assert link.requests("stream_subscribe") == [] and client._state.positions() == {}
    client.subscribe_stream("s/#", lambda e: None)
    with pytest.raises(ValueError, match="already reads s/a"):
        client.subscribe_stream("s/a", lambda e: None, after={"s/a": 3})
    assert client._state.positions() == {}


def test_stream_info_maps_topics_to_first_and_last(make: Any) -> None:
    client, link = make(durable_session=False)
    with pytest.raises(Unconnected, match="stream_info was not sent"):
        client.stream_info()
    connect(client, link, session_present=False, epoch=None)

    def respond(request: Request) -> bytes | None:
        if request.op != "stream_info":
            return None
        if request.filter == "nope/#":
            return encode_error("stream_info", request.req, ProtocolError("bad_filter", "no"))
        if request.filter == "bad/#":
            return encode_reply("stream_info", request.req, topics={"bad/a": 3})
        topics = {"s/a": {"first": 4, "last": 9, "count": 6}, "s/b": {"first": 6, "last": 5, "count": 0}}
        return encode_reply("stream_info", request.req, filter=request.filter, topics=topics)

    link.respond = respond
    assert client.stream_info("s/#") == {"s/a": (4, 9), "s/b": (6, 5)}
    assert link.requests("stream_info")[0].filter == "s/#"
    assert client.stream_info() == {"s/a": (4, 9), "s/b": (6, 5)}
    with pytest.raises(ControlRequestFailed, match="bad_filter"):
        client.stream_info("nope/#")
    with pytest.raises(ControlRequestFailed, match="malformed"):
        client.stream_info("bad/#")
    link.respond = None
    with pytest.raises(RequestTimeout, match="stream_info"):
        client.stream_info(timeout=0.01)
    assert client._waiters == {}


@pytest.mark.parametrize(
    ("after", "error", "words"),
    [
        ([("feed/a", 1)], TypeError, "after must be a dict"),
        ({"feed/+": 1}, ValueError, "is not a topic"),
        ({"other/a": 1}, ValueError, "is not matched by the stream filter"),
        ({"feed/a": -1}, ValueError, "0 or more"),
        ({"feed/a": True}, ValueError, "0 or more"),
    ],
)
def test_subscribe_stream_refuses_a_bad_after_as_streams_md_says_and_registers_nothing(
    after: object, error: type[Exception], words: str
) -> None:
    """streams.md: `after` must be a dict (else TypeError) of topics without wildcards that the
    filter matches, each with a whole number of 0 or more (else ValueError)."""
    client = DurableClient("after-checks")
    try:
        with pytest.raises(error, match=words):
            client.subscribe_stream("feed/#", lambda event: None, after=after)  # type: ignore[arg-type]
        assert list(client._registry.streams()) == []
    finally:
        client.close()
