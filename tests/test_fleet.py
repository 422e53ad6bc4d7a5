"""The fleet harness end to end: a real broker it starts and SIGKILLs, the fault proxy, device
and publisher processes, delivery logs and the Spark audit (slow), and its input errors (fast)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_blind_pipeline import fleet_in_process

from amqtt_durable.cli import PLUGIN_PATH
from amqtt_durable.process import BrokerProcess, free_port, local_config, port_open
from amqtt_durable.store import open_store
from conftest import Broker
from durable_fleet.cli import build_parser, options_from
from durable_fleet.errors import BrokerLostError
from durable_fleet.ha import HaPair
from durable_fleet.model import FAULT_KINDS, Fault, FleetResult
from durable_fleet.report import write_fleet_report
from durable_fleet.runner import FleetOptions, run_fleet
from durable_fleet.schedule import random_schedule

BROKER_YAML = {
    "listeners": {"default": {"type": "tcp", "bind": "127.0.0.1:1883"}},
    "plugins": {
        "amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True},
        PLUGIN_PATH: {"store": "ignored/the/harness/puts/it/under/out"},
    },
}
KEEPALIVE = 2


def assert_every_device_held(result: FleetResult) -> None:
    """The audit's verdict, device by device: every kind ran, nothing lost or out of order, cpl2 exactly-once."""
    assert {device.kind for device in result.devices} == {"cpl1", "cpl2", "paho"}
    for device in result.devices:
        assert device.expected > 0, device
        assert device.lost == 0, device
        assert device.out_of_order == 0, device
        if device.kind == "cpl2":
            assert device.duplicated == 0, device
    assert result.ok, result.failures


def fleet_options(out: Path, spark: Any, faults: list[Fault], **settings: Any) -> FleetOptions:
    return FleetOptions(out=out, config=BROKER_YAML, keepalive=KEEPALIVE, faults=faults, spark=spark, **settings)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_twenty_devices_lose_nothing_through_every_kind_of_fault(tmp_path: Path, spark: Any) -> None:
    devices = [f"dev-{i:03d}" for i in range(20)]
    counts = {"drop": 3, "stall": 3, "device_restart": 3, "broker_kill": 1}
    # The faults fill [5 s, 15 s] (3 stalls of at least 1.5 keepalives each need 9 s of it); the last 5 s publish
    # with none (> 2 keepalives to notice the last heal and reconnect), then the drain (up to 60 s) waits for what
    # is missing.
    faults = random_schedule(7, duration=20.0, devices=devices, counts=counts, keepalive=KEEPALIVE, quiet_tail=5.0)
    result = run_fleet(fleet_options(tmp_path / "out", spark, faults, devices=20, duration=20.0, rate=60.0))

    applied = [applied.fault.kind for applied in result.faults]
    assert {kind: applied.count(kind) for kind in FAULT_KINDS} == counts  # every fault happened and healed
    for kind in ("drop", "stall"):  # and the proxy really broke links
        assert sum(int(a.detail.split()[0]) for a in result.faults if a.fault.kind == kind) > 0, result.faults
    assert result.sent > 750  # 60/s for 20 s is 1200: 62.5% of it, as 1500 of 2400 in 40 s was
    assert_every_device_held(result)
    restarted = [device for device in result.devices if device.restarts]
    assert any(device.kind == "cpl2" for device in restarted)  # exactly once across a process SIGKILL
    assert max(sample.queued or 0 for sample in result.samples) > 0  # queues grew while devices were away
    assert result.latencies  # replays happened and were timed

    charts = write_fleet_report(result)
    page = (tmp_path / "out" / "report.html").read_text(encoding="utf-8")
    assert "PASS" in page
    assert all(chart.exists() for chart in charts)
    assert_the_documented_output(tmp_path / "out", devices)


