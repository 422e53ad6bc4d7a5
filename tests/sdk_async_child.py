"""An asyncio SDK process for the crash tests: AsyncDurableClient, CPL-2, topic ``work``.

    sdk_async_child.py PORT CLIENT_ID STATE_DIR OUT_FILE EXPECTED [KILL_AT] [--only-subscribe]

Each event's loop body appends its payload to OUT_FILE; at KILL_AT the body SIGKILLs the
process before writing it. ``--only-subscribe`` sets the session and its subscription up and
exits. Exits 0 once OUT_FILE holds EXPECTED lines, 3 when that takes longer than the deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path

from durable_client import AsyncDurableClient

DEADLINE = 60.0


class Sink:
    """The side effect: one line per processed payload, written before the body finishes (on
    purpose synchronous: it must be on disk before the event is acknowledged)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.lines = len(self.path.read_bytes().splitlines()) if self.path.exists() else 0

    def record(self, payload: bytes) -> int:
        with self.path.open("ab") as sink:
            sink.write(payload + b"\n")
        self.lines += 1
        return self.lines


async def main_async(args: argparse.Namespace) -> int:
    sink = Sink(args.out_file)
    kill_at = args.kill_at.encode() if args.kill_at is not None else None
    options = {"persistence": "disk", "state_dir": args.state_dir}
    async with AsyncDurableClient(args.client_id, port=int(args.port), **options) as client:
        await client.subscribe("work")
        if args.only_subscribe:
            return 0
        await client.ready_for_events()
        async with asyncio.timeout(DEADLINE), client.events() as events:
            async for event in events:
                if event.payload == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                if sink.record(event.payload) >= int(args.expected):
                    return 0
    return 3


def main() -> int:
    parser = argparse.ArgumentParser()
    for name in ("port", "client_id", "state_dir", "out_file", "expected"):
        parser.add_argument(name)
    parser.add_argument("kill_at", nargs="?")
    parser.add_argument("--only-subscribe", action="store_true")
    try:
        return asyncio.run(main_async(parser.parse_args()))
    except TimeoutError:
        return 3


if __name__ == "__main__":
    sys.exit(main())
