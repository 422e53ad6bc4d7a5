"""Blind tests of README.md, docs/configuration.md and docs/pipeline.md, second pass: promises the other
test files did not check as a user meets them. Real brokers (conftest), real paho clients, real Spark: the
session-wide ``spark`` fixture, and one Spark driver of its own where the page's default master is the
point. Each test quotes the promise it checks."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from test_docs import blocks

from conftest import WAIT, Broker, Client, payloads

HERE = Path(__file__).resolve().parent
FILTER = "telemetry/#"


# ------------------------------------------------------------------ pipeline.md: the example and task retries
@pytest.mark.slow
@pytest.mark.timeout(20 * WAIT)  # a JVM of its own (seconds; minutes on a loaded machine) and a query
def test_the_page_s_example_session_runs_a_read_task_that_got_nothing_again(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], tmp_path: Path
) -> None:
    """pipeline.md: Spark "in local mode (the default, `local[2,4]`: two cores, a failed task tried up to 4
    times as on a cluster)"; "a task that gets nothing for `timeout` seconds fails and is run again, up to
    Spark's task retries". The page's own streaming example, run as a user runs it (a process of its own, its
    `get_session()`), reads through a proxy that keeps every read task's stream silent until Spark counts a
    failed task: the query goes on and writes every event once."""
    (code,) = [c for name, c in blocks("python") if name == "pipeline.md"]
    assert "get_session()" in code, "the example takes the default master"
    broker = broker_factory(streams=[{"filter": FILTER}])
    clients(broker.port, "blind2-pub", clean_session=True).publish("telemetry/a", payloads(30))
    code = code.replace('.option("port", 1883)', '.option("port", PROXY_PORT).option("timeout", 1)')
    code = code.replace('"./out/', f'"{tmp_path}/out/')
    assert "PROXY_PORT" in code and "./out" not in code
    example = tmp_path / "example.py"
    example.write_text(code, encoding="utf-8")
    done = subprocess.run(
        [sys.executable, str(HERE / "spark_retry_child.py"), str(example), str(broker.port)],
        capture_output=True, text=True, timeout=18 * WAIT, check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    assert outcome["master"] == "local[2,4]", outcome
    assert outcome["error"] is None and outcome["finished"], outcome
    assert outcome["silenced"] >= 1 and outcome["failed"] >= 1, f"no read task failed: {outcome}"
    assert outcome["ids"] == list(range(1, 31)), "every event once, after the retry"
