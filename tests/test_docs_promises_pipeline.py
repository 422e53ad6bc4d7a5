"""docs/pipeline.md's promises not pinned elsewhere: the source's option names and defaults as
the page spells them, endingOffsets refused on a streaming query, the audit's required options,
the default master. No Spark job runs here (test_pipeline_source.py and test_pipeline_audit.py
run the jobs)."""

from __future__ import annotations

import inspect
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from amqtt_durable.cli import PLUGIN_PATH
from amqtt_durable.process import BrokerProcess, local_config
from durable_fleet.cli import build_parser as fleet_parser
from durable_pipeline.cli import build_parser
from durable_pipeline.demo import MARKER, prepare_out, run_demo
from durable_pipeline.errors import PipelineError, SourceError
from durable_pipeline.source import AmqttDurableDataSource, Options, _schema
from durable_pipeline.spark import DEFAULT_MASTER, get_session

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
    """Local mode, "the default of `durable-pipeline demo`, `durable-pipeline audit` and `get_session()`,
    `local[2,4]`: two cores, a failed task tried up to 4 times ...; `amqtt-durable fleet`'s audit defaults to
    `local[2]`"."""
    assert DEFAULT_MASTER == "local[2,4]"
    parser = build_parser()
    for command in (["demo"], ["audit", "logs", "--out", "audit", "--expect", "exactly-once"]):
        assert parser.parse_args(command).master == DEFAULT_MASTER, command
    for job in (get_session, run_demo):
        assert inspect.signature(job).parameters["master"].default == DEFAULT_MASTER, job
    assert fleet_parser().parse_args([]).master == "local[2]"


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


GOOD_LOG = [
    {"kind": "subscribe", "device": "r", "time": 1.0, "topic": "t", "qos": 1, "durable": True},
    {"kind": "send", "device": "p", "time": 2.0, "topic": "t", "id": "aa", "qos": 1},
    {"kind": "receive", "device": "r", "time": 3.0, "topic": "t", "id": "aa", "qos": 1, "seq": 1, "epoch": 1},
]


def write_good_log(folder: Path) -> Path:
    path = folder / "run.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in GOOD_LOG), encoding="utf-8")
    return path


