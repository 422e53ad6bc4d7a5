"""The SubscriptionIndex trie against ``matches()`` as the oracle, and its edge cases."""

from __future__ import annotations

import random

import pytest

from amqtt_durable.topics import SubscriptionIndex, filter_is_valid, matches

LEVELS = ["a", "b", "", "$x", "$SYS", "c d"]
FILTER_LEVELS = [*LEVELS, "+", "+", "#"]


def random_topic(rng: random.Random) -> str:
    return "/".join(rng.choice(LEVELS) for _ in range(rng.randint(1, 5)))


def random_filter(rng: random.Random) -> str:
    """A valid filter of 1-5 levels ('#' only last), drawn until valid (bounded)."""
    for _ in range(100):
        candidate = "/".join(rng.choice(FILTER_LEVELS) for _ in range(rng.randint(1, 5)))
        if filter_is_valid(candidate):
            return candidate
    return "#"


def oracle(subscriptions: dict[tuple[str, str], int], topic: str) -> dict[str, int]:
    """What route() must return: per client the highest QoS of its filters that match."""
    expected: dict[str, int] = {}
    for (client_id, topic_filter), qos in subscriptions.items():
        if matches(topic, topic_filter) and expected.get(client_id, -1) < qos:
            expected[client_id] = qos
    return expected


def test_routes_as_matches_does_over_random_filters_and_topics() -> None:
    """Property-style, fixed seed: after every add/remove, route() equals the oracle on sample topics."""
    rng = random.Random(20261124)
    index = SubscriptionIndex()
    subscriptions: dict[tuple[str, str], int] = {}
    topics = [random_topic(rng) for _ in range(150)]
    for step in range(1500):
        client_id = f"c{rng.randrange(8)}"
        if subscriptions and rng.random() < 0.3:
            client_id, topic_filter = rng.choice(sorted(subscriptions))
            index.remove(client_id, topic_filter)
            del subscriptions[(client_id, topic_filter)]
        else:
            topic_filter = random_filter(rng)
            qos = rng.randrange(3)
            index.add(client_id, topic_filter, qos)
            subscriptions[(client_id, topic_filter)] = qos
        if step % 25 == 0:
            for topic in topics:
                assert index.route(topic) == oracle(subscriptions, topic), topic
                assert index.matches_any(topic) is bool(oracle(subscriptions, topic)), topic
                held = {f for _, f in subscriptions}
                assert sorted(index.matching_filters(topic)) == sorted(f for f in held if matches(topic, f)), topic
    assert len(index) == len({f for _, f in subscriptions})
    for client_id in {c for c, _ in subscriptions}:
        assert index.count(client_id) == sum(1 for c, _ in subscriptions if c == client_id)
        assert sorted(index.filters_of(client_id)) == sorted(f for c, f in subscriptions if c == client_id)


def test_everything_removed_leaves_an_empty_trie() -> None:
    rng = random.Random(7)
    index = SubscriptionIndex()
    added = {(f"c{rng.randrange(5)}", random_filter(rng)) for _ in range(500)}
    for client_id, topic_filter in added:
        index.add(client_id, topic_filter, 1)
    for client_id, topic_filter in added:
        index.remove(client_id, topic_filter)
    assert len(index) == 0
    assert index._root.children == {}  # every node pruned: no memory left behind
    assert all(index.count(f"c{i}") == 0 and index.filters_of(f"c{i}") == [] for i in range(5))


@pytest.mark.parametrize(
    ("topic_filter", "topic", "expected"),
    [
        ("a/#", "a", True),  # '#' includes the parent level
        ("a/#", "a/", True),
        ("a/#", "a/b/c", True),
        ("a/#", "ab", False),
        ("#", "a/b", True),
        ("#", "/", True),
        ("+", "", True),  # an empty topic level is a level
        ("+/+", "/", True),
        ("+", "a/b", False),
        ("a/+", "a", False),
        ("a/+/#", "a/b", True),
        ("a//b", "a//b", True),
        ("+/b", "/b", True),
        # MQTT-4.7.2-1: a first-level wildcard never matches a '$' topic; a later one does
        ("#", "$SYS/x", False),
        ("+/x", "$SYS/x", False),
        ("+", "$SYS", False),
        ("$SYS/#", "$SYS", True),
        ("$SYS/+", "$SYS/x", True),
        ("a/#", "a/$x", True),
        ("a/+", "a/$x", True),
    ],
)
def test_edge_cases(topic_filter: str, topic: str, expected: bool) -> None:
    assert matches(topic, topic_filter) is expected  # the oracle agrees with the case
    index = SubscriptionIndex()
    index.add("c", topic_filter, 1)
    assert index.route(topic) == ({"c": 1} if expected else {})
    assert index.matches_any(topic) is expected


def test_many_filters_of_one_client_collapse_to_its_highest_qos() -> None:
    index = SubscriptionIndex()
    index.add("c", "a/b", 0)
    index.add("c", "a/+", 1)
    index.add("c", "+/b", 2)
    index.add("c", "#", 1)
    index.add("d", "a/#", 0)
    assert index.route("a/b") == {"c": 2, "d": 0}
    index.remove("c", "+/b")
    assert index.route("a/b") == {"c": 1, "d": 0}


def test_ten_thousand_non_matching_wildcards_are_not_visited() -> None:
    """The attack of issue 10 point 7: filters under other first levels are never looked at."""
    index = SubscriptionIndex()
    for i in range(10_000):
        index.add("attacker", f"flood/{i}/+", 1)
    index.add("victim", "sensors/+/temp", 1)
    assert index.route("sensors/d1/temp") == {"victim": 1}
    # the walk only touches nodes on the topic's path: the root's children are two, not 10,000
    assert sorted(index._root.children) == ["flood", "sensors"]
    assert index.count("attacker") == 10_000
    assert len(index) == 10_001


def test_admits_counts_distinct_filters_and_not_resubscriptions() -> None:
    index = SubscriptionIndex()
    index.add("c", "a", 1)
    index.add("c", "b/+", 1)
    index.add("c", "b/+", 2)  # a re-subscription replaces the QoS, it is not a second filter
    assert index.count("c") == 2
    assert index.admits("c", "new", 2) is False
    assert index.admits("c", "b/+", 2) is True  # held: a re-subscription
    assert index.admits("c", "b", 2) is False  # a prefix of a held filter is another filter
    assert index.holds("c", "b/+") is True
    assert index.holds("c", "b") is False
    assert index.holds("other", "b/+") is False
    assert index.admits("c", "new", 3) is True
    assert index.admits("c", "new", 0) is True  # 0: no limit
    assert index.admits("other", "new", 1) is True
    index.remove("c", "a")
    assert index.admits("c", "new", 2) is True


def test_remove_of_unknown_or_partial_filters_changes_nothing() -> None:
    index = SubscriptionIndex()
    index.add("c", "a/b/c", 1)
    index.remove("c", "a/b")  # a node on the path, no subscription there
    index.remove("c", "a/b/c/d")
    index.remove("d", "a/b/c")
    assert index.route("a/b/c") == {"c": 1}
    assert index.count("c") == 1
    assert index.count("d") == 0
    assert len(index) == 1


def test_removing_a_filter_keeps_the_longer_ones_under_it() -> None:
    index = SubscriptionIndex()
    index.add("c", "a", 1)
    index.add("c", "a/b", 2)
    index.remove("c", "a")
    assert index.route("a") == {}
    assert index.route("a/b") == {"c": 2}
