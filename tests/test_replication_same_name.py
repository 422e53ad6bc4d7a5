"""Two backups under one replication.name (a broker-c.yaml copied from broker-b.yaml, its name left
as it was), as real broker processes on one primary: the second is refused, says why, and joins
once the name is free; the sync acknowledgement never counts one of them for both."""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from replication_helpers import HOST, bounded, commit, in_sync, new_backup, ops_for, started_primary
from test_ha_brokers import BACKUP, HA_TIMING, SERVING, address, node, start, status, wait_status

from amqtt_durable.process import free_port
from amqtt_durable.replication.config import ReplicationConfig
from amqtt_durable.replication.coordinator import Member
from amqtt_durable.replication.errors import MemberNameTakenError
from amqtt_durable.replication.etcd import EtcdCoordinator
from amqtt_durable.replication.framing import (
    NAME_IN_USE,
    Frame,
    Hello,
    decode_position,
    encode_frame,
    encode_seq,
    read_frame,
)
from amqtt_durable.replication.node import ReplicationNode
from amqtt_durable.replication.primary import KEEPALIVE, USER_TIMEOUT_MS, BackupLink
from amqtt_durable.store import open_store
from conftest import WAIT, Broker, Client, run_cli

pytestmark = pytest.mark.timeout(180)


def refused_twin(first: Broker, second: Broker) -> None:
    """``second`` (the later broker under ``first``'s name) was refused by the primary, and says so."""
    assert second.wait_until(lambda: "ERROR" in second.log() and "is in use" in second.log(), WAIT), second.log()


def test_a_second_backup_under_a_connected_name_is_refused_and_joins_once_the_name_is_free(
    broker_factory: Callable[..., Broker],
) -> None:
    primary = start(node(broker_factory, "p", role="primary"), SERVING)
    first = start(node(broker_factory, "b", role="backup", primary=address(primary)), BACKUP)
    [row] = wait_status(primary, lambda s: [row["state"] for row in s["backups"]] == ["in_sync"])["backups"]
    first_peer = row["peer"]
    port = address(primary).rsplit(":", 1)[1]

    def keepalive_timer() -> bool:  # shown while nothing is in flight (a retransmission timer would be)
        sockets = subprocess.run(
            ["ss", "-tnoH", "state", "established", f"( sport = :{port} )"],
            capture_output=True, text=True, timeout=WAIT, check=True,
        ).stdout  # fmt: skip
        return any(first_peer in line and "timer:(keepalive," in line for line in sockets.splitlines())

    # A backup whose machine is lost without a FIN is found dead by TCP keepalive.
    assert primary.wait_until(keepalive_timer, WAIT)
    twin = start(node(broker_factory, "b", role="backup", primary=address(primary)), BACKUP)
    refused_twin(first, twin)
    # replication.md, One name, one backup: "logs an ERROR, `channel to HOST:PORT refused for its name ...`";
    # "`inspect --replication` on it shows `disconnected, not caught up`"
    refused_line = f"channel to {address(primary)} refused for its name"
    assert any(" ERROR " in line for line in twin.log().splitlines() if refused_line in line), twin.log()

    def shown_refused() -> bool:
        return "disconnected, not caught up" in run_cli("inspect", "--replication", address(twin)).stdout

    assert twin.wait_until(shown_refused, WAIT), run_cli("inspect", "--replication", address(twin)).stdout

    def named_lines() -> list[str]:
        return [line for line in primary.log().splitlines() if "ERROR" in line and "backup name b" in line]

    assert primary.wait_until(lambda: bool(named_lines()), WAIT), primary.log()
    log, named = primary.log(), named_lines()
    assert first_peer in named[0] and "refused" in named[0]
    # docs/replication.md, One name, one backup: the primary's ERROR line as quoted there
    assert f"the name b is in use by the backup connected from {first_peer}, another broker process" in named[0]
    rows = wait_status(primary, lambda s: len(s["backups"]) == 1)["backups"]
    assert [(row["name"], row["state"]) for row in rows] == [("b", "in_sync")]
    # Between its tries the twin is briefly connecting or catching up: its refusal is what holds.
    refused = wait_status(twin, lambda s: f"{NAME_IN_USE} {first_peer}" in s.get("refused_by_primary", ""))
    assert not refused["caught_up"] and refused["state"] != "in_sync"
    assert "disconnected" not in [line for line in log.splitlines() if "backup b" in line][-1]

    first.stop()  # the name is free: the twin, retrying, joins
    accepted = "accepted by the primary: its name is free again"  # an INFO, replication.md says
    assert twin.wait_until(lambda: accepted in twin.log(), 5 + WAIT), twin.log()
    assert any(" INFO " in line for line in twin.log().splitlines() if accepted in line), twin.log()
    wait_status(twin, lambda s: s["caught_up"])
    rows = wait_status(primary, lambda s: [r["state"] for r in s["backups"]] == ["in_sync"])["backups"]
    assert rows[0]["peer"] != first_peer


