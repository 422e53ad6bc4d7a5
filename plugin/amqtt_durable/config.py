"""Plugin configuration: one typed dataclass, validated with the offending key named.

The same class is amqtt's plugin ``Config`` (amqtt builds it from the ``plugins:``
section of broker.yaml) and the input of ``amqtt-durable broker``'s pre-flight check,
which reports every problem before the broker opens a port.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from durable_protocol import MAX_STREAM_WINDOW, filter_is_valid

from .errors import ConfigError
from .replication.config import ReplicationConfig
from .settings import LISTEN_BACKLOG, SCALARS, refuse_long_ints, refuse_long_key

OverflowPolicy = Literal["drop-oldest", "drop-newest"]
OVERFLOW_POLICIES: tuple[str, ...] = get_args(OverflowPolicy)
SessionTakeover = Literal["owner-only", "any-user"]
TAKEOVER_POLICIES: tuple[str, ...] = get_args(SessionTakeover)
STREAM_KEYS = ("filter", "max_count", "max_age")
MIN_PACKET_SIZE = 1024
MAX_PACKET_SIZE = 268_435_455
MAX_KEEPALIVE = 65_535
"""MQTT's keep-alive is two bytes."""


@dataclass(frozen=True)
class StreamConfig:
    """One entry of ``streams``: topics whose messages are also kept in a log per topic."""

    filter: str
    """Topic filter; every topic it matches gets its own log with ids 1, 2, 3, ..."""

    max_count: int = 100_000
    """Events kept per topic; the oldest go first."""

    max_age: float = 0.0
    """Seconds an event is kept; 0 keeps events until max_count pushes them out."""


