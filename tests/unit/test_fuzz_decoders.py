"""Property tests (Hypothesis) of the pure decoders that read bytes from outside the process.

For any input a decoder returns a value or raises exactly its documented error (the control
protocol's ProtocolError, replication's FrameError, the store's damaged-record errors, the MQTT
reader's two packet errors), never another exception; where an encoder exists, decode(encode(x))
is x. Derandomized (a fixed sequence of examples) so CI sees the same cases every run; the
examples pinned with @example are inputs that once broke a decoder.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
import zlib
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from amqtt_durable.errors import PacketTooLargeError, ProtocolViolationError
from amqtt_durable.replication.errors import FrameError
from amqtt_durable.replication.framing import (
    MAX_PEER_FRAME,
    Frame,
    Hello,
    check_batch,
    decode_batch,
    decode_ops,
    decode_position,
    decode_seq,
    encode_batch,
    encode_frame,
    encode_ops,
    encode_position,
    encode_seq,
    name_problem,
    read_frame,
)
from amqtt_durable.store import Body, Entry, SessionRecord, decode_totals, encode_totals
from amqtt_durable.wire import PacketReader, encode_packet, split_packets
from durable_protocol import (
    MAX_STREAM_WINDOW,
    OPS,
    PROTOCOL_VERSION,
    LiveSubscription,
    Marker,
    ProtocolError,
    decode_frame,
    decode_marker,
    decode_reply,
    encode_error,
    encode_marker,
    encode_reply,
    encode_request,
    parse_request,
    request_ids,
)
from durable_protocol import (
    encode_frame as encode_event_frame,
)

pytestmark = pytest.mark.timeout(60)

FUZZ = settings(
    max_examples=150, derandomize=True, database=None, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
"""150 examples a property, the same ones every run (no example database: nothing written to the
work tree); no per-example deadline (a loaded CI machine)."""

U64 = st.integers(min_value=0, max_value=2**64 - 1)
U32 = st.integers(min_value=0, max_value=2**32 - 1)

# JSON values as a client could send them, including the ones Python's json reads beyond the
# standard (NaN, Infinity), huge integers and lone surrogates.
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(["a/b", "a/+", "#", "", "\ud800", "\x00", "$durable/x"]),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
FIELDS = ("v", "op", "req", "client_id", "session_expiry", "filter", "durable", "after", "window", "topic", "id")
requests = st.dictionaries(
    st.sampled_from(FIELDS) | st.text(max_size=6),
    json_values | st.sampled_from([*OPS, PROTOCOL_VERSION, MAX_STREAM_WINDOW]),
    max_size=8,
)


def _json(value: Any) -> bytes:
    return json.dumps(value).encode()  # NaN and Infinity as Python's json writes (and reads) them


def _deep(depth: int, inner: str = "1") -> bytes:
    return ("[" * depth + inner + "]" * depth).encode()


# ------------------------------------------------------------------- control requests
@FUZZ
@given(st.binary(max_size=200))
@example(b"\xff\xfe{\x00}\x00")  # UTF-16 with a BOM: json.loads(bytes) would read it
@example(_deep(100_000))
def test_parse_request_of_any_bytes_returns_or_refuses(payload: bytes) -> None:
    try:
        request = parse_request(payload)
    except ProtocolError as exc:
        assert exc.code in ("malformed", "unsupported_version", "unknown_op")
        return
    assert request.op in OPS


@FUZZ
@given(requests)
@example({"v": 1, "op": "hello", "session_expiry": 10**400})
@example({"v": 1, "op": "stream_subscribe", "filter": "a", "after": {"\ud800": 1}})
def test_parse_request_of_any_json_object_returns_or_refuses(data: dict[str, Any]) -> None:
    payload = _json(data)
    try:
        request = parse_request(payload)
    except ProtocolError as exc:
        assert exc.code in ("malformed", "unsupported_version", "unknown_op")
        # The refusal echoes the request's ids when they are readable, as request_ids reads them.
        assert (exc.op, exc.req) == request_ids(payload) or exc.req is None
        encode_error(exc.op, exc.req, exc)  # the error reply can always be written
        return
    assert request.op in OPS
    assert request.req is None or isinstance(request.req, int)


@pytest.mark.parametrize("field", ["op", "v", "filter", "client_id", "id", "window", "after", "session_expiry"])
def test_parse_request_with_a_field_nested_near_the_json_limit_is_malformed_not_a_crash(field: str) -> None:
    """A value nested just shallow enough for json.loads: the refusal's message shows it (repr)."""
    for depth in (200, 500, 900, 980, 995, 1_000, 1_100):
        base = {"v": 1, "op": "interest", "filter": "a"}
        body = json.dumps({**base, field: "@"}).replace('"@"', _deep(depth).decode())
        try:
            parse_request(body.encode())
        except ProtocolError as exc:
            assert exc.code in ("malformed", "unsupported_version", "unknown_op")


