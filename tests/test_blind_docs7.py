"""Black-box tests written from docs/operations.md alone (the operator's page): what `repair` makes of
damaged records once the broker runs on the repaired store, damage a running broker meets deeper in a
queue or a stream log, and which LevelDB folders repair takes for another program's. Each quotes its
promise; stores are real LevelDB folders damaged with plyvel, the broker and the CLI real processes."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

import plyvel
import pytest
from raw_mqtt_helpers import connect_packet, read_exactly
from test_hostile_damaged_records import damage

from conftest import HOST, WAIT, Broker, Client, run_cli
from durable_client import DurableClient, Event

pytestmark = pytest.mark.timeout(120)

READ_ERRORS = "$SYS/broker/durable/store/read_errors"


def records(store: str) -> dict[str, dict[str, object]]:
    """Each client id's session record (JSON) in a stopped broker's store."""
    db = plyvel.DB(store)
    try:
        return {key[1:].decode(): json.loads(value) for key, value in db.iterator(prefix=b"s")}
    finally:
        db.close()


def sid_of(store: str, client_id: str) -> int:
    sid = records(store)[client_id]["sid"]
    assert isinstance(sid, int)
    return sid


def repair(store: str) -> list[str]:
    """``amqtt-durable repair STORE``, exit code 0; its lines."""
    result = run_cli("repair", store)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"repaired '{store}'; start the broker to use it", lines
    return lines


def entry_key(sid: int, seq: int) -> bytes:
    return b"q" + struct.pack(">QQ", sid, seq)


def store_info(port: int, client_id: str) -> int | None:
    """The store id stream_info names (docs/protocol.md), asked by an SDK client."""
    client = DurableClient(client_id, "127.0.0.1", port)
    try:
        client.connect()
        return client.stream_info("log/#").store
    finally:
        client.close(keep_session=False)


# ------------------------------------------------------------------ repair, then the broker on the repaired store


def test_what_repair_rebuilds_is_what_the_broker_then_serves(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """operations.md, `repair` rebuilds:
    - "a session record that no longer decodes (also JSON that parses but holds a field of the wrong
      type, e.g. a deadline that is not a number ...): its session number is read from the damaged
      bytes ...; its username is kept if readable; its subscriptions are lost (the client must
      subscribe again)";
    - "a sent mark, the highest session number ... that does not decode: set past every number in use
      (never lower; after a sent mark's, the session's queued messages go out DUP-flagged ...)";
    - "a store id that does not decode: removed, and the broker makes a new one (stream readers see a
      new store)".
    One store holds all four damages; one repair; then the broker serves what the page says."""
    broker = broker_factory(streams=[{"filter": "log/#"}])
    owned = clients(broker.port, "owned", username="alice")
    owned.subscribe("t", 1)
    owned.disconnect()
    marked = clients(broker.port, "marked")
    marked.subscribe("u", 1)
    marked.disconnect()
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("t", [b"t0", b"t1", b"t2"])
    publisher.publish("u", [b"u0", b"u1", b"u2"])
    publisher.publish("log/x", [b"e1"])
    old_store = store_info(broker.port, "info-1")
    broker.stop()
    store = broker.store
    owned_record = records(store)["owned"]
    assert owned_record["username"] == "alice"
    sids = {client_id: sid_of(store, client_id) for client_id in ("owned", "marked")}
    damaged_record = json.dumps({**owned_record, "disconnected_at": 1.0, "expires_at": "soon"}).encode()
    damage(
        broker,
        {
            b"sowned": damaged_record,
            b"w" + struct.pack(">Q", sids["marked"]): b"\x00\x02",
            b"n": b"\x07",
            b"i": b"\x01\x02\x03",
        },
    )

    lines = repair(store)
    rebuilt = [line for line in lines[1:] if line.startswith("  rebuilt: ")]
    assert f"  rebuilt: client 'owned': session record rebuilt (session number {sids['owned']})" in [
        line[: len(line.split(")")[0]) + 1] for line in rebuilt
    ], lines
    assert any("store id" in line for line in rebuilt), lines
    assert any("highest session number" in line for line in rebuilt), lines
    assert all(line.startswith("  ") for line in lines[1:]), lines

    broker.start()
    # The username was kept: another user's CONNECT of its client id is refused (owner-only, the default).
    with socket.create_connection((HOST, broker.port), timeout=WAIT) as sock:
        sock.sendall(connect_packet("owned", clean=False, username="mallory"))
        assert read_exactly(sock, 4) == b"\x20\x02\x00\x05", "the owner alice was kept by repair"
    # The owner resumes its session and queue; its subscription to t is gone until it subscribes again.
    back = clients(broker.port, "owned", username="alice")
    assert back.session_present is True
    assert [m.payload for m in back.wait_messages(3)] == [b"t0", b"t1", b"t2"]
    back.subscribe("again", 1)
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("t", [b"t-after"])
    publisher.publish("again", [b"a-after"])
    assert back.wait_for(lambda ms: any(m.payload == b"a-after" for m in ms))
    assert [m.payload for m in back.messages] == [b"t0", b"t1", b"t2", b"a-after"], "its subscription to t was lost"
    # The sent mark rebuilt past the queue: every queued message goes out DUP-flagged.
    resumed = clients(broker.port, "marked")
    got = resumed.wait_messages(3)
    assert [(m.payload, m.dup) for m in got] == [(b"u0", True), (b"u1", True), (b"u2", True)]
    # The store id was removed: the broker made a new one, so stream readers see a new store.
    new_store = store_info(broker.port, "info-2")
    assert new_store is not None and new_store != old_store
    fresh = clients(broker.port, "fresh")
    fresh.disconnect()
    broker.stop()
    numbers = {client_id: record["sid"] for client_id, record in records(store).items()}
    assert all(numbers["fresh"] > number for client_id, number in numbers.items() if client_id != "fresh"), (
        "a new session gets a number past every one in use",
        numbers,
    )


# ------------------------------------------------------------------ damage a running broker meets


class StreamReader:
    """An SDK client reading the stream logs of log/# from id 1: the (id, payload) pairs it got."""

    def __init__(self, port: int, client_id: str, after: int = 0) -> None:
        self.got: list[tuple[int, bytes]] = []
        self._cond = threading.Condition()
        self.client = DurableClient(client_id, "127.0.0.1", port)
        self.client.connect()
        self.client.subscribe_stream("log/#", self._on_event, after={"log/x": after})
        self.client.ready_for_events()

    def _on_event(self, event: Event) -> None:
        with self._cond:
            self.got.append((event.seq, event.payload))
            self._cond.notify_all()

    def wait(self, count: int) -> list[tuple[int, bytes]]:
        with self._cond:
            self._cond.wait_for(lambda: len(self.got) >= count, WAIT)
            return list(self.got)

    def close(self) -> None:
        self.client.close(keep_session=False)


