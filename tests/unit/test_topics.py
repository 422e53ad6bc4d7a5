"""Topic filter validation, topic matching (MQTT 3.1.1 section 4.7) and the SubscriptionIndex."""

from __future__ import annotations

import itertools

import pytest

from amqtt_durable.topics import SubscriptionIndex, filters_overlap, matches, topic_problem
from durable_protocol import filter_is_valid


@pytest.mark.parametrize(
    "topic_filter",
    [
        "#",
        "+",
        "a",
        "a/b/c",
        "sport/tennis/player1/#",
        "sport/#",
        "+/tennis/#",
        "sport/+/player1",
        "+/+",
        "/+",
        "a//b",
        "/",
        "$SYS/#",
        "a/+/+/#",
    ],
)
def test_valid_filters(topic_filter: str) -> None:
    assert filter_is_valid(topic_filter) is True


@pytest.mark.parametrize(
    "topic_filter",
    [
        "",
        "sport/tennis#",
        "sport/tennis/#/ranking",
        "#/a",
        "##",
        "a/#b",
        "sport+",
        "sport/+tennis",
        "a/b+/c",
        "++",
        "a/\x00/b",
        "\x00",
    ],
)
def test_invalid_filters(topic_filter: str) -> None:
    assert filter_is_valid(topic_filter) is False


@pytest.mark.parametrize("topic", ["a", "a/b", "/", "a//b", "$SYS/broker", "sport/tennis/player1"])
def test_valid_publish_topics(topic: str) -> None:
    assert topic_problem(topic) is None


@pytest.mark.parametrize("topic", ["", "a/+", "+", "#", "a/#", "a/b+", "a\x00b"])
def test_invalid_publish_topics(topic: str) -> None:
    assert topic_problem(topic) is not None


@pytest.mark.parametrize(
    ("topic", "topic_filter"),
    [
        # MQTT 3.1.1 section 4.7.1.2 examples
        ("sport/tennis/player1", "sport/tennis/player1/#"),
        ("sport/tennis/player1/ranking", "sport/tennis/player1/#"),
        ("sport/tennis/player1/score/wimbledon", "sport/tennis/player1/#"),
        ("sport", "sport/#"),  # '#' also matches the parent level
        ("sport/", "sport/#"),
        ("anything/at/all", "#"),
        ("/", "#"),
        # section 4.7.1.3 examples
        ("sport/tennis/player1", "sport/tennis/+"),
        ("sport/tennis/player2", "sport/tennis/+"),
        ("sport/", "sport/+"),  # the empty level after the separator
        ("/finance", "+/+"),
        ("/finance", "/+"),
        ("a//b", "a/+/b"),
        ("a/b/c", "a/+/#"),
        ("a/b", "a/+/#"),
        # exact and $ topics matched explicitly
        ("a/b", "a/b"),
        ("$SYS/broker/load", "$SYS/#"),
        ("$SYS/monitor/Clients", "$SYS/monitor/+"),
    ],
)
def test_matching(topic: str, topic_filter: str) -> None:
    assert matches(topic, topic_filter) is True


@pytest.mark.parametrize(
    ("topic", "topic_filter"),
    [
        ("sport/tennis/player1/ranking", "sport/tennis/+"),
        ("sport", "sport/+"),
        ("/finance", "+"),
        ("a", "a/b"),
        ("a/b", "a"),
        ("a/b", "a/b/c"),
        ("a/b/c", "a/b"),
        ("a/b/c", "a/+"),
        ("a/b", "A/b"),  # topics are case sensitive
        ("b/a", "a/#"),
        ("a", "b/#"),
        ("ab", "a/#"),
        # MQTT-4.7.2-1: a leading wildcard never matches a '$' topic
        ("$SYS/monitor/Clients", "#"),
        ("$SYS/monitor/Clients", "+/monitor/Clients"),
        ("$SYS", "+"),
        ("$share", "#"),
    ],
)
def test_not_matching(topic: str, topic_filter: str) -> None:
    assert matches(topic, topic_filter) is False


def test_dollar_topic_matches_wildcard_after_the_first_level() -> None:
    assert matches("$SYS/x", "$SYS/+") is True
    assert matches("a/$SYS", "a/+") is True
    assert matches("a/$x", "#") is True


def test_index_routes_exact_and_wildcard_filters() -> None:
    index = SubscriptionIndex()
    index.add("c1", "sensors/t", 1)
    index.add("c2", "sensors/+", 2)
    index.add("c3", "#", 0)
    index.add("c4", "other", 1)
    assert index.route("sensors/t") == {"c1": 1, "c2": 2, "c3": 0}
    assert index.route("sensors/h") == {"c2": 2, "c3": 0}
    assert index.route("other") == {"c3": 0, "c4": 1}
    assert index.route("sensors/t/deep") == {"c3": 0}
    assert index.route("$SYS/x") == {}


