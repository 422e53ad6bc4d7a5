"""The SDK's subscription registry: listeners per topic follow every subscription change."""

from __future__ import annotations

from durable_client._registry import MATCH_CACHE, Registry, StreamSubscription, Subscription
from durable_client.events import Event


def first(event: Event) -> None: ...


def second(event: Event) -> None: ...


def test_listeners_per_topic_follow_subscription_changes() -> None:
    registry = Registry()
    registry.put(Subscription("a/+", 1, True, first))
    assert registry.listeners("a/1") == [first]
    assert registry.listeners("b/1") == []
    registry.put(Subscription("a/+", 1, True, second))  # the listener replaced
    assert registry.listeners("a/1") == [second]
    registry.put(Subscription("#", 0, False, first))
    assert registry.listeners("a/1") == [second, first]
    assert registry.listeners("b/1") == [first]
    registry.remove("a/+")
    assert registry.listeners("a/1") == [first]


def test_the_match_cache_stays_bounded() -> None:
    registry = Registry()
    registry.put(Subscription("d/+", 1, True, first))
    for index in range(MATCH_CACHE + 5):
        assert registry.listeners(f"d/{index}") == [first]
    assert len(registry._matched) <= MATCH_CACHE


def test_stream_listeners_per_topic_follow_stream_subscription_changes() -> None:
    registry = Registry()
    registry.put_stream(StreamSubscription("s/#", first, None))
    assert registry.stream_listeners("s/a") == [first]
    assert registry.stream_listeners("s/a") == [first], "from the cache"
    registry.put_stream(StreamSubscription("s/+", second, None))
    assert registry.stream_listeners("s/a") == [first, second]
    registry.remove_stream("s/#")
    assert registry.stream_listeners("s/a") == [second]
    assert registry.stream_listeners("t/a") == []
