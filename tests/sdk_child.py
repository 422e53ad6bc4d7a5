"""An SDK process for the crash tests: processes the events of topic ``work`` with CPL-2.

    sdk_child.py PORT CLIENT_ID STATE_DIR OUT_FILE EXPECTED [KILL_AT]
                 [--delivery-log PATH] [--kill-after-log-at PAYLOAD]

Each processed event is appended to OUT_FILE (one line, its payload) by the listener. With
KILL_AT, the listener SIGKILLs its own process when it gets that payload, before writing it:
a crash inside a listener. ``--delivery-log`` passes ``delivery_log=PATH`` to the client;
``--kill-after-log-at`` SIGKILLs the process right after the delivery log's ``receive``
record of that payload is written, before the SDK writes its mark: the window between the
two. Exits 0 once OUT_FILE holds EXPECTED lines, 3 when that takes longer than the deadline.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

from durable_client import DurableClient, Event
from durable_client.delivery_log import DeliveryLog

DEADLINE = 60.0


def kill_after_logging(payload: bytes) -> None:
    """Make DeliveryLog.receive SIGKILL the process once the record of ``payload`` is written."""
    receive = DeliveryLog.receive

    def receive_then_die(self: DeliveryLog, event: Event) -> None:
        receive(self, event)
        if event.payload == payload:
            os.kill(os.getpid(), signal.SIGKILL)

    DeliveryLog.receive = receive_then_die  # type: ignore[method-assign]


def main() -> int:
    parser = argparse.ArgumentParser()
    for name in ("port", "client_id", "state_dir", "out_file", "expected"):
        parser.add_argument(name)
    parser.add_argument("kill_at", nargs="?")
    parser.add_argument("--delivery-log")
    parser.add_argument("--kill-after-log-at")
    args = parser.parse_args()
    kill_at = args.kill_at.encode() if args.kill_at is not None else None
    if args.kill_after_log_at is not None:
        kill_after_logging(args.kill_after_log_at.encode())
    expected = int(args.expected)
    out = Path(args.out_file)
    done = threading.Event()
    lines = len(out.read_bytes().splitlines()) if out.exists() else 0

    def process(event: Event) -> None:
        nonlocal lines
        if event.payload == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        with out.open("ab") as sink:
            sink.write(event.payload + b"\n")
        lines += 1
        if lines >= expected:
            done.set()

    client = DurableClient(
        args.client_id, port=int(args.port), persistence="disk", state_dir=args.state_dir,
        delivery_log=args.delivery_log,
    )
    client.subscribe("work", listener=process)
    client.connect()
    client.ready_for_events()
    finished = done.wait(DEADLINE)
    client.close(keep_session=True)
    print(f"duplicates_dropped={client.stats.duplicates_dropped}", flush=True)
    return 0 if finished else 3


if __name__ == "__main__":
    sys.exit(main())
