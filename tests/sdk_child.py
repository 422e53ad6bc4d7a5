"""An SDK process for the crash tests: processes the events of topic ``work`` with CPL-2.

    sdk_child.py PORT CLIENT_ID STATE_DIR OUT_FILE EXPECTED [KILL_AT]
                 [--delivery-log PATH] [--kill-after-log-at PAYLOAD]
                 [--fsync-batch N] [--fsync-delay-ms MS] [--sync-log PATH]
                 [--kill-in-batch M:J] [--kill-at-sync N] [--kill-after-sync N]
                 [--fail-fsync-at N] [--kill-on-fallback] [--until-live]

Each processed event is appended to OUT_FILE (one line, its payload) by the listener. With
KILL_AT, the listener SIGKILLs its own process when it gets that payload, before writing it:
a crash inside a listener. ``--delivery-log`` passes ``delivery_log=PATH`` to the client;
``--kill-after-log-at`` SIGKILLs the process right after the delivery log's ``receive``
record of that payload is written, before the SDK writes its mark: the window between the
two. Exits 0 once OUT_FILE holds EXPECTED lines, 3 when that takes longer than the deadline.

Group commit (CPL-2's fsync per group; "group N" is the N-th time the client syncs held acks):
``--sync-log`` appends ``sync <acks held> <last payload processed>`` before each group's fsync
(``-`` for none yet) and ``fallback`` when the
client falls back to CPL-1. ``--kill-in-batch M:J`` SIGKILLs the process in the listener once M
events were processed in this run and the client holds J or more acks (a crash inside a
group); ``--kill-at-sync N`` right before the fsync of group N, ``--kill-after-sync N`` right
after it, before its acks are sent. ``--fail-fsync-at N``: from group N on every ``os.fsync``
raises EIO (fault injection in this process only); ``--kill-on-fallback`` SIGKILLs the process in
the fallback callback, before the held acks are sent. ``--until-live``: also wait for the
marker, so everything the broker still held was delivered. Prints ``duplicates_dropped=``,
``level=`` and ``fallbacks=`` at the end.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import sys
import threading
from pathlib import Path

from durable_client import DurableClient, Event
from durable_client._commit import AckGate
from durable_client.delivery_log import DeliveryLog
from durable_client.persistence import DiskState

DEADLINE = 60.0


def kill_after_logging(payload: bytes) -> None:
    """Make DeliveryLog.receive SIGKILL the process once the record of ``payload`` is written."""
    receive = DeliveryLog.receive

    def receive_then_die(self: DeliveryLog, event: Event) -> None:
        receive(self, event)
        if event.payload == payload:
            os.kill(os.getpid(), signal.SIGKILL)

    DeliveryLog.receive = receive_then_die  # type: ignore[method-assign]


def kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class GroupFaults:
    """Counts the groups the client syncs (held acks) and injects the faults asked for."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.sync_log = Path(args.sync_log) if args.sync_log else None
        self.kill_at, self.kill_after, self.fail_at = args.kill_at_sync, args.kill_after_sync, args.fail_fsync_at
        self.groups = 0
        self.failing = False
        self.last = b"-"  # the payload processed last in this run
        flush, sync, fsync = AckGate._flush, DiskState.sync, os.fsync
        faults = self

        def flush_with_faults(gate: AckGate) -> None:
            if gate.held:
                faults.groups += 1
                faults.note(f"sync {gate.held} {faults.last.decode()}")
                if faults.groups == faults.fail_at:
                    faults.failing = True
                if faults.groups == faults.kill_at:
                    kill()
            flush(gate)

        def sync_then_maybe_die(state: DiskState) -> None:
            sync(state)
            if faults.groups == faults.kill_after and faults.groups:
                kill()

        def failing_fsync(fd: int) -> None:
            if faults.failing:
                raise OSError(errno.EIO, "Input/output error (injected by sdk_child.py)")
            fsync(fd)

        AckGate._flush = flush_with_faults  # type: ignore[method-assign]
        DiskState.sync = sync_then_maybe_die  # type: ignore[method-assign]
        os.fsync = failing_fsync

    def note(self, line: str) -> None:
        if self.sync_log is not None:
            with self.sync_log.open("a") as sink:
                sink.write(line + "\n")


def main() -> int:
    parser = argparse.ArgumentParser()
    for name in ("port", "client_id", "state_dir", "out_file", "expected"):
        parser.add_argument(name)
    parser.add_argument("kill_at", nargs="?")
    parser.add_argument("--delivery-log")
    parser.add_argument("--kill-after-log-at")
    parser.add_argument("--fsync-batch", type=int, default=64)
    parser.add_argument("--fsync-delay-ms", type=float, default=5.0)
    parser.add_argument("--sync-log")
    parser.add_argument("--kill-in-batch")
    parser.add_argument("--kill-at-sync", type=int)
    parser.add_argument("--kill-after-sync", type=int)
    parser.add_argument("--fail-fsync-at", type=int)
    parser.add_argument("--kill-on-fallback", action="store_true")
    parser.add_argument("--until-live", action="store_true")
    args = parser.parse_args()
    faults = GroupFaults(args)
    in_batch = tuple(int(part) for part in args.kill_in_batch.split(":")) if args.kill_in_batch else None
    kill_at = args.kill_at.encode() if args.kill_at is not None else None
    if args.kill_after_log_at is not None:
        kill_after_logging(args.kill_after_log_at.encode())
    expected = int(args.expected)
    out = Path(args.out_file)
    done = threading.Event()
    live = threading.Event()
    lines = len(out.read_bytes().splitlines()) if out.exists() else 0
    processed = 0
    fallbacks: list[OSError] = []

    def process(event: Event) -> None:
        nonlocal lines, processed
        if event.payload == kill_at:
            kill()
        gate = client._gate
        if in_batch is not None and gate is not None and processed >= in_batch[0] and gate.held >= in_batch[1]:
            kill()
        with out.open("ab") as sink:
            sink.write(event.payload + b"\n")
        lines += 1
        processed += 1
        faults.last = event.payload
        if lines >= expected:
            done.set()

    def fell_back(exc: OSError) -> None:
        fallbacks.append(exc)
        faults.note("fallback")
        if args.kill_on_fallback:
            kill()

    client = DurableClient(
        args.client_id, port=int(args.port), persistence="disk", state_dir=args.state_dir,
        delivery_log=args.delivery_log, fsync_batch=args.fsync_batch, fsync_delay_ms=args.fsync_delay_ms,
        on_live=lambda marker: live.set(), on_persistence_fallback=fell_back,
    )
    client.subscribe("work", listener=process)
    client.connect()
    client.ready_for_events()
    if lines >= expected:
        done.set()
    finished = done.wait(DEADLINE) and (not args.until_live or live.wait(DEADLINE))
    client.close(keep_session=True)
    print(f"duplicates_dropped={client.stats.duplicates_dropped}", flush=True)
    print(f"level={client.persistence_level}", flush=True)
    print(f"fallbacks={len(fallbacks)}", flush=True)
    return 0 if finished else 3


if __name__ == "__main__":
    sys.exit(main())
