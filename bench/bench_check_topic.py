"""Cost of the SDK's publish topic check (durable_client._options.check_topic) per call, beside
main's check before it (a ``_durable/`` prefix test only) and the check at an earlier commit.

    PYTHONPATH=client_sdk .venv/bin/python bench/bench_check_topic.py [COMMIT] [REPEATS]

COMMIT (default 8690a5d, review 128's branch head) is read with ``git show``; best of REPEATS
runs of 1,000,000 calls each, in one process, the three checks alternating.
"""

from __future__ import annotations

import subprocess
import sys
import timeit
import types
from collections.abc import Callable
from pathlib import Path

from durable_client import _options
from durable_protocol import CONTROL_PREFIX

ROOT = Path(__file__).resolve().parents[1]
TOPICS = ["sensors/building-7/floor-3/room-12/temperature", "t"]
CALLS = 1_000_000


def main_check(topic: str) -> None:
    """main's check before the branch: the control prefix only."""
    if topic.startswith(CONTROL_PREFIX):
        raise ValueError(topic)


def check_at(commit: str) -> Callable[[object], str]:
    source = subprocess.run(
        ["git", "show", f"{commit}:client_sdk/durable_client/_options.py"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout
    module = types.ModuleType("durable_client._options_before")
    module.__package__ = "durable_client"
    exec(compile(source, f"{commit}:_options.py", "exec"), module.__dict__)  # our own file at a commit
    check: Callable[[object], str] = module.check_topic
    return check


def main() -> None:
    commit = sys.argv[1] if len(sys.argv) > 1 else "8690a5d"
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    checks: list[tuple[str, Callable[[str], object]]] = [
        ("main (prefix only)", main_check),
        (f"at {commit}", check_at(commit)),
        ("now", _options.check_topic),
    ]
    for topic in TOPICS:
        best = dict.fromkeys([name for name, _ in checks], float("inf"))
        for _ in range(repeats):
            for name, check in checks:
                seconds = timeit.timeit(lambda check=check, topic=topic: check(topic), number=CALLS)  # type: ignore[misc]
                best[name] = min(best[name], seconds / CALLS * 1e6)
        print(f"{topic!r}: " + ", ".join(f"{name} {us:.3f} µs" for name, us in best.items()))


if __name__ == "__main__":
    main()
