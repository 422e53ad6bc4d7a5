"""``replication.allow_from`` between real broker processes (issue 12, securing the replication
channel): the gate's 64 places for connections in their handshake could be held by anyone with
enough addresses (8 each), keeping a backup and the tools out for ``handshake_timeout`` at a
time. With allow_from, a connection from an address outside it is closed at accept and takes no
place. On Linux all of 127.0.0.0/8 is loopback: the flood comes from 127.0.0.3 and up, the backup
and the tools from 127.0.0.1."""

from __future__ import annotations

import re
import shutil
import socket
import time
from collections.abc import Callable

import pytest
from test_docs_promises_ops import _listen_backlog
from test_ha_brokers import BACKUP, SERVING, address, node, queue_durable_messages, start, status, wait_status

from amqtt_durable.replication.gate import LOG_EVERY, LOG_HOSTS, TOTAL
from conftest import WAIT, Broker, Client, run_cli

pytestmark = pytest.mark.timeout(180)

FLOOD_HOSTS = [f"127.0.0.{n}" for n in range(3, 3 + LOG_HOSTS + 4)]
"""More addresses than the log names in an interval, none in allow_from."""
EACH = 6
"""Connections from each: under the 8 an address may hold, 120 in all, over the 64 of the gate."""
FLOOD = len(FLOOD_HOSTS) * EACH
NOT_ALLOWED = "not in replication.allow_from"


def flood(replication_address: str) -> list[socket.socket]:
    """``EACH`` silent connections from every address of ``FLOOD_HOSTS``, left open."""
    host, port = replication_address.rsplit(":", 1)
    return [
        socket.create_connection((host, int(port)), timeout=WAIT, source_address=(source, 0))
        for source in FLOOD_HOSTS
        for _ in range(EACH)
    ]


def closed_by_node(sock: socket.socket) -> bool:
    """Whether the node closed ``sock`` (within the socket's timeout, WAIT)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_without_allow_from_a_flood_from_many_addresses_keeps_the_tools_out(
    broker_factory: Callable[..., Broker],
) -> None:
    """The gap allow_from closes (passes before and after it): 64 silent connections from 11
    addresses hold every place of the gate, and the tools' STATUS from another address is closed at once."""
    primary = start(node(broker_factory, "p", role="primary", handshake_timeout=60), SERVING)
    peers = flood(address(primary))
    try:
        assert all(closed_by_node(sock) for sock in peers[TOTAL:]), "the surplus is closed at once"
        assert status(primary) is None, "the tools cannot get in while the flood lasts"
    finally:
        for sock in peers:
            sock.close()


def test_a_flood_from_addresses_outside_allow_from_takes_no_place_and_a_backup_catches_up(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    settings = {"handshake_timeout": 60, "allow_from": ["127.0.0.1/32", "::1"]}
    primary = start(node(broker_factory, "p", role="primary", **settings), SERVING)
    queue_durable_messages(primary, clients, 100)
    began = time.monotonic()
    peers = flood(address(primary))
    try:
        assert all(closed_by_node(sock) for sock in peers), "every one is closed at accept"
        spans = {"p": time.monotonic() - began}  # every admit of the flood happened within it
        backup = start(node(broker_factory, "b", role="backup", primary=address(primary), **settings), BACKUP)
        began = time.monotonic()
        more = flood(address(backup))  # a backup's tools' listener: the same
        peers += more
        assert all(closed_by_node(sock) for sock in more)
        spans["b"] = time.monotonic() - began
        caught_up = wait_status(backup, lambda s: s["caught_up"])
        shown = wait_status(primary, lambda s: bool(s["backups"]) and s["backups"][0]["state"] == "in_sync")
        assert shown["backups"][0]["name"] == "b" and caught_up["batch"] == shown["batch"] > 0
        assert shown["refused"] == caught_up["refused"] == FLOOD
        inspected = run_cli("inspect", "--replication", address(primary))
        assert f"connections refused on its replication address since start: {FLOOD}" in inspected.stdout
    finally:
        for sock in peers:
            sock.close()
    backup.stop()  # a stop sums up what the interval's lines did not name
    primary.stop()
    for broker, span in ((primary, spans["p"]), (backup, spans["b"])):
        lines = broker.log().splitlines()
        named = [line for line in lines if NOT_ALLOWED in line]
        summed = [int(m[1]) for line in lines if (m := re.search(r"(\d+) more not in allow_from", line))]
        assert "refused a connection from 127.0.0.3 at once" in named[0]
        assert len(named) + sum(summed) == FLOOD, (named, summed)  # each one named or summed, once
        intervals = 1 + int(span // LOG_EVERY)  # the gate's intervals the flood can touch (1 but under a stall)
        assert LOG_HOSTS <= len(named) <= LOG_HOSTS * intervals and 1 <= len(summed) <= intervals, (named, summed)


def test_a_bad_allow_from_stops_the_broker_naming_the_key_and_the_entry(broker_factory: Callable[..., Broker]) -> None:
    broker = node(broker_factory, "p", role="primary", allow_from=["10.0.0.2", "10.0.1.1/24"])
    broker.write_config()
    result = run_cli("broker", "-c", str(broker.config_path))
    assert result.returncode == 2, result.stderr
    assert "'replication.allow_from': '10.0.1.1/24' has host bits set" in result.stderr


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2) to read a listening socket's backlog")
def test_the_replication_address_listens_with_the_plugins_listen_backlog(broker_factory: Callable[..., Broker]) -> None:
    """Review of allow_from, finding 1: both replication listeners (a primary's, a backup's for the
    tools) had asyncio's backlog of 100: past 100 connections not yet accepted, even ones
    allow_from closes at accept, a backup's or a tool's SYN was dropped and retried 1 s later. They
    now take ``listen_backlog``, as the MQTT listeners do."""
    plugin = {"listen_backlog": 7}
    primary = start(node(broker_factory, "p", plugin, role="primary"), SERVING)
    backup = start(node(broker_factory, "b", plugin, role="backup", primary=address(primary)), BACKUP)
    for broker in (primary, backup):
        assert _listen_backlog(int(address(broker).rsplit(":", 1)[1])) == 7, address(broker)
