"""The fault schedule of a fleet run: drawn at random from a seed, or read from a YAML/JSON script.

A random run can be written out with ``dump_schedule`` and replayed as a script, so a failure
found by a seed can be reproduced, trimmed and kept as a regression case.

Script format (``at``: when, after the publishers start; ``for``: how long the fault lasts)::

    faults:
      - {at: 5s, kind: drop, device: dev-003, for: 2s}
      - {at: 12, kind: stall, device: all, for: 40s}
      - {at: 20s, kind: broker_kill, for: 1s}
      - {at: 30s, kind: device_restart, device: dev-010, for: 500ms}

With ``--ha`` (a replicated pair) there is no broker_kill; ``primary_kill`` and ``partition``
take no device (they hit whichever broker is primary when they begin), nor does ``group_kill``
(it SIGKILLs both brokers at once and starts both again after ``for``)::

      - {at: 10s, kind: primary_kill, for: 2s}
      - {at: 25s, kind: partition, for: 4s}
      - {at: 40s, kind: group_kill, for: 1s}
"""

from __future__ import annotations

import itertools
import json
import math
import random
import re
from collections.abc import Callable, Mapping, Sequence
from decimal import Decimal
from pathlib import Path
from typing import Any, cast

import yaml

from .errors import ScheduleError
from .model import ALL_DEVICES, ALL_FAULT_KINDS, FAULT_KINDS, HA_FAULT_KINDS, Fault, FaultKind

DEFAULT_START = 5.0
"""No fault in the first seconds: every device is connected and subscribed before the first one."""
DEFAULT_QUIET_TAIL = 15.0
"""No fault in the last seconds: devices reconnect (with backoff) and drain their queues, so the
audit judges a healed fleet, not one caught mid-fault."""
ALL_SHARE = 0.2
"""Share of the random drops and stalls that hit every device at once."""
FIXED_DURATIONS: dict[str, tuple[float, float]] = {
    "drop": (0.5, 3.0),
    "broker_kill": (0.5, 2.0),
    "device_restart": (0.2, 2.0),
    "primary_kill": (0.5, 3.0),
    "partition": (3.0, 6.0),
    "group_kill": (0.5, 3.0),
}
"""Random down times (seconds) per kind; a stall's depends on the keep-alive (STALL_KEEPALIVES).
A partition lasts at least 3 s: longer than the lease of the harness's pair (2 s) and the
backup's next check (0.3 s), so the primary steps down and the backup takes over every time."""
SPACED_KINDS = ("broker_kill", *HA_FAULT_KINDS)
"""Faults that keep their down time free before and after them: the broker (or the pair)
recovers before the next one."""
HA_ONLY = "{kind} needs a replicated pair: run with --ha (it hits {hits})"
NOT_WITH_HA = (
    "broker_kill is not available with --ha (the pair would lose both brokers); "
    "use primary_kill: SIGKILL of whichever broker is primary"
)
NOT_WITH_PORT = "broker_kill needs a broker the harness starts (--config), not --port: a running broker is not killed"
STALL_KEEPALIVES = (1.5, 2.5)
"""A random stall lasts this many keep-alives: past 1.5x the broker drops the silent client, so the
stall is a real one both peers notice, not a pause they ride out."""
KILL_SPACING = " (taken 3x: a broker kill keeps its down time free before and after it)"
SCRIPT_KEYS = ("at", "kind", "device", "for")

_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|h|m|s)")
_DURATION_HELP = "use seconds (12, 1.5) or numbers with units: 500ms, 30s, 10m, 1h, 1m30s"