@FUZZ
@given(
    st.sampled_from(OPS),
    st.none() | st.integers(min_value=-(2**63), max_value=2**63),
    st.none() | st.text(min_size=1, max_size=20),
    st.none() | st.integers(min_value=1, max_value=MAX_STREAM_WINDOW),
    st.none() | st.floats(min_value=0, max_value=1e12),
)
def test_encode_request_then_parse_request_round_trips(
    op: str, req: int | None, client_id: str | None, window: int | None, expiry: float | None
) -> None:
    fields: dict[str, Any] = {"client_id": client_id, "window": window, "session_expiry": expiry}
    if op in ("interest", "stream_subscribe", "stream_unsubscribe"):
        fields["filter"] = "a/+"
    if op == "stream_ack":
        fields.update(topic="a/b", id=7)
    request = parse_request(encode_request(op, req, **fields))
    assert (request.op, request.req, request.client_id, request.window) == (op, req, client_id, window)
    assert request.session_expiry == expiry


# ------------------------------------------------------------ replies, markers, frames
@FUZZ
@given(st.binary(max_size=120) | requests.map(_json) | json_values.map(_json))
@example(b'{"ok": true, "error": 1}')
@example(_deep(100_000))
def test_decode_reply_of_anything_returns_or_raises_protocol_error(payload: bytes) -> None:
    try:
        decode_reply(payload)
    except ProtocolError as exc:
        assert exc.code == "malformed"


@FUZZ
@given(st.none() | st.sampled_from(OPS), st.none() | st.integers(), json_values)
def test_encode_reply_then_decode_reply_round_trips(op: str | None, req: int | None, value: Any) -> None:
    reply = decode_reply(encode_reply(op, req, value=value))
    assert (reply.op, reply.req, reply.ok) == (op, req, True)
    assert json.dumps(reply.fields) == json.dumps({"value": value})


@FUZZ
@given(
    st.binary(max_size=120)
    | json_values.map(_json)
    | st.fixed_dictionaries(
        {"epoch": json_scalars, "replayed": json_scalars, "first_seq": json_scalars, "last_seq": json_scalars},
        optional={"live": st.lists(st.dictionaries(st.sampled_from(["filter", "qos", "durable"]), json_scalars))},
    ).map(_json)
)
@example(b'{"epoch": Infinity, "replayed": 0, "first_seq": null, "last_seq": null, "live": []}')
@example(b'{"epoch": 1, "replayed": NaN, "first_seq": null, "last_seq": null, "live": []}')
@example(b'{"epoch": 1, "replayed": 0, "first_seq": 0, "last_seq": 0, "live": [{"filter": "a", "qos": -Infinity}]}')
@example(_deep(100_000))
def test_decode_marker_of_anything_returns_or_raises_protocol_error(payload: bytes) -> None:
    try:
        decode_marker(payload)
    except ProtocolError as exc:
        assert exc.code == "malformed"


@FUZZ
@given(
    U64,
    U64,
    st.none() | U64,
    st.none() | U64,
    st.lists(st.builds(LiveSubscription, st.text(max_size=10), st.integers(0, 2), st.booleans()), max_size=3),
)
def test_encode_marker_then_decode_marker_round_trips(
    epoch: int, replayed: int, first: int | None, last: int | None, live: list[LiveSubscription]
) -> None:
    marker = Marker(epoch, replayed, first, last, tuple(live))
    assert decode_marker(encode_marker(marker)) == marker


@FUZZ
@given(st.binary(max_size=60))
def test_decode_frame_of_any_bytes_returns_or_raises_protocol_error(data: bytes) -> None:
    try:
        frame, payload = decode_frame(data)
    except ProtocolError as exc:
        assert exc.code in ("malformed", "unsupported_version")
        return
    assert len(payload) == len(data) - 26 and frame.qos in (0, 1, 2, 3)


