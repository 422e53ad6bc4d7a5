"""durable_client.protocol: frames, requests, replies and markers, both directions."""

from __future__ import annotations

import json
import math

import pytest

import durable_client.protocol as sdk_protocol
import durable_protocol
from durable_client.protocol import (
    FLAG_REDELIVERED,
    FLAG_REPLAYED,
    FLAG_RETAINED,
    FRAME,
    MAX_REQUEST_BYTES,
    LiveSubscription,
    Marker,
    ProtocolError,
    decode_frame,
    decode_marker,
    decode_reply,
    encode_error,
    encode_frame,
    encode_marker,
    encode_reply,
    encode_request,
    parse_request,
    request_ids,
)


# ------------------------------------------------------------------- frames
@pytest.mark.parametrize("payload", [b"", b"x", bytes(range(256)) * 4])
def test_frame_round_trip_keeps_the_payload_byte_for_byte(payload: bytes) -> None:
    data = encode_frame(FLAG_REPLAYED | FLAG_REDELIVERED, 12, 2**64 - 1, 1_700_000_000.25) + payload
    frame, rest = decode_frame(data)
    assert rest == payload
    assert (frame.epoch, frame.seq, frame.published_at) == (12, 2**64 - 1, 1_700_000_000.25)
    assert frame.replayed and frame.redelivered and not frame.retained


def test_frame_flags_are_independent() -> None:
    for flags in range(8):
        frame, _ = decode_frame(encode_frame(flags, 1, 1, 0.0))
        assert frame.replayed == bool(flags & FLAG_REPLAYED)
        assert frame.retained == bool(flags & FLAG_RETAINED)
        assert frame.redelivered == bool(flags & FLAG_REDELIVERED)


def test_frame_is_26_bytes_big_endian() -> None:
    data = encode_frame(FLAG_RETAINED, 1, 2, 0.0)
    assert FRAME.size == len(data) == 26
    assert data[:2] == b"\x01\x02"
    assert data[2:10] == (1).to_bytes(8, "big")
    assert data[10:18] == (2).to_bytes(8, "big")


def test_short_frame_is_malformed() -> None:
    with pytest.raises(ProtocolError) as info:
        decode_frame(b"\x01" * 25)
    assert info.value.code == "malformed"


def test_frame_of_another_version_is_refused() -> None:
    data = bytearray(encode_frame(0, 1, 1, 0.0))
    data[0] = 2
    with pytest.raises(ProtocolError) as info:
        decode_frame(bytes(data))
    assert info.value.code == "unsupported_version"


# ----------------------------------------------------------------- requests
def test_request_round_trip_with_every_field() -> None:
    payload = encode_request(
        "stream_subscribe", 7, client_id="c1", filter="s/#", after={"s/a": 3}, window=10, session_expiry=None
    )
    assert b"session_expiry" not in payload  # None fields are left out
    request = parse_request(payload)
    assert (request.op, request.req, request.client_id, request.filter) == ("stream_subscribe", 7, "c1", "s/#")
    assert request.after == {"s/a": 3} and request.window == 10


def test_hello_and_ack_requests_parse() -> None:
    hello = parse_request(encode_request("hello", 1, session_expiry=3600))
    assert hello.session_expiry == 3600.0
    ack = parse_request(encode_request("stream_ack", None, topic="s/a", id=5))
    assert (ack.req, ack.topic, ack.id) == (None, "s/a", 5)
    interest = parse_request(encode_request("interest", 2, filter="a/#", durable=False))
    assert interest.durable is False


def _body(**fields: object) -> bytes:
    return json.dumps({"v": 1, "op": "hello", **fields}).encode()