@pytest.mark.slow
def test_damage_deeper_in_a_queue_or_a_log_is_met_by_delivery_and_repair_removes_it(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], tmp_path: Path
) -> None:
    """operations.md, Troubleshooting: "A queue entry key deeper in a queue is met when the session's
    delivery reads it: one too short as damage inside a queue (below), one too long as the entry its
    first 17 bytes name (a copy of that entry is delivered again; repair removes the key)"; damage
    inside a queue: "`session ...: reading its queue after message N failed: ...` (ERROR, counted in
    `$SYS/broker/durable/store/read_errors`) ... Everything before it is delivered; the session then
    waits and tries again after 1 s, 2 s, ... (logged each time; nothing is skipped, other sessions are
    served)"; "A stream reader meets damage in a log the same way (`stream ...: reading its log after id
    N failed: ...`, ERROR, counted, retried with the same pauses; nothing of that log is sent past it)";
    repair: "stream events ... that do not decode" are removed (`stream ...: event N does not decode:
    removed`)."""
    broker = broker_factory(streams=[{"filter": "log/#"}], metrics_interval=0.2)
    for client_id, topic in (("short", "s"), ("long", "l"), ("other", "o")):
        device = clients(broker.port, client_id)
        device.subscribe(topic, 1)
        device.disconnect()
    publisher = clients(broker.port, "pub", clean_session=True)
    many = [f"s{i:03d}".encode() for i in range(1, 261)]
    publisher.publish("s", many)
    publisher.publish("l", [b"l1", b"l2", b"l3"])
    publisher.publish("o", [b"o1", b"o2"])
    publisher.publish("log/x", [b"e1", b"e2", b"e3"])
    broker.stop()
    store = broker.store
    short, long_ = sid_of(store, "short"), sid_of(store, "long")
    db = plyvel.DB(store)
    try:
        copied = db.get(entry_key(long_, 2))
    finally:
        db.close()
    assert copied is not None
    # A 16-byte queue key that sorts after entry 255 and before entry 256 of "short" (the first and last
    # keys of its queue are sound, so start-up does not meet it); a 18-byte key right after entry 2 of "long".
    short_key = b"q" + struct.pack(">Q", short) + b"\x00" * 6 + b"\x01"
    damage(
        broker,
        {
            short_key: copied,
            entry_key(long_, 2) + b"\x00": copied,
            b"e\x00\x05log/x" + struct.pack(">Q", 2): b"\x00\x01\x02",
        },
    )
    kept = tmp_path / "before-repair"
    shutil.copytree(store, kept)

    broker.start()
    watcher = clients(broker.port, "watch", clean_session=True)
    watcher.subscribe(READ_ERRORS, 0)
    reader = StreamReader(broker.port, "reader")
    assert reader.wait(1) == [(1, b"e1")]
    stuck = clients(broker.port, "short")
    assert [m.payload for m in stuck.wait_messages(255)] == many[:255], "everything before the damage comes"
    copy = clients(broker.port, "long")
    assert copy.wait_for(lambda ms: len(ms) >= 4)
    assert [m.payload for m in copy.messages] == [b"l1", b"l2", b"l2", b"l3"], "a copy of entry 2 comes again"
    served = clients(broker.port, "other")
    assert [m.payload for m in served.wait_messages(2)] == [b"o1", b"o2"], "other sessions are served"

    failed = "session short: reading its queue after message 255 failed: "
    assert broker.wait_until(lambda: broker.log().count(failed) >= 2, WAIT), broker.log()[-3000:]
    tries = [line for line in broker.log().splitlines() if failed in line]
    assert all(" ERROR " in line for line in tries), tries
    assert [re.findall(r"tries again in (\d+) s", line) for line in tries[:2]] == [["1"], ["2"]], tries
    stream_failed = "stream log/x: reading its log after id 1 failed: "
    assert broker.wait_until(lambda: broker.log().count(stream_failed) >= 2, WAIT), broker.log()[-3000:]
    assert all(" ERROR " in line for line in broker.log().splitlines() if stream_failed in line)
    assert watcher.wait_for(lambda ms: any(int(m.payload) >= 4 for m in ms if m.topic == READ_ERRORS)), (
        "each failed read is counted"
    )
    assert len(stuck.messages) == 255, "nothing past the damage is sent"
    assert reader.got == [(1, b"e1")], "nothing of the log past the damage is sent"
    reader.close()
    broker.stop()

    lines = repair(store)
    assert "  not recovered: stream log/x: event 2 does not decode: removed" in lines, lines
    db = plyvel.DB(store)
    try:
        lengths = {len(key) for key in db.iterator(prefix=b"q", include_value=False)}
    finally:
        db.close()
    assert lengths <= {17}, "repair removes queue keys of the wrong length"
    broker.start()
    rest = clients(broker.port, "short")
    assert [m.payload for m in rest.wait_messages(5)] == many[255:], "the rest of the queue, in order"
    after = StreamReader(broker.port, "reader-2", after=1)
    assert after.wait(1) == [(3, b"e3")]
    after.close()

    # The copy kept from before the repair: the 18-byte key's copy is gone once repaired, not re-sent.
    broker.stop()
    shutil.rmtree(store)
    shutil.copytree(kept, store)
    repair(store)
    broker.start()
    again = clients(broker.port, "long")
    assert [m.payload for m in again.wait_messages(3)] == [b"l1", b"l2", b"l3"]
    assert not again.wait_for(lambda ms: len(ms) > 3, 0.5), "no copy of entry 2 once the key is removed"


