"""Damaged records of every kind, against the real broker and the real `amqtt-durable` CLI.

Each test builds a store through a real broker (dev-1 and dev-2 share the bodies of topic t,
dev-3 has its own on u, a stream log on log/#), damages one record with plyvel as a disk or a
bad copy would, and checks that start-up, `inspect` and `repair` name the store and the record
(never a bare struct, JSON or Unicode error, never a traceback), and that the other sessions are
served with every message they had queued.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Callable
from typing import Any

import plyvel
import pytest

from amqtt_durable.store import encode_totals
from conftest import WAIT, Broker, Client, run_cli

STREAMS = [{"filter": "log/#"}]
QUEUED = {"dev-1": 5, "dev-2": 5, "dev-3": 3}


def build(broker_factory: Callable[..., Broker], clients: Callable[..., Client]) -> tuple[Broker, dict[str, int]]:
    """A stopped broker whose store holds the three queues and a stream log; each client's session number."""
    broker = broker_factory(streams=STREAMS)
    for client_id, topic_filter in (("dev-1", "t"), ("dev-2", "t"), ("dev-3", "u")):
        device = clients(broker.port, client_id)
        device.subscribe(topic_filter, 1)
        device.disconnect()
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("t", [f"t{i}".encode() for i in range(QUEUED["dev-1"])], qos=1)
    publisher.publish("u", [f"u{i}".encode() for i in range(QUEUED["dev-3"])], qos=1)
    publisher.publish("log/x", [b"e0", b"e1"], qos=1)
    broker.stop()
    return broker, session_numbers(broker)


def session_numbers(broker: Broker) -> dict[str, int]:
    """Each client id's session number, read from the stopped broker's store."""
    db = plyvel.DB(broker.store)
    try:
        return {key[1:].decode(): int(json.loads(value)["sid"]) for key, value in db.iterator(prefix=b"s")}
    finally:
        db.close()


def damage(broker: Broker, put: dict[bytes, bytes], delete: tuple[bytes, ...] = ()) -> None:
    db = plyvel.DB(broker.store)
    try:
        for key in delete:
            db.delete(key)
        for key, value in put.items():
            db.put(key, value, sync=True)
    finally:
        db.close()


def refused(broker: Broker, named: str) -> None:
    """The broker exits 1, naming the store, the record and the repair to run; no bare error."""
    result = run_cli("broker", "-c", str(broker.write_config()))
    assert result.returncode == 1, f"the broker must refuse this store:\n{result.stderr}"
    last = result.stderr.strip().splitlines()[-1]
    assert f"store '{broker.store}' is corrupted or unreadable: {named}" in last, last
    assert f"run 'amqtt-durable repair {broker.store}'" in last, last
    assert "Traceback" not in result.stderr, result.stderr


def inspect_refuses(broker: Broker, named: str) -> None:
    result = run_cli("inspect", broker.store)
    assert result.returncode == 1, result.stdout
    assert result.stderr.startswith(f"amqtt-durable: store '{broker.store}' is corrupted or unreadable: {named}"), (
        result.stderr
    )
    assert "Traceback" not in result.stderr


def repaired(broker: Broker, said: str) -> None:
    result = run_cli("repair", broker.store)
    assert result.returncode == 0, result.stderr
    assert said in result.stdout, result.stdout


def served(broker: Broker, clients: Callable[..., Client], client_ids: tuple[str, ...]) -> None:
    """Each of ``client_ids`` resumes its session and gets every message it had queued, in order."""
    for client_id in client_ids:
        device = clients(broker.port, client_id)
        prefix = "u" if client_id == "dev-3" else "t"
        expected = [f"{prefix}{i}".encode() for i in range(QUEUED[client_id])]
        got = [m.payload for m in device.wait_messages(len(expected), timeout=WAIT)]
        assert got == expected, (client_id, got, broker.log())


def session_record(sid: int, **fields: Any) -> bytes:
    return json.dumps({"sid": sid, "subscriptions": {"t": 1}, "created_at": 1.0, **fields}).encode()


@dataclasses.dataclass(frozen=True)
class Damage:
    """One record damaged (``records``, given each client's session number), what start-up (and
    inspect, where ``inspect``) names, and what repair says it did (``{sid}``: dev-1's session number)."""

    records: Callable[[dict[str, int]], dict[bytes, bytes]]
    named: str
    repaired: str
    inspect: bool = True


