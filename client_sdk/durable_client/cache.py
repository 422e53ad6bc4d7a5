"""The last-value cache: the newest value per topic, readable while disconnected.

It follows GemFire's client cache rules (seeds/gemfire-durable-client-messaging.txt), because a
durable client receives three kinds of events that must not overwrite each other blindly:

* live events (neither ``replayed`` nor ``retained``) put the newest value per topic; an empty
  payload destroys the entry, leaving a tombstone until the next marker (for ever on a
  stateless client, which gets none);
* replayed events were queued while the client was away: listeners see them, the cache does
  not (a current value must not be overwritten by old news);
* retained events are initial values of a new subscription (GemFire's register-interest
  results): they fill an empty or invalidated entry, never a valid one nor a tombstone. They
  count as initial values even when also flagged replayed: that only says they were queued
  before ``ready``.

Stream events are applied like live events.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal, TypeAlias

from .events import Event

EntryState: TypeAlias = Literal["valid", "invalid", "destroyed"]


@dataclass(frozen=True, slots=True)
class CacheEntry:
    value: bytes | None
    """None unless ``state`` is ``valid``."""
    seq: int
    epoch: int
    published_at: float
    state: EntryState
    """``invalid``: cache.invalidate() cleared it; ``destroyed``: a live delete (tombstone)."""


@dataclass(slots=True)
class _Slot:
    entry: CacheEntry
    stream: bool


class LastValueCache:
    """Thread-safe: the network thread writes, any thread reads.

    ``topic in cache``, ``len(cache)`` and iteration consider topics with a value (``valid``)
    only; ``entry()`` also shows invalid entries and tombstones.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slots: dict[str, _Slot] = {}
        self._stale = True

    # ------------------------------------------------------------------ reads
    @property
    def stale(self) -> bool:
        """True while the client is not connected: values may be out of date (reads still work)."""
        return self._stale

    def get(self, topic: str, default: bytes | None = None) -> bytes | None:
        with self._lock:
            slot = self._slots.get(topic)
            if slot is None or slot.entry.state != "valid":
                return default
            return slot.entry.value

    def entry(self, topic: str) -> CacheEntry | None:
        with self._lock:
            slot = self._slots.get(topic)
            return None if slot is None else slot.entry

    def __contains__(self, topic: object) -> bool:
        with self._lock:
            slot = self._slots.get(topic) if isinstance(topic, str) else None
            return slot is not None and slot.entry.state == "valid"

    def __len__(self) -> int:
        with self._lock:
            return sum(1 for slot in self._slots.values() if slot.entry.state == "valid")

    def __iter__(self) -> Iterator[str]:
        with self._lock:
            topics = [topic for topic, slot in self._slots.items() if slot.entry.state == "valid"]
        return iter(topics)

    # ----------------------------------------------------------- application
    def invalidate(self, topic: str) -> None:
        """Drop the value but keep the entry, so the next initial (retained) value may fill it."""
        with self._lock:
            slot = self._slots.get(topic)
            if slot is not None and slot.entry.state == "valid":
                old = slot.entry
                slot.entry = CacheEntry(None, old.seq, old.epoch, old.published_at, "invalid")

    # ------------------------------------------------------- the SDK's side
    def apply(self, event: Event) -> bool:
        """Apply one event by the rules above; True when the cache changed."""
        if event.replayed and not event.retained and not event.stream:
            return False  # the common case of a replay, decided without the lock
        with self._lock:
            slot = self._slots.get(event.topic)
            if event.retained and not event.stream:
                return self._apply_initial(event, slot)
            if event.replayed and not event.stream:
                return False
            if slot is not None and _is_older(event, slot):
                return False
            state: EntryState = "destroyed" if not event.payload else "valid"
            value = event.payload if state == "valid" else None
            self._slots[event.topic] = _Slot(
                CacheEntry(value, event.seq, event.epoch, event.published_at, state), event.stream
            )
            return True

    def _apply_initial(self, event: Event, slot: _Slot | None) -> bool:
        if not event.payload:
            return False  # an empty retained message means "no value": nothing to initialise
        if slot is not None and slot.entry.state != "invalid":
            return False  # a valid value is newer than an initial one; a tombstone wins until the marker
        self._slots[event.topic] = _Slot(
            CacheEntry(event.payload, event.seq, event.epoch, event.published_at, "valid"), event.stream
        )
        return True

    def marker(self) -> None:
        """The replay is over: tombstones have done their job (blocking stale initial values)."""
        with self._lock:
            for topic in [t for t, slot in self._slots.items() if slot.entry.state == "destroyed"]:
                del self._slots[topic]

    def _set_stale(self, stale: bool) -> None:
        self._stale = stale


def _is_older(event: Event, slot: _Slot) -> bool:
    """Seqs only compare within one epoch of one source; across them arrival order decides."""
    entry = slot.entry
    return (
        event.stream == slot.stream
        and event.epoch == entry.epoch
        and event.seq > 0
        and entry.seq > 0
        and event.seq < entry.seq
    )