def test_sync_acknowledgement_waits_for_the_backup_under_the_name_not_its_twin(
    broker_factory: Callable[..., Broker], etcd: Any
) -> None:
    """With a coordinator in sync mode the primary's synchronous set is of names: two backups under
    one name were one entry, and a publish was acknowledged once either of them had it."""
    ha = {"coordinator": [etcd.url], **HA_TIMING, "ack_timeout": 60}
    primary = start(node(broker_factory, "a", **ha), SERVING)
    first = start(node(broker_factory, "b", **ha), BACKUP)
    wait_status(first, lambda s: s["caught_up"])
    twin = start(node(broker_factory, "b", **ha), BACKUP)
    clash = "another broker publishes its position under this node's name, b, at " + address(first)
    assert twin.wait_until(lambda: clash in twin.log() or len((status(primary) or {}).get("backups", [])) == 2, WAIT), (
        twin.log()
    )
    subscriber = Client(primary.port, "device")  # a durable session: each publish to it is stored
    subscriber.subscribe("t/#", 1)
    subscriber.disconnect()
    publisher = Client(primary.port, "publisher", clean_session=True)
    try:
        with first.paused():  # the backup that connected first under "b" confirms nothing
            info = publisher.paho.publish("t/x", b"stored on two machines?", qos=1)
            acked = threading.Event()
            info_waiter = threading.Thread(target=lambda: (info.wait_for_publish(10), acked.set()), daemon=True)
            info_waiter.start()
            assert not acked.wait(5), "PUBACK while the backup b that was in sync first had not confirmed"
        assert acked.wait(WAIT) and info.is_published()
    finally:
        publisher.disconnect()
    assert [(row["name"], row["state"]) for row in status(primary)["backups"]] == [("b", "in_sync")]
    assert next(line for line in twin.log().splitlines() if clash in line).split()[2] == "ERROR"
    first.stop()  # a clean stop withdraws its record: the twin publishes its own, follows and catches up
    wait_status(twin, lambda s: s["caught_up"])
    assert [m["name"] for m in wait_status(primary, lambda s: len(s["members"]) == 2)["members"]] == ["a", "b"]


def test_a_members_record_is_one_brokers_under_its_name(etcd: Any) -> None:
    """members/<name> in etcd: another broker's record under that name (another address) is left as
    it is and named in MemberNameTakenError; this node's from before it restarted (its address) is
    taken over at once."""

    async def main() -> None:
        first, twin, restarted, reader = (
            EtcdCoordinator([etcd.url], prefix="/amqtt-durable/t/", ttl=5, timeout=1.0) for _ in range(4)
        )
        mine = Member("b", "backup", 9, 100, True, "127.0.0.1:7001")
        await first.publish_member(mine)
        with pytest.raises(MemberNameTakenError) as taken:
            await twin.publish_member(Member("b", "backup", 9, 5, False, "127.0.0.1:7002"))
        assert taken.value.holder == mine and "127.0.0.1:7001" in str(taken.value)
        await first.publish_member(mine)  # still its own: renewed and rewritten
        assert await reader.members() == [mine]
        again = Member("b", "backup", 9, 101, True, "127.0.0.1:7001")
        await restarted.publish_member(again)  # the same address, a new process: its old record taken over
        assert await reader.members() == [again]
        await first.withdraw_member()  # the old process's lease no longer holds the record
        assert await reader.members() == [again]

    asyncio.run(asyncio.wait_for(main(), 30))


def test_two_unnamed_backups_are_one_name_backup_and_the_second_is_refused(
    broker_factory: Callable[..., Broker],
) -> None:
    """docs/replication.md, `name`: a backup without one is `backup`; a second one is refused as a
    second backup under any connected name is."""
    primary = start(node(broker_factory, "p", role="primary"), SERVING)

    def unnamed() -> Broker:  # node()'s broker without replication.name
        replication = {"listen": f"{HOST}:{free_port()}", "role": "backup", "primary": address(primary)}
        return broker_factory(start=False, name="u", replication=replication)

    first = start(unnamed(), BACKUP)
    rows = wait_status(primary, lambda s: [row["state"] for row in s["backups"]] == ["in_sync"])["backups"]
    assert rows[0]["name"] == "backup"
    second = start(unnamed(), BACKUP)
    refused_twin(first, second)
    assert "refused backup name backup from" in primary.log()
    shown = run_cli("inspect", "--replication", address(second))
    assert shown.returncode == 0 and "is in use by the backup connected from" in shown.stdout, shown
    assert [row["name"] for row in status(primary)["backups"]] == ["backup"]