NAMED_AND_REPAIRED = {
    # The store id (b"i") was read with a bare struct.unpack: start-up said only `unpack requires a
    # buffer of 8 bytes`, naming neither the store nor the record, and inspect did not see it.
    "store-id-wrong-length": Damage(
        lambda sids: {b"i": b"\x01\x02\x03"},
        "the store id: 3 bytes that do not decode",
        "rebuilt: store id did not decode: removed",
    ),
    # JSON that parses but holds a string where a deadline goes: start-up failed later with a bare
    # `'<' not supported between instances of 'float' and 'str'`, inspect showed it, and repair called
    # the store consistent, so no start ever succeeded again.
    "session-record-field-of-wrong-type": Damage(
        lambda sids: {b"sdev-1": session_record(sids["dev-1"], expires_at="soon", disconnected_at=1.0)},
        "the session record of client id 'dev-1' does not decode (TypeError: expires_at is 'soon', not a number)",
        "rebuilt: client 'dev-1': session record rebuilt (session number {sid})",
    ),
    # A session number of 2**70: start-up said `error: int too large to convert`, inspect and repair
    # ended in a struct.error traceback. Its number is no session's: repair matches it to the one
    # queue left without a record (dev-1's).
    "session-number-no-key-can-hold": Damage(
        lambda sids: {b"sdev-1": session_record(2**70)},
        "the session record of client id 'dev-1' does not decode (ValueError: session number",
        "rebuilt: client 'dev-1': session record rebuilt (session number {sid})",
    ),
    # A stream's id mark (b"L") cut short: start-up said only `error: unpack requires a buffer of 8
    # bytes`, and repair left it as it was, so the broker never started again.
    "stream-id-mark": Damage(
        lambda sids: {b"Llog/x": b"\x00\x02"},
        "the id mark of stream 'log/x': 2 bytes that do not decode",
        "rebuilt: stream log/x: its id mark did not decode: set past every id it can have given",
        inspect=False,
    ),
    # The first event of a log cut short: start-up said only `error: unpack_from requires ...`.
    "stream-event": Damage(
        lambda sids: {b"e\x00\x05log/x" + struct.pack(">Q", 1): b"\x00\x01\x02"},
        "event 1 of stream 'log/x': 3 bytes that do not decode",
        "not recovered: stream log/x: event 1 does not decode: removed",
        inspect=False,
    ),
    # The docs promise inspect names what start-up names; a sent mark cut short stopped start-up by
    # name, but inspect never read the sent mark and listed the store as sound.
    "sent-mark": Damage(
        lambda sids: {b"w" + struct.pack(">Q", sids["dev-1"]): b"\x00\x02"},
        "the sent mark of client id 'dev-1': 2 bytes that do not decode",
        "rebuilt: client 'dev-1': sent mark rebuilt past the queue",
    ),
}


@pytest.mark.parametrize("case", NAMED_AND_REPAIRED)
def test_a_damaged_record_is_named_at_start_and_repaired(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], case: str
) -> None:
    """Start-up refuses the store naming the record (and inspect too, where it reads it), repair
    rebuilds or removes it, and every session is then served all it had queued."""
    damaged = NAMED_AND_REPAIRED[case]
    broker, sids = build(broker_factory, clients)
    damage(broker, damaged.records(sids))
    refused(broker, damaged.named)
    if damaged.inspect:
        inspect_refuses(broker, damaged.named)
    repaired(broker, damaged.repaired.format(sid=sids["dev-1"]))
    broker.start()
    served(broker, clients, ("dev-1", "dev-2", "dev-3"))