def assert_the_documented_output(out: Path, devices: list[str]) -> None:
    """fleet.md: the broker keeps every setting but three ("one TCP listener on a free 127.0.0.1 port, the store
    in `OUT/store` ... and `metrics_interval: 1`"); "Output in `--out`: ... `report.html`, `audit/` (the Spark
    audit's own report and summary.parquet), `logs/` (delivery logs), `workers/` (each process's spec and
    output), `broker.yaml` and `broker.log` (the configuration as run, and its output), `schedule.yaml`";
    `cpl2` state in `OUT/state`."""
    as_run = yaml.safe_load((out / "broker.yaml").read_text(encoding="utf-8"))
    [listener] = as_run["listeners"].values()
    assert listener["type"] == "tcp" and listener["bind"].startswith("127.0.0.1:"), listener
    assert listener["bind"] != BROKER_YAML["listeners"]["default"]["bind"], listener
    plugin = as_run["plugins"][PLUGIN_PATH]
    assert Path(plugin["store"]).resolve() == (out / "store").resolve(), plugin
    assert float(plugin["metrics_interval"]) == 1, plugin
    assert (out / "store").is_dir() and (out / "state").is_dir()
    for name in ("report.html", "schedule.yaml", "broker.log", "audit/report.html", "audit/summary.parquet",
                 "logs/pub-0.jsonl"):
        assert (out / name).is_file(), name
    assert sorted(path.stem for path in (out / "logs").glob("dev-*.jsonl")) == devices
    assert {path.suffix for path in (out / "workers").iterdir()} >= {".json", ".log"}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_qos0_through_connection_drops_is_reported_as_loss(tmp_path: Path, spark: Any) -> None:
    """The harness must catch a failure: QoS 0 promises nothing across a drop, and the audit
    (told to count QoS 0) finds the messages that died with the connections."""
    # Three drops of every link in 7 s at 200 messages/s; the drain (2 s) is ample on 127.0.0.1 for what a
    # drop did not kill, so what is missing at its end died with the connections.
    faults = [Fault(at, "drop", "all", 1.0) for at in (2.0, 3.5, 5.0)]
    result = run_fleet(
        fleet_options(tmp_path / "out", spark, faults, devices=6, duration=7.0, rate=200.0, qos=0, drain_timeout=2.0)
    )
    assert not result.ok
    lost = sum(device.lost for device in result.devices)
    assert lost > 0
    assert any("lost" in failure for failure in result.failures)
    assert all(not device.ok for device in result.devices if device.lost)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_running_broker_is_tested_in_place_and_left_without_fleet_sessions(
    tmp_path: Path, spark: Any, broker: Broker
) -> None:
    faults = [Fault(2.0, "drop", "all", 1.0), Fault(4.0, "device_restart", "dev-001", 0.5)]
    options = FleetOptions(
        out=tmp_path / "out", port=broker.port, keepalive=KEEPALIVE, faults=faults, spark=spark, devices=4,
        processes=2, duration=7.0, rate=40.0,
    )
    result = run_fleet(options)
    assert result.ok, result.failures
    assert result.sent > 140  # 40/s for 7 s is 280
    assert not (tmp_path / "out" / "store").exists()  # the broker's own store was used
    broker.stop()
    db = open_store(broker.store)
    try:  # the devices ended their sessions at the end
        assert [key for key, _ in db.iterator(prefix=b"s")] == []
    finally:
        db.close()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_an_ha_pair_loses_nothing_through_a_full_stop_primary_kills_and_a_partition(tmp_path: Path, spark: Any) -> None:
    """--ha: devices reach whichever broker is primary through the proxy. group_kill: both brokers
    SIGKILLed at once and started again; the pair elects a primary by itself (no primary within 60 s:
    the run raises BrokerLostError) and the devices follow it. Then each fault hits the primary of the
    moment (the elected one, then the other, then the elected one again) and ends once the pair is
    whole again: the elected pair fails over as any. The first primary_kill is down 0.3 s, far less
    than the lease: its broker still restarts only after the other took over, as a backup. One run
    for all (a fleet run costs seconds)."""
    # Each pair fault starts once the pair is whole again after the one before (a restart and a catch-up take
    # 1-3 s, the group's election more): 3.5 s or more apart, and the last ends 5 s before the publishers stop.
    faults = [Fault(5.0, "group_kill", None, 1.0), Fault(13.0, "primary_kill", None, 0.3),
              Fault(16.0, "drop", "all", 1.0), Fault(19.0, "partition", None, 3.5),
              Fault(26.0, "primary_kill", None, 1.0)]
    result = run_fleet(fleet_options(tmp_path / "out", spark, faults, devices=8, processes=2, duration=32.0,
                                     rate=60.0, ha=True))

    on_pair = [applied for applied in result.faults if applied.fault.kind != "drop"]
    assert [applied.fault.kind for applied in on_pair] == ["group_kill", "primary_kill", "partition", "primary_kill"]
    group, *details = [applied.detail for applied in on_pair]
    elected = re.fullmatch(r"[ab] \(primary\) and its backup killed; both restarted: ([ab]) elected primary "
                           r"[\d.]+ s later, its backup caught up [\d.]+ s after that", group)
    assert elected, group
    other = "b" if elected[1] == "a" else "a"
    assert [detail.split(";")[0] for detail in details] == [
        f"{elected[1]} (primary) killed", f"{other} (primary) cut off from etcd", f"{elected[1]} (primary) killed"
    ] and details[0].startswith(f"{elected[1]} (primary) killed; restarted: "), details
    assert all("its backup caught up" in detail for detail in details)  # whole again after each
    assert result.sent > 1095, result.sent  # 60/s for 32 s is 1920: at least 57% of it through 4 pair faults
    assert_every_device_held(result)
    assert "replicated pair" in result.settings["broker"]
    assert all((tmp_path / "out" / "brokers" / name / "store").is_dir() for name in ("a", "b"))
    write_fleet_report(result)
    page = (tmp_path / "out" / "report.html").read_text(encoding="utf-8")
    assert "group_kill" in page and "pair" in page


