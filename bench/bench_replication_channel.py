"""The replication channel alone (issue 12, first round; not yet the broker): a primary and
two backups in this process, real LevelDB stores in a temporary folder, TCP on 127.0.0.1.

Measures batches acknowledged by both backups (which fsync each write) per second, with one
batch in flight and with 100, and a snapshot catch-up from empty. Run:
``python bench/bench_replication_channel.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import tempfile
import time
from pathlib import Path

from amqtt_durable.replication.backup import Backup
from amqtt_durable.replication.framing import Op
from amqtt_durable.replication.primary import Primary
from amqtt_durable.store import STORE_ID_KEY, open_store

HOST = "127.0.0.1"
BATCHES = 20_000


def ops_for(n: int) -> list[Op]:
    """A commit like one publish's: a 64-byte body, a queue entry, the queue's totals."""
    return [
        (b"m" + n.to_bytes(8, "big"), bytes(64)),
        (b"q" + (n % 7).to_bytes(8, "big") + n.to_bytes(8, "big"), bytes(14)),
        (b"t" + (n % 7).to_bytes(8, "big"), bytes(24)),
    ]


def commit(primary: Primary, ops: list[Op]) -> asyncio.Future[None]:
    prepared = primary.prepare(ops)
    with primary.db.write_batch() as batch:
        for key, value in prepared.ops:
            if value is None:
                batch.delete(key)
            else:
                batch.put(key, value)
    return primary.committed(prepared)


async def run(folder: Path, window: int) -> None:
    db = open_store(str(folder / "p"))
    db.put(STORE_ID_KEY, secrets.randbits(63).to_bytes(8, "big"))
    primary = Primary(db, store_id=int.from_bytes(db.get(STORE_ID_KEY), "big"), log_max_batches=100_000,
                      log_max_bytes=64 << 20)
    await primary.start(HOST, 0)
    stop = asyncio.Event()
    backups = [Backup(open_store(str(folder / f"b{i}")), name=f"b{i}") for i in range(2)]
    tasks = [asyncio.create_task(b.follow(HOST, primary.port, stop)) for b in backups]
    for backup in backups:
        await asyncio.wait_for(backup.in_sync_event.wait(), 30)
    started = time.perf_counter()
    pending: list[asyncio.Future[None]] = []
    for n in range(1, BATCHES + 1):
        pending.append(commit(primary, ops_for(n)))
        if len(pending) >= window:
            await asyncio.wait_for(asyncio.gather(*pending), 30)
            pending = []
    await asyncio.wait_for(asyncio.gather(*pending), 30)
    took = time.perf_counter() - started
    print(f"{BATCHES} batches, {window} in flight: {took:.2f} s, {BATCHES / took:,.0f} batches/s acked by 2 backups")
    rows = sum(1 for _ in db.iterator(include_value=False))
    late = Backup(open_store(str(folder / "late")), name="late")
    started = time.perf_counter()
    tasks.append(asyncio.create_task(late.follow(HOST, primary.port, stop)))
    await asyncio.wait_for(late.in_sync_event.wait(), 60)
    took = time.perf_counter() - started
    print(f"  snapshot catch-up from empty, {rows} rows: {took:.2f} s, {rows / took:,.0f} rows/s")
    stop.set()
    for task in tasks:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await primary.close()


def main() -> None:
    for window in (1, 100):
        with tempfile.TemporaryDirectory() as folder:
            asyncio.run(run(Path(folder), window))


if __name__ == "__main__":
    main()
