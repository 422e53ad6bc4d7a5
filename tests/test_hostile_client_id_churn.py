"""An anonymous client cycling fresh client ids (clean_session=false, one subscription, DISCONNECT, expiry)
leaves nothing per client id in the broker's memory: after each round has expired, every dict,
set, list and deque held by an object of amqtt or of the plugin, and amqtt's session and
subscription tables, are as large as after the first round. (The broker's resident size still
keeps its peak: docs/operations.md, Limitations; that is the allocator, not what this counts.)
Against a real broker; a probe plugin reports the sizes. Authenticated client ids and amqtt's
session table: test_hostile_amqtt_sessions.py."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from raw_mqtt_helpers import raw_connect, raw_subscribe
from test_recovery_and_crash import EXPIRED_TOPIC

from amqtt_durable.retained_acks import REUSE_AFTER
from conftest import WAIT, Broker, Client

PROBE_PLUGIN = '''
import gc
import json
from collections import deque

from amqtt.plugins.base import BasePlugin


class ContainerSizes(BasePlugin):
    """Test plugin: a message to probe/sizes is answered on probe/sizes/report with, for every
    "module.Class.attribute" holding a dict, set, list or deque in an object of amqtt or
    amqtt_durable, the sum of their lengths; and amqtt's session and subscription tables."""

    async def on_broker_message_received(self, *, client_id, message):
        if message.topic != "probe/sizes":
            return
        gc.unfreeze()  # the broker freezes what it holds at start-up (cli.py): count that too
        gc.collect()
        sizes = {}
        largest = 0
        for obj in gc.get_objects():
            module = type(obj).__module__
            if not isinstance(module, str) or not module.startswith("amqtt"):
                continue
            for attr, value in getattr(obj, "__dict__", {}).items():
                if isinstance(value, (dict, set, list, deque)):
                    key = f"{module}.{type(obj).__qualname__}.{attr}"
                    sizes[key] = sizes.get(key, 0) + len(value)
                    if key == "amqtt_durable.retained_acks.PacketIds._back":
                        largest = max(largest, len(value))
        sizes["largest PacketIds._back"] = largest
        broker = self.context._broker_instance
        sizes["amqtt sessions"] = len(broker._sessions)
        sizes["amqtt subscriptions"] = sum(len(entries) for entries in broker._subscriptions.values())
        await self.context.broadcast_message("probe/sizes/report", json.dumps(sizes).encode())
'''
ROUND = 40
IDS_GIVEN_BACK = "amqtt_durable.retained_acks.PacketIds._back"
LARGEST_GIVEN_BACK = "largest PacketIds._back"
"""The largest of one connection's packet ids given back (the monitor's): bounded by its most in flight
(at most a round's expired events) plus REUSE_AFTER, whatever the churn; IDS_GIVEN_BACK then counts the
other connections' only, and may not grow as every other table."""


def sizes(monitor: Client) -> dict[str, int]:
    before = len(monitor.messages)
    monitor.paho.publish("probe/sizes", b"", qos=0)
    assert monitor.wait_for(lambda ms: any(m.topic == "probe/sizes/report" for m in ms[before:]))
    report: dict[str, int] = json.loads(
        next(m.payload for m in monitor.messages[before:] if m.topic == "probe/sizes/report")
    )
    report[IDS_GIVEN_BACK] = report.get(IDS_GIVEN_BACK, 0) - report[LARGEST_GIVEN_BACK]
    return report


def churn(broker: Broker, monitor: Client, round_number: int) -> None:
    """ROUND fresh client ids connect (clean_session=false), subscribe once, DISCONNECT; until
    the $SYS expired event of every one arrived."""
    client_ids = [f"churn{round_number}-{i}" for i in range(ROUND)]
    for client_id in client_ids:
        with raw_connect(broker.port, client_id, clean=False) as sock:
            assert raw_subscribe(sock, f"churn/{client_id}", 1) == 1
            sock.sendall(bytes((0xE0, 0)))
            assert sock.recv(1) == b"", "closed after DISCONNECT"
    wanted = set(client_ids)
    assert monitor.wait_for(
        lambda ms: {json.loads(m.payload)["client_id"] for m in ms if m.topic == EXPIRED_TOPIC} >= wanted, 4 * WAIT
    )


def test_expired_client_ids_leave_no_entry_in_any_table_of_amqtt_or_the_plugin(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], tmp_path: Path
) -> None:
    (tmp_path / "container_sizes_probe.py").write_text(PROBE_PLUGIN)
    broker: Broker = broker_factory(start=False, session_expiry=1)
    broker.pythonpath.append(str(tmp_path))
    broker.extra_plugins["container_sizes_probe.ContainerSizes"] = {}
    broker.start()
    monitor = clients(broker.port, "monitor", clean_session=True)
    monitor.subscribe("probe/#", 0)
    monitor.subscribe(EXPIRED_TOPIC, 1)
    churn(broker, monitor, 0)
    first = sizes(monitor)
    assert first["amqtt sessions"] == 1 and first["amqtt subscriptions"] == 2, first  # the monitor's
    for round_number in (1, 2):
        churn(broker, monitor, round_number)
        now = sizes(monitor)
        assert now[LARGEST_GIVEN_BACK] <= ROUND + REUSE_AFTER, now
        grown = {
            key: (first.get(key, 0), size)
            for key, size in now.items()
            if size > first.get(key, 0) and key != LARGEST_GIVEN_BACK
        }
        assert not grown, f"round {round_number}: grew (after round 0, now): {grown}"
