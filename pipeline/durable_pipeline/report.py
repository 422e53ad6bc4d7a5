"""The audit's one-page HTML report and its PNG charts (matplotlib's Figure, Agg: no display needed).

The page is for the person who reads a failed test run: the verdict first, then why, then the
per-device table, then the two charts (replay latency distribution, loss per device) as PNG
files next to report.html, so the folder can be archived or served as it is.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import TYPE_CHECKING

from matplotlib.figure import Figure

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from .audit import AuditResult, DeviceStats

LATENCY_CHART = "replay_latency.png"
LOSS_CHART = "loss_per_device.png"
MAX_DEVICES_CHARTED = 40
"""Loss chart: the devices that lost most (then by name), so a fleet of thousands stays legible."""
MAX_DEVICES_LISTED = 500
"""Report table rows; summary.parquet has every device."""
HEADERS = (
    ("device", "device"),
    ("expected", "expected"),
    ("received", "received"),
    ("lost", "lost"),
    ("duplicated", "duplicated"),
    ("out_of_order", "out of order"),
    ("unknown", "unknown"),
    ("replayed", "replayed"),
    ("replay_p50_ms", "replay p50 (ms)"),
    ("replay_p99_ms", "replay p99 (ms)"),
    ("drain_p50_s", "drain p50 (s)"),
    ("drain_max_s", "drain max (s)"),
)


def write_report(result: AuditResult, out: Path) -> list[Path]:
    """Write the charts and report.html into ``out``; return the chart paths."""
    charts = [_latency_chart(result, out / LATENCY_CHART), _loss_chart(result, out / LOSS_CHART)]
    result.report_path.write_text(_page(result, charts), encoding="utf-8")
    return charts


def cell(stats: DeviceStats, name: str) -> str:
    """A summary value as text: counts as integers, figures with 3 significant decimals, '-' for none."""
    value = getattr(stats, name)
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def chart_label(text: str) -> str:
    """``text`` as matplotlib shows it verbatim: every ``$`` escaped, so no pair of them starts mathtext.

    A device id is a client id and may hold ``$`` or ``\\``; unescaped, ``a$\\x$`` would be parsed
    as mathtext and fail the chart (unknown symbol). With no unescaped ``$`` left matplotlib shows
    the text as it is (a ``\\`` outside mathtext is a plain character) and turns each ``\\$`` back
    into ``$``.
    """
    return text.replace("$", r"\$")


def _figure() -> tuple[Figure, Axes]:
    """A Figure without pyplot: no global state, and savefig renders with Agg (no display needed)."""
    figure = Figure(figsize=(8, 4.2), dpi=100)
    return figure, figure.subplots()


def _latency_chart(result: AuditResult, path: Path) -> Path:
    fig, ax = _figure()
    bins = result.latency_bins
    if bins:
        ax.bar(
            [b.low_ms for b in bins],
            [b.count for b in bins],
            width=[b.high_ms - b.low_ms for b in bins],
            align="edge",
            color="#4c72b0",
            edgecolor="white",
        )
        ax.set_xscale("log")
        total = result.total
        for value, label in ((total.replay_p50_ms, "p50"), (total.replay_p99_ms, "p99")):
            if value is not None and value > 0:
                ax.axvline(value, color="#c44e52", linestyle="--", linewidth=1)
                ax.annotate(label, (value, 1), xycoords=("data", "axes fraction"), va="top", color="#c44e52")
    else:
        ax.text(0.5, 0.5, "no replayed receives", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("replay latency (ms, log scale): receive time - send time")
    ax.set_ylabel("replayed receives")
    ax.set_title("Replay latency distribution")
    fig.tight_layout()
    fig.savefig(path)
    return path


def loss_bars(ax: Axes, devices: list[str], lost: list[int], duplicated: list[int]) -> None:
    """Lost and duplicated per device, stacked: the audit's and the fleet's loss charts."""
    names = [chart_label(device) for device in devices]
    ax.bar(names, lost, color="#c44e52", label="lost")
    ax.bar(names, duplicated, bottom=lost, color="#dd8452", label="duplicated")
    ax.tick_params(axis="x", labelrotation=90, labelsize=7)
    ax.legend()


def _loss_chart(result: AuditResult, path: Path) -> Path:
    fig, ax = _figure()
    devices = sorted(result.devices, key=lambda d: (-d.lost, d.device))[:MAX_DEVICES_CHARTED]
    if devices:
        loss_bars(ax, [d.device for d in devices], [d.lost for d in devices], [d.duplicated for d in devices])
    if not any(d.lost or d.duplicated for d in devices):
        ax.text(0.5, 0.5, "nothing lost or duplicated", ha="center", va="center", transform=ax.transAxes)
    shown = f" (the {len(devices)} that lost most)" if len(result.devices) > MAX_DEVICES_CHARTED else ""
    ax.set_title(f"Loss per receiving device{shown}")
    ax.set_ylabel("messages")
    fig.tight_layout()
    fig.savefig(path)
    return path


def _page(result: AuditResult, charts: list[Path]) -> str:
    esc = html.escape
    colour = "#2a7a2a" if result.ok else "#b22222"
    rows = [result.total, *result.devices[:MAX_DEVICES_LISTED]]
    table = "\n".join(
        "<tr>" + "".join(f"<td>{esc(cell(stats, name))}</td>" for name, _ in HEADERS) + "</tr>" for stats in rows
    )
    more = (
        f"<p>{len(result.devices) - MAX_DEVICES_LISTED} more devices in summary.parquet.</p>"
        if len(result.devices) > MAX_DEVICES_LISTED
        else ""
    )
    failures = "".join(f"<li>{esc(text)}</li>" for text in result.failures)
    notes = "".join(f"<li>{esc(text)}</li>" for text in result.notes)
    images = "\n".join(f'<p><img src="{esc(chart.name)}" alt="{esc(chart.stem)}"></p>' for chart in charts)
    inputs = ", ".join(esc(path) for path in result.inputs)
    asked = "order checked" if result.check_order else "order not checked"
    if result.count_qos0:
        asked += ", QoS 0 counted"
        expected = "sends of any QoS on a topic a durable subscription of any QoS matched while it was open"
    else:
        expected = "QoS&ge;1 sends on a topic a durable QoS&ge;1 subscription matched while it was open"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>Delivery audit: {esc(result.verdict)}</title>
<style>
body {{ font-family: sans-serif; margin: 2em; }}
h1 {{ color: {colour}; }}
table {{ border-collapse: collapse; }}
td, th {{ border: 1px solid #ccc; padding: 2px 8px; text-align: right; }}
td:first-child, th:first-child {{ text-align: left; }}
tr:nth-child(2) {{ font-weight: bold; }}
</style></head>
<body>
<h1>{esc(result.verdict)}</h1>
<ul>{failures}</ul>
<p>{result.records} records from {inputs}. Asked: <b>{esc(result.expect)}</b>
({asked}).</p>
{"<h2>Notes</h2><ul>" + notes + "</ul>" if notes else ""}
<h2>Per receiving device</h2>
<table>
<tr>{"".join(f"<th>{esc(label)}</th>" for _, label in HEADERS)}</tr>
{table}
</table>
{more}
<h2>Charts</h2>
{images}
<p>Definitions: docs/delivery-log.md, "What the audit computes". Expected = {expected} (from its
subscribe to an unsubscribe or the session's end); duplicated = the same delivery processed again,
or received more often than sent; out of order = received after a message sent later on the same
topic by the same publisher; unknown = received but sent by no log.</p>
</body></html>
"""
