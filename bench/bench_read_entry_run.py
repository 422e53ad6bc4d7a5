"""store.read_entry_run per entry (the replay's read of a queue): the loop as it was (no key length
check; branch damaged b0295f1) against the current one (one length comparison per row), alternately (which goes first
alternates too: the first of a pair ran up to 20% faster) on one store of N entries, best of ROUNDS.

    PYTHONPATH=plugin python bench/bench_read_entry_run.py [N] [ROUNDS]
"""

from __future__ import annotations

import struct
import sys
import time
from itertools import islice
from typing import Any

import plyvel
from bench_iter_entries import entry_store, report

from amqtt_durable.store import _ENTRY, _U64, Entry, queue_prefix, read_entry_run


def before(
    db: Any, sid: int, start_seq: int, tail: int, limit: int
) -> tuple[list[Entry], BaseException | None]:
    """read_entry_run as it was (b0295f1), without its guards for an empty range (not met here)."""
    entries: list[Entry] = []
    prefix = queue_prefix(sid)
    rows = db.iterator(start=prefix + _U64.pack(start_seq), stop=prefix + _U64.pack(tail + 1), verify_checksums=True)
    append, unpack, unpack_seq = entries.append, _ENTRY.unpack, _U64.unpack_from
    try:
        for key, value in islice(rows, limit):
            msg_id, qos, flags, size = unpack(value)
            append(Entry(unpack_seq(key, 9)[0], msg_id, qos, flags, size))
    except (plyvel.Error, ValueError, struct.error) as exc:
        return entries, exc
    return entries, None


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 200_000
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    best = {"before": float("inf"), "now": float("inf")}
    pair = (("before", before), ("now", read_entry_run))
    with entry_store(count) as db:
        for turn in range(rounds):
            for name, read in pair if turn % 2 == 0 else pair[::-1]:  # the order alternates: the first runs faster
                start = time.perf_counter()
                entries, damage = read(db, 7, 1, count, count)
                best[name] = min(best[name], time.perf_counter() - start)
                assert len(entries) == count and damage is None
    report(best, count)


if __name__ == "__main__":
    main()
