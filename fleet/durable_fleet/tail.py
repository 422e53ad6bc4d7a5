"""Follows the fleet's delivery logs while they grow, for the progress bar, the drain check and
the latency-over-time chart. The Spark audit judges the run afterwards from the same files; this
is only the live view (and tells the runner when every device has caught up)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .model import LatencyPoint

log = logging.getLogger(__name__)


@dataclass
class _DeviceView:
    topics: frozenset[str]
    early: set[str] = field(default_factory=set)
    """Ids received before their send was read (only those: memory stays bounded by what is in flight)."""
    missing: set[str] = field(default_factory=set)
    """Ids sent on one of its topics and not received yet."""
    subscribed: set[str] = field(default_factory=set)
    live: bool = False


class DeliveryTail:
    """Reads the complete new lines of every ``*.jsonl`` under ``folder`` on each ``poll()``.

    ``devices`` maps each device to the topics it subscribes to: a send on one of them is
    missing at that device until a receive of its id. ``start`` (Unix seconds) is the zero of
    the latency points' times.
    """

    def __init__(self, folder: Path, devices: Mapping[str, Iterable[str]], start: float = 0.0) -> None:
        self.folder = folder
        self.start = start
        self._views = {name: _DeviceView(frozenset(topics)) for name, topics in devices.items()}
        self._by_topic: dict[str, list[_DeviceView]] = {}
        for view in self._views.values():
            for topic in view.topics:
                self._by_topic.setdefault(topic, []).append(view)
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, bytes] = {}
        self._send_times: dict[str, float] = {}
        self._unmatched: dict[str, list[tuple[str, float]]] = {}
        """Replayed receives read before their send (another file, read later): timed at the send."""
        self.sent = 0
        self.received = 0
        self.latencies: list[LatencyPoint] = []

    def poll(self) -> None:
        for path in sorted(self.folder.glob("*.jsonl")):
            for line in self._new_lines(path):
                try:
                    record = json.loads(line)
                except (ValueError, RecursionError):  # RecursionError: nested past the interpreter's limit
                    record = None
                if not isinstance(record, dict):
                    log.warning("%s: a line that is not a JSON object (the audit will name it)", path.name)
                    continue
                self._apply(record)

    def _new_lines(self, path: Path) -> list[bytes]:
        offset = self._offsets.get(path, 0)
        with path.open("rb") as handle:
            handle.seek(offset)
            chunk = handle.read()
        self._offsets[path] = offset + len(chunk)
        data = self._partial.pop(path, b"") + chunk
        *lines, rest = data.split(b"\n")
        if rest:
            self._partial[path] = rest  # a line being written: the rest comes with the next poll
        return [line for line in lines if line]

    def _apply(self, record: dict[str, Any]) -> None:
        kind = record.get("kind")
        if kind == "send":
            self._sent(str(record["topic"]), str(record["id"]), float(record["time"]))
            return
        view = self._views.get(str(record.get("device")))
        if view is None:
            return
        if kind == "receive":
            self.received += 1
            message = str(record["id"])
            if message in self._send_times:
                view.missing.discard(message)
            else:
                view.early.add(message)
            if record.get("replayed"):
                self._replayed(message, str(record["device"]), float(record["time"]))
        elif kind == "subscribe":
            view.subscribed.add(str(record["topic"]))
        elif kind == "live":
            view.live = True

    def _replayed(self, message: str, device: str, at: float) -> None:
        sent_at = self._send_times.get(message)
        if sent_at is None:
            self._unmatched.setdefault(message, []).append((device, at))
        else:
            self.latencies.append(LatencyPoint(at - self.start, (at - sent_at) * 1000.0, device))

    def _sent(self, topic: str, message: str, at: float) -> None:
        self.sent += 1
        self._send_times[message] = at
        for device, received_at in self._unmatched.pop(message, ()):
            self._replayed(message, device, received_at)
        for view in self._by_topic.get(topic, ()):
            if message in view.early:
                view.early.discard(message)
            else:
                view.missing.add(message)

    def missing(self) -> int:
        """Sends not yet received, summed over the devices that subscribe to their topics."""
        return sum(len(view.missing) for view in self._views.values())

    def missing_by_device(self) -> dict[str, int]:
        return {name: len(view.missing) for name, view in self._views.items() if view.missing}

    def not_ready(self, need_live: Iterable[str]) -> list[str]:
        """Devices without a confirmed subscription to each of their topics, or (those in
        ``need_live``: SDK devices) without their first replay marker yet."""
        live = set(need_live)
        return sorted(
            name for name, view in self._views.items()
            if not view.topics <= view.subscribed or (name in live and not view.live)
        )
