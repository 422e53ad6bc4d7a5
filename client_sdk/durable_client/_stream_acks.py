"""Cumulative stream acknowledgements: one ``stream_ack`` covers every id up to it (protocol v1).

A reader that processes a run of stream events acknowledges the newest id of each topic once,
instead of once per event: when the network loop finds nothing more to read (the broker's
window is used up, or the log is read to its end), or after ``EVERY`` events of a topic, so a
large window keeps flowing while the acknowledgement of its first part is on its way.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Final

EVERY: Final = 64
"""Events of one topic processed before their acknowledgement goes without waiting for a quiet loop."""


class StreamAcks:
    """The newest processed id per topic, not yet acknowledged. Thread-safe (close() flushes)."""

    def __init__(self, send: Callable[[str, int], None], every: int = EVERY) -> None:
        self._send = send
        self._every = every
        self._lock = threading.Lock()
        self._newest: dict[str, int] = {}
        self._counts: dict[str, int] = {}
        self.sent = 0
        """stream_ack requests sent (for statistics)."""

    @property
    def pending(self) -> bool:
        return bool(self._newest)

    def add(self, topic: str, event_id: int) -> None:
        with self._lock:
            self._newest[topic] = max(event_id, self._newest.get(topic, 0))
            count = self._counts[topic] = self._counts.get(topic, 0) + 1
            if count >= self._every:
                self._send_topic(topic)

    def flush(self) -> None:
        with self._lock:
            for topic in list(self._newest):
                self._send_topic(topic)

    def drop(self) -> None:
        """The connection was lost: the broker forgot its cursors (the next subscribe gives positions)."""
        with self._lock:
            self._newest.clear()
            self._counts.clear()

    def _send_topic(self, topic: str) -> None:
        event_id = self._newest.pop(topic)
        self._counts.pop(topic, None)
        self._send(topic, event_id)
        self.sent += 1