@FUZZ
@given(st.integers(0, 255), U64, U64, st.floats(allow_nan=False), st.binary(max_size=40))
def test_encode_frame_then_decode_frame_round_trips(
    flags: int, epoch: int, seq: int, at: float, payload: bytes
) -> None:
    frame, rest = decode_frame(encode_event_frame(flags, epoch, seq, at) + payload)
    assert (frame.flags, frame.epoch, frame.seq, frame.published_at, rest) == (flags, epoch, seq, at, payload)


# --------------------------------------------------------------------- replication
ops_strategy = st.lists(st.tuples(st.binary(max_size=20), st.none() | st.binary(max_size=30)), max_size=6)


@FUZZ
@given(U64, U64, ops_strategy)
def test_encode_batch_then_decode_batch_round_trips(seq: int, store_id: int, ops: list[Any]) -> None:
    data, crc = encode_batch(seq, store_id, ops)
    batch = decode_batch(data)
    assert (batch.seq, batch.store_id, list(batch.ops), batch.crc) == (seq, store_id, ops, crc)
    assert decode_ops(encode_ops(ops)) == (ops, len(encode_ops(ops)))


def _with_crc(body: bytes) -> bytes:
    return body + struct.pack(">I", zlib.crc32(body))


@FUZZ
@given(st.binary(max_size=120) | st.binary(min_size=20, max_size=120).map(_with_crc))
@example(_with_crc(bytes(16) + struct.pack(">I", 2**32 - 1)))  # a count of 4 billion operations, none there
@example(_with_crc(bytes(16) + struct.pack(">IIB", 1, 2**32 - 1, 0)))  # a key longer than the batch
def test_decode_batch_of_any_bytes_returns_or_raises_frame_error(data: bytes) -> None:
    with contextlib.suppress(FrameError):
        check_batch(data)
        decode_batch(data)


@FUZZ
@given(st.binary(max_size=80))
def test_decode_ops_of_any_bytes_returns_or_raises_frame_error(data: bytes) -> None:
    try:
        ops, end = decode_ops(data)
    except FrameError:
        return
    assert end <= len(data) and all(isinstance(key, bytes) for key, _ in ops)


@FUZZ
@given(st.binary(max_size=80))
@example(bytes(22) + b"\x00" + bytes(7))  # a NUL with a short instance after it
def test_hello_decode_of_any_bytes_returns_or_raises_frame_error(payload: bytes) -> None:
    with contextlib.suppress(FrameError):
        Hello.decode(payload)


@FUZZ
@given(
    store_id=U64,
    seq=U64,
    crc=U32,
    name=st.text(min_size=1, max_size=20),
    instance=U64,
    version=st.integers(0, 2**16 - 1),
)
def test_hello_encode_then_decode_round_trips(
    *, store_id: int, seq: int, crc: int, name: str, instance: int, version: int
) -> None:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: no backup has such a name (replication.name is YAML text)
        return
    assume(name_problem(name) is None)  # a backup sends only a name its config check let through
    hello = Hello(store_id, seq, crc, name, version, instance)
    assert Hello.decode(hello.encode()) == hello


@FUZZ
@given(st.binary(max_size=20), U64, U32)
def test_position_and_seq_decode_any_bytes_and_round_trip(data: bytes, seq: int, crc: int) -> None:
    assert decode_position(encode_position(seq, crc)) == (seq, crc)
    assert decode_seq(encode_seq(seq)) == seq
    for decode in (decode_position, decode_seq):
        with contextlib.suppress(FrameError):
            decode(data)


async def _read_frames(data: bytes, limit: int) -> int:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    for count in range(len(data) + 1):  # every frame is at least 9 bytes: bounded
        try:
            await read_frame(reader, limit)
        except asyncio.IncompleteReadError:
            return count
    raise AssertionError("read_frame read more frames than the bytes can hold")


@FUZZ
@given(
    st.binary(max_size=100)
    | st.lists(st.tuples(st.sampled_from(list(Frame)), st.binary(max_size=20)), max_size=4).map(
        lambda frames: b"".join(encode_frame(kind, payload) for kind, payload in frames)
    ),
    st.integers(0, 3),
)
@example(encode_frame(99, b"x"), 0)  # an unknown type with a good checksum
@example(struct.pack(">BI", 1, MAX_PEER_FRAME + 1), 0)  # a length past the limit, nothing after it
def test_read_frame_of_any_bytes_reads_frames_or_raises_frame_error(data: bytes, cut: int) -> None:
    data = data[: len(data) - cut] if cut else data
    with contextlib.suppress(FrameError):
        asyncio.run(_read_frames(data, MAX_PEER_FRAME))


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(list(Frame)), st.binary(max_size=50)), max_size=5))
def test_encode_frame_then_read_frame_round_trips(frames: list[tuple[Frame, bytes]]) -> None:
    async def read_all() -> list[tuple[Frame, bytes]]:
        reader = asyncio.StreamReader()
        reader.feed_data(b"".join(encode_frame(kind, payload) for kind, payload in frames))
        reader.feed_eof()
        return [await read_frame(reader) for _ in frames]

    assert asyncio.run(read_all()) == frames


