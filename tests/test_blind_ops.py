"""Black-box checks of the operator's promises (docs/operations.md, docs/configuration.md),
written from the documents alone: real broker processes, real paho clients over TCP, the real
``amqtt-durable`` command. Each test quotes the promise it checks."""

from __future__ import annotations

import json
import re
import socket
import struct
import time
from collections.abc import Callable
from pathlib import Path

import plyvel
import pytest
from raw_mqtt_helpers import raw_connect, read_packet
from test_blind_core import MARKER, closed_by_broker, control, frame, inspect_json, seen_disconnected, stream_events

from conftest import (
    WAIT,
    Broker,
    Client,
    free_port,
    mqtt_packet,
    mqtt_string,
    payloads,
    probe_connack,
    queued_while_dropped,
    run_cli,
)


# ------------------------------------------------------------------ helpers
def inspect_lines(store: str, *options: str) -> list[str]:
    """``amqtt-durable inspect STORE [options]``'s lines; exit code 0 asserted."""
    result = run_cli("inspect", store, *options)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.splitlines()


def assert_laid_out(lines: list[str], cells: list[list[str]]) -> None:
    """operations.md, inspect: "each column as wide as its widest cell, header included, and two
    spaces between columns, trailing spaces cut". ``cells``: the header's and each row's cells."""
    starts = [0]
    for column in range(len(cells[0]) - 1):
        starts.append(starts[-1] + max(len(row[column]) for row in cells) + 2)
    assert len(lines) == len(cells), lines
    for line, row in zip(lines, cells, strict=True):
        assert line == line.rstrip(), f"trailing spaces: {line!r}"
        for start, cell in zip(starts, row, strict=True):
            assert line[start:start + len(cell)] == cell, (line, cell, start)
            assert start == 0 or line[start - 2:start] == "  ", (line, cell, start)


def hello_and_leave(broker: Broker, clients: Callable[..., Client], client_id: str, expiry: float) -> None:
    """A durable session whose hello asks ``expiry`` seconds (docs/protocol.md, hello), then a DISCONNECT."""
    device = clients(broker.port, client_id)
    assert control(device, {"v": 1, "op": "hello", "session_expiry": expiry})["ok"] is True
    device.disconnect()


