"""The SDK <-> plugin wire protocol, version 1 (docs/protocol.md is its description).

Dependency-free on purpose (the standard library only): the SDK and the broker plugin both
import this package, so the two sides can never disagree on a topic, a field or a byte
offset, and importing the plugin does not load the SDK or paho-mqtt. ``durable_client.protocol``
re-exports it for SDK users.

Topics:
* ``_durable/v1/ctl``: client -> broker control requests (JSON). amqtt closes connections
  that publish to ``$`` topics, so client-to-broker control cannot use one; the plugin takes
  every PUBLISH under ``_durable/`` off the message path, so no subscriber ever sees it.
* ``$durable/v1/reply``: broker -> the requesting connection only, replies (JSON, QoS 0).
* ``$durable/v1/marker``: broker -> an SDK session, the end of replay (JSON, QoS 0).
* ``$durable/v1/stream/<topic>``: broker -> a connection, one stream-log event (framed, QoS 0).

Events to SDK sessions and stream events carry a 26-byte frame before the publisher's
payload (``FRAME``); plain MQTT sessions never get frames.
"""

from __future__ import annotations

import functools
import json
import math
import numbers
import struct
import sys
from dataclasses import dataclass, field
from typing import Any, Final

from .jsontext import json_object

__all__ = [
    "CONTROL_PREFIX",
    "CONTROL_TOPIC",
    "ERROR_CODES",
    "FLAG_QOS_SHIFT",
    "FLAG_REDELIVERED",
    "FLAG_REPLAYED",
    "FLAG_RETAINED",
    "FRAME",
    "FRAME_VERSION",
    "MARKER_TOPIC",
    "MAX_INT_DIGITS",
    "MAX_REQUEST_BYTES",
    "MAX_STREAM_WINDOW",
    "OPS",
    "PROTOCOL_VERSION",
    "REPLY_TOPIC",
    "SHOWN_TOPIC_CHARS",
    "STREAM_TOPIC_PREFIX",
    "Frame",
    "LiveSubscription",
    "Marker",
    "ProtocolError",
    "Reply",
    "Request",
    "decode_frame",
    "decode_frame_fields",
    "decode_marker",
    "decode_reply",
    "encode_error",
    "encode_frame",
    "encode_marker",
    "encode_reply",
    "encode_request",
    "filter_is_valid",
    "int_digits",
    "long_fraction",
    "parse_request",
    "remaining_length",
    "request_ids",
    "shown_topic",
    "too_many_digits",
]

PROTOCOL_VERSION: Final = 1
CONTROL_PREFIX: Final = "_durable/"
CONTROL_TOPIC: Final = "_durable/v1/ctl"
REPLY_TOPIC: Final = "$durable/v1/reply"
MARKER_TOPIC: Final = "$durable/v1/marker"
STREAM_TOPIC_PREFIX: Final = "$durable/v1/stream/"
MAX_INT_DIGITS: Final = 4300
"""The most decimal digits an integer may have in a request, an SDK setting or broker.yaml: converting
more costs time quadratic in their count. Python's default limit, kept when the interpreter's is off
or higher (``int_digits``)."""

MAX_REQUEST_BYTES: Final = 65_536
MAX_STREAM_WINDOW: Final = 1_000
SHOWN_TOPIC_CHARS: Final = 100
"""A topic in a log line or an error message is cut to this many characters and "...": it may be
65 kB long (the broker also keeps a topic under ``_durable/`` other than the control topic cut so)."""


def shown_topic(topic: str) -> str:
    """A topic cut to ``SHOWN_TOPIC_CHARS`` (and "...") for an error message or a log line; a cut
    one is left as it is."""
    if len(topic) <= SHOWN_TOPIC_CHARS + 3:
        return topic
    return topic[:SHOWN_TOPIC_CHARS] + "..."


