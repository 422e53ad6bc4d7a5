"""Black-box tests of `amqtt-durable fleet` written from docs/fleet.md alone, for promises test_blind_sdk.py and
test_blind_pipeline.py leave out: the schedule refusals the page lists, and one real run through the command
(its verdict, summary table and output folder). Each test quotes the promise it checks by its words.
"""

from __future__ import annotations

import itertools
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from fleet_helpers import signal_fleet_when
from test_blind_pipeline import fleet_in_process

from amqtt_durable.process import free_port
from durable_fleet.schedule import parse_duration

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("faults", "ha", "named"),
    [
        (["{kind: drop, device: dev-001, for: 1s}"], False, "fault 1: at: missing"),
        (["{at: 5s, device: dev-001, for: 1s}"], False, "fault 1: kind: missing"),
        (["{at: 5s, kind: drop, device: dev-001}"], False, "fault 1: for: missing"),
        (["{at: 5s, kind: stall, device: dev-001, for: 0}"], False, "fault 1: for"),
        (["{at: 5s, kind: drop, device: dev-001, for: 0s}"], False, "fault 1: for"),
        (["{at: 5s, kind: drop, device: dev-001, for: 1s, colour: red}"], False, "fault 1: unknown key(s) 'colour'"),
        (["{at: 5s, kind: partition, for: 1s}"], False, "fault 1: kind: partition needs a replicated pair"),
        (["{at: 5s, kind: primary_kill, for: 1s}"], False, "fault 1: kind: primary_kill needs a replicated pair"),
        (["{at: 5s, kind: group_kill, for: 1s}"], False,
         "fault 1: kind: group_kill needs a replicated pair: run with --ha (it hits both brokers of the pair at once)"),
        (["{at: 5s, kind: broker_kill, for: 1s}"], True, "fault 1: kind: broker_kill"),
        (["{at: 5s, kind: group_kill, device: dev-001, for: 1s}"], True, "fault 1: device"),
        (["{at: 5s, kind: partition, device: dev-001, for: 1s}"], True, "fault 1: device"),
        (["{at: 5s, kind: primary_kill, for: 5s}", "{at: 7s, kind: group_kill, for: 1s}"], True,
         "two faults on the pair at once"),
        (["{at: 5s, kind: group_kill, for: 5s}", "{at: 7s, kind: partition, for: 1s}"], True,
         "two faults on the pair at once"),
        (["{at: 5s, kind: primary_kill, for: 5s}", "{at: 9s, kind: partition, for: 1s}"], True, "fault 2: at"),
        (["{at: 1m30s, kind: drop, device: all, for: 500ms}"], False, "fault 1: for"),  # ends at 90.5 s of 60
    ],
)
def test_a_schedule_the_page_refuses_stops_the_run_naming_file_fault_and_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], faults: list[str], ha: bool, named: str
) -> None:
    """fleet.md: "A schedule is refused when, among others (a missing `at`, `kind` or `for`, a `for` of 0, an
    unknown key or kind, a top-level key other than `faults`, an HA-only kind without `--ha`, `broker_kill` with
    `--ha`)"; "a `broker_kill` (with `--ha`, a `primary_kill`, `partition` or `group_kill`) has a `device`";
    "a fault does not end (`at` plus `for`) within `--duration`" (times like `500ms`, `1m30s`); "with `--ha`,
    primary kills, partitions and group kills all hit the pair: `two faults on the pair at once` when a group
    kill is one of them"; group_kill without --ha "is refused (`group_kill needs a replicated pair: run with --ha
    (it hits both brokers of the pair at once)`)"; "A bad schedule ... stops the run before it starts, with exit
    status 2 and the file, fault number and field named"."""
    schedule = tmp_path / "script.yaml"
    schedule.write_text("faults:\n" + "".join(f"  - {fault}\n" for fault in faults), encoding="utf-8")
    args = ["-c", str(tmp_path / "broker.yaml"), "--schedule", str(schedule), "--devices", "5", "--duration", "60s"]
    status, err = fleet_in_process(tmp_path, capsys, *args, *(["--ha"] if ha else []))
    assert status == 2, err
    assert "script.yaml" in err and named in err, err
    assert not (tmp_path / "out").exists()