def parse_duration(text: str | float | int) -> float:
    """Seconds from a number (12, 1.5) or text with units ("500ms", "30s", "10m", "1h", "1m30s")."""
    if isinstance(text, bool) or not isinstance(text, str | int | float):
        raise ValueError(f"not a duration: {text!r} ({_DURATION_HELP})")
    if isinstance(text, str):
        stripped = text.strip()
        if not stripped:
            raise ValueError(f"empty duration ({_DURATION_HELP})")
        try:
            seconds = float(stripped)
        except ValueError:
            seconds = _parse_units(stripped)
    else:
        seconds = float(text)
    if not math.isfinite(seconds):
        raise ValueError(f"not a duration: {text!r} (must be finite)")
    if seconds < 0:
        raise ValueError(f"negative duration: {text!r}")
    return seconds


def _parse_units(text: str) -> float:
    """``1m30s``: number-unit parts, each unit once and the larger first, so a typo such as
    ``30s1m`` or ``1m1m`` is reported instead of being added up."""
    if text.startswith("-"):
        raise ValueError(f"negative duration: {text!r}")
    parts = _PART.findall(text)
    if not parts or "".join(number + unit for number, unit in parts) != text:
        raise ValueError(f"not a duration: {text!r} ({_DURATION_HELP})")
    scales = [_UNITS[unit] for _, unit in parts]
    if any(later >= earlier for earlier, later in itertools.pairwise(scales)):
        raise ValueError(f"not a duration: {text!r} (each unit once, the largest first: 1h2m3s)")
    return sum(float(number) * _UNITS[unit] for number, unit in parts)


def format_duration(seconds: float) -> str:
    """``seconds`` as the script writes it ("5s", "1.234s"): exact, so a dumped schedule loads back equal."""
    return format(Decimal(repr(float(seconds))).normalize(), "f") + "s"


def random_schedule(
    seed: int,
    *,
    duration: float,
    devices: Sequence[str],
    counts: Mapping[FaultKind, int],
    keepalive: float,
    start: float = DEFAULT_START,
    quiet_tail: float = DEFAULT_QUIET_TAIL,
    ha: bool = False,
) -> list[Fault]:
    """``counts`` faults of each kind drawn from ``random.Random(seed)``, sorted by time.

    The window rule: every fault starts and ends inside ``[start, duration - quiet_tail]``, so
    the run's last ``quiet_tail`` seconds are fault-free and the run ends healed. Each kind is
    stratified on its own: the window is cut into one slot per fault of that kind and each
    fault lies wholly in its slot, so faults spread over the run and faults of one kind never
    overlap (faults of different kinds may: a drop during a broker kill is a case too). A
    broker kill also keeps its own down time free before and after it inside its slot, so two
    kills are apart by at least the sum of their down times. Times are whole milliseconds.

    With ``ha``, primary_kill, partition and group_kill faults (they hit the pair) share one
    stratification, in a random order, spaced as broker kills are: they never overlap, and the
    pair has their down time to recover before the next one. Without ``ha`` they are refused,
    and so is broker_kill with it.
    """
    if not keepalive > 0:
        raise ValueError(f"keepalive must be more than 0 seconds, got {keepalive!r}")
    unknown = sorted(set(counts) - set(ALL_FAULT_KINDS))
    if unknown:
        raise ScheduleError(f"unknown fault kind(s) {', '.join(map(repr, unknown))} ({_valid_kinds(ha)})")
    negative = {kind: n for kind, n in counts.items() if n < 0}
    if negative:
        raise ScheduleError(f"fault counts must be 0 or more, got {negative}")
    for kind in (kind for kind in counts if counts[kind]):
        problem = kind_problem(kind, ha)
        if problem:
            raise ScheduleError(problem)
    if not devices and any(counts.get(kind, 0) for kind in ("drop", "stall", "device_restart")):
        raise ScheduleError("drop, stall and device_restart faults need at least one device")
    rng = random.Random(seed)
    first_ms = math.ceil(start * 1000)
    last_ms = math.floor((duration - quiet_tail) * 1000)
    window = (first_ms, last_ms, f"the fault window [{start:g}s, {duration:g}s - quiet tail {quiet_tail:g}s] is "
              f"{max(last_ms - first_ms, 0) / 1000:g}s")
    faults: list[Fault] = []
    for kind in cast("tuple[FaultKind, ...]", FAULT_KINDS):
        faults += _stratified(rng, [kind] * counts.get(kind, 0), window, devices, keepalive)
    ha_kinds = [kind for kind in cast("tuple[FaultKind, ...]", HA_FAULT_KINDS) for _ in range(counts.get(kind, 0))]
    rng.shuffle(ha_kinds)  # one stratification for both: each slot holds one fault on the primary
    faults += _stratified(rng, ha_kinds, window, devices, keepalive)
    return sorted(faults, key=lambda f: (f.at, ALL_FAULT_KINDS.index(f.kind)))


