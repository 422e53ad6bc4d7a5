"""The start-up scan of a store without the b"M" message id mark (an earlier release's): one read of
every queue entry (store.scan_msg_ids_in_use). Builds a compacted store of N entries, then times the
scan with LevelDB's block cache filled (as before) and not (fill_cache=False, as now), alternately,
each on a freshly opened store.

    PYTHONPATH=plugin python bench/bench_msg_id_scan.py [N] [ROUNDS]
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from typing import Any

from amqtt_durable.store import _ENTRY, _U64, Entry, entry_key, open_store, scan_msg_ids_in_use


def filled_cache_scan(db: Any) -> int:
    """The scan's loop as it was before (main 24508bf): through the block cache, no count."""
    highest = 0
    for value in db.iterator(prefix=b"q", include_key=False, verify_checksums=True):
        if len(value) == _ENTRY.size:
            highest = max(highest, int(_U64.unpack_from(value)[0]))
    return highest


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    folder = tempfile.mkdtemp(prefix="bench_msg_id_scan_")
    path = f"{folder}/store"
    try:
        db = open_store(path)
        for start in range(0, count, 10_000):
            with db.write_batch() as batch:
                for i in range(start, min(count, start + 10_000)):
                    batch.put(entry_key(1 + i // 1000, i), Entry(i, i + 1, 1, 0, 100).encode())
        db.compact_range()
        db.close()
        scans = (
            ("fill_cache=True (before)", filled_cache_scan),
            ("fill_cache=False (now)", lambda d: scan_msg_ids_in_use(d)[0]),
        )
        for round_ in range(rounds):
            for name, scan in scans:
                db = open_store(path, create=False)
                started = time.perf_counter()
                highest = scan(db)
                took = time.perf_counter() - started
                db.close()
                print(f"round {round_} {name}: {count} entries, highest {highest}, {took:.2f} s", flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