# ------------------------------------------------------------------ inspect: sessions
def test_inspect_lays_out_wide_cells_lists_sessions_by_client_id_and_subscriptions_by_filter(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """docs/operations.md, Operator commands, inspect's table: "each column as wide as its widest
    cell, ... header included, and two spaces between columns, trailing spaces cut", subscriptions as
    `filter@qos` ("comma-separated, sorted by filter in code-point order, as client ids: `B` before
    `a`; `-` for none"), "one row per session in client id order"; then `<n> session(s), <m> queued
    message(s)`."""
    broker = broker_factory(metrics_interval=0.2)
    wide = "a-client-id-wider-than-its-column-name"
    sessions = (("zeta", [("x/#", 1), ("a/b", 0), ("m/+", 2), ("B/c", 1)]), (wide, [("x/y", 1)]), ("Bare", []))
    for client_id, filters in sessions:
        device = clients(broker.port, client_id)
        if filters:
            device.subscribe(filters)
        device.disconnect()
    clients(broker.port, "pub", clean_session=True).publish("x/y", payloads(3), qos=1)
    seen_disconnected(clients, broker.port, 3)
    broker.stop()
    lines = inspect_lines(broker.store)
    rows = [line.split() for line in lines[1:-1]]
    assert [row[0] for row in rows] == ["Bare", wide, "zeta"], lines  # "B" < "a" < "z" in UTF-8
    assert [row[-1] for row in rows] == ["-", "x/y@1", "B/c@1,a/b@0,m/+@2,x/#@1"], lines
    header = ["CLIENT ID", "DEPTH", "BYTES", "OLDEST", "EXPIRES IN", "DROPPED", "SUBSCRIPTIONS"]
    assert_laid_out(lines[:-1], [header, *rows])
    assert lines[0] != "CLIENT ID  DEPTH  BYTES  OLDEST  EXPIRES IN  DROPPED  SUBSCRIPTIONS"  # a wider cell
    assert lines[-1] == "3 session(s), 6 queued message(s)", lines


def test_inspect_keeps_one_line_per_row_whatever_characters_a_client_chose(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    """operations.md, inspect: "one row per session", with `--retained` one row per retained message:
    a client id, filter or topic a client chose with a newline, a tab, a terminal escape, a backslash,
    a format character (U+200D) or a space other than the ASCII space (U+00A0) cannot split a row or
    forge another; they read escaped as Python writes them (`\\n`, `\\t`, `\\x1b`, `\\\\`, `\\u200d`,
    `\\xa0`), "spaces, commas and `@` show as they are", each column is as wide as its widest cell,
    "counted in characters of the escaped text", and `--json` gives them as they are."""
    client_id = "dev\nfake-row  0  0  -  -  0  x@1,y@2\t\x1b[31m\\\u200d\xa0\u00e9"
    device = clients(broker.port, client_id)
    device.subscribe("a\nb/#", 1)
    device.disconnect()
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("top\nic", [b"x"], qos=1, retain=True)
    publisher.disconnect()
    broker.stop()
    lines = inspect_lines(broker.store)
    assert len(lines) == 3 and lines[-1] == "1 session(s), 0 queued message(s)", lines
    escaped = "dev\\nfake-row  0  0  -  -  0  x@1,y@2\\t\\x1b[31m\\\\\\u200d\\xa0\u00e9"
    assert lines[1].startswith(escaped + "  "), lines
    assert lines[1].endswith("  a\\nb/#@1"), lines
    header = ["CLIENT ID", "DEPTH", "BYTES", "OLDEST", "EXPIRES IN", "DROPPED", "SUBSCRIPTIONS"]
    assert_laid_out(lines[:-1], [header, [escaped, *lines[1][len(escaped):].split()]])
    [row] = inspect_json(broker.store)
    assert (row["client_id"], row["subscriptions"]) == (client_id, {"a\nb/#": 1})
    retained = inspect_lines(broker.store, "--retained")
    assert len(retained) == 3 and retained[1].startswith("top\\nic  1  "), retained
    [listed] = json.loads("\n".join(inspect_lines(broker.store, "--retained", "--json")))
    assert listed["topic"] == "top\nic"


def test_inspect_rounds_times_to_the_unit_the_page_names(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """docs/operations.md, Operator commands, inspect: "ages and times read `45s` (under 2 minutes ...), `5m` (under 2
    hours) or `3.5h`", "rounded to the nearest second, minute or tenth of an hour" (so a session
    expiring in just under 2 hours reads `120m`). Each session's expiry is its hello's."""
    broker = broker_factory(metrics_interval=0.2)
    expiries = {"secs": 110, "mins": 300, "edge": 7200, "hours": 12600}
    for client_id, expiry in expiries.items():
        hello_and_leave(broker, clients, client_id, expiry)
    seen_disconnected(clients, broker.port, len(expiries))
    broker.stop()
    shown = {line.split()[0]: line.split()[4] for line in inspect_lines(broker.store)[1:-1]}
    seconds = re.fullmatch(r"(\d+)s", shown["secs"])
    assert seconds is not None and 90 <= int(seconds.group(1)) <= 110, shown  # a loaded machine: seconds pass
    assert (shown["mins"], shown["edge"], shown["hours"]) == ("5m", "120m", "3.5h"), shown


def test_inspect_shows_a_queue_s_drops_bytes_and_oldest_age_and_dash_for_an_empty_queue(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """docs/operations.md, Operator commands: inspect shows "queue depth and payload bytes, age of the oldest queued
    message, ... dropped count (since the session was created, across restarts and reconnects)";
    `--json` "`oldest_age_s` ... null where none"; configuration.md, `overflow` default
    `drop-oldest`: the oldest queued message goes."""
    broker = broker_factory(max_depth=2, max_depth_disconnected=2, metrics_interval=0.2)
    for client_id in ("full", "empty"):
        device = clients(broker.port, client_id)
        device.subscribe(f"{client_id}/t", 1)
        device.disconnect()
    sent = [b"one", b"two22", b"three333", b"four4444"]
    clients(broker.port, "pub", clean_session=True).publish("full/t", sent, qos=1)
    seen_disconnected(clients, broker.port, 2)
    broker.stop()
    rows = {row["client_id"]: row for row in inspect_json(broker.store)}
    full, empty = rows["full"], rows["empty"]
    assert (full["depth"], full["bytes"], full["dropped"]) == (2, len(sent[2]) + len(sent[3]), 2), full
    assert isinstance(full["oldest_age_s"], float) and 0 <= full["oldest_age_s"] < 60, full
    assert (empty["depth"], empty["bytes"], empty["dropped"], empty["oldest_age_s"]) == (0, 0, 0, None), empty
    table = {line.split()[0]: line.split() for line in inspect_lines(broker.store)[1:-1]}
    assert table["full"][1:3] == ["2", str(len(sent[2]) + len(sent[3]))] and table["full"][5] == "2", table
    assert re.fullmatch(r"\d+s", table["full"][3]), table
    assert table["empty"][1:4] == ["0", "0", "-"] and table["empty"][5] == "0", table
    broker.start()  # "dropped count (since the session was created, across restarts and reconnects)"
    drained = clients(broker.port, "full")
    assert [m.payload for m in drained.wait_messages(2)] == sent[2:]
    drained.disconnect()
    seen_disconnected(clients, broker.port, 2)
    broker.stop()
    again = {row["client_id"]: row for row in inspect_json(broker.store)}["full"]
    assert (again["depth"], again["bytes"], again["dropped"], again["oldest_age_s"]) == (0, 0, 2, None), again


def test_inspect_of_a_new_store_prints_the_header_and_counts_of_zero(broker_factory: Callable[..., Broker]) -> None:
    """docs/operations.md, Operator commands, inspect: "(a store without sessions: the header and
    `0 session(s), 0 queued message(s)`)"; with `--retained`: header `TOPIC`, `QOS`, `BYTES`, `AGE`, then
    `<n> retained message(s)`; `--json`: a list (empty)."""
    broker = broker_factory()
    broker.stop()
    assert inspect_lines(broker.store) == [
        "CLIENT ID  DEPTH  BYTES  OLDEST  EXPIRES IN  DROPPED  SUBSCRIPTIONS",
        "0 session(s), 0 queued message(s)",
    ]
    assert inspect_lines(broker.store, "--retained") == ["TOPIC  QOS  BYTES  AGE", "0 retained message(s)"]
    for options in ((), ("--retained",)):
        assert json.loads("\n".join(inspect_lines(broker.store, *options, "--json"))) == []


# ------------------------------------------------------------------ inspect: retained
def test_inspect_retained_lists_topics_in_order_laid_out_like_the_sessions(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    """docs/operations.md, Operator commands, inspect: "With `--retained` it lists the retained
    messages instead, in topic order: topic, QoS, payload bytes and age (header `TOPIC`, `QOS`,
    `BYTES`, `AGE`, laid out the same way), then `<n> retained message(s)`"; a retained message
    cleared by an empty retained PUBLISH is gone (MQTT-3.3.1-10)."""
    publisher = clients(broker.port, "pub", clean_session=True)
    long_topic = "plant/a-topic-wider-than-its-column-name/temperature"
    publisher.publish(long_topic, [b"21.5"], qos=1, retain=True)
    publisher.publish("a/b", [b"x" * 1234], qos=0, retain=True)
    publisher.publish("Z/z", [b"zz"], qos=2, retain=True)
    publisher.publish("gone", [b"soon cleared"], qos=1, retain=True)
    publisher.publish("gone", [b""], qos=1, retain=True)
    publisher.disconnect()
    broker.stop()
    lines = inspect_lines(broker.store, "--retained")
    rows = [line.split() for line in lines[1:-1]]
    assert [row[:3] for row in rows] == [["Z/z", "2", "2"], ["a/b", "0", "1234"], [long_topic, "1", "4"]], lines
    assert all(re.fullmatch(r"\d+s", row[3]) for row in rows), lines
    assert_laid_out(lines[:-1], [["TOPIC", "QOS", "BYTES", "AGE"], *rows])
    assert lines[-1] == "3 retained message(s)"
    listed = json.loads("\n".join(inspect_lines(broker.store, "--retained", "--json")))
    assert [(row["topic"], row["qos"], row["bytes"]) for row in listed] == [
        ("Z/z", 2, 2), ("a/b", 0, 1234), (long_topic, 1, 4)
    ]


# ------------------------------------------------------------------ folders that are not stores
def test_inspect_and_repair_of_a_missing_path_create_nothing(tmp_path: Path) -> None:
    """docs/operations.md, Operator commands, inspect: "A missing or empty folder: `no store at
    '...'` ...; each exit code 1, and nothing is created"; repair: "A path that is missing ... is
    refused with `no store at '...'` ...; exit code 1, untouched"."""
    nowhere = tmp_path / "data" / "durable"
    for command in ("inspect", "repair"):
        refused = run_cli(command, str(nowhere))
        assert refused.returncode == 1, refused.stderr
        assert f"no store at '{nowhere}'" in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr
        assert list(tmp_path.iterdir()) == [], command


def test_a_folder_holding_only_leveldb_s_lock_and_log_files_counts_as_empty(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """docs/configuration.md, `store`: "a new store is created only in a missing or empty folder
    (LevelDB's `LOCK`, `LOG` and `LOG.old` files alone, left by a crash while creating it, count as
    empty ...)"; inspect of an empty folder: `no store at '...'` (operations.md, inspect: "A missing
    or empty folder")."""
    broker = broker_factory(start=False)
    store = Path(broker.store)
    store.mkdir()
    for name in ("LOCK", "LOG", "LOG.old"):
        (store / name).write_text("")
    refused = run_cli("inspect", broker.store)
    assert (refused.returncode, f"no store at '{store}'" in refused.stderr) == (1, True), refused.stderr
    broker.start()
    device = clients(broker.port, "after-crash")
    device.subscribe("t", 1)
    device.disconnect()
    broker.stop()
    assert [row["client_id"] for row in inspect_json(broker.store)] == ["after-crash"]


# ------------------------------------------------------------------ a damaged table file
def damaged_table_store(broker_factory: Callable[..., Broker], clients: Callable[..., Client]) -> tuple[Broker, str]:
    """A stopped broker whose store's one table file (the log turned into a table by inspect's open,
    operations.md, Troubleshooting: "LevelDB's open alone, as `inspect`'s, ... may turn the old log
    into a table") is cut in half, as a torn copy would leave it; that file's name."""
    broker = broker_factory()
    queued_while_dropped(clients, broker.port, "t", "t", payloads(50))
    broker.stop()
    assert [row["depth"] for row in inspect_json(broker.store)] == [50]
    [table] = Path(broker.store).glob("*.ldb")
    data = table.read_bytes()
    table.write_bytes(data[: len(data) // 2])
    return broker, table.name


def test_a_truncated_table_file_is_named_by_the_broker_and_inspect_and_repair_moves_it_to_lost(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """docs/operations.md, Operator commands, `broker`: exit code 1 when "the broker cannot start (store locked or
    corrupted ...)": `amqtt-durable: broker not started: ...`; Troubleshooting: "`store '...' is corrupted or
    unreadable: ...` ... The message names the damage: ... a table file cut short (`table file
    000123.ldb is truncated or damaged`)", inspect names the same damage; repair "a damaged
    table file's readable records are copied, the file itself moved to `STORE/lost/`", and it prints
    `not recovered: ...` for "damaged table files"; "the layout version key, if lost (... or
    nothing at all, e.g. every record was in a damaged table ...)"; then the broker starts again."""
    broker, table = damaged_table_store(broker_factory, clients)
    torn = (Path(broker.store) / table).read_bytes()
    named = f"store '{broker.store}' is corrupted or unreadable: table file {table} is truncated or damaged"
    started = run_cli("broker", "-c", str(broker.write_config()))
    assert started.returncode == 1, started.stderr[-2000:]
    assert started.stderr.strip().splitlines()[-1].startswith(f"amqtt-durable: broker not started: {named}")
    listed = run_cli("inspect", broker.store)
    assert listed.returncode == 1 and named in listed.stderr, listed.stderr
    # Troubleshooting: "The broker writes no record to a store it refuses and leaves its table files as they are"
    assert [path.name for path in Path(broker.store).glob("*.ldb")] == [table]
    assert (Path(broker.store) / table).read_bytes() == torn
    repaired = run_cli("repair", broker.store)
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    not_recovered = [line.strip() for line in repaired.stdout.splitlines() if "not recovered:" in line]
    assert any(table in line for line in not_recovered), repaired.stdout
    assert (Path(broker.store) / "lost" / table).exists()
    assert "rebuilt: layout version key restored" in repaired.stdout, repaired.stdout
    assert inspect_lines(broker.store)[-1].endswith("queued message(s)")
    broker.start()
    assert probe_connack(broker.port)


# ------------------------------------------------------------------ repair's report
def test_repair_reports_a_queue_without_its_session_record_and_the_broker_deletes_it(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """docs/operations.md, Operator commands: repair prints "each thing it could not recover (`not recovered:
    ...`): ... queues without a session record (their client id is lost; the broker deletes them
    when it starts)"; its write probe `durable-write-probe.tmp` "is removed at once"; the
    other session keeps its queue."""
    broker = broker_factory()
    for client_id in ("kept", "orphan"):
        device = clients(broker.port, client_id)
        device.subscribe("t", 1)
        device.disconnect()
    clients(broker.port, "pub", clean_session=True).publish("t", payloads(3), qos=1)
    broker.stop()
    db = plyvel.DB(broker.store)
    try:
        db.delete(b"s" + b"orphan", sync=True)  # the session record (docs/store-layout.md: one per client id)
    finally:
        db.close()
    repaired = run_cli("repair", broker.store)
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    lost = [line for line in repaired.stdout.splitlines() if line.strip().startswith("not recovered:")]
    assert len(lost) == 1 and "3 queued message(s)" in lost[0], repaired.stdout
    assert "client id is lost; the broker deletes them when it starts" in lost[0], lost
    assert not (Path(broker.store) / "durable-write-probe.tmp").exists()
    broker.start()
    assert "store: deleted 3 queue entries of a session whose deletion a crash or a stop cut short" in broker.log()
    assert [m.payload for m in clients(broker.port, "kept").wait_messages(3)] == payloads(3)
    assert clients(broker.port, "orphan").session_present is False


def test_repair_of_a_sound_store_says_it_was_consistent_and_changes_no_record(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """docs/operations.md, Operator commands: repair "prints `repaired 'STORE'; start the broker to use it`, then,
    each on a line indented two spaces, each thing it rebuilt ... and each thing it could not recover
    ..., or, when there was neither, `session records, queue totals and message references were all
    consistent`": a store a SIGKILL left (shared bodies, QoS 2, retained, a stream log) is sound."""
    broker = broker_factory(streams=[{"filter": "log/#"}])
    for client_id in ("a", "b"):
        device = clients(broker.port, client_id)
        device.subscribe("t", 2)
        device.disconnect()
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("t", payloads(3), qos=2)
    publisher.publish("r", [b"kept"], qos=1, retain=True)
    publisher.publish("log/x", [b"e1"], qos=1)
    broker.kill()
    repaired = run_cli("repair", broker.store)
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    assert repaired.stdout.splitlines() == [
        f"repaired '{broker.store}'; start the broker to use it",
        "  session records, queue totals and message references were all consistent",
    ]
    assert [(row["client_id"], row["depth"]) for row in inspect_json(broker.store)] == [("a", 3), ("b", 3)]


def test_repair_of_a_replicated_store_clears_its_position(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """docs/operations.md, Operator commands, repair: "A replicated store's position is cleared too
    (`rebuilt: replication position cleared`): its backups then get a new snapshot from it" (a
    fixed-role primary, no etcd)."""
    broker = broker_factory(replication={"role": "primary", "listen": f"127.0.0.1:{free_port()}"})
    queued_while_dropped(clients, broker.port, "t", "t", payloads(3))
    broker.stop()
    repaired = run_cli("repair", broker.store)
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    assert "  rebuilt: replication position cleared" in repaired.stdout, repaired.stdout
    again = run_cli("repair", broker.store)
    assert "replication position cleared" not in again.stdout, "a store without a position has none to clear"
    broker.start()
    assert [m.payload for m in clients(broker.port, "dev-1").wait_messages(3)] == payloads(3)


def test_repair_escapes_a_stream_topic_so_it_cannot_forge_a_line(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """operations.md, repair: each thing it rebuilt or could not recover is "on a line indented two
    spaces", as `rebuilt: stream TOPIC: its id mark did not decode: ...`, and "client ids and topics in
    its lines are escaped as in inspect": a stream topic a client chose with a newline and a line of
    its own cannot forge a `rebuilt:` line. The topic's id mark and one of its events are damaged
    (keys from docs/store-layout.md: `L` + topic, `e` + the topic's byte length + topic + id)."""
    topic = "log/x\n  rebuilt: forged line"
    broker = broker_factory(streams=[{"filter": "log/#"}])
    clients(broker.port, "pub", clean_session=True).publish(topic, [b"e1", b"e2"], qos=1)
    broker.stop()
    raw = topic.encode("utf-8")
    db = plyvel.DB(broker.store)
    try:
        assert db.get(b"L" + raw) is not None
        event = b"e" + struct.pack(">H", len(raw)) + raw + struct.pack(">Q", 1)
        assert db.get(event) is not None
        db.put(b"L" + raw, b"bad", sync=True)
        db.put(event, b"\xff", sync=True)
    finally:
        db.close()
    repaired = run_cli("repair", broker.store)
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    lines = repaired.stdout.splitlines()
    assert not any(line.lstrip().startswith("rebuilt: forged line") for line in lines), lines
    shown = "log/x\\n  rebuilt: forged line"
    assert lines[1:] == [
        f"  rebuilt: stream {shown}: its id mark did not decode: set past every id it can have given",
        f"  not recovered: stream {shown}: event 1 does not decode: removed",
    ], lines


# ------------------------------------------------------------------ metrics
def test_messages_queued_and_bytes_queued_count_a_message_once_per_queue(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """docs/operations.md, Metrics: `sessions/connected` "durable sessions with a connection
    now", `sessions/disconnected` "without one", `messages/queued` "messages in all queues now (a
    message queued for 3 sessions counts 3)", `bytes/queued` "payload bytes in all queues now"."""
    broker = broker_factory(metrics_interval=0.2)
    for client_id in ("q-1", "q-2", "q-3"):
        device = clients(broker.port, client_id)
        device.subscribe("fan/t", 1)
        device.disconnect()
    live = clients(broker.port, "q-live")
    live.subscribe("other/t", 1)
    clients(broker.port, "pub", clean_session=True).publish("fan/t", [b"12345"], qos=1)
    expected = {"messages/queued": b"3", "bytes/queued": b"15", "sessions/disconnected": b"3",
                "sessions/connected": b"1"}
    watcher = clients(broker.port, "watch", clean_session=True)
    watcher.subscribe("$SYS/broker/durable/#", 0)

    def latest() -> dict[str, bytes]:
        seen = {m.topic.removeprefix("$SYS/broker/durable/"): m.payload for m in watcher.messages}
        return {topic: seen.get(topic, b"") for topic in expected}

    assert watcher.wait_for(lambda _: latest() == expected, WAIT), latest()


# ------------------------------------------------------------------ upgrading: a store without the message id mark
def store_of_an_earlier_release(broker_factory: Callable[..., Broker], clients: Callable[..., Client]) -> Broker:
    """A stopped broker whose store holds 3 messages queued for 2 sessions (6 queue entries) and, as
    one an earlier release wrote (docs/operations.md, Upgrading: "a store written by an earlier
    release (one without the message id mark)"), no message id mark (key `M`, docs/store-layout.md):
    removed with plyvel, as that release never wrote it."""
    broker = broker_factory()
    for client_id in ("up-1", "up-2"):
        device = clients(broker.port, client_id)
        device.subscribe("up/t", 1)
        device.disconnect()
    clients(broker.port, "pub", clean_session=True).publish("up/t", payloads(3, "old"), qos=1)
    broker.stop()
    db = plyvel.DB(broker.store)
    try:
        assert db.get(b"M") is not None
        db.delete(b"M", sync=True)
    finally:
        db.close()
    return broker


def assert_old_then_new(broker: Broker, clients: Callable[..., Client]) -> None:
    """Both sessions get their 3 old messages, then 3 new ones: no new message took an old one's id."""
    devices = [clients(broker.port, client_id, manual_ack=False) for client_id in ("up-1", "up-2")]
    clients(broker.port, "pub-2", clean_session=True).publish("up/t", payloads(3, "new"), qos=1)
    for device in devices:
        assert device.session_present is True
        got = [m.payload for m in device.wait_messages(6)]
        assert got == payloads(3, "old") + payloads(3, "new"), (device.client_id, got)


def test_the_first_start_of_a_store_without_the_mark_reads_every_queue_entry_once_and_logs_it(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """docs/operations.md, Upgrading: the first start of a store without the message id mark
    "logs, at INFO, `durable store STORE has no message id mark (written by an earlier release):
    reading every queue entry once` before and `durable store STORE: N queue entries read in S s;
    highest message id in use M, kept as the mark from now on` after"; "Later starts read the mark
    and skip this"; "no new message is given an id a queue entry still holds"."""
    broker = store_of_an_earlier_release(broker_factory, clients)
    broker.start()
    log = broker.log()
    before = (f"durable store {broker.store} has no message id mark (written by an earlier release): "
              "reading every queue entry once")
    lines = [line for line in log.splitlines() if before in line]
    assert len(lines) == 1 and " INFO " in lines[0], log[-3000:]
    after = re.findall(
        rf"durable store {re.escape(broker.store)}: (\d+) queue entries read in [\d.]+ s; highest message id in use "
        r"(\d+), kept as the mark from now on", log)
    assert len(after) == 1 and int(after[0][0]) == 6 and int(after[0][1]) >= 3, log[-3000:]
    assert_old_then_new(broker, clients)
    broker.restart(kill=False)
    assert broker.log().count(before) == 1, "a later start reads the mark"


def test_repair_raises_a_mark_an_earlier_release_left_below_an_id_in_use(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """docs/operations.md, Operator commands, repair: "a highest message id mark that decodes but is below an id a
    message body, a reference count or a queue entry holds ...: set to that id (`rebuilt: highest
    message id N was below message M, which is in use (an earlier release wrote the store since):
    set to M`); a store without the mark gets one, without a line, so the broker's next start need
    not read every queue entry for it"; Upgrading: "run `amqtt-durable repair STORE` ... Repair raises
    the mark past every id in use"."""
    broker = store_of_an_earlier_release(broker_factory, clients)
    without = run_cli("repair", broker.store)
    assert without.returncode == 0, without.stdout + without.stderr
    assert "message id" not in without.stdout, without.stdout
    broker.start()
    assert "has no message id mark" not in broker.log(), "repair gave the store its mark"
    broker.stop()
    db = plyvel.DB(broker.store)
    try:
        db.put(b"M", struct.pack(">Q", 1), sync=True)  # what an earlier release leaves: a mark below ids in use
    finally:
        db.close()
    raised = run_cli("repair", broker.store)
    assert raised.returncode == 0, raised.stdout + raised.stderr
    found = re.findall(
        r"rebuilt: highest message id 1 was below message (\d+), which is in use \(an earlier release wrote the "
        r"store since\): set to (\d+)", raised.stdout)
    assert len(found) == 1 and found[0][0] == found[0][1] and int(found[0][0]) >= 3, raised.stdout
    broker.start()
    assert_old_then_new(broker, clients)


# ------------------------------------------------------------------ max_packet_size at its edge
@pytest.mark.parametrize("limit", [1024, None], ids=["1024", "default"])
def test_a_packet_of_max_packet_size_is_served_and_one_byte_more_closes_the_connection(
    broker_factory: Callable[..., Broker], limit: int | None
) -> None:
    """docs/configuration.md, `max_packet_size` default `1048576`: "Largest packet a client may send
    (remaining length, bytes); a larger one closes the connection before its body is read"."""
    size = 1_048_576 if limit is None else limit
    broker = broker_factory() if limit is None else broker_factory(max_packet_size=limit)
    topic = b"big/t"
    for remaining, served in ((size, True), (size + 1, False)):
        sock = raw_connect(broker.port, f"big-{remaining}", clean=True)
        payload = b"p" * (remaining - 2 - len(topic) - 2)
        packet = mqtt_packet(0x32, mqtt_string(topic) + struct.pack(">H", 7) + payload)
        sock.sendall(packet[: len(packet) - len(payload)])  # header, topic and packet id: the body waits
        if served:
            sock.sendall(payload)
            assert read_packet(sock) == (0x40, struct.pack(">H", 7)), remaining
        else:
            assert closed_by_broker(sock), "closed before its body is read, unanswered"
        sock.close()



@pytest.mark.slow
@pytest.mark.timeout(60)
def test_metrics_come_every_10_seconds_by_default(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """docs/operations.md, Metrics: "Every `metrics_interval` seconds (default 10; 0 = off) the plugin
    publishes, at QoS 0, plain decimal numbers under `$SYS/broker/durable/`"; configuration.md,
    `metrics_interval` default `10`. Two publications of one metric about 10 s apart."""
    broker = broker_factory(start=False)
    del broker.settings["metrics_interval"]  # the tests' brokers turn it off; here: the default
    broker.start()
    watcher = clients(broker.port, "watch", clean_session=True)
    watcher.subscribe("$SYS/broker/durable/messages/enqueued", 0)
    assert watcher.wait_for(lambda ms: len(ms) >= 2, timeout=2 * 10 + WAIT), "two publications"
    first, second = watcher.messages[:2]
    assert (first.payload, second.payload, first.qos) == (b"0", b"0", 0)
    assert 9.5 <= second.timestamp - first.timestamp <= 12.5, (first.timestamp, second.timestamp)  # paho: monotonic


# ------------------------------------------------------------------ limitations
def test_a_client_id_that_said_hello_stays_an_sdk_session_for_a_plain_client_until_the_session_ends(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    """docs/operations.md, Limitations: "a client id that said `hello` stays an SDK session (held until
    ready, framed payloads) until the session ends; a plain MQTT client should not reuse it"."""
    device = clients(broker.port, "sdk-id")
    assert control(device, {"v": 1, "op": "hello"})["ok"] is True
    device.subscribe("sd/t", 1)
    device.disconnect()
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("sd/t", [b"queued"], qos=1)
    plain = clients(broker.port, "sdk-id")  # no hello this time
    assert plain.session_present is True
    assert not plain.wait_for(lambda ms: any(m.topic == "sd/t" for m in ms), timeout=1.0), "held until ready"
    assert control(plain, {"v": 1, "op": "ready"})["ok"] is True
    assert plain.wait_for(lambda ms: any(m.topic == MARKER for m in ms))
    [queued] = [m for m in plain.messages if m.topic == "sd/t"]
    assert frame(queued.payload)[5] == b"queued" and len(queued.payload) == 26 + len(b"queued"), "framed"
    plain.disconnect()
    clients(broker.port, "sdk-id", clean_session=True).disconnect()  # the session ends
    fresh = clients(broker.port, "sdk-id")
    assert fresh.session_present is False
    fresh.subscribe("sd/t", 1)
    publisher.publish("sd/t", [b"plain now"], qos=1)
    assert [m.payload for m in fresh.wait_messages(1)] == [b"plain now"], "neither held nor framed"


def test_a_stream_log_no_configured_stream_covers_is_kept_and_goes_on_when_covered_again(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """docs/operations.md, Limitations: "Stream logs of topics no longer covered by a configured stream are
    kept (never trimmed), so a typo in `streams` does not destroy data"; configuration.md, `streams`: a covered
    topic's log has "ids 1, 2, 3, ..."."""
    broker = broker_factory(streams=[{"filter": "log/#", "max_count": 10}])
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("log/a", payloads(5), qos=1)
    broker.stop()
    broker.settings["streams"] = [{"filter": "lgo/#", "max_count": 1}]  # the typo
    broker.start()
    clients(broker.port, "pub-typo", clean_session=True).publish("log/a", [b"not logged"], qos=1)
    broker.stop()
    broker.settings["streams"] = [{"filter": "log/#", "max_count": 10}]
    broker.start()
    clients(broker.port, "pub-again", clean_session=True).publish("log/a", [b"sixth"], qos=1)
    reader = clients(broker.port, "reader", clean_session=True)
    info = control(reader, {"v": 1, "op": "stream_info", "filter": "log/#"})
    assert info["topics"] == {"log/a": {"first": 1, "last": 6, "count": 6}}, info
    assert control(reader, {"v": 1, "op": "stream_subscribe", "filter": "log/#", "window": 10})["ok"] is True
    assert reader.wait_for(lambda ms: len(stream_events(reader, "log/a")) >= 6)
    assert [(event_id, body) for _, event_id, body in stream_events(reader, "log/a")] == [
        *enumerate(payloads(5), start=1), (6, b"sixth")
    ]


# ------------------------------------------------------------------ the broker command
def test_a_setting_of_amqtt_s_own_that_amqtt_refuses_is_exit_1_broker_not_started(tmp_path: Path) -> None:
    """docs/operations.md, Operator commands, `broker`: exit code 2 for a bad config of the plugin, 1 when the
    broker cannot start, among others for "a setting of amqtt's own that amqtt refuses, e.g.
    `listeners: 5` (`broker not started: wrong value type for field "listeners" ...`)"; a config file
    that is YAML but not a mapping is a bad config (exit code 2)."""
    config = tmp_path / "broker.yaml"
    config.write_text(
        "listeners: 5\nplugins:\n  amqtt.plugins.authentication.AnonymousAuthPlugin:\n    allow_anonymous: true\n"
        f"  amqtt_durable.DurableSessionsPlugin:\n    store: {tmp_path / 'store'}\n", encoding="utf-8")
    refused = run_cli("broker", "-c", str(config))
    assert refused.returncode == 1, refused.stderr[-2000:]
    last = refused.stderr.strip().splitlines()[-1]
    assert last.startswith('amqtt-durable: broker not started: wrong value type for field "listeners"'), last
    config.write_text("- a list\n- not a mapping\n", encoding="utf-8")
    not_a_mapping = run_cli("broker", "-c", str(config))
    assert not_a_mapping.returncode == 2, not_a_mapping.stderr[-2000:]
    assert "Traceback" not in not_a_mapping.stderr


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_connection_without_a_connect_is_closed_after_10_seconds_by_default(broker: Broker) -> None:
    """docs/configuration.md, `connect_timeout` default `10`: "Seconds a new connection has to send
    its whole CONNECT; then it is closed"."""
    with socket.create_connection(("127.0.0.1", broker.port), timeout=WAIT) as sock:
        sock.sendall(b"\x10")  # a CONNECT begun, never finished
        opened = time.monotonic()
        assert closed_by_broker(sock)  # within WAIT (15 s)
        assert 9.5 <= time.monotonic() - opened <= 13, time.monotonic() - opened


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_an_unacknowledged_stream_event_comes_again_after_5_seconds_by_default(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """docs/configuration.md, `stream_ack_timeout` default `5`: "Seconds before an unacknowledged
    stream event is sent again"."""
    broker = broker_factory(streams=[{"filter": "log/#"}])
    clients(broker.port, "pub", clean_session=True).publish("log/a", [b"e1"], qos=1)
    reader = clients(broker.port, "reader", clean_session=True)
    assert control(reader, {"v": 1, "op": "stream_subscribe", "filter": "log/#"})["ok"] is True
    assert reader.wait_for(lambda ms: len(stream_events(reader, "log/a")) >= 2, timeout=2 * 5 + WAIT)
    first, second = [m for m in reader.messages if m.topic == "$durable/v1/stream/log/a"][:2]
    assert [event[1:] for event in stream_events(reader, "log/a")[:2]] == [(1, b"e1")] * 2
    assert 4.5 <= second.timestamp - first.timestamp <= 7.5, (first.timestamp, second.timestamp)
