"""One device through a sequence of faults: drops, broker SIGKILLs, live traffic in between.

What a user has to be able to rely on: every acknowledged message arrives, first deliveries come
in publish order, and anything delivered twice carries DUP.
"""

from __future__ import annotations

from collections.abc import Callable

from conftest import Broker, Client, payloads


def test_no_loss_order_and_dup_only_duplicates_through_faults(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    broker = broker_factory(recovery_buffer=50)
    device = clients(broker.port, "device")
    device.subscribe("fleet/+/t", 1)
    acknowledged: list[bytes] = []

    def publish_round(name: str, count: int = 400) -> None:
        sent = payloads(count, f"{name}-")
        pub = Client(broker.port, f"pub-{name}", clean_session=True)
        try:
            pub.publish(f"fleet/{name}/t", sent, qos=1)  # returns once every PUBACK is in
        finally:
            pub.paho.disconnect()
            pub.paho.loop_stop()
        acknowledged.extend(sent)

    publish_round("live-1")
    device.drop()  # abnormal disconnect, possibly mid-delivery
    publish_round("offline-1")
    broker.kill()
    broker.start()
    assert device.connect() is True
    publish_round("live-2")
    broker.kill()  # with the device connected and messages in flight
    broker.start()
    device.wait_disconnected()
    device.paho.loop_stop()
    publish_round("offline-2")
    assert device.connect() is True
    publish_round("live-3")
    device.disconnect()
    broker.kill()
    broker.start()
    assert device.connect() is True

    assert device.wait_for(lambda ms: set(acknowledged) <= {m.payload for m in ms}), "acknowledged message lost"
    first_seen: list[bytes] = []
    seen: set[bytes] = set()
    for message in device.messages:
        if message.payload in seen:
            assert message.dup, f"{message.payload!r} delivered twice without DUP"
            continue
        seen.add(message.payload)
        first_seen.append(message.payload)
    assert first_seen == acknowledged, "first deliveries must follow the publish order"
