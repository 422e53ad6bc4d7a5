"""The end-to-end demo: a broker, a publisher, SDK devices, the streaming query into ./out, then
the delivery audit of that very run.

Everything runs on this machine (127.0.0.1, Spark in local mode) and every wait is bounded:
a broker subprocess with a stream log on ``telemetry/#`` and a store under OUT/store, SDK
devices that write delivery logs (one of them goes away for part of the run, so the audit sees
a replay), a publisher, the ``amqtt-durable`` streaming query into OUT/events (Parquet, with
its checkpoint), and the audit of OUT/logs into OUT/audit (report.html).
"""

from __future__ import annotations

import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from amqtt_durable.cli import PLUGIN_PATH
from amqtt_durable.process import BrokerProcess, free_port, local_config
from durable_client import DurableClient, Event

from .audit import AuditResult, run_audit
from .errors import PipelineError
from .spark import DEFAULT_MASTER, job_session

STREAM_FILTER = "telemetry/#"
DEMO_STREAM = {"filter": STREAM_FILTER, "max_count": 1_000_000}
WAIT = 60.0
STALE = ("store", "logs", "events", "checkpoint", "audit")
"""Sub-folders of ``out`` an earlier demo left: a new demo replaces them."""
BROKER_FILES = ("broker.yaml", "broker.log")
"""The demo broker's configuration and log, in ``out`` (written anew at each start)."""
MARKER = ".amqtt-durable-demo"
"""In every demo's output folder: a folder with other things in it and no marker is not the demo's to clear
(unless all it holds are a demo's own folders and files: one made before the marker was)."""


@dataclass
class DemoResult:
    events_published: int
    events_in_parquet: int
    """Rows in OUT/events; with ``distinct_in_parquet`` equal to ``events_published``: each event once."""
    distinct_in_parquet: int
    audit: AuditResult


def _start_broker(folder: Path) -> BrokerProcess:
    """``amqtt-durable broker`` with a stream on telemetry/#, as a child process of the demo."""
    port = free_port()
    config = local_config(
        {"plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}}},
        port,
        **_demo_settings(folder),
    )
    broker = BrokerProcess(config, folder, port, ready_wait=WAIT)
    try:
        broker.start()
    except RuntimeError as exc:
        raise PipelineError(f"the demo broker did not start: {exc}") from exc
    return broker


class _Counter:
    """Counts events a device processed; waits are bounded."""

    def __init__(self) -> None:
        self.count = 0
        self._cond = threading.Condition()

    def __call__(self, event: Event) -> None:
        with self._cond:
            self.count += 1
            self._cond.notify_all()

    def wait(self, count: int) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.count >= count, WAIT)


def _device(name: str, port: int, logs: Path, counter: _Counter) -> DurableClient:
    device = DurableClient(name, port=port, delivery_log=logs / f"{name}.jsonl", reconnect_max_delay=1.0)
    device.subscribe(STREAM_FILTER, listener=counter)
    device.connect(WAIT)
    device.ready_for_events()
    return device


def _demo_settings(folder: Path) -> dict[str, Any]:
    """The durable plugin's settings of the demo broker whose output is in ``folder``."""
    return {"store": str(folder / "store"), "metrics_interval": 0, "streams": [DEMO_STREAM]}


def _only_the_demos(out: Path) -> bool:
    """Whether ``out`` holds what a demo made before the marker was: only the demo's folders and files, and
    its broker.yaml the demo broker's (its stream and a store named store/)."""
    if not all(
        not entry.is_symlink()
        and ((entry.name in STALE and entry.is_dir()) or (entry.name in BROKER_FILES and entry.is_file()))
        for entry in out.iterdir()
    ):
        return False
    try:
        config = yaml.safe_load((out / "broker.yaml").read_text(encoding="utf-8"))
        settings = config["plugins"][PLUGIN_PATH]
        return bool(
            settings["streams"] == [DEMO_STREAM] and Path(settings["store"]).name == "store"
            and settings["metrics_interval"] == 0
        )
    except (OSError, UnicodeDecodeError, yaml.YAMLError, KeyError, TypeError):
        return False