@pytest.mark.timeout(240)
def test_restart_group_that_fails_on_a_later_broker_stops_the_ones_it_started(tmp_path: Path) -> None:
    """ha.restart_group (group_kill's end): when a broker of the pair fails to start again (b's
    store path is a file now), the brokers it had started already are stopped before the error
    is raised, as HaPair.start does: none is left running, listening on its port. Before: broker
    a was left running."""
    out = tmp_path / "out"
    pair = HaPair(BROKER_YAML, out, metrics_interval=1.0).start()
    try:
        pair.kill_group()
        store = out / "brokers" / "b" / "store"
        shutil.rmtree(store)
        store.write_text("not a store\n", encoding="utf-8")
        with pytest.raises(BrokerLostError, match="broker b"):
            pair.restart_group()
        first = pair.brokers["a"]
        assert first.proc is not None and first.exit_status is not None, "broker a was left running"
        assert not port_open(first.port)
    finally:
        pair.stop()


@pytest.mark.timeout(60)
def test_an_ha_pair_stop_sigkills_a_broker_that_ignores_its_sigterm_after_its_stop_wait(tmp_path: Path) -> None:
    """HaPair.stop (Ctrl-C, SIGTERM, an --ha run's end): a broker of the pair that does not end on SIGTERM
    (here stopped with SIGSTOP, as a wedged one) is SIGKILLed ``stop_wait`` (STOP_WAIT) after it, as the
    single broker is: not sooner, and not after the broker's own wait (15 s; before: the minute a broker
    gets to start, past this test's bound). The other broker, healthy, ends by its SIGTERM meanwhile."""
    stop_wait = 3.0
    pair = HaPair(BROKER_YAML, tmp_path / "out", metrics_interval=1.0, stop_wait=stop_wait)
    for name in ("a", "b"):
        port = free_port()
        (tmp_path / name).mkdir()
        config = local_config(BROKER_YAML, port, store=str(tmp_path / name / "store"))
        pair.brokers[name] = BrokerProcess(config, tmp_path / name, port)
    healthy, wedged = pair.brokers["a"], pair.brokers["b"]  # the healthy one is waited for first
    try:
        for broker in (healthy, wedged):
            broker.start()
        assert wedged.pid is not None
        os.kill(wedged.pid, signal.SIGSTOP)  # this test's own child, by PID
        started = time.monotonic()
        pair.stop()
        took = time.monotonic() - started
        assert wedged.exit_status == -signal.SIGKILL
        assert healthy.exit_status == 0, f"the healthy broker did not end by its SIGTERM: {healthy.exit_status}"
        assert 0.9 * stop_wait <= took < 10, took
    finally:
        for broker in (healthy, wedged):
            broker.kill()


