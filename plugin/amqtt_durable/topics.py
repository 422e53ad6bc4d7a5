"""Topic filters and the subscription index used to route a publish to durable sessions."""

from __future__ import annotations


def filter_is_valid(topic_filter: str) -> bool:
    """MQTT-4.7.1: '#' only as the whole last level, '+' only as a whole level."""
    if not topic_filter or "\x00" in topic_filter:
        return False
    levels = topic_filter.split("/")
    for index, level in enumerate(levels):
        if "#" in level and (level != "#" or index != len(levels) - 1):
            return False
        if "+" in level and level != "+":
            return False
    return True


def topic_problem(topic: str) -> str | None:
    """Why ``topic`` cannot be a PUBLISH topic name (None: it can); the one check of every path.

    A topic that was not valid UTF-8 never becomes a ``str`` here: the readers refuse it
    while decoding (MQTT-1.5.3-1).
    """
    if not topic:
        return "the topic is empty (MQTT-4.7.3-1)"
    if "\x00" in topic:
        return "the topic contains U+0000 (MQTT-1.5.3-2)"
    if "+" in topic or "#" in topic:
        return "the topic contains a wildcard, + or # (MQTT-3.3.2-2)"
    return None


def topic_is_valid(topic: str) -> bool:
    """A PUBLISH topic: non-empty, no wildcards, no NUL (MQTT-3.3.2-2, MQTT-4.7.3-1, MQTT-1.5.3-2)."""
    return topic_problem(topic) is None


def matches(topic: str, topic_filter: str) -> bool:
    """True when ``topic`` matches ``topic_filter``; '$' topics never match a leading wildcard."""
    if topic.startswith("$") and topic_filter[:1] in ("+", "#"):
        return False
    if "+" not in topic_filter and "#" not in topic_filter:
        return topic == topic_filter
    topic_levels = topic.split("/")
    filter_levels = topic_filter.split("/")
    for index, level in enumerate(filter_levels):
        if level == "#":
            return True
        if index >= len(topic_levels) or level not in ("+", topic_levels[index]):
            return False
    return len(topic_levels) == len(filter_levels)


def filters_overlap(a: str, b: str) -> bool:
    """True when some topic matches both filters (a stream subscription must reach a configured stream).

    Walks the levels: '+' agrees with any single level, '#' with any rest (including none,
    as "a/#" matches "a"), literals must be equal. MQTT-4.7.2-1: a topic starting with '$' is
    matched only by filters whose first level is that literal, so a filter whose first level
    is a '$' literal overlaps only filters with the same first level.
    """
    levels_a = a.split("/")
    levels_b = b.split("/")
    first_a, first_b = levels_a[0], levels_b[0]
    for mine, other in ((first_a, first_b), (first_b, first_a)):
        if mine.startswith("$") and other != mine:
            return False
    for index in range(max(len(levels_a), len(levels_b))):
        level_a = levels_a[index] if index < len(levels_a) else None
        level_b = levels_b[index] if index < len(levels_b) else None
        if level_a == "#" or level_b == "#":
            return True
        if level_a is None or level_b is None:
            return False
        if level_a != level_b and "+" not in (level_a, level_b):
            return False
    return True


class SubscriptionIndex:
    """Filters -> {client_id: qos}; exact filters by dict lookup, wildcard filters by matching.

    One entry per distinct filter keeps routing cost independent of how many sessions
    share a filter (1000 subscribers on one topic is one lookup).
    """

    def __init__(self) -> None:
        self._exact: dict[str, dict[str, int]] = {}
        self._wildcard: dict[str, dict[str, int]] = {}

    def add(self, client_id: str, topic_filter: str, qos: int) -> None:
        table = self._wildcard if ("+" in topic_filter or "#" in topic_filter) else self._exact
        table.setdefault(topic_filter, {})[client_id] = qos

    def remove(self, client_id: str, topic_filter: str) -> None:
        for table in (self._exact, self._wildcard):
            subscribers = table.get(topic_filter)
            if subscribers is not None:
                subscribers.pop(client_id, None)
                if not subscribers:
                    del table[topic_filter]

    def route(self, topic: str) -> dict[str, int]:
        """Sessions that take ``topic``, each with its highest matching subscription QoS."""
        targets = dict(self._exact.get(topic, ()))
        for topic_filter, subscribers in self._wildcard.items():
            if matches(topic, topic_filter):
                for client_id, qos in subscribers.items():
                    if targets.get(client_id, -1) < qos:
                        targets[client_id] = qos
        return targets
