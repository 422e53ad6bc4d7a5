"""The members' published positions between real broker processes and a real etcd: with
several backups in async mode the most advanced one takes over, not whichever backup's HA
cycle happens to see the free lease first."""

from __future__ import annotations

import asyncio
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


def reader(etcd: EtcdProcess) -> EtcdCoordinator:
    """The default cluster's keys in etcd, as the brokers see them."""
    prefix = ReplicationConfig(coordinator=[etcd.url], name="test").prefix
    return EtcdCoordinator([etcd.url], prefix=prefix, ttl=HA_TIMING["lease_ttl"])


def records(etcd: EtcdProcess) -> dict[str, Member]:
    """The members' records in etcd now."""
    return {member.name: member for member in asyncio.run(reader(etcd).members())}


def lease_holder(etcd: EtcdProcess) -> str | None:
    leader = asyncio.run(reader(etcd).leader())
    return None if leader is None else leader.name


@pytest.mark.slow
def test_in_async_mode_the_most_advanced_backup_takes_over_and_the_other_follows_it(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], etcd: EtcdProcess
) -> None:
    # ack_timeout: a primary disconnects a backup silent that long with batches outstanding
    ha: dict[str, Any] = {"coordinator": [etcd.url], **HA_TIMING, "mode": "async", "ack_timeout": 1}
    first = start(node(broker_factory, "a", **ha), SERVING)
    second = start(node(broker_factory, "b", **ha), BACKUP)
    third = start(node(broker_factory, "c", **ha), BACKUP)
    for backup in (second, third):
        wait_status(backup, lambda s: s["caught_up"])
    subscriber = clients(first.port, "device")
    subscriber.subscribe("t/#", 1)
    subscriber.disconnect()
    published = payloads(BURST + 1)
    publisher = clients(first.port, "publisher", clean_session=True)
    with third.paused():  # c applies nothing more, but stays caught up in its own eyes
        publisher.publish("t/a", published[:1])  # c leaves it unacknowledged: a disconnects c
        wait_status(first, lambda s: "c" not in [b["name"] for b in s["backups"] if b["state"] == "in_sync"])
        publisher.publish("t/a", published[1:])  # every one acknowledged (async: after a's own commit) ...
        publisher.disconnect()  # ... and none of them sent to c, not even into its socket's buffer
        head = wait_status(first, lambda s: s["role"] == "primary")["batch"]
        wait_status(second, lambda s: s["batch"] >= head)
        # b's own record says so (it publishes each cycle): the state any node deciding sees
        assert first.wait_until(lambda: (r := records(etcd).get("b")) is not None and r.seq >= head, WAIT)
        behind = records(etcd).get("c")
        assert behind is None or behind.seq < head  # c's record: behind, or expired while it is paused
        first.kill()
        # c resumes once a's lease is gone: its overdue HA cycle runs at once, b's within loop_wait,
        # so c most often finds the lease free first (unless b took it already)
        assert second.wait_until(lambda: lease_holder(etcd) != "a", FAILOVER_WAIT)
    assert second.wait_until(lambda: connack_code(second.port) == SERVING, FAILOVER_WAIT), second.log() + third.log()
    assert connack_code(third.port) == BACKUP, third.log()
    resumed = clients(second.port, "device")
    assert resumed.session_present is True
    received = resumed.wait_messages(len(published))
    assert [m.payload for m in received] == published, "every acknowledged publish, from b"
    caught_up = wait_status(third, lambda s: s["caught_up"] and s["primary"] == address(second) and s["batch"] >= head)
    assert caught_up["role"] == "backup"
    print("c waited for b" if "further ahead" in third.log() else "b took the lease before c saw it free")
    shown = run_cli("inspect", "--replication", address(second))
    assert shown.returncode == 0, shown.stderr
    assert "b: primary" in shown.stdout and "members in the coordinator" in shown.stdout, shown.stdout
