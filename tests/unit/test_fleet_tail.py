"""The fleet's live view of the delivery logs, and how it deals device kinds (no broker)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from amqtt_durable.process import local_config
from durable_fleet.errors import FleetError
from durable_fleet.runner import device_kinds
from durable_fleet.schedule import load_schedule
from durable_fleet.tail import DeliveryTail

CMD_A, CMD_B, ALL = "fleet/a/cmd", "fleet/b/cmd", "fleet/broadcast"


def append(path: Path, *records: dict[str, object], end: str = "\n") -> None:
    with path.open("a", encoding="utf-8") as handle:
        handle.write("\n".join(json.dumps(record) for record in records) + end)


def send(topic: str, message: str, at: float = 100.0) -> dict[str, object]:
    return {"kind": "send", "device": "pub-0", "time": at, "topic": topic, "id": message, "qos": 1}


def receive(device: str, topic: str, message: str, at: float = 101.0, replayed: bool = False) -> dict[str, object]:
    return {"kind": "receive", "device": device, "time": at, "topic": topic, "id": message, "replayed": replayed}


@pytest.fixture
def tail(tmp_path: Path) -> DeliveryTail:
    return DeliveryTail(tmp_path, {"a": (CMD_A, ALL), "b": (CMD_B, ALL)}, start=90.0)


def test_a_send_is_missing_at_each_subscriber_until_received(tmp_path: Path, tail: DeliveryTail) -> None:
    append(tmp_path / "pub-0.jsonl", send(CMD_A, "m1"), send(ALL, "m2"))
    tail.poll()
    assert tail.sent == 2
    assert tail.missing_by_device() == {"a": 2, "b": 1}
    append(tmp_path / "a.jsonl", receive("a", CMD_A, "m1"), receive("a", ALL, "m2"))
    append(tmp_path / "b.jsonl", receive("b", ALL, "m2"))
    tail.poll()
    assert tail.missing() == 0
    assert tail.received == 3


def test_a_receive_logged_before_its_send_is_not_missing(tmp_path: Path, tail: DeliveryTail) -> None:
    append(tmp_path / "a.jsonl", receive("a", CMD_A, "m1"))  # delivered before the publisher saw its PUBACK
    tail.poll()
    append(tmp_path / "pub-0.jsonl", send(CMD_A, "m1"))
    tail.poll()
    assert tail.missing() == 0


def test_a_line_that_is_no_json_object_is_skipped(
    tmp_path: Path, tail: DeliveryTail, caplog: pytest.LogCaptureFixture
) -> None:
    """A damaged delivery log (nested past the recursion limit, a bare list, not JSON) leaves the live
    view running: the line is skipped with a WARNING, the records around it count."""
    path = tmp_path / "pub-0.jsonl"
    append(path, send(CMD_A, "m1"))
    with path.open("a", encoding="utf-8") as handle:
        handle.write("[" * 100_000 + "]" * 100_000 + "\n[1, 2]\n{not json\n")
    append(path, send(CMD_A, "m2"))
    tail.poll()
    assert tail.sent == 2
    skipped = [r for r in caplog.records if "a line that is not a JSON object" in r.getMessage()]
    assert len(skipped) == 3, caplog.text


def test_a_line_being_written_waits_for_the_next_poll(tmp_path: Path, tail: DeliveryTail) -> None:
    path = tmp_path / "pub-0.jsonl"
    line = json.dumps(send(CMD_A, "m1"))
    path.write_text(line[:20], encoding="utf-8")
    tail.poll()
    assert tail.sent == 0
    with path.open("a", encoding="utf-8") as handle:
        handle.write(line[20:] + "\n")
    tail.poll()
    assert tail.sent == 1
    tail.poll()
    assert tail.sent == 1  # read once


def test_replayed_receives_give_latency_points(tmp_path: Path, tail: DeliveryTail) -> None:
    append(tmp_path / "pub-0.jsonl", send(CMD_A, "m1", at=100.0))
    append(tmp_path / "a.jsonl", receive("a", CMD_A, "m1", at=102.5, replayed=True), receive("a", ALL, "x", at=103))
    tail.poll()
    assert [(p.time, round(p.latency_ms), p.device) for p in tail.latencies] == [(12.5, 2500, "a")]


def test_ready_needs_every_subscription_and_for_sdk_devices_the_marker(tmp_path: Path, tail: DeliveryTail) -> None:
    append(tmp_path / "a.jsonl", *({"kind": "subscribe", "device": "a", "time": 1, "topic": t} for t in (CMD_A, ALL)))
    append(tmp_path / "b.jsonl", {"kind": "subscribe", "device": "b", "time": 1, "topic": CMD_B})
    tail.poll()
    assert tail.not_ready(need_live=["a"]) == ["a", "b"]
    append(tmp_path / "a.jsonl", {"kind": "live", "device": "a", "time": 2, "replayed_count": 0})
    append(tmp_path / "b.jsonl", {"kind": "subscribe", "device": "b", "time": 1, "topic": ALL})
    tail.poll()
    assert tail.not_ready(need_live=["a"]) == []


def test_device_kinds_follow_the_weights_evenly() -> None:
    assert device_kinds(6, {"cpl1": 1, "cpl2": 1, "paho": 1}) == ["cpl1", "cpl2", "paho"] * 2
    kinds = device_kinds(30, {"cpl1": 0, "cpl2": 2, "paho": 1})
    assert kinds.count("cpl2") == 20 and kinds.count("paho") == 10 and "cpl1" not in kinds
    assert kinds[:3].count("cpl2") == 2  # any prefix keeps the mix
    with pytest.raises(FleetError, match="weight 0"):
        device_kinds(3, {"cpl1": 0})


def test_local_config_keeps_the_users_settings_and_moves_port_and_store() -> None:
    user = {
        "listeners": {"default": {"type": "tcp", "bind": "0.0.0.0:1883"}, "ws": {"type": "ws", "bind": ":8080"}},
        "plugins": [{"amqtt_durable.DurableSessionsPlugin": {"store": "data/store", "max_depth": 7}}, "other.Plugin"],
        "timeout-disconnect-delay": 2,
    }
    config = local_config(user, 4242, store="/tmp/x", metrics_interval=1)
    assert config["listeners"] == {"default": {"type": "tcp", "bind": "127.0.0.1:4242"}}
    assert config["plugins"] == {
        "amqtt_durable.DurableSessionsPlugin": {"store": "/tmp/x", "max_depth": 7, "metrics_interval": 1},
        "other.Plugin": None,
    }
    assert config["timeout-disconnect-delay"] == 2
    assert user["plugins"][0]["amqtt_durable.DurableSessionsPlugin"]["store"] == "data/store"  # not changed


def test_the_example_schedule_fits_the_default_fleet() -> None:
    """examples/fleet_schedule.yaml, shown in the fleet docs page, loads for the default 20 devices and 45 s."""
    path = Path(__file__).parents[2] / "examples" / "fleet_schedule.yaml"
    faults = load_schedule(path, devices=[f"dev-{i:03d}" for i in range(20)], duration=45.0)
    assert [fault.kind for fault in faults] == ["drop", "stall", "broker_kill", "device_restart"]
    readme = (path.parents[1] / "docs" / "fleet.md").read_text(encoding="utf-8")  # where the README links
    assert all(line in readme for line in path.read_text(encoding="utf-8").splitlines() if line.startswith("  - "))