@dataclass
class DurableConfig:
    """Every knob of the plugin, with the default a broker gets when the key is absent."""

    store: str = "./data/durable"
    """LevelDB folder; created if missing. One broker process at a time may open it."""

    sync: bool = False
    """fsync every group commit. false survives a broker crash (SIGKILL); true also power loss."""

    session_expiry: float = 300.0
    """Seconds a disconnected durable session (and its queue) is kept (GemFire's durable-client-timeout)."""

    max_depth: int = 100_000
    """Queue limit of a connected session, in messages."""

    max_depth_disconnected: int = 1_000_000
    """Queue limit while disconnected (Diffusion's max-depth); must be >= max_depth."""

    overflow: OverflowPolicy = "drop-oldest"
    """What a full queue drops: the oldest queued message, or the new one."""

    recovery_buffer: int = 100
    """Sent-but-unacknowledged messages kept and re-sent first on reconnect; also the in-flight window."""

    queue_qos0: bool = False
    """Queue QoS 0 messages for disconnected sessions too (as Mosquitto's queue_qos0_messages)."""

    batch_size: int = 5000
    """Writes (publishes, acks) that start a commit at once, whatever pending_threshold says (XAP size)."""

    batch_delay_ms: float = 10.0
    """With sync: true, longest a write waits for company while fewer than pending_threshold wait
    (XAP delay). Without sync a commit costs microseconds, so writes of one loop pass share a
    batch and none waits."""

    pending_threshold: int = 100
    """With sync: true, waiting writes that start a commit at once, without batch_delay_ms."""

    metrics_interval: float = 10.0
    """Seconds between $SYS/broker/durable/ metric publications; 0 turns them off."""

    drop_log_interval: float = 10.0
    """Seconds between two overflow warnings of one session (drops are always counted)."""

    max_session_expiry: float = 604_800.0
    """Longest session expiry an SDK client may ask for in its hello (seconds); longer asks are capped."""

    streams: list[StreamConfig] = dataclasses.field(default_factory=list)
    """Stream logs for stateless resume: a list of {filter, max_count, max_age}."""

    stream_window: int = 1
    """Stream events in flight per topic before the client's ack (a client may ask for up to 1000)."""

    stream_ack_timeout: float = 5.0
    """Seconds before an unacknowledged stream event is sent again."""

    session_takeover: SessionTakeover = "owner-only"
    """Who may connect with the client id of a durable session: only the user that owns it
    (another gets CONNACK 5), or any user, who then owns it (and gets only what it may read)."""

    connect_timeout: float = 10.0
    """Seconds a new connection has to send its whole CONNECT; then it is closed (a silent or
    half-sent connection would otherwise hold a descriptor for ever)."""

    connection_end_wait: float = 5.0
    """Seconds the end of a connection (DISCONNECT, close, take-over) waits for the SUBSCRIBEs,
    UNSUBSCRIBEs and messages it read before to be applied and handed over (changes still waiting
    then are dropped, with a WARNING, none applied after; no message is dropped); also how long,
    after its own end is handled, what a connection that took over published waits for the older
    one's (after that one's end, for a connection made once an earlier one had ended). Bounds a
    take-over's CONNACK when the older connection's message loop is stuck (a topic plugin's slow check)."""

    max_packet_size: int = 1_048_576
    """Largest packet a client may send, in bytes of remaining length (EMQX's default, 1 MB; at
    most MQTT's 268435455). A larger one closes the connection before its body is read."""

    max_bytes: int = 0
    """Queue limit of a connected session in payload bytes, beside max_depth (same overflow); 0: none."""

    max_bytes_disconnected: int = 0
    """Byte limit while disconnected, beside max_depth_disconnected; 0: none. Must be >= max_bytes
    when both are set."""

    max_subscriptions_per_client: int = 1000
    """Topic filters one client may hold (durable or clean session); a SUBSCRIBE past it gets
    return code 0x80 for the filters over the limit. Re-subscribing to a held filter does not
    count twice. 0 means no limit. Routing cost does not grow with filters, but memory does,
    and a durable session's stored record is rewritten whole on every SUBSCRIBE."""

    max_subscription_bytes_per_client: int = 1_048_576
    """The UTF-8 bytes of one client's topic filters, summed (durable or clean session); a SUBSCRIBE
    past it gets return code 0x80 for the filters over the limit, as past max_subscriptions_per_client.
    0 means no limit. A durable session's stored record holds its filters and is rewritten whole on
    every SUBSCRIBE: with 250 filters of 60 kB (under max_subscriptions_per_client) each SUBSCRIBE
    held the event loop for about 0.25 s, and the cost grows with every filter added."""

    max_pending_clean: int = 10_000
    """Messages waiting to be sent to one clean-session connection (amqtt delivers those; a QoS 1/2
    one waits until acknowledged); past it a new message for that connection is dropped, counted
    and logged. 0 means no limit. A client that does not read (its socket full) would otherwise
    make the broker hold every message for it, without bound."""

    max_pending_bytes_clean: int = 16_777_216
    """The same limit in payload bytes (default 16 MiB); 0 means no limit."""

    max_awaiting_pubrel: int = 1000
    """QoS 2 publishes one connection may have awaiting their PUBREL (EMQX's max_awaiting_rel); a
    QoS 2 PUBLISH with a new packet id past it closes the connection, unacknowledged. 0 means no
    limit. amqtt holds each such message in memory until its PUBREL: a client that never sends
    PUBREL could make it hold 65535 packets per connection."""

    max_stream_entries_per_client: int = 10_000
    """Stream filters (``stream_subscribe``) one connection may hold open, plus the positions it
    presented in ``after`` for topics that have no log yet (kept until such a log appears); a
    ``stream_subscribe`` past it is refused (``malformed``) and changes nothing. Both stay until
    the connection ends: without a bound a client added some 1,800 positions per 64 kB request
    (52 MB of broker memory for 11 MB sent), without end. 0 means no limit."""

    max_pending_control_bytes: int = 1_048_576
    """Bytes of control requests (``_durable/v1/ctl``) one connection may have waiting to be
    handled, each counted as its topic, its payload and 200 bytes; past it the connection is
    closed. Requests wait while the client does not read what the broker sends it (more unsent
    than the socket's 64 KiB write buffer; a ``stream_ack`` on an open stream, naming no other
    client_id, does not, except while a waiting ``stream_unsubscribe``'s filter matches its
    topic): a request of 45 bytes can
    ask for a reply of a megabyte (``hello`` lists the session's subscriptions), so a
    client sending requests without reading their replies made the broker hold every reply.
    0 means no limit (requests still wait for the client to read)."""

    max_durable_sessions: int = 100_000
    """Durable sessions the store may hold: a CONNECT with clean_session=false that would create a
    new one while it holds that many is refused with CONNACK 3 (server unavailable), until a
    session ends (expiry, a clean CONNECT, end_session). A durable session's reconnect and clean
    sessions are never refused by it. 0 means no limit. Without a bound any client id connecting
    with clean_session=false made the broker keep a session (20 to 40 kB of memory each)."""

    max_connections_per_address: int = 0
    """Connections open at once from one remote IP address; a new one past it is closed as soon as
    it is accepted, before anything is read (no CONNACK). 0 (the default) means no limit: devices
    behind one NAT gateway share its address."""

    max_keepalive: int = 0
    """Longest keep-alive a CONNECT may ask for, in seconds (as Mosquitto 2's max_keepalive for MQTT
    3.1.1 clients): a CONNECT with keep-alive 0 (none) or above it gets CONNACK 2 (identifier
    rejected). 0 (the default) allows any keep-alive, 0 included, as MQTT does."""

    listen_backlog: int = LISTEN_BACKLOG
    """Connections the kernel holds for each listener, TCP and websocket, and for the replication
    address, until the broker accepts them (the listen backlog; amqtt's and asyncio's is 100). Past it, Linux
    drops a new connection's SYN and the client tries again 1 s later (then 3 s, 7 s): in a
    reconnect storm of more clients than the backlog, the late ones wait for that. The kernel caps
    it at net.core.somaxconn."""

    attach_limit: int = 256
    """Durable sessions attached to their new connection at once (after CONNACK: the store's
    commit, the pump's set-up and its first batch); the rest wait their turn in the order they
    came. Bounds the work a reconnect storm puts in one pass of the event loop, so publishes and
    new CONNECTs are read in between. 64 bounds a publish's wait more, at the cost of later first
    messages, a longer storm and longer SUBACK waits for durable newcomers (bench/RESULTS.md)."""

    replication: ReplicationConfig | None = None
    """Primary-backup replication of the store (docs/replication.md); absent: one broker, as before."""

    def __post_init__(self) -> None:
        _check_ranges(self)

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any] | None) -> DurableConfig:
        """Build from broker.yaml's plugin section, naming the first bad key and what it accepts."""
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise ConfigError("amqtt_durable.DurableSessionsPlugin", "expected a mapping of settings")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for key, value in raw.items():
            refuse_long_key("amqtt_durable.DurableSessionsPlugin", key)
            if key not in fields:
                raise ConfigError(str(key), f"unknown setting; accepted settings are {', '.join(fields)}")
            refuse_long_ints(key, value)
            values[key] = _coerce(key, value, fields[key].type)
        return cls(**values)


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    kind = str(annotation)
    scalar = SCALARS.get(kind)
    if scalar is not None:
        return scalar(key, value)
    if kind == "list[StreamConfig]":
        return _streams(key, value)
    if kind == "ReplicationConfig | None":
        if value is None or isinstance(value, ReplicationConfig):
            return value
        return ReplicationConfig.from_mapping(value, key)
    choices = {"OverflowPolicy": OVERFLOW_POLICIES, "SessionTakeover": TAKEOVER_POLICIES}.get(kind)
    if choices is not None:
        if value in choices:
            return value
        raise ConfigError(key, f"expected one of {', '.join(choices)}, got {value!r}")
    if kind == "str" and isinstance(value, os.PathLike):  # store given in Python as a Path: its text
        text = os.fspath(value)
        if text == ".":  # Path("") is Path("."): refused as "" is, since which was meant cannot be told
            raise ConfigError(
                key, f"expected a non-empty folder path, got {value!r} (Path('') is Path('.'): give the current "
                "folder as the text '.')",
            )  # fmt: skip
        value = text
    if isinstance(value, str) and value:
        return value
    what = "topic filter" if kind == "topic filter" else "folder path"
    raise ConfigError(key, f"expected a non-empty {what}, got {value!r}")


