"""The engine's counters, and the flat name -> value map of them published under $SYS/broker/durable/."""

from __future__ import annotations

import logging

from .engine_state import EngineState
from .errors import StoreReadError

log = logging.getLogger("amqtt_durable")


class EngineMetrics(EngineState):
    """The engine's counters and their report, over its state (see engine_state.py)."""

    def note_sent(self, sent: int, replayed: int) -> None:
        self.sent_total += sent
        self.replayed_total += replayed

    def queue_read_failed(self, client_id: str, exc: StoreReadError, delay: float) -> None:
        """A pump could not read its session's queue; it tries again in ``delay`` seconds."""
        if self.db.closed:  # not damage: a retry after a failed write could not reopen the store yet
            log.warning("%s. Delivery to %s tries again in %.0f s", exc, client_id, delay)
            return
        self.read_errors += 1
        log.error(
            "%s. Delivery to %s waits and tries again in %.0f s; the store is damaged: stop the broker, run "
            "'amqtt-durable repair %s' (keeps every readable message), then start the broker again",
            exc,
            client_id,
            delay,
            self.config.store,
        )

    def metrics(self) -> dict[str, int]:
        connected = sum(1 for s in self.sessions.values() if s.connected)
        return {
            "sessions/connected": connected,
            "sessions/disconnected": len(self.sessions) - connected,
            "messages/queued": sum(s.depth for s in self.sessions.values()),
            "bytes/queued": sum(s.bytes for s in self.sessions.values()),
            "messages/enqueued": self.enqueued_total,
            "messages/dropped": self.dropped_total,
            "messages/dropped_clean": self.clean_dropped_total,
            "messages/replayed": self.replayed_total,
            "messages/sent": self.sent_total,
            "sessions/expired": self.expired_total,
            "sessions/refused": self.session_limit.refused,
            "retained/messages": len(self.retained),
            "store/commits": self.earlier_commits + self.committer.commits,
            "store/read_errors": self.read_errors + self.streams.read_errors,
        }
