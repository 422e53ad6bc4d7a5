"""The SDK (durable_client) against a real broker over TCP, with a real LevelDB store:
replay, marker and live in order; the cache; hold until ready; non-durable interest;
keep_session; redelivery after a failing listener; exactly-once across broker and SDK
crashes (SIGKILL); CPL-2 fallback; stateless resume from stream logs; 100 clients at once."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from conftest import WAIT, Broker, Client, payloads
from durable_client import DurableClient, DurableClientError, Event, Marker, RequestTimeout, Unconnected
from durable_client.delivery_log import message_id
from durable_client.persistence import DiskState

ROOT = Path(__file__).resolve().parent.parent
CHILD = ROOT / "tests" / "sdk_child.py"


class Recorder:
    """A listener that keeps every event; waits are bounded and event-driven."""

    def __init__(self, fail_once_on: bytes | None = None) -> None:
        self.events: list[Event] = []
        self.attempts: list[bytes] = []
        self._fail_once_on = fail_once_on
        self._cond = threading.Condition()

    def __call__(self, event: Event) -> None:
        with self._cond:
            self.attempts.append(event.payload)
            if event.payload == self._fail_once_on:
                self._fail_once_on = None
                raise RuntimeError("listener failed (on purpose)")
            self.events.append(event)
            self._cond.notify_all()

    def wait(self, count: int, timeout: float = WAIT) -> list[Event]:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.events) >= count, timeout), (
                f"{len(self.events)} of {count} events arrived"
            )
            return list(self.events)

    def wait_until(self, done: Callable[[list[Event]], bool], timeout: float = WAIT) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: bool(self.events) and done(self.events), timeout)

    def payloads(self) -> list[bytes]:
        with self._cond:
            return [event.payload for event in self.events]


class Signals:
    """Callbacks of one client, each recorded and waitable."""

    def __init__(self) -> None:
        self.markers: list[Marker] = []
        self.events_before_marker: list[int] = []
        self.live = threading.Event()
        self.disconnected = threading.Event()
        self.fallbacks: list[OSError] = []
        self.recorder: Recorder | None = None

    def on_live(self, marker: Marker) -> None:
        self.markers.append(marker)
        self.events_before_marker.append(len(self.recorder.events) if self.recorder else 0)
        self.live.set()

    def kwargs(self) -> dict[str, Any]:
        return {
            "on_live": self.on_live,
            "on_disconnected": lambda reason: self.disconnected.set(),
            "on_persistence_fallback": self.fallbacks.append,
        }


def queue_backlog(
    sdk: Callable[..., DurableClient], broker: Broker, client_id: str, topic_filter: str, **kwargs: Any
) -> None:
    """Create the durable session with its subscription, then leave: what follows is queued."""
    first = sdk(broker.port, client_id, **kwargs)
    first.subscribe(topic_filter)
    first.connect()
    first.close(keep_session=True)


def listening(
    sdk: Callable[..., DurableClient], broker: Broker, client_id: str, topic_filter: str
) -> tuple[DurableClient, Signals, Recorder]:
    """A client with recorded callbacks and a recording listener on ``topic_filter``: connected, ready for events."""
    signals, recorder = Signals(), Recorder()
    client = sdk(broker.port, client_id, **signals.kwargs())
    client.subscribe(topic_filter, listener=recorder)
    client.connect()
    client.ready_for_events()
    return client, signals, recorder


def test_replay_then_marker_then_live_in_order_while_a_publisher_keeps_publishing(
    broker: Broker, sdk: Callable[..., DurableClient], clients: Callable[..., Client]
) -> None:
    queue_backlog(sdk, broker, "dev-order", "feed/#")
    publisher = clients(broker.port, "pub", clean_session=True)
    everything = payloads(600)
    publisher.publish("feed/a", everything[:300])

    signals, recorder = Signals(), Recorder()
    signals.recorder = recorder
    device = sdk(broker.port, "dev-order", **signals.kwargs())
    device.subscribe("feed/#", listener=recorder)
    live_publisher = threading.Thread(target=publisher.publish, args=("feed/a", everything[300:]))
    live_publisher.start()
    device.connect()
    device.ready_for_events()
    got = recorder.wait(600)
    live_publisher.join(WAIT)

    assert [e.payload for e in got] == everything, "every event once, in publish order, across the marker"
    assert len(signals.markers) == 1, "on_live once per marker"
    (marker,), (before,) = signals.markers, signals.events_before_marker
    assert before >= 300, "the whole backlog is replayed before the marker"
    assert [e.replayed for e in got] == [True] * before + [False] * (600 - before)
    assert marker.replayed == before
    assert (marker.first_seq, marker.last_seq) == (got[0].seq, got[before - 1].seq)
    seqs = [e.seq for e in got]
    assert seqs == sorted(seqs) and len(set(seqs)) == 600, "broker sequence ids increase along the order"
    assert {e.epoch for e in got} == {marker.epoch}


def test_the_cache_takes_initial_and_live_values_but_never_replayed_ones(
    broker: Broker, sdk: Callable[..., DurableClient], clients: Callable[..., Client]
) -> None:
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("s/init", [b"retained"], retain=True)
    queue_backlog(sdk, broker, "dash", "s/+")
    publisher.publish("s/1", [b"old"])

    dashboard, signals, recorder = listening(sdk, broker, "dash", "s/+")
    assert signals.live.wait(WAIT)
    replayed = [e for e in recorder.wait(1) if e.payload == b"old"]
    assert replayed and replayed[0].replayed, "the listener gets the replayed event"
    assert dashboard.cache.get("s/1") is None, "a replayed event is not applied to the cache"

    publisher.publish("s/1", [b"new"])
    assert recorder.wait_until(lambda events: events[-1].payload == b"new")
    assert dashboard.cache.get("s/1") == b"new", "a live event is"

    broker.kill()
    assert signals.disconnected.wait(WAIT)
    assert dashboard.cache.stale
    assert dashboard.cache.get("s/1") == b"new", "reads work while disconnected (possibly stale)"
    with pytest.raises(Unconnected):
        dashboard.publish("s/1", b"while away")


def test_retained_values_are_initial_values_of_the_cache(
    broker: Broker, sdk: Callable[..., DurableClient], clients: Callable[..., Client]
) -> None:
    clients(broker.port, "pub", clean_session=True).publish("r/1", [b"initial"], retain=True)
    client, signals, recorder = listening(sdk, broker, "cache-init", "r/+")
    (event,) = recorder.wait(1)
    assert event.retained
    assert signals.live.wait(WAIT)
    assert client.cache.get("r/1") == b"initial"


def test_nothing_is_delivered_before_ready(
    broker: Broker, sdk: Callable[..., DurableClient], clients: Callable[..., Client]
) -> None:
    recorder = Recorder()
    device = sdk(broker.port, "dev-hold")
    device.subscribe("h", listener=recorder)
    device.connect()
    clients(broker.port, "pub", clean_session=True).publish("h", payloads(3))
    with pytest.raises(AssertionError):
        recorder.wait(1, timeout=0.5)
    device.ready_for_events()
    assert [e.payload for e in recorder.wait(3)] == payloads(3)
    assert all(e.replayed for e in recorder.events), "queued before ready: replayed (GemFire: as if while away)"


def test_a_non_durable_subscription_ends_with_the_connection_a_durable_one_stays(
    broker_factory: Callable[..., Broker], sdk: Callable[..., DurableClient], clients: Callable[..., Client]
) -> None:
    broker = broker_factory(metrics_interval=0.1)
    gauge = clients(broker.port, "gauge", clean_session=True)
    gauge.subscribe("$SYS/broker/durable/sessions/connected")
    device = sdk(broker.port, "dev-interest")
    device.subscribe("keep")
    device.subscribe("gone", durable=False)
    device.connect()
    assert gauge.wait_for(lambda ms: bool(ms) and ms[-1].payload == b"1")
    device.close(keep_session=True)
    # "While away" starts when the broker has handled the disconnect, not when the socket closed.
    assert gauge.wait_for(lambda ms: ms[-1].payload == b"0")
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("gone", [b"missed"])
    publisher.publish("keep", [b"kept"])

    device, signals, recorder = listening(sdk, broker, "dev-interest", "keep")
    assert signals.live.wait(WAIT)
    assert [s.filter for s in signals.markers[0].live] == ["keep"]
    assert [e.payload for e in recorder.wait(1)] == [b"kept"]
    assert device.stats.received == 1, "nothing was queued for the non-durable subscription"


def test_close_without_keep_session_removes_the_session_at_once(
    broker: Broker, sdk: Callable[..., DurableClient], clients: Callable[..., Client]
) -> None:
    queue_backlog(sdk, broker, "dev-bye", "b")
    clients(broker.port, "pub", clean_session=True).publish("b", payloads(2))
    device = sdk(broker.port, "dev-bye")
    device.connect()
    device.close(keep_session=False)
    assert clients(broker.port, "dev-bye").session_present is False


def test_a_listener_that_raises_gets_the_event_again(
    broker: Broker, sdk: Callable[..., DurableClient], clients: Callable[..., Client]
) -> None:
    recorder = Recorder(fail_once_on=payloads(10)[3])
    device = sdk(broker.port, "dev-retry")
    device.subscribe("r", listener=recorder)
    device.connect()
    device.ready_for_events()
    clients(broker.port, "pub", clean_session=True).publish("r", payloads(10))
    got = recorder.wait(10)
    assert [e.payload for e in got] == payloads(10), "each processed once, in order"
    assert recorder.attempts.count(payloads(10)[3]) == 2
    assert got[3].redelivered
    assert device.stats.redeliveries_requested == 1


@pytest.mark.slow
def test_exactly_once_across_a_broker_sigkill_and_restart(
    broker: Broker, sdk: Callable[..., DurableClient], clients: Callable[..., Client]
) -> None:
    total = 3000
    queue_backlog(sdk, broker, "dev-crash", "c")
    clients(broker.port, "pub", clean_session=True).publish("c", payloads(total))
    halfway = threading.Event()
    recorder = Recorder()

    def listener(event: Event) -> None:
        recorder(event)
        if len(recorder.events) == total // 3:
            halfway.set()

    device = sdk(broker.port, "dev-crash")
    device.subscribe("c", listener=listener)
    device.connect()
    device.ready_for_events()
    assert halfway.wait(WAIT)
    broker.restart(kill=True)
    got = recorder.wait(total, timeout=2 * WAIT)
    assert [e.payload for e in got] == payloads(total), "nothing lost, nothing twice, in order"
    assert device.stats.reconnects >= 1


@pytest.mark.slow
def test_exactly_once_across_an_sdk_process_sigkill_with_disk_persistence(
    broker: Broker, sdk: Callable[..., DurableClient], clients: Callable[..., Client], tmp_path: Path
) -> None:
    total = 400
    state, out = tmp_path / "state", tmp_path / "processed.txt"
    queue_backlog(sdk, broker, "dev-cpl2", "work", persistence="disk", state_dir=state)
    clients(broker.port, "pub", clean_session=True).publish("work", payloads(total))

    def child(*extra: str) -> subprocess.CompletedProcess[str]:
        args = [sys.executable, str(CHILD), str(broker.port), "dev-cpl2", str(state), str(out), str(total)]
        return subprocess.run([*args, *extra], capture_output=True, text=True, timeout=4 * WAIT, check=False)

    crashed = child(payloads(total)[250].decode())
    assert crashed.returncode == -9, crashed.stderr
    assert out.read_bytes().splitlines() == payloads(total)[:250], "processed up to the crash"
    finished = child()
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert out.read_bytes().splitlines() == payloads(total), "each event processed exactly once, in order"


def test_exactly_once_in_the_delivery_log_across_a_sigkill_between_its_record_and_the_mark(
    broker: Broker, sdk: Callable[..., DurableClient], clients: Callable[..., Client], tmp_path: Path
) -> None:
    total, kill = 60, 30
    state, out, log = tmp_path / "state", tmp_path / "processed.txt", tmp_path / "logs" / "device.jsonl"
    queue_backlog(sdk, broker, "dev-logged", "work", persistence="disk", state_dir=state)
    clients(broker.port, "pub", clean_session=True).publish("work", payloads(total))

    def child(*extra: str) -> subprocess.CompletedProcess[str]:
        args = [sys.executable, str(CHILD), str(broker.port), "dev-logged", str(state), str(out), str(total)]
        args += ["--delivery-log", str(log), *extra]
        return subprocess.run(args, capture_output=True, text=True, timeout=4 * WAIT, check=False)

    def receives() -> list[dict[str, Any]]:
        records = [json.loads(line) for line in log.read_text().splitlines()]
        return [r for r in records if r["kind"] == "receive"]

    crashed = child("--kill-after-log-at", payloads(total)[kill].decode())
    assert crashed.returncode == -9, crashed.stderr
    last = receives()[-1]
    assert last["id"] == message_id("work", payloads(total)[kill])
    with closing(DiskState(state, "dev-logged")) as marks:
        assert marks.get_mark(last["epoch"]) < last["seq"], "killed between the record and its mark"
    finished = child()
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert "duplicates_dropped=0" not in finished.stdout, "the broker sent the unmarked event again"
    assert [r["id"] for r in receives()] == [message_id("work", p) for p in payloads(total)], (
        "the delivery log holds each event once, in order"
    )
    assert out.read_bytes().splitlines() == payloads(total), "each event processed exactly once, in order"


def test_disk_persistence_falls_back_to_memory_on_an_unwritable_state_folder(
    broker: Broker, sdk: Callable[..., DurableClient], clients: Callable[..., Client], tmp_path: Path
) -> None:
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("a file where the state folder's parent should be")
    signals, recorder = Signals(), Recorder()
    device = sdk(broker.port, "dev-fallback", persistence="disk", state_dir=not_a_folder / "state", **signals.kwargs())
    assert device.persistence_level == "memory"
    assert signals.fallbacks and isinstance(signals.fallbacks[0], OSError)
    device.subscribe("f", listener=recorder)
    device.connect()
    device.ready_for_events()
    clients(broker.port, "pub", clean_session=True).publish("f", payloads(3))
    assert [e.payload for e in recorder.wait(3)] == payloads(3), "delivery goes on at CPL-1"


STREAMS = [{"filter": "log/#", "max_count": 1000}]


def test_stateless_resume_continues_after_the_last_processed_id_across_a_restart(
    broker_factory: Callable[..., Broker],
    sdk: Callable[..., DurableClient],
    clients: Callable[..., Client],
    tmp_path: Path,
) -> None:
    broker = broker_factory(streams=STREAMS)
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("log/a", payloads(5, "first"))
    state = tmp_path / "state"

    def reader(persistence: str) -> tuple[DurableClient, Recorder]:
        recorder = Recorder()
        client = sdk(broker.port, "reader", durable_session=False, persistence=persistence, state_dir=state)
        client.connect()
        client.subscribe_stream("log/#", recorder)
        return client, recorder

    client, recorder = reader("disk")
    assert [e.payload for e in recorder.wait(5)] == payloads(5, "first")
    assert [e.seq for e in recorder.events] == [1, 2, 3, 4, 5] and all(e.stream for e in recorder.events)
    client.close()
    publisher.publish("log/a", payloads(3, "second"))

    client, recorder = reader("disk")  # a new process would do the same: the ids are on disk
    assert [e.payload for e in recorder.wait(3)] == payloads(3, "second")
    assert [e.seq for e in recorder.events] == [6, 7, 8]
    client.close()

    _, recorder = reader("memory")  # CPL-1 after a restart: from the first retained event
    assert [e.payload for e in recorder.wait(8)] == payloads(5, "first") + payloads(3, "second")


@pytest.mark.slow
def test_a_hundred_sdk_clients_at_once(
    broker: Broker, sdk: Callable[..., DurableClient], clients: Callable[..., Client]
) -> None:
    recorders = [Recorder() for _ in range(100)]
    devices = []
    for index, recorder in enumerate(recorders):
        device = sdk(broker.port, f"fleet-{index:03d}")
        device.subscribe("fleet/all", listener=recorder)
        device.connect()
        device.ready_for_events()
        devices.append(device)
    clients(broker.port, "pub", clean_session=True).publish("fleet/all", payloads(20))
    for recorder in recorders:
        assert [e.payload for e in recorder.wait(20)] == payloads(20)
    assert all(device.stats.duplicates_dropped == 0 for device in devices)


def test_a_restarted_client_does_not_subscribe_again_what_its_session_holds(
    broker: Broker, sdk: Callable[..., DurableClient], clients: Callable[..., Client]
) -> None:
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("s/1", [b"seed"], retain=True)
    first, seen = sdk(broker.port, "dash-restart"), Recorder()
    first.subscribe("s/+", listener=seen)
    first.connect()
    first.ready_for_events()
    assert [e.payload for e in seen.wait(1)] == [b"seed"]
    first.close(keep_session=True)
    publisher.publish("s/1", [b"new"])

    again, signals, recorder = listening(sdk, broker, "dash-restart", "s/+")  # a new process knows no SUBACK
    assert signals.live.wait(WAIT)
    assert [e.payload for e in recorder.events] == [b"new"], "no retained value queued again behind newer ones"
    assert again.cache.get("s/1") is None, "the replayed value stays out of the cache"


def test_delivery_logs_record_sends_and_processed_events_with_matching_ids(
    broker: Broker, sdk: Callable[..., DurableClient], tmp_path: Path
) -> None:
    signals, recorder = Signals(), Recorder()
    device = sdk(broker.port, "logged-device", delivery_log=tmp_path / "logs" / "device.jsonl", **signals.kwargs())
    device.subscribe("audit/#", listener=recorder)
    device.connect()
    device.ready_for_events()
    assert signals.live.wait(WAIT)
    sender = sdk(broker.port, "logged-sender", durable_session=False, delivery_log=tmp_path / "logs" / "sender.jsonl")
    sender.connect()
    for payload in payloads(3):
        sender.publish("audit/x", payload)
    recorder.wait(3)
    sender.close()
    device.unsubscribe("audit/#")
    device.close(keep_session=False)

    def records(name: str) -> list[dict[str, Any]]:
        return [json.loads(line) for line in (tmp_path / "logs" / name).read_text().splitlines()]

    sent, got = records("sender.jsonl"), records("device.jsonl")
    assert [r["kind"] for r in got] == [
        "connect", "subscribe", "live", "receive", "receive", "receive", "unsubscribe", "session_end"
    ], "a subscription counts from its SUBACK"
    assert [r["kind"] for r in sent] == ["connect", "send", "send", "send"]
    sends = [r for r in sent if r["kind"] == "send"]
    receives = [r for r in got if r["kind"] == "receive"]
    assert [r["id"] for r in receives] == [r["id"] for r in sends], "the same id on both sides"
    assert len({r["id"] for r in sends}) == 3
    assert all(r["device"] == "logged-device" and r["topic"] == "audit/x" for r in receives)
    assert [r["seq"] for r in receives] == [e.seq for e in recorder.events]
    assert got[1] == {**got[1], "topic": "audit/#", "qos": 1, "durable": True}
    assert got[-2] == {**got[-2], "topic": "audit/#"}


def test_a_filter_unsubscribed_and_subscribed_again_at_once_stays_subscribed(
    broker: Broker, sdk: Callable[..., DurableClient], clients: Callable[..., Client]
) -> None:
    """sdk.md: unsubscribe() returns once the UNSUBSCRIBE is sent, subscribe() at its SUBACK. The
    broker applied the SUBSCRIBE first when both had arrived (amqtt queued them apart), then the
    UNSUBSCRIBE: the filter was gone, live messages lost (19 of 20 rounds)."""
    device, signals, recorder = listening(sdk, broker, "dev-resub", "x/#")
    device.subscribe("sentinel", listener=recorder)
    assert signals.live.wait(WAIT)
    publisher = clients(broker.port, "pub", clean_session=True)
    for round_ in range(5):
        device.unsubscribe("x/#")
        device.subscribe("x/#", listener=recorder)
        publisher.publish("x/a", [b"x%d" % round_])
        publisher.publish("sentinel", [b"s%d" % round_])  # after x/a, from the same publisher
        assert recorder.wait_until(lambda events, r=round_: events[-1].payload == b"s%d" % r)
    assert recorder.payloads() == [p for r in range(5) for p in (b"x%d" % r, b"s%d" % r)]


def test_an_unsubscribe_behind_the_connections_subscribes_is_applied_after_them(
    broker: Broker, sdk: Callable[..., DurableClient]
) -> None:
    """on_connected runs after the connection's SUBSCRIBEs went out, before their SUBACKs: an
    UNSUBSCRIBE of one of them sent there is applied after it (the broker applied it first when
    an earlier SUBSCRIBE was still queued, and the filter stayed: in the marker, and queued)."""
    signals = Signals()
    holder: list[DurableClient] = []

    def on_connected(_info: Any) -> None:
        holder[0].unsubscribe("b/#")
        holder[0].subscribe("c/#")

    device = sdk(broker.port, "dev-unsub-early", on_connected=on_connected, **signals.kwargs())
    holder.append(device)
    device.subscribe("a/#")
    device.subscribe("b/#")
    device.ready_for_events()
    device.connect()
    assert signals.live.wait(WAIT)
    assert sorted(s.filter for s in signals.markers[0].live) == ["a/#", "c/#"]


def test_unsubscribes_right_before_close_are_applied(broker: Broker, sdk: Callable[..., DurableClient]) -> None:
    """sdk.md: an `unsubscribe()` followed at once by `close()` is applied before the session is
    left: the UNSUBSCRIBEs and the DISCONNECT go out back to back, and the broker applied at most
    one more SUBSCRIBE/UNSUBSCRIBE once it had read the DISCONNECT (the session kept the rest)."""
    filters = ["keep/#", *(f"drop{i}/#" for i in range(5))]
    device, signals, _ = listening(sdk, broker, "dev-unsub-close", filters[0])
    for topic_filter in filters[1:]:
        device.subscribe(topic_filter)
    assert signals.live.wait(WAIT)
    for topic_filter in filters[1:]:
        device.unsubscribe(topic_filter)
    device.close(keep_session=True)
    again_signals = Signals()
    again = sdk(broker.port, "dev-unsub-close", **again_signals.kwargs())
    again.connect()
    again.ready_for_events()
    assert again_signals.live.wait(WAIT)
    assert [s.filter for s in again_signals.markers[0].live] == ["keep/#"]


@pytest.mark.parametrize("refusal", ["queue full", "packet id in use"])
def test_a_publish_paho_refuses_neither_replaces_nor_leaves_a_send_record(
    refusal: str, broker: Broker, sdk: Callable[..., DurableClient], relays: Callable[..., Any], tmp_path: Path
) -> None:
    """sdk.md: a message paho refuses (MQTT_ERR_QUEUE_SIZE) raises DurableClientError and is not logged;
    the publish still waiting for its PUBACK gets its ``send`` when it comes (the refused one's record
    replaced it when their packet ids were the same: that send was lost)."""
    relay = relays(broker.port)
    log = tmp_path / "pub.jsonl"
    publisher = sdk(relay.port, "refused-pub", delivery_log=log)
    publisher.connect(timeout=WAIT)
    relay.hold("down", lambda packet: packet.kind == 4)  # PUBACKs
    with pytest.raises(RequestTimeout):
        publisher.publish("refused/t", b"first", qos=1, timeout=0.3)
    paho = publisher._link._client  # paho's limits, set directly: its setter refuses while connected
    if refusal == "queue full":
        paho._max_queued_messages = 1
    else:  # the next packet id is the waiting publish's: as after 65535 publishes
        (waiting,) = paho._out_messages
        paho._last_mid = waiting - 1
    with pytest.raises(DurableClientError, match=r"paho refused the message: .* nothing was published"):
        publisher.publish("refused/t", b"refused", qos=1, timeout=WAIT)
    paho._max_queued_messages = 0
    relay.release("down")
    publisher.publish("refused/t", b"third", qos=1, timeout=WAIT)
    sends = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]
    assert [r["id"] for r in sends if r["kind"] == "send"] == [
        message_id("refused/t", b"first"),
        message_id("refused/t", b"third"),
    ]
    assert not publisher._sends_due._due, "no record left for the refused publish"
