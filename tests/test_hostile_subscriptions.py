"""Issue 10, point 7 (routing): one client's subscriptions must not slow everyone, and are bounded.

Against a real broker process over TCP: a SUBSCRIBE past ``max_subscriptions_per_client`` gets
return code 0x80 for the filters over the limit (MQTT 3.1.1 has no other refusal) while the
granted ones deliver; 10,000 wildcard filters of one client, durable or clean, do not starve
routing of everyone else's publishes.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from raw_mqtt_helpers import raw_connect, raw_subscribe
from test_protocol import request

from conftest import Broker, Client, mqtt_packet, mqtt_string, payloads, queued_while_dropped
from durable_client.protocol import CONTROL_TOPIC, encode_request

REFUSED = 0x80
FLOOD = 10_000
FLOOD_PER_PACKET = 500
PUBLISHES = 5000
# Before the trie, routing checked every wildcard filter per publish: about 300 msgs/s with 10,000
# filters, so 5000 publishes took over 15 s. Routed per topic level they take well under a second;
# the bound is generous for a loaded two-core machine and still far below the old cost.
FLOOD_BOUND_S = 8.0


@pytest.mark.parametrize("clean", [False, True], ids=["durable", "clean"])
def test_subscribe_past_the_limit_gets_0x80_and_granted_filters_deliver(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], clean: bool
) -> None:
    broker = broker_factory(max_subscriptions_per_client=3)
    kind = "clean" if clean else "durable"
    greedy = clients(broker.port, f"greedy-{kind}", clean_session=clean)
    publisher = clients(broker.port, f"pub-{kind}", clean_session=True)

    assert greedy.subscribe([("lim/a", 1), ("lim/+/b", 1)]) == [1, 1]
    # "lim/a" again is a re-subscription, not a third filter; "lim/c" is the third; the rest are over.
    assert greedy.subscribe([("lim/a", 1), ("lim/c", 1), ("lim/d", 1), ("lim/#", 1)]) == [1, 1, REFUSED, REFUSED]
    assert "max_subscriptions_per_client" in broker.log()

    publisher.publish("lim/d", [b"refused-d"])
    publisher.publish("lim/zzz", [b"refused-hash"])  # only the refused "lim/#" would match it
    for topic in ("lim/a", "lim/x/b", "lim/c"):
        publisher.publish(topic, [f"granted {topic}".encode()])
    assert greedy.wait_for(lambda got: len(got) >= 3), "the granted subscriptions did not deliver"

    # Unsubscribing frees a place under the limit.
    greedy.unsubscribe("lim/c")
    assert greedy.subscribe("lim/d") == [1]
    publisher.publish("lim/d", [b"granted now"])
    assert greedy.wait_for(lambda got: any(m.payload == b"granted now" for m in got))
    received = sorted(m.payload for m in greedy.messages)
    assert received == [b"granted lim/a", b"granted lim/c", b"granted lim/x/b", b"granted now"]


@pytest.mark.parametrize(
    ("clean", "clean_victim"),
    [(False, False), (True, False), (True, True)],
    ids=["durable-attacker", "clean-attacker", "clean-attacker-clean-victim"],
)
def test_ten_thousand_wildcard_subscriptions_of_one_client_do_not_starve_routing(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], clean: bool, clean_victim: bool
) -> None:
    """The durable route, the "does amqtt want it" check and amqtt's own delivery to clean subscribers."""
    broker = broker_factory(max_subscriptions_per_client=0)
    kind = "clean" if clean else "durable"
    attacker = clients(broker.port, f"attacker-{kind}", clean_session=clean)
    for start in range(0, FLOOD, FLOOD_PER_PACKET):
        batch = [(f"flood/{i}/+", 1) for i in range(start, start + FLOOD_PER_PACKET)]
        assert attacker.subscribe(batch) == [1] * FLOOD_PER_PACKET
    victim = clients(broker.port, f"victim-{kind}", clean_session=clean_victim)
    assert victim.subscribe("work/t") == [1]
    publisher = clients(broker.port, f"pub-{kind}", clean_session=True)

    started = time.monotonic()
    publisher.publish("work/t", payloads(PUBLISHES))
    assert victim.wait_for(lambda got: len(got) >= PUBLISHES, timeout=FLOOD_BOUND_S), (
        f"{len(victim.messages)} of {PUBLISHES} arrived in {FLOOD_BOUND_S} s"
    )
    elapsed = time.monotonic() - started
    assert elapsed < FLOOD_BOUND_S, f"{PUBLISHES} publishes took {elapsed:.1f} s with {FLOOD} wildcard filters"
    assert [m.payload for m in victim.messages] == payloads(PUBLISHES)
    assert attacker.messages == []  # none of its filters matches


