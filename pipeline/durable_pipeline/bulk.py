"""A bulk reader of one stream log id range: a raw-socket MQTT 3.1.1 client for the Spark source's read tasks.

The SDK's DurableClient handles a stream event at a time (paho's packet objects, a frame
decode and an ``Event`` per event, a listener call, a hand-over to Spark's thread). A read
task needs none of that: it reads one topic, in id order, and gives Spark columns. This
reader has no thread of its own. It reads the socket in large chunks, takes every complete
PUBLISH out of a chunk in one loop (stream events on ``$durable/v1/stream/<topic>``: the
26-byte frame's id, flags and publish time, and the payload), appends them to column lists,
and sends one cumulative ``stream_ack`` per chunk (docs/protocol.md, "Streams").

What the source guarantees (docs/pipeline.md) is kept here:

* exact ranges, in order, no duplicates: an id below the next one expected (sent again
  after a reconnect or a resend) is dropped, ids past the range's end (the window runs
  ahead) are never taken;
* trimmed ids: an id above the next one expected means retention trimmed the ones between
  (the broker sends the first retained); ``on_lost`` raises or counts them
  (failOnDataLoss), as does a stalled read whose ids ``stream_info`` shows trimmed;
* failover and restarts: a connection that fails or ends, or a CONNACK 3 (a backup), moves
  on to the next address of ``host`` + ``failover`` (as the SDK does), retrying every
  RECONNECT_MAX_DELAY at most, and the stream is opened again after the last id taken;
* timeouts: no event for ``timeout`` seconds (the broker away, or silent) is SourceError.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import struct
import time
from collections.abc import Callable, Iterator
from typing import Any, Final

from durable_client.protocol import (
    CONTROL_TOPIC,
    FLAG_QOS_SHIFT,
    FRAME,
    FRAME_VERSION,
    REPLY_TOPIC,
    STREAM_TOPIC_PREFIX,
    decode_reply,
    encode_request,
    remaining_length,
)
from durable_protocol.hostport import join_host_port

from .errors import SourceError

RECV_BYTES: Final = 1 << 18
"""Bytes asked of the socket per read: a window of small events in one call."""
KEEPALIVE: Final = 60
"""CONNECT keepalive (s); a PINGREQ goes after half of it without a packet sent."""
BACKOFF_MIN: Final = 0.1
_U16: Final = struct.Struct(">H")
_FRAME_SIZE: Final = FRAME.size
_unpack_frame: Final = FRAME.unpack_from
_PINGREQ: Final = b"\xc0\x00"
_DISCONNECT: Final = b"\xe0\x00"
_REPLY_TOPIC: Final = REPLY_TOPIC.encode()
log = logging.getLogger("durable_pipeline.source")


class _RefusedError(Exception):
    """CONNACK with a non-zero return code."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class _ClosedError(Exception):
    """The connection ended or failed (the broker closed it, restarted, or the network broke)."""


def _publish_qos0(topic: bytes, payload: bytes) -> bytes:
    variable = _U16.pack(len(topic)) + topic
    return b"\x30" + remaining_length(len(variable) + len(payload)) + variable + payload


def _connect_packet(client_id: str) -> bytes:
    cid = client_id.encode()
    variable = b"\x00\x04MQTT\x04\x02" + _U16.pack(KEEPALIVE)  # protocol level 4, clean session
    payload = _U16.pack(len(cid)) + cid
    return b"\x10" + remaining_length(len(variable) + len(payload)) + variable + payload


_CONNACK_REASONS: Final = {
    1: "unacceptable protocol version", 2: "client id rejected", 3: "server unavailable",
    4: "bad user name or password", 5: "not authorised",
}


class Columns:
    """One batch's columns, as plain lists (Arrow arrays are made from them at once)."""

    __slots__ = ("flags", "ids", "payloads", "times")

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.payloads: list[bytes] = []
        self.flags: list[int] = []
        self.times: list[float] = []

    def __len__(self) -> int:
        return len(self.ids)