def _streams(key: str, value: Any) -> list[StreamConfig]:
    if not isinstance(value, list | tuple):  # a tuple given in Python, held as a list
        raise ConfigError(key, f"expected a list of {{filter, max_count, max_age}} entries, got {value!r}")
    streams = []
    for index, given in enumerate(value):
        where = f"{key}[{index}]"
        # a StreamConfig given in Python: its fields checked as a mapping's
        entry = dataclasses.asdict(given) if isinstance(given, StreamConfig) else given
        if not isinstance(entry, Mapping):
            raise ConfigError(where, f"expected a mapping with {', '.join(STREAM_KEYS)}, got {entry!r}")
        unknown = [str(k) for k in entry if k not in STREAM_KEYS]
        if unknown:
            raise ConfigError(f"{where}.{unknown[0]}", f"unknown setting; accepted are {', '.join(STREAM_KEYS)}")
        if "filter" not in entry:
            raise ConfigError(f"{where}.filter", "missing; every stream names the topic filter it logs")
        streams.append(
            StreamConfig(
                filter=_coerce(f"{where}.filter", entry["filter"], "topic filter"),
                max_count=_coerce(f"{where}.max_count", entry.get("max_count", 100_000), "int"),
                max_age=_coerce(f"{where}.max_age", entry.get("max_age", 0.0), "float"),
            )
        )
    return streams