def test_a_subscribe_of_many_filters_is_one_commit_and_stored_before_its_suback(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """A durable session's SUBSCRIBE (and UNSUBSCRIBE) of n filters is stored by one commit, not n:
    amqtt handles a packet's filters one by one, and a commit per filter wrote the whole, growing
    session record each time (10,000 filters in packets of 500 took half a minute of broker CPU).
    Every filter of the packet is stored before the SUBACK: a SIGKILL right after it loses none."""
    broker = broker_factory(metrics_interval=0.1, max_subscriptions_per_client=0)
    watcher = clients(broker.port, "ops", clean_session=True)
    commits_topic = "$SYS/broker/durable/store/commits"
    watcher.subscribe(commits_topic, 0)

    def commits_after(samples_seen: int) -> int:
        """The counter from a sample published after the ``samples_seen`` already there."""
        assert watcher.wait_for(lambda got: sum(m.topic == commits_topic for m in got) >= samples_seen + 2)
        return int([m.payload for m in watcher.messages if m.topic == commits_topic][-1])

    def samples() -> int:
        return sum(m.topic == commits_topic for m in watcher.messages)

    device = clients(broker.port, "many-filters")
    before = commits_after(samples())
    first = [f"first/{i}/+" for i in range(FLOOD_PER_PACKET)]
    assert device.subscribe([(f, 1) for f in first]) == [1] * FLOOD_PER_PACKET
    subscribed = commits_after(samples())
    device.unsubscribe(first)
    unsubscribed = commits_after(samples())
    # The metrics' own bookkeeping may commit too; a commit per filter would be 500 each.
    assert subscribed - before <= 5, f"{subscribed - before} commits for one SUBSCRIBE of {FLOOD_PER_PACKET} filters"
    assert unsubscribed - subscribed <= 5, f"{unsubscribed - subscribed} commits for one UNSUBSCRIBE"

    second = [f"second/{i}/+" for i in range(FLOOD_PER_PACKET)]
    assert device.subscribe([(f, 1) for f in second]) == [1] * FLOOD_PER_PACKET
    device.disconnect()
    broker.restart(kill=True)  # SIGKILL right after the SUBACK
    publisher = clients(broker.port, "pub-many", clean_session=True)
    for topic in ("first/0/x", "second/0/x", f"second/{FLOOD_PER_PACKET // 2}/x", f"second/{FLOOD_PER_PACKET - 1}/x"):
        publisher.publish(topic, [topic.encode()])
    assert device.connect() is True
    assert device.wait_for(lambda got: len(got) >= 3)
    assert [m.payload for m in device.messages] == [b"second/0/x", b"second/250/x", b"second/499/x"]


def test_a_connecting_client_gets_no_retained_message_of_filters_others_hold(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """amqtt 0.12.1 sends, on every CONNECT, the retained messages matching every filter of its
    table, whoever holds it: one client's filters decided what everyone else received (and each
    CONNECT cost a match per filter and retained message)."""
    broker = broker_factory()
    publisher = clients(broker.port, "pub-retained", clean_session=True)
    publisher.publish("secret/x", [b"retained secret"], retain=True)
    holder = clients(broker.port, "holder", clean_session=True)
    assert holder.subscribe("secret/#") == [1]
    assert holder.wait_for(lambda got: [m.payload for m in got] == [b"retained secret"])

    for clean in (True, False):
        other = clients(broker.port, f"other-{clean}", clean_session=clean)
        assert other.subscribe("mine/t") == [1]
        publisher.publish("mine/t", [b"marker"])
        assert other.wait_for(lambda got: any(m.payload == b"marker" for m in got))
        assert [m.payload for m in other.messages] == [b"marker"]


def test_a_clean_session_ending_frees_its_places_under_the_limit(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """A new clean session starts with no filters: amqtt drops the old session's (the plugin
    removes exactly the client's own, instead of trying every filter of amqtt's table)."""
    broker = broker_factory(max_subscriptions_per_client=2)
    publisher = clients(broker.port, "pub-ending", clean_session=True)
    first = clients(broker.port, "ending", clean_session=True)
    assert first.subscribe([("old/a", 1), ("old/b", 1), ("old/c", 1)]) == [1, 1, REFUSED]
    first.disconnect()
    again = clients(broker.port, "ending", clean_session=True)
    assert again.subscribe([("new/a", 1), ("new/b", 1)]) == [1, 1]
    publisher.publish("old/a", [b"old"])
    publisher.publish("new/b", [b"new"])
    assert again.wait_for(lambda got: any(m.payload == b"new" for m in got))
    assert [m.payload for m in again.messages] == [b"new"]


RETAINED_TOPICS = 5000


@pytest.mark.parametrize("clean", [False, True], ids=["durable", "clean"])
def test_a_subscribe_of_many_filters_against_many_retained_topics_gets_exactly_the_matching_ones(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], clean: bool
) -> None:
    """One SUBSCRIBE of 500 filters against 5000 retained topics: every filter's retained messages
    were found by matching every retained message (2.5 million matches, seconds of a blocked
    event loop for every client; see bench/RESULTS.md, "Many-filter SUBSCRIBE against many retained
    topics"); they are now looked up in a trie of the retained topics. What is checked here is
    that the subscriber gets exactly the retained messages its filters match, each once per
    matching filter, retained-flagged: the trie must answer as ``matches`` does, '$' rule included
    (the '$' rule is in tests/unit/test_topic_trie.py: a client may not publish to '$' topics; the
    stall of other clients is a timing, recorded in bench/RESULTS.md, not asserted)."""
    broker = broker_factory(max_subscriptions_per_client=0)
    publisher = clients(broker.port, "pub-fleet", clean_session=True)
    infos = [
        publisher.paho.publish(f"fleet/{i:05d}/state", f"state {i}".encode(), qos=1, retain=True)
        for i in range(RETAINED_TOPICS)
    ]
    deadline = time.monotonic() + 60.0
    for info in infos:
        info.wait_for_publish(max(0.1, deadline - time.monotonic()))
        assert info.is_published(), f"retained publish mid={info.mid} not acknowledged"
    publisher.publish("fleet/00003/state", [b""], retain=True)  # deleted: matched by nothing

    filters = [f"other/{k}/+" for k in range(FLOOD_PER_PACKET - 8)]
    filters += ["fleet/00007/+", "fleet/01234/#", "+/04999/state", "fleet/00003/+", "+/+/x", "+/nothing/q",
                "fleet/00042/state", "other/#"]
    wanted = ["fleet/00007/state", "fleet/01234/state", "fleet/04999/state", "fleet/00042/state"]
    device = clients(broker.port, f"retained-{clean}", clean_session=clean)
    assert device.subscribe([(f, 1) for f in filters]) == [1] * FLOOD_PER_PACKET
    assert device.wait_for(lambda got: len(got) >= len(wanted))
    publisher.publish("other/0/marker", [b"marker"])  # after every retained message, in order
    assert device.wait_for(lambda got: any(m.payload == b"marker" for m in got))
    got = [(m.topic, m.payload, m.retain) for m in device.messages if m.payload != b"marker"]
    assert sorted(got) == sorted((topic, f"state {int(topic.split('/')[1])}".encode(), True) for topic in wanted)


def test_an_unsubscribe_read_just_before_disconnect_and_close_is_stored(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    """guarantees.md, lifecycle: a durable session's subscriptions and their removal are stored.
    An UNSUBSCRIBE that arrives in one write with a control request before it and DISCONNECT
    after it, the socket closed at once (what the SDK's unsubscribe() then close() sends), was
    dropped every time: the reader reached EOF and cancelled the packets' handlers it had
    started, so the broker kept queueing for the filter. Packets read before the end are handled."""
    for round_ in range(5):
        client_id = f"unsub-close-{round_}"
        with raw_connect(broker.port, client_id, clean=False) as sock:
            assert raw_subscribe(sock, "uc/t", 1) == 1
            ready = mqtt_packet(0x30, mqtt_string(CONTROL_TOPIC) + encode_request("ready", 1))
            unsubscribe = mqtt_packet(0xA2, b"\x00\x02" + mqtt_string("uc/t"))
            sock.sendall(ready + unsubscribe + bytes([0xE0, 0]))
        device = clients(broker.port, client_id)
        assert device.session_present is True
        assert request(device, "hello").fields["subscriptions"] == {}, f"round {round_}: the UNSUBSCRIBE was lost"
        device.disconnect()


LONG_FILTER = 60_000
"""Bytes of each filter of the attack below: near MQTT's 65535, far below max_packet_size."""
BYTE_LIMIT = 1_048_576
"""The default max_subscription_bytes_per_client."""


@pytest.mark.parametrize("clean", [False, True], ids=["durable", "clean"])
def test_long_filters_past_max_subscription_bytes_per_client_get_0x80(
    broker: Broker, clients: Callable[..., Client], clean: bool
) -> None:
    """A durable session's stored record holds its filters and is rewritten whole on every
    SUBSCRIBE: with 250 filters of 60 kB (under max_subscriptions_per_client) each SUBSCRIBE held
    the event loop for about 0.25 s (another client's round trip: up to 0.6 s), growing with every
    filter. The filters' bytes are bounded too; a held filter re-subscribed counts once."""
    queued = payloads(5, "order")
    device, _ = queued_while_dropped(clients, broker.port, "orders/#", "orders/1", queued)
    hog = raw_connect(broker.port, "hog", clean=clean, keepalive=0)
    fits = BYTE_LIMIT // LONG_FILTER
    codes = []
    for i in range(fits + 3):
        long_filter = f"hog/{i:04d}/".encode() + b"a" * (LONG_FILTER - 9)
        codes.append(raw_subscribe(hog, long_filter, 1, packet_id=i + 1))
    assert codes == [1] * fits + [REFUSED] * 3
    again = f"hog/{0:04d}/".encode() + b"a" * (LONG_FILTER - 9)  # a held filter: a re-subscription
    assert raw_subscribe(hog, again, 1, packet_id=0xFF00) == 1
    hog.close()
    log = broker.log()
    assert f"max_subscription_bytes_per_client is {BYTE_LIMIT}" in log, log[-3000:]
    assert "hog: SUBSCRIBE to 'hog/" in log
    assert clients(broker.port, "newcomer", clean_session=True).paho.is_connected()
    device.connect()
    assert [m.payload for m in device.wait_messages(len(queued))] == queued, "a queued message was lost"
