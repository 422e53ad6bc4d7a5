"""A backup's queue of frames received and not yet applied is bounded in bytes as well as in
frames: a primary sending large batches meets TCP back-pressure, not a backup taking gigabytes
(QUEUE_FRAMES frames of up to MAX_FRAME each), and every batch still arrives, in order."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from replication_helpers import bounded, commit, content, in_sync, new_backup, started_primary

from amqtt_durable.replication.backup import Backup
from amqtt_durable.replication.framing import CheckedBatch

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


@pytest.mark.parametrize("queue_bytes", [3 * MIB, MIB // 2], ids=["two-frames", "smaller-than-a-frame"])
def test_a_backup_queues_no_more_than_its_byte_bound_of_large_batches_and_applies_every_one_in_order(
    tmp_path: Path, queue_bytes: int
) -> None:
    async def main() -> None:
        primary = await started_primary(tmp_path / "p", log_max_batches=1000, log_max_bytes=256 * MIB)
        backup = new_backup(tmp_path, "b", queue_bytes=queue_bytes)
        try:
            async with in_sync(primary.port, backup):
                first = primary.log.head_seq + 1
                gate, written = held_and_recorded(backup)
                big = [[(b"big%04d" % n, bytes([n]) * MIB), (b"t", b"%d" % n)] for n in range(BATCHES)]
                acked = [commit(primary, ops) for ops in big]
                frame = max(len(item.data) for item in primary.log.since(first - 1))  # the largest frame payload
                # The applier holds its first group; the reader fills the queue up to its bound and waits.
                await bounded(backup.received.backed_up.wait(), 10)
                queued = backup.received.bytes
                assert 0 < queued <= max(queue_bytes, frame), f"{queued} bytes queued, the bound is {queue_bytes}"
                gate.set()
                await bounded(asyncio.gather(*acked))
                assert written == list(range(first, primary.log.head_seq + 1)), "every batch, once, in order"
                peak = backup.received.peak_bytes
                assert peak <= max(queue_bytes, frame), f"the queue held {peak} bytes, its bound is {queue_bytes}"
                assert backup.snapshots == 1, "the channel never dropped (one snapshot: the first connection's)"
            assert backup.applied_seq == primary.log.head_seq
            assert content(backup.db) == content(primary.db)
        finally:
            await primary.close()
            backup.db.close()
            primary.db.close()

    asyncio.run(main())
