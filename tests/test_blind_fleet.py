"""Black-box tests of `amqtt-durable fleet` written from docs/fleet.md alone, for promises test_blind_sdk.py,
test_blind_pipeline.py and the unit tests leave out: schedule refusals through the command, and the random
schedule's documented window, kinds and lengths. Each test quotes the promise it checks by its words. (A real
run's output folder: tests/test_fleet.py; its printed seed: test_blind_pipeline.py.)
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import yaml
from test_blind_pipeline import fleet_in_process

from durable_fleet.cli import build_parser, options_from
from durable_fleet.runner import FleetRun
from durable_fleet.schedule import parse_duration

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("faults", "ha", "named"),
    [
        (["{at: 5s, kind: drop, device: dev-001, for: 0s}"], False, "fault 1: for"),  # 0 with a unit
        (["{at: 5s, kind: group_kill, for: 5s}", "{at: 7s, kind: partition, for: 1s}"], True,
         "two faults on the pair at once"),  # the group kill first
        (["{at: 1m30s, kind: drop, device: all, for: 500ms}"], False, "fault 1: for"),  # ends at 90.5 s of 60
    ],
)
def test_a_schedule_the_page_refuses_stops_the_run_naming_file_fault_and_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], faults: list[str], ha: bool, named: str
) -> None:
    """fleet.md: "A schedule is refused when, among others (..., a `for` of 0, ...)"; "a fault does not end (`at`
    plus `for`) within `--duration`" (times like `500ms`, `1m30s`); "with `--ha`, primary kills, partitions and
    group kills all hit the pair: `two faults on the pair at once` when a group kill is one of them"; "A bad
    schedule ... stops the run before it starts, with exit status 2 and the file, fault number and field named".
    Through the command: the cases tests/unit/test_fleet_schedule.py and test_fleet_ha.py leave out."""
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
    `OUT/schedule.yaml`" (the command's options and a run's set-up, in this process: nothing is started)."""
    parser = build_parser()
    args = ["-c", str(Path(__file__).parent.parent / "broker.yaml"), "--out", str(tmp_path / "out"), "--seed", "5",
            "--duration", "70s", "--keepalive", "3", "--devices", "4", "--faults", "drop=3,stall=2,device_restart=2"]
    FleetRun(options_from(parser.parse_args(args), parser))._prepare()
    faults = yaml.safe_load((tmp_path / "out" / "schedule.yaml").read_text(encoding="utf-8"))["faults"]
    spans = {kind: sorted((parse_duration(f["at"]), parse_duration(f["at"]) + parse_duration(f["for"]))
                          for f in faults if f["kind"] == kind) for kind in ("drop", "stall", "device_restart")}
    assert {kind: len(found) for kind, found in spans.items()} == {"drop": 3, "stall": 2, "device_restart": 2}
    assert len(faults) == 7, faults
    for kind, found in spans.items():
        assert all(start >= 5 and end <= 70 - 15 for start, end in found), (kind, found)
        assert all(end <= start for (_, end), (start, _) in itertools.pairwise(found)), (kind, found)  # no overlap
    assert all(1.5 * 3 <= end - start <= 2.5 * 3 for start, end in spans["stall"]), spans["stall"]