def test_a_scripted_broker_kill_against_a_running_broker_is_refused_naming_file_fault_and_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """fleet.md: "`--port P [--host H]` targets a running broker instead: then no broker kills (...; `broker_kill`
    in `--faults` or a schedule is refused, exit status 2)"; "A bad schedule ... stops the run before it starts,
    with exit status 2 and the file, fault number and field named"."""
    schedule = tmp_path / "script.yaml"
    schedule.write_text(
        "faults:\n  - {at: 5s, kind: drop, device: dev-001, for: 1s}\n  - {at: 9s, kind: broker_kill, for: 1s}\n",
        encoding="utf-8",
    )
    status, err = fleet_in_process(tmp_path, capsys, "--port", "1883", "--schedule", str(schedule), "--duration", "60s")
    assert status == 2, err
    assert "script.yaml: fault 2: kind: broker_kill" in err and "--port" in err, err
    assert not (tmp_path / "out").exists()


def test_a_top_level_key_other_than_faults_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """fleet.md: a schedule is refused for "a top-level key other than `faults`" (exit status 2, the file
    named)."""
    schedule = tmp_path / "script.json"
    schedule.write_text('{"faults": [], "devices": 5}', encoding="utf-8")
    status, err = fleet_in_process(tmp_path, capsys, "-c", str(tmp_path / "broker.yaml"), "--schedule", str(schedule))
    assert status == 2, err
    assert "script.json" in err and "devices" in err, err
    assert not (tmp_path / "out").exists()


