"""durable_fleet.schedule: durations, the seeded random schedule's rules, script validation, dump/load."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from durable_fleet.errors import ScheduleError
from durable_fleet.model import ALL_DEVICES, FAULT_KINDS, Fault
from durable_fleet.schedule import (
    dump_schedule,
    load_schedule,
    parse_duration,
    random_schedule,
)

DEVICES = [f"dev-{i:03d}" for i in range(20)]
COUNTS = {"drop": 8, "stall": 3, "broker_kill": 4, "device_restart": 5}
KEEPALIVE = 5.0
DURATION = 300.0


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        (12, 12.0),
        (1.5, 1.5),
        (0, 0.0),
        ("12", 12.0),
        (" 2.5 ", 2.5),
        ("500ms", 0.5),
        ("30s", 30.0),
        ("10m", 600.0),
        ("1h", 3600.0),
        ("1m30s", 90.0),
        ("1h2m3s", 3723.0),
        ("1.5s", 1.5),
        ("2s250ms", 2.25),
    ],
)
def test_parse_duration(text: str | float, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty duration"),
        ("   ", "empty duration"),
        (-1, "negative duration"),
        ("-5", "negative duration"),
        ("-5s", "negative duration"),
        ("5d", "not a duration: '5d'"),
        ("5 s", "not a duration"),
        ("s", "not a duration"),
        ("1.5.5s", "not a duration"),
        ("30s1m", "each unit once, the largest first"),
        ("1m1m", "each unit once, the largest first"),
        ("nan", "must be finite"),
        ("inf", "must be finite"),
        (float("nan"), "must be finite"),
        (float("inf"), "must be finite"),
        (True, "not a duration"),
        (None, "not a duration"),
        ([5], "not a duration"),
    ],
)
def test_parse_duration_rejects(text: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_duration(text)  # type: ignore[arg-type]


def schedule(seed: int = 7, **overrides: object) -> list[Fault]:
    arguments: dict[str, object] = {
        "duration": DURATION,
        "devices": DEVICES,
        "counts": COUNTS,
        "keepalive": KEEPALIVE,
    }
    arguments.update(overrides)
    return random_schedule(seed, **arguments)  # type: ignore[arg-type]


def test_random_schedule_is_deterministic_per_seed() -> None:
    assert schedule(1) == schedule(1)
    assert schedule(1) != schedule(2)
    assert schedule(1, counts=dict(reversed(COUNTS.items()))) == schedule(1)


@pytest.mark.parametrize("seed", range(30))
def test_random_schedule_rules(seed: int) -> None:
    start, quiet_tail = 5.0, 15.0
    faults = schedule(seed, start=start, quiet_tail=quiet_tail)
    assert {kind: sum(f.kind == kind for f in faults) for kind in FAULT_KINDS} == COUNTS
    assert faults == sorted(faults, key=lambda f: f.at)
    for fault in faults:
        assert fault.at >= start
        assert fault.at + fault.duration <= DURATION - quiet_tail + 1e-9
        low, high = {
            "drop": (0.5, 3.0),
            "stall": (1.5 * KEEPALIVE, 2.5 * KEEPALIVE),
            "broker_kill": (0.5, 2.0),
            "device_restart": (0.2, 2.0),
        }[fault.kind]
        assert low <= fault.duration <= high
        if fault.kind == "broker_kill":
            assert fault.target is None
        elif fault.kind == "device_restart":
            assert fault.target in DEVICES
        else:
            assert fault.target in [*DEVICES, ALL_DEVICES]
    for kind in FAULT_KINDS:
        mine = [f for f in faults if f.kind == kind]
        for earlier, later in itertools.pairwise(mine):
            gap = later.at - (earlier.at + earlier.duration)
            assert gap >= 0, f"{kind} faults overlap: {earlier} {later}"
            if kind == "broker_kill":
                assert gap >= max(earlier.duration, later.duration)


def test_random_schedule_spreads_faults_over_the_window() -> None:
    faults = schedule(3, counts={"drop": 10})
    window = (DURATION - 15.0 - 5.0) / 10
    for slot, fault in enumerate(faults):
        assert 5.0 + slot * window <= fault.at < 5.0 + (slot + 1) * window


def test_random_schedule_stalls_outlast_the_keepalive() -> None:
    for seed in range(10):
        for fault in schedule(seed, counts={"stall": 4}, keepalive=30.0, duration=900.0):
            assert fault.duration >= 1.5 * 30.0


def test_random_schedule_hits_all_devices_sometimes() -> None:
    faults = schedule(0, counts={"drop": 200, "stall": 0}, duration=3000.0)
    share = sum(f.target == ALL_DEVICES for f in faults) / len(faults)
    assert 0.1 < share < 0.3


def test_random_schedule_without_faults() -> None:
    assert schedule(counts={}) == []
    assert schedule(counts={"broker_kill": 2}, devices=[]) != []


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"counts": {"stall": 4}, "keepalive": 30.0, "duration": 199.0},
            r"the fault window \[5s, 199s - quiet tail 15s\] is 179s: too short for 4 stall fault\(s\) of at least "
            r"45s each; it needs at least 180s",
        ),
        ({"counts": {"broker_kill": 10}, "duration": 30.0}, r"broker_kill .*3x: a broker kill keeps its down time"),
        ({"counts": {"drop": 1}, "duration": 10.0}, r"is 0s: too short for 1 drop"),
        ({"counts": {"drop": 1}, "devices": []}, "need at least one device"),
        ({"counts": {"crash": 1}}, r"unknown fault kind\(s\) 'crash' \(valid: drop, stall, broker_kill"),
        ({"counts": {"drop": -1}}, "must be 0 or more"),
    ],
)
def test_random_schedule_rejects(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        schedule(**overrides)


def test_random_schedule_rejects_a_bad_keepalive() -> None:
    with pytest.raises(ValueError, match="keepalive must be more than 0"):
        schedule(keepalive=0)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "faults.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def load(path: Path, duration: float = 120.0) -> list[Fault]:
    return load_schedule(path, devices=DEVICES, duration=duration)


EXAMPLE = """\
faults:
  - {at: 30s, kind: device_restart, device: dev-010, for: 500ms}
  - {at: 5s, kind: drop, device: dev-003, for: 2s}
  - {at: 12, kind: stall, device: all, for: 40s}
  - {at: 20s, kind: broker_kill, for: 1s}
