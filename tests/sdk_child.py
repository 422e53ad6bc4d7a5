"""An SDK process for the crash tests: processes the events of topic ``work`` with CPL-2.

    sdk_child.py PORT CLIENT_ID STATE_DIR OUT_FILE EXPECTED [KILL_AT]

Each processed event is appended to OUT_FILE (one line, its payload) by the listener. With
KILL_AT, the listener SIGKILLs its own process when it gets that payload, before writing it:
a crash inside a listener. Exits 0 once OUT_FILE holds EXPECTED lines, 3 when that takes
longer than the deadline.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

from durable_client import DurableClient, Event

DEADLINE = 60.0


def main() -> int:
    port, client_id, state_dir, out_file, expected = sys.argv[1:6]
    kill_at = sys.argv[6].encode() if len(sys.argv) > 6 else None
    out = Path(out_file)
    done = threading.Event()
    lines = len(out.read_bytes().splitlines()) if out.exists() else 0

    def process(event: Event) -> None:
        nonlocal lines
        if event.payload == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        with out.open("ab") as sink:
            sink.write(event.payload + b"\n")
        lines += 1
        if lines >= int(expected):
            done.set()

    client = DurableClient(client_id, port=int(port), persistence="disk", state_dir=state_dir)
    client.subscribe("work", listener=process)
    client.connect()
    client.ready_for_events()
    finished = done.wait(DEADLINE)
    client.close(keep_session=True)
    print(f"duplicates_dropped={client.stats.duplicates_dropped}", flush=True)
    return 0 if finished else 3


if __name__ == "__main__":
    sys.exit(main())
