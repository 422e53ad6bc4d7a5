"""A second blind pass over docs/replication.md's user-facing promises, from the docs' words only, with
real brokers, a real etcd and paho clients: `cluster` keeps two groups apart on one etcd, a backup's
`name` is a level of its primary's `$SYS` topics and `inspect --replication` rows, and a pair whose
`loop_wait` sits at its documented bound fails over as the docs say."""

from __future__ import annotations

import ipaddress
import json
import re
import shutil
import socket
import time
from collections.abc import Callable
from typing import Any

import pytest
from test_docs_promises_ha2 import _etcd_keys
from test_docs_promises_ops import _listen_backlog
from test_ha_brokers import (
    BACKUP,
    SERVING,
    address,
    assert_queue_served,
    ha_pair,
    node,
    queue_durable_messages,
    start,
)
from test_hostile_door_limits import websocket_connack
from test_hostile_wire import wait_until

from amqtt_durable.process import HOST, free_port
from conftest import WAIT, Broker, Client, connack_code, run_cli

pytestmark = pytest.mark.timeout(90)


def test_two_clusters_on_one_etcd_each_elect_their_own_primary_under_their_own_keys(
    broker_factory: Callable[..., Broker], etcd: Any
) -> None:
    """Settings, `cluster`: "name of the group ...; its etcd keys live under `/amqtt-durable/<cluster>/`";
    `name`: "this broker's unique name in the cluster". Two groups on one etcd, each a node named `a`:
    neither is the other's backup, both serve (CONNACK 0), and each group's `leader` key names its own
    node at its own replication address."""
    timing = {"lease_ttl": 2, "loop_wait": 0.3, "demote_margin": 0.5}
    east = start(node(broker_factory, "a", coordinator=[etcd.url], cluster="east", **timing), SERVING)
    west = start(node(broker_factory, "a", coordinator=[etcd.url], cluster="west", **timing), SERVING)
    for broker, cluster in ((east, "east"), (west, "west")):
        keys = _etcd_keys(etcd, f"/amqtt-durable/{cluster}/")
        assert json.loads(keys[f"/amqtt-durable/{cluster}/leader"]) == {"name": "a", "address": address(broker)}
        assert f"/amqtt-durable/{cluster}/members/a" in keys, keys
    assert not _etcd_keys(etcd, "/amqtt-durable/amqtt-durable/")  # the default cluster is untouched
    assert connack_code(east.port) == connack_code(west.port) == SERVING


def test_a_backup_s_name_is_a_level_of_its_primary_s_sys_topics_and_of_its_inspect_row(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """Settings, `name`: "without `/`, `+`, `#` or a control character (a level of its `$SYS` topics ...)";
    Watching it: "per backup `backup/<name>/state` (`snapshot`, `catching_up`, `in_sync`), `lag_batches`"
    and the row `backup <name> (peer): in_sync, acked N, lag 0 batches / 0.0 s`. A name with dots and
    dashes is one level."""
    primary = start(node(broker_factory, "p", {"metrics_interval": 0.2}, role="primary"), SERVING)
    start(node(broker_factory, "rack-1.b", role="backup", primary=address(primary)), BACKUP)
    prefix = "$SYS/broker/durable/replication/"
    monitor = clients(primary.port, "monitor", clean_session=True)
    monitor.subscribe(prefix + "backup/+/state", 0)
    assert monitor.wait_for(lambda got: any(m.payload == b"in_sync" for m in got)), monitor.messages
    assert {m.topic for m in monitor.messages} == {prefix + "backup/rack-1.b/state"}
    shown = run_cli("inspect", "--replication", address(primary))
    assert shown.returncode == 0, shown.stderr
    row = re.compile(rf"  backup rack-1\.b \({re.escape(HOST)}:\d+\): in_sync, acked \d+, lag 0 batches / 0\.0 s")
    assert any(row.fullmatch(line) for line in shown.stdout.splitlines()), shown.stdout


@pytest.mark.slow
def test_a_pair_whose_loop_wait_is_at_its_bound_fails_over_and_loses_nothing(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], etcd: Any
) -> None:
    """Settings: `loop_wait` "at most `(lease_ttl - demote_margin) / 2`": lease_ttl 2, demote_margin 1.1,
    loop_wait 0.45 is valid, and such a pair fails over; nothing acknowledged is lost in sync mode: the
    durable session gets `session_present=1` and every queued message on the new primary. How long it
    took (at most lease_ttl + loop_wait + promotion, on an idle machine) is printed, not asserted: on a
    loaded machine promotion alone may take seconds."""
    first, second = ha_pair(broker_factory, etcd, lease_ttl=2, demote_margin=1.1, loop_wait=0.45)
    queue_durable_messages(first, clients, 40)
    first.kill()
    killed = time.monotonic()
    assert second.wait_until(lambda: connack_code(second.port) == SERVING, 2 + 0.45 + WAIT), second.log()
    print(f"failover took {time.monotonic() - killed:.2f} s (lease_ttl 2 + loop_wait 0.45 + promotion)")
    assert_queue_served(second, clients, 40)