@pytest.mark.parametrize(
    ("payload", "code"),
    [
        (b"not json", "malformed"),
        (b"\xff\xfe", "malformed"),
        (b"[1, 2]", "malformed"),
        (b"x" * (MAX_REQUEST_BYTES + 1), "malformed"),
        (_body(req="7"), "malformed"),
        (_body(req=True), "malformed"),
        (json.dumps({"op": "hello"}).encode(), "unsupported_version"),
        (json.dumps({"v": 2, "op": "hello"}).encode(), "unsupported_version"),
        (json.dumps({"v": True, "op": "hello"}).encode(), "unsupported_version"),  # not the integer 1
        (json.dumps({"v": 1.0, "op": "hello"}).encode(), "unsupported_version"),
        (json.dumps({"v": 1}).encode(), "unknown_op"),
        (json.dumps({"v": 1, "op": "explode"}).encode(), "unknown_op"),
        (json.dumps({"v": 1, "op": "interest"}).encode(), "malformed"),
        (json.dumps({"v": 1, "op": "stream_ack", "topic": "a"}).encode(), "malformed"),
        (_body(client_id=5), "malformed"),
        (_body(client_id=""), "malformed"),
        (_body(session_expiry=-1), "malformed"),
        (_body(session_expiry=True), "malformed"),
        (_body(session_expiry="10"), "malformed"),
        (_body(filter=3), "malformed"),
        (_body(durable="no"), "malformed"),
        (_body(after=[]), "malformed"),
        (_body(after={"a": -1}), "malformed"),
        (_body(after={"a": True}), "malformed"),
        (_body(after={"": 1}), "malformed"),
        (_body(window=0), "malformed"),
        (_body(window=1001), "malformed"),
        (_body(window=2.5), "malformed"),
        (_body(topic=""), "malformed"),
        (_body(id=0), "malformed"),
        (_body(id="1"), "malformed"),
    ],
)
def test_parse_request_refuses_each_malformed_case(payload: bytes, code: str) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_request(payload)
    assert info.value.code == code


_REQUIRED_VALUES: dict[str, dict[str, object]] = {
    "interest": {"filter": "a/#"},
    "stream_subscribe": {"filter": "a/#"},
    "stream_unsubscribe": {"filter": "a/#"},
    "stream_ack": {"topic": "a/b", "id": 1},
}
_FIELDS = ("req", "client_id", "session_expiry", "filter", "durable", "after", "window", "topic", "id")


@pytest.mark.parametrize("op", durable_protocol.OPS)
def test_an_optional_field_given_as_null_counts_as_absent(op: str) -> None:
    """protocol.md: "A field given as JSON `null` counts as absent: an optional one takes its default", for
    every op and field."""
    required = _REQUIRED_VALUES.get(op, {})
    absent = parse_request(json.dumps({"v": 1, "op": op, **required}).encode())
    for name in _FIELDS:
        if name not in required:
            with_null = parse_request(json.dumps({"v": 1, "op": op, **required, name: None}).encode())
            assert with_null == absent, name


@pytest.mark.parametrize(("op", "name"), [(op, name) for op, fields in _REQUIRED_VALUES.items() for name in fields])
def test_a_required_field_given_as_null_is_missing(op: str, name: str) -> None:
    body = {"v": 1, "op": op, **_REQUIRED_VALUES[op], name: None}
    with pytest.raises(ProtocolError) as info:
        parse_request(json.dumps(body).encode())
    assert (info.value.code, info.value.message) == ("malformed", f"{op} needs '{name}'")


def test_infinite_expiry_is_malformed() -> None:
    # json.dumps writes Infinity, which json.loads accepts: the check must catch it.
    with pytest.raises(ProtocolError) as info:
        parse_request(_body(session_expiry=math.inf))
    assert info.value.code == "malformed"


def test_error_keeps_the_req_it_could_read() -> None:
    with pytest.raises(ProtocolError) as info:
        parse_request(json.dumps({"v": 1, "op": "nope", "req": 9}).encode())
    assert info.value.req == 9


