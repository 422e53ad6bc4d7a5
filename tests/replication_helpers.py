"""Shared by the replication tests: real stores in tmp folders, a primary and backups on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any, TypeVar

import trustme

from amqtt_durable.replication.backup import Backup
from amqtt_durable.replication.framing import Op
from amqtt_durable.replication.primary import Primary
from amqtt_durable.store import STORE_ID_KEY, open_store

HOST = "127.0.0.1"
BOUND = 30.0
_T = TypeVar("_T")


async def bounded(awaitable: Awaitable[_T], seconds: float = BOUND) -> _T:
    async with asyncio.timeout(seconds):
        return await awaitable


def primary_store(folder: Path) -> tuple[Any, int]:
    db = open_store(str(folder))
    store_id = secrets.randbits(63)
    db.put(STORE_ID_KEY, store_id.to_bytes(8, "big"), sync=True)
    return db, store_id


def write(db: Any, ops: list[Op]) -> None:
    with db.write_batch() as batch:
        for key, value in ops:
            if value is None:
                batch.delete(key)
            else:
                batch.put(key, value)


def commit(primary: Primary, ops: list[Op]) -> asyncio.Future[None]:
    """What the wiring will do around each group commit: number, write locally, ship."""
    prepared = primary.prepare(ops)
    write(primary.db, prepared.ops)
    return primary.committed(prepared)


def ops_for(n: int) -> list[Op]:
    """A commit like the broker's: a body, a queue entry, totals; every third deletes older keys."""
    ops: list[Op] = [
        (b"m" + n.to_bytes(8, "big"), b"body-%d" % n * 3),
        (b"q" + (n % 7).to_bytes(8, "big") + n.to_bytes(8, "big"), b"entry-%d" % n),
        (b"t" + (n % 7).to_bytes(8, "big"), n.to_bytes(8, "big")),
    ]
    if n % 3 == 0 and n > 10:
        ops += [(b"m" + (n - 10).to_bytes(8, "big"), None), (b"q" + (n % 7).to_bytes(8, "big"), None)]
    return ops


def content(db: Any) -> list[tuple[bytes, bytes]]:
    return list(db.iterator())


@contextlib.asynccontextmanager
async def following(backup: Backup, port: int) -> AsyncIterator[asyncio.Task[None]]:
    """The backup follows the primary at ``port`` until the block ends."""
    stop = asyncio.Event()
    task = asyncio.create_task(backup.follow(HOST, port, stop, retry=0.05))
    try:
        yield task
    finally:
        stop.set()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def started_primary(
    folder: Path, *, log_max_batches: int = 100, log_max_bytes: int = 1 << 20, **settings: Any
) -> Primary:
    """A Primary on a new store in ``folder`` (``primary_store``: its ``db`` and ``store_id``),
    serving on a free 127.0.0.1 port; ``settings``: Primary's others."""
    db, store_id = primary_store(folder)
    primary = Primary(db, store_id=store_id, log_max_batches=log_max_batches, log_max_bytes=log_max_bytes, **settings)
    await primary.start(HOST, 0)
    return primary


def new_backup(folder: Path, name: str, **settings: Any) -> Backup:
    """A Backup named ``name`` on its store in ``folder / name`` (made or reopened)."""
    return Backup(open_store(str(folder / name)), name=name, **settings)


@contextlib.asynccontextmanager
async def in_sync(port: int, *backups: Backup) -> AsyncIterator[None]:
    """Each of ``backups`` follows the primary at ``port`` until the block ends (``following``);
    the block begins once every one of them is in sync."""
    async with contextlib.AsyncExitStack() as stack:
        for backup in backups:
            await stack.enter_async_context(following(backup, port))
        for backup in backups:
            await bounded(backup.in_sync_event.wait())
        yield


def cluster_pki(folder: Path) -> dict[str, str]:
    """A cluster CA, a certificate for 127.0.0.1 signed by it, and one from a stranger's CA."""
    ca, stranger = trustme.CA(), trustme.CA()
    paths = {name: str(folder / f"{name}.pem") for name in ("ca", "node", "stranger")}
    ca.cert_pem.write_to_path(paths["ca"])
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(paths["node"])
    stranger.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(paths["stranger"])
    return paths
