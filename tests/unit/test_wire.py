"""PUBLISH/PUBREL encodings, decoded by hand and by amqtt's own decoder; packet ids from seqs."""

from __future__ import annotations

import asyncio
import struct
from dataclasses import dataclass
from typing import Any

import pytest
from amqtt.mqtt.publish import PublishPacket
from amqtt.mqtt.pubrel import PubrelPacket

from amqtt_durable.errors import PacketTooLargeError, ProtocolViolationError
from amqtt_durable.wire import (
    PUBREL_FIXED,
    decode_remaining_length,
    encode_connect,
    encode_packet,
    encode_puback,
    encode_publish,
    encode_pubrel,
    encode_subscribe,
    packet_id_for,
    publish_packet_id,
    read_packet,
    remaining_length,
    split_packets,
)


@dataclass
class Decoded:
    packet_type: int
    dup: bool
    qos: int
    retain: bool
    remaining_length: int
    length_bytes: int
    topic: bytes
    packet_id: int | None
    payload: bytes


def decode_varint(data: bytes, offset: int) -> tuple[int, int]:
    """MQTT remaining length starting at ``offset``: (value, bytes used). Written here from the spec,
    apart from the codec's decoder, so the encoders are not checked against the code they pair with."""
    value, multiplier, used = 0, 1, 0
    while True:
        byte = data[offset + used]
        used += 1
        value += (byte & 0x7F) * multiplier
        if not byte & 0x80:
            return value, used
        multiplier *= 128
        assert used < 4, "remaining length longer than 4 bytes"


def decode_publish(data: bytes) -> Decoded:
    first = data[0]
    remaining, used = decode_varint(data, 1)
    body = data[1 + used :]
    assert len(body) == remaining, "remaining length must cover exactly the rest of the packet"
    qos = (first >> 1) & 0x03
    (topic_len,) = struct.unpack_from(">H", body, 0)
    topic = body[2 : 2 + topic_len]
    pos = 2 + topic_len
    packet_id = None
    if qos:
        (packet_id,) = struct.unpack_from(">H", body, pos)
        pos += 2
    return Decoded(
        packet_type=first >> 4,
        dup=bool(first & 0x08),
        qos=qos,
        retain=bool(first & 0x01),
        remaining_length=remaining,
        length_bytes=used,
        topic=topic,
        packet_id=packet_id,
        payload=body[pos:],
    )


def amqtt_decode(cls: Any, data: bytes) -> Any:
    async def run() -> Any:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        packet = await cls.from_stream(reader)
        assert await reader.read() == b"", "amqtt's decoder must consume exactly the packet"
        return packet

    return asyncio.run(run())


@pytest.mark.parametrize(
    ("length", "encoded"),
    [
        (0, b"\x00"),
        (1, b"\x01"),
        (127, b"\x7f"),
        (128, b"\x80\x01"),
        (321, b"\xc1\x02"),
        (16383, b"\xff\x7f"),
        (16384, b"\x80\x80\x01"),
        (2_097_151, b"\xff\xff\x7f"),
        (2_097_152, b"\x80\x80\x80\x01"),
        (268_435_455, b"\xff\xff\xff\x7f"),
    ],
)
def test_remaining_length_spec_table(length: int, encoded: bytes) -> None:
    assert remaining_length(length) == encoded
    assert decode_varint(encoded, 0) == (length, len(encoded))


@pytest.mark.parametrize("qos", [0, 1, 2])
@pytest.mark.parametrize("dup", [False, True])
@pytest.mark.parametrize("retain", [False, True])
def test_publish_fixed_header_flags(qos: int, dup: bool, retain: bool) -> None:
    raw = encode_publish(b"a/b", b"hello", qos, 4242, dup=dup, retain=retain)
    decoded = decode_publish(raw)
    assert decoded.packet_type == 3
    assert decoded.qos == qos
    assert decoded.retain is retain
    assert decoded.dup is (dup and qos > 0), "DUP must be 0 for QoS 0 (MQTT-3.3.1-2)"
    assert decoded.topic == b"a/b"
    assert decoded.payload == b"hello"
    assert decoded.packet_id == (4242 if qos else None)
    expected_first = 0x30 | (qos << 1) | (0x08 if dup and qos else 0) | (0x01 if retain else 0)
    assert raw[0] == expected_first


def test_qos0_has_no_packet_id() -> None:
    raw = encode_publish(b"t", b"p", 0, 777, dup=False, retain=False)
    assert raw == b"\x30\x04\x00\x01tp"


def test_qos1_exact_bytes() -> None:
    raw = encode_publish(b"t", b"p", 1, 0x0102, dup=False, retain=False)
    assert raw == b"\x32\x06\x00\x01t\x01\x02p"


