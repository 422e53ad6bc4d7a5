"""The SubscriptionIndex trie against ``matches()`` as the oracle, and its edge cases."""

from __future__ import annotations

import random

import pytest
from amqtt.broker import RetainedApplicationMessage

from amqtt_durable.amqtt_glue import RetainedTable
from amqtt_durable.topics import SubscriptionIndex, TopicIndex, matches
from durable_protocol import filter_is_valid

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
    topics = TopicIndex()  # the retained topics' trie, the other way round: a filter finds topics
    topics.add(topic)
    assert topics.matching(topic_filter) == ([topic] if expected else [])


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


def test_topic_index_finds_what_matches_finds_over_random_topics_and_filters() -> None:
    """Property-style, fixed seed: after every add/discard, matching(f) equals the topics that
    ``matches`` accepts, in the order a dict of them would list them (re-adding keeps the place)."""
    rng = random.Random(20261126)
    index = TopicIndex()
    held: dict[str, None] = {}  # the oracle: a dict, as amqtt's retained table
    filters = [random_filter(rng) for _ in range(150)] + ["#", "+", "+/+", "$SYS/#", "$x/+", "a", "a/b", "$SYS"]
    for step in range(2000):
        topic = random_topic(rng)
        if held and rng.random() < 0.3:
            topic = rng.choice(list(held))
            index.discard(topic)
            del held[topic]
        else:
            index.add(topic)
            held[topic] = None
        assert len(index) == len(held)
        if step % 80 == 0:
            for topic_filter in filters:
                expected = [t for t in held if matches(t, topic_filter)]
                assert index.matching(topic_filter) == expected, topic_filter
            assert all(t in index for t in held)
    for topic in list(held):
        index.discard(topic)
        index.discard(topic)  # twice: nothing left to discard, nothing changes
    assert len(index) == 0
    assert index._root.children == {}  # every node pruned
    assert index.matching("#") == []


def test_topic_index_walks_only_the_matching_branches() -> None:
    """A filter of a first level no topic has is one lookup, however many topics there are."""
    index = TopicIndex()
    for i in range(10_000):
        index.add(f"fleet/{i:05d}/state")
    index.add("$SYS/broker/uptime")
    assert list(index._root.children) == ["fleet", "$SYS"]
    assert index.matching("other/1/+") == []
    assert index.matching("fleet/00042/+") == ["fleet/00042/state"]
    assert index.matching("fleet/00042/state") == ["fleet/00042/state"]
    assert len(index.matching("fleet/#")) == len(index.matching("+/+/state")) == 10_000
    assert "$SYS/broker/uptime" not in index.matching("#")
    assert index.matching("$SYS/#") == ["$SYS/broker/uptime"]
    index.clear()
    assert len(index) == 0
    assert index.matching("#") == []


def test_amqtts_retained_table_keeps_its_topic_trie_in_step_whatever_changes_it() -> None:
    """The glue's RetainedTable: every mapping method amqtt, its persistence plugin or the glue
    may use to change the table changes the trie with it."""
    def message(topic: str) -> RetainedApplicationMessage:
        return RetainedApplicationMessage(None, topic, topic.encode(), 1)

    table = RetainedTable()
    table["a/1"] = message("a/1")
    table.update({"a/2": message("a/2"), "b/1": message("b/1")})
    table |= {"c/1": message("c/1")}
    table.setdefault("c/2", message("c/2"))
    table["a/1"] = message("a/1")  # a new message of a topic it has: same place, as in a dict
    assert table.matching("a/+") == [("a/1", table["a/1"]), ("a/2", table["a/2"])]
    del table["a/2"]
    assert table.pop("b/1").topic == "b/1"
    assert table.pop("missing", None) is None
    popped, _ = table.popitem()
    assert popped not in table.topics
    assert len(table) == 2
    assert [topic for topic, _ in table.matching("#")] == list(table)
    assert len(table.topics) == len(table)
    table.clear()
    assert table.matching("#") == []
    assert len(table.topics) == 0


def test_admits_bytes_sums_utf8_bytes_of_distinct_filters_and_frees_them_on_remove() -> None:
    index = SubscriptionIndex()
    index.add("c", "a/+", 1)  # 3 bytes
    index.add("c", "é", 1)  # 2 bytes in UTF-8
    index.add("c", "a/+", 2)  # a re-subscription adds nothing
    assert index.filter_bytes("c") == 5
    assert index.admits_bytes("c", "xyz", 8) is True  # 5 + 3 = 8
    assert index.admits_bytes("c", "wxyz", 8) is False
    assert index.admits_bytes("c", "a/+", 5) is True  # held: counts once
    assert index.admits_bytes("c", "wxyz", 0) is True  # 0: no limit
    index.remove("c", "é")
    assert index.filter_bytes("c") == 3
    index.remove("c", "a/+")
    assert index.filter_bytes("c") == 0
