"""docs/pipeline.md's promises not pinned elsewhere: the source's option names and defaults as
the page spells them, endingOffsets refused on a streaming query, the audit's required options,
the default master. No Spark job runs here (test_pipeline_source.py and test_pipeline_audit.py
run the jobs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from durable_pipeline.errors import SourceError
from durable_pipeline.source import AmqttDurableDataSource, Options, _schema
from durable_pipeline.spark import DEFAULT_MASTER

CLI = [str(Path(sys.executable).with_name("durable-pipeline"))]


def test_the_options_as_the_page_spells_them_and_their_defaults() -> None:
    """Options: host, port, filter (required), startingOffsets (earliest default), endingOffsets,
    failOnDataLoss (default true), window (default 1000, the most the broker allows),
    maxEventsPerTrigger, idsPerPartition (default 100000), numPartitions, timeout (default 30),
    failover (host:port,host:port)."""
    defaults = Options.parse({"filter": "telemetry/#"})
    assert (defaults.host, defaults.port, defaults.starting, defaults.fail_on_data_loss) == (
        "127.0.0.1",
        1883,
        "earliest",
        True,
    )
    assert (defaults.window, defaults.ids_per_partition, defaults.num_partitions, defaults.timeout) == (
        1000,
        100000,
        None,
        30.0,
    )
    assert defaults.max_events_per_trigger is None and defaults.failover == ()
    spelled = Options.parse(
        {
            "host": "10.0.0.1",
            "port": "1884",
            "filter": "telemetry/#",
            "startingOffsets": "latest",
            "endingOffsets": '{"telemetry/a": 20}',
            "failOnDataLoss": "false",
            "window": "1000",
            "maxEventsPerTrigger": "500",
            "numPartitions": "2",
            "timeout": "5",
            "failover": "10.0.0.2:1883,10.0.0.3:1883",
        }
    )
    assert spelled.failover == (("10.0.0.2", 1883), ("10.0.0.3", 1883))
    assert (spelled.starting, spelled.ending, spelled.num_partitions) == ("latest", {"telemetry/a": 20}, 2)
    assert Options.parse({"filter": "telemetry/#", "idsPerPartition": "10"}).ids_per_partition == 10
    with pytest.raises(SourceError, match="window must be a whole number from 1 to 1000"):
        Options.parse({"filter": "telemetry/#", "window": "1001"})  # the most the broker allows


def test_ending_offsets_is_refused_on_a_streaming_query() -> None:
    """`endingOffsets` is refused on a streaming query (it is for batch reads); a batch read takes it."""
    options = {"filter": "telemetry/#", "endingOffsets": '{"telemetry/a": 20}'}
    with pytest.raises(SourceError, match=r"endingOffsets is for batch reads \(spark\.read\)"):
        AmqttDurableDataSource(options).streamReader(_schema())
    assert AmqttDurableDataSource(options).reader(_schema()).opts.ending == {"telemetry/a": 20}


def test_the_default_master_is_two_cores_and_four_task_attempts() -> None:
    """Local mode by default, `local[2,4]`: two cores, a failed task tried up to 4 times."""
    assert DEFAULT_MASTER == "local[2,4]"


@pytest.mark.parametrize("missing", ["--expect", "--out"])
def test_the_audit_needs_expect_and_out(tmp_path: Path, missing: str) -> None:
    """Delivery audit: --expect and --out are required; without one the command exits 2 naming it."""
    given = {"--expect": "exactly-once", "--out": str(tmp_path / "audit")}
    del given[missing]
    args = [word for pair in given.items() for word in pair]
    done = subprocess.run(
        [*CLI, "audit", str(tmp_path), *args], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2 and missing in done.stderr, done.stderr
