"""A full stop of a coordinated group (the primary and every backup SIGKILLed, as a power cut
does), then its brokers started again, with a real etcd that kept running: a restarted node
has not been told IN_SYNC by any primary, so the group elects the way docs/replication.md
(After a full stop of the group) says: only the last primary or a member of its synchronous
set, the most advanced of those running. A primary is elected within a bounded time, the
durable subscriber gets every acknowledged publish with session_present=1, and a node that may
lack acknowledged publishes never takes the lease."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import pytest
from test_ha_brokers import (
    BACKUP,
    FAILOVER_WAIT,
    HA_TIMING,
    SERVING,
    address,
    assert_queue_served,
    ha_pair,
    node,
    queue_durable_messages,
    start,
    status,
    wait_status,
)

from amqtt_durable.process import EtcdProcess
from amqtt_durable.replication.config import ReplicationConfig
from amqtt_durable.replication.coordinator import Leader
from amqtt_durable.replication.etcd import EtcdCoordinator
from amqtt_durable.store import open_store
from conftest import WAIT, Broker, Client, connack_code, payloads, run_cli

pytestmark = pytest.mark.timeout(180)

QUEUED = 200
WAITING = "not caught up with the last one, nor the last primary"
"""The start of the WARNING of a node that waits after a full stop (docs/replication.md)."""


def coordinator(etcd: EtcdProcess) -> EtcdCoordinator:
    prefix = ReplicationConfig(coordinator=[etcd.url], name="test").prefix
    return EtcdCoordinator([etcd.url], prefix=prefix, ttl=HA_TIMING["lease_ttl"])


def lease_holder(etcd: EtcdProcess) -> str | None:
    leader = asyncio.run(coordinator(etcd).leader())
    return None if leader is None else leader.name


def sync_set(etcd: EtcdProcess) -> frozenset[str] | None:
    return asyncio.run(coordinator(etcd).sync_members())


def kill_all(*brokers: Broker) -> None:
    """SIGKILL each, the primary first: no broker is left running to publish a new synchronous set."""
    for broker in brokers:
        broker.kill()


def served_by(broker: Broker) -> bool:
    return broker.wait_until(lambda: connack_code(broker.port) == SERVING, FAILOVER_WAIT)


@pytest.mark.parametrize("etcd_too", [False, True], ids=["etcd-ran-on", "etcd-killed-too"])
def test_both_restarted_elect_a_primary_that_serves_every_acknowledged_publish(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], etcd: EtcdProcess, etcd_too: bool
) -> None:
    first, second = ha_pair(broker_factory, etcd)
    queue_durable_messages(first, clients, QUEUED)
    kill_all(first, second)
    if etcd_too:  # the power cut took etcd's machine too: it starts again on its data folder
        etcd.kill()
        etcd.start()

    restarted = time.monotonic()
    first.spawn()
    second.spawn()

    def serving() -> list[Broker]:
        return [broker for broker in (first, second) if connack_code(broker.port) == SERVING]

    elected = first.wait_until(lambda: len(serving()) > 0, FAILOVER_WAIT)
    assert elected, f"no primary elected in {FAILOVER_WAIT} s\n{first.log()}\n{second.log()}"
    [primary] = serving()
    print(f"{primary.settings['replication']['name']} elected {time.monotonic() - restarted:.1f} s after the restart")
    other = second if primary is first else first
    assert lease_holder(etcd) == primary.settings["replication"]["name"]
    assert other.wait_until(lambda: connack_code(other.port) == BACKUP, WAIT), other.log()  # may still be starting
    assert_queue_served(primary, clients, QUEUED)
    caught_up = wait_status(other, lambda s: s["caught_up"] and s["primary"] == address(primary))
    assert caught_up["role"] == "backup"


@pytest.mark.parametrize(
    "alone",
    [
        "b",  # the former backup: it was in a's synchronous set, so it holds every acknowledged publish
        "a",  # the former primary, the last to take the lease: it acknowledged every publish itself
    ],
)
def test_a_node_restarted_alone_takes_over_if_it_holds_every_acknowledged_publish_and_the_other_follows_it(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], etcd: EtcdProcess, alone: str
) -> None:
    first, second = ha_pair(broker_factory, etcd)
    queue_durable_messages(first, clients, QUEUED)
    assert sync_set(etcd) == frozenset({"b"})
    kill_all(first, second)
    restarted, other = (first, second) if alone == "a" else (second, first)

    restarted.spawn()
    assert served_by(restarted), restarted.log()
    assert lease_holder(etcd) == alone
    assert_queue_served(restarted, clients, QUEUED)
    start(other, BACKUP)
    assert wait_status(other, lambda s: s["caught_up"])["primary"] == address(restarted)


def stale_node_restarted_alone(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], etcd: EtcdProcess
) -> tuple[Broker, Broker, Broker, list[bytes]]:
    """a primary, b and c its backups; c is killed, then ``later`` publishes are acknowledged by a
    and b only; a and b are killed; c alone is started again and waits, with a WARNING, without
    the lease. Returns (a, b, c, later), a and b stopped."""
    ha: dict[str, Any] = {"coordinator": [etcd.url], **HA_TIMING}
    first, second = ha_pair(broker_factory, etcd)
    third = start(node(broker_factory, "c", **ha), BACKUP)
    wait_status(third, lambda s: s["caught_up"])
    assert first.wait_until(lambda: sync_set(etcd) == frozenset({"b", "c"}), WAIT)
    queue_durable_messages(first, clients, QUEUED)
    third.kill()  # c leaves: the publishes below are acknowledged by a and b only
    assert first.wait_until(lambda: sync_set(etcd) == frozenset({"b"}), WAIT)
    later = payloads(100, "later-")
    publisher = clients(first.port, "publisher", clean_session=True)
    publisher.publish("t/a", later)
    publisher.disconnect()
    kill_all(first, second)

    third.spawn()  # c lacks the later publishes: it must not take the lease
    assert third.wait_until(lambda: WAITING in third.log(), FAILOVER_WAIT), third.log()
    assert "WARNING" in next(line for line in third.log().splitlines() if WAITING in line)
    assert lease_holder(etcd) is None and connack_code(third.port) == BACKUP, third.log()
    shown = run_cli("inspect", "--replication", address(third))
    assert shown.returncode == 0, shown.stderr
    assert f"  its last HA cycle: no primary, but this node is {WAITING}" in shown.stdout, shown.stdout
    return first, second, third, later


def test_a_node_that_may_lack_acknowledged_publishes_waits_for_one_that_holds_them(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], etcd: EtcdProcess
) -> None:
    _, second, third, later = stale_node_restarted_alone(broker_factory, clients, etcd)
    second.spawn()  # b, in the last synchronous set, holds them: it takes over, c follows it
    assert served_by(second), second.log()
    device = clients(second.port, "device")
    assert device.session_present is True
    received = device.wait_messages(QUEUED + len(later))
    assert [m.payload for m in received] == payloads(QUEUED) + later
    assert connack_code(third.port) == BACKUP
    assert wait_status(third, lambda s: s["caught_up"])["primary"] == address(second)


def test_the_operator_promotes_a_node_that_may_lack_acknowledged_publishes_and_it_serves_what_it_has(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], etcd: EtcdProcess
) -> None:
    first, _, third, _ = stale_node_restarted_alone(broker_factory, clients, etcd)
    batch = wait_status(third, lambda s: s["role"] == "backup")["batch"]
    waiting = json.loads(run_cli("inspect", "--replication", address(third), "--json").stdout)["waiting_for"]
    shown = run_cli("inspect", "--replication", address(third)).stdout.splitlines()
    assert waiting and f"  waiting for: {', '.join(waiting)}" in shown, (waiting, shown)  # Watching it
    promoted = run_cli("promote", address(third))  # a and b are lost for good: the operator's decision
    assert promoted.returncode == 0, promoted.stderr
    assert promoted.stdout.strip() == (  # replication.md's words, "When the nodes that may take over are gone"
        f"{address(third)}: the operator's decision: no primary holds the lease; this node, at batch {batch}, not "
        "known to be caught up, takes it at its next HA cycle unless another node takes it first; it serves clients "
        "as the primary once its store is loaded"
    ), promoted.stdout
    assert served_by(third), third.log()
    assert any(" WARNING " in line and "operator" in line for line in third.log().splitlines()), third.log()
    assert lease_holder(etcd) == "c"
    device = clients(third.port, "device")
    assert device.session_present is True
    assert [m.payload for m in device.wait_messages(QUEUED)] == payloads(QUEUED)  # not the later ones
    assert not device.wait_for(lambda messages: len(messages) > QUEUED, 1.0)
    refused = run_cli("promote", address(third))
    assert refused.returncode == 1 and "it is the primary already" in refused.stderr
    start(first, BACKUP)  # the old primary's later batches never reached c: it gets a snapshot
    assert wait_status(first, lambda s: s["caught_up"])["primary"] == address(third)


def test_a_primary_in_async_mode_deletes_a_synchronous_set_left_from_sync_mode_once_it_serves(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], etcd: EtcdProcess
) -> None:
    """docs/replication.md: a node in async mode deletes the synchronous set once its promotion
    succeeded (taking the lease leaves it), before its first acknowledgement."""

    async def earlier_sync_mode_period() -> None:
        era, old = coordinator(etcd), Leader("old", "127.0.0.1:1")
        assert await era.acquire(old)
        assert await era.publish_sync(old, frozenset({"b"}))
        await era.release(old)

    asyncio.run(earlier_sync_mode_period())
    assert sync_set(etcd) == frozenset({"b"})
    first, _ = ha_pair(broker_factory, etcd, mode="async")
    assert lease_holder(etcd) == "a"
    queue_durable_messages(first, clients, QUEUED)  # acknowledged: the set was deleted before
    assert sync_set(etcd) is None


def test_in_async_mode_only_the_last_primary_takes_over_after_a_full_stop(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], etcd: EtcdProcess
) -> None:
    first, second = ha_pair(broker_factory, etcd, mode="async")
    queue_durable_messages(first, clients, QUEUED)
    assert sync_set(etcd) is None  # async mode publishes no synchronous set
    kill_all(first, second)

    second.spawn()  # b cannot know what a acknowledged after b's last batch: it waits
    waiting = "not caught up with the last one, nor the last primary or in its synchronous set (a)"
    assert second.wait_until(lambda: waiting in second.log(), FAILOVER_WAIT), second.log()
    assert lease_holder(etcd) is None and connack_code(second.port) == BACKUP
    first.spawn()  # a, the last to take the lease
    assert served_by(first), first.log()
    assert_queue_served(first, clients, QUEUED)
    assert wait_status(second, lambda s: s["caught_up"])["primary"] == address(first)


def inspected(broker: Broker) -> tuple[dict[str, Any], list[str]]:
    """``inspect --replication`` of a running node: its JSON and its text lines."""
    shown = run_cli("inspect", "--replication", address(broker), "--json")
    assert shown.returncode == 0, shown.stderr
    text = run_cli("inspect", "--replication", address(broker))
    assert text.returncode == 0, text.stderr
    return json.loads(shown.stdout), text.stdout.splitlines()


def test_inspect_shows_whom_a_node_waits_for_after_a_full_stop_and_a_member_whose_promotion_failed(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], etcd: EtcdProcess
) -> None:
    """docs/replication.md, Watching it: after a full stop, a waiting node's status names the nodes it
    waits for (``waiting_for``, the text's ``waiting for:`` line), and the members' rows say which one's
    last promotion failed (``promotion_failed``): the one that holds nobody back."""
    first, second = ha_pair(broker_factory, etcd)
    queue_durable_messages(first, clients, QUEUED)
    kill_all(first, second)
    db = open_store(first.store, create=False)
    db.put(b"sbroken-device", b"\xff not a session record")  # a's store will not load: its promotions fail
    db.close()

    first.spawn()  # a, the last primary, waits up to lease_ttl for b, then tries and fails, again and again
    waiting = wait_status(first, lambda s: s.get("waiting_for") == ["b"], FAILOVER_WAIT)
    assert "waiting up to 2 s for b" in waiting["waiting"], waiting
    failed = wait_status(
        first, lambda s: [row["promotion_failed"] for row in s["members"] if row["name"] == "a"] == [True],
        FAILOVER_WAIT,
    )
    assert "broken-device" in failed["promotion_failed"], failed
    assert lease_holder(etcd) is None and connack_code(first.port) == BACKUP
    _, lines = inspected(first)
    row = next(line for line in lines if line.startswith("    a: backup, at batch "))
    assert row.endswith(", its last promotion failed"), lines
    shown: list[str] = []

    def says_waiting_for_b() -> bool:  # a cycle that waits for b, between two that try the lease
        shown[:] = run_cli("inspect", "--replication", address(first)).stdout.splitlines()
        return "  waiting for: b" in shown

    assert first.wait_until(says_waiting_for_b, FAILOVER_WAIT), shown

    second.spawn()  # b, in a's synchronous set, is not held back by a, whose promotion failed
    assert served_by(second), f"{second.log()}\n{first.log()}"
    assert lease_holder(etcd) == "b"
    assert_queue_served(second, clients, QUEUED)
    primary, lines = inspected(second)
    assert primary["role"] == "primary" and "waiting_for" not in primary
    assert all(row["promotion_failed"] is False for row in primary["members"] if row["name"] == "b"), primary


def waits_not_caught_up(broker: Broker, clients: Callable[..., Client], acknowledged: int) -> None:
    """``broker`` waits, saying it is not caught up with the last primary; the fault, that it serves
    (what it lacks of the ``acknowledged`` publishes), fails the test."""

    def decided() -> bool:
        current = status(broker)
        return connack_code(broker.port) == SERVING or (
            current is not None and "not caught up with the last one" in current.get("waiting", "")
        )

    assert broker.wait_until(decided, FAILOVER_WAIT), broker.log()
    if connack_code(broker.port) == SERVING:
        served = clients(broker.port, "device").wait_messages(acknowledged, 5.0)
        pytest.fail(f"the backup took the lease serving {len(served)} of {acknowledged} acknowledged publishes")


@pytest.mark.parametrize(
    "resumed",
    [
        "while-b-holds-the-lease",  # c follows b (never answered): it is not caught up with a new primary
        "after-b-s-lease-ended",  # c never saw b: the coordinator's last primary is not the one it followed
    ],
)
def test_a_backup_caught_up_with_an_earlier_primary_does_not_take_over_after_an_async_primary_deleted_the_set(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], etcd: EtcdProcess, resumed: str
) -> None:
    """A group part-way through a switch from sync to async mode. a (sync) acknowledges ``later`` with b only,
    after c stopped answering (frozen: its record still says caught up with a). b (already configured async)
    takes over, deletes a's synchronous set once it serves, and is killed before it acknowledged anything. c,
    running again, was never caught up with b, the last primary: it must not take the lease (it lacks
    ``later``), though no synchronous set holds it back any more; b, started again, takes over with every
    acknowledged publish."""
    ha: dict[str, Any] = {"coordinator": [etcd.url], **HA_TIMING}
    first = start(node(broker_factory, "a", **ha, ack_timeout=1), SERVING)
    second = start(node(broker_factory, "b", **ha, mode="async"), BACKUP)
    third = start(node(broker_factory, "c", **ha), BACKUP)
    for backup in (second, third):
        wait_status(backup, lambda s: s["caught_up"])
    assert first.wait_until(lambda: sync_set(etcd) == frozenset({"b", "c"}), WAIT)
    queue_durable_messages(first, clients, QUEUED)
    # More than the socket buffers between a and c hold (about 24 MiB): c gets only part of it.
    later = [b"later-%06d" % n + b"x" * 16_378 for n in range(1500)]
    with third.paused():  # c reads nothing of what follows: it still says caught up with a
        publisher = clients(first.port, "publisher", clean_session=True)
        publisher.publish("t/a", later)  # acknowledged once a dropped c (ack_timeout) and published {b}
        publisher.disconnect()
        assert sync_set(etcd) == frozenset({"b"})
        first.kill()
        assert served_by(second), second.log()
        assert second.wait_until(lambda: sync_set(etcd) is None, WAIT), second.log()  # async mode: deleted
        second.kill()  # before it acknowledged anything
        if resumed == "after-b-s-lease-ended":
            assert third.wait_until(lambda: lease_holder(etcd) is None, FAILOVER_WAIT)  # c is paused, not ended

    waits_not_caught_up(third, clients, QUEUED + len(later))
    assert lease_holder(etcd) is None, third.log()
    waiting = status(third)
    assert waiting is not None and waiting["waiting_for"] == ["b"], waiting  # the last primary, no set left
    assert waiting["caught_up"] is False, waiting  # with a, not with the last primary

    second.spawn()  # the last primary: it takes over with everything a acknowledged
    assert served_by(second), second.log()
    device = clients(second.port, "device")
    assert device.session_present is True
    assert [m.payload for m in device.wait_messages(QUEUED + len(later))] == payloads(QUEUED) + later
    assert wait_status(third, lambda s: s["caught_up"])["primary"] == address(second)


def test_a_backup_caught_up_with_an_earlier_term_of_the_last_primary_does_not_take_over(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], etcd: EtcdProcess
) -> None:
    """Review 260 (ABA, async mode): c is caught up with a's first term, then frozen through b's term
    (b acknowledges ``x``) and a's second one (a restarted, caught up with b, took over when b died and
    acknowledged ``y``); a dies. The last primary is named a again, but c's IN_SYNC came from a's first
    term: c must not take the lease without ``x`` and ``y``; a, started again, takes over with all."""
    ha = {"coordinator": [etcd.url], **HA_TIMING, "mode": "async"}
    first = start(node(broker_factory, "a", **ha), SERVING)
    second = start(node(broker_factory, "b", **ha), BACKUP)
    third = start(node(broker_factory, "c", **ha), BACKUP)
    for backup in (second, third):
        wait_status(backup, lambda s: s["caught_up"])
    queue_durable_messages(first, clients, QUEUED)
    head = status(first)["batch"]
    wait_status(third, lambda s: s["batch"] >= head)
    x = [b"x-%04d" % n for n in range(100)]
    y = [b"y-%04d" % n for n in range(100)]
    with third.paused():
        first.kill()
        assert served_by(second), second.log()
        publisher = clients(second.port, "pub-x", clean_session=True)
        publisher.publish("t/a", x)  # acknowledged by b
        publisher.disconnect()
        first.spawn()
        wait_status(first, lambda s: s["caught_up"] and s["primary"] == address(second), FAILOVER_WAIT)
        second.kill()
        assert served_by(first), first.log()  # a's second term
        publisher = clients(first.port, "pub-y", clean_session=True)
        publisher.publish("t/a", y)
        publisher.disconnect()
        first.kill()
        assert third.wait_until(lambda: lease_holder(etcd) is None, FAILOVER_WAIT)

    waits_not_caught_up(third, clients, QUEUED + len(x) + len(y))
    waiting = status(third)
    assert waiting is not None and waiting["waiting_for"] == ["a"] and waiting["caught_up"] is False, waiting
    first.spawn()  # the last primary: it takes over with everything acknowledged
    assert served_by(first), first.log()
    device = clients(first.port, "device")
    assert [m.payload for m in device.wait_messages(QUEUED + len(x) + len(y))] == payloads(QUEUED) + x + y