# ----------------------------------------------------------------------------- store
@FUZZ
@given(st.binary(max_size=60))
def test_store_records_of_any_bytes_decode_or_raise_their_documented_errors(raw: bytes) -> None:
    for decode in (Body.decode, lambda r: Entry.decode(1, r), decode_totals):
        with contextlib.suppress(struct.error, ValueError):  # what store.decoded turns into DamagedRecordError
            decode(raw)


@FUZZ
@given(st.binary(max_size=80) | json_values.map(_json) | requests.map(_json))
@example(b'{"sid": Infinity}')
@example(b'{"sid": 1, "created_at": 1e400}')
@example(b'{"sid": 1, "created_at": ' + str(10**400).encode() + b"}")
@example(b'{"sid": 1, "subscriptions": {"a": -Infinity}}')
@example(_deep(100_000))
def test_session_record_of_any_bytes_decodes_or_raises_its_documented_errors(raw: bytes) -> None:
    with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):  # what iter_sessions and repair catch
        SessionRecord.decode("c", raw)


@FUZZ
@given(
    topic=st.text(max_size=20),
    payload=st.binary(max_size=30),
    qos=st.integers(0, 2),
    at=st.floats(allow_nan=False),
    depth=U64,
    size=U64,
    dropped=U64,
)
def test_store_records_round_trip(
    *, topic: str, payload: bytes, qos: int, at: float, depth: int, size: int, dropped: int
) -> None:
    try:
        topic.encode("utf-8")
    except UnicodeEncodeError:  # MQTT topics are well-formed UTF-8: the broker never stores a lone surrogate
        return
    assert Body.decode(Body(topic, payload, qos, at).encode()) == Body(topic, payload, qos, at)
    assert decode_totals(encode_totals(depth, size, dropped)) == (depth, size, dropped)
    record = SessionRecord("c", depth, {topic or "t": qos}, at, username=topic)
    assert SessionRecord.decode("c", record.encode()) == record


# ------------------------------------------------------------------------ MQTT framing
@FUZZ
@given(st.binary(max_size=200), st.lists(st.integers(1, 40), max_size=10))
@example(b"\x30\xff\xff\xff\xff\x01", [])  # a remaining length of five bytes
def test_packet_reader_of_any_bytes_in_any_cuts_matches_split_packets(data: bytes, cuts: list[int]) -> None:
    reader = PacketReader(max_size=1_000)
    got: list[tuple[int, bytes]] = []
    error: type[Exception] | None = None
    pos = 0
    try:
        for size in [*cuts, len(data)]:  # bounded: one feed a cut, then the rest
            got.extend(reader.feed(data[pos : pos + size]))
            pos += size
    except (PacketTooLargeError, ProtocolViolationError) as exc:
        error = type(exc)
    try:
        packets, _used = split_packets(data)
    except ProtocolViolationError:
        assert error is not None
        return
    whole = [(data[first_at], data[start:end]) for first_at, start, end in _starts(packets)]
    if error is None:
        assert got == whole
    else:
        assert got == whole[: len(got)]


def _starts(packets: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """split_packets' (first byte, start, end) as (offset of the first byte, start, end)."""
    out = []
    at = 0
    for _first, start, end in packets:
        out.append((at, start, end))
        at = end
    return out


@FUZZ
@given(st.lists(st.tuples(st.integers(0, 255), st.binary(max_size=300)), max_size=5), st.integers(1, 64))
def test_encode_packet_then_packet_reader_round_trips(packets: list[tuple[int, bytes]], chunk: int) -> None:
    data = b"".join(encode_packet(first, body) for first, body in packets)
    reader = PacketReader()
    got: list[tuple[int, bytes]] = []
    for at in range(0, len(data), chunk):
        got.extend(reader.feed(data[at : at + chunk]))
    assert got == packets and reader.pending == 0
