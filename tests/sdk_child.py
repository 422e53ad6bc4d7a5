"""An SDK process for the crash tests: processes the events of topic ``work`` with CPL-2.

    sdk_child.py PORT CLIENT_ID STATE_DIR OUT_FILE EXPECTED [KILL_AT]
                 [--delivery-log PATH] [--kill-after-log-at PAYLOAD] [--async] [--only-subscribe]

Each processed event is appended to OUT_FILE (one line, its payload) by the listener. With
KILL_AT, the listener SIGKILLs its own process when it gets that payload, before writing it:
a crash inside a listener. ``--delivery-log`` passes ``delivery_log=PATH`` to the client;
``--kill-after-log-at`` SIGKILLs the process right after the delivery log's ``receive``
record of that payload is written, before the SDK writes its mark: the window between the
two. ``--async`` processes with AsyncDurableClient (``async for``) instead of a listener;
``--only-subscribe`` sets the durable session and its subscription up and exits. Exits 0 once
OUT_FILE holds EXPECTED lines, 3 when that takes longer than the deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import threading
from pathlib import Path

from durable_client import AsyncDurableClient, DurableClient, Event
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


class Processor:
    """Appends each processed payload to OUT_FILE; SIGKILLs the process at KILL_AT, before writing it."""

    def __init__(self, out: Path, expected: int, kill_at: bytes | None) -> None:
        self.out = out
        self.expected = expected
        self.kill_at = kill_at
        self.lines = len(out.read_bytes().splitlines()) if out.exists() else 0
        self.done = threading.Event()

    def __call__(self, event: Event) -> None:
        if event.payload == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        with self.out.open("ab") as sink:
            sink.write(event.payload + b"\n")
        self.lines += 1
        if self.lines >= self.expected:
            self.done.set()


async def process_async(args: argparse.Namespace, process: Processor) -> bool:
    options = {"persistence": "disk", "state_dir": args.state_dir, "delivery_log": args.delivery_log}
    async with AsyncDurableClient(args.client_id, port=int(args.port), **options) as client:
        await client.subscribe("work")
        if args.only_subscribe:
            return True
        await client.ready_for_events()
        async with asyncio.timeout(DEADLINE), client.events() as events:
            async for event in events:
                process(event)
                if process.done.is_set():
                    break
        print(f"duplicates_dropped={client.stats.duplicates_dropped}", flush=True)
    return process.done.is_set()


def process_threaded(args: argparse.Namespace, process: Processor) -> bool:
    client = DurableClient(
        args.client_id, port=int(args.port), persistence="disk", state_dir=args.state_dir,
        delivery_log=args.delivery_log,
    )
    client.subscribe("work", listener=None if args.only_subscribe else process)
    client.connect()
    if args.only_subscribe:
        client.close(keep_session=True)
        return True
    client.ready_for_events()
    finished = process.done.wait(DEADLINE)
    client.close(keep_session=True)
    print(f"duplicates_dropped={client.stats.duplicates_dropped}", flush=True)
    return finished


def main() -> int:
    parser = argparse.ArgumentParser()
    for name in ("port", "client_id", "state_dir", "out_file", "expected"):
        parser.add_argument(name)
    parser.add_argument("kill_at", nargs="?")
    parser.add_argument("--delivery-log")
    parser.add_argument("--kill-after-log-at")
    parser.add_argument("--async", dest="use_async", action="store_true")
    parser.add_argument("--only-subscribe", action="store_true")
    args = parser.parse_args()
    if args.kill_after_log_at is not None:
        kill_after_logging(args.kill_after_log_at.encode())
    kill_at = args.kill_at.encode() if args.kill_at is not None else None
    process = Processor(Path(args.out_file), int(args.expected), kill_at)
    finished = asyncio.run(process_async(args, process)) if args.use_async else process_threaded(args, process)
    return 0 if finished else 3


if __name__ == "__main__":
    sys.exit(main())
