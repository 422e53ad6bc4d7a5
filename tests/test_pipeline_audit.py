"""The delivery audit (durable_pipeline.audit) on synthetic and hand-written delivery logs.

Synthetic logs (durable_pipeline.synthetic) carry their own truth: the audit must find exactly
the planted loss, duplicates and reordering per device, also when payloads repeat. Hand-written
logs pin the semantics of docs/delivery-log.md one case at a time (multiset ids, subscription
windows, QoS 0 with and without count_qos0, non-durable subscriptions, unknown ids, order per
publisher, repeated payloads and redeliveries). Bad inputs, and inputs that check nothing, each
get an AuditInputError naming the file, column or reason, and exit status 2 from the CLI.
"""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any
from unittest.mock import Mock

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from matplotlib.cbook import is_math_text

from amqtt_durable.topics import matches
from durable_pipeline import audit
from durable_pipeline.audit import AuditResult, DeviceStats, run_audit
from durable_pipeline.cli import format_summary
from durable_pipeline.cli import main as cli_main
from durable_pipeline.errors import AuditInputError
from durable_pipeline.logs import HEAD_BYTES, check_local_inputs
from durable_pipeline.report import chart_label, write_report
from durable_pipeline.spark import job_session, stop_session
from durable_pipeline.synthetic import SyntheticLogs, write_logs
from durable_pipeline.topics import topic_filter_pairs

pytestmark = pytest.mark.slow  # Spark: a JVM and Python workers, seconds per test

CLI = [str(Path(sys.executable).with_name("durable-pipeline"))]
FAULTS: dict[str, Any] = {"lose": 0.02, "duplicate": 0.01, "reorder": 0.02, "repeat": 0.3, "seed": 7}


def counts(stats: DeviceStats) -> tuple[int, ...]:
    return (stats.expected, stats.received, stats.lost, stats.duplicated, stats.out_of_order, stats.replayed)


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=110, check=False)


def rec(kind: str, device: str, time: float, **fields: Any) -> dict[str, Any]:
    return {"kind": kind, "device": device, "time": time, **fields}


def sub(device: str, time: float, topic_filter: str, *, qos: int = 1, durable: bool = True) -> dict[str, Any]:
    return rec("subscribe", device, time, topic=topic_filter, qos=qos, durable=durable)


def send(time: float, topic: str, msg: str, device: str = "p", qos: int = 1) -> dict[str, Any]:
    return rec("send", device, time, topic=topic, id=msg, qos=qos)


def recv(
    device: str,
    time: float,
    topic: str,
    msg: str,
    seq: int,
    *,
    replayed: bool = False,
    redelivered: bool = False,
    epoch: int = 1,
) -> dict[str, Any]:
    return rec(
        "receive",
        device,
        time,
        topic=topic,
        id=msg,
        qos=1,
        replayed=replayed,
        redelivered=redelivered,
        seq=seq,
        epoch=epoch,
    )


