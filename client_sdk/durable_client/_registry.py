"""The client's subscriptions, kept so every reconnect can replay them (the broker may have none)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from ._paho import topic_matches
from .events import Listener


@dataclass(slots=True)
class Subscription:
    filter: str
    qos: int
    durable: bool
    listener: Listener | None
    confirmed: bool = False
    """The broker acknowledged it (SUBACK) on the current session: it survives a disconnect."""
    mid: int | None = None
    """The SUBSCRIBE awaiting its SUBACK."""
    answered: bool = False
    """The SUBACK of the last SUBSCRIBE sent came (granted or refused)."""
    undo_interest: bool = False
    """Made durable again while not connected: the broker's session may hold the filter as
    non-durable, made so by a connection it still counts as open (a take-over of a half-open
    link); ``interest durable: true`` goes on the next connection, before its hello."""
    interest_req: int | None = None
    """The ``interest`` request awaiting its reply, which says what the broker holds: one this
    subscription sent, or the one it replaced (_take_over)."""
    interest_due: bool = False
    """A change of durability the broker has not confirmed yet (its ``interest`` reply, or the SUBACK
    or hello reply of the connection that sends it again): subscribe() waits for it, and so does
    the delivery-log record of a change to durable: true (one to durable: false is written as sent)."""
    refused: bool = False
    """The broker refused the last change to durable: true (its ``interest`` reply) on this connection:
    it holds the filter non-durable until it applies one, so meanwhile a SUBACK writes ``durable:
    false`` and a subscribe(durable=True) sends the change again. A durable subscribe() replacing it
    keeps it, at any QoS. A connection's loss clears it and sets ``undo_interest`` instead: the next
    connection sends the change again before its hello (the broker drops the filter with the old
    connection); refused again, it is set again and the hello's replay subscribes the filter non-durable."""
    false_logged: bool = False
    """Made non-durable while a SUBSCRIBE of it waits for its SUBACK (one sent with the change, or an
    earlier one): the ``durable: false`` record was written as sent, so that SUBACK writes none."""


@dataclass(slots=True)
class StreamSubscription:
    filter: str
    listener: Listener
    window: int | None


MATCH_CACHE = 10_000