# ------------------------------------------------------------------ whose LevelDB repair takes


def leveldb(folder: Path, keys: dict[bytes, bytes]) -> dict[str, bytes]:
    """A closed LevelDB at ``folder`` holding ``keys``; its files' bytes by name."""
    db = plyvel.DB(str(folder), create_if_missing=True)
    try:
        for key, value in keys.items():
            db.put(key, value, sync=True)
    finally:
        db.close()
    return {path.name: path.read_bytes() for path in folder.iterdir() if path.is_file()}


def test_another_programs_key_is_named_as_python_writes_bytes_cut_at_40_bytes(tmp_path: Path) -> None:
    """operations.md, repair: another program's LevelDB is refused, "nothing was changed", naming "the
    first such key, as Python writes bytes, cut at 40 bytes with `, ...`"; exit code 1, "every file of
    the folder as it was"; the lock check opens its `LOCK` file, "not created"."""
    folder = tmp_path / "other"
    key = b"user:" + b"x" * 60
    before = leveldb(folder, {key: b"1"})
    (folder / "LOCK").unlink()  # its LOCK file "is opened, not created"
    del before["LOCK"]
    result = run_cli("repair", str(folder))
    assert result.returncode == 1, result.stdout
    assert (
        f"repair of '{folder}' refused: it is not an amqtt-durable store but another program's LevelDB (no layout "
        f"version key or store id, and its key {key[:40]!r}, ... has the shape of no key of amqtt-durable's store "
        "layout); nothing was changed. Point repair at the plugin's 'store' folder"
    ) in result.stderr, result.stderr
    after = {path.name: path.read_bytes() for path in folder.iterdir() if path.is_file()}
    assert after == before, "every file of the folder as it was, and none created"
    assert not (folder / "lost").exists()


