"""store.iter_entries per entry (what drop-oldest and session deletion read): the loop as it was
(checked_key, partial and decoded() per entry; branch damaged 9c6c5ed) against the current one
(a length check, decoded in the loop), alternately on one store of N entries, best of ROUNDS.

    PYTHONPATH=plugin python bench/bench_iter_entries.py [N] [ROUNDS]
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

from amqtt_durable.store import (
    _U64,
    Entry,
    checked_key,
    decoded,
    entry_key,
    iter_entries,
    open_store,
    queue_prefix,
    seq_of_entry_key,
)


def before(db: Any, sid: int) -> Iterator[Entry]:
    """iter_entries as it was (9c6c5ed), without its limit."""
    rows = db.iterator(start=queue_prefix(sid) + _U64.pack(0), stop=queue_prefix(sid + 1), verify_checksums=True)
    owner = f"session number {sid}"
    for key, value in rows:
        seq = seq_of_entry_key(checked_key(key))
        yield decoded(partial(Entry.decode, seq), value, f"queue entry {seq} of {owner}")


@contextmanager
def entry_store(count: int) -> Iterator[Any]:
    """A store in a temporary folder holding ``count`` queue entries of session 7."""
    folder = tempfile.mkdtemp()
    try:
        db = open_store(folder)
        with db.write_batch() as batch:
            for seq in range(1, count + 1):
                batch.put(entry_key(7, seq), Entry(seq, seq, 1, 0, 10).encode())
        try:
            yield db
        finally:
            db.close()
    finally:
        shutil.rmtree(folder)


def report(best: dict[str, float], count: int) -> None:
    for name, seconds in best.items():
        print(f"{name}: {seconds * 1e9 / count:.0f} ns/entry")
    print(f"before/now: {best['before'] / best['now']:.2f}x")


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 200_000
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    best = {"before": float("inf"), "now": float("inf")}
    with entry_store(count) as db:
        for _ in range(rounds):
            for name, read in (("before", before), ("now", iter_entries)):
                start = time.perf_counter()
                read_count = sum(1 for _ in read(db, 7))
                best[name] = min(best[name], time.perf_counter() - start)
                assert read_count == count
    report(best, count)


if __name__ == "__main__":
    main()
