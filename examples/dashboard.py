#!/usr/bin/env python3
"""A dashboard that uses the SDK's last-value cache: replayed readings never overwrite it.

Needs a running broker with the durable plugin (``make run`` in another terminal):

    .venv/bin/python examples/dashboard.py [--host 127.0.0.1] [--port 1883] [--sensors 3] [--readings 3]

1. Each sensor sensors/<n>/temperature gets a retained reading, published by the SDK too: a
   DurableClient with durable_session=False (no session of its own) whose publish() waits for
   the PUBACK.
2. The dashboard, a DurableClient, subscribes durably to sensors/+/temperature and calls
   ready_for_events(); at the marker (on_live) its cache holds the retained readings: the
   initial values of a new subscription. It goes away with close(keep_session=True).
3. While it is away, --readings more readings per sensor are published (not retained); the
   broker queues them for the dashboard's session.
4. The dashboard comes back (a new DurableClient with the same client id, as after a
   restart): it registers on_live, subscribes with its listener and calls ready_for_events().
   The queued readings are replayed (event.replayed): the listener gets every one (e.g. for a
   history chart), the cache none: they were news while the dashboard was away. The broker's
   session still holds the subscription, so the new client does not send its SUBSCRIBE again
   (a repeated SUBSCRIBE would queue the retained readings again): no initial values come,
   and the new cache is empty at the marker, until live readings arrive.
5. After the marker, one live reading per sensor is published: live readings update the cache.

Exit code 0 when the listener got every replayed reading in order, the cache took none of
them, and the cache holds each live reading after it; otherwise 1. Every wait is bounded by
--timeout.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading

from durable_client import CacheEntry, ConnectionInfo, DurableClient, DurableClientError, Event, Marker

FILTER = "sensors/+/temperature"


def sensor_topic(n: int) -> str:
    return f"sensors/{n}/temperature"


def reading(n: int, round_: int) -> str:
    """Sensor n's reading number round_ (0: the retained seed), e.g. '21.0', '21.1', ..."""
    return f"{20 + n}.{round_}"


class Dashboard:
    """One visit of the dashboard: a DurableClient, what its listener got, the cache at the marker."""

    def __init__(self, client_id: str, host: str, port: int, timeout: float) -> None:
        self.timeout = timeout
        self.events: list[Event] = []
        self.marker: Marker | None = None
        self.events_before_marker = 0
        self.cache_at_marker: dict[str, CacheEntry] = {}
        self.info: ConnectionInfo | None = None
        self._cond = threading.Condition()
        self.client = DurableClient(client_id, host, port, on_live=self._on_live, on_connected=self._on_connected)

    def open(self) -> None:
        """Subscribe, connect, say ready; return at the marker (every replayed event is in by then)."""
        self.client.subscribe(FILTER, qos=1, listener=self._listener)
        self.client.connect(self.timeout)
        self.client.ready_for_events()
        with self._cond:
            if not self._cond.wait_for(lambda: self.marker is not None, self.timeout):
                raise TimeoutError(f"no replay marker (on_live) within {self.timeout} s after ready_for_events()")

    def _on_connected(self, info: ConnectionInfo) -> None:
        self.info = info

    def _listener(self, event: Event) -> None:
        with self._cond:
            self.events.append(event)
            self._cond.notify_all()

    def _on_live(self, marker: Marker) -> None:
        # On the network thread, after every replayed event went through the cache and the listener.
        snapshot = {topic: entry for topic in self.client.cache if (entry := self.client.cache.entry(topic))}
        with self._cond:
            self.cache_at_marker = snapshot
            self.events_before_marker = len(self.events)
            self.marker = marker
            self._cond.notify_all()

    def wait_live_events(self, count: int) -> list[Event]:
        """The events after the marker, once ``count`` of them came (or after the timeout)."""
        with self._cond:
            self._cond.wait_for(lambda: len(self.events) - self.events_before_marker >= count, self.timeout)
            return self.events[self.events_before_marker :]

    def replayed(self) -> list[Event]:
        with self._cond:
            return self.events[: self.events_before_marker]


def publish_all(
    publisher: DurableClient, messages: list[tuple[str, str]], timeout: float, retain: bool = False
) -> None:
    """Publish (topic, payload) pairs at QoS 1 in order, each acknowledged (PUBACK) within ``timeout``."""
    for topic, payload in messages:
        publisher.publish(topic, payload, qos=1, retain=retain, timeout=timeout)


def origin(entry: CacheEntry | None, events: list[Event]) -> str:
    """Which event put this cache entry there (matched by its broker sequence id)."""
    if entry is None:
        return "-"
    event = next((e for e in events if (e.epoch, e.seq) == (entry.epoch, entry.seq)), None)
    if event is None:
        return "?"
    if event.retained:
        return "retained (initial value)"
    return "replayed reading" if event.replayed else "live reading"


def print_table(title: str, entries: dict[str, CacheEntry], events: list[Event]) -> None:
    print(title)
    print(f"    {'sensor':<24} {'cached value':>12} {'seq':>5}  from")
    for topic in sorted(entries):
        entry = entries[topic]
        value = entry.value.decode(errors="replace") if entry.value is not None else f"({entry.state})"
        print(f"    {topic:<24} {value:>12} {entry.seq:>5}  {origin(entry, events)}")
    if not entries:
        print("    (empty)")


def current_cache(client: DurableClient) -> dict[str, CacheEntry]:
    return {topic: entry for topic in client.cache if (entry := client.cache.entry(topic))}


