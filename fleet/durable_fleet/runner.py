"""A fleet run from start to verdict: broker, fault proxy, device and publisher processes, the
fault schedule, the drain, then the Spark delivery audit of the delivery logs.

Layout of ``out``: ``logs/`` (one delivery log per device and publisher), ``state/`` (CPL-2
journals), ``store/`` and ``broker.log`` (a broker started here), ``brokers/`` and ``etcd/``
(the replicated pair of ``--ha``, durable_fleet.ha), ``workers/`` (each process's spec and
output), ``schedule.yaml`` (the faults, replayable with ``--schedule``), ``audit/`` (the Spark
audit's summary and report), ``report.html`` with its charts.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import math
import os
import shutil
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

import paho.mqtt.client as mqtt
import psutil
from paho.mqtt.enums import CallbackAPIVersion

from amqtt_durable.process import HOST, BrokerProcess, ChildProcess, free_port, local_config, stop_all

from .errors import BrokerLostError, FleetError
from .ha import HA_TIMING, WHOLE_WAIT, HaPair
from .model import (
    ALL_DEVICES,
    HA_FAULT_KINDS,
    STOP_WAIT,
    AppliedFault,
    DeviceKind,
    DeviceOutcome,
    Fault,
    FaultKind,
    FleetResult,
    Sample,
)
from .proxy import FaultProxy
from .schedule import dump_schedule
from .tail import DeliveryTail
from .worker import BROADCAST_TOPIC, DeviceSpec, PublisherSpec, WorkerSpec, command_topic

log = logging.getLogger(__name__)

QUEUED_METRIC = "$SYS/broker/durable/messages/queued"
MONITOR_KEEPALIVE = 10
"""Seconds of the queue-depth monitor's keep-alive, unless the devices' is shorter."""
STALE = ("logs", "state", "store", "workers", "audit", "brokers", "etcd")
"""Sub-folders of ``out`` that a new run replaces, with the files in OWN_FILES."""
OWN_FILES = ("report.html", "schedule.yaml", "broker.yaml", "broker.log")
MARKER = ".amqtt-durable-fleet"
"""In every output folder: a folder with other things in it and no marker is not ours to clear."""
SAMPLE_INTERVAL = 1.0
MIN_CPU_INTERVAL = 0.5
"""Seconds of wall time a CPU figure spans at least."""
LOG_LINE_EVERY = 5.0
"""Seconds between progress lines when stderr is not a terminal."""
BROKER_FAULTS = ("broker_kill", *HA_FAULT_KINDS)
"""Faults on the broker side, driven by a thread of their own: a pair's recovery after one
(a restart, a catch-up) does not hold up the faults on the devices' links and processes."""


@dataclass
class FleetOptions:
    out: Path
    devices: int = 20
    mix: Mapping[DeviceKind, int] = field(default_factory=lambda: {"cpl1": 1, "cpl2": 1, "paho": 1})
    """Weights of the device kinds; kinds are dealt round robin by weight, so any prefix of the
    fleet has the same mix."""
    rate: float = 100.0
    """Messages per second from all publishers together."""
    duration: float = 45.0
    qos: int = 1
    publishers: int = 2
    processes: int = 8
    """Device processes: a device_restart fault restarts every device of the target's process."""
    keepalive: int = 4
    faults: list[Fault] = field(default_factory=list)
    config: dict[str, Any] | None = None
    """broker.yaml's content: the harness starts that broker (own port and store under ``out``)."""
    host: str = HOST
    port: int | None = None
    """A running broker to target instead (no broker_kill faults then)."""
    prefix: str = "dev-"
    broadcast_every: int = 10
    payload_size: int = 64
    drain_timeout: float = 60.0
    ready_timeout: float = 120.0
    master: str = "local[2]"
    spark: Any = None
    """A SparkSession to audit with, left running (tests share one); None: one on ``master``, stopped after."""
    progress: TextIO | None = None
    schedule_note: str = ""
    """How the faults were made (seed or file), for the settings table."""
    ha: bool = False
    """Start a replicated pair from ``config`` (etcd, two brokers, durable_fleet.ha) instead of one
    broker; the fault proxy is its virtual address (devices reach whichever broker is primary)."""