def test_random_group_kills_are_refused_without_ha(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """fleet.md: group_kill is "Not among the random defaults: ask for it with `--faults group_kill=1` ... Without
    `--ha` it is refused (`group_kill needs a replicated pair: run with --ha (it hits both brokers of the pair at
    once)`)"."""
    status, err = fleet_in_process(tmp_path, capsys, "-c", str(tmp_path / "broker.yaml"), "--faults", "group_kill=1")
    assert status == 2, err
    assert "group_kill needs a replicated pair: run with --ha (it hits both brokers of the pair at once)" in err, err
    assert not (tmp_path / "out").exists()


def test_random_faults_keep_the_documented_window_kinds_and_lengths(tmp_path: Path) -> None:
    """fleet.md: "Faults, random with `--seed` (...; set with `--faults`, where a kind left out gets none ...)";
    "Random faults fall between 5 s after the start and 15 s before the end, faults of one kind never overlap,
    stalls last 1.5 to 2.5 keep-alives (`--keepalive`, default 4 s). The schedule used is written to
    `OUT/schedule.yaml`" (read here as the run starts, against a running broker's --port, which gets no broker
    kills; the run is then stopped with SIGTERM)."""
    def written(out: Path) -> bool:
        try:
            return len(yaml.safe_load((out / "schedule.yaml").read_text(encoding="utf-8"))["faults"]) == 7
        except (OSError, TypeError, KeyError, yaml.YAMLError):
            return False

    args = ["--port", str(free_port()), "--seed", "5", "--duration", "70s", "--keepalive", "3", "--devices", "4",
            "--faults", "drop=3,stall=2,device_restart=2", "--processes", "1", "--quiet"]
    signal_fleet_when(tmp_path, args, written, signal.SIGTERM)
    faults = yaml.safe_load((tmp_path / "out" / "schedule.yaml").read_text(encoding="utf-8"))["faults"]
    spans = {kind: sorted((parse_duration(f["at"]), parse_duration(f["at"]) + parse_duration(f["for"]))
                          for f in faults if f["kind"] == kind) for kind in ("drop", "stall", "device_restart")}
    assert {kind: len(found) for kind, found in spans.items()} == {"drop": 3, "stall": 2, "device_restart": 2}
    for kind, found in spans.items():
        assert all(start >= 5 and end <= 70 - 15 for start, end in found), (kind, found)
        assert all(end <= start for (_, end), (start, _) in itertools.pairwise(found)), (kind, found)  # no overlap
    assert all(1.5 * 3 <= end - start <= 2.5 * 3 for start, end in spans["stall"]), spans["stall"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_run_through_the_command_prints_its_seed_and_verdict_and_writes_the_documented_output(
    tmp_path: Path,
) -> None:
    """fleet.md: the broker starts "with `-c broker.yaml` ..., keeping every setting but three: one TCP listener
    on a free 127.0.0.1 port, the store in `OUT/store` ... and `metrics_interval: 1`"; faults "random with
    `--seed` (printed ...)"; "`--faults drop=5` is five drops and nothing else"; "Exit status 0: every device
    held"; "Output in `--out`: the summary table on stdout (per device kind: expected, received, lost,
    duplicated, out of order), `report.html` ..., `audit/` (the Spark audit's own report and summary.parquet),
    `logs/` (delivery logs ...), `workers/` (each process's spec and output), `broker.yaml` and `broker.log`
    (the configuration as run, and its output), `schedule.yaml`"."""
    config = tmp_path / "mine.yaml"
    config.write_text(yaml.safe_dump({
        "listeners": {"default": {"type": "tcp", "bind": "127.0.0.1:1883"}},
        "plugins": {
            "amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True},
            "amqtt_durable.DurableSessionsPlugin": {"store": "./elsewhere", "session_expiry": 600, "max_depth": 5000},
        },
    }), encoding="utf-8")
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "durable_fleet.console", "fleet", "-c", str(config), "--out", str(out),
         "--devices", "3", "--processes", "1", "--publishers", "1", "--rate", "30", "--duration", "21s",
         "--faults", "drop=1", "--drain-timeout", "30", "--quiet"],
        capture_output=True, text=True, timeout=220, check=False, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"--seed \d+", done.stdout + done.stderr), done.stderr

    header = next(line for line in done.stdout.splitlines() if "expected" in line)
    for column in ("expected", "received", "lost", "duplicated", "out of order"):
        assert column in header, header
    kinds = {line.split()[0] for line in done.stdout.splitlines() if line.split() and line.split()[0] in
             ("cpl1", "cpl2", "paho")}
    assert kinds == {"cpl1", "cpl2", "paho"}, done.stdout  # the default --mix cpl1=1,cpl2=1,paho=1

    as_run = yaml.safe_load((out / "broker.yaml").read_text(encoding="utf-8"))
    [listener] = as_run["listeners"].values()
    assert listener["type"] == "tcp" and listener["bind"].startswith("127.0.0.1:")
    assert listener["bind"] != "127.0.0.1:1883"
    plugin = as_run["plugins"]["amqtt_durable.DurableSessionsPlugin"]
    assert Path(plugin.pop("store")).resolve() == (out / "store").resolve()
    assert float(plugin.pop("metrics_interval")) == 1
    assert plugin == {"session_expiry": 600, "max_depth": 5000}, "every other setting is kept"
    assert as_run["plugins"]["amqtt.plugins.authentication.AnonymousAuthPlugin"] == {"allow_anonymous": True}

    schedule = yaml.safe_load((out / "schedule.yaml").read_text(encoding="utf-8"))
    assert [fault["kind"] for fault in schedule["faults"]] == ["drop"]
    for name in ("report.html", "broker.log", "audit/report.html", "audit/summary.parquet", "logs/pub-0.jsonl"):
        assert (out / name).is_file(), name
    assert sorted(path.name for path in (out / "logs").glob("dev-*.jsonl")) == [
        "dev-000.jsonl", "dev-001.jsonl", "dev-002.jsonl",
    ]
    assert {path.suffix for path in (out / "workers").iterdir()} >= {".json", ".log"}
    assert (out / "store").is_dir() and not (tmp_path / "elsewhere").exists()