def filter_is_valid(topic_filter: str) -> bool:
    """MQTT-4.7.1: '#' only as the whole last level, '+' only as a whole level; not empty, no U+0000,
    well-formed UTF-8 (MQTT-1.5.3-1: no lone surrogate, which no client could encode)."""
    if not topic_filter or "\x00" in topic_filter:
        return False
    if not topic_filter.isascii():
        try:
            topic_filter.encode("utf-8")
        except UnicodeEncodeError:
            return False
    levels = topic_filter.split("/")
    for index, level in enumerate(levels):
        if "#" in level and (level != "#" or index != len(levels) - 1):
            return False
        if "+" in level and level != "+":
            return False
    return True


def remaining_length(length: int) -> bytes:
    """MQTT's variable byte integer: 7 bits a byte, low bits first, the high bit set when more follow.

    The one encoder of it in the project: the broker's wire module, the Spark source's bulk reader,
    and the benchmarks' and the tests' raw clients use it.
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


FRAME: Final = struct.Struct(">BBQQd")
"""version:u8 flags:u8 epoch:u64 seq:u64 published_at:f64, then the payload as published."""
FRAME_VERSION: Final = 1
_FRAME_SIZE: Final = FRAME.size
_unpack_frame: Final = FRAME.unpack_from
FLAG_REPLAYED: Final = 0x01
"""Queued before the replay marker point: a listener gets it, the cache does not."""
FLAG_RETAINED: Final = 0x02
"""A retained message queued with a new subscription: an initial value for the cache."""
FLAG_REDELIVERED: Final = 0x04
"""Sent before (recovery buffer, or a stream retransmit): it may have been seen already."""
FLAG_QOS_SHIFT: Final = 3
"""Bits 3-4: the publish QoS of a stream event (stream events travel at QoS 0 themselves)."""

OPS: Final = (
    "hello",
    "interest",
    "ready",
    "end_session",
    "stream_subscribe",
    "stream_ack",
    "stream_unsubscribe",
    "stream_info",
)


class ProtocolError(Exception):
    """A request the broker refuses; ``code`` is one of ``ERROR_CODES``."""

    def __init__(self, code: str, message: str, req: int | None = None, op: str | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.req = req
        """The request's "req", when it could be read, so the error reply can echo it."""
        self.op = op
        """The request's "op", when it is a known one, echoed likewise."""


ERROR_CODES: Final = (
    "malformed",  # not a JSON object, a field missing or of the wrong type, or too large
    "unsupported_version",  # "v" is not a version this broker speaks
    "unknown_op",
    "unknown_topic",  # a PUBLISH under _durable/ other than the control topic
    "not_your_session",  # "client_id" names another client: a connection acts on its own session only
    "no_session",  # the op needs a durable session (clean_session=false) on this connection
    "bad_filter",
    "unknown_stream",  # the filter matches no configured stream, or the topic has no open stream
    "not_authorized",  # a topic ACL plugin refused it
    "internal",  # the broker failed while handling it (its log says why); nothing was changed
)


# ----------------------------------------------------------------------- frames
@dataclass(frozen=True, slots=True)
class Frame:
    flags: int
    epoch: int
    """Durable session id (changes when a session is lost and created anew); 0 for stream events."""
    seq: int
    """Queue sequence within the epoch, or the stream log id: increases along the delivery order."""
    published_at: float

    @property
    def replayed(self) -> bool:
        return bool(self.flags & FLAG_REPLAYED)

    @property
    def retained(self) -> bool:
        return bool(self.flags & FLAG_RETAINED)

    @property
    def redelivered(self) -> bool:
        return bool(self.flags & FLAG_REDELIVERED)

    @property
    def qos(self) -> int:
        """The publish QoS a stream event was logged with (0 in session events: MQTT carries theirs)."""
        return (self.flags >> FLAG_QOS_SHIFT) & 0x03


def encode_frame(flags: int, epoch: int, seq: int, published_at: float) -> bytes:
    return FRAME.pack(FRAME_VERSION, flags, epoch, seq, published_at)


