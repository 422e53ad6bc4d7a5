"""MQTT-3.1.2-24 for connections read by amqtt's own reader loop: a client that sends nothing for
1.5 keep-alive periods is gone. amqtt 0.12.1 waits for each fixed header ``keep_alive`` seconds,
then calls a ``handle_read_timeout`` that does nothing and waits again, so with a topic plugin
loaded (or on a websocket listener) a silent or half-open client held its connection for ever.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


class SilenceWatch:
    """Calls ``on_silence`` once, when nothing was heard for ``limit`` seconds (``heard`` is called
    for every chunk of bytes received, whole packets or not). One timer, re-armed from the last
    time heard when it fires: no work per chunk beyond reading the clock."""

    def __init__(self, limit: float, on_silence: Callable[[], None]) -> None:
        self.limit = limit
        self._on_silence = on_silence
        self._last = time.monotonic()
        self._timer: asyncio.TimerHandle | None = None

    def heard(self) -> None:
        self._last = time.monotonic()

    def start(self) -> None:
        self._last = time.monotonic()
        self._arm(self.limit)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm(self, delay: float) -> None:
        self._timer = asyncio.get_running_loop().call_later(delay, self._check)

    def _check(self) -> None:
        left = self._last + self.limit - time.monotonic()
        if left > 0:
            self._arm(left)
            return
        self._timer = None
        self._on_silence()