@pytest.mark.parametrize(
    ("payload", "ids"),
    [
        (json.dumps({"v": 1, "op": "ready", "req": 4}).encode(), ("ready", 4)),
        (json.dumps({"op": "nope", "req": 5}).encode(), (None, 5)),
        (json.dumps({"op": "ready", "req": "6"}).encode(), (None, None)),
        (b"[1]", (None, None)),
        (b"x" * (MAX_REQUEST_BYTES + 1), (None, None)),
    ],
)
def test_request_ids_reads_what_an_error_reply_can_echo(payload: bytes, ids: tuple[str | None, int | None]) -> None:
    """For a request refused before it is parsed (another topic under _durable/): op and req as
    parse_request would echo them."""
    assert request_ids(payload) == ids


# ------------------------------------------------------------------ replies
def test_reply_round_trip() -> None:
    reply = decode_reply(encode_reply("hello", 7, protocol=1, epoch=12, session_expiry=3600.0))
    assert (reply.op, reply.req, reply.ok) == ("hello", 7, True)
    assert reply.fields == {"protocol": 1, "epoch": 12, "session_expiry": 3600.0}
    assert reply.error_code is None


def test_error_reply_round_trip() -> None:
    reply = decode_reply(encode_error("ready", 8, ProtocolError("no_session", "needs a durable session")))
    assert (reply.op, reply.req, reply.ok) == ("ready", 8, False)
    assert (reply.error_code, reply.error_message) == ("no_session", "needs a durable session")


@pytest.mark.parametrize("payload", [b"nope", b"[]", b"{}", b'{"ok": true, "error": 5}'])
def test_malformed_reply_is_a_protocol_error(payload: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_reply(payload)


# ------------------------------------------------------------------- marker
def test_marker_round_trip() -> None:
    marker = Marker(12, 3, 41, 43, (LiveSubscription("sensors/#", 1, True), LiveSubscription("a", 0, False)))
    assert decode_marker(encode_marker(marker)) == marker


def test_marker_of_a_new_session_has_no_seqs() -> None:
    marker = Marker(1, 0, None, None, ())
    assert decode_marker(encode_marker(marker)) == marker


@pytest.mark.parametrize("payload", [b"nope", b"{}", b'{"epoch": 1, "replayed": 0, "first_seq": null}'])
def test_malformed_marker_is_a_protocol_error(payload: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_marker(payload)


def test_the_sdk_module_is_the_shared_protocol_under_another_name() -> None:
    """The SDK and the plugin must never disagree on a byte: one set of objects, no copy."""
    assert sdk_protocol.__all__ == durable_protocol.__all__
    assert all(getattr(sdk_protocol, name) is getattr(durable_protocol, name) for name in durable_protocol.__all__)


@pytest.mark.parametrize("encoding", ["utf-16", "utf-32", "utf-16-le"])
def test_a_request_in_another_encoding_than_utf8_is_malformed(encoding: str) -> None:
    """protocol.md: a request is a JSON object in UTF-8; json.loads(bytes) would read UTF-16 and
    UTF-32 too (review 65)."""
    payload = encode_request("hello", 7).decode("utf-8").encode(encoding)
    with pytest.raises(ProtocolError, match="not UTF-8 JSON") as refused:
        parse_request(payload)
    assert refused.value.code == "malformed"
    assert request_ids(payload) == (None, None)


@pytest.mark.parametrize(
    ("payload", "kind"),
    [
        (b"null", "a JSON null"),
        (b"true", "a boolean"),
        (b"5", "a number"),
        (b"1.5", "a number"),
        (b'"x"', "a string"),
        (b"[1]", "an array"),
    ],
)
def test_a_request_that_is_not_a_json_object_is_refused_naming_what_it_is_in_jsons_words(
    payload: bytes, kind: str
) -> None:
    """Review 325: the refusal says what the request is in JSON's words, not in Python's type names
    ('a NoneType', 'a list')."""
    with pytest.raises(ProtocolError) as refused:
        parse_request(payload)
    assert (refused.value.code, refused.value.message) == ("malformed", f"request is not a JSON object but {kind}")