def two_queued(broker_factory: Callable[..., Broker], clients: Callable[..., Client]) -> Broker:
    """A stopped broker whose store holds the durable session "dev" with m1 and m2 queued on t."""
    broker = broker_factory()
    device = clients(broker.port, "dev")
    device.subscribe("t", 1)
    device.disconnect()
    clients(broker.port, "pub", clean_session=True).publish("t", [b"m1", b"m2"])
    broker.stop()
    return broker


@pytest.mark.parametrize("lost", [(b"v", b"i"), (b"v",)], ids=["version-and-store-id", "version-only"])
def test_repair_takes_a_store_by_its_version_key_or_store_id_and_refuses_it_without_both(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], lost: tuple[bytes, ...]
) -> None:
    """operations.md, repair: "It is a store of this plugin if it holds the layout version key `v` or the
    store id `i` (8 bytes), or else if every key it holds has the shape of a key of the store layout";
    "A store of this plugin that lost both `v` and `i` and also holds a key of no such shape (e.g. a queue
    key of the wrong length, left by damage) cannot be told from another program's and is refused the
    same way (put the key `v` back with the value `1`, e.g. with plyvel, and repair runs)"; the layout
    version key is rebuilt "only when the store holds its store id, or only keys of the layout's shapes"
    (`layout version key restored`)."""
    broker = two_queued(broker_factory, clients)
    sid = sid_of(broker.store, "dev")
    bad = entry_key(sid, 1)[:-3]
    damage(broker, {bad: b"\x00" * 14}, delete=lost)

    if b"i" in lost:
        refused = run_cli("repair", broker.store)
        assert refused.returncode == 1, refused.stdout
        assert (
            f"repair of '{broker.store}' refused: it is not an amqtt-durable store but another program's LevelDB"
        ) in refused.stderr, refused.stderr
        assert f"its key {bad!r} has the shape of no key" in refused.stderr, refused.stderr
        damage(broker, {b"v": b"1"})
        repair(broker.store)
    else:
        assert "  rebuilt: layout version key restored" in repair(broker.store)
    broker.start()
    back = clients(broker.port, "dev")
    assert back.session_present is True
    assert [m.payload for m in back.wait_messages(2)] == [b"m1", b"m2"]