def _listening_warning(broker: Broker) -> bool:
    return "not a loopback address, without replication.secret" in broker.log()


def test_a_replication_address_on_loopback_written_in_any_case_starts_without_the_plain_tcp_warning(
    broker_factory: Callable[..., Broker],
) -> None:
    """Securing the replication channel: "A broker whose `listen` is not a loopback address starts anyway
    but logs a WARNING naming the address when none of `secret`, `secret_file`, `secret_env` and `tls` is
    set". `LOCALHOST` is the loopback host as much as `localhost` (host names are compared "but for the
    host's case", Settings, `primary`); a host name that may resolve anywhere gets the WARNING, naming it."""
    quiet = start(node(broker_factory, "q", role="primary", listen=f"LOCALHOST:{free_port()}"), SERVING)
    assert connack_code(quiet.port) == SERVING and not _listening_warning(quiet), quiet.log()
    own = socket.gethostname()
    if not all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(own, None)):
        pytest.skip(f"this machine's name {own} does not resolve to loopback only")  # binding it would leave 127.0.0.1
    listen = f"{own}:{free_port()}"
    named = start(node(broker_factory, "n", role="primary", listen=listen), SERVING)
    assert named.wait_until(lambda: _listening_warning(named) and listen in named.log(), WAIT), named.log()


WAITING = "no primary, but this node is not caught up with the last one, nor the last primary or in its synchronous set"


def test_a_node_that_may_lack_acknowledged_publishes_waits_and_inspect_shows_why_as_documented(
    broker_factory: Callable[..., Broker], etcd: Any
) -> None:
    """After a full stop of the group: "Every other node waits, and says so once as a WARNING: `replication HA
    c: no primary, but this node is not caught up with the last one, nor the last primary or in its
    synchronous set (a, b): it may lack acknowledged publishes; not taking the lease until one of them is
    primary again (or the operator promotes a node: ...)`". Watching it: such a backup shows

        c: backup, at batch 2314
          following (nobody yet): disconnected, not caught up
          its last HA cycle: no primary, but this node is not caught up with the last one, ...

    Here a, the last primary (alone, so its synchronous set is empty), is killed, and once its lease has
    ended c starts with an empty store."""
    timing = {"coordinator": [etcd.url], "lease_ttl": 2, "loop_wait": 0.3, "demote_margin": 0.5}
    first = start(node(broker_factory, "a", **timing), SERVING)
    first.kill()
    leader = "/amqtt-durable/amqtt-durable/leader"
    assert wait_until(lambda: not _etcd_keys(etcd, leader), 2 + WAIT)  # a's lease ended: no primary
    third = start(node(broker_factory, "c", **timing), BACKUP)
    expected = f"replication HA c: {WAITING} (a): it may lack acknowledged publishes; not taking the lease until"
    assert third.wait_until(lambda: expected in third.log(), 4 * 2 + WAIT), third.log()
    (line,) = [line for line in third.log().splitlines() if expected in line]  # once
    assert " WARNING " in line and "(or the operator promotes a node: " in line, line
    shown = run_cli("inspect", "--replication", address(third))
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert re.fullmatch(r"c: backup, at batch \d+", lines[0]), lines
    assert lines[1] == "  following (nobody yet): disconnected, not caught up", lines
    assert lines[2].startswith(f"  its last HA cycle: {WAITING} (a): "), lines
    assert connack_code(third.port) == BACKUP