class Registry:
    """Thread-safe: the application thread changes it, the network thread reads and replays it."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        """Notified when a SUBACK or an ``interest`` reply arrives, a hello reply confirms the
        subscriptions the broker holds, a connection ends (no SUBACK or reply will come), or a
        subscription is replaced or removed."""
        self._subscriptions: dict[str, Subscription] = {}
        self._streams: dict[str, StreamSubscription] = {}
        self._unsubscribed: set[str] = set()
        self._unsubscribing: dict[int, str] = {}
        """UNSUBSCRIBEs awaiting their UNSUBACK, by mid: sent again on the next connection if it is lost first."""
        self.broker_held: set[str] | None = None
        """The filters the broker's session held at the last hello (None: not said), less those
        unsubscribed since; it may include a subscription an earlier run of this client id made:
        unsubscribe() removes it too."""
        self._matched: dict[str, list[Listener]] = {}
        """Listeners per topic seen: matching every filter for every event costs more than the rest
        of the dispatch. Dropped whenever subscriptions change, and when it grows past MATCH_CACHE."""
        self._stream_matched: dict[str, list[Listener]] = {}
        """The same for stream subscriptions."""

    # -------------------------------------------------------- subscriptions
    def get(self, topic_filter: str) -> Subscription | None:
        with self.lock:
            return self._subscriptions.get(topic_filter)

    def put(self, subscription: Subscription) -> None:
        with self.lock:
            self._matched.clear()
            self._subscriptions[subscription.filter] = subscription
            self._unsubscribed.discard(subscription.filter)
            for mid in [mid for mid, pending in self._unsubscribing.items() if pending == subscription.filter]:
                del self._unsubscribing[mid]
            self.changed.notify_all()

    def remove(self, topic_filter: str) -> Subscription | None:
        """Forget a subscription (an UNSUBSCRIBE that could not be sent goes to ``unsubscribe_later``)."""
        with self.lock:
            self._matched.clear()
            subscription = self._subscriptions.pop(topic_filter, None)
            self.changed.notify_all()
            return subscription

    def subscriptions(self) -> list[Subscription]:
        with self.lock:
            return list(self._subscriptions.values())

    def unsubscribe_later(self, topic_filter: str) -> None:
        """The UNSUBSCRIBE could not be sent: send it on the next connection."""
        with self.lock:
            self._unsubscribed.add(topic_filter)

    def unsubscribing(self, mid: int, topic_filter: str) -> None:
        """An UNSUBSCRIBE went out with ``mid``: until its UNSUBACK, a lost connection may have lost it."""
        with self.lock:
            self._unsubscribing[mid] = topic_filter

    def unsubscribed(self, mid: int) -> None:
        """The UNSUBACK of ``mid`` arrived: the broker has removed the subscription."""
        with self.lock:
            self._unsubscribing.pop(mid, None)

    def connection_lost(self) -> None:
        """UNSUBSCRIBEs without their UNSUBACK may not have reached the broker: send them again
        on the next connection (unless the filter was subscribed again meanwhile)."""
        with self.lock:
            for topic_filter in self._unsubscribing.values():
                if topic_filter not in self._subscriptions:
                    self._unsubscribed.add(topic_filter)
            self._unsubscribing.clear()

    def take_unsubscribed(self) -> list[str]:
        with self.lock:
            filters = sorted(self._unsubscribed)
            self._unsubscribed.clear()
            return filters

    def session_lost(self) -> None:
        """The broker has none of them any more."""
        with self.lock:
            for subscription in self._subscriptions.values():
                subscription.confirmed = False
                subscription.mid = None
            self._unsubscribed.clear()
            self._unsubscribing.clear()

    def subscribed(self, mid: int, ok: bool, answered: Callable[[Subscription], None]) -> None:
        """A SUBACK arrived (``ok``: granted): the subscription it answers (none if it was removed
        meanwhile) is handed to ``answered`` before a wait_answered() returns."""
        with self.lock:
            for subscription in self._subscriptions.values():
                if subscription.mid == mid:
                    subscription.mid = None
                    subscription.confirmed = ok
                    subscription.answered = True
                    if subscription.interest_req is None:  # else an interest sent after this SUBSCRIBE awaits its reply
                        subscription.interest_due = False  # sent with the SUBSCRIBE: the SUBACK confirms both
                    answered(subscription)
                    self.changed.notify_all()
                    return

    def settled(self) -> bool:
        """No SUBSCRIBE waits for its SUBACK and no UNSUBSCRIBE for its UNSUBACK."""
        with self.lock:
            return not self._unsubscribing and all(s.mid is None for s in self._subscriptions.values())

    def wait_settled(self, timeout: float) -> bool:
        """Wait until no subscription waits for its SUBACK; False when ``timeout`` ran out first."""
        with self.lock:
            return self.changed.wait_for(
                lambda: all(s.mid is None for s in self._subscriptions.values()), timeout
            )

    def wait_answered(self, topic_filter: str, timeout: float, stopped: Callable[[], bool]) -> bool:
        """Wait until the subscription of ``topic_filter`` has its SUBACK (the one of a SUBSCRIBE
        re-sent after a reconnect too) and its change of durability its confirmation, is confirmed
        without a SUBACK (the broker's session holds it),
        or is no longer this registry's (at once when it is not when called), or ``stopped()``
        (the client closes: notified); False when ``timeout`` ran out first."""
        with self.lock:
            subscription = self._subscriptions.get(topic_filter)
            return self.changed.wait_for(
                lambda: stopped()
                or subscription is None
                or self._subscriptions.get(topic_filter) is not subscription
                or (
                    subscription.mid is None
                    and not subscription.interest_due
                    and (subscription.answered or subscription.confirmed)
                ),
                timeout,
            )

    def has_stream(self, topic_filter: str) -> bool:
        with self.lock:
            return topic_filter in self._streams

    def listeners(self, topic: str) -> list[Listener]:
        with self.lock:
            found = self._matched.get(topic)
            if found is None:
                found = _remember(self._matched, topic, [
                    s.listener
                    for s in self._subscriptions.values()
                    if s.listener is not None and topic_matches(s.filter, topic)
                ])  # fmt: skip
            return found

    # -------------------------------------------------------------- streams
    def put_stream(self, stream: StreamSubscription) -> StreamSubscription | None:
        with self.lock:
            self._stream_matched.clear()
            previous = self._streams.get(stream.filter)
            self._streams[stream.filter] = stream
            return previous

    def remove_stream(self, topic_filter: str) -> StreamSubscription | None:
        with self.lock:
            self._stream_matched.clear()
            return self._streams.pop(topic_filter, None)

    def streams(self) -> list[StreamSubscription]:
        with self.lock:
            return list(self._streams.values())

    def stream_listeners(self, topic: str) -> list[Listener]:
        with self.lock:
            found = self._stream_matched.get(topic)
            if found is None:
                matching = [s.listener for s in self._streams.values() if topic_matches(s.filter, topic)]
                found = _remember(self._stream_matched, topic, matching)
            return found


def _remember(cache: dict[str, list[Listener]], topic: str, found: list[Listener]) -> list[Listener]:
    if len(cache) >= MATCH_CACHE:
        cache.clear()
    cache[topic] = found
    return found
