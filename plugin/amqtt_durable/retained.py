"""Retained messages in the store (``b"r" + topic``, see store.py), one per topic.

A retained message is set, or cleared by an empty payload (MQTT-3.3.1-10/11), in the group
commit of the publish that does it, so it is stored before that publish is acknowledged. Only
the topics are kept in memory (for the count); the messages themselves are read from the store
once, at start-up, and handed to amqtt's table.
"""

from __future__ import annotations

from typing import Any

from .store import GroupCommitter, RetainedMessage, iter_retained, retained_key


class RetainedMessages:
    """The retained message of every topic that has one, written through the group committer."""

    def __init__(self, committer: GroupCommitter) -> None:
        self._committer = committer
        self._topics: set[str] = set()
        self._loaded: list[RetainedMessage] = []

    def load(self, db: Any) -> None:
        """Read every stored retained message, each decoded now: a damaged one stops start-up by
        name (DamagedRecordError) instead of leaving amqtt's table short later."""
        self._loaded = list(iter_retained(db))
        self._topics = {message.topic for message in self._loaded}

    def take_loaded(self) -> list[RetainedMessage]:
        """The messages ``load`` read, once (for amqtt's table; not kept here afterwards)."""
        loaded, self._loaded = self._loaded, []
        return loaded

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
