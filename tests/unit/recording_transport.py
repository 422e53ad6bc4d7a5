"""A real in-memory Transport for driving the pump and stream senders without a broker."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from amqtt_durable.delivery import AckKind
from amqtt_durable.wire import split_packets


@dataclass
class Sent:
    """One packet the broker side wrote: a PUBLISH (with topic, payload, packet id) or another type."""

    packet_type: int
    flags: int
    topic: str = ""
    payload: bytes = b""
    packet_id: int | None = None

    @property
    def qos(self) -> int:
        return (self.flags >> 1) & 0x03

    @property
    def dup(self) -> bool:
        return bool(self.flags & 0x08)


def parse_packets(data: bytes) -> list[Sent]:
    """Split a byte stream into MQTT packets, decoding PUBLISH fully."""
    packets = []
    framed, used = split_packets(data)
    assert used == len(data), "a packet was cut off"
    for first, start, end in framed:
        body = data[start:end]
        packet_type, flags = first >> 4, first & 0x0F
        if packet_type != 3:
            packets.append(Sent(packet_type, flags, packet_id=int.from_bytes(body[:2], "big")))
            continue
        topic_len = int.from_bytes(body[:2], "big")
        topic = body[2 : 2 + topic_len].decode()
        at = 2 + topic_len
        packet_id = None
        if (flags >> 1) & 0x03:
            packet_id = int.from_bytes(body[at : at + 2], "big")
            at += 2
        packets.append(Sent(packet_type, flags, topic, bytes(body[at:]), packet_id))
    return packets


class RecordingTransport:
    """Keeps every write; ``wait_for`` blocks (bounded) until the packets so far satisfy a test."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.writes = 0
        self.closed = False
        self.expected: dict[tuple[AckKind, int], Callable[[], None]] = {}
        self._changed = asyncio.Event()

    def write(self, data: bytes) -> None:
        self.writes += 1
        self.data += data
        self._changed.set()

    async def drain(self) -> None:
        return None

    def expect_ack(self, kind: AckKind, packet_id: int, on_ack: Callable[[], None]) -> None:
        self.expected[(kind, packet_id)] = on_ack

    def ack(self, kind: AckKind, packet_id: int) -> None:
        self.expected.pop((kind, packet_id))()

    @property
    def packets(self) -> list[Sent]:
        return parse_packets(bytes(self.data))

    async def wait_for(self, done: Callable[[list[Sent]], bool], limit: float = 5.0) -> list[Sent]:
        async with asyncio.timeout(limit):
            while not done(packets := self.packets):
                self._changed.clear()
                await self._changed.wait()
            return packets