def first_visit(args: argparse.Namespace, sensors: range) -> list[str]:
    """A new durable subscription: its initial values are the retained readings. Leaves the session."""
    problems = []
    first = Dashboard(args.client_id, args.host, args.port, args.timeout)
    try:
        first.open()
        print_table(
            f"dashboard {args.client_id}: first visit, cache at the marker:", first.cache_at_marker, first.replayed()
        )
        for n in sensors:
            if first.client.cache.get(sensor_topic(n)) != reading(n, 0).encode():
                problems.append(f"first visit: the cache lacks the retained reading of {sensor_topic(n)}")
    finally:
        first.client.close(keep_session=True, timeout=args.timeout)
    print(f"dashboard {args.client_id}: away (close(keep_session=True): the broker keeps queueing for it)")
    return problems


def check_replay(back: Dashboard, away: list[tuple[str, str]]) -> list[str]:
    """The listener got every reading published while away, flagged replayed; the cache took none."""
    problems = []
    replayed = back.replayed()
    readings = [e for e in replayed if not e.retained]
    initial = [e for e in replayed if e.retained]
    marker = back.marker
    assert marker is not None
    present = int(bool(back.info and back.info.session_present))
    print(
        f"dashboard {back.client.client_id}: back (session_present={present}); marker (on_live) after "
        f"{marker.replayed} replayed events: {len(readings)} readings + {len(initial)} retained initial values"
    )
    got = [(e.topic, e.payload.decode(errors="replace")) for e in readings]
    if got != away:
        problems.append(f"the listener got the replayed readings {got}, expected {away}")
    if not all(e.replayed for e in replayed):
        problems.append("an event before the marker was not flagged replayed")
    replayed_seqs = {(e.epoch, e.seq) for e in readings}
    took = [t for t, entry in back.cache_at_marker.items() if (entry.epoch, entry.seq) in replayed_seqs]
    if took:
        problems.append(f"the cache took replayed readings for {took}")
    in_order = ", in order" if got == away else ""
    print(f"    the listener got {len(readings)} replayed readings{in_order}; the cache took {len(took)} of them")
    print_table("    cache at the marker:", back.cache_at_marker, replayed)
    return problems


def check_live(back: Dashboard, live: list[tuple[str, str]], timeout: float) -> list[str]:
    """Each live reading reached the listener (not replayed) and is now the cached value."""
    problems = []
    live_events = back.wait_live_events(len(live))
    print(f"publisher: {len(live)} live readings; the listener got {len(live_events)}")
    for (topic, payload), event in zip(live, live_events, strict=False):
        entry = back.client.cache.entry(topic)
        if event.replayed or (event.topic, event.payload) != (topic, payload.encode()):
            problems.append(f"expected the live reading {topic} = {payload}, got {event}")
        elif entry is None or (entry.value, entry.seq) != (payload.encode(), event.seq):
            problems.append(f"the cache did not take the live reading {topic} = {payload} (it holds {entry})")
    if len(live_events) < len(live):
        problems.append(f"only {len(live_events)} of {len(live)} live readings arrived within {timeout} s")
    print_table("    cache after the live readings:", current_cache(back.client), back.events)
    return problems


def run(args: argparse.Namespace) -> list[str]:
    """The walk-through above; returns the failed checks (none: OK)."""
    sensors = range(1, args.sensors + 1)
    topics = [sensor_topic(n) for n in sensors]

    # Start from a clean slate: end any session an earlier run left behind.
    wipe = DurableClient(args.client_id, args.host, args.port)
    wipe.connect(args.timeout)
    wipe.close(keep_session=False, timeout=args.timeout)

    # The thermometers: a stateless DurableClient (no session of its own) that only publishes.
    publisher = DurableClient(f"thermometers-{os.getpid()}", args.host, args.port, durable_session=False)
    publisher.connect(args.timeout)
    try:
        publish_all(publisher, [(sensor_topic(n), reading(n, 0)) for n in sensors], args.timeout, retain=True)
        print(f"publisher: retained readings for {args.sensors} sensors ({topics[0]} = {reading(1, 0)}, ...)")
        problems = first_visit(args, sensors)

        away = [(sensor_topic(n), reading(n, r)) for r in range(1, args.readings + 1) for n in sensors]
        publish_all(publisher, away, args.timeout)
        print(f"publisher: {len(away)} readings ({args.readings} per sensor) while the dashboard was away")

        # Second visit: a new client object (as after a restart), the same client id.
        back = Dashboard(args.client_id, args.host, args.port, args.timeout)
        try:
            back.open()
            problems += check_replay(back, away)
            live = [(sensor_topic(n), reading(n, args.readings + 1)) for n in sensors]
            publish_all(publisher, live, args.timeout)
            problems += check_live(back, live, args.timeout)
            back.client.close(keep_session=False, timeout=args.timeout)  # done: the broker drops the session
        finally:
            back.client.close(keep_session=True, timeout=args.timeout)  # a no-op when closed already
        # Leave no retained readings behind (an empty retained publish deletes one).
        publish_all(publisher, [(topic, "") for topic in topics], args.timeout, retain=True)
    finally:
        publisher.close(timeout=args.timeout)
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=1883)
    parser.add_argument("--client-id", default="dashboard-1")
    parser.add_argument("--sensors", type=int, default=3, help="sensors (default 3)")
    parser.add_argument("--readings", type=int, default=3, help="readings per sensor while away (default 3)")
    parser.add_argument("--timeout", type=float, default=10.0, help="bound of every wait, seconds (default 10)")
    args = parser.parse_args()
    if args.sensors < 1 or args.readings < 1:
        parser.error("--sensors and --readings must be 1 or more")
    logging.basicConfig(level=logging.ERROR, format="%(name)s: %(message)s")
    try:
        problems = run(args)
    except (OSError, TimeoutError, DurableClientError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    if problems:
        print("FAILED")
        return 1
    print("OK: replayed readings reached the listener only; live readings updated the cache")
    return 0


if __name__ == "__main__":
    sys.exit(main())