def inspect_rows(store: str) -> list[dict[str, object]]:
    result = run_cli("inspect", store, "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert isinstance(rows, list)
    return rows


def test_a_session_connected_at_a_kill_gets_its_deadline_counted_from_the_next_start(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """operations.md, inspect: time until expiry "`-`: no deadline stored, as for a session that was
    connected when the broker was killed or stopped, its deadline then counted from the next start";
    `--json` "times in Unix seconds, null where none"; the default `session_expiry` 300 s reads `5m`."""
    broker = broker_factory()
    device = clients(broker.port, "killed-dev")
    device.subscribe("k/t", 1)
    broker.kill()
    [row] = inspect_rows(broker.store)
    assert (row["disconnected_at"], row["expires_at"]) == (None, None)
    began = time.time()
    broker.start()
    broker.stop()
    ended = time.time()
    [row] = inspect_rows(broker.store)
    assert isinstance(row["disconnected_at"], float | int) and isinstance(row["expires_at"], float | int), row
    assert began - 1 <= row["disconnected_at"] <= ended, (began, row, ended)
    assert row["expires_at"] == pytest.approx(row["disconnected_at"] + 300), row
    table = run_cli("inspect", broker.store).stdout.splitlines()
    assert table[1].split()[:5] == ["killed-dev", "0", "0", "-", "5m"], table


def totals(depth: int, size: int, dropped: int) -> bytes:
    """Queue totals as store.py's docstring lays them out: depth, bytes, dropped, each a u64."""
    return struct.pack(">QQQ", depth, size, dropped)


def test_totals_start_up_sets_to_0_are_one_warning_and_repair_keeps_the_drops_of_totals_that_decode(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """operations.md, Troubleshooting: start-up keeps to the rule "a queue without entries counts 0 messages
    and one that counts 0 messages holds 0 bytes; totals it sets so are one WARNING for the load
    (`durable store ...: N session(s) had queue totals that did not fit their queue ...: set to 0 for
    '...'`, naming at most 5 client ids)". inspect's dropped count is kept "since the session was
    created, across restarts and reconnects; a repair that rebuilds missing or undecodable queue totals
    starts it at 0", while repair rebuilds "queue totals that are missing, undecodable or wrong": the
    drops of totals that decode but are wrong are kept."""
    broker = broker_factory(max_depth=2, max_depth_disconnected=2)
    empty = [f"empty-{n}" for n in range(6)]
    for client_id, topic in [("wrong", "w"), ("undecodable", "u")] + [(e, "e") for e in empty]:
        device = clients(broker.port, client_id)
        device.subscribe(topic, 1)
        device.disconnect()
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("w", [b"w1", b"w2", b"w3", b"w4"])
    publisher.publish("u", [b"u1", b"u2", b"u3", b"u4"])
    broker.stop()
    before = {row["client_id"]: row for row in inspect_rows(broker.store)}
    assert (before["wrong"]["depth"], before["wrong"]["dropped"]) == (2, 2), before["wrong"]
    sids = {client_id: sid_of(broker.store, client_id) for client_id in ["wrong", "undecodable", *empty]}
    damage(broker, {b"t" + struct.pack(">Q", sids[e]): totals(3, 30, 0) for e in empty})

    broker.start()
    broker.stop()
    said = [line for line in broker.log().splitlines() if "had queue totals that did not fit their queue" in line]
    assert len(said) == 1, said
    assert " WARNING " in said[0] and f"durable store {broker.store}: 6 session(s) had queue totals" in said[0], said
    named = [e for e in empty if f"'{e}'" in said[0]]
    assert 1 <= len(named) <= 5, said
    assert all(
        row["depth"] == 0 and row["bytes"] == 0 for row in inspect_rows(broker.store) if row["client_id"] in empty
    )

    damage(
        broker,
        {
            b"t" + struct.pack(">Q", sids["wrong"]): totals(9, 999, 7),
            b"t" + struct.pack(">Q", sids["undecodable"]): b"\x01\x02",
        },
    )
    repair(broker.store)
    after = {row["client_id"]: row for row in inspect_rows(broker.store)}
    assert (after["wrong"]["depth"], after["wrong"]["bytes"], after["wrong"]["dropped"]) == (2, 4, 7), after["wrong"]
    assert (after["undecodable"]["depth"], after["undecodable"]["bytes"], after["undecodable"]["dropped"]) == (2, 4, 0)


def test_a_damaged_entry_erased_with_its_session_leaves_its_body_for_repair_to_remove(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """operations.md, Troubleshooting: a queue entry that does not decode, met when the session is deleted
    (a clean-session connect), "is erased by its key with the rest of the queue (`queue entry S of client
    id '...': N bytes that do not decode: erased with its session ...`, ERROR ...), and the body it pointed
    at stays for repair to remove"."""
    broker = broker_factory()
    device = clients(broker.port, "gone")
    device.subscribe("g", 1)
    device.disconnect()
    clients(broker.port, "pub", clean_session=True).publish("g", [b"g1", b"g2", b"g3"])
    broker.stop()
    sid = sid_of(broker.store, "gone")
    damage(broker, {entry_key(sid, 2): b"\x00\x01\x02"})
    broker.start()
    clients(broker.port, "gone", clean_session=True).disconnect()
    named = "queue entry 2 of client id 'gone': 3 bytes that do not decode: erased with its session"
    assert broker.wait_until(lambda: named in broker.log(), WAIT), broker.log()[-3000:]
    assert all(" ERROR " in line for line in broker.log().splitlines() if named in line)
    broker.stop()

    def stored(prefix: bytes) -> int:
        db = plyvel.DB(broker.store)
        try:
            return sum(1 for _ in db.iterator(prefix=prefix, include_value=False))
        finally:
            db.close()

    assert (stored(b"q"), stored(b"m")) == (0, 1), "the queue is erased; the damaged entry's body stays"
    assert "  rebuilt: 1 message body(ies) that no queue entry points at removed" in repair(broker.store)
    assert stored(b"m") == 0, "repair removes the body no entry points at"


def test_ctrl_c_stops_the_broker_cleanly_and_keeps_what_it_acknowledged(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """operations.md, Operator commands: "Ctrl-C or SIGTERM shuts it down cleanly"; the next start serves
    the durable session and its queue."""
    broker = broker_factory()
    device = clients(broker.port, "ctrl-c")
    device.subscribe("c", 1)
    device.disconnect()
    clients(broker.port, "pub", clean_session=True).publish("c", [b"c1", b"c2"])
    assert broker.pid is not None
    os.kill(broker.pid, signal.SIGINT)
    assert broker.wait_stopped(time.monotonic() + WAIT), "Ctrl-C ends the broker"
    assert broker.exit_status == 0, broker.log()[-3000:]
    assert "Traceback" not in broker.log(), broker.log()[-3000:]
    broker.start()
    back = clients(broker.port, "ctrl-c")
    assert back.session_present is True
    assert [m.payload for m in back.wait_messages(2)] == [b"c1", b"c2"]


def start_refused(broker: Broker) -> str:
    """``amqtt-durable broker`` on the stopped broker's config: exit code 1; its last line."""
    result = run_cli("broker", "-c", str(broker.write_config()))
    assert result.returncode == 1, result.stderr[-3000:]
    return result.stderr.strip().splitlines()[-1]


def test_start_up_reads_the_last_body_key_and_the_last_count_key_only_without_the_message_id_mark(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """operations.md, Troubleshooting: a key whose length is wrong for its kind is named (`a ... key of 3
    bytes, not 9 (damaged): b'...'`) "when start-up reads it: ... of the message body keys only the last;
    of the reference count keys only the last, and only in a store without the highest message id mark
    (`b"M"`)"; repair removes "message body and reference count keys of the wrong length"."""
    broker = two_queued(broker_factory, clients)
    count_key, body_key = b"c\xff\xff\xff\xff", b"m\xff\xff\xff\xff"  # each the last key of its kind
    damage(broker, {count_key: b"\x00\x00\x00\x02"})
    broker.start()  # the store holds the mark: start-up does not read the count keys
    broker.stop()
    damage(broker, {body_key: b"\x00"})
    refusal = start_refused(broker)
    assert f"store '{broker.store}' is corrupted or unreadable: " in refusal, refusal
    assert f"a message body key of 5 bytes, not 9 (damaged): {body_key!r}" in refusal, refusal
    lines = repair(broker.store)
    assert "  not recovered: a message body key of 5 bytes (damaged) removed" in lines, lines
    assert "  not recovered: a message reference count key of 5 bytes (damaged) removed" in lines, lines

    damage(broker, {count_key: b"\x00\x00\x00\x02"}, delete=(b"M",))
    refusal = start_refused(broker)
    assert f"store '{broker.store}' is corrupted or unreadable: " in refusal, refusal
    assert f"a message reference count key of 5 bytes, not 9 (damaged): {count_key!r}" in refusal, refusal
    repair(broker.store)
    broker.start()
    assert [m.payload for m in clients(broker.port, "dev").wait_messages(2)] == [b"m1", b"m2"]


def test_repair_leaves_nothing_in_tmpdir_or_the_store_folder_whatever_the_outcome(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], tmp_path: Path
) -> None:
    """operations.md, repair: it "checks whose LevelDB the folder holds, on a scratch copy in the temporary
    folder (`TMPDIR`) ...; the copy is removed whatever the outcome"; the disk check's probe is "allocated
    (not written) to a file `durable-write-probe.tmp` that is removed at once"."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch)}
    broker = broker_factory()
    clients(broker.port, "dev").subscribe("t", 1)
    clients(broker.port, "pub", clean_session=True).publish("t", [b"m1"])
    broker.stop()
    done = run_cli("repair", broker.store, env=env)
    assert done.returncode == 0, done.stderr
    assert list(scratch.iterdir()) == [], "the scratch copy is removed after a repair"
    assert not (Path(broker.store) / "durable-write-probe.tmp").exists()

    other = tmp_path / "other"
    leveldb(other, {b"user:1": b"x"})
    refused = run_cli("repair", str(other), env=env)
    assert refused.returncode == 1 and "another program's LevelDB" in refused.stderr, refused.stderr
    assert list(scratch.iterdir()) == [], "the scratch copy is removed after a refusal"

    damage(broker, {b"v": b"2"})
    release = run_cli("repair", broker.store, env=env)
    assert release.returncode == 1 and "was written by another release of amqtt_durable" in release.stderr, (
        release.stderr
    )
    assert list(scratch.iterdir()) == [], "the scratch copy is removed after another release's store is refused"
    assert not (Path(broker.store) / "durable-write-probe.tmp").exists()


def stored_files(store: str) -> dict[str, bytes]:
    """The store's files and their bytes, but LevelDB's info log (LOG, LOG.old), which the process holding
    the store writes to as it pleases, and LOCK: closing any descriptor of it would release the fcntl
    lock this process holds on it."""
    skipped = ("LOG", "LOG.old", "LOCK")
    return {path.name: path.read_bytes() for path in Path(store).iterdir() if path.name not in skipped}


def test_a_store_any_program_holds_open_is_locked_for_the_broker_inspect_and_repair(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """operations.md: "a store that a running broker (or `inspect`, or any program using the LevelDB) holds
    is refused with `store '...' is locked by another process`, exit code 1" (repair); `inspect` needs the
    broker stopped ("LevelDB allows one process per store"); the broker exits 1 when "the broker cannot
    start (store locked ...)". Once the program lets go, each works and nothing was lost."""
    broker = two_queued(broker_factory, clients)
    holder = plyvel.DB(broker.store)
    try:
        before = stored_files(broker.store)
        locked = f"store '{broker.store}' is locked by another process"
        for args in (["repair", broker.store], ["inspect", broker.store], ["broker", "-c", str(broker.write_config())]):
            result = run_cli(*args)
            assert result.returncode == 1, (args, result.stdout, result.stderr[-2000:])
            assert locked in result.stderr, (args, result.stderr[-2000:])
            assert "Traceback" not in result.stderr, (args, result.stderr[-2000:])
        assert stored_files(broker.store) == before, "no file of the held store was written"
    finally:
        holder.close()
    repair(broker.store)
    broker.start()
    assert [m.payload for m in clients(broker.port, "dev").wait_messages(2)] == [b"m1", b"m2"]
