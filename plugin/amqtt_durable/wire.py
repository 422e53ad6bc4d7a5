"""MQTT 3.1.1 encodings the plugin writes itself (PUBLISH, PUBACK, PUBREL, PUBCOMP), batched per write."""

from __future__ import annotations

import struct

_U16 = struct.Struct(">H")
PUBACK_FIXED = 0x40
PUBREL_FIXED = 0x62
PUBCOMP_FIXED = 0x70


def remaining_length(length: int) -> bytes:
    """MQTT's variable byte integer: 7 bits a byte, low bits first, the high bit set when more follow.

    The one encoder of it in the project: the benchmarks' and the tests' raw clients use it too.
    """
    out = bytearray()
    while True:
        byte = length % 128
        length //= 128
        if length:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def encode_string(text: str | bytes) -> bytes:
    """An MQTT UTF-8 string (or binary data) field: its length in two bytes, then the bytes."""
    raw = text.encode() if isinstance(text, str) else text
    return _U16.pack(len(raw)) + raw


def encode_packet(first: int, body: bytes) -> bytes:
    """A whole packet: the first byte (type and flags), the remaining length, the body."""
    return bytes((first,)) + remaining_length(len(body)) + body


def encode_publish(topic: bytes, payload: bytes, qos: int, packet_id: int, *, dup: bool, retain: bool) -> bytes:
    """One PUBLISH packet; ``packet_id`` is ignored for QoS 0 (which never has one)."""
    first = 0x30 | (qos << 1) | (0x08 if dup and qos else 0) | (0x01 if retain else 0)
    variable = _U16.pack(len(topic)) + topic
    if qos:
        variable += _U16.pack(packet_id)
    return bytes((first,)) + remaining_length(len(variable) + len(payload)) + variable + payload


def encode_puback(packet_id: int) -> bytes:
    return bytes((PUBACK_FIXED, 2)) + _U16.pack(packet_id)


def encode_pubrel(packet_id: int) -> bytes:
    return bytes((PUBREL_FIXED, 2)) + _U16.pack(packet_id)


def encode_pubcomp(packet_id: int) -> bytes:
    return bytes((PUBCOMP_FIXED, 2)) + _U16.pack(packet_id)


def packet_id_for(seq: int) -> int:
    """Packet id derived from the queue sequence, so a re-send after a crash reuses the same id.

    The pump never has more than ``recovery_buffer`` (<= 65535) consecutive sequences in
    flight, so two in-flight entries never share an id.
    """
    return seq % 65535 + 1