@pytest.mark.parametrize(
    ("remaining", "length_bytes"),
    [(127, 1), (128, 2), (16383, 2), (16384, 3), (2_097_151, 3), (2_097_152, 4)],
)
@pytest.mark.parametrize("qos", [0, 1])
def test_publish_multi_byte_remaining_length(remaining: int, length_bytes: int, qos: int) -> None:
    topic = b"sensors/temp"
    overhead = 2 + len(topic) + (2 if qos else 0)
    payload = bytes(range(256)) * ((remaining - overhead) // 256 + 1)
    payload = payload[: remaining - overhead]
    raw = encode_publish(topic, payload, qos, 65535, dup=False, retain=False)
    decoded = decode_publish(raw)
    assert decoded.remaining_length == remaining
    assert decoded.length_bytes == length_bytes
    assert len(raw) == 1 + length_bytes + remaining
    assert decoded.topic == topic
    assert decoded.payload == payload
    assert decoded.packet_id == (65535 if qos else None)


def test_utf8_topic_length_counts_bytes() -> None:
    topic = "capteurs/température/°C".encode()
    raw = encode_publish(topic, b"", 1, 1, dup=False, retain=False)
    decoded = decode_publish(raw)
    assert decoded.topic.decode("utf-8") == "capteurs/température/°C"
    assert decoded.payload == b""
    assert decoded.packet_id == 1


def test_empty_payload() -> None:
    raw = encode_publish(b"x", b"", 2, 9, dup=True, retain=True)
    assert raw == b"\x3d\x05\x00\x01x\x00\x09"


@pytest.mark.parametrize(
    ("qos", "dup", "retain", "size"),
    [(0, False, False, 10), (1, True, False, 200), (2, True, True, 20000), (1, False, True, 3_000_000)],
)
def test_amqtt_decodes_our_publish(qos: int, dup: bool, retain: bool, size: int) -> None:
    payload = (bytes(range(251)) * (size // 251 + 1))[:size]
    raw = encode_publish("a/ü/c".encode(), payload, qos, 513, dup=dup, retain=retain)
    packet = amqtt_decode(PublishPacket, raw)
    assert packet.topic_name == "a/ü/c"
    assert packet.qos == qos
    assert packet.dup_flag is (dup and qos > 0)
    assert packet.retain_flag is retain
    assert packet.data == payload
    assert packet.packet_id == (513 if qos else None)


def test_pubrel_encoding() -> None:
    raw = encode_pubrel(0xBEEF)
    assert raw == b"\x62\x02\xbe\xef"
    assert raw[0] == PUBREL_FIXED
    assert raw[0] >> 4 == 6 and raw[0] & 0x0F == 0b0010, "PUBREL flags must be 0010 (MQTT-3.6.1-1)"
    packet = amqtt_decode(PubrelPacket, raw)
    assert packet.packet_id == 0xBEEF


@pytest.mark.parametrize("packet_id", [1, 255, 256, 65535])
def test_pubrel_packet_ids(packet_id: int) -> None:
    assert struct.unpack(">H", encode_pubrel(packet_id)[2:])[0] == packet_id


@pytest.mark.parametrize("seq", [0, 1, 2, 65533, 65534, 65535, 65536, 131069, 131070, 2**32, 2**63 - 1, 2**64 - 1])
def test_packet_id_in_range_never_zero(seq: int) -> None:
    packet_id = packet_id_for(seq)
    assert 1 <= packet_id <= 65535


def test_packet_id_wraps_without_zero() -> None:
    assert packet_id_for(0) == 1
    assert packet_id_for(65534) == 65535
    assert packet_id_for(65535) == 1
    assert all(packet_id_for(seq) != 0 for seq in range(200_000))


def test_packet_id_is_deterministic_for_resend() -> None:
    assert packet_id_for(123_456) == packet_id_for(123_456)


@pytest.mark.parametrize("start", [0, 1, 65534, 65535, 100_000, 2**40 + 7])
def test_any_65535_consecutive_seqs_have_distinct_ids(start: int) -> None:
    ids = {packet_id_for(seq) for seq in range(start, start + 65535)}
    assert len(ids) == 65535
    assert ids == set(range(1, 65536))


@pytest.mark.parametrize("length", [0, 1, 127, 128, 16_383, 16_384, 2_097_151, 2_097_152, 268_435_455])
def test_remaining_length_decodes_what_it_encodes_at_every_width(length: int) -> None:
    field = b"\x30" + remaining_length(length)
    assert decode_remaining_length(field, 1) == (length, len(field))
    assert decode_remaining_length(field[:-1], 1) is None, "a field cut short is incomplete, not wrong"


def test_remaining_length_past_four_bytes_is_a_protocol_violation() -> None:
    with pytest.raises(ProtocolViolationError, match="longer than 4 bytes"):
        decode_remaining_length(b"\x30\xff\xff\xff\xff\x01", 1)


def test_split_packets_leaves_a_cut_packet_for_the_next_read() -> None:
    stream = encode_puback(7) + encode_publish(b"a/b", b"x" * 200, 1, 9, dup=False, retain=False)
    packets, used = split_packets(stream[:-1])
    assert [(first, bytes(stream[start:end])) for first, start, end in packets] == [(0x40, b"\x00\x07")]
    assert used == 4
    packets, used = split_packets(stream)
    assert used == len(stream)
    first, start, end = packets[1]
    assert first == 0x32 and publish_packet_id(first, stream[start:end]) == 9


def test_read_packet_bounds_size_and_idle_time() -> None:
    async def main() -> None:
        stream = asyncio.StreamReader()
        stream.feed_data(encode_subscribe(3, "t/#") + b"\x30\x80")  # a SUBSCRIBE, then half a header
        assert await read_packet(stream) == (0x82, b"\x00\x03\x00\x03t/#\x01")
        assert await read_packet(stream, idle=0.05) is None, "bytes missing past the idle bound"
        big = asyncio.StreamReader()
        big.feed_data(b"\x30" + remaining_length(5000))
        with pytest.raises(PacketTooLargeError):
            await read_packet(big, max_size=4096)

    asyncio.run(main())


def test_connect_sends_a_password_only_with_a_username() -> None:
    anonymous = encode_connect("dev", password="ignored", clean=False, keepalive=30)
    assert anonymous == encode_packet(0x10, b"\x00\x04MQTT\x04\x00\x00\x1e\x00\x03dev")
    named = encode_connect("dev", username="u", password="p")
    assert named[9] == 0x02 | 0x80 | 0x40
    assert named.endswith(b"\x00\x01u\x00\x01p")
