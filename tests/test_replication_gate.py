"""Hostile or misconfigured peers of a replication address (review of the replication secret,
F2/F3/F5): how many connections wait for their handshake is bounded per address, the surplus is
closed at once and logged once per address per LOG_EVERY, and a stopping primary ends the waiting
ones at once instead of waiting for them (Python 3.12's Server.wait_closed would wait for every
one); a backup whose certificate is refused says so and retries as after any refusal."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import select
import socket
import ssl
import time
from pathlib import Path

import pytest
from replication_helpers import HOST, bounded, cluster_pki, following, new_backup, primary_store

from amqtt_durable.errors import DurableError
from amqtt_durable.process import free_port
from amqtt_durable.replication.auth import server_handshake
from amqtt_durable.replication.backup import AUTH_RETRY, Backup
from amqtt_durable.replication.config import ReplicationConfig
from amqtt_durable.replication.framing import Frame
from amqtt_durable.replication.gate import PER_HOST
from amqtt_durable.replication.node import ReplicationNode
from amqtt_durable.replication.primary import Primary
from amqtt_durable.replication.tool import ask, format_status
from amqtt_durable.settings import LISTEN_BACKLOG
from amqtt_durable.store import open_store

SECRET = b"replication-secret-of-the-gate-tests-0123456789"
SILENT = PER_HOST + 12


async def closed_by_peer(reader: asyncio.StreamReader) -> bool:
    with contextlib.suppress(ConnectionError):
        return await reader.read(1) == b""
    return True


def tls_context(paths: dict[str, str], cert: str, *, server: bool) -> ssl.SSLContext:
    tls = ReplicationConfig.from_mapping({"role": "primary", "tls": {"cert": cert, "ca": paths["ca"]}}).tls
    assert tls is not None
    return tls.context(server=server)


@pytest.mark.parametrize("with_tls", [False, True], ids=["tcp", "tls"])
def test_silent_peers_past_the_per_address_bound_are_closed_at_once_and_a_stop_ends_the_rest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, with_tls: bool
) -> None:
    """With TLS too: a peer that never sends its ClientHello waits at the gate like any other
    (asyncio's own TLS listener would have held it outside, unbounded)."""

    async def main() -> None:
        db, store_id = primary_store(tmp_path / "p")
        primary = Primary(
            db, store_id=store_id, log_max_batches=100, log_max_bytes=1 << 20, secret=SECRET, handshake_timeout=60.0
        )
        pki = cluster_pki(tmp_path)
        await primary.start(HOST, 0, tls_context(pki, pki["node"], server=True) if with_tls else None)
        peers = [await asyncio.open_connection(HOST, primary.port) for _ in range(SILENT)]
        try:
            # Each of the first PER_HOST waits for its handshake (60 s); every later one is closed now.
            ends = [asyncio.ensure_future(closed_by_peer(reader)) for reader, _ in peers]
            await bounded(asyncio.wait(ends[PER_HOST:]), 10.0)
            assert all(end.result() for end in ends[PER_HOST:])
            assert not any(end.done() for end in ends[:PER_HOST])
            assert primary.gate.turned_away == SILENT - PER_HOST
            await bounded(primary.close(), 5.0)  # not the 60 s of the handshake
            await bounded(asyncio.wait(ends[:PER_HOST]), 5.0)
            assert all(end.result() for end in ends[:PER_HOST]), "a stop closes the waiting connections"
        finally:
            for _, writer in peers:
                writer.close()
            db.close()

    with caplog.at_level(logging.WARNING, logger="amqtt_durable.replication"):
        asyncio.run(main())
    named = [r.getMessage() for r in caplog.records if f"closed a connection from {HOST} at once" in r.getMessage()]
    assert len(named) == 1, "one WARNING per address per LOG_EVERY seconds, not one per connection"
    assert f"at most {PER_HOST}" in named[0]
    summed = [r.getMessage() for r in caplog.records if "more closed at once" in r.getMessage()]
    assert len(summed) == 1 and f"{SILENT - PER_HOST - 1} more closed at once" in summed[0], "the stop sums up the rest"
    assert not [r for r in caplog.records if r.exc_info], "no traceback on the way out"


def test_a_backup_gets_in_once_the_silent_peers_have_gone(tmp_path: Path) -> None:
    async def main() -> None:
        db, store_id = primary_store(tmp_path / "p")
        primary = Primary(
            db, store_id=store_id, log_max_batches=100, log_max_bytes=1 << 20, secret=SECRET, handshake_timeout=60.0
        )
        await primary.start(HOST, 0)
        peers = [await asyncio.open_connection(HOST, primary.port) for _ in range(PER_HOST)]
        backup = new_backup(tmp_path, "b", secret=SECRET)
        try:
            for _, writer in peers:
                writer.close()
            async with following(backup, primary.port):
                await bounded(backup.in_sync_event.wait(), 20.0)
        finally:
            await primary.close()
            backup.db.close()
            db.close()

    asyncio.run(main())


@pytest.mark.parametrize("secret", [None, SECRET])
def test_a_backup_whose_certificate_the_primary_refuses_says_so_and_retries_slowly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, secret: bytes | None
) -> None:
    """TLS 1.3 tells a client that its certificate was refused only at its first read: the
    backup logged "the primary ... closed the channel" (or a hint about releases without a
    secret), retried twice a second, and stayed "connecting" between tries."""
    paths = cluster_pki(tmp_path)

    def context(cert: str, *, server: bool) -> ssl.SSLContext:
        return tls_context(paths, cert, server=server)

    async def main() -> str:
        db, store_id = primary_store(tmp_path / "p")
        primary = Primary(db, store_id=store_id, log_max_batches=100, log_max_bytes=1 << 20, secret=secret)
        await primary.start(HOST, 0, context(paths["node"], server=True))
        backup = Backup(
            open_store(str(tmp_path / "b")), name="b", secret=secret, tls=context(paths["stranger"], server=False)
        )
        try:
            async with following(backup, primary.port):
                await bounded(first_refusal.wait(), 20.0)
            return backup.state
        finally:
            await primary.close()
            backup.db.close()
            db.close()

    first_refusal = asyncio.Event()

    class Refusals(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "refused (retried in" in record.getMessage():
                first_refusal.set()

    handler = Refusals()
    logging.getLogger("amqtt_durable.replication").addHandler(handler)
    try:
        with caplog.at_level(logging.WARNING, logger="amqtt_durable.replication"):
            state = asyncio.run(main())
    finally:
        logging.getLogger("amqtt_durable.replication").removeHandler(handler)
    assert state == "disconnected"
    refusals = [r.getMessage() for r in caplog.records if "backup b: channel to" in r.getMessage()]
    assert refusals, caplog.text
    assert f"refused (retried in {AUTH_RETRY:g} s)" in refusals[0], refusals[0]
    assert "refuse this node's certificate" in refusals[0] and "replication.tls" in refusals[0], refusals[0]


def test_refused_handshakes_are_logged_once_per_address_and_reason_then_summed_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Review F2: every silent peer was one WARNING (a flood wrote megabytes of them). Three waves
    of PER_HOST silent peers, each refused after handshake_timeout: one line names the first, one
    line sums up the rest, and the gate counts them all."""
    waves = 3

    async def main() -> int:
        db, store_id = primary_store(tmp_path / "p")
        primary = Primary(
            db, store_id=store_id, log_max_batches=100, log_max_bytes=1 << 20, secret=SECRET, handshake_timeout=0.3
        )
        await primary.start(HOST, 0)
        try:
            for _ in range(waves):
                peers = [await asyncio.open_connection(HOST, primary.port) for _ in range(PER_HOST)]
                try:
                    ends = await bounded(asyncio.gather(*(closed_by_peer(reader) for reader, _ in peers)), 10.0)
                    assert all(ends)
                finally:
                    for _, writer in peers:
                        writer.close()
            return primary.gate.refused
        finally:
            await primary.close()  # sums up what was not logged yet
            db.close()

    with caplog.at_level(logging.WARNING, logger="amqtt_durable.replication"):
        refused = asyncio.run(main())
    assert refused == waves * PER_HOST
    lines = [r.getMessage() for r in caplog.records]
    named = [line for line in lines if "refused a connection from" in line]
    assert len(named) == 1 and "the handshake was not completed within 0.3 s" in named[0], lines
    summed = [line for line in lines if "more connection(s)" in line]
    assert len(summed) == 1 and f"{waves * PER_HOST - 1} more connection(s) refused" in summed[0], lines


def test_a_promotion_closes_an_idle_peer_of_the_tools_listener_at_once_and_status_counts_refusals(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Review F3: a backup's promotion closes its tools' listener; a peer silent in its handshake
    (60 s) must neither hold the promotion up (Python 3.12's wait_closed waits for it) nor stay
    open (it sees EOF at once). Review F2: the refused connections are counted in STATUS, across
    the promotion (one replication address, one count)."""
    secret = SECRET.decode()
    db, _ = primary_store(tmp_path / "b")

    async def main() -> None:
        listen, unreachable = f"{HOST}:{free_port()}", f"{HOST}:{free_port()}"
        config = ReplicationConfig(
            name="b", role="backup", primary=unreachable, listen=listen, secret=secret, handshake_timeout=60.0
        )
        node = ReplicationNode(db, config)
        await node.start()
        try:
            host, port = listen.rsplit(":", 1)
            idle_reader, idle_writer = await asyncio.open_connection(host, int(port))
            idle_end = asyncio.ensure_future(closed_by_peer(idle_reader))
            with pytest.raises(DurableError, match="do not share the replication secret"):
                await bounded(ask(listen, Frame.STATUS, b"not-the-secret-of-this-cluster"), 10.0)
            status = await bounded(ask(listen, Frame.STATUS, SECRET), 10.0)  # the idle peer was accepted before
            assert status["refused"] == 1, status
            assert "connections refused on its replication address since start: 1" in format_status(status)
            assert not idle_end.done()
            started = asyncio.get_running_loop().time()
            await bounded(node.promote(), 5.0)
            assert await bounded(idle_end, 2.0), "the idle peer's socket is closed"
            assert asyncio.get_running_loop().time() - started < 5.0
            idle_writer.close()
            status = await bounded(ask(listen, Frame.STATUS, SECRET), 10.0)
            assert status["role"] == "primary" and status["refused"] == 1, status
        finally:
            await bounded(node.stop(), 10.0)

    with caplog.at_level(logging.WARNING, logger="amqtt_durable.replication"):
        asyncio.run(main())
    db.close()
    assert not [r for r in caplog.records if r.exc_info], "no traceback"


def test_a_backup_gives_a_slow_primary_one_handshake_timeout_for_tls_and_the_secret_together(
    tmp_path: Path,
) -> None:
    """Review F4: with TLS and a secret the backup gave the TLS handshake handshake_timeout, then
    the secret's handshake handshake_timeout again. A primary (a real TLS listener and auth.py)
    slow by 0.6 of it in each phase (its TLS answer held up by a relay, then its AUTH answer) must
    time out once, at handshake_timeout from the connect."""
    pki = cluster_pki(tmp_path)
    within = 1.0
    slowness = 0.6 * within  # the slowness under test, not a synchronisation

    async def slow_primary(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            await asyncio.sleep(slowness)
            await server_handshake(reader, writer, SECRET, 1 << 16)
            await reader.read()
        writer.close()

    async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
        with contextlib.suppress(Exception):
            first = True
            while chunk := await reader.read(1 << 16):
                if first and delay:
                    await asyncio.sleep(delay)
                first = False
                writer.write(chunk)
                await writer.drain()
        writer.close()

    async def main() -> float:
        server = await asyncio.start_server(
            slow_primary, HOST, 0, ssl=tls_context(pki, pki["node"], server=True), ssl_handshake_timeout=10.0
        )
        server_port = server.sockets[0].getsockname()[1]
        pumps: list[asyncio.Task[None]] = []

        async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            up_reader, up_writer = await asyncio.open_connection(HOST, server_port)
            pumps.append(asyncio.create_task(pump(reader, up_writer, 0.0)))
            pumps.append(asyncio.create_task(pump(up_reader, writer, slowness)))  # the TLS answer, late

        proxy = await asyncio.start_server(relay, HOST, 0)
        backup = Backup(
            open_store(str(tmp_path / "b")), name="b", secret=SECRET, handshake_timeout=within,
            tls=tls_context(pki, pki["node"], server=False),
        )
        started = asyncio.get_running_loop().time()
        try:
            with pytest.raises(TimeoutError):
                _, writer, _ = await bounded(backup._open(HOST, proxy.sockets[0].getsockname()[1]), 10.0)
                writer.close()
            return asyncio.get_running_loop().time() - started
        finally:
            backup.db.close()
            proxy.close()
            server.close()
            for task in pumps:
                task.cancel()
            if pumps:
                await asyncio.wait(pumps, timeout=5.0)

    elapsed = asyncio.run(main())
    assert within <= elapsed < 1.5 * within, elapsed


def connects_while_nothing_is_accepted(port: int, count: int, within: float = 5.0) -> int:
    """How many of ``count`` connections to ``port`` the kernel completes while the caller's event
    loop (blocked by this call) accepts none: the listen backlog plus one, at most. Past it Linux
    drops the SYN and the client retries 1 s later, then 3 s: the connection waits for an accept."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        poller = select.poll()
        for sock in socks:
            sock.setblocking(False)
            sock.connect_ex((HOST, port))
            poller.register(sock, select.POLLOUT)
        pending = {sock.fileno(): sock for sock in socks}
        connected = 0
        deadline = time.monotonic() + within
        while pending and (left := deadline - time.monotonic()) > 0:
            for fd, _ in poller.poll(left * 1000):
                sock = pending.pop(fd)
                poller.unregister(fd)
                connected += sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
        return connected
    finally:
        for sock in socks:
            sock.close()


def test_both_replication_listeners_hold_the_listen_backlog_not_asyncios_100(tmp_path: Path) -> None:
    """Review of allow_from, finding 1: a backup's tools' listener and a primary's listened with
    asyncio's default backlog of 100, so a flood (even one allow_from closes at accept) faster
    than the accepts made a backup's or a tool's SYN wait 1 s, 3 s, ... for a place. Both now
    listen with the plugin's listen_backlog (512 by default): 300 connections, none accepted yet
    (this test holds the event loop), all complete."""
    count = 300
    assert 100 + 1 < count <= LISTEN_BACKLOG
    db, _ = primary_store(tmp_path / "b")

    async def main() -> None:
        listen, unreachable = f"{HOST}:{free_port()}", f"{HOST}:{free_port()}"
        node = ReplicationNode(db, ReplicationConfig(name="b", role="backup", primary=unreachable, listen=listen))
        port = int(listen.rsplit(":", 1)[1])
        await node.start()
        try:
            assert connects_while_nothing_is_accepted(port, count) == count, "the backup's tools' listener"
            await bounded(node.promote(), 10.0)
            assert node.primary is not None
            assert connects_while_nothing_is_accepted(port, count) == count, "the primary's listener"
        finally:
            await bounded(node.stop(), 10.0)

    asyncio.run(main())
    db.close()
