"""Points 8 and 9: group commit shares write batches; metrics under $SYS/broker/durable/."""

from __future__ import annotations

from collections.abc import Callable

import paho.mqtt.client as mqtt

from conftest import Broker, Client, payloads


def latest(messages: list[mqtt.MQTTMessage], topic: str) -> int | None:
    values = [int(m.payload) for m in messages if m.topic == topic]
    return values[-1] if values else None


def test_metrics_published_under_sys(broker_factory: Callable[..., Broker], clients: Callable[..., Client]) -> None:
    broker = broker_factory(metrics_interval=0.2)
    sub = clients(broker.port, "dev-1")
    sub.subscribe("t", 1)
    sub.disconnect()
    clients(broker.port, "pub", clean_session=True).publish("t", payloads(7), qos=1)
    watcher = clients(broker.port, "ops", clean_session=True)
    watcher.subscribe("$SYS/broker/durable/#", 0)
    prefix = "$SYS/broker/durable/"
    assert watcher.wait_for(
        lambda ms: latest(ms, prefix + "messages/queued") == 7 and latest(ms, prefix + "sessions/disconnected") == 1
    ), "queued and disconnected-session gauges must reflect the offline queue"
    assert watcher.wait_for(lambda ms: latest(ms, prefix + "bytes/queued") == sum(map(len, payloads(7))))
    sub.connect()
    sub.wait_messages(7)
    assert watcher.wait_for(
        lambda ms: (
            latest(ms, prefix + "messages/replayed") == 7
            and latest(ms, prefix + "messages/queued") == 0
            and latest(ms, prefix + "sessions/connected") == 1
        )
    ), "after the replay the queue is empty and the replay is counted"


def test_concurrent_publishes_share_fsynced_commits(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """With sync: true each commit costs an fsync, so pipelined publishes must share them."""
    broker = broker_factory(metrics_interval=0.2, sync=True, batch_delay_ms=10, pending_threshold=100)
    sub = clients(broker.port, "dev-1")
    sub.subscribe("t", 1)
    sub.disconnect()
    watcher = clients(broker.port, "ops", clean_session=True)
    watcher.subscribe("$SYS/broker/durable/#", 0)
    prefix = "$SYS/broker/durable/"
    assert watcher.wait_for(lambda ms: latest(ms, prefix + "store/commits") is not None)
    before = latest(watcher.messages, prefix + "store/commits")
    assert before is not None
    count = 5000
    clients(broker.port, "pub", clean_session=True).publish("t", payloads(count), qos=1)
    assert watcher.wait_for(lambda ms: latest(ms, prefix + "messages/queued") == count)
    commits = latest(watcher.messages, prefix + "store/commits")
    assert commits is not None
    assert commits - before < count / 5, f"{commits - before} commits for {count} pipelined publishes"
    sub.connect()
    assert [m.payload for m in sub.wait_messages(count)] == payloads(count), "batching must keep FIFO"


def test_sync_mode_persists_and_survives_sigkill(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    broker = broker_factory(sync=True)
    sub = clients(broker.port, "dev-1")
    sub.subscribe("t", 1)
    sub.disconnect()
    clients(broker.port, "pub", clean_session=True).publish("t", payloads(300), qos=1)
    broker.kill()
    broker.start()
    assert sub.connect() is True
    assert [m.payload for m in sub.wait_messages(300)] == payloads(300)