@pytest.mark.parametrize("master", ["foo", "local[0]", "local[2", "Local[2]"])
def test_a_master_spark_does_not_take_is_bad_input_found_before_spark_starts(tmp_path: Path, master: str) -> None:
    """Audit options: `--master` (default `local[2,4]`; a master URL Spark does not take is bad input, found
    before Spark starts): exit status 2 naming it, not Spark's gateway traceback with exit status 1 (which
    would read as "the guarantee does not hold")."""
    log = write_good_log(tmp_path)
    done = subprocess.run(
        [*CLI, "audit", str(log), "--out", str(tmp_path / "audit"), "--expect", "exactly-once", "--master", master],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert done.returncode == 2, done.stderr
    assert f"--master {master!r} is not a Spark master URL" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "Exception in thread" not in done.stderr, done.stderr
    assert not (tmp_path / "audit").exists()


def test_the_demo_refuses_a_bad_master_before_its_broker_starts(tmp_path: Path) -> None:
    """The demo's `--master` is checked as the audit's: exit status 2 before anything runs (no store)."""
    done = subprocess.run(
        [*CLI, "demo", "--out", str(tmp_path / "out"), "--events", "2", "--devices", "1", "--master", "nowhere"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "--master 'nowhere' is not a Spark master URL" in done.stderr, done.stderr
    assert not (tmp_path / "out" / "store").exists()


def test_every_master_form_spark_takes_passes_the_check() -> None:
    """The check refuses only what Spark refuses: local, local[N], local[*], local[N,F], local-cluster[N,C,M],
    spark://, yarn, k8s:// pass (Spark then connects to them)."""
    from durable_pipeline.spark import check_master  # noqa: PLC0415 - new with the check

    for master in ("local", "local[2]", "local[*]", "local[2,4]", "local[*, 3]", "local-cluster[2,1,1024]",
                   "spark://h1:7077,h2:7077", "yarn", "k8s://https://k8s.example:443", DEFAULT_MASTER):
        check_master(master)


@pytest.mark.parametrize("out", ["hdfs://namenode/audit", "file:///tmp/audit", "s3a://bucket/audit"])
def test_out_is_a_local_folder_a_uri_is_bad_input(tmp_path: Path, out: str) -> None:
    """"`--out` stays a local folder on the driver (the machine running the command; a URI there is bad
    input)": exit status 2 naming it, before Spark starts; no local folder named after the URI is made."""
    log = write_good_log(tmp_path)
    work = tmp_path / "cwd"
    work.mkdir()
    done = subprocess.run(
        [*CLI, "audit", str(log), "--out", out, "--expect", "exactly-once"],
        capture_output=True, text=True, timeout=300, check=False, cwd=work,
    )
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert f"--out {out} is a URI" in done.stderr and "local path" in done.stderr, done.stderr
    assert list(work.iterdir()) == []


def test_without_the_pipeline_extra_the_command_exits_2_saying_so(tmp_path: Path) -> None:
    """"an operator who only runs the broker can `pip install amqtt-durable` without it, and then
    `durable-pipeline` ... exit with status 2 saying so": pyspark made unimportable in the child."""
    log = write_good_log(tmp_path)
    code = (
        "import sys; sys.modules['pyspark'] = None\n"
        "from durable_pipeline.cli import main\n"
        f"sys.exit(main(['audit', {str(log)!r}, '--out', {str(tmp_path / 'audit')!r}, '--expect', 'exactly-once']))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2, done.stderr
    assert "need the pipeline extra (pip install 'amqtt-durable[pipeline]')" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def run_demo_cli(out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, "demo", "--out", str(out), "--events", "2", "--devices", "1"],
        capture_output=True, text=True, timeout=300, check=False,
    )


def test_the_demo_refuses_an_out_folder_of_other_things_and_deletes_nothing(tmp_path: Path) -> None:
    """The demo: exit status "2 for bad options, or an `--out` that holds other things and no earlier demo
    (refused, so nothing of yours is deleted)": it replaced the logs/, store/, events/ ... of any folder."""
    out = tmp_path / "project"
    (out / "logs").mkdir(parents=True)
    (out / "logs" / "mine.txt").write_text("keep", encoding="utf-8")
    done = run_demo_cli(out)
    assert done.returncode == 2, done.stderr
    assert f"--out {out} is not empty and holds no earlier demo" in done.stderr, done.stderr
    assert (out / "logs" / "mine.txt").read_text(encoding="utf-8") == "keep"
    assert sorted(p.name for p in out.iterdir()) == ["logs"]


def test_the_demo_refuses_an_out_that_is_a_file(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.write_text("a file", encoding="utf-8")
    done = run_demo_cli(out)
    assert done.returncode == 2, done.stderr
    assert f"--out {out} is a file, not a folder" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_every_extension_the_page_lists_is_told_without_reading_the_file(tmp_path: Path) -> None:
    """"A file is told JSON lines or Parquet by its extension, a final `.gz` aside (`.jsonl`, `.json`,
    `.ndjson`; `.parquet`, `.parq`)": such files pass the check before Spark starts whatever they hold (Spark's
    read checks the content); without one, the first bytes decide."""
    from durable_pipeline.errors import AuditInputError  # noqa: PLC0415
    from durable_pipeline.logs import check_local_inputs  # noqa: PLC0415

    names = ["a.jsonl", "b.json", "c.ndjson", "d.parquet", "e.parq", "f.ndjson.gz", "g.parq.gz", "h.JSONL"]
    for name in names:
        (tmp_path / name).write_bytes(b"\x00 not looked at")
    check_local_inputs([str(tmp_path / name) for name in names])
    (tmp_path / "i.log").write_bytes(b"\x00 looked at")
    with pytest.raises(AuditInputError, match=r"i\.log is neither JSON lines nor Parquet"):
        check_local_inputs([str(tmp_path / "i.log")])


def test_the_demo_refuses_an_out_uri_before_its_broker_starts(tmp_path: Path) -> None:
    """The demo's `--out` is a local folder, as the audit's: a URI is bad input (exit status 2) before anything
    runs; no local folder named after it is made."""
    done = subprocess.run(
        [*CLI, "demo", "--out", "hdfs://namenode/demo", "--events", "2", "--devices", "1"],
        capture_output=True, text=True, timeout=300, check=False, cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr
    assert "--out hdfs://namenode/demo is a URI" in done.stderr, done.stderr
    assert list(tmp_path.iterdir()) == []


def _main_demo_output(out: Path) -> None:
    """What the demo left in ``out`` before it wrote its marker: its folders (with something in them), the
    broker's log and the broker.yaml it wrote, with the plugin settings the demo has always given it."""
    for name in ("store", "logs", "events", "checkpoint", "audit"):
        (out / name).mkdir(parents=True)
        (out / name / "part").write_text("old", encoding="utf-8")
    (out / "broker.log").write_text("old log\n", encoding="utf-8")
    config = local_config(
        {"plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}}}, 1883,
        store=str(out / "store"), metrics_interval=0, streams=[{"filter": "telemetry/#", "max_count": 1_000_000}],
    )
    BrokerProcess(config, out, 1883).write_config()


def test_an_earlier_demo_from_before_the_marker_is_replaced(tmp_path: Path) -> None:
    """"an earlier demo's results are replaced", also those of a demo that wrote no marker yet: a folder of only
    the demo's own folders and files, its broker.yaml the demo broker's, was refused as not the demo's."""
    out = tmp_path / "demo-out"
    _main_demo_output(out)
    prepare_out(out)
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "broker.log", "broker.yaml"]


@pytest.mark.parametrize("extra", ["notes.txt", "other-broker.yaml"])
def test_a_demo_folder_with_other_things_and_no_marker_is_still_refused(tmp_path: Path, extra: str) -> None:
    """Anything else in the folder (a file of yours; a broker.yaml that is not the demo broker's) and it is
    refused as before, nothing deleted."""
    out = tmp_path / "demo-out"
    _main_demo_output(out)
    if extra == "notes.txt":
        (out / extra).write_text("mine", encoding="utf-8")
    else:
        (out / "broker.yaml").write_text(yaml.safe_dump({"plugins": {PLUGIN_PATH: {"store": "./data"}}}), "utf-8")
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    with pytest.raises(PipelineError, match="holds no earlier demo"):
        prepare_out(out)
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before


def test_a_symlink_in_an_earlier_demos_out_is_refused_and_nothing_is_followed(tmp_path: Path) -> None:
    """An earlier demo's --out (its marker there) in which ``logs`` became a symbolic link to another folder.
    Before: the marker was enough; the link was not cleared (rmtree refuses links, the error ignored) and the
    demo's devices wrote their logs through it into that folder. Now: refused, naming the link; nothing of the
    other folder or of --out is touched."""
    out, elsewhere = tmp_path / "demo-out", tmp_path / "elsewhere"
    _main_demo_output(out)
    (out / MARKER).touch()
    shutil.rmtree(out / "logs")
    elsewhere.mkdir()
    (elsewhere / "mine.txt").write_text("keep", encoding="utf-8")
    (out / "logs").symlink_to(elsewhere, target_is_directory=True)
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    with pytest.raises(PipelineError, match=r"holds a symbolic link the demo did not make \(logs\)"):
        prepare_out(out)
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before
    assert (out / "logs").is_symlink() and sorted(p.name for p in elsewhere.iterdir()) == ["mine.txt"]


def test_the_demo_refuses_an_out_whose_demo_folders_are_symlinks_with_exit_2(tmp_path: Path) -> None:
    """A folder that looks like a demo's from before the marker but whose store/ is a symbolic link to another
    folder. Before: accepted as the demo's (is_dir followed the link); the demo broker put its store there.
    Now: exit status 2 naming the link, nothing deleted."""
    out, elsewhere = tmp_path / "demo-out", tmp_path / "elsewhere"
    _main_demo_output(out)
    shutil.rmtree(out / "store")
    elsewhere.mkdir()
    (elsewhere / "mine.txt").write_text("keep", encoding="utf-8")
    (out / "store").symlink_to(elsewhere, target_is_directory=True)
    done = run_demo_cli(out)
    assert done.returncode == 2, done.stderr
    assert f"--out {out} holds a symbolic link the demo did not make (store)" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert sorted(p.name for p in elsewhere.iterdir()) == ["mine.txt"]
    assert not (out / MARKER).exists()


def test_the_demo_refuses_an_out_that_is_a_dangling_symlink_with_exit_2(tmp_path: Path) -> None:
    """An --out that is a symbolic link to nothing. Before: mkdir raised FileExistsError, uncaught (a
    traceback, exit 1). Now: exit status 2 naming the link and its target; nothing made at the target."""
    out, missing = tmp_path / "demo-out", tmp_path / "missing"
    out.symlink_to(missing, target_is_directory=True)
    done = run_demo_cli(out)
    assert done.returncode == 2, done.stderr
    assert f"--out {out} is a symbolic link to {missing}, which does not exist" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert out.is_symlink() and not missing.exists()


def test_an_out_that_is_a_symlink_to_a_folder_is_followed(tmp_path: Path) -> None:
    """The docstring's other half: an --out that is itself a link to a folder is used (the user named it)."""
    out, target = tmp_path / "demo-out", tmp_path / "target"
    target.mkdir()
    out.symlink_to(target, target_is_directory=True)
    prepare_out(out)
    assert sorted(p.name for p in target.iterdir()) == [MARKER]