class BulkRangeReader:
    """Ids ``first`` to ``end`` of ``topic`` over one raw connection (moved between brokers as needed).

    ``batches`` yields Columns of at most ``rows`` events; ``on_lost(first_missing, last_missing,
    log_first)`` is called for trimmed ids (it raises, or returns to count them). ``describe``
    names the brokers in messages.
    """

    def __init__(
        self,
        addresses: list[tuple[str, int]],
        topic: str,
        first: int,
        end: int,
        *,
        window: int,
        timeout: float,
        client_id: str,
        on_lost: Callable[[int, int, int], int],
        describe: str,
        reconnect_max_delay: float = 1.0,
    ) -> None:
        self.addresses = addresses
        self.topic = topic
        self.expected = first
        self.end = end
        self.window = window
        self.timeout = timeout
        self.client_id = client_id
        self.on_lost = on_lost
        self.describe = describe
        self.reconnect_max_delay = reconnect_max_delay
        self.connections = 0
        """Connections made (a reconnect or a failover adds one)."""
        self._index = 0
        self._sock: socket.socket | None = None
        self._data = b""
        self._sent_at = 0.0
        self._acked = first - 1
        self._req = 0
        self._replies: dict[int, Any] = {}
        self._info_req: int | None = None
        self._prefix = _U16.pack(len((STREAM_TOPIC_PREFIX + topic).encode())) + (STREAM_TOPIC_PREFIX + topic).encode()
        self._cols = Columns()

    # ------------------------------------------------------------ connection
    def _send(self, data: bytes) -> None:
        assert self._sock is not None
        try:
            self._sock.sendall(data)
        except OSError as exc:
            raise _ClosedError(f"send failed: {exc}") from None
        self._sent_at = time.monotonic()

    def _request(self, op: str, **fields: Any) -> int:
        self._req += 1
        self._send(_publish_qos0(CONTROL_TOPIC.encode(), encode_request(op, self._req, **fields)))
        return self._req

    def _drop(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None
        self._data = b""
        self._replies.clear()
        self._info_req = None

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.sendall(_DISCONNECT)
        self._drop()

    def _open_once(self, host: str, port: int, deadline: float) -> None:
        """CONNECT to one broker and read its CONNACK; _RefusedError or OSError/_ClosedError when it will not do."""
        sock = socket.create_connection((host, port), timeout=max(0.05, min(5.0, deadline - time.monotonic())))
        self._sock = sock
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._send(_connect_packet(self.client_id))
        data = b""
        while len(data) < 4:
            chunk = sock.recv(4 - len(data))
            if not chunk:
                raise _ClosedError("the broker closed the connection before its CONNACK")
            data += chunk
        if data[0] != 0x20:
            raise _ClosedError(f"expected a CONNACK, got packet type {data[0] >> 4}")
        if data[3]:
            raise _RefusedError(data[3])

    def _connect(self, deadline: float) -> None:
        """Connect to the first broker of the list (from the current one on) that takes us; then open the stream.

        Raises _ClosedError when the deadline passes first (the caller words the error), SourceError
        for a refusal that trying again cannot cure.
        """
        delay = BACKOFF_MIN
        problem = "no attempt"
        while True:
            for _ in range(len(self.addresses)):
                host, port = self.addresses[self._index]
                try:
                    self._open_once(host, port, deadline)
                    self._subscribe(deadline)
                except _RefusedError as exc:
                    self._drop()
                    reason = _CONNACK_REASONS.get(exc.code, f"code {exc.code}")
                    if exc.code != 3:
                        raise SourceError(
                            f"the broker at {join_host_port(host, port)} refused the connection: {reason}"
                        ) from None
                    problem = f"{join_host_port(host, port)} refused the connection: {reason} (a backup?)"
                except (OSError, _ClosedError) as exc:
                    self._drop()
                    problem = f"{join_host_port(host, port)}: {exc}"
                else:
                    self.connections += 1
                    return
                self._index = (self._index + 1) % len(self.addresses)
                if time.monotonic() >= deadline:
                    raise _ClosedError(problem)
            pause = min(delay, max(0.0, deadline - time.monotonic()))
            if pause <= 0:
                raise _ClosedError(problem)
            time.sleep(pause)  # backoff between rounds of the addresses, not synchronisation
            delay = min(delay * 2, self.reconnect_max_delay)

    def _subscribe(self, deadline: float) -> None:
        """stream_subscribe after the last id taken; checks the log still reaches the range's end."""
        req = self._request(
            "stream_subscribe", filter=self.topic, after={self.topic: self.expected - 1}, window=self.window
        )
        reply = self._wait_reply(req, deadline)
        if not reply.ok:
            raise SourceError(f"the broker at {self.describe} refused the stream {self.topic}: "
                              f"{reply.error_code}: {reply.error_message}")
        bounds = (reply.fields.get("topics") or {}).get(self.topic)
        last = bounds["last"] if bounds else 0
        if self.topic in (reply.fields.get("ahead") or {}) or last < self.end:
            raise SourceError(
                f"stream {self.topic} at {self.describe} ends at id {last}, but this batch was planned up to id "
                f"{self.end}: was the broker's store wiped or replaced? Start the query from a new checkpoint"
            )
        first = bounds["first"] if bounds else last + 1
        if first > self.expected:  # trimmed before the stream opened: the broker starts at `first`
            self._skip_to(first)

    def _wait_reply(self, req: int, deadline: float) -> Any:
        while req not in self._replies:
            if not self._pump(max(0.05, deadline - time.monotonic())) and time.monotonic() >= deadline:
                raise _ClosedError(f"no reply to a request within the timeout (request {req})")
        return self._replies.pop(req)

    # ------------------------------------------------------------ reading
    def _skip_to(self, log_first: int) -> None:
        last_missing = min(log_first - 1, self.end)
        self.expected = self.on_lost(self.expected, last_missing, log_first)

    def _pump(self, wait: float) -> bool:
        """One socket read (waiting up to ``wait`` s for data) and every complete packet in it; False when none came."""
        sock = self._sock
        if sock is None:
            raise _ClosedError("not connected")
        sock.settimeout(wait)
        try:
            chunk = sock.recv(RECV_BYTES)
        except TimeoutError:
            return False
        except OSError as exc:
            raise _ClosedError(f"read failed: {exc}") from None
        if not chunk:
            raise _ClosedError("the broker closed the connection")
        self._data = self._data + chunk if self._data else chunk
        self._parse()
        return True

    def _parse(self) -> None:  # noqa: C901, PLR0915 - the hot loop, kept in one piece on purpose
        data = self._data
        size = len(data)
        pos = 0
        prefix = self._prefix
        body_at = len(prefix)
        cols = self._cols
        ids, payloads, flags, times = cols.ids, cols.payloads, cols.flags, cols.times
        expected, end = self.expected, self.end
        unpack, frame_size = _unpack_frame, _FRAME_SIZE
        try:
            while size - pos >= 2:
                head = data[pos]
                length = data[pos + 1]
                start = pos + 2
                if length & 0x80:  # a remaining length of more than one byte
                    length &= 0x7F
                    shift = 7
                    while True:
                        if start >= size:
                            return
                        byte = data[start]
                        start += 1
                        length |= (byte & 0x7F) << shift
                        if not byte & 0x80:
                            break
                        shift += 7
                        if shift > 21:
                            raise _ClosedError("malformed remaining length from the broker")
                stop = start + length
                if stop > size:
                    return
                pos = stop
                if head == 0x30 and data.startswith(prefix, start):  # a stream event of our topic, QoS 0
                    at = start + body_at
                    if stop - at < frame_size:
                        raise SourceError(f"stream {self.topic} at {self.describe}: an event without its "
                                          f"{frame_size}-byte frame (docs/protocol.md, Frames)")
                    version, flag, _epoch, seq, published = unpack(data, at)
                    if version != FRAME_VERSION:
                        raise SourceError(
                            f"stream {self.topic} at {self.describe}: an event with frame version {version}; this "
                            f"reader knows version {FRAME_VERSION} (docs/protocol.md): upgrade durable_pipeline"
                        )
                    if seq != expected or seq > end:
                        if seq < expected or seq > end:
                            continue  # sent again, or past the range: not ours to take
                        self.expected = expected
                        self._skip_to(seq)  # ids between were trimmed (raises with failOnDataLoss)
                        expected = self.expected
                        if seq != expected:
                            continue
                    ids.append(seq)
                    flags.append(flag)
                    times.append(published)
                    payloads.append(data[at + frame_size:stop])
                    expected += 1
                elif head >> 4 == 3:
                    self.expected = expected  # a stream_info reply compares with the ids taken so far
                    self._other_publish(head, data[start:stop])
                    expected = self.expected
        finally:
            self.expected = expected
            self._data = data[pos:]

    def _other_publish(self, head: int, body: bytes) -> None:
        """A reply (or another PUBLISH, which this reader does not use)."""
        topic_len = _U16.unpack_from(body)[0]
        topic = body[2:2 + topic_len]
        at = 2 + topic_len + (2 if (head >> 1) & 3 else 0)
        if topic != _REPLY_TOPIC:
            return
        try:
            reply = decode_reply(body[at:])
        except Exception:
            return
        if reply.req == self._info_req:
            self._info_req = None
            self._check_trimmed(reply)
        elif isinstance(reply.req, int):
            self._replies[reply.req] = reply

    def _check_trimmed(self, reply: Any) -> None:
        """A stalled read asked stream_info: ids retention trimmed meanwhile will never come."""
        bounds = (reply.fields.get("topics") or {}).get(self.topic) if reply.ok else None
        if bounds and bounds["first"] > self.expected:
            self._skip_to(bounds["first"])

    def _ack(self) -> None:
        last = self.expected - 1
        if last > self._acked and self.expected <= self.end:
            self._send(_publish_qos0(CONTROL_TOPIC.encode(), encode_request("stream_ack", topic=self.topic, id=last)))
            self._acked = last
        elif time.monotonic() - self._sent_at > KEEPALIVE / 2:
            self._send(_PINGREQ)

    def _take(self) -> Columns:
        cols, self._cols = self._cols, Columns()
        return cols

    def batches(self, rows: int, stall_check: float) -> Iterator[Columns]:
        """Columns of the range's events in id order, at most ``rows`` each, until ``end`` is taken."""
        deadline = time.monotonic() + self.timeout
        try:
            try:
                self._connect(deadline)
            except _ClosedError as exc:
                raise SourceError(self._unreachable(exc)) from None
            while self.expected <= self.end:
                before = self.expected
                try:
                    came = self._pump(stall_check)
                    more = came and self._readable()  # before the ack: what the window had already sent
                    self._ack()
                    if not came and self._info_req is None:
                        self._info_req = self._request("stream_info", filter=self.topic)
                except _ClosedError as exc:
                    self._drop()
                    if len(self._cols):
                        yield self._take()
                    self._reconnect(exc, deadline)
                    continue
                if self.expected != before:  # ids taken or skipped: a reply, a PINGRESP or a resend is no event
                    deadline = time.monotonic() + self.timeout
                elif time.monotonic() >= deadline:
                    raise SourceError(self._no_event()) from None
                cols = self._cols
                if len(cols) >= rows or (cols.ids and (self.expected > self.end or not more)):
                    yield self._take()
                    deadline = time.monotonic() + self.timeout  # after the yield: Spark may hold it long
            if len(self._cols):
                yield self._take()
        finally:
            self.close()

    def _reconnect(self, lost: _ClosedError, deadline: float) -> None:
        """The connection ended: the next broker that takes us, the stream opened after the last id taken."""
        if time.monotonic() >= deadline:
            raise SourceError(self._no_event(str(lost))) from None
        try:
            self._connect(deadline)
        except _ClosedError as again:
            raise SourceError(self._no_event(f"{lost}; then {again}")) from None
        host, port = self.addresses[self._index]
        log.info("stream %s: reconnected to %s after %s; reading on after id %d",
                 self.topic, join_host_port(host, port), lost, self.expected - 1)

    def _readable(self) -> bool:
        sock = self._sock
        return sock is not None and bool(select.select([sock], [], [], 0)[0])

    def _no_event(self, why: str = "") -> str:
        return (
            f"stream {self.topic} at {self.describe}: no event after id {self.expected - 1} within "
            f"{self.timeout:g} s (is the broker down?{' ' + why if why else ''}). This task fails; Spark reads the "
            "range again (or the query resumes from its checkpoint when restarted)"
        )

    def _unreachable(self, why: object) -> str:
        return (
            f"cannot reach the amqtt-durable broker at {self.describe} within {self.timeout:g} s: start the broker "
            f"(amqtt-durable broker -c broker.yaml), or set the options host and port to where it listens [{why}]"
        )


def arrow_batch(pa: Any, arrow_schema: Any, topic: str, cols: Columns) -> Any:
    """The source's Arrow batch from one Columns: qos from the frame flags, times in microseconds (half even)."""
    import pyarrow.compute as pc  # noqa: PLC0415 - executors only

    n = len(cols)
    flags = pa.array(cols.flags, type=pa.int32())
    micros = pc.cast(pc.round(pc.multiply(pa.array(cols.times, type=pa.float64()), 1_000_000.0)), pa.int64())
    return pa.RecordBatch.from_arrays(
        [
            pa.array([topic] * n, type=pa.string()),
            pa.array(cols.ids, type=pa.int64()),
            pa.array(cols.payloads, type=pa.binary()),
            pc.bit_wise_and(pc.shift_right(flags, FLAG_QOS_SHIFT), 3),
            micros.cast(arrow_schema.field(4).type),
        ],
        schema=arrow_schema,
    )