def decode_frame(data: bytes) -> tuple[Frame, bytes]:
    """Split a framed payload; ProtocolError when it is not a frame of a known version."""
    flags, epoch, seq, published_at, payload = decode_frame_fields(data)
    return Frame(flags, epoch, seq, published_at), payload


def decode_frame_fields(data: bytes) -> tuple[int, int, int, float, bytes]:
    """``decode_frame`` as plain values (flags, epoch, seq, published_at, payload), no Frame object:
    the receiving SDK's per-event path."""
    if len(data) < _FRAME_SIZE:
        raise ProtocolError("malformed", f"payload of {len(data)} bytes is shorter than the {FRAME.size}-byte frame")
    version, flags, epoch, seq, published_at = _unpack_frame(data)
    if version != FRAME_VERSION:
        raise ProtocolError("unsupported_version", f"frame version {version}; this side speaks {FRAME_VERSION}")
    return flags, epoch, seq, published_at, data[_FRAME_SIZE:]


# --------------------------------------------------------------------- requests
@dataclass(frozen=True)
class Request:
    """One control request, its fields checked for type (the broker checks their meaning)."""

    op: str
    req: int | None = None
    client_id: str | None = None
    session_expiry: float | None = None
    """hello: seconds this session outlives a disconnect (the broker caps it)."""
    filter: str | None = None
    """interest, stream_subscribe, stream_unsubscribe, stream_info."""
    durable: bool = True
    """interest: False makes the filter's subscription end with the connection."""
    after: dict[str, int] = field(default_factory=dict)
    """stream_subscribe: last id processed per topic; topics absent start at the log's first event."""
    window: int | None = None
    """stream_subscribe: events in flight per topic before an ack (default: the broker's stream_window)."""
    topic: str | None = None
    """stream_ack: the log topic."""
    id: int | None = None
    """stream_ack: the id processed (acknowledges every id up to it on that topic)."""


_REQUIRED: Final[dict[str, tuple[str, ...]]] = {
    "interest": ("filter",),
    "stream_subscribe": ("filter",),
    "stream_unsubscribe": ("filter",),
    "stream_ack": ("topic", "id"),
}


def encode_request(op: str, req: int | None = None, **fields: Any) -> bytes:
    body: dict[str, Any] = {"v": PROTOCOL_VERSION, "op": op}
    if req is not None:
        body["req"] = req
    body.update({k: v for k, v in fields.items() if v is not None})
    return json.dumps(body, separators=(",", ":")).encode()


def parse_request(payload: bytes) -> Request:
    """Decode and type-check one request; ProtocolError names what is wrong."""
    data = _json_object(payload)
    req = data.get("req")
    if req is not None and not _is_int(req):
        raise ProtocolError("malformed", "'req' must be an integer")
    op = data.get("op")
    try:
        version = data.get("v")
        if not _is_int(version) or version != PROTOCOL_VERSION:  # JSON true and 1.0 are not 1
            raise ProtocolError(
                "unsupported_version", f"'v' is {version!r}; this broker speaks protocol {PROTOCOL_VERSION}"
            )
        if op not in OPS:
            raise ProtocolError("unknown_op", f"'op' is {op!r}; known ops are {', '.join(OPS)}")
        for name in _REQUIRED.get(op, ()):
            if data.get(name) is None:  # absent or null: a null field counts as absent
                raise ProtocolError("malformed", f"{op} needs '{name}'")
        return Request(
            op=op,
            req=req,
            client_id=_optional(data, "client_id", str),
            session_expiry=_expiry(data),
            filter=_optional(data, "filter", str),
            durable=_optional(data, "durable", bool, default=True),
            after=_after(data),
            window=_window(data),
            topic=_optional(data, "topic", str),
            id=_id(data),
        )
    except ProtocolError as exc:
        exc.req = req
        exc.op = op if op in OPS else None
        raise