def prepare_out(out: Path) -> None:
    """``out`` made, an earlier demo's results cleared from it; PipelineError for a folder that is not a demo's
    (its store, logs, events, checkpoint and audit sub-folders would be deleted), for one that holds a symbolic
    link (the demo makes none; no link in ``out`` is followed), for a file, or for a symbolic link to nothing.
    An ``out`` that is itself a symbolic link to a folder is followed: the user named it."""
    if out.is_symlink() and not out.exists():
        raise PipelineError(
            f"--out {out} is a symbolic link to {os.readlink(out)}, which does not exist: "
            "make that folder, or name a new or empty folder"
        )
    if out.exists() and not out.is_dir():
        raise PipelineError(f"--out {out} is a file, not a folder: name a new or empty folder")
    links = sorted(entry.name for entry in out.iterdir() if entry.is_symlink()) if out.exists() else []
    if links:
        # The demo makes no symbolic link: one in --out is someone else's, and the demo would write (or clear)
        # through it into another folder. Refused like other things, even after an earlier demo.
        raise PipelineError(
            f"--out {out} holds a symbolic link the demo did not make ({', '.join(links)}): the demo would write "
            "through it into another folder; remove it or choose a new or empty folder"
        )
    if out.exists() and any(out.iterdir()) and not (out / MARKER).exists() and not _only_the_demos(out):
        raise PipelineError(
            f"--out {out} is not empty and holds no earlier demo (the demo replaces its {', '.join(STALE)} "
            "sub-folders): choose a new or empty folder"
        )
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).touch()
    for stale in STALE:
        shutil.rmtree(out / stale, ignore_errors=True)


def run_demo(out: Path, *, events: int = 2000, devices: int = 3, master: str = DEFAULT_MASTER) -> DemoResult:
    """Run the whole demo into ``out`` (created; an earlier demo there is replaced: :func:`prepare_out`)."""
    prepare_out(out)
    logs = out / "logs"
    logs.mkdir()
    broker = _start_broker(out)
    clients: list[DurableClient] = []
    try:
        counters = [_Counter() for _ in range(devices)]
        for i in range(devices):
            clients.append(_device(f"device-{i}", broker.port, logs, counters[i]))
        publisher = DurableClient(
            "publisher", port=broker.port, durable_session=False, delivery_log=logs / "publisher.jsonl"
        )
        clients.append(publisher)
        publisher.connect(WAIT)
        half = events // 2
        clients[0].close(keep_session=True)  # away for the first half: it gets those replayed
        for index in range(half):
            publisher.publish(f"telemetry/sensor-{index % 4}", f"reading-{index:07d}".encode())
        clients[0] = _device("device-0", broker.port, logs, counters[0])
        for index in range(half, events):
            publisher.publish(f"telemetry/sensor-{index % 4}", f"reading-{index:07d}".encode())
        for counter in counters:
            if not counter.wait(events):
                raise PipelineError(f"a demo device got {counter.count} of {events} events within {WAIT} s")
        for client in clients:
            client.close(keep_session=False)  # the devices end their sessions (a no-op for the publisher)

        # A process that already runs a SparkSession, in any thread (a notebook, a test), runs the demo in it and
        # leaves it running with its settings and log level as they were (job_session).
        with job_session(master, "amqtt-durable-demo") as spark:
            stream = (
                spark.readStream.format("amqtt-durable")
                .option("port", str(broker.port))
                .option("filter", STREAM_FILTER)
                .load()
            )
            query = (
                stream.writeStream.format("parquet")
                .option("path", str(out / "events"))
                .option("checkpointLocation", str(out / "checkpoint"))
                .start()
            )
            try:
                query.processAllAvailable()
            finally:
                query.stop()
            written = spark.read.parquet(str(out / "events"))
            audit = run_audit(spark, [str(logs)], str(out / "audit"), expect="exactly-once")
            return DemoResult(events, written.count(), written.select("topic", "id").distinct().count(), audit)
    finally:
        for client in clients:
            client.close(keep_session=True)  # a no-op for those already closed
        broker.stop()
