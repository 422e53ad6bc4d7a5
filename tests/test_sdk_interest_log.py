"""The delivery log's record of a change of durability only (docs/delivery-log.md): written when the
broker's `interest` reply confirms it, not when it is sent. A real broker, the real SDK client, and the
fleet's fault proxy (durable_fleet.proxy.FaultProxy) stalling, then cutting, the link between the two."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import HOST, WAIT, Broker, Client, seen_away
from durable_client import DurableClient, Marker, RequestTimeout
from durable_fleet.proxy import FaultProxy

pytestmark = pytest.mark.timeout(120)


def subscribes(log: Path, topic_filter: str) -> list[dict[str, Any]]:
    """The log's `subscribe` records of ``topic_filter``, in order."""
    found = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [r for r in found if r["kind"] == "subscribe" and r["topic"] == topic_filter]


def test_a_durability_change_lost_with_its_connection_is_logged_only_once_the_reconnect_confirms_it(
    broker_factory: Callable[..., Broker], sdk: Callable[..., DurableClient], clients: Callable[..., Client],
    tmp_path: Path,
) -> None:
    """A non-durable filter made durable while the link is stalled: the `interest` is sent, the broker never
    gets it, the link is cut, so the broker drops the filter with the connection and queues nothing for a
    publish made while away. Before, its `durable: true` record was written as it was sent: the audit then
    expected that publish and reported it lost. Now no record until the reconnect sends the change again
    and the broker confirms it; subscribe() waits for that confirmation (RequestTimeout meanwhile)."""
    broker = broker_factory(metrics_interval=0.1)
    proxy = FaultProxy(HOST, broker.port)
    port = proxy.start()
    log = tmp_path / "device.jsonl"
    live = threading.Condition()
    markers: list[Marker] = []

    def on_live(marker: Marker) -> None:
        with live:
            markers.append(marker)
            live.notify_all()

    try:
        device = sdk(port, "flipper", delivery_log=log, on_live=on_live)
        device.subscribe("flip/t", qos=1, durable=False)
        device.connect(timeout=WAIT)
        device.ready_for_events()  # each connection's marker comes once its SUBACKs did
        with live:
            assert live.wait_for(lambda: len(markers) == 1, WAIT), "no marker"
        assert [r["durable"] for r in subscribes(log, "flip/t")] == [False]

        assert proxy.stall() == 1
        timed_out = False
        try:
            device.subscribe("flip/t", qos=1, durable=True, timeout=1.0)  # sent; no reply can come
        except RequestTimeout:
            timed_out = True
        assert [r["durable"] for r in subscribes(log, "flip/t")] == [False], "logged before the broker confirmed it"
        assert timed_out, "subscribe() returned without the broker's confirmation"

        assert proxy.cut() == 1
        seen_away(clients, broker, 1)  # the broker ended the connection, and the non-durable filter with it
        away = time.time()
        publisher = clients(broker.port, "flip-pub", clean_session=True)
        publisher.publish("flip/t", [b"sent while away: nothing queued it"], qos=1)
        assert [r["durable"] for r in subscribes(log, "flip/t")] == [False]

        proxy.restore()
        with live:  # after the reconnect's SUBACK, or hello reply, that confirms the change
            assert live.wait_for(lambda: len(markers) == 2, WAIT), "no reconnect"
        logged = subscribes(log, "flip/t")
        assert [r["durable"] for r in logged] == [False, True], logged
        assert logged[1]["time"] > away, (logged, away)  # the window opens after the publish made while away
    finally:
        with contextlib.suppress(Exception):
            proxy.stop()


def test_a_confirmed_durability_change_is_logged_once_at_its_reply_and_subscribe_returns_after_it(
    broker: Broker, sdk: Callable[..., DurableClient], tmp_path: Path
) -> None:
    """Without faults: one record per change, written by the time subscribe() returns (it waits for the
    `interest` reply), each with the new `durable`."""
    log = tmp_path / "device.jsonl"
    device = sdk(broker.port, "toggler", delivery_log=log)
    device.connect(timeout=WAIT)
    device.subscribe("tog/t", qos=1, timeout=WAIT)  # a new filter: returns at its SUBACK
    expected = [True]
    for durable in (False, True, False):
        device.subscribe("tog/t", qos=1, durable=durable, timeout=WAIT)
        expected.append(durable)
        assert [r["durable"] for r in subscribes(log, "tog/t")] == expected
    device.subscribe("tog/t", qos=1, durable=False, timeout=WAIT)  # no change: no record
    assert [r["durable"] for r in subscribes(log, "tog/t")] == expected


def test_a_change_to_non_durable_is_logged_as_sent_and_subscribe_still_waits_for_its_reply(
    broker: Broker, sdk: Callable[..., DurableClient], tmp_path: Path
) -> None:
    """durable=False closes the audit's window as it is sent (expecting less is safe): with the broker
    stopped (SIGSTOP) no reply can come, so subscribe() raises RequestTimeout, and the `false` record is
    in the log already. Once the broker answers, no second record."""
    log = tmp_path / "device.jsonl"
    device = sdk(broker.port, "closer", delivery_log=log)
    device.connect(timeout=WAIT)
    device.subscribe("close/t", qos=1, timeout=WAIT)
    assert [r["durable"] for r in subscribes(log, "close/t")] == [True]
    with broker.paused():
        with pytest.raises(RequestTimeout):
            device.subscribe("close/t", qos=1, durable=False, timeout=0.3)
        assert [r["durable"] for r in subscribes(log, "close/t")] == [True, False]
    device.subscribe("close/t", qos=1, timeout=WAIT)  # its reply comes after the false one's
    assert [r["durable"] for r in subscribes(log, "close/t")] == [True, False, True]
