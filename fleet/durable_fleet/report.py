"""What a fleet run found: the summary printed at its end, and report.html with PNG charts.

House style of the audit's report (durable_pipeline.report): the verdict first, then why, then
the tables, then the charts as PNG files next to report.html (matplotlib's Figure with Agg, no
pyplot: no display, no global state), so the folder can be archived or served as it is. The
charts put the faults as shaded spans on a common time axis, so a queue build-up, a latency
spike or a CPU peak can be read against the fault that caused it. The Spark audit's own
report (per-device replay latency distribution) is linked, not repeated.
"""

from __future__ import annotations

import html
from collections import Counter
from collections.abc import Container, Sequence
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from durable_pipeline.report import loss_bars

from .model import DEVICE_KINDS, FAULT_KINDS, HA_FAULT_KINDS, DeviceOutcome, FleetResult

if TYPE_CHECKING:
    from matplotlib.axes import Axes

QUEUE_CHART = "fleet_queue_depth.png"
LATENCY_CHART = "fleet_replay_latency.png"
LOSS_CHART = "fleet_loss_per_device.png"
BROKER_CHART = "fleet_broker.png"
"""Chart names carry a ``fleet_`` prefix: the audit writes its own charts, maybe into the same folder."""
MAX_FAILING_PRINTED = 20
MAX_DEVICES_CHARTED = 40
"""Loss chart: the devices that lost or duplicated most, so a fleet of thousands stays legible."""
MAX_DEVICES_LISTED = 500
"""Rows per device table of report.html; the audit's report has every device."""
FAULT_COLOURS = {
    "drop": "#dd8452", "stall": "#8172b3", "broker_kill": "#c44e52", "device_restart": "#55a868",
    "primary_kill": "#937860", "partition": "#da8bc3", "group_kill": "#8c613c",
}
DEVICE_COLOURS = {"cpl1": "#4c72b0", "cpl2": "#64b5cd", "paho": "#937860"}
OTHER_COLOUR = "#999999"
"""Latency points of a device missing from the outcomes (the audit judged no such device)."""
TIME_LABEL = "seconds after the publishers started"

KIND_HEADER = ("kind", "devices", "expected", "received", "lost", "duplicated", "out of order", "verdict")
KIND_NUMBERS = range(1, 7)
DEVICE_HEADER = (
    "device",
    "kind",
    "expected",
    "received",
    "lost",
    "duplicated",
    "out of order",
    "restarts",
    "drops",
    "stalls",
    "why",
)
DEVICE_NUMBERS = range(2, 10)
FAULT_HEADER = ("started (s)", "kind", "target", "for (s)", "ended (s)", "detail")
FAULT_NUMBERS = (0, 3, 4)


def format_summary(result: FleetResult) -> str:
    """The plain-text summary printed when the run ends: per-kind table, failing devices, faults, verdict."""
    lines = [
        f"fleet run: {len(result.devices)} devices, {result.sent} messages sent in {result.duration_s:.1f} s",
        *_text_table([KIND_HEADER, *_kind_rows(result)], KIND_NUMBERS),
    ]
    failing = [d for d in result.devices if not d.ok]
    if failing:
        lines += ["", f"failing devices ({len(failing)} of {len(result.devices)}):"]
        rows = [(d.device, d.kind, d.why) for d in failing[:MAX_FAILING_PRINTED]]
        lines += _text_table([("device", "kind", "why"), *rows], ())
        if len(failing) > MAX_FAILING_PRINTED:
            lines.append(f"... and {len(failing) - MAX_FAILING_PRINTED} more (report.html lists them)")
    lines += ["", _faults_line(result)]
    lines += [f"note: {note}" for note in result.notes]
    if result.report_path is not None:
        lines.append(f"report: {result.report_path}")
    lines.append(_verdict(result))
    return "\n".join(lines)