async def hello(port: int, name: str, instance: int) -> tuple[asyncio.StreamWriter, Frame, bytes]:
    """A backup's connection as a HELLO from ``name``/``instance`` at batch 0; the primary's first answer."""
    reader, writer = await asyncio.open_connection(HOST, port)
    writer.write(encode_frame(Frame.HELLO, Hello(0, 0, 0, name, instance=instance).encode()))
    kind, payload = await bounded(read_frame(reader))
    return writer, kind, payload


def test_a_reconnect_of_the_same_backup_replaces_its_old_connection_another_instance_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A backup whose old connection the primary has not seen end (half-dead TCP) reconnects: the
    same broker process (its HELLO's instance) takes the name over at once, never locked out; a
    HELLO under that name from another process gets an ERROR frame, logged once a minute."""

    async def scenario() -> None:
        primary = await started_primary(tmp_path / "p")
        backup = new_backup(tmp_path, "b")
        old = asyncio.create_task(backup.run(HOST, primary.port))  # one connection, not retried
        await bounded(backup.in_sync_event.wait())
        [row] = primary.status()
        for _ in range(2):
            writer, kind, payload = await hello(primary.port, "b", backup.instance + 1)
            assert kind == Frame.ERROR and NAME_IN_USE in payload.decode(), payload
            assert f"{NAME_IN_USE} {row['peer']}" in payload.decode()
            writer.close()
        assert [r["peer"] for r in primary.status()] == [row["peer"]] and not old.done()

        writer, kind, _ = await hello(primary.port, "b", backup.instance)
        assert kind == Frame.SNAP_BEGIN  # store 0 at batch 0: served, not refused
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            await bounded(old)  # the old connection was closed by the primary
        [again] = primary.status()
        assert again["name"] == "b" and again["peer"] != row["peer"]
        writer.close()
        await primary.close()
        backup.db.close()
        primary.db.close()

    with caplog.at_level(logging.INFO, logger="amqtt_durable.replication"):
        asyncio.run(scenario())
    refusals = [r for r in caplog.records if r.levelno == logging.ERROR and "refused backup name b" in r.message]
    assert len(refusals) == 1, [r.message for r in refusals]  # the second within a minute: counted, not logged
    assert any("replaced by its new connection" in r.message for r in caplog.records)


def test_a_backup_that_takes_nothing_is_dropped_by_the_ack_watchdog_and_its_name_is_free(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A backup in sync that stops reading (its machine lost with batches in flight: keepalive
    never probes such a connection) is aborted after ack_timeout, not closed (a close waits for a
    write buffer that never empties), and dropped at once: a backup under its name is served
    within the bound, every commit waiting for it completes, and the drop is logged once. Its
    connection carries TCP keepalive and, in sync, TCP_USER_TIMEOUT (read back)."""

    async def scenario() -> None:
        dropped = asyncio.Event()

        def changed(link: BackupLink, what: str) -> None:
            if what.startswith("no ack for"):
                dropped.set()

        primary = await started_primary(tmp_path / "p", log_max_bytes=256 << 20, ack_timeout=2.0, on_change=changed)
        await bounded(commit(primary, ops_for(1)))  # no backup: acknowledged at once
        head = (primary.store_id, 1, primary.log.crc_of(1) or 0)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills after a few KiB
        sock.connect((HOST, primary.port))
        reader, stalled = await asyncio.open_connection(sock=sock)
        stalled.write(encode_frame(Frame.HELLO, Hello(*head, "b", instance=7).encode()))
        kind, _ = await bounded(read_frame(reader))
        assert kind == Frame.IN_SYNC
        [link] = primary.links.values()
        served = link.writer.get_extra_info("socket") if link.writer is not None else None
        assert served is not None
        assert served.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        options = [
            served.getsockopt(socket.IPPROTO_TCP, getattr(socket, o))
            for o in ("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT")
        ]
        assert options == list(KEEPALIVE)
        assert served.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == USER_TIMEOUT_MS == 25_000
        # Nothing outstanding yet (the watchdog cannot have fired): the name is the stalled backup's.
        writer, kind, _ = await hello(primary.port, "b", 8)
        assert kind == Frame.ERROR
        writer.close()
        commits = [  # 10 MiB the peer never reads: past the kernel's buffers, the primary's write buffer stays full
            commit(primary, [(b"big" + n.to_bytes(8, "big"), secrets.token_bytes(256 * 1024))]) for n in range(2, 42)
        ]
        assert link.writer is not None and link.writer.transport.get_write_buffer_size() > 0
        await bounded(dropped.wait(), 8.0)  # ack_timeout 2 s, checked every 0.5 s
        assert not primary.links  # dropped in the same loop pass, not once its buffer drains
        await bounded(asyncio.gather(*commits))  # no longer waited for: every commit completes
        writer, kind, _ = await hello(primary.port, "b", 8)
        assert kind != Frame.ERROR, kind  # the name is free: the replacement is served
        writer.close()
        stalled.close()
        await primary.close()
        primary.db.close()

    with caplog.at_level(logging.INFO, logger="amqtt_durable.replication"):
        asyncio.run(scenario())
    stalled_peer = next(r.message for r in caplog.records if "no ack for" in r.message).split("(")[1].split(")")[0]
    ends = [r.message for r in caplog.records if stalled_peer in r.message and "disconnected" in r.message]
    assert len(ends) == 1 and "no ack for 2 s" in ends[0], ends  # not also "the backup closed the channel"


def test_tcp_user_timeout_is_set_only_once_a_backup_is_in_sync(tmp_path: Path) -> None:
    """A slow backup may keep its window closed for long while it applies a queue of snapshot
    chunks: TCP_USER_TIMEOUT would cut its snapshot, again and again. It is 0 (the kernel's
    default) during the snapshot, 25 s once the backup is in sync; keepalive from the HELLO on."""
    seen: dict[str, tuple[int, int]] = {}

    def changed(link: BackupLink, what: str) -> None:
        sock = link.writer.get_extra_info("socket") if link.writer is not None else None
        for event in ("snapshot at batch", "in sync at batch"):
            if what.startswith(event) and sock is not None and event not in seen:
                keepalive = sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
                seen[event] = (keepalive, sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT))

    async def scenario() -> None:
        primary = await started_primary(tmp_path / "p", on_change=changed)
        await bounded(commit(primary, ops_for(50)))
        backup = new_backup(tmp_path, "b")
        async with in_sync(primary.port, backup):
            assert backup.snapshots == 1
        await primary.close()
        backup.db.close()
        primary.db.close()

    asyncio.run(scenario())
    assert seen == {"snapshot at batch": (1, 0), "in sync at batch": (1, USER_TIMEOUT_MS)}


