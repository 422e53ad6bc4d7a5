"""Reconnect delays: exponential growth with full jitter.

Jitter keeps a fleet of clients that lost the same broker from reconnecting in lock-step; the
floor keeps a flapping link from spinning; the cap bounds how stale a client can get.
"""

from __future__ import annotations

import random


class Backoff:
    """Delays in [min_delay, min(max_delay, min_delay * 2**attempt)], drawn uniformly.

    ``min_delay`` is more than 0 (DurableClient checks its ``reconnect_min_delay`` where it is given)."""

    def __init__(self, min_delay: float, max_delay: float, rng: random.Random | None = None) -> None:
        if not max_delay >= min_delay:
            raise ValueError(
                f"reconnect_max_delay ({max_delay!r}) must be at least reconnect_min_delay ({min_delay!r})"
            )
        self.min_delay = min_delay
        self.max_delay = max_delay
        self._rng = rng or random.Random()
        self._attempt = 0

    @property
    def attempt(self) -> int:
        """Delays handed out since the last reset()."""
        return self._attempt

    def ceiling(self) -> float:
        """The upper bound of the next delay."""
        # The exponent is capped so a long outage never computes 2**huge.
        return min(self.max_delay, self.min_delay * 2.0 ** min(self._attempt, 62))

    def next_delay(self) -> float:
        delay = float(self._rng.uniform(self.min_delay, self.ceiling()))
        self._attempt += 1
        return delay

    def reset(self) -> None:
        """After a connection that got as far as a session: the next outage starts small again."""
        self._attempt = 0