def _verdict(result: FleetResult) -> str:
    if result.ok:
        return (
            f"PASS: all {len(result.devices)} devices delivered what their kind promises through "
            f"{len(result.faults)} faults ({result.sent} messages sent)"
        )
    return "FAIL: " + ("; ".join(result.failures) or "no failure recorded")


def _kind_rows(result: FleetResult) -> list[tuple[str, ...]]:
    """One row per device kind in the run, then the total, as printed and as in report.html."""
    groups = [(kind, [d for d in result.devices if d.kind == kind]) for kind in DEVICE_KINDS]
    rows = [_kind_row(kind, devices) for kind, devices in groups if devices]
    rows.append(_kind_row("total", result.devices))
    return rows


def _kind_row(label: str, devices: Sequence[DeviceOutcome]) -> tuple[str, ...]:
    failing = sum(not d.ok for d in devices)
    verdict = "no devices" if not devices else f"{failing} failing" if failing else "ok"
    counts = (
        len(devices),
        sum(d.expected for d in devices),
        sum(d.received for d in devices),
        sum(d.lost for d in devices),
        sum(d.duplicated for d in devices),
        sum(d.out_of_order for d in devices),
    )
    return (label, *map(str, counts), verdict)


def _faults_line(result: FleetResult) -> str:
    counts: Counter[str] = Counter(applied.fault.kind for applied in result.faults)
    kinds = [*FAULT_KINDS, *(kind for kind in HA_FAULT_KINDS if counts[kind])]  # HA kinds only in an HA run
    per_kind = ", ".join(f"{counts[kind]} {kind}" for kind in kinds)
    return f"faults applied: {len(result.faults)} ({per_kind})"


def _text_table(rows: Sequence[Sequence[str]], numbers: Container[int]) -> list[str]:
    """Columns padded to their widest cell: numbers right-aligned, text left."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            text.rjust(widths[i]) if i in numbers else text.ljust(widths[i]) for i, text in enumerate(row)
        ).rstrip()
        for row in rows
    ]


def write_fleet_report(result: FleetResult) -> list[Path]:
    """Write the charts and report.html into ``result.out``, record them on ``result``; return the charts."""
    out = result.out
    out.mkdir(parents=True, exist_ok=True)
    charts = [
        _queue_chart(result, out / QUEUE_CHART),
        _latency_chart(result, out / LATENCY_CHART),
        _loss_chart(result, out / LOSS_CHART),
        _broker_chart(result, out / BROKER_CHART),
    ]
    result.report_path = out / "report.html"
    result.charts = charts
    result.report_path.write_text(_page(result, charts), encoding="utf-8")
    return charts


def _figure() -> tuple[Figure, Axes]:
    """Wider than the audit's charts: a time axis over the whole run."""
    figure = Figure(figsize=(10, 4.2), dpi=100)
    return figure, figure.subplots()


def _say(ax: Axes, text: str) -> None:
    """Why a chart is empty, in its middle, so an empty chart is not mistaken for a broken one."""
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)


def _shade_faults(ax: Axes, result: FleetResult) -> None:
    """Each applied fault as a span in its kind's colour; one legend entry per kind."""
    labelled: set[str] = set()
    for applied in result.faults:
        kind = applied.fault.kind
        label = kind if kind not in labelled else None
        labelled.add(kind)
        ax.axvspan(applied.started, applied.ended, color=FAULT_COLOURS[kind], alpha=0.2, linewidth=0, label=label)


def _legend(ax: Axes, *others: Axes) -> None:
    """One legend for ``ax`` and its twins, or none when nothing is labelled (legend() would warn)."""
    handles, labels = ax.get_legend_handles_labels()
    for other in others:
        more_handles, more_labels = other.get_legend_handles_labels()
        handles += more_handles
        labels += more_labels
    if handles:
        ax.legend(handles, labels, loc="upper right", fontsize=8)


def _save(figure: Figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path)
    return path