def _stratified(
    rng: random.Random,
    kinds: Sequence[FaultKind],
    window: tuple[int, int, str],
    devices: Sequence[str],
    keepalive: float,
) -> list[Fault]:
    """One fault of ``kinds[i]`` in slot i of the window (whole milliseconds): never overlapping."""
    if not kinds:
        return []
    first_ms, last_ms, described = window
    count = len(kinds)
    slot_ms = (last_ms - first_ms) // count
    faults: list[Fault] = []
    for slot, kind in enumerate(kinds):
        low, high = _duration_range(kind, keepalive)
        share = 3 if kind in SPACED_KINDS else 1  # a kill's slot holds: quiet, down, quiet
        longest_ms = min(math.floor(high * 1000), slot_ms // share)
        shortest_ms = math.ceil(low * 1000)
        if longest_ms < shortest_ms:
            what = f"{count} {kind} fault(s)" if len(set(kinds)) == 1 else f"{count} {_listed(set(kinds))} faults"
            raise ScheduleError(
                f"{described}: too short for {what} of at least "
                f"{shortest_ms / 1000:g}s each{KILL_SPACING if share == 3 else ''}; "
                f"it needs at least {count * share * shortest_ms / 1000:g}s"
            )
        down_ms = rng.randint(shortest_ms, longest_ms)
        pad_ms = down_ms if share == 3 else 0
        slot_start = first_ms + slot * slot_ms
        at_ms = rng.randint(slot_start + pad_ms, slot_start + slot_ms - down_ms - pad_ms)
        faults.append(Fault(at_ms / 1000, kind, _random_target(rng, kind, devices), down_ms / 1000))
    return faults


def hits(kind: str) -> str:
    """What a fault of ``kind`` on the brokers hits, as the refusals say it."""
    if kind == "broker_kill":
        return "the broker"
    if kind == "group_kill":
        return "both brokers of the pair at once"
    return "whichever broker is primary"


def _listed(kinds: set[str]) -> str:
    """HA fault kinds in their order: ``primary_kill and partition``, ``primary_kill, partition and group_kill``."""
    names = [kind for kind in HA_FAULT_KINDS if kind in kinds]
    return " and ".join(names) if len(names) < 3 else ", ".join(names[:-1]) + f" and {names[-1]}"


def kind_problem(kind: str, ha: bool) -> str:
    """Why a fault of ``kind`` cannot run against one broker (``ha`` False) or a pair; '' if it can."""
    if kind in HA_FAULT_KINDS and not ha:
        return HA_ONLY.format(kind=kind, hits=hits(kind))
    if kind == "broker_kill" and ha:
        return NOT_WITH_HA
    return ""


def _valid_kinds(ha: bool) -> str:
    if ha:
        return "valid with --ha: " + ", ".join(kind for kind in ALL_FAULT_KINDS if kind != "broker_kill")
    return f"valid: {', '.join(FAULT_KINDS)}) (with --ha also {', '.join(HA_FAULT_KINDS)}"


def _duration_range(kind: FaultKind, keepalive: float) -> tuple[float, float]:
    if kind == "stall":
        return STALL_KEEPALIVES[0] * keepalive, STALL_KEEPALIVES[1] * keepalive
    return FIXED_DURATIONS[kind]


def _random_target(rng: random.Random, kind: FaultKind, devices: Sequence[str]) -> str | None:
    if kind in SPACED_KINDS:
        return None
    if kind != "device_restart" and rng.random() < ALL_SHARE:
        return ALL_DEVICES
    return rng.choice(devices)


def load_schedule(
    path: Path, *, devices: Sequence[str], duration: float, ha: bool = False, running_broker: bool = False
) -> list[Fault]:
    """The faults of a YAML or JSON script (JSON is YAML), validated against the fleet, the
    run's duration and its broker (one, or a pair with ``ha``; one the harness did not start, which
    it must not kill, with ``running_broker``), sorted by ``at``; any mistake is a ScheduleError
    naming file, fault and field."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ScheduleError(f"cannot read the schedule: {exc.strerror or exc}", path=path) from exc
    try:
        document = yaml.safe_load(text)
    except RecursionError as exc:  # PyYAML's composer recurses once per level
        raise ScheduleError("not YAML or JSON: nested too deeply", path=path) from exc
    except yaml.YAMLError as exc:
        try:
            document = json.loads(text)  # JSON is YAML, except for tab indentation (json.dump(indent="\t"))
        except (ValueError, RecursionError):
            raise ScheduleError(f"not YAML or JSON: {exc}", path=path) from exc
    if not isinstance(document, dict) or not isinstance(document.get("faults"), list):
        raise ScheduleError(
            "expected a mapping with a 'faults' list, e.g. faults: [{at: 5s, kind: drop, ...}]", path=path
        )
    extra = sorted(str(key) for key in document if key != "faults")
    if extra:
        raise ScheduleError(f"unknown top-level key(s) {', '.join(map(repr, extra))} (only 'faults')", path=path)
    faults = [
        _load_fault(entry, path, index, devices, duration, ha=ha, running_broker=running_broker)
        for index, entry in enumerate(document["faults"], 1)
    ]
    _check_overlaps(faults, path)
    return sorted(faults, key=lambda f: f.at)


def _load_fault(
    entry: Any, path: Path, index: int, devices: Sequence[str], duration: float, *, ha: bool, running_broker: bool
) -> Fault:
    def error(what: str, field: str | None = None) -> ScheduleError:
        return ScheduleError(what, path=path, fault=index, field=field)

    if not isinstance(entry, dict):
        raise error(f"expected a mapping such as {{at: 5s, kind: drop, device: dev-1, for: 2s}}, got {entry!r}")
    extra = sorted(str(key) for key in entry if key not in SCRIPT_KEYS)
    if extra:
        raise error(f"unknown key(s) {', '.join(map(repr, extra))} (valid: {', '.join(SCRIPT_KEYS)})")
    for field in ("kind", "at", "for"):
        if field not in entry:
            raise error("missing", field)
    kind = entry["kind"]
    if kind not in ALL_FAULT_KINDS:
        raise error(f"unknown kind {kind!r} ({_valid_kinds(ha)})", "kind")
    problem = NOT_WITH_PORT if kind == "broker_kill" and running_broker else kind_problem(kind, ha)
    if problem:
        raise error(problem, "kind")
    at, lasting = _load_times(entry, duration, error)
    return Fault(at, kind, _load_target(entry, kind, devices, error), lasting)


def _load_times(
    entry: dict[str, Any], duration: float, error: Callable[[str, str], ScheduleError]
) -> tuple[float, float]:
    times: dict[str, float] = {}
    for field in ("at", "for"):
        try:
            times[field] = parse_duration(entry[field])
        except ValueError as exc:
            raise error(str(exc), field) from exc
    if times["for"] == 0:
        raise error("must be more than 0", "for")
    end = times["at"] + times["for"]
    if end > duration:
        raise error(
            f"the fault ends at {end:g}s, after the run's duration of {duration:g}s (it must heal before the end)",
            "for",
        )
    return times["at"], times["for"]


def _load_target(
    entry: dict[str, Any],
    kind: FaultKind,
    devices: Sequence[str],
    error: Callable[[str, str], ScheduleError],
) -> str | None:
    if kind in SPACED_KINDS:
        if "device" in entry:
            raise error(f"a {kind} hits {hits(kind)}, not a device: remove 'device'", "device")
        return None
    if "device" not in entry:
        raise error(f"missing (a {kind} needs the device it hits)", "device")
    device = entry["device"]
    if device == ALL_DEVICES:
        if kind == "device_restart":
            raise error(f"a device_restart restarts one device's process: name a device, not {ALL_DEVICES!r}", "device")
        return ALL_DEVICES
    if not isinstance(device, str) or device not in devices:
        naming = (
            f"the fleet's {len(devices)} devices are {devices[0]} .. {devices[-1]}"
            if devices
            else "the fleet has no devices"
        )
        valid = f"; or {ALL_DEVICES!r} for all of them" if kind != "device_restart" else ""
        raise error(f"unknown device {device!r} ({naming}{valid})", "device")
    return device


def _check_overlaps(faults: list[Fault], path: Path) -> None:
    """Faults of one kind on a common device must not overlap: the first one's restore (link
    back, process started) would end the second early. Broker kills always share the broker;
    primary kills, partitions and group kills all share the pair (one of each at once could
    leave the pair without a broker caught up enough to take over)."""
    ordered = sorted(enumerate(faults, 1), key=lambda item: item[1].at)
    for position, (number, fault) in enumerate(ordered):
        for earlier_number, earlier in ordered[:position]:
            on_primary = earlier.kind in HA_FAULT_KINDS and fault.kind in HA_FAULT_KINDS
            if (
                (earlier.kind == fault.kind or on_primary)
                and _share_target(earlier, fault)
                and fault.at < earlier.at + earlier.duration
            ):
                raise ScheduleError(
                    f"starts during fault {earlier_number} ({_describe(earlier)}): {_overlap(earlier, fault)}",
                    path=path,
                    fault=number,
                    field="at",
                )


def _overlap(earlier: Fault, fault: Fault) -> str:
    """What two overlapping faults both hit, as the refusal says it."""
    kinds = {earlier.kind, fault.kind}
    if kinds <= set(HA_FAULT_KINDS):
        if "group_kill" in kinds:
            shared, exclusive = "the pair", set(HA_FAULT_KINDS)
        else:
            shared, exclusive = "the primary", {"primary_kill", "partition"}
        return f"two faults on {shared} at once ({_listed(exclusive)} faults must not overlap)"
    return f"two {fault.kind} faults on {'the broker' if fault.kind == 'broker_kill' else 'one device'} at once"


def _share_target(a: Fault, b: Fault) -> bool:
    return a.target is None or a.target == b.target or ALL_DEVICES in (a.target, b.target)


def _describe(fault: Fault) -> str:
    target = f" on {fault.target}" if fault.target is not None else ""
    return f"{fault.kind}{target} at {format_duration(fault.at)} for {format_duration(fault.duration)}"


def dump_schedule(faults: Sequence[Fault], path: Path) -> None:
    """Write ``faults`` as a script ``load_schedule`` reads back equal: a random run, replayable."""
    entries: list[dict[str, str]] = []
    for fault in faults:
        entry = {"at": format_duration(fault.at), "kind": fault.kind}
        if fault.target is not None:
            entry["device"] = fault.target
        entry["for"] = format_duration(fault.duration)
        entries.append(entry)
    text = yaml.safe_dump({"faults": entries}, sort_keys=False, default_flow_style=None, width=1_000_000)
    path.write_text(
        "# amqtt-durable fleet fault schedule. at: time after the publishers start; for: how long it lasts\n" + text,
        encoding="utf-8",
    )