@pytest.mark.slow
def test_a_backup_that_followed_a_primary_whose_lease_ended_shows_its_address_and_waits(
    broker_factory: Callable[..., Broker], etcd: Any
) -> None:
    """Watching it: a backup that followed a primary whose lease has since ended shows that primary's
    address instead of `(nobody yet)` (`following ADDRESS: disconnected, not caught up`, or `connecting`
    while an attempt is under way) and keeps trying it until a node takes the lease; meanwhile it waits
    as any node that may lack acknowledged publishes. c starts empty while a's lease still runs
    (lease_ttl 6), so its first cycles follow a."""
    timing = {"coordinator": [etcd.url], "lease_ttl": 6, "loop_wait": 0.3, "demote_margin": 0.5}
    first = start(node(broker_factory, "a", **timing), SERVING)
    first.kill()
    third = start(node(broker_factory, "c", **timing), BACKUP)
    expected = re.compile(rf"  following {re.escape(address(first))}: (disconnected|connecting), not caught up")

    def shown() -> list[str]:
        return run_cli("inspect", "--replication", address(third)).stdout.splitlines()

    assert third.wait_until(lambda: any(expected.fullmatch(line) for line in shown()), WAIT), shown()
    assert wait_until(lambda: f"replication HA c: {WAITING} (a)" in third.log(), 6 + WAIT), third.log()
    lines = shown()
    assert expected.fullmatch(lines[1]) and lines[2].startswith(f"  its last HA cycle: {WAITING} (a): "), lines


def test_a_backup_refuses_websocket_clients_with_connack_3_too(broker_factory: Callable[..., Broker]) -> None:
    """ "A backup answers every MQTT CONNECT with **CONNACK 3** (server unavailable), so clients move on to the
    primary"; "The MQTT listeners are opened when the broker starts (a backup answers CONNACK 3 on them)":
    a websocket listener's CONNECT as a TCP one's; the primary's websocket listener serves (CONNACK 0)."""
    primary = node(broker_factory, "p", role="primary")
    primary.ws_port = free_port()
    start(primary, SERVING)
    backup = node(broker_factory, "b", role="backup", primary=address(primary))
    backup.ws_port = free_port()
    start(backup, BACKUP)
    assert websocket_connack(backup.ws_port, "ws-device", disconnect=False) == b"\x20\x02\x00\x03"
    assert websocket_connack(primary.ws_port, "ws-device") == b"\x20\x02\x00\x00"


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2) to read a listening socket's backlog")
def test_the_replication_address_listens_with_listen_backlog_on_a_primary_and_a_backup(
    broker_factory: Callable[..., Broker],
) -> None:
    """configuration.md, `listen_backlog`: "Connections the kernel holds for each MQTT listener, TCP and
    websocket ..., and for the replication address (`replication.listen`), until the broker accepts them";
    replication.md: the replication address is "bound once at start", on a backup too (its tools answer
    there)."""
    primary = start(node(broker_factory, "p", {"listen_backlog": 9}, role="primary"), SERVING)
    backup = start(node(broker_factory, "b", {"listen_backlog": 11}, role="backup", primary=address(primary)), BACKUP)
    for broker, backlog in ((primary, 9), (backup, 11)):
        port = int(address(broker).rsplit(":", 1)[1])
        assert _listen_backlog(port) == backlog, address(broker)
        assert _listen_backlog(broker.port) == backlog