def _queue_chart(result: FleetResult, path: Path) -> Path:
    fig, ax = _figure()
    points = [(s.time, s.queued) for s in result.samples if s.queued is not None]
    if points:
        ax.plot([t for t, _ in points], [q for _, q in points], color="#4c72b0", label="queued")
    else:
        _say(ax, "the broker reported no queue depth" if result.samples else "no samples")
    _shade_faults(ax, result)
    _legend(ax)
    ax.set_xlabel(TIME_LABEL)
    ax.set_ylabel("messages queued (all durable sessions)")
    ax.set_title("Durable queue depth, faults shaded")
    return _save(fig, path)


def _latency_chart(result: FleetResult, path: Path) -> Path:
    fig, ax = _figure()
    kind_of = {d.device: d.kind for d in result.devices}
    points = [p for p in result.latencies if p.latency_ms > 0]  # > 0: a log axis cannot show 0
    for kind in (*DEVICE_KINDS, None):
        mine = [p for p in points if kind_of.get(p.device) == kind]
        if mine:
            ax.scatter(
                [p.time for p in mine],
                [p.latency_ms for p in mine],
                s=4,
                alpha=0.5,
                color=DEVICE_COLOURS[kind] if kind is not None else OTHER_COLOUR,
                label=kind if kind is not None else "other",
            )
    if points:
        ax.set_yscale("log")
    else:
        _say(ax, "no replayed receives")
    _shade_faults(ax, result)
    _legend(ax)
    ax.set_xlabel(TIME_LABEL)
    ax.set_ylabel("replay latency (ms, log scale)")
    ax.set_title("Replay latency of each replayed receive, faults shaded")
    return _save(fig, path)


def _loss_chart(result: FleetResult, path: Path) -> Path:
    fig, ax = _figure()
    lossy = [d for d in result.devices if d.lost or d.duplicated]
    worst = sorted(lossy, key=lambda d: (-(d.lost + d.duplicated), d.device))[:MAX_DEVICES_CHARTED]
    if worst:
        loss_bars(ax, [d.device for d in worst], [d.lost for d in worst], [d.duplicated for d in worst])
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    else:
        _say(ax, "no loss: nothing lost or duplicated")
    shown = f" (the {len(worst)} worst of {len(lossy)})" if len(lossy) > len(worst) else ""
    ax.set_title(f"Lost and duplicated per device{shown}")
    ax.set_ylabel("messages")
    return _save(fig, path)


def _broker_chart(result: FleetResult, path: Path) -> Path:
    fig, ax = _figure()
    rss_ax = ax.twinx()
    cpu = [(s.time, s.broker_cpu_percent) for s in result.samples if s.broker_cpu_percent is not None]
    rss = [(s.time, s.broker_rss_bytes / 1e6) for s in result.samples if s.broker_rss_bytes is not None]
    if cpu:
        ax.plot([t for t, _ in cpu], [c for _, c in cpu], color="#c44e52", label="CPU %")
    if rss:
        rss_ax.plot([t for t, _ in rss], [m for _, m in rss], color="#4c72b0", label="RSS MB")
    if not cpu and not rss:
        _say(ax, "broker not started by the harness: no CPU or memory figures" if result.samples else "no samples")
    _shade_faults(ax, result)
    _legend(ax, rss_ax)
    ax.set_xlabel(TIME_LABEL)
    ax.set_ylabel("broker CPU % (100 = one core)")
    rss_ax.set_ylabel("broker RSS (MB)")
    ax.set_title("Broker CPU and memory, faults shaded")
    return _save(fig, path)


def _html_table(header: Sequence[str], rows: Sequence[Sequence[object]], numbers: Container[int]) -> str:
    """Every cell escaped; numbers right-aligned like the printed table."""

    def row(cells: Sequence[object], tag: str) -> str:
        return (
            "<tr>"
            + "".join(
                f"<{tag}{' class=n' if i in numbers else ''}>{html.escape(str(text))}</{tag}>"
                for i, text in enumerate(cells)
            )
            + "</tr>"
        )

    return "<table>\n" + "\n".join([row(header, "th"), *(row(cells, "td") for cells in rows)]) + "\n</table>"


