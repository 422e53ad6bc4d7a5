"""The project's one MQTT 3.1.1 codec: the framing and the packets the plugin, the fleet proxy,
the benchmarks' raw clients and the tests write and read themselves.

The broker's own hot paths use it (the pump's PUBLISHes, FastReader's framing), so encoders
build each packet in one go and decoders work on buffers by position, without copies.
"""

from __future__ import annotations

import asyncio
import struct

from durable_protocol import remaining_length

from .errors import PacketTooLargeError, ProtocolViolationError

_U16 = struct.Struct(">H")
PUBACK_FIXED = 0x40
PUBREC_FIXED = 0x50
PUBREL_FIXED = 0x62
PUBCOMP_FIXED = 0x70




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


TOPIC_HEADS_KEPT = 4096


def publish_fixed_header(length: int, qos: int, *, dup: bool, retain: bool) -> bytes:
    """A PUBLISH's fixed header for a topic field and payload of ``length`` bytes (the packet id a
    QoS 1 or 2 packet has is counted here); the one- and two-byte lengths of most packets inline."""
    first = 0x30 | (0x01 if retain else 0)
    if qos:
        first |= (qos << 1) | (0x08 if dup else 0)
        length += 2
    if length < 0x80:
        return bytes((first, length))
    if length < 0x4000:
        return bytes((first, (length & 0x7F) | 0x80, length >> 7))
    return bytes((first,)) + remaining_length(length)


class PublishRun:
    """The PUBLISH packets of one run (a window's worth), built into one buffer for one write.

    Each topic's encoded field (length + UTF-8) is made once and kept (up to TOPIC_HEADS_KEPT topics,
    then the cache starts over); a packet is its fixed header, that field, the packet id and the
    payload, appended as pieces and joined once by ``take``. The bytes equal ``encode_publish``'s.
    """

    __slots__ = ("_heads", "_pieces")

    def __init__(self) -> None:
        self._heads: dict[str, bytes] = {}
        self._pieces: list[bytes] = []

    def add(self, topic: str, payload: bytes, qos: int, packet_id: int, *, dup: bool, retain: bool) -> None:
        head = self._heads.get(topic)
        if head is None:
            if len(self._heads) >= TOPIC_HEADS_KEPT:
                self._heads.clear()
            raw = topic.encode("utf-8")
            head = self._heads[topic] = _U16.pack(len(raw)) + raw
        fixed = publish_fixed_header(len(head) + len(payload), qos, dup=dup, retain=retain)
        pieces = self._pieces
        pieces.append(fixed)
        pieces.append(head)
        if qos:
            pieces.append(_U16.pack(packet_id))
        pieces.append(payload)

    def add_stored(self, stored: bytes, at: int, qos: int, packet_id: int, *, dup: bool, retain: bool) -> None:
        """A PUBLISH whose topic field (as MQTT encodes it: length in two bytes, then the topic) and
        payload are ``stored[at:]``, as a stored message body holds them: the packet is its fixed
        header, a slice, the packet id and a slice, without decoding the topic. The bytes equal
        ``encode_publish``'s."""
        fixed = publish_fixed_header(len(stored) - at, qos, dup=dup, retain=retain)
        if qos:
            end = at + 2 + ((stored[at] << 8) | stored[at + 1])
            self._pieces += (fixed, stored[at:end], _U16.pack(packet_id), stored[end:])
        else:
            self._pieces += (fixed, stored[at:])

    def add_raw(self, packet: bytes) -> None:
        """A packet built elsewhere (a PUBREL), in its place in the run."""
        self._pieces.append(packet)

    def take(self) -> bytes:
        """The run's bytes; the run is empty again (the topic cache stays)."""
        data = b"".join(self._pieces)
        self._pieces.clear()
        return data


def encode_puback(packet_id: int) -> bytes:
    return bytes((PUBACK_FIXED, 2)) + _U16.pack(packet_id)


def encode_pubrec(packet_id: int) -> bytes:
    return bytes((PUBREC_FIXED, 2)) + _U16.pack(packet_id)


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


def encode_connect(
    client_id: str,
    *,
    username: str | None = None,
    password: str | None = None,
    clean: bool = True,
    keepalive: int = 0,
) -> bytes:
    """A CONNECT of MQTT 3.1.1 (a password is sent only with a username, as MQTT-3.1.2-22 wants)."""
    flags = 0x02 if clean else 0
    payload = encode_string(client_id)
    if username is not None:
        flags |= 0x80
        payload += encode_string(username)
        if password is not None:
            flags |= 0x40
            payload += encode_string(password)
    return encode_packet(0x10, encode_string("MQTT") + bytes((4, flags)) + _U16.pack(keepalive) + payload)


def encode_subscribe(packet_id: int, topic_filter: str, qos: int = 1) -> bytes:
    return encode_packet(0x82, _U16.pack(packet_id) + encode_string(topic_filter) + bytes((qos,)))


REMAINING_LENGTH_TOO_LONG = "remaining length longer than 4 bytes (MQTT-2.2.3)"


