"""Retained messages survive SIGKILL: stored with the publish that sets (or clears) them, restored at start-up."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable

import paho.mqtt.client as mqtt

from conftest import WAIT, Broker, Client, run_cli


def sync_point(client: Client) -> None:
    """A QoS 1 PUBACK on the same connection: everything that connection sent before is stored
    (publishes are committed in arrival order), QoS 0 ones included."""
    client.publish("sync/point", [b"."], qos=1)


def retained_then_live(
    clients: Callable[..., Client], client: Client, topic_filter: str, live_topic: str
) -> list[mqtt.MQTTMessage]:
    """Subscribe, then wait for a live message published after SUBACK: every retained message the
    subscription brings comes before it (durable: queued with the subscription; clean: sent by amqtt
    before SUBSCRIBE is done). The live message is QoS 2 like the subscription: paho hands a QoS 2
    message over at its PUBREL, so a QoS 1 live one could overtake a retained QoS 2 one."""
    client.subscribe(topic_filter, qos=2)
    clients(client.port, f"live-{client.client_id}", clean_session=True).publish(live_topic, [b"live"], qos=2)
    assert client.wait_for(lambda ms: any(m.topic == live_topic for m in ms)), f"{client.client_id}: no live message"
    got = list(client.messages)
    return got[: [m.topic for m in got].index(live_topic)]


def test_retained_messages_of_every_qos_survive_sigkill(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("state/q0", [b"zero"], qos=0, retain=True)
    publisher.publish("state/q1", [b"old", b"one"], qos=1, retain=True)  # the later one replaces the earlier
    publisher.publish("state/q2", [b"two"], qos=2, retain=True)
    sync_point(publisher)

    broker.restart(kill=True)

    expected = [("state/q0", b"zero", 0), ("state/q1", b"one", 1), ("state/q2", b"two", 2)]
    durable = clients(broker.port, "durable-sub")
    got = retained_then_live(clients, durable, "state/#", "state/zz")
    assert sorted((m.topic, m.payload, m.qos) for m in got) == expected, "durable: each topic's last retained"
    assert all(m.retain for m in got), "sent because of a new SUBSCRIBE: RETAIN=1"

    clean = clients(broker.port, "clean-sub", clean_session=True)
    got = retained_then_live(clients, clean, "state/#", "state/zz")
    assert sorted((m.topic, m.payload) for m in got) == [(t, p) for t, p, _ in expected], "clean: from amqtt's table"
    assert all(m.retain for m in got)
    # The live message published after the restart is retained too only if it asked to be: it did not.
    late = clients(broker.port, "late-sub", clean_session=True)
    assert "state/zz" not in {m.topic for m in retained_then_live(clients, late, "state/#", "state/zy")}


def test_an_empty_payload_deletes_the_retained_message_for_good(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("lamp/1", [b"on"], qos=1, retain=True)
    publisher.publish("lamp/2", [b"off"], qos=1, retain=True)
    broker.restart(kill=True)  # lamp/1 now exists only in the store (and the table it filled)

    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("lamp/1", [b""], qos=1, retain=True)  # MQTT-3.3.1-10: removes it
    broker.restart(kill=True)

    durable = clients(broker.port, "durable-sub")
    got = retained_then_live(clients, durable, "lamp/#", "lamp/zz")
    assert [(m.topic, m.payload, m.retain) for m in got] == [("lamp/2", b"off", True)], "lamp/1 stays deleted"
    clean = clients(broker.port, "clean-sub", clean_session=True)
    got = retained_then_live(clients, clean, "lamp/#", "lamp/zz")
    assert [(m.topic, m.payload) for m in got] == [("lamp/2", b"off")]


def test_a_retained_will_survives_sigkill(broker: Broker, clients: Callable[..., Client]) -> None:
    watcher = clients(broker.port, "watcher")
    watcher.subscribe("dev/+/status", qos=1)
    device = Client(broker.port, "dev-1", clean_session=True, auto_start=False)
    device.paho.will_set("dev/1/status", b"offline", qos=1, retain=True)
    device.connect()
    device.drop()  # abnormal: amqtt publishes the will and retains it
    # The will's retain is stored in the batch of its broadcast; the durable watcher gets it only after that.
    assert watcher.wait_for(lambda ms: [m.payload for m in ms] == [b"offline"]), "the will was not sent"

    broker.restart(kill=True)

    for client_id, clean_session in (("clean-sub", True), ("durable-sub", False)):
        subscriber = clients(broker.port, client_id, clean_session=clean_session)
        got = retained_then_live(clients, subscriber, "dev/+/status", "dev/zz/status")
        assert [(m.topic, m.payload, m.qos, m.retain) for m in got] == [("dev/1/status", b"offline", 1, True)]


def test_the_retained_count_in_sys_and_inspect(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    broker = broker_factory(metrics_interval=0.2)
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("room/a", [b"21.5"], qos=1, retain=True)
    publisher.publish("room/b", [b"19.0"], qos=0, retain=True)
    publisher.publish("room/c", [b"x"], qos=1, retain=True)
    publisher.publish("room/c", [b""], qos=1, retain=True)
    sync_point(publisher)

    seen: list[bytes] = []
    two = threading.Event()
    watcher = clients(broker.port, "watch", clean_session=True)

    def on_metric(message: mqtt.MQTTMessage) -> None:
        seen.append(message.payload)
        if message.payload == b"2":
            two.set()

    watcher.on_message_hook = on_metric
    watcher.subscribe("$SYS/broker/durable/retained/messages", qos=0)
    assert two.wait(WAIT), f"retained/messages never said 2: {seen}"

    broker.kill()
    table = run_cli("inspect", broker.store, "--retained")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["TOPIC", "QOS", "BYTES", "AGE"]
    assert [line.split()[:3] for line in lines[1:-1]] == [["room/a", "1", "4"], ["room/b", "0", "4"]]
    assert lines[-1] == "2 retained message(s)"
    as_json = run_cli("inspect", broker.store, "--retained", "--json")
    rows = json.loads(as_json.stdout)
    assert [(r["topic"], r["qos"], r["bytes"]) for r in rows] == [("room/a", 1, 4), ("room/b", 0, 4)]
    assert all(0 <= r["age_s"] < WAIT * 4 for r in rows)
