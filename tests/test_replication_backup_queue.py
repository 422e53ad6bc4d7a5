"""A backup's queue of frames received and not yet applied is bounded in bytes as well as in
frames: a primary sending large batches meets TCP back-pressure, not a backup taking gigabytes
(QUEUE_FRAMES frames of up to MAX_FRAME each), and every batch still arrives, in order. Observed
as an operator sees it: the backup node's status (``queued_bytes``, ``queue_full``; inspect)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from replication_helpers import HOST, bounded, commit, content, started_primary

from amqtt_durable.process import free_port
from amqtt_durable.replication.backup import Backup
from amqtt_durable.replication.config import ReplicationConfig
from amqtt_durable.replication.framing import CheckedBatch, Frame
from amqtt_durable.replication.node import ReplicationNode
from amqtt_durable.replication.tool import ask, format_status
from amqtt_durable.store import open_store

MIB = 1 << 20
BATCHES = 24
"""Batches of a MiB each: far more than either bound below (without the byte bound, all of them
fit in the 1,024 frames of the queue)."""


def held_and_recorded(backup: Backup) -> tuple[asyncio.Event, list[int]]:
    """The backup receives batches but writes none until the event is set; the list gets the
    number of each batch written, in the order written."""
    gate = asyncio.Event()
    written: list[int] = []
    real_write = backup._write_batches

    async def held_write(batches: list[CheckedBatch], size: int) -> int | None:
        await gate.wait()
        last = await real_write(batches, size)
        written.extend(batch.seq for batch in batches)
        return last

    backup._write_batches = held_write  # type: ignore[method-assign]
    return gate, written


async def status_when(address: str, check: Callable[[dict[str, Any]], bool], seconds: float = 10.0) -> dict[str, Any]:
    """The node's STATUS (asked as ``inspect --replication`` asks it) once ``check`` holds of it."""
    deadline = time.monotonic() + seconds
    while True:
        status = await ask(address, Frame.STATUS)
        if check(status):
            return status
        if time.monotonic() > deadline:
            raise TimeoutError(f"not true within {seconds} s: {status}")
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("queue_bytes", [3 * MIB, MIB // 2], ids=["two-frames", "smaller-than-a-frame"])
def test_a_backup_queues_no_more_than_its_byte_bound_of_large_batches_and_applies_every_one_in_order(
    tmp_path: Path, queue_bytes: int
) -> None:
    async def main() -> None:
        primary = await started_primary(tmp_path / "p", log_max_batches=1000, log_max_bytes=256 * MIB)
        db = open_store(str(tmp_path / "b"))
        listen = f"{HOST}:{free_port()}"
        node = ReplicationNode(db, ReplicationConfig(role="backup", name="b", primary=f"{HOST}:{primary.port}",
                                                     listen=listen))  # fmt: skip
        node.backup.queue_bytes = queue_bytes
        await node.start()
        try:
            await bounded(node.backup.in_sync_event.wait())
            first = primary.log.head_seq + 1
            gate, written = held_and_recorded(node.backup)
            big = [[(b"big%04d" % n, bytes([n]) * MIB), (b"t", b"%d" % n)] for n in range(BATCHES)]
            acked = [commit(primary, ops) for ops in big]
            frame = max(len(item.data) for item in primary.log.since(first - 1))  # the largest frame payload
            # The applier holds its first group; the reader fills the queue up to its bound and waits:
            # what it holds then is the most it holds while the applier is held.
            full = await status_when(listen, lambda status: status["queue_full"])
            queued = full["queued_bytes"]
            assert 0 < queued <= max(queue_bytes, frame), f"{queued} bytes queued, the bound is {queue_bytes}"
            shown = f"{queued} bytes received not yet applied (queue full: the primary waits for this backup's writes)"
            assert shown in format_status(full), format_status(full)
            gate.set()
            await bounded(asyncio.gather(*acked))
            assert written == list(range(first, primary.log.head_seq + 1)), "every batch, once, in order"
            emptied = await status_when(listen, lambda status: status["queued_bytes"] == 0)
            assert not emptied["queue_full"] and "not yet applied" not in format_status(emptied)
            assert node.backup.snapshots == 1, "the channel never dropped (one snapshot: the first connection's)"
            assert node.backup.applied_seq == primary.log.head_seq
            assert content(db) == content(primary.db)
        finally:
            await node.stop()
            await primary.close()
            db.close()
            primary.db.close()

    asyncio.run(main())
