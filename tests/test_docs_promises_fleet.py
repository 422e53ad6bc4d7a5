"""docs/fleet.md's promises not pinned elsewhere: the options' defaults as the page gives them, bad options
(a port, the audit's master) stopping the run before it starts with exit status 2, and schedule.yaml written
for every run. No broker, device or Spark job runs here (test_fleet.py runs the fleet)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import select
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from amqtt_durable.cli import PLUGIN_PATH
from conftest import Broker, Client
from durable_fleet.cli import build_parser, options_from
from durable_fleet.runner import FleetOptions, FleetRun
from durable_fleet.schedule import load_schedule
from durable_fleet.worker import CLOSE_TIMEOUT, DeviceSpec, PublisherSpec, WorkerSpec

BROKER_YAML = {
    "listeners": {"default": {"type": "tcp", "bind": "127.0.0.1:1883"}},
    "plugins": {
        "amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True},
        PLUGIN_PATH: {"store": "./data/durable"},
    },
}


@pytest.fixture
def broker_yaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A ./broker.yaml in the current folder, the page's default `-c`."""
    (tmp_path / "broker.yaml").write_text(yaml.safe_dump(BROKER_YAML), encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    return tmp_path / "broker.yaml"


def test_the_defaults_the_page_gives(broker_yaml: Path) -> None:
    """`amqtt-durable fleet`: 20 devices, 100 msg/s, 45 s, 10 faults (drop=3,stall=3,broker_kill=1,
    device_restart=3), `-c` ./broker.yaml, `--keepalive` 4 s, `--drain-timeout` 60 s, the audit's `--master`
    local[2], `--out` ./fleet-out, `--prefix` dev-, every 10th message to fleet/broadcast, cpl1, cpl2 and paho
    over 8 processes, 2 publisher processes;
    random faults between 5 s after the start and 15 s before the end, stalls 1.5 to 2.5 keep-alives."""
    parser = build_parser()
    options = options_from(parser.parse_args(["--seed", "7"]), parser)
    assert options.config is not None and options.config["plugins"][PLUGIN_PATH] == {"store": "./data/durable"}
    assert (options.devices, options.rate, options.duration, options.keepalive, options.drain_timeout) == (
        20, 100.0, 45.0, 4, 60.0
    )
    assert (options.master, options.out, options.prefix, options.broadcast_every, options.qos) == (
        "local[2]", Path("fleet-out"), "dev-", 10, 1
    )
    assert dict(options.mix) == {"cpl1": 1, "cpl2": 1, "paho": 1}
    assert (options.processes, options.publishers) == (8, 2)
    assert Counter(fault.kind for fault in options.faults) == {
        "drop": 3, "stall": 3, "broker_kill": 1, "device_restart": 3
    }
    assert options.schedule_note == "random, --seed 7"
    for fault in options.faults:
        assert fault.at >= 5.0 and fault.at + fault.duration <= 45.0 - 15.0, fault
        if fault.kind == "stall":
            assert 1.5 * 4 <= fault.duration <= 2.5 * 4, fault


def test_faults_sets_the_kinds_it_names_and_none_of_the_others(broker_yaml: Path) -> None:
    """fleet.md: "set with `--faults`, where a kind left out gets none: `--faults drop=5` is five drops and nothing
    else" (the page's `--qos 0 --faults drop=5` run)."""
    parser = build_parser()
    options = options_from(parser.parse_args(["--qos", "0", "--faults", "drop=5", "--seed", "1"]), parser)
    assert Counter(fault.kind for fault in options.faults) == {"drop": 5}
    options = options_from(parser.parse_args(["--faults", "stall=1,device_restart=2", "--seed", "1"]), parser)
    assert Counter(fault.kind for fault in options.faults) == {"stall": 1, "device_restart": 2}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--port", "70000"], "--port must be a TCP port from 1 to 65535, got 70000"),
        (["--port", "0"], "--port must be a TCP port from 1 to 65535, got 0"),
        (["--master", "nowhere"], "--master 'nowhere' is not a Spark master URL"),
        (["--master", "local[0]"], "--master 'local[0]' is not a Spark master URL"),
        (["--out", "hdfs://namenode/fleet"], "is a URI"),
    ],
)
def test_a_bad_port_or_master_stops_the_run_before_it_starts(
    broker_yaml: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    """"A bad schedule, option or broker.yaml stops the run before it starts, with exit status 2": a port no
    broker can have (it made every device fail to connect until the 120 s ready timeout) and a master Spark does
    not take (found only by the audit, after the whole run); an --out URI (a local folder named after it was
    made, and the audit refused it after the run)."""
    parser = build_parser()
    with pytest.raises(SystemExit) as stopped:
        options_from(parser.parse_args(["--out", str(broker_yaml.parent / "out"), *args]), parser)
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err
    assert not (broker_yaml.parent / "out").exists()


def test_a_run_without_faults_writes_a_schedule_that_replays(tmp_path: Path) -> None:
    """"The schedule used is written to `OUT/schedule.yaml`; replay a run with `--schedule
    OUT/schedule.yaml`": for a run without faults too (`--faults ""` or an empty script)."""
    out = tmp_path / "fleet-out"
    FleetRun(FleetOptions(out=out, config={}, faults=[]))._prepare()
    assert load_schedule(out / "schedule.yaml", devices=["dev-000"], duration=45.0) == []


def test_without_the_pipeline_extra_the_fleet_exits_2_before_it_runs(broker_yaml: Path) -> None:
    """pipeline.md: without the `pipeline` extra `amqtt-durable fleet` exits with status 2 saying so, before
    the run (the audit needs pyspark; it was found missing only once the run was over, exit status 3)."""
    out = broker_yaml.parent / "out"
    args = ["fleet", "-c", str(broker_yaml), "--out", str(out), "--devices", "1", "--duration", "1",
            "--faults", "", "--drain-timeout", "1", "--quiet"]
    code = (
        "import sys; sys.modules['pyspark'] = None\n"
        f"from durable_fleet.console import main\nsys.exit(main({args!r}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 2, done.stderr
    assert "needs the pipeline extra (pip install 'amqtt-durable[pipeline]')" in done.stderr, done.stderr
    assert not out.exists()


@pytest.mark.parametrize(
    "breakage",
    [
        "sys.modules['durable_fleet.runner'] = None",  # a module of the fleet itself missing
        "import types; sys.modules['durable_fleet.runner'] = types.ModuleType('durable_fleet.runner')",  # a name
    ],
)
def test_a_broken_import_that_is_not_the_extra_is_not_blamed_on_it(broker_yaml: Path, breakage: str) -> None:
    """Only the pipeline extra's modules missing are "needs the pipeline extra" (exit status 2), as for
    durable-pipeline: any other failed import (any ImportError was) is a fault, shown with its traceback."""
    args = ["fleet", "-c", str(broker_yaml), "--out", str(broker_yaml.parent / "out"), "--quiet"]
    code = f"import sys; {breakage}\nfrom durable_fleet.console import main\nsys.exit(main({args!r}))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode not in (0, 2), done.stderr
    assert "pipeline extra" not in done.stderr and "Traceback" in done.stderr, done.stderr
    assert "durable_fleet.runner" in done.stderr, done.stderr


def test_an_earlier_runs_results_are_replaced(tmp_path: Path) -> None:
    """"Output in `--out` (...; an earlier run's results are replaced)": its logs, audit, workers, store,
    report.html, charts, broker.yaml and broker.log go before a new run writes its own."""
    out = tmp_path / "fleet-out"
    FleetRun(FleetOptions(out=out, config={}, faults=[]))._prepare()
    for folder in ("logs/dev-000.jsonl", "audit/summary.parquet", "workers/devices-0.log", "store/CURRENT",
                   "brokers/a/broker.log", "etcd/etcd.log"):
        (out / folder).parent.mkdir(parents=True, exist_ok=True)
        (out / folder).write_text("earlier", encoding="utf-8")
    for name in ("report.html", "fleet_queue_depth.png", "broker.yaml", "broker.log"):
        (out / name).write_text("earlier", encoding="utf-8")
    FleetRun(FleetOptions(out=out, config={}, faults=[]))._prepare()
    left = sorted(str(path.relative_to(out)) for path in out.rglob("*") if path.is_file())
    assert left == [".amqtt-durable-fleet", "schedule.yaml"]
    assert sorted(path.name for path in out.iterdir() if path.is_dir()) == ["logs", "state", "workers"]


def test_every_fleet_command_the_docs_show_is_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    """fleet.md's and README's `amqtt-durable fleet` command lines (with the repository's broker.yaml and
    examples/fleet_schedule.yaml) pass the checks that stop a run before it starts."""
    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)
    text = (root / "docs" / "fleet.md").read_text(encoding="utf-8") + (root / "README.md").read_text(encoding="utf-8")
    commands = sorted(set(re.findall(r"amqtt-durable fleet[^`#\n]*", text)))
    assert len(commands) >= 5, commands
    for command in commands:
        parser = build_parser()
        options = options_from(parser.parse_args([*shlex.split(command)[2:], "--seed", "1"]), parser)
        assert options.config is not None, command


def _exited(pidfd: int, timeout: float) -> bool:
    """Whether the process behind ``pidfd`` has exited within ``timeout`` s: a pidfd is readable once its
    process exits, reaped or not (psutil's wait on a process that is not our child waits for its reaping)."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(timeout * 1000))


@contextmanager
def _stand_in_harness(spec: WorkerSpec, path: Path, then: str) -> Iterator[tuple[subprocess.Popen[str], int]]:
    """A stand-in for the runner and a pidfd for its worker: it writes ``spec`` to ``path`` with its own PID as
    the harness's, starts a worker on it, prints the worker's PID (the pidfd is opened before the harness can
    end: it has not reaped the worker, so the PID is still the worker's), then runs ``then`` (Python). Its stderr
    and the worker's go to ``path.with_suffix(".err")``. Both are killed at the end if still running."""
    code = (
        "import dataclasses, os, subprocess, sys, threading\n"
        "from pathlib import Path\n"
        "from durable_fleet.worker import WorkerSpec\n"
        f"path = Path({str(path)!r})\n"
        "dataclasses.replace(WorkerSpec.load(path), harness_pid=os.getpid()).dump(path)\n"
        "worker = subprocess.Popen([sys.executable, '-m', 'durable_fleet.worker', str(path)])\n"
        "print(worker.pid, flush=True)\n"
        f"{then}\n"
    )
    spec.dump(path)
    with path.with_suffix(".err").open("wb") as err:
        harness = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True
        )
    pidfd = -1
    try:
        assert harness.stdout is not None
        pidfd = os.pidfd_open(int(harness.stdout.readline()))
        yield harness, pidfd
    finally:
        harness.kill()
        harness.wait(10)
        if pidfd >= 0:
            if not _exited(pidfd, 0):  # the test failed: leave nothing running
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            os.close(pidfd)


def test_a_publisher_whose_harness_was_killed_outright_stops_by_itself_within_a_second(
    broker: Broker, clients: Callable[..., Client], tmp_path: Path
) -> None:
    """"processes whose harness was killed outright notice it within a second and stop by themselves": a publisher
    (publishing to a real broker) noticed its parent's death but went on publishing until its thread's join
    timed out (CLOSE_TIMEOUT). Its parent here is a stand-in harness, SIGKILLed once the publisher's messages
    reach a subscriber."""
    (tmp_path / "logs").mkdir()
    watcher = clients(broker.port, "watcher", clean_session=True)
    watcher.subscribe("fleet/#", 0)
    spec = WorkerSpec(
        device_port=broker.port, broker_host="127.0.0.1", broker_port=broker.port, logs=str(tmp_path / "logs"),
        state_dir=str(tmp_path / "state"), keepalive=4, end_sessions=False, harness_pid=0,
        publisher=PublisherSpec("pub-0", 50.0, ["dev-000"], 0, 0, 64, 1),
    )
    with _stand_in_harness(spec, tmp_path / "publisher.json", "threading.Event().wait(120)  # until SIGKILLed") as (
        harness, pidfd
    ):
        assert watcher.wait_messages(1, 30), "the publisher's messages reached no subscriber within 30 s"
        assert not _exited(pidfd, 0), "the publisher exited"
        harness.kill()
        harness.wait(10)
        killed = time.monotonic()
        assert _exited(pidfd, CLOSE_TIMEOUT), f"the publisher still ran {CLOSE_TIMEOUT} s after its harness died"
        # It looks for its parent once a second, then stops its thread and waits for the last PUBACKs.
        assert time.monotonic() - killed < CLOSE_TIMEOUT - 2  # main: about 1 s + CLOSE_TIMEOUT


def test_a_worker_whose_harness_died_before_it_looked_stops_by_itself(tmp_path: Path) -> None:
    """The same promise when the harness dies while the worker is still starting: the worker took its parent
    at that time for the harness (PID 1 by then) and never stopped. It now compares its parent with the PID
    the runner writes into its spec."""
    spec = WorkerSpec(
        device_port=1, broker_host="127.0.0.1", broker_port=1, logs=str(tmp_path / "logs"),
        state_dir=str(tmp_path / "state"), keepalive=4, end_sessions=False, harness_pid=0,
    )
    with _stand_in_harness(spec, tmp_path / "worker.json", "sys.stdin.readline()  # then exit") as (harness, pidfd):
        assert harness.stdin is not None
        harness.stdin.write("\n")
        harness.stdin.flush()
        assert harness.wait(10) == 0
        gone = time.monotonic()
        assert _exited(pidfd, CLOSE_TIMEOUT), f"the worker still ran {CLOSE_TIMEOUT} s after its harness exited"
        assert time.monotonic() - gone < 5.0  # its start (imports), then at once; main: never
        assert "Traceback" not in (tmp_path / "worker.err").read_text(encoding="utf-8")


def _dead_pid() -> int:
    """The PID of a process that has exited (and been reaped): a harness that died."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(30)
    return gone.pid


def _run_worker_of(tmp_path: Path, harness_pid: int, devices: list[DeviceSpec]) -> tuple[Path, str]:
    """A worker run to its end from a spec naming ``harness_pid`` (no broker behind its ports): the
    spec's path and the worker's stderr, once it exited 0 having built no device (no log folder)."""
    spec = WorkerSpec(
        device_port=1, broker_host="127.0.0.1", broker_port=1, logs=str(tmp_path / "logs"),
        state_dir=str(tmp_path / "state"), keepalive=4, end_sessions=False, harness_pid=harness_pid,
        devices=devices,
    )  # fmt: skip
    path = tmp_path / "worker.json"
    spec.dump(path)
    done = subprocess.run(
        [sys.executable, "-m", "durable_fleet.worker", str(path)],
        check=False, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "logs").exists(), list((tmp_path / "logs").iterdir())
    return path, done.stderr


def test_a_worker_whose_harness_died_before_it_started_builds_nothing(tmp_path: Path) -> None:
    """Before: the worker built its devices (their clients, their delivery logs) and only then looked for its
    harness. Now it looks first: no device, no log file, exit 0 with a WARNING saying why."""
    harness_pid = _dead_pid()
    path, stderr = _run_worker_of(tmp_path, harness_pid, [DeviceSpec("dev-000", "cpl1"), DeviceSpec("dev-001", "paho")])
    assert f"the harness (PID {harness_pid}) that wrote {path} is gone" in stderr, stderr


def test_a_worker_spec_written_before_harness_pid_runs_without_a_harness_watch(broker: Broker, tmp_path: Path) -> None:
    """A spec written by an older version has no harness_pid. Before: WorkerSpec.load raised TypeError and the
    worker exited 1 with a traceback. Now it runs as such a worker did (its device connects, writes its
    delivery log), says once that it does not watch its harness, and stops on SIGTERM."""
    spec = WorkerSpec(
        device_port=broker.port, broker_host="127.0.0.1", broker_port=broker.port, logs=str(tmp_path / "logs"),
        state_dir=str(tmp_path / "state"), keepalive=4, end_sessions=False, harness_pid=0,
        devices=[DeviceSpec("old-dev-000", "cpl1")],
    )  # fmt: skip
    raw = json.loads(json.dumps(dataclasses.asdict(spec)))
    del raw["harness_pid"]  # as an older version wrote it
    path = tmp_path / "old.json"
    path.write_text(json.dumps(raw), encoding="utf-8")
    assert WorkerSpec.load(path).harness_pid is None
    worker = subprocess.Popen(
        [sys.executable, "-m", "durable_fleet.worker", str(path)], stderr=subprocess.PIPE, text=True
    )
    try:
        assert worker.stderr is not None
        first = worker.stderr.readline()  # its first line, or "" if it exited (EOF)
        assert "has no harness_pid (written by an older version)" in first, first + worker.stderr.read()
        log_file = tmp_path / "logs" / "old-dev-000.jsonl"
        assert log_file.exists()  # the device was built
        worker.send_signal(signal.SIGTERM)
        status = worker.wait(CLOSE_TIMEOUT + 20)
        rest = worker.stderr.read()
        assert status == 0, rest
        assert "Traceback" not in rest
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(10)


def test_a_worker_started_by_hand_exits_at_once_saying_its_harness_is_gone(tmp_path: Path) -> None:
    """docs/fleet.md: a worker started by hand from a spec with a harness_pid (its parent is not that harness,
    which still runs here) exits at once, status 0, saying its harness is gone; no device built."""
    harness = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        path, stderr = _run_worker_of(tmp_path, harness.pid, [DeviceSpec("dev-000", "cpl1")])
        assert harness.poll() is None  # the harness named in the spec still runs
    finally:
        assert harness.stdin is not None
        harness.stdin.close()
        harness.wait(30)
    said = f"the harness (PID {harness.pid}) that wrote {path} is gone: stopping before any device starts"
    assert said in stderr, stderr
