"""Points 2-4 of the foundation issue: durable sessions, persist-before-ack, delivery from the store."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from conftest import Broker, Client, payloads, seen_away


def test_anonymous_durable_session_is_kept_and_present(broker: Broker, clients: Callable[..., Client]) -> None:
    sub = clients(broker.port, "dev-1")
    assert sub.session_present is False
    assert sub.subscribe("sensors/#", 1) == [1]
    sub.disconnect()
    assert sub.connect() is True, "clean_session=false with allow_anonymous must keep the session"


def test_offline_messages_survive_sigkill_after_last_puback(broker: Broker, clients: Callable[..., Client]) -> None:
    sub = clients(broker.port, "dev-1")
    sub.subscribe("sensors/#", 1)
    sub.disconnect()
    pub = clients(broker.port, "pub", clean_session=True)
    sent = payloads(2000)
    pub.publish("sensors/t", sent, qos=1)
    broker.kill()  # right after the last PUBACK
    broker.start()
    assert sub.connect() is True
    got = sub.wait_messages(len(sent))
    assert [m.payload for m in got] == sent
    assert all(m.retain is False for m in got), "queued messages must not carry RETAIN (MQTT-3.3.1-9)"
    assert all(m.qos == 1 for m in got)


def test_subscriptions_recreated_after_restart_without_resubscribing(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    sub = clients(broker.port, "dev-1")
    sub.subscribe("a/+", 1)
    sub.disconnect()
    broker.restart(kill=True)
    assert sub.connect() is True
    pub = clients(broker.port, "pub", clean_session=True)
    pub.publish("a/b", [b"live"], qos=1)
    assert [m.payload for m in sub.wait_messages(1)] == [b"live"]


def test_clean_session_deletes_stored_session(broker: Broker, clients: Callable[..., Client]) -> None:
    sub = clients(broker.port, "dev-1")
    sub.subscribe("x", 1)
    sub.disconnect()
    clients(broker.port, "pub", clean_session=True).publish("x", [b"old"], qos=1)
    clean = clients(broker.port, "dev-1", clean_session=True)
    clean.disconnect()
    again = clients(broker.port, "dev-1")
    assert again.session_present is False
    assert not again.wait_for(lambda ms: len(ms) > 0, timeout=0.5), "a wiped session must not replay"


def test_live_fifo_across_replay_boundary(broker: Broker, clients: Callable[..., Client]) -> None:
    sub = clients(broker.port, "dev-1")
    sub.subscribe("s", 1)
    sub.disconnect()
    pub = clients(broker.port, "pub", clean_session=True)
    backlog = payloads(3000, "old")
    pub.publish("s", backlog, qos=1)
    sub.connect()
    live = payloads(1000, "new")
    pub.publish("s", live, qos=1)
    got = [m.payload for m in sub.wait_messages(len(backlog) + len(live))]
    assert got == backlog + live, "replayed and live messages must arrive in one FIFO order without gaps"


@pytest.mark.parametrize(("pub_qos", "sub_qos", "expected"), [(2, 1, 1), (1, 2, 1), (0, 2, 0), (2, 2, 2), (1, 0, 0)])
def test_delivered_qos_is_min_of_publish_and_subscription(
    broker: Broker, clients: Callable[..., Client], pub_qos: int, sub_qos: int, expected: int
) -> None:
    sub = clients(broker.port, "dev-1")
    sub.subscribe("q", sub_qos)
    pub = clients(broker.port, "pub", clean_session=True)
    pub.publish("q", [b"x"], qos=pub_qos)
    got = sub.wait_messages(1)
    assert [(m.payload, m.qos) for m in got] == [(b"x", expected)]


def test_qos0_not_queued_offline_by_default(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    broker = broker_factory(metrics_interval=0.05)
    sub = clients(broker.port, "dev-1")
    sub.subscribe("q", 1)
    sub.disconnect()
    seen_away(clients, broker, 1)  # else the publish may be read first, while the session is still connected
    pub = clients(broker.port, "pub", clean_session=True)
    pub.publish("q", [b"qos0"], qos=0)
    pub.publish("q", [b"qos1"], qos=1)
    sub.connect()
    assert [m.payload for m in sub.wait_messages(1)] == [b"qos1"]
    assert not sub.wait_for(lambda ms: len(ms) > 1, timeout=0.5)


def test_qos0_queued_offline_when_enabled(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    broker = broker_factory(queue_qos0=True)
    sub = clients(broker.port, "dev-1")
    sub.subscribe("q", 1)
    sub.disconnect()
    pub = clients(broker.port, "pub", clean_session=True)
    pub.publish("q", [b"a"], qos=0)
    pub.publish("q", [b"b"], qos=1)
    sub.connect()
    got = sub.wait_messages(2)
    assert [(m.payload, m.qos) for m in got] == [(b"a", 0), (b"b", 1)]
