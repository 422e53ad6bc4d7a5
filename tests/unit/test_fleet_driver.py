"""The fault driver of a fleet run against recording stand-ins for the proxy, broker and processes."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from durable_fleet.model import Fault
from durable_fleet.runner import FleetOptions, FleetRun, _BrokerUsage


class Recorder:
    """Stands in for the proxy, the broker and the worker processes; records what was called."""

    def __init__(self, calls: list[tuple[str, ...]], name: str, devices: tuple[str, ...] = ()) -> None:
        self.calls, self.name, self.down = calls, name, 0
        self.called = threading.Event()
        self.spec = SimpleNamespace(devices=[SimpleNamespace(name=device) for device in devices])

    def __getattr__(self, method: str) -> Any:
        def call(*args: Any) -> int:
            self.calls.append((self.name, method, *(str(arg) for arg in args)))
            self.called.set()
            return 1

        return call


def drive(tmp_path: Path, faults: list[Fault]) -> tuple[FleetRun, list[tuple[str, ...]]]:
    run = FleetRun(FleetOptions(out=tmp_path, config={}, devices=4, processes=2, faults=faults))
    calls: list[tuple[str, ...]] = []
    run.proxy = Recorder(calls, "proxy")
    run.broker = Recorder(calls, "broker")
    workers = [Recorder(calls, f"devices-{i}", tuple(run.names[i::2])) for i in range(2)]
    run.worker_of = {device.name: worker for worker in workers for device in worker.spec.devices}
    errors: list[BaseException] = []
    run.t0 = time.monotonic()
    run._drive_faults(threading.Event(), errors)
    assert errors == []
    return run, calls


def test_two_restarts_of_one_process_start_it_once_when_the_last_ends(tmp_path: Path) -> None:
    run, calls = drive(tmp_path, [Fault(0.0, "device_restart", "dev-000", 0.08),
                                  Fault(0.02, "device_restart", "dev-002", 0.02)])  # same process
    assert [call for call in calls if call[0] == "devices-0"] == [
        ("devices-0", "kill"), ("devices-0", "kill"), ("devices-0", "start")
    ]
    assert len(run.applied) == 2
    assert run.counts["dev-000"]["device_restart"] == 2  # both restarts restarted both devices
    assert run.applied[0].detail == "devices-0: dev-000, dev-002"


def test_ending_a_drop_keeps_a_stall_of_all_devices_in_force(tmp_path: Path) -> None:
    _, calls = drive(tmp_path, [Fault(0.0, "stall", "all", 0.08), Fault(0.02, "drop", "dev-001", 0.02)])
    assert calls == [
        ("proxy", "stall", "None"),
        ("proxy", "cut", "dev-001"),
        ("proxy", "restore", "dev-001"),
        ("proxy", "stall", "None"),  # the stall of all devices is applied again
        ("proxy", "restore", "None"),
    ]


def test_a_broker_kill_restarts_the_broker_after_its_down_time(tmp_path: Path) -> None:
    run, calls = drive(tmp_path, [Fault(0.0, "broker_kill", None, 0.03)])
    assert calls == [("broker", "kill"), ("broker", "start")]
    assert run.applied[0].ended is not None and run.applied[0].ended >= 0.03


def test_once_stopped_no_fault_begins_and_those_begun_end_at_once(tmp_path: Path) -> None:
    run = FleetRun(FleetOptions(out=tmp_path, config={}, devices=2, processes=1, faults=[
        Fault(0.0, "drop", "dev-000", 30.0), Fault(20.0, "stall", "dev-001", 1.0)]))
    calls: list[tuple[str, ...]] = []
    run.proxy = proxy = Recorder(calls, "proxy")
    stop = threading.Event()
    run.t0 = time.monotonic()
    driver = threading.Thread(target=run._drive_faults, args=(stop, []))
    driver.start()
    assert proxy.called.wait(10)  # the drop began
    stop.set()
    driver.join(10)
    assert not driver.is_alive()
    assert calls == [("proxy", "cut", "dev-000"), ("proxy", "restore", "dev-000")]


def test_broker_cpu_is_measured_over_half_a_second_at_least() -> None:
    """Two readings milliseconds apart would turn one 10 ms CPU tick into hundreds of percent."""
    usage = _BrokerUsage()
    me = os.getpid()
    assert usage.read(me)[0] is None  # the first reading of a process is the baseline
    cpu, rss = usage.read(me)
    assert cpu is None and rss is not None and rss > 0
    deadline = time.monotonic() + 0.6
    while time.monotonic() < deadline:  # busy: this process is its own "broker"
        pass
    cpu, _ = usage.read(me)
    assert cpu is not None and 0 < cpu <= 100.0 * (os.cpu_count() or 1)
    assert usage.read(None) == (None, None)
