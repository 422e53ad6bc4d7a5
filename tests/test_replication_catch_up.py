"""replication.catch_up_timeout between real broker processes: a peer that asks for a snapshot and
then reads nothing is disconnected once its connection took no byte for the timeout, while clients
get their PUBACKs and the real backup stays in sync with the same store; a real backup behind a
genuinely slow link (a rate-limited TCP relay, plain and over TLS) is caught up, never cut, even
with a timeout shorter than each of the primary's waits to write to it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import ssl
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from replication_helpers import HOST, bounded, cluster_pki, commit, started_primary
from test_ha_brokers import BACKUP, SERVING, address, node, start, status, store_rows

from amqtt_durable.replication.config import TlsConfig
from amqtt_durable.replication.framing import Frame, Hello, encode_frame
from amqtt_durable.replication.primary import BackupLink
from amqtt_durable.replication.tool import ask
from conftest import WAIT, Broker, Client, payloads
from durable_fleet.proxy import TcpRelay

pytestmark = pytest.mark.timeout(150)

BODY = 100_000
"""Bytes of each queued message: the store of ``fill`` holds megabytes in few publishes."""
STALLED = "took no byte for"
"""The primary's WARNING about a backup it disconnected for replication.catch_up_timeout."""


def fill(primary: Broker, clients: Callable[..., Client], count: int) -> None:
    """``count`` QoS 1 publishes of BODY bytes each, acknowledged and queued for a durable subscriber."""
    subscriber = clients(primary.port, "device")
    subscriber.subscribe("t/#", 1)
    subscriber.disconnect()
    publisher = clients(primary.port, "loader", clean_session=True)
    publisher.publish("t/big", [n.to_bytes(4, "big") * (BODY // 4) for n in range(count)])
    publisher.disconnect()


def stranger(
    replication_address: str, name: str, context: ssl.SSLContext | None = None, hello: Hello | None = None
) -> socket.socket:
    """A peer that sends a HELLO (``hello``, else one from an empty store: a snapshot of the store is due
    to it) and then reads nothing (with ``context``: over TLS, a broken backup with the cluster's
    certificate): its receive buffer is small, so the primary's writes soon wait on it."""
    host, port = replication_address.rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(WAIT)
    sock.connect((host, int(port)))
    if context is not None:
        sock = context.wrap_socket(sock, server_hostname=host)
    sock.sendall(encode_frame(Frame.HELLO, (hello or Hello(0, 0, 0, name)).encode()))
    return sock


def tls_context(pki: dict[str, str]) -> ssl.SSLContext:
    return TlsConfig.from_mapping({"cert": pki["node"], "ca": pki["ca"]}, "replication.tls").context(server=False)


def ask_status(primary: Broker, context: ssl.SSLContext | None) -> dict[str, Any]:
    """The primary's STATUS (over TLS with ``context``)."""
    return asyncio.run(ask(address(primary), Frame.STATUS, None, context))


def backups(primary: Broker, context: ssl.SSLContext | None) -> list[tuple[str, str, int]]:
    """The primary's backups: name, state and lag in batches."""
    return [(row["name"], row["state"], row["lag_batches"]) for row in ask_status(primary, context)["backups"]]


@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tls"])
def test_a_stranger_that_reads_none_of_its_snapshot_is_cut_at_catch_up_timeout_and_the_pair_goes_on(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], tmp_path: Path, tls: bool
) -> None:
    """Without a secret anyone who reaches the replication address can ask for a snapshot; over TLS only
    a member can, but a broken one may stop reading all the same."""
    timeout = 2.0
    pki = cluster_pki(tmp_path)
    secure: dict[str, Any] = {"tls": {"cert": pki["node"], "ca": pki["ca"]}} if tls else {}
    context = tls_context(pki) if tls else None
    primary = start(node(broker_factory, "p", role="primary", catch_up_timeout=timeout, **secure), SERVING)
    backup = start(node(broker_factory, "b", role="backup", primary=address(primary), **secure), BACKUP)
    assert primary.wait_until(lambda: backups(primary, context) == [("b", "in_sync", 0)], WAIT), primary.log()
    fill(primary, clients, 80)  # 8 MB: more than the stranger's and the primary's socket buffers take
    thief = stranger(address(primary), "thief", context)
    asked = time.monotonic()
    try:

        def snapshot_or_cut() -> bool:  # the cut may come before a STATUS that shows the snapshot
            return STALLED in primary.log() or ("thief", "snapshot") in {row[:2] for row in backups(primary, context)}

        assert primary.wait_until(snapshot_or_cut, WAIT), primary.log()
        publisher = clients(primary.port, "publisher", clean_session=True)
        publisher.publish("t/a", payloads(50, "during-"))  # sync mode: each PUBACK waited for the real backup
        assert primary.wait_until(lambda: STALLED in primary.log(), timeout + WAIT), primary.log()
        took = time.monotonic() - asked
        assert timeout <= took <= timeout + 10.0, took
        line = next(line for line in primary.log().splitlines() if STALLED in line)
        assert "WARNING" in line and f"backup thief (127.0.0.1:{thief.getsockname()[1]})" in line, line
        assert f"{STALLED} 2 s during its snapshot, " in line and "rows sent" in line, line
        assert "raise replication.catch_up_timeout" in line, line
        # It no longer counts anywhere: one backup, the real one, in sync; publishes still acknowledged.
        assert primary.wait_until(lambda: backups(primary, context) == [("b", "in_sync", 0)], WAIT), primary.log()
        level = ask_status(primary, context)["batch"]
        publisher.publish("t/a", payloads(50, "after-"))
    finally:
        thief.close()

    def level_again() -> bool:
        status = ask_status(primary, context)
        return status["batch"] > level and [row["lag_batches"] for row in status["backups"]] == [0]

    assert primary.wait_until(level_again, WAIT), primary.log()
    primary.kill()
    backup.kill()
    assert store_rows(primary) == store_rows(backup), "the backup's store is the primary's, key for key"


@pytest.mark.slow
@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tls"])
def test_a_real_backup_on_a_slow_link_is_caught_up_and_never_cut(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], tmp_path: Path, tls: bool
) -> None:
    """Once the primary's socket buffer is full (Linux takes up to 4 MiB at once), each of its waits to
    write a 4 MiB chunk to the backup lasts about 2.8 s at 1.5 MB/s, longer than catch_up_timeout
    (1.5 s), but the link takes bytes all along: only no byte at all counts. Over TLS the TLS layer's
    buffer stays level during those waits while the socket's empties."""
    timeout, rate, chunk = 1.5, 1_500_000, 4 * 1024 * 1024
    pki = cluster_pki(tmp_path)
    secure: dict[str, Any] = {"tls": {"cert": pki["node"], "ca": pki["ca"]}} if tls else {}
    context = tls_context(pki) if tls else None
    settings = {"catch_up_timeout": timeout, "snapshot_chunk_bytes": chunk, **secure}
    primary = start(node(broker_factory, "p", role="primary", **settings), SERVING)
    fill(primary, clients, 120)  # 12 MB: 3 chunks, about 8 s at the relay's rate
    host, port = address(primary).rsplit(":", 1)
    relay = TcpRelay(host, int(port), rate=rate)
    relay.start()
    try:
        began = time.monotonic()
        start(node(broker_factory, "b", role="backup", primary=relay.address, **secure), BACKUP)

        def in_sync() -> bool:
            return [row[:2] for row in backups(primary, context)] == [("b", "in_sync")]

        # fails at once when the primary cut it (it would start a new snapshot, and be cut again)
        assert primary.wait_until(lambda: in_sync() or STALLED in primary.log(), 90.0), primary.log()
        took = time.monotonic() - began
    finally:
        relay.stop()
    assert took >= 3 * timeout, f"the link was not slow: in sync after {took:.1f} s"
    log = primary.log()
    assert STALLED not in log, log
    assert log.count("): snapshot at batch") == 2, log  # one snapshot: starts, sent; never cut and begun again


def test_a_backup_that_takes_longer_than_catch_up_timeout_to_apply_a_snapshot_the_buffers_held_is_not_cut(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """The whole snapshot fits in the connection's buffers, so the primary's writes stop waiting; the
    backup (paused with SIGSTOP) then takes twice catch_up_timeout to apply it and acknowledge. Only a
    wait to write counts: it is not cut, and is in sync once it acknowledges. To have the snapshot
    written while the backup is paused, the primary is paused until the backup's HELLO is in its
    kernel (the backup says it is catching up once the HELLO is written)."""
    timeout = 1.0
    primary = start(node(broker_factory, "p", role="primary", catch_up_timeout=timeout), SERVING)
    subscriber = clients(primary.port, "device")
    subscriber.subscribe("t/#", 1)
    subscriber.disconnect()
    clients(primary.port, "loader", clean_session=True).publish("t/a", payloads(5, "small-"))  # a few KB
    backup = node(broker_factory, "b", role="backup", primary=address(primary))
    with contextlib.ExitStack() as held:
        with primary.paused():
            start(backup, BACKUP)
            assert backup.wait_until(lambda: (status(backup) or {}).get("state") == "catching_up", WAIT), backup.log()
            held.enter_context(backup.paused())
        assert primary.wait_until(lambda: re.search(r"snapshot at batch \d+ sent", primary.log()), WAIT), primary.log()
        assert not primary.wait_until(lambda: STALLED in primary.log(), 2 * timeout), primary.log()
        assert [row[:2] for row in backups(primary, None)] == [("b", "catching_up")]  # held, not in sync
    assert primary.wait_until(lambda: backups(primary, None) == [("b", "in_sync", 0)], WAIT), primary.log()
    assert STALLED not in primary.log(), primary.log()
    primary.kill()
    backup.kill()
    assert store_rows(primary) == store_rows(backup), "the backup's store is the primary's, key for key"


def _table_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.iterdir() if path.suffix in (".ldb", ".sst"))


def test_the_snapshot_a_stalled_peer_held_is_released_and_the_tables_it_pinned_leave_the_disk(tmp_path: Path) -> None:
    """What the stall cost, measured: while a peer holds a snapshot it reads nothing of, a compaction
    after 16 MB of deletes writes new tables but cannot remove the ones they replace (the snapshot's
    iterator reads them): the store's tables grow from 16 to about 25 MB. Once catch_up_timeout cut
    the peer, the next compaction removes them."""

    async def main() -> None:
        snapshot, cut = asyncio.Event(), asyncio.Event()

        def changed(link: BackupLink, what: str) -> None:
            if what.endswith(" starts"):
                snapshot.set()
            if STALLED in what:
                cut.set()

        primary = await started_primary(tmp_path / "p", catch_up_timeout=1.0, on_change=changed)
        keys = [b"big%05d" % n for n in range(160)]
        for first in range(0, len(keys), 16):
            await bounded(commit(primary, [(key, os.urandom(BODY)) for key in keys[first : first + 16]]))
        loop = asyncio.get_running_loop()

        def compact() -> None:  # the rows' range (plyvel's compact_range() without bounds compacts nothing here)
            primary.db.compact_range(start=b"big", stop=b"bih")

        thief = stranger(f"{HOST}:{primary.port}", "thief")
        try:
            await bounded(snapshot.wait())
            await bounded(commit(primary, [(key, None) for key in keys]))
            await loop.run_in_executor(None, compact)
            held = _table_bytes(tmp_path / "p")
            await bounded(cut.wait(), 1.0 + WAIT)
            assert not primary.links
            _, late = await asyncio.wait(set(primary._serving), timeout=WAIT)  # its connection's tasks ended
            assert not late
            await loop.run_in_executor(None, compact)
            released = _table_bytes(tmp_path / "p")
            assert held >= 20_000_000 and held - released >= 8_000_000, (held, released)
        finally:
            thief.close()
            await primary.close()

    asyncio.run(main())


def test_a_backup_that_stops_reading_its_catch_up_from_the_log_is_cut_naming_the_batches(tmp_path: Path) -> None:
    """A broken backup of this store (its id and a position still in the retained log, so no snapshot)
    reads none of the batches sent since: cut at catch_up_timeout, the WARNING says how far it got and
    that only retained batches were held. With ack_timeout 30 the watchdog still looks every quarter of
    catch_up_timeout: the cut comes within catch_up_timeout and a quarter of it (and 1 s of slack) of
    the primary starting to send, the moment its writes start to wait (not 7.5 s, a quarter of
    ack_timeout)."""
    timeout = 0.5

    async def main() -> None:
        cut: list[str] = []
        done = asyncio.Event()
        connected: list[float] = []

        def changed(link: BackupLink, what: str) -> None:
            if what.startswith("connected at batch"):  # said just before its first write
                connected.append(time.monotonic())
            if STALLED in what:
                cut.append(what)
                done.set()

        primary = await started_primary(
            tmp_path / "p", log_max_bytes=64 << 20, ack_timeout=30.0, catch_up_timeout=timeout, on_change=changed
        )
        for n in range(1, 81):
            await bounded(commit(primary, [(b"big%05d" % n, os.urandom(BODY))]))
        crc = primary.log.crc_of(1)
        assert crc is not None
        host_port = f"{HOST}:{primary.port}"
        sock = await asyncio.to_thread(stranger, host_port, "broken", None, Hello(primary.store_id, 1, crc, "broken"))
        try:
            await bounded(done.wait(), timeout + WAIT)
            took = time.monotonic() - connected[0]
            assert not primary.links
        finally:
            sock.close()
            await primary.close()
        assert len(cut) == 1 and " during its catch-up, batch " in cut[0], cut
        sent = int(cut[0].split(" during its catch-up, batch ")[1].split(" ")[0])
        assert 1 < sent < 80 and ", 1 acknowledged;" in cut[0], cut  # its HELLO said batch 1
        assert "what was held for it (retained batches) is released" in cut[0], cut
        assert len(connected) == 1 and timeout <= took <= timeout + timeout / 4 + 1.0, took

    asyncio.run(main())