def test_a_nodes_backup_hello_carries_the_instance_mark(tmp_path: Path) -> None:
    """ReplicationNode's backups (one per term, ``_new_backup``) send its instance with the top
    byte 0xFF whatever random value the node drew: an earlier version's primary then refuses the
    HELLO rather than take the instance for part of the name (it did 1 time in 111 unmarked)."""
    hellos: list[Hello] = []

    async def primary(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hellos.append(Hello.decode((await read_frame(reader))[1]))
        writer.close()

    async def scenario() -> None:
        server = await asyncio.start_server(primary, HOST, 0)
        port = server.sockets[0].getsockname()[1]
        db = open_store(str(tmp_path / "b"))
        node = ReplicationNode(db, ReplicationConfig(role="backup", primary=f"{HOST}:{port}"))
        node.instance = 0x00AB_CDEF_0123_4567  # a draw whose top byte is not 0xFF
        for backup in (node.backup, node._new_backup()):
            with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
                await bounded(backup.run(HOST, port))
        server.close()
        await server.wait_closed()
        db.close()

    asyncio.run(scenario())
    assert len(hellos) == 2 and all(h.instance >> 56 == 0xFF for h in hellos), hellos
    assert hellos[1].instance == 0xFFAB_CDEF_0123_4567 and hellos[1].name == "backup"


def test_tcp_user_timeout_is_unset_again_when_an_in_sync_backup_falls_behind(tmp_path: Path) -> None:
    """An in-sync backup that fell out of the retained log gets a snapshot: TCP_USER_TIMEOUT is 0
    again from then on (until it is in sync again). Its ack of the snapshot after its ack of batch 1
    on the same connection grows: the connection goes on (no ACK-backwards check trips)."""
    seen: list[tuple[str, int]] = []
    events: list[str] = []

    def changed(link: BackupLink, what: str) -> None:
        events.append(what)
        sock = link.writer.get_extra_info("socket") if link.writer is not None else None
        for event in ("in sync at batch", "fell behind", "snapshot at batch"):
            if sock is not None and what.startswith(event):
                seen.append((event, sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)))

    async def scenario() -> None:
        primary = await started_primary(tmp_path / "p", ack_timeout=60, on_change=changed)
        await bounded(commit(primary, ops_for(1)))
        head = (primary.store_id, 1, primary.log.crc_of(1) or 0)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((HOST, primary.port))
        reader, writer = await asyncio.open_connection(sock=sock)
        writer.write(encode_frame(Frame.HELLO, Hello(*head, "b", instance=7).encode()))
        kind, _ = await bounded(read_frame(reader))
        assert kind == Frame.IN_SYNC
        writer.write(encode_frame(Frame.ACK, encode_seq(1)))
        for n in range(2, 82):  # 20 MiB it does not read yet: past the kernel buffers, 1 MiB log, 4 MiB pin
            commit(primary, [(b"big" + n.to_bytes(8, "big"), secrets.token_bytes(256 * 1024))])
        kinds: set[Frame] = set()
        while Frame.SNAP_BEGIN not in kinds:  # now it reads: the sender goes on, and finds it behind
            kinds.add((await bounded(read_frame(reader)))[0])
        kind, payload = await bounded(read_frame(reader))
        while kind != Frame.SNAP_END:  # bounded: a snapshot of 81 batches
            kind, payload = await bounded(read_frame(reader))
        snapshot_seq = decode_position(payload)[0]
        assert snapshot_seq > 1
        writer.write(encode_frame(Frame.ACK, encode_seq(snapshot_seq)))
        while (await bounded(read_frame(reader)))[0] != Frame.IN_SYNC:  # bounded: the batches after it
            pass
        writer.close()
        await primary.close()
        primary.db.close()

    asyncio.run(scenario())
    in_sync, behind, snapshot = seen[:3]
    assert in_sync == ("in sync at batch", USER_TIMEOUT_MS) and behind[0] == "fell behind", seen
    assert snapshot == ("snapshot at batch", 0), seen
    assert not [e for e in events if e.startswith("disconnected") and "after an ack of batch" in e], events


