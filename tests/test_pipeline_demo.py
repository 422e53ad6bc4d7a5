"""`durable-pipeline demo`, the README's end-to-end command, runs and its audit holds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import WAIT

CONSOLE_SCRIPT = str(Path(sys.executable).with_name("durable-pipeline"))


@pytest.mark.slow
@pytest.mark.timeout(25 * WAIT)  # a JVM, a streaming query and an audit: about a minute, several on a loaded machine
def test_the_demo_runs_end_to_end(tmp_path: Path) -> None:
    """README's command as a user runs it: the console script, in a process of its own that starts (and stops) its
    own SparkSession with Spark's defaults (the suite's session evaluates interpreted; its JVM, like every Spark JVM
    of the suite, compiles with C1 only: conftest.SPARK_JVM). The suite's one run of
    the pipeline's console script in a JVM of its own: the audit's CLI tests run main() in this process."""
    out = tmp_path / "out"
    result = subprocess.run(
        [CONSOLE_SCRIPT, "demo", "--out", str(out), "--events", "200", "--devices", "2"],
        capture_output=True,
        text=True,
        timeout=20 * WAIT,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "published 200 events; 200 in" in result.stdout
    assert "OK: exactly-once holds" in result.stdout
    assert any((out / "events").glob("*.parquet"))
    assert (out / "audit" / "report.html").is_file()
    assert sorted(p.name for p in (out / "logs").iterdir()) == ["device-0.jsonl", "device-1.jsonl", "publisher.jsonl"]
    # pipeline.md: "a stream log on `telemetry/#` (store in `out/store`)", "checkpoint in `out/checkpoint`",
    # "one device is away for half the run so it gets a replay"
    assert (out / "store" / "CURRENT").is_file() and any((out / "checkpoint").iterdir())
    records = [
        json.loads(line)
        for path in (out / "logs").glob("device-*.jsonl")
        for line in path.read_text(encoding="utf-8").splitlines()
        if line.strip()
    ]
    assert any(r["kind"] == "receive" and r["replayed"] for r in records), "a device got a replay"


def test_the_demo_refuses_bad_arguments() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "durable_pipeline.cli", "demo", "--events", "0"],
        capture_output=True,
        text=True,
        timeout=WAIT,
        check=False,
    )
    assert result.returncode == 2
    assert "--events 2 or more" in result.stderr
