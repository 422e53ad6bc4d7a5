"""The batch-shaped replay path's plain parts (issue 14, point 2): PacketReader framing reads however
they are cut, PublishRun building a window's PUBLISHes into one buffer, the store's run reads, and a
pump taking a run of acks as one removal."""

from __future__ import annotations

import asyncio
import random
import struct
from collections.abc import Callable
from pathlib import Path

import plyvel
import pytest
from test_replicated_commits import HeldShipping

from amqtt_durable.config import DurableConfig
from amqtt_durable.delivery import ReadAccess, Transport, packet_seq
from amqtt_durable.engine import DurableEngine
from amqtt_durable.errors import PacketTooLargeError, ProtocolViolationError
from amqtt_durable.replication.primary import Primary
from amqtt_durable.sessions import PendingRemovals
from amqtt_durable.store import (
    BODY_TOPIC_FIELD,
    FLAG_SHARED,
    Body,
    DamagedEntry,
    Entry,
    SessionRecord,
    body_key,
    iter_entries,
    read_entry_run,
    read_session_state,
    read_stored_bodies,
    session_key,
    write_body,
    write_entry,
)
from amqtt_durable.turns import FIRST_RUN
from amqtt_durable.wire import (
    PacketReader,
    PublishRun,
    encode_puback,
    encode_publish,
    encode_pubrel,
    encode_subscribe,
    packet_id_for,
    remaining_length,
)
from recording_transport import RecordingTransport, parse_packets

LIMIT = 5.0


def test_packet_reader_frames_packets_split_anywhere() -> None:
    packets = [
        encode_puback(1),
        encode_publish(b"a/b", b"x" * 300, 1, 7, dup=False, retain=False),  # a 2-byte remaining length
        encode_puback(65535),
        bytes((0xE0, 0)),  # an empty body (DISCONNECT)
        encode_subscribe(3, "t/#"),
        encode_publish(b"t", b"y" * 20000, 0, 0, dup=False, retain=True),  # a 3-byte remaining length
    ]
    stream = b"".join(packets)
    expected = [(packet[0], packet[len(packet) - _body_length(packet) :]) for packet in packets]
    for cut in range(1, len(stream)):  # every cut into two reads
        reader = PacketReader(max_size=1 << 20)
        got = reader.feed(stream[:cut]) + reader.feed(stream[cut:])
        assert got == expected, cut
        assert reader.pending == 0
    rng = random.Random(14)
    for _ in range(200):  # and random cuts into many
        reader = PacketReader()
        got = []
        at = 0
        while at < len(stream):
            step = rng.randint(1, 40)
            got += reader.feed(stream[at : at + step])
            at += step
        assert got == expected


def _body_length(packet: bytes) -> int:
    length = shift = 0
    for byte in packet[1:5]:
        length |= (byte & 0x7F) << shift
        if byte < 0x80:
            return length
        shift += 7
    raise AssertionError("no length")


def test_packet_reader_keeps_a_cut_packet_and_returns_whole_ones_before_it() -> None:
    reader = PacketReader()
    data = encode_puback(1) + encode_puback(2) + encode_puback(3)[:3]
    assert reader.feed(data) == [(0x40, b"\x00\x01"), (0x40, b"\x00\x02")]
    assert reader.pending == 3
    assert reader.feed(b"") == []
    assert reader.feed(b"\x03" + encode_puback(4)[:1]) == [(0x40, b"\x00\x03")]
    assert reader.feed(encode_puback(4)[1:]) == [(0x40, b"\x00\x04")]
    assert reader.pending == 0


def test_packet_reader_refuses_a_huge_length_before_its_body_arrives() -> None:
    reader = PacketReader(max_size=4096)
    assert reader.feed(encode_puback(1) + b"\x30") == [(0x40, b"\x00\x01")]
    with pytest.raises(PacketTooLargeError):
        reader.feed(remaining_length(5000)[:2])  # no body byte yet
    at_limit = PacketReader(max_size=4096)
    assert at_limit.feed(b"\x30" + remaining_length(4096)) == [], "at the limit: waits for the body"
    assert at_limit.pending == 1 + len(remaining_length(4096))


def test_packet_reader_refuses_a_remaining_length_over_four_bytes() -> None:
    with pytest.raises(ProtocolViolationError):
        PacketReader().feed(b"\x30\xff\xff\xff\xff\x01")
    reader = PacketReader()
    assert reader.feed(b"\x30\xff\xff\xff") == [], "a cut length field waits"
    with pytest.raises(ProtocolViolationError):
        reader.feed(b"\xff\x01")


def test_packet_reader_collects_a_long_packet_without_parsing_each_read() -> None:
    payload = bytes(range(256)) * 1000
    packet = encode_publish(b"big", payload, 1, 9, dup=False, retain=False)
    reader = PacketReader()
    assert reader.feed(packet[:10]) == []
    at = 10
    while len(packet) - at > 1000:
        assert reader.feed(packet[at : at + 1000]) == []
        at += 1000
    assert reader.pending == at
    got = reader.feed(packet[at:] + encode_puback(5))
    assert got == [(packet[0], packet[len(packet) - _body_length(packet) :]), (0x40, b"\x00\x05")]