def test_a_per_session_key_of_the_wrong_length_is_named_at_start(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """A QoS 2 packet id key cut short (and a queue totals key): start-up said `error: unpack_from
    requires a buffer of at least 11 bytes ...`, not which key."""
    broker, sids = build(broker_factory, clients)
    key = b"x" + struct.pack(">Q", sids["dev-1"]) + b"\x07"
    damage(broker, {key: b""})
    refused(broker, f"a QoS 2 packet id key of 10 bytes, not 11 (damaged): {key!r}")
    repaired(broker, "not recovered: a QoS 2 packet id key of 10 bytes (damaged) removed")
    damage(broker, {b"t\x00\x00": b""})
    refused(broker, "a queue totals key of 3 bytes, not 9 (damaged)")
    repaired(broker, "not recovered: a queue totals key of 3 bytes (damaged) removed")
    broker.start()
    served(broker, clients, ("dev-1", "dev-2", "dev-3"))


def test_a_first_queue_entry_that_does_not_decode_stops_only_its_session(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """Start-up read each session's first entry whole: one that did not decode refused the whole
    broker (`error: unpack requires a buffer of 14 bytes`), and inspect ended in a traceback. Now
    only its key is read at start; delivery meets the damage as any other in a queue (logged,
    retried, the other sessions served), and inspect names the entry."""
    broker, sids = build(broker_factory, clients)
    damage(broker, {b"q" + struct.pack(">QQ", sids["dev-1"], 1): b"\x00\x01\x02\x03\x04"})
    inspect_refuses(broker, "queue entry 1 of client id 'dev-1': 5 bytes that do not decode")
    broker.start()
    served(broker, clients, ("dev-2", "dev-3"))
    clients(broker.port, "dev-1")
    assert broker.wait_until(lambda: "session dev-1: reading its queue after message 0 failed" in broker.log(), WAIT)
    broker.stop()
    repaired(broker, "not recovered: client 'dev-1': 1 queued message(s) unreadable (removed)")


@pytest.mark.parametrize("count", [b"\x00\x01", None], ids=["cut-short", "missing"])
def test_a_damaged_reference_count_loses_no_message_of_the_sessions_sharing_the_body(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], count: bytes | None
) -> None:
    """The count of a body shared by dev-1 and dev-2. Cut short: the PUBACK that released it ended the
    client's connection (`reader stopped: error('unpack requires a buffer of 4 bytes')`), so dev-2
    never got past it. Missing: it was taken for 1, dev-1's PUBACK deleted the body, and dev-2's copy
    was gone (`queue entry 1 has no message body; removing it`). Now the body is kept, an ERROR names it."""
    broker, _ = build(broker_factory, clients)
    db = plyvel.DB(broker.store)
    try:
        key = next(db.iterator(prefix=b"c", include_value=False))
    finally:
        db.close()
    if count is None:
        damage(broker, {}, delete=(key,))
    else:
        damage(broker, {key: count})
    broker.start()
    served(broker, clients, ("dev-1", "dev-2", "dev-3"))
    msg_id = int.from_bytes(key[1:], "big")
    state = "is missing" if count is None else "does not decode"
    assert f"message {msg_id}: its reference count {state}: its body is kept" in broker.log(), broker.log()
    # Once per message, not once per release (dev-1's and dev-2's PUBACKs both released it).
    assert broker.log().count(f"message {msg_id}: its reference count") == 1, broker.log()
    assert "has no message body" not in broker.log(), broker.log()
    assert "reader stopped" not in broker.log(), broker.log()
    broker.stop()
    if count is not None:  # no entry points at the body any more: repair removes the damaged count
        repaired(broker, "shared message reference count(s) rebuilt from the queues")


def test_a_reference_count_key_of_the_wrong_length_is_removed_by_repair(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """Repair read every count key's message id with a bare unpack: a short key ended it in a traceback."""
    broker, _ = build(broker_factory, clients)
    damage(broker, {b"c\x00\x00\x00\x00": b"\x00\x00\x00\x02"})  # start-up never reads it: only repair did
    repaired(broker, "not recovered: a message reference count key of 5 bytes (damaged) removed")
    broker.start()
    served(broker, clients, ("dev-1", "dev-2", "dev-3"))


def build_shared(broker_factory: Callable[..., Broker], clients: Callable[..., Client], **settings: Any) -> Broker:
    """A stopped broker whose store holds t0..t2 for dev-1 and dev-2 (shared bodies); dev-1's entry
    ``seq`` (1: its first) cut short."""
    broker = broker_factory(**settings)
    for client_id in ("dev-1", "dev-2"):
        device = clients(broker.port, client_id)
        device.subscribe("t", 1)
        device.disconnect()
    clients(broker.port, "pub", clean_session=True).publish("t", [b"t0", b"t1", b"t2"], qos=1)
    broker.stop()
    return broker


def damage_entry(broker: Broker, seq: int) -> None:
    sid = session_numbers(broker)["dev-1"]
    damage(broker, {b"q" + struct.pack(">QQ", sid, seq): b"\x00\x01\x02"})


@pytest.mark.parametrize("seq", [1, 2], ids=["first-entry", "deeper-entry"])
def test_a_damaged_queue_entry_met_by_drop_oldest_stops_no_publish(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], seq: int
) -> None:
    """dev-1 offline at its queue limit: drop-oldest decoded the entries it scanned, and the damaged one
    raised into routing: the PUBLISH was never acknowledged, the publisher's connection ended
    (`reader stopped: DamagedRecordError(...)`) and dev-2 never got the message. Now the damaged entry
    is dropped by its key (an ERROR names it) as the oldest, counted as a drop."""
    broker = build_shared(broker_factory, clients, max_depth=3, max_depth_disconnected=3)
    damage_entry(broker, seq)
    broker.start()
    clients(broker.port, "pub", clean_session=True).publish("t", [b"n0", b"n1"], qos=1)
    for client_id in ("dev-2", "dev-1"):  # each queue at its limit of 3 kept the newest 3
        device = clients(broker.port, client_id)
        got = [m.payload for m in device.wait_messages(3)]
        assert got == [b"t2", b"n0", b"n1"], (client_id, got, broker.log())
    named = f"session dev-1: queue entry {seq} of client id 'dev-1': 3 bytes that do not decode: dropped"
    assert named in broker.log(), broker.log()
    assert "reader stopped" not in broker.log(), broker.log()
    broker.stop()
    result = run_cli("repair", broker.store)
    assert result.returncode == 0, result.stderr
    broker.start()
    served_again = clients(broker.port, "dev-2")
    assert served_again.session_present


@pytest.mark.parametrize("seq", [1, 2], ids=["first-entry", "deeper-entry"])
def test_a_damaged_queue_entry_does_not_stop_a_clean_session_connect(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], seq: int
) -> None:
    """A clean-session CONNECT deletes the old session, whose entries were decoded to be erased: the
    damaged one raised (`Unhandled exception in client_connected_cb`), no CONNACK came, and the session
    record was already erased while its entries stayed, so the next start refused the store (orphan
    entries). Now the damaged entry is erased by its key (an ERROR names it; its body is left for repair)."""
    broker = build_shared(broker_factory, clients)
    damage_entry(broker, seq)
    broker.start()
    clients(broker.port, "dev-1", clean_session=True).disconnect()  # its CONNACK came (Client asserts it)
    named = f"queue entry {seq} of client id 'dev-1': 3 bytes that do not decode: erased with its session"
    assert broker.wait_until(lambda: named in broker.log(), WAIT), broker.log()
    broker.stop()
    broker.start()
    dev2 = clients(broker.port, "dev-2")
    got = [m.payload for m in dev2.wait_messages(3)]
    assert got == [b"t0", b"t1", b"t2"], (got, broker.log())
    assert not clients(broker.port, "dev-1").session_present