"""


def test_load_schedule_example(tmp_path: Path) -> None:
    assert load(write(tmp_path, EXAMPLE)) == [
        Fault(5.0, "drop", "dev-003", 2.0),
        Fault(12.0, "stall", ALL_DEVICES, 40.0),
        Fault(20.0, "broker_kill", None, 1.0),
        Fault(30.0, "device_restart", "dev-010", 0.5),
    ]


def test_load_schedule_json(tmp_path: Path) -> None:
    document = {"faults": [{"at": 5, "kind": "drop", "device": "dev-001", "for": "1m"}]}
    expected = [Fault(5.0, "drop", "dev-001", 60.0)]
    assert load(write(tmp_path, json.dumps(document))) == expected
    assert load(write(tmp_path, json.dumps(document, indent="\t"))) == expected  # tabs: not YAML


def test_load_schedule_empty_list(tmp_path: Path) -> None:
    assert load(write(tmp_path, "faults: []\n")) == []


def one(fault: str) -> str:
    return f"faults:\n  - {{at: 1s, kind: drop, device: dev-000, for: 1s}}\n  - {fault}\n"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("- {at: 1s}\n", "expected a mapping with a 'faults' list"),
        ("faults: {at: 1s}\n", "expected a mapping with a 'faults' list"),
        ("", "expected a mapping with a 'faults' list"),
        ("faults: []\nseed: 4\nextra: 1\n", r"unknown top-level key\(s\) 'extra', 'seed' \(only 'faults'\)"),
        ("faults: [\n", "not YAML or JSON"),
        ("faults: " + "[" * 5000 + "]" * 5000 + "\n", "not YAML or JSON: nested too deeply"),
        ("{\t\"faults\": " + "[" * 5000 + "]" * 5000 + "}\n", "not YAML or JSON: "),
        (one("5s"), "fault 2: expected a mapping such as"),
        (
            one("{at: 1s, kind: drop, device: dev-000, for: 1s, when: 2, why: x}"),
            r"fault 2: unknown key\(s\) 'when', 'why' \(valid: at, kind, device, for\)",
        ),
        (one("{at: 1s, device: dev-000, for: 1s}"), "fault 2: kind: missing"),
        (one("{kind: drop, device: dev-000, for: 1s}"), "fault 2: at: missing"),
        (one("{at: 1s, kind: drop, device: dev-000}"), "fault 2: for: missing"),
        (
            one("{at: 1s, kind: crash, for: 1s}"),
            r"fault 2: kind: unknown kind 'crash' \(valid: drop, stall, broker_kill, device_restart\)",
        ),
        (one("{at: soon, kind: drop, device: dev-000, for: 1s}"), "fault 2: at: not a duration: 'soon'"),
        (one("{at: -3s, kind: drop, device: dev-000, for: 1s}"), "fault 2: at: negative duration"),
        (one("{at: 1s, kind: drop, device: dev-000, for: 2d}"), "fault 2: for: not a duration: '2d'"),
        (one("{at: 1s, kind: drop, device: dev-000, for: 0}"), "fault 2: for: must be more than 0"),
        (
            one("{at: 100s, kind: drop, device: dev-000, for: 30s}"),
            r"fault 2: for: the fault ends at 130s, after the run's duration of 120s",
        ),
        (one("{at: 1s, kind: stall, for: 1s}"), r"fault 2: device: missing \(a stall needs the device it hits\)"),
        (
            one("{at: 1s, kind: broker_kill, device: dev-000, for: 1s}"),
            "fault 2: device: a broker_kill hits the broker, not a device",
        ),
        (
            one("{at: 1s, kind: device_restart, device: all, for: 1s}"),
            "fault 2: device: a device_restart restarts one device's process: name a device, not 'all'",
        ),
        (
            one("{at: 1s, kind: drop, device: dev-999, for: 1s}"),
            r"fault 2: device: unknown device 'dev-999' \(the fleet's 20 devices are dev-000 .. dev-019; "
            r"or 'all' for all of them\)",
        ),
        (
            one("{at: 1s, kind: device_restart, device: dev-999, for: 1s}"),
            r"unknown device 'dev-999' \(the fleet's 20 devices are dev-000 .. dev-019\)$",
        ),
        (
            "faults:\n  - {at: 20s, kind: broker_kill, for: 5s}\n  - {at: 10s, kind: broker_kill, for: 11s}\n",
            r"fault 1: at: starts during fault 2 \(broker_kill at 10s for 11s\): two broker_kill faults on the broker",
        ),
        (
            one("{at: 1.5s, kind: drop, device: all, for: 1s}"),
            r"fault 2: at: starts during fault 1 \(drop on dev-000 at 1s for 1s\): two drop faults on one device",
        ),
    ],
)
def test_load_schedule_rejects(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ScheduleError, match=message) as caught:
        load(path)
    assert str(caught.value).startswith(f"{path}: ")


def test_load_schedule_names_a_device_in_a_fleet_without_devices(tmp_path: Path) -> None:
    with pytest.raises(ScheduleError, match=r"unknown device 'dev-000' \(the fleet has no devices"):
        load_schedule(write(tmp_path, one("{at: 5s, kind: drop, device: dev-000, for: 1s}")), devices=[], duration=60)


def test_load_schedule_error_fields(tmp_path: Path) -> None:
    path = write(tmp_path, one("{at: 1s, kind: drop, device: dev-000, for: never}"))
    with pytest.raises(ScheduleError) as caught:
        load(path)
    assert (caught.value.path, caught.value.fault, caught.value.field) == (path, 2, "for")


def test_load_schedule_unreadable(tmp_path: Path) -> None:
    with pytest.raises(ScheduleError, match="cannot read the schedule"):
        load(tmp_path / "missing.yaml")


def test_load_schedule_allows_other_overlaps(tmp_path: Path) -> None:
    text = """\
faults:
  - {at: 1s, kind: drop, device: dev-000, for: 5s}
  - {at: 2s, kind: drop, device: dev-001, for: 5s}
  - {at: 3s, kind: stall, device: dev-000, for: 5s}
  - {at: 4s, kind: broker_kill, for: 1s}
  - {at: 5s, kind: broker_kill, for: 1s}
"""
    assert len(load(write(tmp_path, text))) == 5


def test_dump_then_load_gives_the_same_faults(tmp_path: Path) -> None:
    faults = schedule(11)
    path = tmp_path / "dumped.yaml"
    dump_schedule(faults, path)
    assert load_schedule(path, devices=DEVICES, duration=DURATION) == faults
    text = path.read_text(encoding="utf-8")
    assert text.startswith("#")
    assert "- {at: " in text  # one line per fault, as a person writes it


def test_dump_keeps_awkward_values(tmp_path: Path) -> None:
    faults = [Fault(0.1 + 0.2, "drop", "dev-001", 1e-05), Fault(3600.0, "stall", ALL_DEVICES, 1234.5678)]
    path = tmp_path / "dumped.yaml"
    dump_schedule(faults, path)
    assert load_schedule(path, devices=DEVICES, duration=5000.0) == faults