def write_broker_yaml(tmp_path: Path, content: Any) -> Path:
    """``content`` as tmp_path/fleet.yaml (fleet_in_process writes the shipped broker.yaml beside it). The refusals
    below run the command's main() in this process: a child interpreter took 1-3 s a refusal to import the
    fleet's Spark, pandas and matplotlib, and a refusal's exit status from a process of its own is
    test_blind_pipeline's test_fleet_ha_with_port_is_refused_it_needs_a_config."""
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(content) if not isinstance(content, str) else content, encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--devices", "0"], "--devices must be 1 or more"),
        (["--faults", "drop=2,quake=1"], "'quake=1' is not NAME=COUNT"),
        (["--mix", "cpl1=0,cpl2=0,paho=0"], "weight 0"),
        (["--duration", "soon"], "soon"),
        (["--qos", "2"], "invalid choice"),
        (["--port", "1883", "--faults", "broker_kill=1"], "broker_kill faults need a broker the harness starts"),
        (["--prefix", "a/b"], "--prefix 'a/b'"),
        (["--host", "10.0.0.5"], "give its --port too"),
        (["--broadcast-every", "-1"], "--broadcast-every must be 0 or more"),
    ],
)
def test_bad_options_exit_2_naming_the_problem(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    config = write_broker_yaml(tmp_path, BROKER_YAML)
    extra = [] if "--port" in args else ["-c", str(config)]
    status, err = fleet_in_process(tmp_path, capsys, *extra, *args)
    assert status == 2, err
    assert message in err


def test_a_running_broker_gets_the_default_faults_but_broker_kills() -> None:
    parser = build_parser()
    options = options_from(parser.parse_args(["--port", "1883", "--seed", "3"]), parser)
    kinds = {fault.kind for fault in options.faults}
    assert kinds == {"drop", "stall", "device_restart"}
    assert options.config is None and options.port == 1883


def test_an_out_folder_with_other_things_in_it_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "precious.txt").write_text("mine", encoding="utf-8")
    config = write_broker_yaml(tmp_path, BROKER_YAML)
    status, err = fleet_in_process(tmp_path, capsys, "-c", str(config))
    assert status == 2
    assert "not empty" in err
    assert (tmp_path / "out" / "precious.txt").read_text(encoding="utf-8") == "mine"


def test_a_bad_broker_yaml_exits_2_naming_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = {**BROKER_YAML, "plugins": {PLUGIN_PATH: {"max_depth": -1}}}
    status, err = fleet_in_process(tmp_path, capsys, "-c", str(write_broker_yaml(tmp_path, bad)))
    assert status == 2
    assert "max_depth" in err


def test_a_bad_schedule_file_exits_2_naming_the_fault(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    schedule = tmp_path / "faults.yaml"
    schedule.write_text(json.dumps({"faults": [{"at": 1, "kind": "drop", "device": "dev-000", "for": 1},
                                               {"at": 2, "kind": "flood", "for": 1}]}), encoding="utf-8")
    config = write_broker_yaml(tmp_path, BROKER_YAML)
    status, err = fleet_in_process(tmp_path, capsys, "-c", str(config), "--schedule", str(schedule))
    assert status == 2
    assert "fault 2" in err and "flood" in err