def test_a_damaged_entry_dropped_under_a_byte_limit_leaves_no_bytes_in_an_empty_queue(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """dev-1's only entry (90 bytes) is damaged; drop-oldest drops it by its key, its size unknown. Its
    90 bytes stayed in the byte total (persisted), so the empty queue refused every 20-byte message,
    connected or not, across restarts, until repair. Now an empty queue holds no bytes."""
    broker = broker_factory(max_bytes=100, max_bytes_disconnected=100)
    device = clients(broker.port, "dev-1")
    device.subscribe("t", 1)
    device.disconnect()
    clients(broker.port, "pub", clean_session=True).publish("t", [b"x" * 90], qos=1)
    broker.stop()
    damage_entry(broker, 1)
    broker.start()
    clients(broker.port, "pub", clean_session=True).publish("t", [b"a" * 20, b"b" * 20], qos=1)
    broker.stop()
    result = run_cli("inspect", broker.store)
    assert result.returncode == 0, result.stderr
    row = next(line.split() for line in result.stdout.splitlines() if line.startswith("dev-1"))
    assert row[1:3] == ["2", "40"], (row, broker.log())  # DEPTH, BYTES
    broker.start()
    device = clients(broker.port, "dev-1")
    got = [m.payload for m in device.wait_messages(2)]
    assert got == [b"a" * 20, b"b" * 20], (got, row, broker.log())
    device.disconnect()  # else c goes to this live connection, which may acknowledge it before the take-over
    clients(broker.port, "pub", clean_session=True).publish("t", [b"c" * 20], qos=1)
    device = clients(broker.port, "dev-1")
    assert [m.payload for m in device.wait_messages(1)] == [b"c" * 20], broker.log()


def test_a_damaged_entry_in_an_orphaned_queue_does_not_refuse_the_store(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """dev-1's session record is gone (a crash while deleting it) and its first queue entry is damaged:
    start-up's orphaned-queue cleanup erases the damaged entry by its key (an ERROR names the session
    number) with the rest of the queue and goes on; the other sessions are served."""
    broker = build_shared(broker_factory, clients)
    sid = session_numbers(broker)["dev-1"]
    damage(broker, {b"q" + struct.pack(">QQ", sid, 1): b"\x00\x01\x02"}, delete=(b"sdev-1",))
    broker.start()
    named = f"queue entry 1 of session number {sid}: 3 bytes that do not decode: erased with its session"
    assert named in broker.log(), broker.log()
    dev2 = clients(broker.port, "dev-2")
    assert [m.payload for m in dev2.wait_messages(3)] == [b"t0", b"t1", b"t2"], broker.log()
    assert not clients(broker.port, "dev-1").session_present
    broker.stop()
    db = plyvel.DB(broker.store)
    try:
        assert list(db.iterator(prefix=b"q" + struct.pack(">Q", sid), include_value=False)) == []
    finally:
        db.close()


def test_a_wrong_length_key_after_an_entry_awaiting_pubcomp_is_not_dropped_by_drop_oldest(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """dev-1 offline at its limit of 3; its entry 1 is a QoS 2 message whose PUBREL is due (not
    droppable) and right after it lies a queue entry key one byte too long. Drop-oldest reaches that key,
    which it cannot drop by a sequence number: the new message is dropped for dev-1 only (ERROR naming
    the key); the publisher gets its PUBACK and dev-2 gets the message."""
    broker = build_shared(broker_factory, clients, max_depth=3, max_depth_disconnected=3)
    db = plyvel.DB(broker.store)
    try:
        sid = int(json.loads(db.get(b"sdev-1"))["sid"])
        key = b"q" + struct.pack(">QQ", sid, 1)
        msg_id, _, _, size = struct.unpack(">QBBI", db.get(key))
        db.put(key, struct.pack(">QBBI", msg_id, 2, 0x02, size), sync=True)  # QoS 2, RELEASED
        long_key = key + b"\x00"
        db.put(long_key, db.get(b"q" + struct.pack(">QQ", sid, 2)), sync=True)
    finally:
        db.close()
    broker.start()
    clients(broker.port, "pub", clean_session=True).publish("t", [b"n0"], qos=1)
    dev2 = clients(broker.port, "dev-2")
    got = [m.payload for m in dev2.wait_messages(3)]
    assert got == [b"t1", b"t2", b"n0"], (got, broker.log())  # dev-2's own limit of 3 dropped t0
    named = (
        f"session dev-1: a queue entry key of 18 bytes, not 17 (damaged): {long_key!r}: its queue is full "
        "and this key cannot be dropped: the new message is dropped"
    )
    assert broker.wait_until(lambda: named in broker.log(), WAIT), broker.log()
    assert "reader stopped" not in broker.log(), broker.log()


def test_totals_of_an_empty_queue_are_set_to_zero_at_start_with_one_warning(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """dev-1's queue is empty but its stored totals say 0 messages and 90 bytes, as an earlier release
    left them after drop-oldest dropped a damaged entry by its key (dev-2: 1 message counted, no entry).
    Before: the load took the totals as stored; under a 100-byte limit dev-1's empty queue refused every
    20-byte message, across restarts, until repair. Now the load sets them to 0 and says so once."""
    broker = broker_factory(max_bytes=100, max_bytes_disconnected=100)
    for client_id in ("dev-1", "dev-2"):
        device = clients(broker.port, client_id)
        device.subscribe("t", 1)
        device.disconnect()
    broker.stop()
    sids = session_numbers(broker)
    damage(
        broker,
        {
            b"t" + struct.pack(">Q", sids["dev-1"]): encode_totals(0, 90, 0),
            b"t" + struct.pack(">Q", sids["dev-2"]): encode_totals(1, 90, 0),
        },
    )
    broker.start()
    clients(broker.port, "pub", clean_session=True).publish("t", [b"a" * 20, b"b" * 20], qos=1)
    broker.stop()
    said = [line for line in broker.log().splitlines() if "queue totals that did not fit their queue" in line]
    assert len(said) == 1 and "2 session(s)" in said[0] and "'dev-1', 'dev-2'" in said[0], broker.log()
    result = run_cli("inspect", broker.store)
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line.split()[1:3] for line in result.stdout.splitlines() if line.startswith("dev-")}
    assert rows == {"dev-1": ["2", "40"], "dev-2": ["2", "40"]}, (rows, broker.log())  # DEPTH, BYTES
    broker.start()
    for client_id in ("dev-1", "dev-2"):
        got = [m.payload for m in clients(broker.port, client_id).wait_messages(2)]
        assert got == [b"a" * 20, b"b" * 20], (client_id, got, broker.log())
    assert "did not fit their queue" not in broker.log().split(said[0])[-1], broker.log()  # once, not again
