"""Retained messages in the store (``b"r" + topic``, see store.py), one per topic.

A retained message is set, or cleared by an empty payload (MQTT-3.3.1-10/11), in the group
commit of the publish that does it, so it is stored before that publish is acknowledged. Only
the topics are kept in memory (for the count); the messages themselves are read from the store
once at start-up, into amqtt's table.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from .store import RETAINED_PREFIX, GroupCommitter, RetainedMessage, iter_retained, retained_key


class RetainedMessages:
    """The retained message of every topic that has one, written through the group committer."""

    def __init__(self, db: Callable[[], Any], committer: GroupCommitter) -> None:
        self._db = db
        """The engine's current handle: a retry after a failed write reopens the store."""
        self._committer = committer
        self._topics: set[str] = set()

    def load(self) -> None:
        """Learn which topics have a retained message (keys only: start-up stays cheap)."""
        start = len(RETAINED_PREFIX)
        keys = self._db().iterator(prefix=RETAINED_PREFIX, include_value=False)
        self._topics = {key[start:].decode("utf-8") for key in keys}

    def __len__(self) -> int:
        return len(self._topics)

    def __contains__(self, topic: object) -> bool:
        return topic in self._topics

    def update(self, topic: str, payload: bytes, qos: int, published_at: float) -> None:
        """Put the topic's new retained message into the current batch; an empty payload deletes it."""
        if payload:
            self._committer.put(retained_key(topic), RetainedMessage(topic, payload, qos, published_at).encode())
            self._topics.add(topic)
        elif topic in self._topics:
            self._committer.delete(retained_key(topic))
            self._topics.discard(topic)

    def stored(self) -> Iterator[RetainedMessage]:
        """Every retained message as written so far (not what the current batch still holds)."""
        return iter_retained(self._db())