def _device_rows(devices: Sequence[DeviceOutcome]) -> list[tuple[object, ...]]:
    return [
        (
            d.device,
            d.kind,
            d.expected,
            d.received,
            d.lost,
            d.duplicated,
            d.out_of_order,
            d.restarts,
            d.drops,
            d.stalls,
            d.why,
        )
        for d in devices[:MAX_DEVICES_LISTED]
    ]


def _devices_section(title: str, devices: Sequence[DeviceOutcome]) -> str:
    more = (
        f"<p>{len(devices) - MAX_DEVICES_LISTED} more not listed; the Spark audit's report has every device.</p>"
        if len(devices) > MAX_DEVICES_LISTED
        else ""
    )
    return f"<h2>{html.escape(title)}</h2>\n{_html_table(DEVICE_HEADER, _device_rows(devices), DEVICE_NUMBERS)}\n{more}"


def _fault_rows(result: FleetResult) -> list[tuple[object, ...]]:
    return [
        (
            f"{applied.started:.2f}",
            applied.fault.kind,
            applied.fault.target if applied.fault.target is not None
            else "pair" if applied.fault.kind == "group_kill"
            else "primary" if applied.fault.kind in HA_FAULT_KINDS else "broker",
            f"{applied.fault.duration:g}",
            f"{applied.ended:.2f}",
            applied.detail,
        )
        for applied in result.faults
    ]


def _audit_link(result: FleetResult) -> str:
    """A relative link when the audit's report lies under ``out`` (the folder moves as one), else a file URI."""
    if result.audit_report is None:
        return "<p>No Spark audit report was written.</p>"
    report = result.audit_report.resolve()
    try:
        href = quote(report.relative_to(result.out.resolve()).as_posix())
    except ValueError:
        href = report.as_uri()
    return (
        f'<p>The Spark delivery audit\'s own report: <a href="{html.escape(href)}">{html.escape(str(report))}</a></p>'
    )


def _page(result: FleetResult, charts: Sequence[Path]) -> str:
    esc = html.escape
    word = "PASS" if result.ok else "FAIL"
    colour = "#2a7a2a" if result.ok else "#b22222"
    failures = "".join(f"<li>{esc(text)}</li>" for text in result.failures)
    notes = "".join(f"<li>{esc(text)}</li>" for text in result.notes)
    settings = [*result.settings.items(), ("sent", str(result.sent)), ("ran for", f"{result.duration_s:.1f} s")]
    failing = [d for d in result.devices if not d.ok]
    images = "\n".join(f'<p><img src="{esc(quote(chart.name))}" alt="{esc(chart.stem)}"></p>' for chart in charts)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>Fleet run: {word}</title>
<style>
body {{ font-family: sans-serif; margin: 2em; }}
h1 {{ color: {colour}; }}
table {{ border-collapse: collapse; margin-bottom: 1em; }}
td, th {{ border: 1px solid #ccc; padding: 2px 8px; text-align: left; }}
.n {{ text-align: right; }}
</style></head>
<body>
<h1>{word}</h1>
{f"<ul>{failures}</ul>" if failures else f"<p>{esc(_verdict(result))}</p>"}
{"<h2>Notes</h2><ul>" + notes + "</ul>" if notes else ""}
<h2>Settings</h2>
{_html_table(("setting", "value"), settings, ())}
<h2>Per device kind</h2>
{_html_table(KIND_HEADER, _kind_rows(result), KIND_NUMBERS)}
{_devices_section(f"Failing devices ({len(failing)})", failing) if failing else "<p>No failing device.</p>"}
{_devices_section(f"All devices ({len(result.devices)})", result.devices)}
<h2>Faults applied</h2>
<p>{esc(_faults_line(result))}</p>
{_html_table(FAULT_HEADER, _fault_rows(result), FAULT_NUMBERS)}
<h2>Charts</h2>
{images}
<h2>Delivery audit</h2>
{_audit_link(result)}
</body></html>
"""