def request_ids(payload: bytes) -> tuple[str | None, int | None]:
    """The ``op`` (when it is a known one) and ``req`` (when an integer) of a request that is refused
    before it is parsed (sent to another topic under ``_durable/``), so the error reply echoes them
    as it does for any refusal; (None, None) when the payload is not a JSON object or its ``req``
    is not an integer, as ``parse_request`` answers those."""
    try:
        data = _json_object(payload)
    except ProtocolError:
        return None, None
    op, req = data.get("op"), data.get("req")
    if req is not None and not _is_int(req):
        return None, None
    return (op if op in OPS else None), req


def _json_object(payload: bytes) -> dict[str, Any]:
    """The request's JSON object, bounded in size and depth (a control topic is open to every client)."""
    if len(payload) > MAX_REQUEST_BYTES:
        raise ProtocolError("malformed", f"request of {len(payload)} bytes; the limit is {MAX_REQUEST_BYTES}")
    try:
        return json_object(payload, parse_int=_json_int)
    except ValueError as exc:
        raise ProtocolError("malformed", f"request is {exc}") from None


def _json_int(digits: str) -> int:
    """A JSON integer; one of more than ``int_digits()`` digits refuses the request with a message
    that says so, counted before any conversion (``int`` raised an error naming a Python setting a
    client cannot change, inside the parser: "not UTF-8 JSON")."""
    count, limit = len(digits.lstrip("-")), int_digits()
    if count > limit:
        raise ProtocolError("malformed", f"request holds an integer of {count} digits; the limit is {limit}")
    return int(digits)


def int_digits() -> int:
    """The most decimal digits of an integer read or shown here: MAX_INT_DIGITS, or the interpreter's
    lower limit where one is set (``sys.set_int_max_str_digits``, PYTHONINTMAXSTRDIGITS), as a
    number past it could be neither read nor written in this process."""
    interpreter = sys.get_int_max_str_digits()
    return min(MAX_INT_DIGITS, interpreter) if interpreter else MAX_INT_DIGITS


def too_many_digits(number: int) -> bool:
    """Whether ``number`` has more than ``int_digits()`` decimal digits, found without writing it
    (writing one costs time quadratic in its digits, or raises ValueError past Python's limit)."""
    return abs(number) >= _first_too_long(int_digits())


def long_fraction(value: object) -> tuple[int, int] | None:
    """The numerator and denominator of a Fraction (any non-integer ``numbers.Rational``) when either has
    more than ``int_digits()`` digits, so its repr would be slow or raise ValueError; None otherwise."""
    if not isinstance(value, numbers.Rational) or isinstance(value, int):
        return None
    numerator, denominator = int(value.numerator), int(value.denominator)
    return (numerator, denominator) if too_many_digits(numerator) or too_many_digits(denominator) else None


@functools.lru_cache(maxsize=4)  # one limit at a time, in practice: the interpreter's may change
def _first_too_long(digits: int) -> int:
    first: int = 10**digits
    return first


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional(data: dict[str, Any], name: str, kind: type, default: Any = None) -> Any:
    value = data.get(name)
    if value is None:  # absent or null
        return default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ProtocolError("malformed", f"'{name}' must be a {kind.__name__}, got {value!r}")
    if kind is str and value == "":
        raise ProtocolError("malformed", f"'{name}' must not be empty")
    return value


def _expiry(data: dict[str, Any]) -> float | None:
    value = data.get("session_expiry")
    if value is None:
        return None
    try:
        # A JSON integer past a double's range (10**400) is as infinite as 1e400, which JSON reads as inf.
        seconds = float(value) if isinstance(value, int | float) and not isinstance(value, bool) else math.nan
    except OverflowError:
        seconds = math.inf
    if not math.isfinite(seconds) or seconds < 0:
        huge = isinstance(value, int) and seconds == math.inf
        shown = f"an integer of {len(str(abs(value)))} digits" if huge else repr(value)
        raise ProtocolError("malformed", f"'session_expiry' must be a number of seconds, 0 or more, got {shown}")
    return seconds + 0.0  # -0.0 is granted as 0.0