def device_names(prefix: str, count: int) -> list[str]:
    """The client ids of the fleet; schedule files name devices by them."""
    return [f"{prefix}{i:03d}" for i in range(count)]


def device_kinds(count: int, mix: Mapping[DeviceKind, int]) -> list[DeviceKind]:
    """Smooth weighted round robin: with weights 1:1:1, kinds alternate; 2:1 gives a, b, a, ..."""
    weights = {kind: weight for kind, weight in mix.items() if weight > 0}
    if not weights:
        raise FleetError("--mix gives every device kind weight 0")
    total = sum(weights.values())
    current = dict.fromkeys(weights, 0)
    kinds: list[DeviceKind] = []
    for _ in range(count):
        for kind, weight in weights.items():
            current[kind] += weight
        chosen = max(current, key=lambda kind: current[kind])
        current[chosen] -= total
        kinds.append(chosen)
    return kinds


class _Worker(ChildProcess):
    """A worker process (``python -m durable_fleet.worker``), its spec in ``folder/NAME.json``."""

    def __init__(self, name: str, spec: WorkerSpec, folder: Path) -> None:
        self.name = name
        self.spec = spec
        spec_path = folder / f"{name}.json"
        spec.dump(spec_path)
        super().__init__([sys.executable, "-m", "durable_fleet.worker", str(spec_path)], folder / f"{name}.log",
                         wait=STOP_WAIT)
        self.down = 0
        """device_restart faults now holding this process down: it starts again when the last one ends."""


class _QueueDepth:
    """The broker's queued-messages metric, from a subscriber straight to the broker (no proxy);
    its keep-alive at most the devices' (which the CLI keeps within the broker's max_keepalive)."""

    def __init__(self, host: str, port: int, keepalive: int) -> None:
        self.value: int | None = None
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"fleet-monitor-{os.getpid()}")
        self.client.reconnect_delay_set(1, 1)
        self.client.on_connect = lambda client, *_: client.subscribe(QUEUED_METRIC, 0)
        self.client.on_message = self._on_message
        self.client.connect_async(host, port, min(MONITOR_KEEPALIVE, keepalive))
        self.client.loop_start()

    def _on_message(self, client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
        try:
            self.value = int(message.payload)
        except ValueError:
            log.warning("unexpected %s payload %r", QUEUED_METRIC, message.payload[:40])

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


class _BrokerUsage:
    """CPU (percent of one core, since the previous reading) and RSS of the broker process."""

    def __init__(self) -> None:
        self._pid: int | None = None
        self._last: tuple[float, float] = (0.0, 0.0)

    def read(self, pid: int | None) -> tuple[float | None, int | None]:
        if pid is None:
            return None, None
        try:
            process = psutil.Process(pid)
            times = process.cpu_times()
            rss = int(process.memory_info().rss)
        except psutil.Error:
            return None, None
        now, busy = time.monotonic(), times.user + times.system
        if pid != self._pid:
            self._pid, self._last = pid, (now, busy)
            return None, rss
        since, busy_before = self._last
        if now - since < MIN_CPU_INTERVAL:  # CPU times tick in 10 ms: a short interval gives nonsense
            return None, rss
        self._last = (now, busy)
        return 100.0 * (busy - busy_before) / (now - since), rss


def prepare_out(out: Path) -> None:
    """Clear an earlier run's results from ``out``; FleetError for a folder that is not a run's."""
    if out.exists() and not out.is_dir():
        raise FleetError(f"--out {out} is a file, not a folder")
    if out.exists() and any(out.iterdir()) and not (out / MARKER).exists():
        raise FleetError(f"--out {out} is not empty and holds no earlier fleet run: choose a new or empty folder")
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).touch()
    for name in STALE:
        shutil.rmtree(out / name, ignore_errors=True)
    for name in OWN_FILES:
        (out / name).unlink(missing_ok=True)
    for chart in out.glob("fleet_*.png"):
        chart.unlink()


