"""Session expiry deadlines (GemFire's durable-client-timeout), as a lazy-deletion heap."""

from __future__ import annotations

import heapq


class ExpiryTracker:
    """Deadlines of disconnected sessions; connecting again cancels one."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, str]] = []
        self._deadlines: dict[str, float] = {}

    def schedule(self, client_id: str, deadline: float) -> None:
        self._deadlines[client_id] = deadline
        heapq.heappush(self._heap, (deadline, client_id))

    def cancel(self, client_id: str) -> None:
        self._deadlines.pop(client_id, None)
        if len(self._heap) > 2 * len(self._deadlines) + 64:
            # Cancelled deadlines stay in the heap until they surface; do not let them pile up.
            self._heap = [(deadline, cid) for cid, deadline in self._deadlines.items()]
            heapq.heapify(self._heap)

    def deadline(self, client_id: str) -> float | None:
        return self._deadlines.get(client_id)

    def next_deadline(self) -> float | None:
        self._discard_stale()
        return self._heap[0][0] if self._heap else None

    def pop_expired(self, now: float) -> list[str]:
        """Client ids whose deadline is at or before ``now``, earliest first."""
        expired: list[str] = []
        while self._heap:
            self._discard_stale()
            if not self._heap or self._heap[0][0] > now:
                break
            _, client_id = heapq.heappop(self._heap)
            del self._deadlines[client_id]
            expired.append(client_id)
        return expired

    def _discard_stale(self) -> None:
        while self._heap and self._deadlines.get(self._heap[0][1]) != self._heap[0][0]:
            heapq.heappop(self._heap)