def _check_streams(streams: list[StreamConfig]) -> None:
    seen: set[str] = set()
    for index, stream in enumerate(streams):
        where = f"streams[{index}]"
        if not filter_is_valid(stream.filter) or stream.filter.startswith(("$", "_durable/")):
            raise ConfigError(
                f"{where}.filter", f"{stream.filter!r} is not a valid topic filter outside $ and _durable/ topics"
            )
        if stream.filter in seen:
            raise ConfigError(f"{where}.filter", f"{stream.filter!r} is listed twice")
        seen.add(stream.filter)
        if stream.max_count < 1:
            raise ConfigError(f"{where}.max_count", f"must be at least 1, got {stream.max_count!r}")
        if not math.isfinite(stream.max_age) or stream.max_age < 0:
            raise ConfigError(f"{where}.max_age", f"must be finite seconds, 0 or more, got {stream.max_age!r}")


def _check_ranges(config: DurableConfig) -> None:
    for field in dataclasses.fields(config):  # a DurableConfig made in Python, not by from_mapping
        refuse_long_ints(field.name, getattr(config, field.name))
        # from_mapping's rules for each kind: a Fraction(1, 3) of seconds is a float, a Path a store's
        # text, a mapping in streams a StreamConfig (again for a value from_mapping made: the same value)
        setattr(config, field.name, _coerce(field.name, getattr(config, field.name), field.type))
    _check_counts(config)
    _check_byte_limits(config)
    _check_durations(config)
    _check_streams(config.streams)
    if "\0" in config.store:
        raise ConfigError("store", f"a folder path cannot hold a NUL character, got {config.store!r}")


def _check_counts(config: DurableConfig) -> None:
    positive_ints = ("max_depth", "max_depth_disconnected", "batch_size", "pending_threshold", "attach_limit")
    for key in positive_ints:
        if getattr(config, key) < 1:
            raise ConfigError(key, f"must be at least 1, got {getattr(config, key)!r}")
    if not 1 <= config.recovery_buffer <= 65_535:
        raise ConfigError(
            "recovery_buffer", f"must be between 1 and 65535 (MQTT packet ids), got {config.recovery_buffer!r}"
        )
    if config.max_depth_disconnected < config.max_depth:
        raise ConfigError(
            "max_depth_disconnected",
            f"must be >= max_depth ({config.max_depth}), got {config.max_depth_disconnected}",
        )
    if not 1 <= config.stream_window <= MAX_STREAM_WINDOW:
        raise ConfigError("stream_window", f"must be between 1 and {MAX_STREAM_WINDOW}, got {config.stream_window!r}")
    if not 0 <= config.max_keepalive <= MAX_KEEPALIVE:
        raise ConfigError(
            "max_keepalive", f"must be between 0 (no limit) and {MAX_KEEPALIVE} seconds, got {config.max_keepalive!r}"
        )
    if config.listen_backlog < 1:
        raise ConfigError("listen_backlog", f"must be a whole number, 1 or more, got {config.listen_backlog!r}")
    for key in (
        "max_subscriptions_per_client",
        "max_pending_clean",
        "max_awaiting_pubrel",
        "max_stream_entries_per_client",
        "max_durable_sessions",
        "max_connections_per_address",
    ):
        if getattr(config, key) < 0:
            raise ConfigError(key, f"must be a whole number, 0 (no limit) or more, got {getattr(config, key)!r}")


def _check_byte_limits(config: DurableConfig) -> None:
    for key in (
        "max_bytes",
        "max_bytes_disconnected",
        "max_pending_bytes_clean",
        "max_subscription_bytes_per_client",
        "max_pending_control_bytes",
    ):
        if getattr(config, key) < 0:
            raise ConfigError(key, f"must be 0 (no limit) or more bytes, got {getattr(config, key)!r}")
    if 0 < config.max_bytes_disconnected < config.max_bytes:
        raise ConfigError(
            "max_bytes_disconnected",
            f"must be >= max_bytes ({config.max_bytes}) or 0 (no limit), got {config.max_bytes_disconnected}",
        )
    if not MIN_PACKET_SIZE <= config.max_packet_size <= MAX_PACKET_SIZE:
        raise ConfigError(
            "max_packet_size",
            f"must be between {MIN_PACKET_SIZE} and {MAX_PACKET_SIZE} (MQTT's largest packet), "
            f"got {config.max_packet_size!r}",
        )


def _check_durations(config: DurableConfig) -> None:
    for key in ("stream_ack_timeout", "connect_timeout", "connection_end_wait"):
        value = getattr(config, key)
        if value <= 0 or not math.isfinite(value):
            raise ConfigError(key, f"must be a finite number above 0, got {value!r}")
    for key in ("session_expiry", "batch_delay_ms", "metrics_interval", "drop_log_interval", "max_session_expiry"):
        value = getattr(config, key)
        if not math.isfinite(value) or value < 0:
            raise ConfigError(key, f"must be a finite number, 0 or more, got {value!r}")