def _after(data: dict[str, Any]) -> dict[str, int]:
    value = data.get("after")
    if value is None:  # absent or null
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and _is_topic(k) and _is_int(v) and v >= 0 for k, v in value.items()
    ):
        raise ProtocolError(
            "malformed",
            "'after' must map topics (no wildcards, U+0000 or lone surrogate) to ids (whole numbers, 0 or more)",
        )
    return dict(value)


def _is_topic(topic: str) -> bool:
    """A topic name a log can have: a valid filter without wildcards (a key such as 'a/+' names no
    topic, and kept as a position it would only use up max_stream_entries_per_client)."""
    return filter_is_valid(topic) and "+" not in topic and "#" not in topic


def _window(data: dict[str, Any]) -> int | None:
    value = data.get("window")
    if value is not None and not (_is_int(value) and 1 <= value <= MAX_STREAM_WINDOW):
        raise ProtocolError("malformed", f"'window' must be a whole number from 1 to {MAX_STREAM_WINDOW}")
    return value


def _id(data: dict[str, Any]) -> int | None:
    value = data.get("id")
    if value is not None and not (_is_int(value) and value >= 1):
        raise ProtocolError("malformed", f"'id' must be a whole number, 1 or more, got {value!r}")
    return value


# ---------------------------------------------------------------------- replies
def encode_reply(op: str | None, req: int | None, **fields: Any) -> bytes:
    return json.dumps({"op": op, "req": req, "ok": True, **fields}, separators=(",", ":")).encode()


def encode_error(op: str | None, req: int | None, error: ProtocolError) -> bytes:
    body = {"op": op, "req": req, "ok": False, "error": {"code": error.code, "message": error.message}}
    return json.dumps(body, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Reply:
    op: str | None
    req: int | None
    ok: bool
    fields: dict[str, Any]
    error_code: str | None = None
    error_message: str | None = None


def decode_reply(payload: bytes) -> Reply:
    try:
        data = json.loads(payload)
        error = data.get("error") or {}
        fields = {k: v for k, v in data.items() if k not in ("op", "req", "ok", "error")}
        return Reply(data.get("op"), data.get("req"), bool(data["ok"]), fields, error.get("code"), error.get("message"))
    except (ValueError, KeyError, AttributeError, TypeError, RecursionError) as exc:
        raise ProtocolError("malformed", f"reply is not a protocol {PROTOCOL_VERSION} reply: {exc}") from None


# ----------------------------------------------------------------------- marker
@dataclass(frozen=True)
class LiveSubscription:
    filter: str
    qos: int
    durable: bool


@dataclass(frozen=True)
class Marker:
    """End of replay (GemFire's marker): everything before it was queued before ``ready``."""

    epoch: int
    replayed: int
    first_seq: int | None
    last_seq: int | None
    live: tuple[LiveSubscription, ...]


def encode_marker(marker: Marker) -> bytes:
    return json.dumps(
        {
            "v": PROTOCOL_VERSION,
            "epoch": marker.epoch,
            "replayed": marker.replayed,
            "first_seq": marker.first_seq,
            "last_seq": marker.last_seq,
            "live": [{"filter": s.filter, "qos": s.qos, "durable": s.durable} for s in marker.live],
        },
        separators=(",", ":"),
    ).encode()


def decode_marker(payload: bytes) -> Marker:
    try:
        data = json.loads(payload)
        live = tuple(LiveSubscription(str(s["filter"]), int(s["qos"]), bool(s["durable"])) for s in data["live"])
        return Marker(int(data["epoch"]), int(data["replayed"]), data["first_seq"], data["last_seq"], live)
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as exc:  # int(Infinity): Overflow
        raise ProtocolError("malformed", f"marker is not a protocol {PROTOCOL_VERSION} marker: {exc}") from None