def decode_remaining_length(data: bytes | bytearray | memoryview, pos: int) -> tuple[int, int] | None:
    """The remaining length whose field starts at ``pos``, and the position after the field; None
    when ``data`` ends inside the field. ProtocolViolationError past its 4-byte limit."""
    length = shift = 0
    size = len(data)
    while pos < size:
        byte = data[pos]
        pos += 1
        length |= (byte & 0x7F) << shift
        if byte < 0x80:
            return length, pos
        shift += 7
        if shift > 21:
            raise ProtocolViolationError(REMAINING_LENGTH_TOO_LONG)
    return None


def split_packets(buf: bytes | bytearray) -> tuple[list[tuple[int, int, int]], int]:
    """The complete packets at the start of ``buf`` as (first byte, body start, body end), and the
    bytes they use; a packet cut off by the end of the buffer is left for the next call."""
    packets: list[tuple[int, int, int]] = []
    pos = 0
    size = len(buf)
    while size - pos >= 2:
        # decode_remaining_length, inlined: this loop runs per packet in the benchmarks' load
        # clients, whose ceiling bounds what the benchmarks can measure (Mosquitto's replay).
        start = pos + 1
        length = shift = 0
        while True:
            if start >= size:
                return packets, pos
            byte = buf[start]
            start += 1
            length |= (byte & 0x7F) << shift
            if byte < 0x80:
                break
            shift += 7
            if shift > 21:
                raise ProtocolViolationError(REMAINING_LENGTH_TOO_LONG)
        end = start + length
        if end > size:
            break
        packets.append((buf[pos], start, end))
        pos = end
    return packets, pos


class PacketReader:
    """Frames the bytes of one connection into packets, however the reads cut them.

    ``feed`` takes what one read of the socket returned and gives back every packet it completed, as
    (first byte, body); a packet cut off by the end of the read is kept for the next ``feed``. A
    remaining length over ``max_size`` raises PacketTooLargeError as soon as its field is complete
    (before the body arrives), one over 4 bytes ProtocolViolationError: the caller closes the
    connection. Whatever comes after the error is never looked at.
    """

    __slots__ = ("_have", "_max_size", "_need", "_parts")

    def __init__(self, max_size: int | None = None) -> None:
        self._parts: list[bytes] = []
        """The received bytes of packets not complete yet, as read (joined once complete)."""
        self._have = 0
        self._max_size = max_size
        self._need = 0
        """Bytes the buffered start of a packet needs before it is complete (0: not known yet)."""

    @property
    def pending(self) -> int:
        """Bytes received of packets not complete yet."""
        return self._have

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        if self._parts:
            self._parts.append(data)
            self._have += len(data)
            if self._have < self._need:  # the rest of a long packet is still coming
                return []
            buf = b"".join(self._parts)
        else:
            buf = data
        packets: list[tuple[int, bytes]] = []
        append = packets.append
        max_size = self._max_size
        pos = 0
        size = len(buf)
        need = 0
        while size - pos >= 2:
            length = buf[pos + 1]
            if length < 0x80:  # a one-byte remaining length (every ack): no loop
                start = pos + 2
            else:
                header = decode_remaining_length(buf, pos + 1)
                if header is None:  # the length field itself is cut off
                    break
                length, start = header
            if max_size is not None and length > max_size:
                raise PacketTooLargeError(length, max_size)
            end = start + length
            if end > size:
                need = end - pos
                break
            append((buf[pos], buf[start:end]))
            pos = end
        rest = buf if pos == 0 else buf[pos:]
        self._parts = [rest] if rest else []
        self._have = len(rest)
        self._need = need
        return packets


async def read_packet(
    stream: asyncio.StreamReader, *, max_size: int | None = None, idle: float | None = None
) -> tuple[int, bytes] | None:
    """One whole packet from ``stream`` as (first byte, body).

    ``max_size``: a larger remaining length raises PacketTooLargeError before a byte of the body is
    read. ``idle``: waiting for bytes not yet received is bounded by it (buffered ones are not);
    None is returned when it passed with bytes missing. EOF raises asyncio.IncompleteReadError.
    """

    async def read(count: int) -> bytes:
        if idle is None or len(stream._buffer) >= count:  # type: ignore[attr-defined]
            return await stream.readexactly(count)
        async with asyncio.timeout(idle):  # not wait_for, which can swallow a cancellation (see amqtt_glue._read_some)
            return await stream.readexactly(count)

    try:
        first = (await read(1))[0]
        length = shift = 0
        while True:
            byte = (await read(1))[0]
            length |= (byte & 0x7F) << shift
            if byte < 0x80:
                break
            shift += 7
            if shift > 21:
                raise ProtocolViolationError(REMAINING_LENGTH_TOO_LONG)
        if max_size is not None and length > max_size:
            raise PacketTooLargeError(length, max_size)
        return first, (await read(length) if length else b"")
    except TimeoutError:
        return None


def publish_packet_id(first: int, body: bytes | bytearray | memoryview) -> int | None:
    """The packet id of a PUBLISH (``first`` its first byte), None at QoS 0."""
    if not first & 0x06:
        return None
    at = 2 + ((body[0] << 8) | body[1])
    return (body[at] << 8) | body[at + 1]