@pytest.fixture(scope="module")
def faulty(spark: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[SyntheticLogs, AuditResult]:
    """6 devices x 200 messages with 2% lost, 1% duplicated, 2% reordered per device, 30% of the
    payloads repeating an earlier one (JSON lines)."""
    folder = tmp_path_factory.mktemp("faulty")
    logs = write_logs(folder / "logs" / "fleet.jsonl", 6, 200, **FAULTS)
    return logs, run_audit(spark, [str(folder / "logs")], folder / "audit", "exactly-once")


def test_finds_planted_loss_duplicates_and_reordering_per_device(faulty: tuple[SyntheticLogs, AuditResult]) -> None:
    logs, result = faulty
    assert [d.device for d in result.devices] == sorted(logs.devices)
    for stats in result.devices:
        truth = logs.devices[stats.device]
        expected = (truth.expected, truth.received, truth.lost, truth.duplicated, truth.out_of_order, truth.replayed)
        assert counts(stats) == expected, stats.device
        assert stats.unknown == 0
        assert stats.drain_max_s is not None and stats.replay_p99_ms is not None
    total = logs.total
    assert total.lost > 0 and total.duplicated > 0 and total.out_of_order > 0
    assert total.repeated > 0 and total.repeated_lost > 0  # copies of a payload, some of them lost
    assert counts(result.total) == (
        total.expected,
        total.received,
        total.lost,
        total.duplicated,
        total.out_of_order,
        total.replayed,
    )
    assert result.records == logs.records
    assert not result.ok
    assert len(result.failures) == 3 and "does NOT hold" in result.verdict
    # a replayed receive has a latency unless it is a duplicate (no send of its own)
    assert total.replayed - total.duplicated <= sum(b.count for b in result.latency_bins) <= total.replayed


def test_summary_parquet_report_and_charts(faulty: tuple[SyntheticLogs, AuditResult]) -> None:
    logs, result = faulty
    table = pq.read_table(result.summary_path).to_pylist()
    assert [row["device"] for row in table] == [*sorted(logs.devices), "ALL"]
    assert table[-1]["scope"] == "all" and table[-1]["lost"] == logs.total.lost
    page = result.report_path.read_text()
    assert result.verdict in page and "exactly-once does NOT hold" in page
    for chart in result.charts:
        assert chart.parent == result.report_path.parent
        assert chart.read_bytes().startswith(b"\x89PNG")
        assert f'src="{chart.name}"' in page
    assert {c.name for c in result.charts} == {"replay_latency.png", "loss_per_device.png"}
    printed = format_summary(result)
    assert printed.splitlines()[-1] == "FAILED: " + result.verdict
    assert "dev-00005" in printed


def test_at_least_once_fails_with_loss_and_order_can_be_ignored(
    spark: Any, faulty: tuple[SyntheticLogs, AuditResult], tmp_path: Path
) -> None:
    logs, _ = faulty
    result = run_audit(spark, [str(logs.path)], tmp_path, "at-least-once", check_order=False)
    assert not result.ok
    assert len(result.failures) == 1 and "never received" in result.failures[0]
    assert result.verdict.startswith("at-least-once does NOT hold (order not checked)")


def test_at_least_once_holds_with_duplicates(spark: Any, tmp_path: Path) -> None:
    logs = write_logs(tmp_path / "dups.parquet", 3, 100, duplicate=0.05, seed=3)
    result = run_audit(spark, [str(logs.path)], tmp_path / "audit", "at-least-once")
    assert result.ok, result.verdict
    assert result.total.duplicated == logs.total.duplicated == 15
    assert result.total.lost == 0
    assert "at-least-once holds" in result.report_path.read_text()


def assert_same_result(result: AuditResult, reference: AuditResult) -> None:
    assert [counts(d) for d in result.devices] == [counts(d) for d in reference.devices]
    assert result.total == reference.total
    assert result.latency_bins == reference.latency_bins
    assert result.verdict == reference.verdict


@pytest.fixture(scope="module")
def faulty_parquet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The faulty fixture's logs as one Parquet file, in a folder with Spark's and Hadoop's bookkeeping."""
    folder = tmp_path_factory.mktemp("faulty_parquet")
    logs = write_logs(folder / "logs" / "fleet.parquet", 6, 200, **FAULTS)
    (folder / "logs" / "_SUCCESS").write_text("")
    (folder / "logs" / ".draft.jsonl").write_text("not a log\n")
    (folder / "logs" / "_temporary" / "0").mkdir(parents=True)
    (folder / "logs" / "_temporary" / "0" / "part-0.jsonl").write_text("not a log\n")
    return logs.path


@pytest.mark.slow
def test_parquet_and_json_lines_give_the_same_result(
    spark: Any, faulty: tuple[SyntheticLogs, AuditResult], faulty_parquet: Path, tmp_path: Path
) -> None:
    _, from_json = faulty
    assert_same_result(run_audit(spark, [str(faulty_parquet)], tmp_path / "audit", "exactly-once"), from_json)


def test_file_uris_give_the_same_result_as_plain_paths(
    spark: Any, faulty: tuple[SyntheticLogs, AuditResult], faulty_parquet: Path, tmp_path: Path
) -> None:
    """Inputs go through Hadoop's FileSystem API: file:// URIs of folders and files, JSON and Parquet,
    read as their plain paths do (bookkeeping files skipped as in a local folder)."""
    logs, from_json = faulty
    for i, path in enumerate([logs.path, faulty_parquet.parent]):  # a JSON lines file; a Parquet folder
        result = run_audit(spark, [f"file://{path}"], tmp_path / f"audit{i}", "exactly-once")
        assert_same_result(result, from_json)
        assert result.records == logs.records


def test_unknown_file_system_scheme(spark: Any, tmp_path: Path) -> None:
    message = audit_error(spark, tmp_path, "nosuchfs://x/y")
    assert message.startswith("input nosuchfs://x/y: Spark has no file system for its scheme nosuchfs://"), message
    assert "UnsupportedFileSystemException" in message and "\tat " not in message and "o1" not in message


def test_clean_run_holds_through_the_cli(spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """main() in this process, with the session running: the console script in a process of its own, starting
    and stopping a session of its own (job_session), is test_pipeline_demo's run of `durable-pipeline demo`."""
    logs = write_logs(tmp_path / "logs" / "fleet.jsonl", 4, 100, seed=1)
    status = cli_main(["audit", str(logs.path), "--out", str(tmp_path / "audit"), "--expect", "exactly-once"])
    captured = capsys.readouterr()
    assert status == 0, captured.err[-2000:]
    lines = captured.out.strip().splitlines()
    assert lines[-1] == "OK: exactly-once holds"
    assert lines[0].split()[:4] == ["device", "expected", "received", "lost"]
    assert lines[1].split()[:4] == ["ALL", "400", "400", "0"]
    assert (tmp_path / "audit" / "report.html").exists()
    assert spark.range(3).count() == 3  # the session main() did not start is still running


def test_semantics_on_a_hand_written_log(spark: Any, tmp_path: Path) -> None:
    """docs/delivery-log.md, case by case (see the comments)."""

    records = [
        rec("subscribe", "r1", 10.0, topic="s/+/t", qos=1, durable=True),
        rec("subscribe", "r2", 10.0, topic="s/#", qos=1, durable=False),  # non-durable: expects nothing
        rec("subscribe", "r3", 10.0, topic="s/a/t", qos=0, durable=True),  # QoS 0: expects nothing
        send(5.0, "s/a/t", "A0"),  # before r1 subscribed: not expected (received below: fine)
        send(11.0, "s/a/t", "X"),
        send(12.0, "s/a/t", "X"),  # the same id twice: received once below = 1 lost
        send(13.0, "s/a/t", "Y"),  # received twice = 1 duplicated
        send(13.5, "s/a/t", "V", device="p2"),  # another publisher: its own order
        send(14.0, "s/b/t", "Z"),
        send(14.5, "s/b/t", "Z2"),  # received before Z: Z is out of order
        send(15.0, "s/a/t", "Q0", qos=0),  # QoS 0: never expected
        send(16.0, "s/a/x", "W"),  # s/+/t does not match
        recv("r1", 10.5, "s/a/t", "A0", 1),
        recv("r1", 18.5, "s/b/t", "Z2", 2),
        recv("r1", 19.0, "s/b/t", "Z", 3),
        recv("r1", 20.0, "s/a/t", "X", 4, replayed=True),
        recv("r1", 20.5, "s/a/t", "V", 5),
        recv("r1", 21.0, "s/a/t", "Y", 6, replayed=True),
        recv("r1", 22.0, "s/a/t", "Y", 6, epoch=2),  # a new session: not the same delivery again
        recv("r1", 23.0, "s/a/t", "U", 7),  # no log sent U: unknown
        recv("r1", 24.0, "s/a/t", "Q0", 8),
        recv("r2", 20.0, "s/a/t", "X", 1),
        rec("connect", "r1", 17.0, session_present=True),
        rec("live", "r1", 17.5, replayed_count=2),
        rec("connect", "r1", 25.0, session_present=True),  # no live follows before the next connect
        rec("connect", "r1", 30.0, session_present=True),
        rec("live", "r1", 31.5, replayed_count=0),
    ]
    result = run_audit(spark, [str(write_jsonl(tmp_path / "log.jsonl", records))], tmp_path / "audit", "exactly-once")
    r1, r2, r3 = result.devices
    assert (r1.device, r2.device, r3.device) == ("r1", "r2", "r3")
    assert (r1.expected, r1.received, r1.lost, r1.duplicated, r1.out_of_order, r1.unknown) == (6, 9, 1, 1, 1, 1)
    assert r1.replayed == 2 and r1.replay_max_ms == pytest.approx(9000.0)
    assert r1.replay_p50_ms in (pytest.approx(8000.0), pytest.approx(9000.0))
    assert r1.drain_max_s == pytest.approx(1.5) and r1.drain_p50_s in (pytest.approx(0.5), pytest.approx(1.5))
    assert counts(r2)[:5] == (0, 1, 0, 0, 0)
    assert counts(r3) == (0, 0, 0, 0, 0, 0) and r3.replay_p50_ms is None and r3.drain_p50_s is None
    assert not result.ok and len(result.failures) == 3
    assert any("no log sent" in note for note in result.notes)


def stats_by_device(result: AuditResult) -> dict[str, tuple[int, ...]]:
    """(expected, received, lost, duplicated, out_of_order) per device."""
    return {d.device: counts(d)[:5] for d in result.devices}


def test_repeated_payloads_and_redeliveries(spark: Any, tmp_path: Path) -> None:
    """The same payload sent more than once (a switch's ON and OFF): a receive repeating an earlier
    receive's (topic, epoch, seq) is the same delivery again (a duplicate); the others pair with the
    sends in time order, and order is judged on the pairs."""
    records = []
    for device in "abcdef":
        records.append(sub(device, 10.0, f"sw/{device}"))
        payloads = ["ON", "OFF", "ON", "OFF"] if device == "c" else ["ON", "OFF", "ON"]
        records += [send(11.0 + i, f"sw/{device}", msg) for i, msg in enumerate(payloads)]
    received = {
        # ON, OFF, ON received ON, ON again (a broker redelivery: same epoch and seq), OFF, ON
        "a": [("ON", 1, False), ("ON", 1, True), ("OFF", 2, False), ("ON", 3, False)],
        "b": [("OFF", 1, False), ("ON", 2, False)],  # the first ON lost
        "c": [("OFF", 1, False), ("ON", 2, False), ("OFF", 3, False)],  # ON, OFF, ON, OFF: the first ON lost
        "d": [("ON", 1, False), ("OFF", 2, False)],  # the last ON lost
        "e": [("OFF", 1, False), ("ON", 2, False), ("ON", 3, False)],  # one ON came after the other two
        "f": [("ON", 0, False), ("OFF", 0, False), ("ON", 0, False)],  # raw events: seq 0 is no delivery id
    }
    for device, receives in received.items():
        records += [
            recv(device, 20.0 + i, f"sw/{device}", msg, seq, redelivered=again, epoch=0 if device == "f" else 1)
            for i, (msg, seq, again) in enumerate(receives)
        ]
    # stream events (epoch 0): seq is per stream topic, the same seq on two topics is two deliveries
    records += [sub("g", 10.0, "st/#"), send(11.0, "st/1", "X"), send(11.0, "st/2", "Y")]
    records += [recv("g", 20.0, "st/1", "X", 5, epoch=0), recv("g", 20.0, "st/2", "Y", 5, epoch=0)]
    result = run_audit(spark, [str(write_jsonl(tmp_path / "log.jsonl", records))], tmp_path / "audit", "exactly-once")
    assert stats_by_device(result) == {
        "a": (3, 4, 0, 1, 0),
        "b": (3, 2, 1, 0, 0),
        "c": (4, 3, 1, 0, 0),
        "d": (3, 2, 1, 0, 0),
        "e": (3, 3, 0, 0, 1),
        "f": (3, 3, 0, 0, 0),
        "g": (2, 2, 0, 0, 0),
    }


def test_subscription_windows(spark: Any, tmp_path: Path) -> None:
    """A subscription expects sends from its subscribe until its unsubscribe, the device's
    session_end or a change to non-durable or QoS 0 (sends at the close are not expected); a later
    subscribe opens a new window."""
    records = [
        # w1: subscribed, unsubscribed, subscribed again: the send in between is not expected
        sub("w1", 10.0, "w/1"),
        send(11.0, "w/1", "A"),
        rec("unsubscribe", "w1", 12.0, topic="w/1"),
        send(13.0, "w/1", "B"),
        sub("w1", 14.0, "w/1"),
        send(15.0, "w/1", "C"),
        recv("w1", 20.0, "w/1", "A", 1),
        recv("w1", 21.0, "w/1", "C", 2),
        # w2: the session ended (every window of the device closes), then subscribed anew
        sub("w2", 10.0, "w/2/#"),
        send(11.0, "w/2/t", "A"),
        rec("session_end", "w2", 12.0),
        send(13.0, "w/2/t", "B"),  # not expected; received anyway: not a duplicate
        sub("w2", 14.0, "w/2/#"),
        send(15.0, "w/2/t", "C"),  # expected and lost
        recv("w2", 20.0, "w/2/t", "A", 1),
        recv("w2", 21.0, "w/2/t", "B", 1, epoch=2),
        # w3: the same filter made non-durable (a stateless client) then durable again
        sub("w3", 10.0, "w/3"),
        send(11.0, "w/3", "A"),
        sub("w3", 12.0, "w/3", durable=False),
        send(13.0, "w/3", "B"),
        sub("w3", 14.0, "w/3"),
        send(15.0, "w/3", "C"),
        recv("w3", 20.0, "w/3", "A", 1),
        recv("w3", 21.0, "w/3", "C", 2),
        # w4: unsubscribing one filter leaves the other matching filter's window open
        sub("w4", 10.0, "w/4/+"),
        sub("w4", 10.0, "w/4/#"),
        rec("unsubscribe", "w4", 12.0, topic="w/4/+"),
        send(13.0, "w/4/t", "A"),  # expected (w/4/#) and lost
        # w5: a session end is not another device's
        sub("w5", 10.0, "w/5"),
        send(11.0, "w/5", "A"),
        rec("session_end", "w5", 12.0),
        send(13.0, "w/5", "B"),
        recv("w5", 20.0, "w/5", "A", 1),
        sub("w6", 10.0, "w/5"),
        recv("w6", 20.0, "w/5", "A", 1),
        recv("w6", 21.0, "w/5", "B", 2),
        # w7: a durable QoS 0 subscribe of the filter closes its window too
        sub("w7", 10.0, "w/7"),
        send(11.0, "w/7", "A"),
        sub("w7", 12.0, "w/7", qos=0),
        send(13.0, "w/7", "B"),  # not expected; received anyway: not a duplicate
        recv("w7", 20.0, "w/7", "A", 1),
        recv("w7", 21.0, "w/7", "B", 2),
        # w8: a send at the subscribe's time is expected, one at the unsubscribe's time is not
        sub("w8", 10.0, "w/8"),
        send(10.0, "w/8", "A"),
        rec("unsubscribe", "w8", 12.0, topic="w/8"),
        send(12.0, "w/8", "B"),
        recv("w8", 20.0, "w/8", "A", 1),
    ]
    result = run_audit(spark, [str(write_jsonl(tmp_path / "log.jsonl", records))], tmp_path / "audit", "exactly-once")
    assert stats_by_device(result) == {
        "w1": (2, 2, 0, 0, 0),
        "w2": (2, 2, 1, 0, 0),
        "w3": (2, 2, 0, 0, 0),
        "w4": (1, 0, 1, 0, 0),
        "w5": (1, 1, 0, 0, 0),
        "w6": (2, 2, 0, 0, 0),
        "w7": (1, 2, 0, 0, 0),
        "w8": (1, 1, 0, 0, 0),
    }


def qos0_records() -> list[dict[str, Any]]:
    """QoS 0 sends (some not received) to a QoS 1, a QoS 0 and a non-durable subscription."""
    return [
        sub("r1", 10.0, "q/t"),
        sub("r0", 10.0, "q/t", qos=0),  # opens a window only with count_qos0
        sub("rn", 10.0, "q/t", qos=0, durable=False),  # non-durable: expects nothing either way
        sub("rq", 10.0, "q/t"),
        sub("rq", 10.5, "q/t", qos=0),  # closes rq's window, only without count_qos0
        send(11.0, "q/t", "Q1", qos=0),
        send(12.0, "q/t", "Q2", qos=0),
        send(13.0, "q/t", "Q3", qos=0),
        send(14.0, "q/t", "A"),
        recv("r1", 20.0, "q/t", "Q1", 1),
        recv("r1", 21.0, "q/t", "A", 2),
        recv("r0", 20.0, "q/t", "Q2", 1),
        recv("r0", 21.0, "q/t", "A", 2),
        recv("rn", 20.0, "q/t", "Q1", 1),
        *(recv("rq", 20.0 + i, "q/t", msg, i + 1) for i, msg in enumerate(["Q1", "Q2", "Q3", "A"])),
    ]


def test_qos0_is_expected_only_when_counted(spark: Any, tmp_path: Path) -> None:
    """Without count_qos0 QoS 0 promises nothing; with it, the QoS 0 sends not received are lost."""
    log = str(write_jsonl(tmp_path / "qos0.jsonl", qos0_records()))
    plain = run_audit(spark, [log], tmp_path / "plain", "exactly-once")
    assert stats_by_device(plain) == {
        "r0": (0, 2, 0, 0, 0),
        "r1": (1, 2, 0, 0, 0),
        "rn": (0, 1, 0, 0, 0),
        "rq": (0, 4, 0, 0, 0),
    }
    assert plain.ok and plain.verdict == "exactly-once holds" and not plain.count_qos0
    counted = run_audit(spark, [log], tmp_path / "counted", "exactly-once", count_qos0=True)
    assert stats_by_device(counted) == {
        "r0": (4, 2, 2, 0, 0),
        "r1": (4, 2, 2, 0, 0),
        "rn": (0, 1, 0, 0, 0),
        "rq": (4, 4, 0, 0, 0),
    }
    assert counted.count_qos0 and not counted.ok
    assert counted.verdict == (
        "exactly-once does NOT hold (QoS 0 counted): 4 of 12 expected messages never received (2 devices)"
    )
    assert "QoS 0 counted" in counted.report_path.read_text()


def test_count_qos0_through_the_cli(spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI's flags reach the audit. In this process, as test_clean_run_holds_through_the_cli: main() audits
    with the session already running and leaves it running."""
    log = write_jsonl(tmp_path / "qos0.jsonl", qos0_records())
    out = str(tmp_path / "audit")
    status = cli_main(["audit", str(log), "--out", out, "--expect", "at-least-once", "--ignore-order", "--count-qos0"])
    captured = capsys.readouterr()
    assert status == 1, captured.err[-2000:]
    assert captured.out.strip().splitlines()[-1] == (
        "FAILED: at-least-once does NOT hold (order not checked, QoS 0 counted): "
        "4 of 12 expected messages never received (2 devices)"
    )
    assert spark.range(3).count() == 3  # the session main() did not start is still running


def test_chart_labels_escape_mathtext(tmp_path: Path) -> None:
    """Device ids are client ids: '$' or '\\' in them must not be read as matplotlib mathtext."""
    names = ["price$\\x$", "a\\$b$", "$$", "plain"]
    for name in names:
        label = chart_label(name)
        assert not is_math_text(label) and label.replace("\\$", "$") == name
    devices = [DeviceStats(name, 2, 1, 1, 0, 0, 0, 0, None, None, None, None, None) for name in names]
    total = DeviceStats("ALL", 8, 4, 4, 0, 0, 0, 0, None, None, None, None, None)
    result = AuditResult(
        ok=False,
        expect="exactly-once",
        check_order=True,
        count_qos0=False,
        total=total,
        devices=devices,
        latency_bins=[],
        records=16,
        inputs=["logs"],
        failures=["4 of 8 expected messages never received (4 devices)"],
        notes=[],
        summary_path=tmp_path / "summary.parquet",
        report_path=tmp_path / "report.html",
    )
    for chart in write_report(result, tmp_path):
        assert chart.read_bytes().startswith(b"\x89PNG")
    assert "price$\\x$" in result.report_path.read_text()


def test_topic_filter_matching_agrees_with_the_broker(spark: Any) -> None:
    topics = ["a", "a/b", "a/b/c", "/a", "a/", "a//b", "$SYS/x", "$SYS", "b/a", "/", "a/b/c/d", "x/y"]
    filters = ["a", "a/#", "#", "+", "+/+", "a/+", "a/+/c", "/+", "+/#", "$SYS/#", "a/b/#", "a//b", "/#", "+/y"]
    pairs = topic_filter_pairs(
        spark.createDataFrame([(t,) for t in topics], "topic string"),
        spark.createDataFrame([(f,) for f in filters], "filter string"),
    )
    assert {(row.topic, row.filter) for row in pairs.collect()} == {
        (t, f) for t in topics for f in filters if matches(t, f)
    }


# ------------------------------------------------------------------ bad input


def good_records() -> list[dict[str, Any]]:
    return [
        {"kind": "subscribe", "device": "r", "time": 1.0, "topic": "t", "qos": 1, "durable": True},
        {"kind": "send", "device": "p", "time": 2.0, "topic": "t", "id": "a", "qos": 1},
        {"kind": "receive", "device": "r", "time": 3.0, "topic": "t", "id": "a", "qos": 1, "seq": 1},
    ]


def audit_error(spark: Any, tmp_path: Path, *inputs: Path | str) -> str:
    with pytest.raises(AuditInputError) as caught:
        run_audit(spark, [str(p) for p in inputs], tmp_path / "audit", "exactly-once")
    return str(caught.value)


def test_missing_input_path(spark: Any, tmp_path: Path) -> None:
    message = audit_error(spark, tmp_path, tmp_path / "nowhere.jsonl")
    assert "nowhere.jsonl does not exist" in message


def test_json_lines_that_are_not_json(spark: Any, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", good_records())
    with path.open("a") as handle:
        handle.write('{"kind": "send", "device": "p", "time": "soon"}\n{"kind": "send", "dev\n')
    message = audit_error(spark, tmp_path, path)
    assert f"{path}: 2 of 5 lines" in message and "not JSON objects" in message


def test_truncated_parquet(spark: Any, tmp_path: Path) -> None:
    whole = tmp_path / "whole.parquet"
    pq.write_table(pa.Table.from_pylist(good_records()), whole)
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(whole.read_bytes()[:-40])
    message = audit_error(spark, tmp_path, whole, cut)
    assert f"{cut} is not a readable Parquet file" in message


def test_missing_required_columns_are_named(spark: Any, tmp_path: Path) -> None:
    parquet = tmp_path / "nodevice.parquet"
    pq.write_table(
        pa.Table.from_pylist([{k: v for k, v in r.items() if k != "device"} for r in good_records()]), parquet
    )
    assert f"{parquet} lacks the required column(s) device" in audit_error(spark, tmp_path, parquet)
    records = good_records()
    del records[1]["id"], records[2]["topic"]
    json_path = write_jsonl(tmp_path / "noid.jsonl", records)
    message = audit_error(spark, tmp_path, json_path)
    assert str(json_path) in message
    assert "id (in send records): 1" in message and "topic (in receive records): 1" in message


def test_parquet_column_types(spark: Any, tmp_path: Path) -> None:
    """Other integer and float widths are cast; a column pyarrow wrote as null (Spark reads int) holds
    nothing and is read as nulls; a column with values of a type that does not convert is named."""
    names = {name for r in good_records() for name in r}  # from_pylist takes the first record's keys
    rows = [{**dict.fromkeys(names), **r, "time": int(r["time"]), "replayed": None} for r in good_records()]
    table = pa.Table.from_pylist(rows)
    assert table.schema.field("replayed").type == pa.null() and table.schema.field("time").type == pa.int64()
    widths = tmp_path / "widths.parquet"
    pq.write_table(table, widths)
    assert run_audit(spark, [str(widths)], tmp_path / "audit", "exactly-once").ok
    numbers = tmp_path / "numbers.parquet"
    pq.write_table(pa.Table.from_pylist([{**r, "topic": 7} for r in good_records()]), numbers)
    message = audit_error(spark, tmp_path, numbers)
    assert f"column topic of {numbers} is bigint, which does not convert to string" in message


def test_unknown_kind(spark: Any, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "kinds.jsonl", [*good_records(), {"kind": "ack", "device": "r", "time": 4.0}])
    message = audit_error(spark, tmp_path, path)
    assert "unknown kind values" in message and "kind='ack'" in message and str(path) in message


def test_no_records_and_no_subscriptions(spark: Any, tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert "hold no records" in audit_error(spark, tmp_path, empty)
    only_sends = write_jsonl(tmp_path / "sends.jsonl", good_records()[1:2])
    assert "no subscribe records" in audit_error(spark, tmp_path, only_sends)


def test_inputs_that_check_nothing(spark: Any, tmp_path: Path) -> None:
    """No send records, or no send any subscription expected: an audit that checked nothing must not pass."""
    no_sends = write_jsonl(tmp_path / "nosends.jsonl", [good_records()[0], good_records()[2]])
    assert "no send records: was the publisher's delivery_log written?" in audit_error(spark, tmp_path, no_sends)
    late = write_jsonl(tmp_path / "late.jsonl", [{**good_records()[0], "time": 2.5}, *good_records()[1:]])
    message = audit_error(spark, tmp_path, late)
    assert "nothing was expected" in message and "1 send" in message


def test_unreadable_gzip_and_out_a_file(spark: Any, tmp_path: Path) -> None:
    """Spark's read error names the file (not a Py4J call); --out naming a file is an input error."""
    packed = gzip.compress("".join(json.dumps(r) + "\n" for r in good_records() * 50).encode())
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(packed[: len(packed) // 2])
    message = audit_error(spark, tmp_path, cut)
    assert f"{cut} cannot be read" in message and "collectToPython" not in message, message
    good = write_jsonl(tmp_path / "good.jsonl", good_records())
    out = tmp_path / "out.txt"
    out.write_text("not a folder\n")
    with pytest.raises(AuditInputError, match="is not a folder"):
        run_audit(spark, [str(good)], out, "exactly-once")


def cache_is_empty(spark: Any) -> bool:
    return bool(spark._jsparkSession.sharedState().cacheManager().isEmpty())


def test_cleanup_releases_the_cache_and_never_hides_the_error(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An audit leaves nothing cached. When a job fails because the SparkContext died, unpersist and
    stop fail too (bench/RESULTS.md: a NullPointerException hid an OutOfMemoryError): the cleanup
    logs those, and the job's own error is what the caller gets."""
    spark.catalog.clearCache()
    path = str(write_jsonl(tmp_path / "good.jsonl", good_records()))
    assert run_audit(spark, [path], tmp_path / "audit", "exactly-once").ok
    assert cache_is_empty(spark)

    def job_fails(*args: Any) -> Any:
        raise RuntimeError("Job aborted: java.lang.OutOfMemoryError: Java heap space")

    def context_gone(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("java.lang.NullPointerException (the SparkContext is stopped)")

    monkeypatch.setattr(audit, "_summary", job_fails)
    monkeypatch.setattr(type(spark.range(1)), "unpersist", context_gone)  # pyspark's classic DataFrame
    with pytest.raises(RuntimeError, match="OutOfMemoryError"):
        run_audit(spark, [path], tmp_path / "audit", "exactly-once")
    assert "could not unpersist a cached frame" in caplog.text
    stop_session(Mock(stop=Mock(side_effect=ConnectionRefusedError("the JVM exited"))))
    assert "could not stop the SparkSession" in caplog.text
    monkeypatch.undo()
    spark.catalog.clearCache()


def test_cli_exit_2_on_bad_input(tmp_path: Path) -> None:
    """A missing local path, and a local file that is neither JSON lines nor Parquet, are checked before Spark
    starts (check_local_inputs, no JVM): a quick exit from the console script with the message on stderr."""
    done = run_cli("audit", str(tmp_path / "missing"), "--out", str(tmp_path / "o"), "--expect", "exactly-once")
    assert done.returncode == 2
    assert "durable-pipeline audit: error:" in done.stderr and "missing does not exist" in done.stderr
    notes = tmp_path / "notes.txt"
    notes.write_text("hello\n")
    with pytest.raises(AuditInputError, match=f"^{re.escape(str(notes))} is neither JSON lines nor Parquet"):
        check_local_inputs([str(notes)])  # Python alone: no SparkSession, no JVM
    done = run_cli("audit", str(notes), "--out", str(tmp_path / "o"), "--expect", "at-least-once")
    assert done.returncode == 2 and f"error: {notes} is neither JSON lines nor Parquet" in done.stderr


def test_local_files_are_told_apart_by_extension_else_by_first_bytes(tmp_path: Path) -> None:
    """check_local_inputs, before any JVM: known extensions pass whatever they hold (Spark's read checks the
    content), other names pass when they start (after whitespace) with PAR1 or {; folders and URIs are checked in
    Spark's JVM (test_a_file_neither_json_lines_nor_parquet_in_a_folder_or_a_uri)."""
    (tmp_path / "a.jsonl.gz").write_bytes(b"not checked here")
    (tmp_path / "b.parquet").write_text("nor here")
    (tmp_path / "c").write_text("\n  {}\n")
    (tmp_path / "d.bin").write_bytes(b"PAR1....")
    check_local_inputs([str(tmp_path / name) for name in ("a.jsonl.gz", "b.parquet", "c", "d.bin")])
    check_local_inputs([str(tmp_path), f"file://{tmp_path}/nowhere"])
    (tmp_path / "e.txt").write_text("")
    with pytest.raises(AuditInputError, match=r"e\.txt is neither JSON lines nor Parquet"):
        check_local_inputs([str(tmp_path / "c"), str(tmp_path / "e.txt")])


def test_gzip_a_byte_order_mark_and_blank_lines_are_sniffed_as_spark_reads_them(tmp_path: Path) -> None:
    """Without a known extension: a gzip file named *.gz is judged by its decompressed start (Spark decompresses
    by the suffix), a UTF-8 byte order mark and blank lines (beyond the 64 bytes once read) are skipped; a gzip
    file not named *.gz (Spark reads it raw), gzipped Parquet (Spark's Parquet reader decompresses nothing) and
    blank lines filling the whole head are refused."""
    lines = "".join(json.dumps(r) + "\n" for r in good_records()).encode()
    passing = {
        "log.txt.gz": gzip.compress(lines),
        "log.gz": gzip.compress(b"\xef\xbb\xbf" + b"\n" * 1000 + lines),
        "bom.txt": b"\xef\xbb\xbf" + lines,
        "blank.txt": b"\r\n" * 200 + lines,
        "p.gz": b"PAR1....",  # named .gz, not gzip: Spark's Parquet reader reads it as it is
    }
    for name, data in passing.items():
        (tmp_path / name).write_bytes(data)
    check_local_inputs([str(tmp_path / name) for name in passing])
    refused = {
        "gzip.bin": gzip.compress(lines),
        "parquet.gz": gzip.compress(b"PAR1...."),
        "cut.gz": gzip.compress(lines)[:2] + b"garbage",
        "blank.gz": gzip.compress(b"\n" * HEAD_BYTES + lines),
        "blank.txt2": b"\n" * HEAD_BYTES + lines,
        "plain.gz": lines,  # named .gz, not gzip: Spark would try to decompress it
    }
    for name, data in refused.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(AuditInputError, match=f"{re.escape(name)} is neither JSON lines nor Parquet"):
            check_local_inputs([str(tmp_path / name)])


def test_a_gzip_log_without_a_log_extension_is_audited_like_the_plain_one(spark: Any, tmp_path: Path) -> None:
    """The same sniff in Spark's JVM, for the files of a folder: log.gz (a byte order mark and blank lines first)
    is read decompressed, as its plain JSON lines are."""
    plain = write_logs(tmp_path / "plain" / "fleet.jsonl", 3, 40, lose=0.1, seed=3)
    (tmp_path / "packed").mkdir()
    (tmp_path / "packed" / "log.gz").write_bytes(gzip.compress(b"\xef\xbb\xbf\n\n" + plain.path.read_bytes()))
    reference = run_audit(spark, [str(plain.path)], tmp_path / "audit-plain", "exactly-once")
    result = run_audit(spark, [str(tmp_path / "packed")], tmp_path / "audit-packed", "exactly-once")
    assert_same_result(result, reference)
    assert result.records == reference.records == plain.records


def test_job_session_in_another_thread_leaves_the_running_session_as_it_was(spark: Any) -> None:
    """A job (the audit CLI's main(), the demo) run in a thread other than the one that started the process's
    session runs in that session and neither stops it nor changes its settings or log level."""
    log4j = spark._jvm.org.apache.logging.log4j.LogManager
    spark.sparkContext.setLogLevel("WARN")
    partitions = spark.conf.get("spark.sql.shuffle.partitions")
    seen: dict[str, Any] = {}

    def job() -> None:
        try:
            with job_session("local[1]", "job-in-a-thread") as session:
                seen["same"] = session._jsparkSession.equals(spark._jsparkSession)
                seen["count"] = session.range(2).count()
        except BaseException as exc:  # reported to the test's thread
            seen["error"] = exc

    worker = threading.Thread(target=job)
    try:
        worker.start()
        worker.join(120)
        assert not worker.is_alive() and "error" not in seen, seen
        assert seen == {"same": True, "count": 2}
        assert spark.sparkContext._jsc is not None, "the job stopped the session it did not start"
        assert spark.range(3).count() == 3
        assert spark.conf.get("spark.sql.shuffle.partitions") == partitions
        assert str(log4j.getRootLogger().getLevel()) == "WARN"
    finally:
        if spark.sparkContext._jsc is not None:
            spark.sparkContext.setLogLevel("ERROR")  # as get_session left it for the other tests


def test_a_file_neither_json_lines_nor_parquet_in_a_folder_or_a_uri(spark: Any, tmp_path: Path) -> None:
    """The same check in Spark's JVM (Hadoop's FileSystem API) for the files of a folder and for URIs."""
    folder = tmp_path / "logs"
    folder.mkdir()
    write_jsonl(folder / "good.jsonl", good_records())
    (folder / "notes.txt").write_text("hello\n")
    assert f"{folder}/notes.txt is neither JSON lines nor Parquet" in audit_error(spark, tmp_path, folder)
    message = audit_error(spark, tmp_path, f"file://{folder}/notes.txt")
    assert f"{folder}/notes.txt is neither JSON lines nor Parquet" in message


def test_cli_exit_2_on_a_missing_file_uri(spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A URI is checked by Hadoop, in Spark's JVM: the same exit status and message as a local path (main() in
    this process, with the running session, which it leaves running)."""
    missing = f"file://{tmp_path}/missing.jsonl"
    status = cli_main(["audit", missing, "--out", str(tmp_path / "o"), "--expect", "exactly-once"])
    captured = capsys.readouterr()
    assert status == 2, captured.err[-2000:]
    assert f"durable-pipeline audit: error: input {missing} does not exist" in captured.err
    assert "Traceback" not in captured.err
    assert spark.range(3).count() == 3
