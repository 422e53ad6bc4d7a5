"""The members' published positions between real broker processes and a real etcd: with
several backups in async mode the most advanced one takes over, not whichever backup's HA
cycle happens to see the free lease first."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable
from typing import Any

import pytest
from test_ha_brokers import BACKUP, FAILOVER_WAIT, HA_TIMING, SERVING, address, node, start, wait_status

from amqtt_durable.process import EtcdProcess
from amqtt_durable.replication.config import ReplicationConfig
from amqtt_durable.replication.coordinator import Member
from amqtt_durable.replication.etcd import EtcdCoordinator
from conftest import WAIT, Broker, Client, connack_code, payloads, run_cli

pytestmark = pytest.mark.timeout(180)

BURST = 400


def records(etcd: EtcdProcess) -> dict[str, Member]:
    """The members' records in etcd now (the default cluster's keys)."""
    reader = EtcdCoordinator([etcd.url], prefix=ReplicationConfig(coordinator=[etcd.url], name="x").prefix, ttl=HA_TIMING["lease_ttl"])
    return {member.name: member for member in asyncio.run(reader.members())}


@pytest.mark.slow
def test_in_async_mode_the_most_advanced_backup_takes_over_and_the_other_follows_it(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], etcd: EtcdProcess
) -> None:
    ha: dict[str, Any] = {"coordinator": [etcd.url], **HA_TIMING, "mode": "async"}
    first = start(node(broker_factory, "a", **ha), SERVING)
    second = start(node(broker_factory, "b", **ha), BACKUP)
    third = start(node(broker_factory, "c", **ha), BACKUP)
    for backup in (second, third):
        wait_status(backup, lambda s: s["caught_up"])
    subscriber = clients(first.port, "device")
    subscriber.subscribe("t/#", 1)
    subscriber.disconnect()
    assert third.pid is not None
    os.kill(third.pid, signal.SIGSTOP)  # c applies nothing more, but stays caught up in its own eyes
    try:
        publisher = clients(first.port, "publisher", clean_session=True)
        publisher.publish("t/a", payloads(BURST))  # every one acknowledged (async: after a's own commit)
        publisher.disconnect()
        head = wait_status(first, lambda s: s["role"] == "primary")["batch"]
        wait_status(second, lambda s: s["batch"] >= head)
        # b's own record says so (it publishes each cycle): the state any node deciding sees
        assert first.wait_until(lambda: (r := records(etcd).get("b")) is not None and r.seq >= head, WAIT)
        behind = records(etcd).get("c")
        assert behind is None or behind.seq < head  # c's record: behind, or expired while it is paused
        first.kill()
    finally:
        os.kill(third.pid, signal.SIGCONT)  # c races b for the free lease from here on
    assert second.wait_until(lambda: connack_code(second.port) == SERVING, FAILOVER_WAIT), (
        second.log() + third.log()
    )
    assert connack_code(third.port) == BACKUP, third.log()
    resumed = clients(second.port, "device")
    assert resumed.session_present is True
    received = resumed.wait_messages(BURST)
    assert [m.payload for m in received] == payloads(BURST), "every acknowledged publish, from b"
    caught_up = wait_status(third, lambda s: s["caught_up"] and s["primary"] == address(second) and s["batch"] >= head)
    assert caught_up["role"] == "backup"
    print("c waited for b" if "further ahead" in third.log() else "b took the lease before c saw it free")
    shown = run_cli("inspect", "--replication", address(second))
    assert shown.returncode == 0, shown.stderr
    assert "b: primary" in shown.stdout and "members in the coordinator" in shown.stdout, shown.stdout