def test_a_replaced_connection_whose_snapshot_ack_arrives_with_the_new_hello_is_never_in_sync(
    tmp_path: Path,
) -> None:
    """The old connection of a backup acknowledges its snapshot in the very loop pass in which its
    reconnect's HELLO replaces it (the same broker process: the old connection is aborted): its
    sender, woken by that acknowledgement, must not mark the dead connection in sync (it did,
    without the guard in Primary._in_sync: "in sync at batch N" for a connection already ended,
    and the name's last acknowledged batch taken from it); the new connection is served."""

    async def scenario() -> None:
        events: list[tuple[str, str]] = []
        primary = await started_primary(tmp_path / "p", on_change=lambda link, what: events.append((link.peer, what)))
        for n in range(1, 4):
            await bounded(commit(primary, ops_for(n)))  # no backup: acknowledged at once
        old_reader, old = await asyncio.open_connection(HOST, primary.port)
        old.write(encode_frame(Frame.HELLO, Hello(0, 0, 0, "b", instance=7).encode()))
        kinds = []
        while not kinds or kinds[-1] != Frame.SNAP_END:
            kind, payload = await bounded(read_frame(old_reader))
            kinds.append(kind)
        assert kinds[0] == Frame.SNAP_BEGIN
        snapshot_seq = decode_position(payload)[0]
        [old_link] = primary.links.values()
        [old_served] = primary._serving  # the old connection's task
        new_reader, new = await asyncio.open_connection(HOST, primary.port)
        for _ in range(1000):  # loop passes until the primary accepted it and waits for its first frame
            if primary.gate._waiting:
                break
            await asyncio.sleep(0)
        assert primary.gate._waiting, "the new connection was not accepted"
        # The old connection's ACK of the snapshot and the new one's HELLO reach the primary together.
        old.write(encode_frame(Frame.ACK, encode_seq(snapshot_seq)))
        new.write(encode_frame(Frame.HELLO, Hello(0, 0, 0, "b", instance=7).encode()))
        kind, _ = await bounded(read_frame(new_reader))
        assert kind == Frame.SNAP_BEGIN  # the reconnect is served
        assert any(peer == old_link.peer and what.startswith("replaced by its new connection") for peer, what in events)
        await bounded(asyncio.wait({old_served}))  # its sender and reader ended with it
        old_events = [what for peer, what in events if peer == old_link.peer]
        assert not any(what.startswith("in sync") for what in old_events), old_events
        assert old_link.state != "in_sync" and primary.in_sync() == []
        old.close()
        new.close()
        await primary.close()
        primary.db.close()

    asyncio.run(scenario())
