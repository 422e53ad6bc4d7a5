"""durable_fleet.report: the printed summary and report.html with its PNG charts, from hand-built results."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from durable_fleet.model import (
    ALL_DEVICES,
    AppliedFault,
    DeviceOutcome,
    Fault,
    FleetResult,
    LatencyPoint,
    Sample,
)
from durable_fleet.report import format_summary, write_fleet_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
BOLD = "dev-<b>7</b>"


def outcome(device: str, kind: str, *, lost: int = 0, duplicated: int = 0, why: str = "") -> DeviceOutcome:
    return DeviceOutcome(
        device=device,
        kind=kind,  # type: ignore[arg-type]
        expected=100,
        received=100 - lost + duplicated,
        lost=lost,
        duplicated=duplicated,
        out_of_order=0,
        restarts=1,
        drops=2,
        stalls=0,
        ok=not why,
        why=why,
    )


FAULTS = [
    AppliedFault(Fault(5.0, "drop", "dev-001", 2.0), 5.01, 7.02),
    AppliedFault(Fault(8.0, "stall", ALL_DEVICES, 12.0), 8.0, 20.1),
    AppliedFault(Fault(10.0, "broker_kill", None, 1.0), 10.0, 11.5, "pid 4242"),
    AppliedFault(Fault(14.0, "device_restart", "dev-002", 0.5), 14.0, 14.5, "dev-002, dev-003"),
]


def passing(out: Path) -> FleetResult:
    devices = [
        outcome("dev-001", "cpl1"),
        outcome("dev-002", "cpl2"),
        outcome("dev-003", "paho", duplicated=3),  # at-least-once: duplicates are allowed
    ]
    samples = [
        Sample(float(t), None if t == 0 else t * 10, 12.5 + t, 50_000_000 + t * 1000, 3, t * 100, t * 100)
        for t in range(30)
    ]
    latencies = [LatencyPoint(5.0 + i / 10, 1.0 + i, f"dev-00{1 + i % 4}") for i in range(50)]
    audit = out / "audit" / "report.html"
    return FleetResult(
        ok=True,
        failures=[],
        devices=devices,
        faults=FAULTS,
        samples=samples,
        latencies=latencies,
        settings={"devices": "3", "mix": "cpl1=1,cpl2=1,paho=1", "seed": "7"},
        sent=300,
        duration_s=30.0,
        out=out,
        audit_report=audit,
    )


def failing(out: Path, audit: Path | None = None) -> FleetResult:
    devices = [
        outcome("dev-001", "cpl1", lost=4, why="4 lost"),
        outcome("dev-002", "cpl2", duplicated=2, why="2 duplicated (CPL-2 asks for exactly once)"),
        outcome(BOLD, "cpl2", lost=1, duplicated=1, why="1 lost; 1 duplicated <again>"),
        outcome("dev-004", "paho"),
    ]
    return FleetResult(
        ok=False,
        failures=["3 devices failed", "dev-<b>7</b> lost 1"],
        devices=devices,
        faults=[],
        samples=[],
        latencies=[],
        settings={"schedule": "faults <1>.yaml"},
        sent=400,
        duration_s=60.0,
        out=out,
        audit_report=audit,
        notes=["broker & devices on one host"],
    )


def test_summary_of_a_passing_run(tmp_path: Path) -> None:
    lines = format_summary(passing(tmp_path)).splitlines()
    assert lines[0] == "fleet run: 3 devices, 300 messages sent in 30.0 s"
    assert lines[1:6] == [
        "kind   devices  expected  received  lost  duplicated  out of order  verdict",
        "cpl1         1       100       100     0           0             0  ok",
        "cpl2         1       100       100     0           0             0  ok",
        "paho         1       100       103     0           3             0  ok",
        "total        3       300       303     0           3             0  ok",
    ]
    assert "failing devices" not in "\n".join(lines)
    assert "faults applied: 4 (1 drop, 1 stall, 1 broker_kill, 1 device_restart)" in lines
    assert lines[-1] == "PASS: all 3 devices delivered what their kind promises through 4 faults (300 messages sent)"


def test_summary_of_a_failing_run(tmp_path: Path) -> None:
    text = format_summary(failing(tmp_path))
    lines = text.splitlines()
    assert lines[2].split() == ["cpl1", "1", "100", "96", "4", "0", "0", "1", "failing"]
    assert lines[3].split() == ["cpl2", "2", "200", "202", "1", "3", "0", "2", "failing"]
    assert lines[5].split() == ["total", "4", "400", "398", "5", "3", "0", "3", "failing"]
    assert "failing devices (3 of 4):" in lines
    assert any(line.split()[:2] == [BOLD, "cpl2"] and line.endswith("1 lost; 1 duplicated <again>") for line in lines)
    assert not any(line.startswith("dev-004") for line in lines)
    assert "faults applied: 0 (0 drop, 0 stall, 0 broker_kill, 0 device_restart)" in lines
    assert "note: broker & devices on one host" in lines
    assert lines[-1] == "FAIL: 3 devices failed; dev-<b>7</b> lost 1"
    assert "\x1b" not in text


def test_summary_lists_at_most_20_failing_devices(tmp_path: Path) -> None:
    result = failing(tmp_path)
    result.devices = [outcome(f"dev-{i:03d}", "cpl1", lost=1, why="1 lost") for i in range(25)]
    lines = format_summary(result).splitlines()
    assert "failing devices (25 of 25):" in lines
    assert sum(line.startswith("dev-") for line in lines) == 20
    assert "... and 5 more (report.html lists them)" in lines


def test_summary_without_failures_recorded(tmp_path: Path) -> None:
    result = failing(tmp_path)
    result.failures = []
    assert format_summary(result).endswith("FAIL: no failure recorded")


def assert_pngs(charts: list[Path], out: Path) -> None:
    assert len(charts) == 4
    for chart in charts:
        assert chart.parent == out
        assert chart.read_bytes()[:8] == PNG_MAGIC


def test_report_of_a_passing_run(tmp_path: Path) -> None:
    result = passing(tmp_path)
    charts = write_fleet_report(result)
    assert_pngs(charts, tmp_path)
    assert result.charts == charts
    assert result.report_path == tmp_path / "report.html"
    page = result.report_path.read_text(encoding="utf-8")
    assert page.index("<h1>PASS</h1>") < page.index("Settings") < page.index("Per device kind")
    assert "No failing device." in page
    for chart in charts:
        assert f'<img src="{chart.name}"' in page
    assert '<a href="audit/report.html">' in page
    assert "<td>pid 4242</td>" in page
    assert "<td class=n>14.50</td>" in page
    assert "<td>cpl1=1,cpl2=1,paho=1</td>" in page
    assert "report: " + str(tmp_path / "report.html") in format_summary(result)


def test_report_of_a_failing_run_without_samples(tmp_path: Path) -> None:
    out = tmp_path / "run"
    audit = tmp_path / "elsewhere" / "report.html"
    result = failing(out, audit)
    charts = write_fleet_report(result)
    assert_pngs(charts, out)
    page = (out / "report.html").read_text(encoding="utf-8")
    assert "<h1>FAIL</h1>" in page
    assert "<li>3 devices failed</li>" in page
    assert "<li>dev-&lt;b&gt;7&lt;/b&gt; lost 1</li>" in page
    assert BOLD not in page
    assert "dev-&lt;b&gt;7&lt;/b&gt;" in page
    assert "1 lost; 1 duplicated &lt;again&gt;" in page
    assert "faults &lt;1&gt;.yaml" in page
    assert "broker &amp; devices on one host" in page
    failing_section = page[page.index("Failing devices (3)") : page.index("All devices (4)")]
    assert "dev-001" in failing_section
    assert "dev-002" in failing_section
    assert "dev-004" not in failing_section
    assert f'href="{audit.resolve().as_uri()}"' in page


def test_report_without_audit_and_with_many_devices(tmp_path: Path) -> None:
    result = failing(tmp_path)
    result.devices = [outcome(f"dev-{i:04d}", "cpl1", lost=i % 2, why="1 lost" if i % 2 else "") for i in range(600)]
    write_fleet_report(result)
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert "No Spark audit report was written." in page
    assert page.count("<td>dev-") == 300 + 500
    assert "100 more not listed" in page


@pytest.mark.parametrize("device", ["a$b$c", "back\\slash$"])
def test_loss_chart_shows_mathtext_like_names(tmp_path: Path, device: str) -> None:
    result = failing(tmp_path)
    result.devices = [outcome(device, "cpl1", lost=1, why="1 lost")]
    assert_pngs(write_fleet_report(result), tmp_path)


def test_report_does_not_import_pyspark() -> None:
    """The report (and the audit's chart_label it reuses) must render without the Spark runtime loaded."""
    code = "import sys, durable_fleet.report; sys.exit(any(m.startswith('pyspark') for m in sys.modules))"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