class FleetRun:
    """One run; ``run()`` returns the result (the audit included) or raises FleetError."""

    def __init__(self, options: FleetOptions) -> None:
        self.o = options
        self.out = options.out
        self.kinds = device_kinds(options.devices, options.mix)
        self.names = device_names(options.prefix, options.devices)
        self.kind_of = dict(zip(self.names, self.kinds, strict=True))
        self.broker: BrokerProcess | None = None
        self.pair: HaPair | None = None
        self.proxy: FaultProxy | None = None
        self.publisher_proxy: FaultProxy | None = None
        """--ha: the publishers' way to the primary (the same router as the devices', no faults)."""
        self.hit: dict[Fault, str] = {}
        """The broker each primary_kill or partition under way hit (its end restarts or heals that one)."""
        self.device_workers: list[_Worker] = []
        self.publishers: list[_Worker] = []
        self.worker_of: dict[str, _Worker] = {}
        self.applied: list[AppliedFault] = []
        self.samples: list[Sample] = []
        self.counts: dict[str, dict[FaultKind, int]] = {name: {} for name in self.names}
        self.lock = threading.Lock()
        self.broker_host = HOST if options.config is not None else options.host
        self.usage = _BrokerUsage()
        self.t0 = 0.0
        self.phase = "starting"
        self._last_line = 0.0

    # ------------------------------------------------------------------ set-up
    def _prepare(self) -> None:
        prepare_out(self.out)
        for name in ("logs", "state", "workers"):
            (self.out / name).mkdir(parents=True)
        dump_schedule(self.o.faults, self.out / "schedule.yaml")  # none too: replayable with --schedule

    def _start_broker(self) -> int:
        if self.o.config is None:
            if self.o.port is None:
                raise FleetError("give a broker.yaml to start (--config) or a running broker (--port)")
            if self.o.ha:
                raise FleetError("--ha starts a replicated pair from a broker.yaml (--config), not --port")
            return self.o.port
        if self.o.ha:
            self.pair = HaPair(self.o.config, self.out, metrics_interval=SAMPLE_INTERVAL)
            self.pair.start()  # kept first: a signal during the start still finds it to stop
            return 0  # no fixed broker port: the proxies route to the primary
        port = free_port()
        config = local_config(self.o.config, port, store=str(self.out / "store"), metrics_interval=SAMPLE_INTERVAL)
        self.broker = BrokerProcess(config, self.out, port, wait=STOP_WAIT)
        try:
            self.broker.start()
        except RuntimeError as exc:
            raise FleetError(str(exc)) from exc
        return port

    def _start_workers(self, broker_port: int, proxy_port: int) -> None:
        o = self.o
        base = WorkerSpec(
            device_port=proxy_port,
            broker_host=self.broker_host,
            broker_port=broker_port,
            logs=str(self.out / "logs"),
            state_dir=str(self.out / "state"),
            keepalive=o.keepalive,
            end_sessions=o.config is None,
            harness_pid=os.getpid(),
        )
        folder = self.out / "workers"
        processes = max(1, min(o.processes, o.devices))
        for index in range(processes):
            members = [DeviceSpec(name, self.kind_of[name]) for name in self.names[index::processes]]
            worker = _Worker(f"devices-{index}", replace(base, devices=members), folder)
            self.device_workers.append(worker)
            for member in members:
                self.worker_of[member.name] = worker
        for index in range(o.publishers):
            share = o.rate / o.publishers
            offset = index * 7919  # publishers start at different devices
            publisher = PublisherSpec(
                f"pub-{index}", share, self.names, offset, o.broadcast_every, o.payload_size, o.qos
            )
            self.publishers.append(_Worker(f"publisher-{index}", replace(base, publisher=publisher), folder))
        for worker in self.device_workers:
            worker.start()

    def _wait_ready(self, tail: DeliveryTail) -> None:
        sdk = [name for name in self.names if self.kind_of[name] != "paho"]
        deadline = time.monotonic() + self.o.ready_timeout
        while True:
            tail.poll()
            waiting = tail.not_ready(sdk)
            if not waiting:
                return
            if time.monotonic() > deadline:
                shown = ", ".join(waiting[:10]) + (" ..." if len(waiting) > 10 else "")
                raise FleetError(
                    f"{len(waiting)} device(s) not subscribed and live within {self.o.ready_timeout} s: {shown}; "
                    f"see {self.out / 'workers'}"
                )
            self._progress(tail, f"starting: {self.o.devices - len(waiting)}/{self.o.devices} devices ready")
            time.sleep(0.2)  # polling files another process writes; bounded by the deadline

    # ------------------------------------------------------------------ faults
    def _apply(self, fault: Fault, begin: bool) -> str:
        """Start or end one fault; return what it touched (or, at its end, how it healed)."""
        proxy, broker = self.proxy, self.broker
        assert proxy is not None
        if fault.kind in HA_FAULT_KINDS:
            return self._apply_ha(fault, begin)
        target = None if fault.target == ALL_DEVICES else fault.target
        if fault.kind in ("drop", "stall"):
            if begin:
                links = proxy.cut(target) if fault.kind == "drop" else proxy.stall(target)
                return f"{links} link(s)"
            proxy.restore(target)
            return ""
        if fault.kind == "broker_kill":
            if broker is None:
                raise FleetError("broker_kill needs a broker the harness started (--config)")
            if begin:
                broker.kill()
            else:
                try:
                    broker.start()
                except RuntimeError as exc:
                    raise BrokerLostError(f"the broker did not restart after its SIGKILL: {exc}") from exc
            return ""
        worker = self.worker_of[str(fault.target)]
        with self.lock:  # _check_workers must not see a process between its kill and its start
            if begin:
                worker.down += 1
                worker.kill()
                return f"{worker.name}: " + ", ".join(device.name for device in worker.spec.devices)
            worker.down -= 1
            if worker.down == 0:  # another restart of the same process may still hold it down
                worker.start()
        return ""

    def _apply_ha(self, fault: Fault, begin: bool) -> str:
        """primary_kill and partition: whichever broker is primary once the pair is whole;
        group_kill: both brokers at once, then both started again."""
        pair = self.pair
        if pair is None:
            raise FleetError(f"{fault.kind} needs the replicated pair of --ha")
        if fault.kind == "group_kill":
            if begin:
                return f"{pair.kill_group()} (primary) and its backup killed"
            elected, took = pair.restart_group()
            return (f"both restarted: {pair.primary()} elected primary {elected:.1f} s later, "
                    f"its backup caught up {took:.1f} s after that")
        if begin:
            if fault.kind == "primary_kill":
                self.hit[fault] = pair.kill_primary()
                return f"{self.hit[fault]} (primary) killed"
            self.hit[fault] = pair.partition_primary()
            return f"{self.hit[fault]} (primary) cut off from etcd"
        name = self.hit.pop(fault)
        took = pair.restart(name) if fault.kind == "primary_kill" else pair.heal(name)
        again = "restarted" if fault.kind == "primary_kill" else "reconnected to etcd"
        return f"{again}: {pair.primary()} primary, its backup caught up {took:.1f} s later"

    def _drive_faults(
        self, stop: threading.Event, errors: list[BaseException], kinds: tuple[str, ...] | None = None
    ) -> None:
        """Apply the schedule (the faults of ``kinds``, None: all): each fault starts at ``at``
        and ends ``duration`` later (or once the one before it on this thread has ended)."""
        events: list[tuple[float, int, bool, int]] = []
        for index, fault in enumerate(self.o.faults):
            if kinds is not None and fault.kind not in kinds:
                continue
            heapq.heappush(events, (fault.at, 1, True, index))
            heapq.heappush(events, (fault.at + fault.duration, 0, False, index))  # ends first at equal times
        active: dict[int, Fault] = {}
        started: dict[int, tuple[float, str]] = {}
        try:
            while events:
                at, _, begin, index = heapq.heappop(events)
                # Once the run is over (stop), faults not begun are dropped and the rest end at once.
                stop.wait(max(0.0, self.t0 + at - time.monotonic()))
                fault = self.o.faults[index]
                if begin:
                    if not stop.is_set():
                        started[index] = (time.monotonic() - self.t0, self._apply(fault, True))
                        active[index] = fault
                        self._count(fault)
                    continue
                if active.pop(index, None) is None:
                    continue
                healed = self._apply(fault, False)
                self._reapply_links(fault, active)
                begun, detail = started[index]
                detail = "; ".join(filter(None, (detail, healed)))
                with self.lock:
                    self.applied.append(AppliedFault(fault, begun, time.monotonic() - self.t0, detail))
        except BaseException as exc:  # handed to the main thread, which stops the run
            errors.append(exc)

    def _reapply_links(self, ended: Fault, active: Mapping[int, Fault]) -> None:
        """restore() of a device or of all also lifts other cuts and stalls still due to run."""
        if ended.kind not in ("drop", "stall"):
            return
        lifted = (ended.target, ALL_DEVICES) if ended.target != ALL_DEVICES else None
        for fault in active.values():
            if fault.kind in ("drop", "stall") and (lifted is None or fault.target in lifted):
                self._apply(fault, True)

    def _count(self, fault: Fault) -> None:
        if fault.kind in BROKER_FAULTS:
            return
        targets = self.names if fault.target == ALL_DEVICES else [str(fault.target)]
        if fault.kind == "device_restart":
            targets = [device.name for device in self.worker_of[str(fault.target)].spec.devices]
        for name in targets:
            self.counts[name][fault.kind] = self.counts[name].get(fault.kind, 0) + 1

    # --------------------------------------------------------------- sampling
    def _check_workers(self) -> None:
        """A process that ended on its own (not killed by a fault) makes the run meaningless."""
        for worker in [*self.device_workers, *(self.publishers if self.phase == "publishing" else [])]:
            if worker.down == 0 and worker.proc is not None and worker.exit_status is not None:
                raise FleetError(f"{worker.name} exited with status {worker.exit_status}; see {worker.log_path}")

    def _sample(self, tail: DeliveryTail, depth: _QueueDepth) -> None:
        tail.poll()
        with self.lock:
            self._check_workers()
        pid = self.pair.primary_pid() if self.pair is not None else self.broker.pid if self.broker is not None else None
        cpu, rss = self.usage.read(pid)
        assert self.proxy is not None
        sample = Sample(
            time.monotonic() - self.t0, depth.value, cpu, rss, self.proxy.connected(), tail.sent, tail.received
        )
        self.samples.append(sample)
        self._progress(tail, self.phase)

    def _progress(self, tail: DeliveryTail, phase: str) -> None:
        stream = self.o.progress
        if stream is None:
            return
        elapsed = max(0.0, time.monotonic() - self.t0) if self.t0 else 0.0
        done = min(1.0, elapsed / self.o.duration) if self.t0 else 0.0
        bar = "#" * int(done * 30) + "." * (30 - int(done * 30))
        with self.lock:
            faults = len(self.applied)
        links = self.samples[-1].devices_connected if self.samples else 0
        line = (
            f"[{bar}] {elapsed:5.0f}/{self.o.duration:.0f} s  {phase:<12.40} sent {tail.sent:,}  "
            f"received {tail.received:,}  missing {tail.missing():,}  links {links}  "
            f"faults {faults}/{len(self.o.faults)}"
        )
        if stream.isatty():
            stream.write("\r" + line[:160])
        elif time.monotonic() - self._last_line >= LOG_LINE_EVERY:  # a log file gets a line now and then
            self._last_line = time.monotonic()
            stream.write(line + "\n")
        stream.flush()

    # -------------------------------------------------------------------- run
    def run(self) -> FleetResult:
        self._prepare()
        tail = DeliveryTail(
            self.out / "logs", {name: (command_topic(name), BROADCAST_TOPIC) for name in self.names}, time.time()
        )
        depth: _QueueDepth | None = None
        errors: list[BaseException] = []
        stop = threading.Event()
        link_kinds = ("drop", "stall", "device_restart")
        drivers = [
            threading.Thread(target=self._drive_faults, args=(stop, errors, kinds), name=name, daemon=True)
            for name, kinds in (("fleet-faults", link_kinds), ("fleet-broker-faults", BROKER_FAULTS))
        ]
        try:  # a SIGTERM while the broker (or the pair) starts still stops what was started
            broker_port = self._start_broker()
            upstream = self.pair.router if self.pair is not None else None
            self.proxy = FaultProxy(self.broker_host, broker_port, upstream=upstream)
            proxy_port = self.proxy.start()
            publish_port = broker_port
            if upstream is not None:
                self.publisher_proxy = FaultProxy(self.broker_host, broker_port, upstream=upstream)
                publish_port = self.publisher_proxy.start()
            self._start_workers(publish_port, proxy_port)
            depth = _QueueDepth(self.broker_host, publish_port, self.o.keepalive)
            self._wait_ready(tail)
            self._publish(tail, depth, drivers, stop, errors)
            self._drain(tail, depth)
            duration = time.monotonic() - self.t0
        finally:
            stop.set()
            self._stop_all(drivers, depth)
        return self._judge(tail, duration)

    def _stop_all(self, drivers: list[threading.Thread], depth: _QueueDepth | None) -> None:
        """After the run or its failure: faults ended, processes stopped, proxies and brokers last."""
        for driver in drivers:
            if driver.is_alive():  # the run failed: let the driver end its faults before we stop all
                driver.join(self._driver_bound())
        stop_all([*self.publishers, *self.device_workers], STOP_WAIT)
        if depth is not None:
            depth.close()
        self._stop_services()
        if self.o.progress is not None and self.o.progress.isatty():
            self.o.progress.write("\n")

    def _stop_services(self) -> None:
        """The proxies (each bounded by its calls' timeout), then the broker or the pair: a broker is SIGKILLed
        if still running STOP_WAIT after its SIGTERM, as the workers are, so a Ctrl-C ends in bounded time."""
        for proxy in (self.proxy, self.publisher_proxy):
            if proxy is not None:
                proxy.stop()
        if self.broker is not None:
            self.broker.stop()  # its wait is STOP_WAIT
        if self.pair is not None:
            self.pair.stop()

    def _publish(
        self, tail: DeliveryTail, depth: _QueueDepth, drivers: list[threading.Thread], stop: threading.Event,
        errors: list[BaseException],
    ) -> None:
        """Publishers run for the duration while the driver applies the faults; then all heal."""
        self.usage = _BrokerUsage()
        self.t0 = time.monotonic()
        tail.start = time.time()
        for publisher in self.publishers:
            publisher.start()
        for driver in drivers:
            driver.start()
        self.phase = "publishing"
        while time.monotonic() - self.t0 < self.o.duration and not errors:
            self._sample(tail, depth)
            stop.wait(SAMPLE_INTERVAL)  # the sampling period
        stop.set()
        for driver in drivers:
            self._join(driver, errors)

    def _drain(self, tail: DeliveryTail, depth: _QueueDepth) -> None:
        """Publishers stop; the devices get up to drain_timeout to receive what is missing."""
        self.phase = "draining"
        # A publisher ends after the PUBACKs it still waits for, logging those sends: until it has
        # ended, "nothing missing" could be read before its last sends were written.
        stop_all(self.publishers, STOP_WAIT)
        drain_end = time.monotonic() + self.o.drain_timeout
        while time.monotonic() < drain_end:
            self._sample(tail, depth)
            if tail.missing() == 0:
                break
            time.sleep(SAMPLE_INTERVAL / 2)  # polling the devices' logs; bounded by drain_end
        self._sample(tail, depth)

    def _driver_bound(self) -> float:
        """How long ending the last faults can take: a broker start, proxy calls, process stops."""
        broker_start = self.broker.ready_wait if self.broker is not None else 0.0
        if self.pair is not None:  # starts, and waits for the pair to be whole before and after
            # (a group_kill: both brokers started, then a wait for its election and one for its catch-up)
            broker_start = 2 * max(b.ready_wait for b in self.pair.brokers.values()) + 3 * WHOLE_WAIT
        return max((f.duration for f in self.o.faults), default=0.0) + broker_start + 2 * STOP_WAIT

    def _join(self, driver: threading.Thread, errors: list[BaseException]) -> None:
        driver.join(self._driver_bound())
        if driver.is_alive():
            raise FleetError(f"the faults did not end within {self._driver_bound():.0f} s of the run's end")
        if errors:
            error = errors[0]
            if isinstance(error, FleetError):
                raise error
            raise FleetError(f"a fault could not be applied: {error!r}") from error

    # ------------------------------------------------------------------ verdict
    def _judge(self, tail: DeliveryTail, duration: float) -> FleetResult:
        from durable_pipeline.audit import run_audit  # noqa: PLC0415 - pyspark loads only for the audit
        from durable_pipeline.spark import job_session  # noqa: PLC0415

        self.phase = "auditing"
        # A session of the caller's (the option, or one this process runs) is left running as it was.
        sessions = (
            contextlib.nullcontext(self.o.spark) if self.o.spark else job_session(self.o.master, "amqtt-durable-fleet")
        )
        with sessions as spark:
            audit = run_audit(
                spark, [str(self.out / "logs")], self.out / "audit", "at-least-once", check_order=True,
                count_qos0=self.o.qos == 0,
            )
        stats = {row.device: row for row in audit.devices}
        outcomes: list[DeviceOutcome] = []
        for name in self.names:
            row = stats.get(name)
            kind = self.kind_of[name]
            counts = self.counts[name]
            expected, received, lost, duplicated, out_of_order = (
                (row.expected, row.received, row.lost, row.duplicated, row.out_of_order) if row else (0, 0, 0, 0, 0)
            )
            why = _why(kind, expected, lost, duplicated, out_of_order)
            outcomes.append(DeviceOutcome(
                name, kind, expected, received, lost, duplicated, out_of_order,
                counts.get("device_restart", 0), counts.get("drop", 0), counts.get("stall", 0), not why, why,
            ))
        failures = [f"{len(bad)} device(s) failed: " + "; ".join(f"{d.device} ({d.kind}): {d.why}" for d in bad[:5])
                    for bad in [[d for d in outcomes if not d.ok]] if bad]
        failures += [f"audit: {text}" for text in audit.failures]
        notes = list(audit.notes)
        if tail.missing():
            worst = sorted(tail.missing_by_device().items(), key=lambda item: -item[1])[:5]
            shown = ", ".join(f"{device} {count:,}" for device, count in worst)
            notes.append(f"the drain ended after {self.o.drain_timeout:.0f} s with {tail.missing():,} receive(s) "
                         f"missing (most at {shown})")
            queued = next((sample.queued for sample in reversed(self.samples) if sample.queued is not None), None)
            if queued:
                notes.append(f"{queued:,} message(s) were still queued at the broker then: the audit counts them as "
                             "lost; a longer --drain-timeout tells a slow drain from a loss")
        return FleetResult(
            ok=not failures, failures=failures, devices=outcomes, faults=sorted(self.applied, key=lambda a: a.started),
            samples=self.samples, latencies=tail.latencies, settings=self._settings(), sent=tail.sent,
            duration_s=duration, out=self.out, audit_report=audit.report_path, notes=notes,
        )

    def _settings(self) -> dict[str, str]:
        o = self.o
        mix = ", ".join(f"{kind} {self.kinds.count(kind)}" for kind in ("cpl1", "cpl2", "paho") if kind in self.kinds)
        store = self.out / "store"
        broker = f"started from broker.yaml (store {store})" if o.config is not None else f"{o.host}:{o.port}"
        if self.pair is not None:
            broker = (f"replicated pair a, b started from broker.yaml (sync mode, lease {HA_TIMING['lease_ttl']} s; "
                      f"stores {self.out / 'brokers'}/*/store), etcd in {self.out / 'etcd'}")
        return {
            "devices": f"{o.devices} ({mix}) in {len(self.device_workers)} process(es)",
            "publishers": f"{o.publishers} at {o.rate:g} messages/s in all, QoS {o.qos}, {o.payload_size} B payloads",
            "duration": f"{o.duration:g} s (+ drain up to {o.drain_timeout:g} s)",
            "keep-alive": f"{o.keepalive} s",
            "faults": f"{len(o.faults)} ({o.schedule_note})" if o.schedule_note else str(len(o.faults)),
            "broker": broker,
        }


def _why(kind: DeviceKind, expected: int, lost: int, duplicated: int, out_of_order: int) -> str:
    reasons = []
    if expected == 0:
        reasons.append("nothing expected (no confirmed subscription in its log)")
    if lost:
        reasons.append(f"{lost} lost")
    if out_of_order:
        reasons.append(f"{out_of_order} out of order")
    if duplicated and kind == "cpl2":
        reasons.append(f"{duplicated} duplicated (CPL-2 promises exactly once)")
    return "; ".join(reasons)


def run_fleet(options: FleetOptions) -> FleetResult:
    """Run the fleet and audit it; the caller writes the report (``durable_fleet.report``)."""
    for name in ("devices", "processes", "publishers", "keepalive"):
        if getattr(options, name) < 1:
            raise FleetError(f"--{name} must be 1 or more, got {getattr(options, name)}")
    if not (options.rate > 0 and math.isfinite(options.rate)):
        raise FleetError(f"--rate must be a positive number of messages per second, got {options.rate}")
    return FleetRun(options).run()