def test_index_takes_highest_qos_of_overlapping_subscriptions() -> None:
    index = SubscriptionIndex()
    index.add("c", "a/b", 0)
    index.add("c", "a/+", 2)
    index.add("c", "#", 1)
    assert index.route("a/b") == {"c": 2}
    index.remove("c", "a/+")
    assert index.route("a/b") == {"c": 1}
    index.remove("c", "#")
    assert index.route("a/b") == {"c": 0}
    # exact filter with the higher qos, wildcard lower: the exact one must win too
    index.add("c", "a/b", 2)
    index.add("c", "a/#", 0)
    assert index.route("a/b") == {"c": 2}


def test_index_resubscribe_replaces_qos() -> None:
    index = SubscriptionIndex()
    index.add("c", "x", 2)
    index.add("c", "x", 0)
    index.add("c", "y/+", 2)
    index.add("c", "y/+", 1)
    assert index.route("x") == {"c": 0}
    assert index.route("y/z") == {"c": 1}


def test_index_many_subscribers_on_one_filter() -> None:
    index = SubscriptionIndex()
    for i in range(1000):
        index.add(f"c{i}", "t", i % 3)
    routed = index.route("t")
    assert len(routed) == 1000
    assert routed["c4"] == 1
    # one entry per distinct filter, not per subscription
    assert len(index) == 1


def test_index_remove_keeps_other_subscribers_and_drops_empty_filters() -> None:
    index = SubscriptionIndex()
    index.add("c1", "t", 1)
    index.add("c2", "t", 1)
    index.add("c1", "w/#", 1)
    index.remove("c1", "t")
    assert index.route("t") == {"c2": 1}
    index.remove("c2", "t")
    assert index.route("t") == {}
    assert len(index) == 1  # "t" is gone, "w/#" is left
    index.remove("c1", "w/#")
    assert index.route("w/x") == {}
    assert len(index) == 0


def test_index_remove_unknown_is_harmless() -> None:
    index = SubscriptionIndex()
    index.add("c1", "t", 1)
    index.remove("c2", "t")
    index.remove("c1", "nope")
    index.remove("c1", "n/+")
    assert index.route("t") == {"c1": 1}


def test_route_result_is_a_copy() -> None:
    index = SubscriptionIndex()
    index.add("c1", "t", 1)
    routed = index.route("t")
    routed["intruder"] = 2
    routed["c1"] = 0
    assert index.route("t") == {"c1": 1}


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("a/+", "+/b"),
        ("a/b", "a/b"),
        ("a/#", "a"),  # '#' also matches the parent level
        ("a/#", "a/b/c"),
        ("#", "a/b"),
        ("+/+", "a/b"),
        ("+", "+"),
        ("#", "#"),
        ("a/+/c", "a/#"),
        ("$SYS/#", "$SYS/x"),
        ("$SYS/+", "$SYS/#"),
        ("a/$x", "a/+"),  # '$' only matters in the first level
        ("/+", "+/a"),
    ],
)
def test_filters_overlap(a: str, b: str) -> None:
    assert filters_overlap(a, b) is True
    assert filters_overlap(b, a) is True


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("a/#", "b/#"),
        ("a/b", "a/c"),
        ("a/+", "a"),
        ("a/+", "a/b/c"),
        ("+", "a/b"),
        ("a", "A"),
        # MQTT-4.7.2-1: leading wildcards never match '$' topics
        ("#", "$SYS/x"),
        ("+/x", "$SYS/x"),
        ("+", "$SYS"),
        ("$SYS/#", "$OTHER/#"),
        ("$SYS/#", "#"),
    ],
)
def test_filters_do_not_overlap(a: str, b: str) -> None:
    assert filters_overlap(a, b) is False
    assert filters_overlap(b, a) is False


def test_filters_overlap_agrees_with_matching_on_every_small_topic() -> None:
    """Brute force: overlap holds exactly when some topic (of up to 4 levels) matches both."""
    topic_levels = ["a", "b", "", "$x"]
    topics = ["/".join(p) for n in range(1, 5) for p in itertools.product(topic_levels, repeat=n)]
    filter_levels = ["a", "b", "+", "#", "$x"]
    filters = [
        f
        for f in ("/".join(p) for n in range(1, 4) for p in itertools.product(filter_levels, repeat=n))
        if filter_is_valid(f)
    ]
    for a in filters:
        for b in filters:
            expected = any(matches(t, a) and matches(t, b) for t in topics)
            assert filters_overlap(a, b) is expected, (a, b)