def test_packet_reader_passes_garbage_types_on_for_the_reader_to_refuse() -> None:
    """Framing does not judge packet types: a reserved type (0 or 15) comes out as a packet, and the
    reader closes the connection on it, as before."""
    assert PacketReader().feed(b"\x00\x00\xf0\x01z") == [(0x00, b""), (0xF0, b"z")]


@pytest.mark.parametrize("qos", [0, 1, 2])
@pytest.mark.parametrize("size", [0, 1, 100, 200, 20000])
def test_publish_run_builds_what_encode_publish_builds(qos: int, size: int) -> None:
    run = PublishRun()
    expected = []
    for index, (topic, dup, retain) in enumerate([("a/b", False, False), ("ü/ß", True, True), ("a/b", True, False)]):
        payload = bytes([index]) * size
        run.add(topic, payload, qos, 100 + index, dup=dup, retain=retain)
        expected.append(encode_publish(topic.encode(), payload, qos, 100 + index, dup=dup, retain=retain))
    run.add_raw(encode_pubrel(9))
    expected.append(encode_pubrel(9))
    assert run.take() == b"".join(expected)
    assert run.take() == b"", "taking empties the run"


def test_publish_run_starts_its_topic_cache_over_when_full(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("amqtt_durable.wire.TOPIC_HEADS_KEPT", 2)
    run = PublishRun()
    for topic in ("a", "b", "c", "a"):
        run.add(topic, b"p", 0, 0, dup=False, retain=False)
    expected = [encode_publish(t, b"p", 0, 0, dup=False, retain=False) for t in (b"a", b"b", b"c", b"a")]
    assert run.take() == b"".join(expected)
    assert len(run._heads) <= 2


def _store(tmp_path: Path, msg_ids: list[int], *, sid: int = 1) -> plyvel.DB:
    db = plyvel.DB(str(tmp_path / "db"), create_if_missing=True)
    with db.write_batch() as batch:
        for seq, msg_id in enumerate(msg_ids, start=1):
            write_entry(batch, sid, Entry(seq, msg_id, 1, 0, 3))
            write_body(batch, msg_id, Body(f"t/{msg_id % 3}", b"m%d" % msg_id, 1, float(msg_id)))
        write_entry(batch, sid + 1, Entry(1, 999, 1, 0, 3))  # the next session's queue is not read
    return db


@pytest.mark.parametrize("msg_ids", [list(range(1, 41)), list(range(1, 4001, 100))], ids=["dense", "sparse"])
def test_read_stored_bodies_dense_or_sparse_gives_each_body_once(tmp_path: Path, msg_ids: list[int]) -> None:
    db = _store(tmp_path, msg_ids)
    try:
        wanted = [*msg_ids[5:30], msg_ids[7], 123456]  # one asked twice, one not stored
        bodies = read_stored_bodies(db, wanted)
        assert set(bodies) == set(msg_ids[5:30])
        for msg_id in msg_ids[5:30]:
            assert Body.decode(bodies[msg_id]) == Body(f"t/{msg_id % 3}", b"m%d" % msg_id, 1, float(msg_id))
        assert read_stored_bodies(db, []) == {}
    finally:
        db.close()


def test_read_stored_bodies_raises_on_a_body_that_does_not_decode(tmp_path: Path) -> None:
    db = _store(tmp_path, list(range(1, 11)))
    try:
        db.put(body_key(5), b"\x00")
        with pytest.raises(struct.error):
            read_stored_bodies(db, list(range(1, 11)))
    finally:
        db.close()


def test_a_too_short_queue_key_is_met_by_the_read_after_the_entry_before_it(tmp_path: Path) -> None:
    """A 16-byte queue key sorting between entries 255 and 256 (damage): a read from 256 on (delivery's
    run after one cut short there, drop-oldest's scan from the pump's next unread) meets it first, it
    is not skipped; a too-long key beginning with entry 255's is passed over from 256 on."""
    db = _store(tmp_path, list(range(1, 261)))  # entries 1 .. 260
    try:
        short = b"q" + struct.pack(">Q", 1) + b"\x00" * 6 + b"\x01"
        db.put(short, b"x" * 13)
        db.put(b"q" + struct.pack(">QQ", 1, 255) + b"+", b"x" * 13)
        entries, damage = read_entry_run(db, 1, 256, 300, 100)
        assert entries == [] and damage is not None, "the read from 256 starts past the short key"
        scanned = iter_entries(db, 1, 256, keep_damaged=True)
        first = next(scanned)
        assert isinstance(first, DamagedEntry) and first.seq == -1 and first.key == short
        assert [e.seq for e in scanned] == list(range(256, 261))
        db.delete(short)
        entries, damage = read_entry_run(db, 1, 256, 300, 100)
        assert [e.seq for e in entries] == list(range(256, 261)) and damage is None
    finally:
        db.close()


def test_read_entry_run_stops_at_the_tail_and_the_limit(tmp_path: Path) -> None:
    db = _store(tmp_path, list(range(1, 21)))
    try:
        entries, damage = read_entry_run(db, 1, 3, 10, 100)
        assert [e.seq for e in entries] == list(range(3, 11)) and damage is None
        entries, _ = read_entry_run(db, 1, 3, 100, 4)
        assert [e.seq for e in entries] == [3, 4, 5, 6]
        assert read_entry_run(db, 1, 0, 100, 0) == ([], None)
        entries, _ = read_entry_run(db, 1, 18, 100, 100)
        assert [e.seq for e in entries] == [18, 19, 20], "the next session's entries are not read"
        db.put(b"q" + struct.pack(">QQ", 1, 6), b"short")
        entries, damage = read_entry_run(db, 1, 1, 100, 100)
        assert [e.seq for e in entries] == [1, 2, 3, 4, 5] and isinstance(damage, struct.error), "cut at the damage"
    finally:
        db.close()


class RunTransport(RecordingTransport):
    """A RecordingTransport that hands acks over in runs, as the glue's HandlerTransport does."""

    def __init__(self) -> None:
        super().__init__()
        self.ack_runs = None

    def ack_run(self, kind: str, packet_ids: list[int], during: Callable[[], None] | None = None) -> None:
        runs = self.ack_runs
        assert runs is not None, "the pump registered itself"
        runs.begin_ack_run()
        for packet_id in packet_ids:
            if kind == "puback":  # the pump matches PUBACKs itself (no callback registered per message)
                assert runs.take_pubacks([packet_id]) == [], packet_id
            else:
                self.expected.pop((kind, packet_id))()  # type: ignore[index]
            if during is not None:
                during()
        runs.end_ack_run()


async def _engine_with_queue(
    tmp_path: Path, qos_of: list[int], window: int = 40, first_seq: int | None = None, *, sync: bool = False
) -> DurableEngine:
    """An open engine whose durable session "c" has one queued message per entry of ``qos_of``,
    numbered from ``first_seq`` (a fresh session's first sequence number when None)."""
    engine = DurableEngine(DurableConfig(store=str(tmp_path / "store"), recovery_buffer=window, sync=sync))
    engine.open()
    await engine.connect("c", clean_session=False)
    await engine.subscribe("c", "t", 2)
    if first_seq is not None:
        session = engine.sessions["c"]
        session.head_seq = session.next_seq = first_seq
    for index, qos in enumerate(qos_of):
        assert engine.route_publish("t", b"%d" % index, qos) is not None
    await engine.written_so_far()
    return engine


def test_a_run_of_acks_removes_its_entries_once_at_the_end_and_refills_the_window(tmp_path: Path) -> None:
    async def main() -> None:
        engine = await _engine_with_queue(tmp_path, [1] * 100)
        try:
            transport = RunTransport()
            await engine.attach("c", transport)
            session = engine.sessions["c"]
            sent = await transport.wait_for(lambda ps: len(ps) >= 40, LIMIT)
            await asyncio.sleep(0.05)
            assert len(transport.packets) == 40, "the window holds"
            depths: list[int] = []
            transport.ack_run("puback", [p.packet_id for p in sent[:30]], lambda: depths.append(session.depth))
            assert depths == [100] * 30, "removed at the end of the run, not per ack"
            assert session.depth == 70
            sent = await transport.wait_for(lambda ps: len(ps) >= 70, LIMIT)
            assert [p.payload for p in sent] == [b"%d" % i for i in range(70)], "in order, none twice"
            transport.ack_run("puback", [p.packet_id for p in sent[30:70]])
            sent = await transport.wait_for(lambda ps: len(ps) >= 100, LIMIT)
            transport.ack_run("puback", [p.packet_id for p in sent[70:]])
            assert session.depth == 0 and session.bytes == 0
            await engine.written_so_far()
            assert list(engine.db.iterator(prefix=b"q")) == [], "every entry left the store"
            assert list(engine.db.iterator(prefix=b"m")) == [], "and every body"
        finally:
            await engine.close()

    asyncio.run(main())


def test_shared_bodies_stay_until_the_last_session_acknowledges_them(tmp_path: Path) -> None:
    async def main() -> None:
        engine = DurableEngine(DurableConfig(store=str(tmp_path / "store")))
        engine.open()
        try:
            for client in ("a", "b"):
                await engine.connect(client, clean_session=False)
                await engine.subscribe(client, "t", 1)
            for index in range(10):
                stored = engine.route_publish("t", b"%d" % index, 1)
                assert stored is not None
            await engine.written_so_far()
            transports = {client: RunTransport() for client in ("a", "b")}
            for client, transport in transports.items():
                await engine.attach(client, transport)
            sent = {c: await t.wait_for(lambda ps: len(ps) >= 10, LIMIT) for c, t in transports.items()}
            transports["a"].ack_run("puback", [p.packet_id for p in sent["a"]])
            await engine.written_so_far()
            assert len(list(engine.db.iterator(prefix=b"m"))) == 10, "b still needs them"
            entries, _ = engine.sessions["b"].read_entries(1, 10, 10)
            assert len(entries) == 10 and all(entry.flags & FLAG_SHARED for entry, _body in entries)
            transports["b"].ack_run("puback", [p.packet_id for p in sent["b"]])
            await engine.written_so_far()
            assert list(engine.db.iterator(prefix=b"m")) == []
        finally:
            await engine.close()

    asyncio.run(main())


def test_pending_removals_of_a_run_hide_entries_until_written() -> None:
    removals = PendingRemovals()
    entries = [Entry(seq, seq, 1, 0, 1) for seq in range(1, 7)]
    assert removals.absent(1, entries) is entries, "nothing pending: the run as read"
    removals.add_run(1, [2, 3])
    removals.add((1, 5))
    assert [e.seq for e in removals.absent(1, entries)] == [1, 4, 6]
    assert removals.absent(2, entries) == entries, "another session's seqs are not these"
    removals.seal()
    removals.add_run(1, [6])
    assert [e.seq for e in removals.absent(1, entries)] == [1, 4], "sealed and open both hide"
    removals.written()
    assert [e.seq for e in removals.absent(1, entries)] == [1, 2, 3, 4, 5]


# Issue 14, the round after the batch-shaped replay: PUBLISHes built from the stored body bytes,
# PUBACKs matched by packet id, the first sent mark in the attach's commit.


@pytest.mark.parametrize("qos", [0, 1, 2])
@pytest.mark.parametrize("size", [0, 1, 100, 116, 117, 200, 16370, 20000])
def test_publish_run_builds_a_stored_body_into_what_encode_publish_builds(qos: int, size: int) -> None:
    run = PublishRun()
    expected = []
    for index, (topic, dup, retain) in enumerate([("a/b", False, False), ("ü/ß", True, True), ("", True, False)]):
        payload = bytes([index]) * size
        stored = Body(topic, payload, qos, 1.5).encode()
        run.add_stored(stored, BODY_TOPIC_FIELD, qos, 65535 - index, dup=dup, retain=retain)
        expected.append(encode_publish(topic.encode(), payload, qos, 65535 - index, dup=dup, retain=retain))
    run.add("c", b"live", qos, 7, dup=False, retain=False)  # mixed with decoded ones in one run
    expected.append(encode_publish(b"c", b"live", qos, 7, dup=False, retain=False))
    assert run.take() == b"".join(expected)


def test_stored_bodies_are_checked_as_body_decode_checks_them(tmp_path: Path) -> None:
    good = Body("t/1", b"payload", 1, 2.0).encode()
    head = good[:BODY_TOPIC_FIELD]
    damaged = {
        "shorter than its head": (good[:5], struct.error),
        "topic past the end": (head + b"\x00\x09t/1", ValueError),
        "topic not UTF-8": (head + b"\x00\x02\xff\xfe" + b"payload", ValueError),
    }
    for index, (raw, error) in enumerate(damaged.values()):
        with pytest.raises(error):
            Body.decode(raw)
        folder = tmp_path / str(index)
        folder.mkdir()
        db = _store(folder, list(range(1, 6)))
        try:
            assert read_stored_bodies(db, [1, 2, 3]) == {m: db.get(body_key(m)) for m in (1, 2, 3)}
            db.put(body_key(2), raw)
            with pytest.raises(error):
                read_stored_bodies(db, [1, 2, 3])
        finally:
            db.close()


@pytest.mark.parametrize("oldest", [1, 500, 65533, 65534, 65535, 65536, 131069, 131070, 10**9])
def test_packet_seq_finds_the_in_flight_sequence_of_a_packet_id(oldest: int) -> None:
    for offset in (0, 1, 99, 100, 65533, 65534):  # anything within 65535 of the oldest in flight
        seq = oldest + offset
        assert packet_seq(packet_id_for(seq), oldest) == seq


def test_the_pump_matches_a_run_of_pubacks_by_packet_id(tmp_path: Path) -> None:
    """QoS 1 acks of a run go to take_pubacks (no callback per message); an id of a QoS 2 message in
    flight, an unknown id and an id acked twice come back as not the pump's, in order."""

    async def main() -> None:
        qos_of = [1, 1, 2, 1, 2, 1, 1]
        engine = await _engine_with_queue(tmp_path, qos_of)
        try:
            transport = RunTransport()
            await engine.attach("c", transport)
            session = engine.sessions["c"]
            sent = await transport.wait_for(lambda ps: len(ps) >= len(qos_of), LIMIT)
            assert [p.qos for p in sent] == qos_of
            assert {kind for kind, _ in transport.expected} == {"pubrec"}, "no callback per QoS 1 message"
            pump = transport.ack_runs
            assert pump is not None
            ids = [p.packet_id for p in sent]
            assert all(isinstance(i, int) for i in ids)
            pump.begin_ack_run()
            others = pump.take_pubacks([ids[3], 999, ids[2], ids[0], ids[1], ids[0]])
            assert session.depth == 7, "removed at the end of the run"
            pump.end_ack_run()
            assert others == [999, ids[2], ids[0]]
            assert session.depth == 4
            assert sorted(pump.inflight) == [3, 5, 6, 7]
            assert pump.take_pubacks([ids[5], ids[6]]) == [], "outside a run: removed at once"
            assert session.depth == 2
            await engine.detach("c", transport)
        finally:
            await engine.close()

    asyncio.run(main())


def test_pubacks_after_the_pump_stopped_are_taken_once_and_change_nothing(tmp_path: Path) -> None:
    """As the callbacks registered per message were: an in-flight message's PUBACK after the stop is
    the pump's (not passed on), and removes nothing (the entry goes out again, DUP, on the next
    connection); a second one is not the pump's."""

    async def main() -> None:
        engine = await _engine_with_queue(tmp_path, [1, 1, 1])
        try:
            transport = RunTransport()
            await engine.attach("c", transport)
            sent = await transport.wait_for(lambda ps: len(ps) >= 3, LIMIT)
            pump = transport.ack_runs
            assert pump is not None
            await engine.detach("c", transport)
            await pump.stop()  # a take-over stops the displaced pump a second time: it still knows its ids
            ids = [p.packet_id for p in sent]
            assert pump.take_pubacks([ids[1], 4242]) == [4242]
            assert pump.take_pubacks([ids[1], ids[0]]) == [ids[1]]
            session = engine.sessions["c"]
            assert session.depth == 3
            again = RunTransport()
            await engine.attach("c", again)
            resent = await again.wait_for(lambda ps: len(ps) >= 3, LIMIT)
            assert [(p.payload, p.dup) for p in resent] == [(b"0", True), (b"1", True), (b"2", True)]
            await engine.detach("c", again)
        finally:
            await engine.close()

    asyncio.run(main())


def test_a_puback_with_packet_id_0_is_not_for_the_message_sent_with_id_65535(tmp_path: Path) -> None:
    """0 is no packet id (MQTT-2.3.1-1), but modular matching took it for the in-flight message sent
    with id 65535, which left the store unacknowledged: lost if the connection then dropped."""

    async def main() -> None:
        engine = await _engine_with_queue(tmp_path, [1] * 10, first_seq=65530)  # a session 65,529 messages old
        try:
            session = engine.sessions["c"]
            transport = RunTransport()
            await engine.attach("c", transport)
            sent = await transport.wait_for(lambda ps: len(ps) >= 10, LIMIT)
            assert 65535 in [p.packet_id for p in sent]
            pump = transport.ack_runs
            assert pump is not None
            assert pump.take_pubacks([0]) == [0], "not the pump's: amqtt logs it"
            assert session.depth == 10
            await engine.detach("c", transport)
        finally:
            await engine.close()

    asyncio.run(main())


def test_attach_writes_the_first_sent_mark_in_its_own_commit(tmp_path: Path) -> None:
    """The pump's first send finds its sent mark already stored (by the commit attach waits for):
    the first replayed message does not wait for a commit of its own."""

    async def main() -> None:
        engine = await _engine_with_queue(tmp_path, [1] * 50, window=40)
        try:
            session = engine.sessions["c"]
            transport = RunTransport()
            await engine.attach("c", transport)
            assert read_session_state(engine.db, session.record)[1] == 1 + 40, "stored before the pump runs"
            assert len(transport.packets) == FIRST_RUN, "the first batch went out within attach"
            assert session.stored_mark == 1 + 40, "the first send (FIRST_RUN entries) needed no mark of its own"
            assert session.sent_mark == FIRST_RUN + 40, "the next batch's is handed to the store with it (replay)"
            await engine.detach("c", transport)
        finally:
            await engine.close()

    asyncio.run(main())


def test_the_first_batch_goes_out_within_attach_unless_something_must_be_awaited(tmp_path: Path) -> None:
    """attach writes the first batch (FIRST_RUN entries) before it returns, ahead of amqtt's message loop set-up;
    with a topic ACL to ask (an await) the pump's task sends it, as every later batch."""

    async def main() -> None:
        engine = await _engine_with_queue(tmp_path, [1] * 50, window=40)
        try:
            transport = RunTransport()
            await engine.attach("c", transport)
            assert [p.payload for p in transport.packets] == [b"%d" % i for i in range(FIRST_RUN)]
            sent = await transport.wait_for(lambda ps: len(ps) >= 40, LIMIT)
            assert [p.payload for p in sent] == [b"%d" % i for i in range(40)], "then the rest, in order, none twice"
            assert not any(p.dup for p in sent)
            await engine.detach("c", transport)

            async def allow(topic: str) -> bool:
                await asyncio.sleep(0)
                return True

            checked = RunTransport()
            await engine.attach("c", checked, ReadAccess(allow))
            assert checked.packets == [], "nothing before the ACL's answer"
            resent = await checked.wait_for(lambda ps: len(ps) >= 40, LIMIT)
            assert [(p.payload, p.dup) for p in resent] == [(b"%d" % i, True) for i in range(40)]
            await engine.detach("c", checked)
        finally:
            await engine.close()

    asyncio.run(main())


class FlushingTransport(RunTransport):
    """Like the glue's transport (HandlerTransport): writes are queued for one socket write at the
    end of the loop pass (``flush``); each flush records what LevelDB held when it sent."""

    def __init__(self, engine: DurableEngine) -> None:
        super().__init__()
        self.engine = engine
        self.queued: list[bytes] = []
        self.covered: list[bool] = []
        self.stored_connected: list[bool] = []
        """At each flush that sends a PUBLISH: did the stored session record say connected?"""

    def write(self, data: bytes) -> None:
        if not self.queued:
            asyncio.get_running_loop().call_soon(self.flush)
        self.queued.append(data)

    def flush(self) -> None:
        data, self.queued = b"".join(self.queued), []
        if data:
            stored = read_session_state(self.engine.db, self.engine.sessions["c"].record)[1]
            ids = [p.packet_id for p in parse_packets(data) if p.packet_type == 3 and p.packet_id is not None]
            self.covered.append(all(packet_id - 1 <= stored for packet_id in ids))
            if ids:
                record = SessionRecord.decode("c", self.engine.db.get(session_key("c")))
                self.stored_connected.append(record.disconnected_at is None and record.expires_at is None)
            super().write(data)


@pytest.mark.parametrize("sync", [False, True])
def test_the_first_publish_leaves_after_the_commit_that_stores_the_sessions_connection(
    tmp_path: Path, sync: bool
) -> None:
    """docs/guarantees.md: a session's first batch waits for the commit that stores the session's
    connection and the batch's sent mark. The record's connection (no disconnect time, no expiry
    deadline) was saved after that commit, so with sync true the first PUBLISH reached the socket
    while LevelDB still held the previous disconnect (the next commit carried it; with sync false the
    commit at the end of the pass happened to write it first)."""

    async def main() -> None:
        engine = await _engine_with_queue(tmp_path, [1] * 50, window=40, sync=sync)
        try:
            earlier = RunTransport()
            await engine.attach("c", earlier)
            await earlier.wait_for(lambda ps: len(ps) >= 40, LIMIT)
            await engine.detach("c", earlier)  # unacknowledged: the next connection gets them again
            await engine.written_so_far()
            stored = SessionRecord.decode("c", engine.db.get(session_key("c")))
            assert stored.disconnected_at is not None and stored.expires_at is not None
            await engine.connect("c", clean_session=False)
            transport = FlushingTransport(engine)
            await engine.attach("c", transport)
            await transport.wait_for(lambda ps: len(ps) >= 40, LIMIT)
            assert transport.stored_connected and all(transport.stored_connected), (
                "a PUBLISH left while the stored record still held the previous disconnect"
            )
            await engine.detach("c", transport)
        finally:
            await engine.close()

    asyncio.run(main())


async def _acknowledge_until_done(shipping: HeldShipping, attach: asyncio.Task[Transport | None]) -> None:
    """Acknowledge every commit ``shipping`` holds, and those shipped after, until ``attach`` is done."""
    for _ in range(10):
        shipping.shipping.clear()
        for held in shipping.shipped:
            if not held.done():
                held.set_result(None)
        shipped = asyncio.ensure_future(shipping.shipping.wait())
        await asyncio.wait({attach, shipped}, timeout=LIMIT, return_when=asyncio.FIRST_COMPLETED)
        shipped.cancel()
        if attach.done():
            return


def test_a_take_over_whose_commit_waits_stores_its_connection_when_the_old_connection_ends_meanwhile(
    tmp_path: Path,
) -> None:
    """Sync replication holds the attach's commit until the backups acknowledge it. The connection
    taken over ends during that wait and starts the expiry clock (its record: disconnected); the new
    connection's attach stores its connection again, in a commit its first PUBLISH waits for, and
    cancels the clock: no expiry deadline while it is connected."""

    async def main() -> None:
        engine = await _engine_with_queue(tmp_path, [1] * 50, window=40)
        primary = Primary(engine.db, store_id=7, log_max_batches=100, log_max_bytes=1 << 20)
        try:
            old = RunTransport()
            await engine.attach("c", old)
            await old.wait_for(lambda ps: len(ps) >= 40, LIMIT)
            engine.committer.replication = shipping = HeldShipping(primary)
            await engine.connect("c", clean_session=False)
            new = FlushingTransport(engine)
            attach = asyncio.create_task(engine.attach("c", new))
            await asyncio.wait_for(shipping.shipping.wait(), LIMIT)  # the attach's commit, held
            assert not attach.done()
            await engine.detach("c", old)
            assert engine.sessions["c"].record.disconnected_at is not None
            await _acknowledge_until_done(shipping, attach)
            assert await attach is None, "the old connection was gone already: none to end"
            record = engine.sessions["c"].record
            assert record.disconnected_at is None and record.expires_at is None
            assert engine.expiry.deadline("c") is None, "an expiry clock runs while the session is connected"
            await new.wait_for(lambda ps: len(ps) >= 40, LIMIT)
            assert new.stored_connected and all(new.stored_connected), (
                "a PUBLISH left while the stored record held the old connection's end"
            )
            engine.committer.replication = None
            for held in shipping.shipped:
                if not held.done():
                    held.set_result(None)
            await engine.detach("c", new)
        finally:
            await engine.close()
            await primary.close()

    asyncio.run(main())


def test_an_attach_a_newer_connect_drops_during_its_commit_leaves_the_session_its_expiry_deadline(
    tmp_path: Path,
) -> None:
    """docs/guarantees.md, Expiry: the time counts from the session's last disconnect. An attach
    stores the session's connection (no expiry deadline) ahead of its commit; a newer CONNECT
    accepted during that commit drops it, and when that newer connection then neither attaches nor
    detaches (its CONNACK write failed), nothing else would give the session a deadline again: it
    stayed connected in memory and in LevelDB, with no connection, and never expired."""

    async def main() -> None:
        engine = await _engine_with_queue(tmp_path, [1] * 5)
        primary = Primary(engine.db, store_id=7, log_max_batches=100, log_max_bytes=1 << 20)
        try:
            first = RunTransport()
            await engine.attach("c", first)
            await engine.detach("c", first)
            record = engine.sessions["c"].record
            disconnected = (record.disconnected_at, record.expires_at)
            deadline = engine.expiry.deadline("c")
            assert None not in disconnected and deadline is not None
            engine.committer.replication = shipping = HeldShipping(primary)
            dropped = RunTransport()
            await engine.connect("c", clean_session=False, transport=dropped)
            attach = asyncio.create_task(engine.attach("c", dropped))
            await asyncio.wait_for(shipping.shipping.wait(), LIMIT)  # the attach's commit, held
            await engine.connect("c", clean_session=False, transport=RunTransport())  # never attaches
            await _acknowledge_until_done(shipping, attach)
            assert await attach is None
            engine.committer.replication = None
            await engine.detach("c", dropped)  # superseded: its end leaves the session to the newer one
            assert engine.expiry.deadline("c") == deadline, "the session lost its expiry deadline"
            assert (record.disconnected_at, record.expires_at) == disconnected
            await engine.written_so_far()
            stored = SessionRecord.decode("c", engine.db.get(session_key("c")))
            assert (stored.disconnected_at, stored.expires_at) == disconnected
        finally:
            await engine.close()
            await primary.close()

    asyncio.run(main())


def test_a_connection_attached_while_the_old_ones_pump_stops_keeps_its_session_connected(tmp_path: Path) -> None:
    """The old connection ends (its detach waits for its pump's task to stop) and the new one attaches
    in that wait. The old connection's end then found the session attached again and still applied
    the disconnected queue limits, started the expiry clock and stored it disconnected."""

    async def main() -> None:
        engine = await _engine_with_queue(tmp_path, [1] * 50, window=40)
        try:
            old = RunTransport()
            await engine.attach("c", old)
            await old.wait_for(lambda ps: len(ps) >= 40, LIMIT)
            await engine.connect("c", clean_session=False)
            new = RunTransport()
            detach = asyncio.create_task(engine.detach("c", old))  # first steps in this order
            attach = asyncio.create_task(engine.attach("c", new))
            await asyncio.wait_for(asyncio.gather(detach, attach), LIMIT)
            session = engine.sessions["c"]
            assert session.transport is new
            assert session.record.disconnected_at is None and engine.expiry.deadline("c") is None
            await engine.written_so_far()
            stored = SessionRecord.decode("c", engine.db.get(session_key("c")))
            assert stored.disconnected_at is None and stored.expires_at is None
            await new.wait_for(lambda ps: len(ps) >= 40, LIMIT)
            await engine.detach("c", new)
        finally:
            await engine.close()

    asyncio.run(main())


def test_no_publish_is_written_before_a_stored_sent_mark_covers_it(tmp_path: Path) -> None:
    """The default committer (sync: false) writes at the end of the loop pass. A live publish raises
    its session's sent mark in its own batch, and the pump took that queued mark for a stored one:
    resumed ahead of the batch's write (here its drain() returns, as a socket's write-ready callback
    run before the reader's in one pass resumes it), it wrote backlog PUBLISHes the stored mark did
    not cover, a callback before the batch holding their mark (a crash there re-sends them without
    DUP). Every write is checked against the mark LevelDB holds at that moment."""

    async def main() -> None:
        engine = await _engine_with_queue(tmp_path, [1] * 30, window=10)
        try:
            transport = MarkCheckingTransport(engine)
            await engine.attach("c", transport)
            sent = await transport.wait_for(lambda ps: len(ps) >= 10, LIMIT)  # the mark 1 + 10 came with attach
            gate = transport.gate = asyncio.get_running_loop().create_future()
            transport.ack_run("puback", [sent[0].packet_id])
            sent = await transport.wait_for(lambda ps: len(ps) >= 11, LIMIT)  # now waiting in drain()
            gate.set_result(None)  # the pump resumes first in the next pass
            transport.ack_run("puback", [p.packet_id for p in sent[1:6]])
            assert engine.route_publish("t", b"live", 1) is not None  # raises the mark in the pass's batch
            sent = await transport.wait_for(lambda ps: len(ps) >= 16, LIMIT)
            assert [p.payload for p in sent] == [b"%d" % i for i in range(16)]
            assert transport.uncovered == [], "PUBLISHes written past the sent mark stored then"
            await engine.detach("c", transport)
        finally:
            await engine.close()

    asyncio.run(main())


class MarkCheckingTransport(RunTransport):
    """Records the PUBLISHes of each write that the sent mark stored at that moment does not cover;
    ``drain`` waits for ``gate`` while one is set (a socket whose buffer is full)."""

    def __init__(self, engine: DurableEngine) -> None:
        super().__init__()
        self.engine = engine
        self.uncovered: list[int] = []
        self.gate: asyncio.Future[None] | None = None

    def write(self, data: bytes) -> None:
        session = self.engine.sessions["c"]
        stored = read_session_state(self.engine.db, session.record)[1]
        publishes = [p for p in parse_packets(data) if p.packet_type == 3 and p.packet_id is not None]
        self.uncovered += [p.packet_id for p in publishes if p.packet_id - 1 > stored]  # type: ignore[operator]
        super().write(data)

    async def drain(self) -> None:
        gate, self.gate = self.gate, None
        if gate is not None:
            await gate


def test_a_replay_does_not_wait_for_a_sent_mark_commit_once_per_window(tmp_path: Path) -> None:
    """The pump stored the sent mark a batch needed only when that batch was due, and waited for the
    commit: once per window of a replay. The mark a window past each replayed batch now goes with the
    write its acks ask for, so a client acking as it reads never holds the pump up for one; no
    PUBLISH is written past the mark stored at the time (checked at every write)."""

    async def main() -> None:
        count = 2000
        engine = await _engine_with_queue(tmp_path, [1] * count, window=100)
        try:
            session = engine.sessions["c"]
            waits: list[int] = []
            advance = session.advance_sent_mark

            async def counted(*args: int) -> None:  # (highest, window); the code before took (mark)
                waits.append(args[0])
                await advance(*args)

            session.advance_sent_mark = counted  # type: ignore[method-assign]
            transport = AckingTransport(engine)
            commits = engine.committer.commits
            await engine.attach("c", transport)
            sent = await transport.wait_for(lambda ps: len(ps) >= count, LIMIT)
            assert [p.payload for p in sent] == [b"%d" % i for i in range(count)]
            assert transport.uncovered == []
            assert waits == [], "the first batch (within attach) already sent the mark of the next"
            await engine.written_so_far()
            assert session.depth == 0
            assert engine.committer.commits - commits < count // 50, "the marks ride with the acks' writes"
            await engine.detach("c", transport)
        finally:
            await engine.close()

    asyncio.run(main())


def test_a_forced_sent_mark_commit_covers_a_window_past_the_batch_it_waits_for(tmp_path: Path) -> None:
    """A batch that finds its mark queued ahead but not yet written forces a commit anyway (with
    ``sync: true`` the acks' write waits for batch_delay_ms); that commit must carry the mark a window
    past this batch, or the next batch waits for a commit of its own again: with ``sync: true`` a
    replay then waited for a commit more often than once per window."""

    async def main() -> None:
        engine = await _engine_with_queue(tmp_path, [1] * 10, window=100)
        try:
            session = engine.sessions["c"]
            base = session.stored_mark
            session.mark_ahead(base + 100)  # queued with no write of its own, as after a sent batch
            assert session.stored_mark == base
            await session.advance_sent_mark(base + 50, 100)
            assert session.stored_mark >= base + 150
        finally:
            await engine.close()

    asyncio.run(main())


class AckingTransport(MarkCheckingTransport):
    """A client that acknowledges each write's PUBLISHes, as one run, in the loop pass after it."""

    def write(self, data: bytes) -> None:
        super().write(data)
        ids = [p.packet_id for p in parse_packets(data) if p.packet_type == 3 and p.packet_id is not None]
        asyncio.get_running_loop().call_soon(self.ack_run, "puback", ids)
