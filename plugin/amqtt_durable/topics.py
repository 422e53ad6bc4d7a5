"""Topic filters and the subscription index used to route a publish to durable sessions."""

from __future__ import annotations

from collections.abc import Iterator


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


class _Node:
    """One level of the filter trie: the next levels ('+' and '#' are keys too) and who ends here."""

    __slots__ = ("children", "filter", "subscribers")

    def __init__(self) -> None:
        self.children: dict[str, _Node] = {}
        self.subscribers: dict[str, int] = {}
        self.filter = ""  # the filter that ends here, once one does


def _utf8_size(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


class SubscriptionIndex:
    """Filters -> {client_id: qos}: filters without wildcards in a dict, the others in a trie of levels.

    Routing looks the topic up in the dict, then walks its levels through the trie, following
    the literal level, '+' and '#' at each: its cost depends on the topic's levels and the
    filters that match, not on how many filters there are (10,000 wildcard filters of one
    client cost a publish nothing when they do not match it). One node per distinct filter
    keeps the cost independent of how many sessions share a filter (1000 subscribers on one
    topic is one node).
    """

    def __init__(self) -> None:
        self._exact: dict[str, _Node] = {}
        self._root = _Node()
        self._filters = 0
        self._held: dict[str, set[str]] = {}  # client id -> its filters
        self._held_bytes: dict[str, int] = {}  # client id -> the UTF-8 bytes of its filters

    def __len__(self) -> int:
        """Distinct filters with at least one subscriber."""
        return self._filters

    def add(self, client_id: str, topic_filter: str, qos: int) -> None:
        if "+" in topic_filter or "#" in topic_filter:
            node = self._root
            for level in topic_filter.split("/"):
                child = node.children.get(level)
                if child is None:
                    child = node.children[level] = _Node()
                node = child
        else:
            node = self._exact.setdefault(topic_filter, _Node())
        node.filter = topic_filter
        subscribers = node.subscribers
        if client_id not in subscribers:
            if not subscribers:
                self._filters += 1
            self._held.setdefault(client_id, set()).add(topic_filter)
            self._held_bytes[client_id] = self._held_bytes.get(client_id, 0) + _utf8_size(topic_filter)
        subscribers[client_id] = qos

    def remove(self, client_id: str, topic_filter: str) -> None:
        levels = topic_filter.split("/")
        path = [self._root]
        if "+" in topic_filter or "#" in topic_filter:
            for level in levels:
                child = path[-1].children.get(level)
                if child is None:
                    return
                path.append(child)
            node = path[-1]
        else:
            exact = self._exact.get(topic_filter)
            if exact is None:
                return
            node = exact
        subscribers = node.subscribers
        if subscribers.pop(client_id, None) is None:
            return
        if not subscribers:
            self._filters -= 1
            self._exact.pop(topic_filter, None)
        held = self._held[client_id]
        held.discard(topic_filter)
        self._held_bytes[client_id] -= _utf8_size(topic_filter)
        if not held:
            del self._held[client_id]
            del self._held_bytes[client_id]
        for depth in range(len(path) - 1, 0, -1):  # prune the trie nodes nothing ends at or passes through
            trie_node = path[depth]
            if trie_node.subscribers or trie_node.children:
                break
            del path[depth - 1].children[levels[depth - 1]]

    def count(self, client_id: str) -> int:
        """How many filters ``client_id`` is subscribed to."""
        return len(self._held.get(client_id, ()))

    def filters_of(self, client_id: str) -> list[str]:
        """The filters ``client_id`` is subscribed to."""
        return list(self._held.get(client_id, ()))

    def admits(self, client_id: str, topic_filter: str, limit: int) -> bool:
        """May ``client_id`` subscribe to ``topic_filter`` under ``limit`` filters per client (0: any number)?

        A filter it already has is a re-subscription and does not count twice.
        """
        return not limit or self.count(client_id) < limit or self.holds(client_id, topic_filter)

    def filter_bytes(self, client_id: str) -> int:
        """The UTF-8 bytes of the filters ``client_id`` is subscribed to, summed."""
        return self._held_bytes.get(client_id, 0)

    def admits_bytes(self, client_id: str, topic_filter: str, limit: int) -> bool:
        """May ``client_id`` subscribe to ``topic_filter`` under ``limit`` bytes of filters per client
        (0: any)? A filter it already has does not count twice."""
        if not limit or self.holds(client_id, topic_filter):
            return True
        return self.filter_bytes(client_id) + _utf8_size(topic_filter) <= limit

    def holds(self, client_id: str, topic_filter: str) -> bool:
        """True when ``client_id`` is subscribed to exactly ``topic_filter``."""
        return topic_filter in self._held.get(client_id, ())

    def route(self, topic: str) -> dict[str, int]:
        """Sessions that take ``topic``, each with its highest matching subscription QoS."""
        if not self._root.children:  # no wildcard filter: one lookup
            exact = self._exact.get(topic)
            return {} if exact is None else dict(exact.subscribers)
        targets: dict[str, int] = {}
        for node in self._matching(topic):
            subscribers = node.subscribers
            if not targets:
                targets = dict(subscribers)
                continue
            for client_id, qos in subscribers.items():
                if targets.get(client_id, -1) < qos:
                    targets[client_id] = qos
        return targets

    def matches_any(self, topic: str) -> bool:
        """True when some filter matches ``topic`` (stops at the first)."""
        return next(self._matching(topic), None) is not None

    def matching_filters(self, topic: str) -> Iterator[str]:
        """Every filter with a subscriber that matches ``topic``."""
        for node in self._matching(topic):
            yield node.filter

    def _matching(self, topic: str) -> Iterator[_Node]:
        """The node of every subscribed filter that matches ``topic`` (MQTT 3.1.1 section 4.7): the
        exact filter, then the trie's.

        '#' matches the rest of the topic, also none of it ('a/#' matches 'a'); '+' one level;
        a topic starting with '$' is not matched by a wildcard in the first level (MQTT-4.7.2-1).
        """
        exact = self._exact.get(topic)
        if exact is not None:
            yield exact
        if not self._root.children:
            return
        levels = topic.split("/")
        nodes = [self._root]
        wildcards_first = not topic.startswith("$")
        for depth, level in enumerate(levels):
            matched: list[_Node] = []
            nodes = _descend(nodes, level, bool(depth) or wildcards_first, matched)
            yield from matched
            if not nodes:
                return
        for node in nodes:
            if node.subscribers:
                yield node
            rest = node.children.get("#")
            if rest is not None and rest.subscribers:
                yield rest


def _descend(nodes: list[_Node], level: str, wildcards: bool, matched: list[_Node]) -> list[_Node]:
    """One level down the trie: the nodes ``level`` leads to (literal and '+'); with ``wildcards``,
    the '#' filters below ``nodes`` match whatever follows, so they go to ``matched``."""
    following: list[_Node] = []
    for node in nodes:
        children = node.children
        if wildcards:
            rest = children.get("#")
            if rest is not None and rest.subscribers:
                matched.append(rest)
            single = children.get("+")
            if single is not None:
                following.append(single)
        child = children.get(level)
        if child is not None and level not in ("+", "#"):  # wildcards are not literals
            following.append(child)
    return following


_NO_CHILDREN: dict[str, _TopicNode] = {}
"""The children of every leaf, shared (never written: ``add`` gives a node its own dict first)."""


class _TopicNode:
    """One level of the topic trie: the next levels, and the topic that ends here (with its order)."""

    __slots__ = ("children", "order", "topic")

    def __init__(self) -> None:
        self.children = _NO_CHILDREN  # most nodes are leaves: no dict of their own (64 bytes each)
        self.topic: str | None = None
        self.order = 0


class TopicIndex:
    """A set of topic names (the retained messages' topics) in a trie of levels, answering "which
    of them does this filter match" by walking the branches the filter can match only.

    A filter's cost is its literal levels (one lookup each), the children of the nodes where it has
    '+' (one per child), and the topics it matches; not the number of topics. The answer is exactly
    ``[t for t in topics if matches(t, topic_filter)]``, in the order the topics were added (as a
    dict's keys: re-adding a topic already there keeps its place).
    """

    def __init__(self) -> None:
        self._root = _TopicNode()
        self._count = 0
        self._added = 0

    def __len__(self) -> int:
        return self._count

    def __contains__(self, topic: object) -> bool:
        return isinstance(topic, str) and self._node(topic) is not None

    def _node(self, topic: str) -> _TopicNode | None:
        node = self._root
        for level in topic.split("/"):
            child = node.children.get(level)
            if child is None:
                return None
            node = child
        return node if node.topic is not None else None

    def add(self, topic: str) -> None:
        node = self._root
        for level in topic.split("/"):
            child = node.children.get(level)
            if child is None:
                if node.children is _NO_CHILDREN:
                    node.children = {}
                child = node.children[level] = _TopicNode()
            node = child
        if node.topic is None:
            node.topic = topic
            self._added += 1
            node.order = self._added
            self._count += 1

    def discard(self, topic: str) -> None:
        levels = topic.split("/")
        path = [self._root]
        for level in levels:
            child = path[-1].children.get(level)
            if child is None:
                return
            path.append(child)
        if path[-1].topic is None:
            return
        path[-1].topic = None
        self._count -= 1
        for depth in range(len(path) - 1, 0, -1):  # prune the nodes no topic ends at or passes through
            node = path[depth]
            if node.topic is not None or node.children:
                break
            del path[depth - 1].children[levels[depth - 1]]

    def clear(self) -> None:
        self._root = _TopicNode()
        self._count = 0

    def matching(self, topic_filter: str) -> list[str]:
        """The topics ``topic_filter`` matches, as ``matches`` decides (MQTT 3.1.1 section 4.7):
        '+' is any one level, '#' the rest (also none of it: 'a/#' matches 'a'), and a topic
        starting with '$' is not matched by a wildcard first level (MQTT-4.7.2-1)."""
        found: list[_TopicNode] = []
        nodes = [self._root]
        for depth, level in enumerate(topic_filter.split("/")):
            if level == "#":
                stack = [child for node in nodes for key, child in node.children.items() if depth or key[:1] != "$"]
                found.extend(node for node in nodes if node.topic is not None)
                while stack:  # every node below holds or leads to a topic (pruned): output-bound
                    node = stack.pop()
                    if node.topic is not None:
                        found.append(node)
                    stack.extend(node.children.values())
                return _in_order(found)
            following: list[_TopicNode] = []
            if level == "+":
                for node in nodes:
                    following.extend(
                        child for key, child in node.children.items() if depth or key[:1] != "$"
                    )
            else:
                for node in nodes:
                    child = node.children.get(level)
                    if child is not None:
                        following.append(child)
            nodes = following
            if not nodes:
                return []
        return _in_order([node for node in nodes if node.topic is not None])


def _in_order(nodes: list[_TopicNode]) -> list[str]:
    if len(nodes) > 1:
        nodes.sort(key=lambda node: node.order)
    return [node.topic for node in nodes if node.topic is not None]
