"""What a fleet run is made of and what it found: plain data shared by the schedule, the runner
and the report, so each can be tested without the others."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

BrokerFaultKind = Literal["drop", "stall", "broker_kill", "device_restart"]
"""The faults of a run against one broker."""
HaFaultKind = Literal["primary_kill", "partition", "group_kill"]
"""The faults of a run against a replicated pair (``--ha``): primary_kill and partition hit whichever
broker is primary, group_kill both brokers at once (a full stop of the group)."""
FaultKind = BrokerFaultKind | HaFaultKind
FAULT_KINDS: tuple[str, ...] = get_args(BrokerFaultKind)
HA_FAULT_KINDS: tuple[str, ...] = get_args(HaFaultKind)
ALL_FAULT_KINDS: tuple[str, ...] = FAULT_KINDS + HA_FAULT_KINDS
DeviceKind = Literal["cpl1", "cpl2", "paho"]
"""An SDK client with in-memory duplicate detection (CPL-1), with its fsync'd journal (CPL-2),
or a plain paho client (clean_session=False, QoS 1): at-least-once only."""
DEVICE_KINDS: tuple[str, ...] = get_args(DeviceKind)
ALL_DEVICES = "all"
"""The target of a drop or stall that hits every device at once."""
STOP_WAIT = 15.0
"""Seconds a process the harness started (a worker, a publisher, a broker, either of an HA pair's) gets
after its SIGTERM before its SIGKILL when the harness stops it."""


@dataclass(frozen=True)
class Fault:
    """One fault of the schedule.

    ``at`` is seconds after the publishers start. ``duration``: how long the link stays cut
    (drop), blackholed (stall), the broker stays dead (broker_kill), the device's process
    stays dead (device_restart), the killed primary stays dead (primary_kill), the primary
    stays cut off from etcd (partition) or both brokers of the pair stay dead (group_kill)
    before it is restored, restarted or healed.
    ``target``: a device name or ``ALL_DEVICES`` for drop and stall, a device name for
    device_restart (its whole process restarts), None for broker_kill, primary_kill,
    partition (the broker that is primary when the fault begins) and group_kill (both brokers).
    """

    at: float
    kind: FaultKind
    target: str | None
    duration: float


@dataclass(frozen=True)
class AppliedFault:
    """A fault as it happened: ``started``/``ended`` are seconds after the publishers started;
    ``detail`` says what it touched (e.g. the devices of a restarted process)."""

    fault: Fault
    started: float
    ended: float
    detail: str = ""


@dataclass(frozen=True)
class Sample:
    """The broker and fleet once a second; ``time`` in seconds after the publishers started."""

    time: float
    queued: int | None
    """Messages in all durable queues ($SYS/broker/durable/messages/queued), None before the first report."""
    broker_cpu_percent: float | None
    """CPU of the broker process since the previous sample (100 = one core); None for a broker not started here."""
    broker_rss_bytes: int | None
    devices_connected: int
    sent: int
    """Acknowledged sends so far (all publishers)."""
    received: int
    """Receives processed so far (all devices, duplicates included)."""


@dataclass(frozen=True)
class LatencyPoint:
    """A replayed receive: when it was processed (seconds after the start) and its replay latency."""

    time: float
    latency_ms: float
    device: str


@dataclass(frozen=True)
class DeviceOutcome:
    """One device's verdict; the counts are the Spark audit's."""

    device: str
    kind: DeviceKind
    expected: int
    received: int
    lost: int
    duplicated: int
    out_of_order: int
    restarts: int
    drops: int
    stalls: int
    ok: bool
    why: str = ""
    """Why not ok ('' when ok): e.g. '3 lost; 2 duplicated (CPL-2 asks for exactly once)'."""


@dataclass
class FleetResult:
    """Everything a fleet run found; ``ok`` decides the exit status."""

    ok: bool
    failures: list[str]
    devices: list[DeviceOutcome]
    faults: list[AppliedFault]
    samples: list[Sample]
    latencies: list[LatencyPoint]
    settings: dict[str, str]
    """What was run (devices, mix, rate, duration, qos, seed or schedule file, broker), as shown."""
    sent: int
    duration_s: float
    out: Path
    audit_report: Path | None
    """The Spark audit's own report.html (per-device figures, latency distribution)."""
    report_path: Path | None = None
    charts: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
