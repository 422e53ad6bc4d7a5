"""CPL-2 group commit against a real broker, real files and SDK processes (tests/sdk_child.py).

An SDK process processes a backlog of topic ``work`` with ``persistence="disk"``; its listener
appends each event's payload to a file (the side effect). The process is SIGKILLed at points
inside a group (in the listener while acks are held, right before a group's fsync, right after
it), or its fsync fails (injected in that process only). A second process finishes the work.

Exactly-once: the side-effect file holds every event once, in order. Acks after the fsync: the
events of the group the kill interrupted come again from the broker (it still held them: no ack
went before their fsync) and the next process drops them as duplicates (their marks were in the
OS already).
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import WAIT, Broker, Client, payloads
from durable_client import DurableClient

ROOT = Path(__file__).resolve().parent.parent
CHILD = ROOT / "tests" / "sdk_child.py"
TOTAL = 500


class Work:
    """One durable session with TOTAL events queued, and the files of the SDK processes that work on it."""

    def __init__(self, broker: Broker, clients: Callable[..., Client], tmp_path: Path, client_id: str) -> None:
        self.broker, self.client_id = broker, client_id
        self.state, self.out, self.sync_log = tmp_path / "state", tmp_path / "processed.txt", tmp_path / "syncs.txt"
        first = DurableClient(client_id, port=broker.port, persistence="disk", state_dir=self.state)
        first.subscribe("work")
        first.connect(timeout=WAIT)
        first.close(keep_session=True)
        clients(broker.port, "pub", clean_session=True).publish("work", payloads(TOTAL))

    def child(self, *extra: str) -> subprocess.CompletedProcess[str]:
        args = [sys.executable, str(CHILD), str(self.broker.port), self.client_id, str(self.state), str(self.out),
                str(TOTAL), "--sync-log", str(self.sync_log), *extra]
        return subprocess.run(args, capture_output=True, text=True, timeout=4 * WAIT, check=False)

    def processed(self) -> list[bytes]:
        return self.out.read_bytes().splitlines() if self.out.exists() else []

    def syncs(self) -> list[str]:
        return self.sync_log.read_text().splitlines() if self.sync_log.exists() else []


def printed(result: subprocess.CompletedProcess[str], name: str) -> str:
    found = re.search(rf"^{name}=(\S+)$", result.stdout, re.MULTILINE)
    assert found, result.stdout + result.stderr
    return found.group(1)


@pytest.mark.parametrize(
    "kill",
    [
        pytest.param(["--kill-in-batch", "0:1"], id="listener-first-group"),
        pytest.param(["--kill-in-batch", "150:8"], id="listener-8-acks-held"),
        pytest.param(["--kill-at-sync", "3"], id="before-the-fsync"),
        pytest.param(["--kill-after-sync", "4"], id="after-the-fsync-before-the-acks"),
    ],
)
def test_exactly_once_across_a_sigkill_inside_a_group(
    kill: list[str], broker: Broker, clients: Callable[..., Client], tmp_path: Path
) -> None:
    work = Work(broker, clients, tmp_path, "dev-group")
    crashed = work.child("--fsync-batch", "64", "--fsync-delay-ms", "1000", *kill)
    assert crashed.returncode == -9, crashed.stdout + crashed.stderr
    done = work.processed()
    assert done == payloads(TOTAL)[: len(done)] and 0 < len(done) < TOTAL, "processed in order up to the crash"
    syncs = work.syncs()
    assert all(line.startswith("sync ") for line in syncs)
    if kill[0] == "--kill-in-batch":
        # Killed in the listener: the acks held since the last group's fsync were never sent.
        unacked = len(done) - sum(int(line.split()[1]) for line in syncs)
        assert unacked >= int(kill[1].split(":")[1])
    else:
        unacked = int(syncs[-1].split()[1])  # the group whose fsync the kill came before or right after
        assert len(syncs) == int(kill[1]) and unacked >= 1

    finished = work.child()
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert work.processed() == payloads(TOTAL), "each event processed exactly once, in order"
    assert int(printed(finished, "duplicates_dropped")) >= unacked, (
        "every event whose ack was held at the kill came again (no ack before its group's fsync), and its mark, "
        "written before the kill, recognised it"
    )
    assert printed(finished, "level") == "disk"


def test_an_fsync_error_in_a_group_falls_back_to_cpl1_without_acking_the_group_first(
    broker: Broker, clients: Callable[..., Client], tmp_path: Path
) -> None:
    work = Work(broker, clients, tmp_path, "dev-eio")
    group = ["--fsync-batch", "64", "--fsync-delay-ms", "1000", "--fail-fsync-at", "3"]

    # 1. The fsync of group 3 fails; the process dies in the fallback callback, before any ack of group 3.
    crashed = work.child(*group, "--kill-on-fallback")
    assert crashed.returncode == -9, crashed.stdout + crashed.stderr
    syncs = work.syncs()
    assert syncs[-1] == "fallback" and len(syncs) == 4, syncs
    uncovered = int(syncs[-2].split()[1])
    assert uncovered >= 1
    assert work.processed() == payloads(TOTAL)[: len(work.processed())]

    # 2. Again, without dying: the group's events came again (not acknowledged), the marks written before the
    #    failure recognise them; after the fallback the work goes on at CPL-1, every event once.
    work.sync_log.unlink()
    fell_back = work.child(*group)
    assert fell_back.returncode == 0, fell_back.stdout + fell_back.stderr
    assert printed(fell_back, "level") == "memory" and printed(fell_back, "fallbacks") == "1"
    assert int(printed(fell_back, "duplicates_dropped")) >= uncovered
    syncs = work.syncs()
    assert syncs.count("fallback") == 1 and syncs[-1] == "fallback" and len(syncs) == 4, syncs
    failed_group_ends_at = syncs[-2].split()[2].encode()  # the last event whose ack the failed fsync held
    assert work.processed() == payloads(TOTAL), "each event processed exactly once, in order"

    # 3. After the fallback the held acks were sent (CPL-1 semantics): a new process with a working disk gets
    #    none of the failed group's events again before the marker, although its disk marks stop before them.
    #    (An event processed as step 2 closed may come again: its ack can lose the race with the DISCONNECT
    #    that close() queues from the main thread, and CPL-1's marks are gone with the process.)
    again = work.child("--until-live")
    assert again.returncode == 0, again.stdout + again.stderr
    assert printed(again, "duplicates_dropped") == "0" and printed(again, "level") == "disk"
    done = work.processed()
    assert done[:TOTAL] == payloads(TOTAL)
    assert all(payload > failed_group_ends_at for payload in done[TOTAL:]), (
        f"events of the failed group were processed again: {done[TOTAL:]}"
    )
