"""The ``replication:`` settings of the plugin, one typed dataclass validated with the key named.

DurableConfig's ``replication`` field (None: a single broker, exactly as before), built by
``ReplicationConfig.from_mapping(value, "replication")``.

Two ways to run, as in Patroni:

- with ``coordinator`` (etcd endpoints), ``role: auto``: who is primary is a lease in etcd;
  every node runs the HA loop (ha.py) and a backup takes over when the primary is gone;
- without a coordinator, ``role: primary`` or ``role: backup`` (with ``primary``): fixed
  roles; making a backup primary is the operator's decision (``amqtt-durable promote``).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import re
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from decimal import ROUND_FLOOR, Decimal, localcontext
from fractions import Fraction
from typing import Any, Literal, get_args
from urllib.parse import urlsplit

from durable_protocol.hostport import parse_host, split_host_port

from ..errors import ConfigError
from ..settings import SCALARS, WrittenFloat, refuse_long_ints, refuse_long_key
from .framing import MAX_FRAME, NAME_MAX_BYTES, name_problem

Role = Literal["auto", "primary", "backup"]
ROLES: tuple[str, ...] = get_args(Role)
Mode = Literal["sync", "async"]
MODES: tuple[str, ...] = get_args(Mode)
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
MIN_LEASE_TTL = 2
"""etcd grants no lease shorter than about 1.5 election timeouts (2 s with its defaults)."""
MAX_LEASE_TTL = 9_000_000_000
"""etcd's longest lease (its MaxLeaseTTL), in seconds: it refuses to grant a longer one."""
MAX_SNAPSHOT_CHUNK = MAX_FRAME // 2
"""The largest snapshot_chunk_bytes (128 MiB): a chunk ends with the row that reaches the setting,
so its frame holds up to the setting plus one row, and a backup refuses a frame over MAX_FRAME
(it would then refuse every chunk and start the snapshot over, forever)."""


@dataclass(frozen=True)
class TlsConfig:
    """``replication.tls``: mutual TLS on every replication connection (the channel, the tools).

    Both ends present a certificate (``cert``, ``key``) signed by the cluster's CA (``ca``) and
    refuse a peer whose certificate is not: a node accepts only peers holding a key the CA
    signed. ``check_hostname`` also makes a connecting side check that the node's certificate
    names the host it dialled (the ``primary`` / leader address): off by default, since
    replication addresses are often bare IPs; the CA should then sign only cluster members."""

    cert: str = ""
    """PEM certificate of this node (its chain may follow in the same file)."""
    key: str = ""
    """PEM private key of ``cert``; empty: the key is in the ``cert`` file."""
    ca: str = ""
    """PEM CA certificate(s) that sign every member's certificate."""
    check_hostname: bool = False

    @classmethod
    def from_mapping(cls, raw: Any, where: str) -> TlsConfig:
        if not isinstance(raw, Mapping):
            raise ConfigError(where, f"expected a mapping with cert, key, ca, got {raw!r}")
        names = [f.name for f in dataclasses.fields(cls)]
        values: dict[str, Any] = {}
        for key, value in raw.items():
            if key not in names:
                raise ConfigError(f"{where}.{key}", f"unknown setting; accepted settings are {', '.join(names)}")
            if key != "check_hostname":
                values[key] = _file_path(f"{where}.{key}", value)
            elif isinstance(value, bool):
                values[key] = value
            else:
                raise ConfigError(f"{where}.{key}", f"expected true or false, got {value!r}")
        for key in ("cert", "ca"):
            if key not in values:
                raise ConfigError(f"{where}.{key}", "needed with tls (mutual TLS: this node's certificate and the CA)")
        tls = cls(**values)
        tls.context(server=True, where=where)  # every file read and checked at start-up
        object.__setattr__(tls, READ, True)  # frozen: a mark beside the fields, for _coerce
        return tls

    def context(self, *, server: bool, where: str = "replication.tls") -> ssl.SSLContext:
        """An SSL context for the listening side (``server``) or the connecting side."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.verify_mode = ssl.CERT_REQUIRED
        if not server:
            context.check_hostname = self.check_hostname
        try:
            context.load_cert_chain(self.cert, self.key or None)
        except (OSError, ssl.SSLError) as exc:
            key = "cert" if _missing(self.cert) or not self.key else "key"
            raise ConfigError(
                f"{where}.{key}", f"cannot load the certificate {self.cert!r} and its key {self.key!r}: {exc}"
            ) from exc
        try:
            context.load_verify_locations(cafile=self.ca)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"{where}.ca", f"cannot load the CA certificate(s) {self.ca!r}: {exc}") from exc
        return context


READ = "_files_read"
"""The attribute TlsConfig.from_mapping sets on the TlsConfig it built once its files are read: that
object, given again (ReplicationConfig.from_mapping's, checked by the constructor), is not read twice
(a passphrase-protected key would ask twice). Not a field: equality, asdict and replace ignore it."""


def _file_path(key: str, value: Any) -> str:
    """A file path setting (tls cert, key, ca; secret_file) as text: a path object (``pathlib.Path``,
    any os.PathLike, as ``store`` takes) held as its text; not empty, no NUL."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value or "\0" in value:
        raise ConfigError(key, f"expected a file path, got {value!r}")
    return _text(key, value)


def _missing(path: str) -> bool:
    try:
        with open(path, "rb"):
            return False
    except OSError:
        return True


@dataclass(frozen=True)
class ReplicationConfig:
    """Primary-backup replication of the durable store (issue 12)."""

    role: Role = "auto"
    """``auto``: the coordinator's lease decides (needs ``coordinator``, so the defaults alone
    are not a valid setting); ``primary`` or ``backup``: a fixed role, without a coordinator."""

    mode: Mode = "sync"
    """``sync``: a publish is acknowledged once every in-sync backup has stored it (XAP sync
    replication: "stored on N machines"); ``async``: once stored locally, shipped right after
    (a failover can lose what was acknowledged but not yet shipped)."""

    name: str = ""
    """This broker's name in the cluster, unique, without '/', '+', '#' or NUL (a level of its $SYS topics
    and etcd key); needed with a coordinator."""

    listen: str = "127.0.0.1:7883"
    """host:port where this broker, as primary, accepts its backups' replication channels."""

    advertise: str = ""
    """host:port backups use to reach this broker's ``listen`` (published in the leader key);
    empty: ``listen``."""

    primary: str = ""
    """Without a coordinator, on a backup: the primary's replication address (host:port)."""

    coordinator: list[str] = field(default_factory=list)
    """etcd client URLs (``http://host:2379``), tried in order; empty: no coordinator, no HA loop."""

    cluster: str = "amqtt-durable"
    """Name of this primary-backup group; its keys in etcd live under ``/amqtt-durable/<cluster>/``."""

    lease_ttl: int = 5
    """Seconds the leader lease outlives the primary's last renewal: the bulk of failover time."""

    loop_wait: float = 1.0
    """Seconds between two HA cycles (renewal by the primary, checks by a backup)."""

    demote_margin: float = 1.0
    """Seconds before its lease could end at which a primary that could not renew has stopped
    acknowledging (clock-rate and stop-time allowance; ha.py has the timing argument)."""

    retained_batches: int = 100_000
    """Batches the primary keeps in memory to catch a returning backup up without a snapshot."""

    retained_bytes: int = 64 * 1024 * 1024
    """Bytes of those batches at most (the older ones leave first)."""

    ack_timeout: float = 5.0
    """Seconds an in-sync backup may leave a batch unacknowledged before it is disconnected and
    no longer holds up sync acknowledgements (it is caught up again when it returns)."""

    catch_up_timeout: float = 60.0
    """Seconds a backup being caught up (a snapshot, or batches from the retained log) may leave
    the primary waiting to write to it with no byte taken by its connection before it is
    disconnected: a peer that asks for a snapshot and reads nothing would hold the primary's
    LevelDB snapshot (disk space compaction cannot reclaim) and the retained batches for ever."""

    max_backups: int = 8
    """Backup connections a primary serves at once (PostgreSQL's max_wal_senders): one past it is
    refused at its HELLO with an ERROR frame naming this key. Each link is a connection, two tasks,
    a pin of the retained log and, while it is copied, a LevelDB snapshot: a peer that can reach the
    address and says HELLO (no secret, no allow_from) must not get them without bound."""

    snapshot_chunk_bytes: int = 1024 * 1024
    """Size of one chunk of a snapshot streamed to a backup: from 1024 to MAX_SNAPSHOT_CHUNK bytes."""

    secret: str = field(default="", repr=False)
    """Shared secret of the cluster, inline: every connection to a replication address (backups,
    ``promote``, ``inspect --replication``) must prove it knows it (HMAC challenge-response,
    replication/auth.py). Empty, and no ``secret_file`` or ``secret_env``: no authentication, as before."""

    secret_file: str = ""
    """A file holding the shared secret (surrounding whitespace stripped), read at start-up: keeps
    the secret out of broker.yaml. Set one of ``secret``, ``secret_file``, ``secret_env``."""

    secret_env: str = ""
    """The name of an environment variable holding the shared secret (its bytes, read as
    ``secret_file``'s: ASCII whitespace around stripped, bytes counted), read at start-up, for
    containers that are handed their secrets that way. Set one of ``secret``, ``secret_file``,
    ``secret_env``."""

    tls: TlsConfig | None = None
    """Mutual TLS on the replication channel and the tools' connections (TlsConfig); absent: plain TCP."""

    handshake_timeout: float = 10.0
    """Seconds a peer of a replication address has for its first frame and, with a secret, the
    whole handshake; a silent peer is disconnected after it."""

    allow_from: list[str] | None = None
    """IP addresses and CIDR networks (IPv4 or IPv6) allowed to connect to this node's replication
    address (a primary's, a backup's for the tools); a connection from any other address is closed
    at accept, before TLS and the handshake, without taking one of the gate's places (gate.py).
    None (absent): any address, as before. A network must not have host bits set (10.0.0.0/24,
    not 10.0.0.1/24); a /0 network is every address of its family (0.0.0.0/0, ::/0); an empty
    list is refused (it would shut out every backup and tool), and so are scoped (fe80::1%eth0)
    and IPv4-mapped (::ffff:10.0.0.2) entries (parse_allow_from)."""

    def allowed_networks(self) -> tuple[Network, ...] | None:
        """``allow_from`` parsed; None: any address may connect."""
        if self.allow_from is None:
            return None
        return parse_allow_from(self.allow_from, "replication.allow_from")

    def __post_init__(self) -> None:
        _check(self, "replication")

    def shared_secret(self) -> bytes | None:
        """The secret as bytes (read from ``secret_file`` or ``secret_env`` when one is set);
        None: no secret."""
        if self.secret_file:
            return read_secret_file(self.secret_file, "replication.secret_file")
        if self.secret_env:
            return read_secret_env(self.secret_env, "replication.secret_env")
        return self.secret.encode("utf-8") if self.secret else None

    @property
    def advertised(self) -> str:
        return self.advertise or self.listen

    @property
    def prefix(self) -> str:
        """Where this cluster's keys live in etcd."""
        return f"/amqtt-durable/{self.cluster}/"

    @classmethod
    def from_mapping(cls, raw: Any, where: str = "replication") -> ReplicationConfig:
        """Build from broker.yaml's ``replication:`` mapping, naming the first bad key (an unknown one
        first, then in the order of the fields, as the constructor; ``where.key``, and the checks after
        coercion name ``replication.key``)."""
        if not isinstance(raw, Mapping):
            raise ConfigError(where, f"expected a mapping of replication settings, got {raw!r}")
        names = [f.name for f in dataclasses.fields(cls)]
        for key in raw:
            refuse_long_key(where, key)
            if key not in names:
                raise ConfigError(f"{where}.{key}", f"unknown setting; accepted settings are {', '.join(names)}")
        return cls(**_coerced(raw, where))


def _coerced(given: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The settings in ``given``, each by from_mapping's rules, in the order of the fields: from_mapping
    and the constructor name the same first bad one, whatever the mapping's order."""
    values: dict[str, Any] = {}
    for item in dataclasses.fields(ReplicationConfig):
        if item.name in given:
            key, value = f"{where}.{item.name}", given[item.name]
            refuse_long_ints(key, value)
            values[item.name] = _coerce(key, value, str(item.type))
    return values


def _coerce_tls(key: str, value: Any) -> TlsConfig | None:
    if isinstance(value, TlsConfig):
        if vars(value).get(READ):  # TlsConfig.from_mapping's, its files read already
            return value
        # given in Python: its fields checked as a mapping's, its files read
        value = {name: item for name, item in dataclasses.asdict(value).items() if name != "key" or item != ""}
    return None if value is None else TlsConfig.from_mapping(value, key)


def _coerce(key: str, value: Any, kind: str) -> Any:
    if kind == "TlsConfig | None":
        return _coerce_tls(key, value)
    if kind in ("int", "float"):
        return SCALARS[kind](key, value)  # the plugin's own rules for numbers
    if kind.startswith("list[str]"):
        return _coerce_list(key, value, kind)
    choices = {"Role": ROLES, "Mode": MODES}.get(kind)
    if choices is not None:
        if value in choices:
            return value
        raise ConfigError(key, f"expected one of {', '.join(choices)}, got {value!r}")
    if key.endswith(".secret_file") and value != "":  # "": its default, no file
        return _file_path(key, value)
    if isinstance(value, str):
        return _text(key, value)
    if key.endswith((".secret", ".secret_env")):  # never echoed: a secret YAML read as a number (pasted
        # in place of the variable's name, for secret_env) is still the secret; broker.yaml's 1.0e+400 is a float
        kind = "float" if isinstance(value, WrittenFloat) else type(value).__name__
        raise ConfigError(key, f"expected text, got a value of type {kind} (quote it in YAML)")
    raise ConfigError(key, f"expected text, got {value!r}")


def _text(key: str, value: str) -> str:
    """``value``, or a ConfigError naming ``key`` when it holds a lone surrogate (YAML's "\\ud800"),
    which no UTF-8 encoding carries: the secret, a name or a path would fail later, when it is
    hashed, sent or opened, instead of at the settings check. The value is not shown: it may be
    the secret."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ConfigError(
            key, f"holds a lone surrogate (\\u{ord(value[exc.start]):04x}), which is not valid text (UTF-8)"
        ) from None
    return value


def _coerce_list(key: str, value: Any, kind: str) -> list[str]:
    if isinstance(value, tuple):  # given in Python, held as a list (as streams)
        value = list(value)
    if kind == "list[str] | None":  # allow_from: an explicit null is refused too (it does not mean "any address")
        parse_allow_from(value, key)
        return list(value)
    if isinstance(value, str):  # coordinator: one URL, or a list of them
        value = [value]
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return [_text(key, item) for item in value]
    raise ConfigError(key, f"expected a list of URLs, got {value!r}")


def _address(key: str, value: str) -> None:
    try:
        split_host_port(value)
    except ValueError as exc:
        raise ConfigError(key, f"{exc}, got {value!r}") from None


def _check(config: ReplicationConfig, where: str) -> None:
    def bad(key: str, problem: str) -> ConfigError:
        return ConfigError(f"{where}.{key}", problem)

    # a ReplicationConfig made in Python: from_mapping's rules for each field (again for one from_mapping made;
    # the TlsConfig it built is not read again); None is tls's and allow_from's default: absent
    given = {item.name: getattr(config, item.name) for item in dataclasses.fields(config)}
    given = {name: value for name, value in given.items() if value is not None or name not in ("tls", "allow_from")}
    for name, value in _coerced(given, where).items():
        object.__setattr__(config, name, value)  # frozen: set as __init__ does
    _check_addresses(config, where)
    _check_roles(config, where, bad)
    _check_timing(config, bad)
    _check_sizes(config, bad)
    _check_secret(config, where, bad)
    if config.allow_from is not None:
        parse_allow_from(config.allow_from, f"{where}.allow_from")


ALLOW_FROM_EXAMPLE = 'e.g. [10.0.0.2, 10.0.1.0/24, "2001:db8::/64"]'
IPV4_MAPPED = ipaddress.IPv6Network("::ffff:0:0/96")


def parse_allow_from(entries: Any, key: str) -> tuple[Network, ...]:
    """``replication.allow_from``'s networks (an address alone is its /32 or /128), or a
    ConfigError naming ``key`` and the bad entry: not a list, an empty list, an entry that is not
    text, not an IP address or network, a network with host bits set (10.0.0.1/24: strict, since
    it may mean the host 10.0.0.1/32 as well as the network 10.0.0.0/24), a scoped IPv6 entry
    (fe80::1%eth0: a peer is matched by its address, so the zone would be ignored), or an
    IPv4-mapped one (::ffff:10.0.0.2: asyncio's IPv6 listeners are IPv6-only, so an IPv4 peer is
    always seen as its IPv4 address and such an entry would match nobody)."""
    if not isinstance(entries, list):
        raise ConfigError(
            key, f"expected a list of IP addresses or CIDR networks ({ALLOW_FROM_EXAMPLE}), got {entries!r}"
        )
    if not entries:
        raise ConfigError(
            key,
            "an empty list would refuse every backup and tool: list their addresses, or leave allow_from out "
            "to let any address connect",
        )
    networks: list[Network] = []
    for entry in entries:
        if not isinstance(entry, str):
            raise ConfigError(key, f"expected an IP address or CIDR network, got {entry!r} (quote it in YAML)")
        if "%" in entry:
            address, _, zone = entry.partition("%")
            _, slash, prefix = zone.partition("/")
            raise ConfigError(
                key,
                f"{entry!r} has a zone (%...), which allow_from cannot check (a peer is matched by its address "
                f"alone): write {address}{slash}{prefix}, which matches that address on every interface",
            )
        try:
            network = ipaddress.ip_network(entry)
        except ValueError as exc:
            raise ConfigError(key, _bad_network(entry)) from exc
        if isinstance(network, ipaddress.IPv6Network) and network.subnet_of(IPV4_MAPPED):
            mapped = ipaddress.IPv4Network((int(network.network_address) & 0xFFFFFFFF, network.prefixlen - 96))
            raise ConfigError(
                key,
                f"{entry!r} is an IPv4-mapped IPv6 address, which no peer has (asyncio's IPv6 listeners take "
                f"IPv6 peers only: an IPv4 peer is seen as its IPv4 address): write the IPv4 "
                f"{mapped.network_address if mapped.prefixlen == 32 else mapped}",
            )
        networks.append(network)
    return tuple(networks)


def _bad_network(entry: str) -> str:
    try:
        network = ipaddress.ip_network(entry, strict=False)
    except ValueError:
        return f"{entry!r} is not an IP address or CIDR network ({ALLOW_FROM_EXAMPLE})"
    address = entry.partition("/")[0]
    if network.prefixlen == 0:
        return (
            f"{entry!r} has host bits set, and a /0 network would be every IPv{network.version} address: write the "
            f"single address {address}, or the network you mean with its own prefix"
        )
    return f"{entry!r} has host bits set: write the network {network} or the single address {address}"


MIN_SECRET = 16
"""The shortest secret accepted (characters inline; bytes in a file or an environment variable)."""
MAX_SECRET = 64 * 1024
"""The longest secret a file or an environment variable may hold, in bytes."""
SECRET_ADVICE = (
    "a long random string, not a password: e.g. the output of openssl rand -hex 32 "
    "(anyone who reaches a replication address can test guesses of it offline)"
)


def read_secret_file(path: str, key: str) -> bytes:
    """The secret in ``path``, stripped; a ConfigError naming ``key`` when it cannot be read, is
    empty, is longer than ``MAX_SECRET`` bytes or is shorter than ``MIN_SECRET`` bytes."""
    try:
        with open(path, "rb") as handle:
            secret = handle.read(MAX_SECRET + 1).strip()
    except OSError as exc:
        raise ConfigError(key, f"cannot read the secret file {path!r}: {exc.strerror or exc}") from exc
    except ValueError as exc:  # a NUL in the path
        raise ConfigError(key, f"cannot read the secret file {path!r}: {exc}") from exc
    return _checked_secret(secret, key, f"the secret file {path!r}", repr(path))


def _checked_secret(secret: bytes, key: str, source: str, where: str) -> bytes:
    """``secret`` (read from ``source``, shown as ``where`` in 'the secret in ...'), or a ConfigError
    naming ``key`` when it is empty, longer than ``MAX_SECRET`` or shorter than ``MIN_SECRET`` bytes."""
    if not secret:
        raise ConfigError(key, f"{source} is empty")
    if len(secret) > MAX_SECRET:
        raise ConfigError(key, f"{source} is larger than 64 KiB")
    if len(secret) < MIN_SECRET:
        raise ConfigError(
            key, f"the secret in {where} must be at least {MIN_SECRET} bytes, not {len(secret)} ({SECRET_ADVICE})"
        )
    return secret


ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
"""What replication.secret_env accepts: a portable environment variable name (POSIX shells'); anything
else is refused without being shown, as it may be the secret pasted in place of the name."""


def read_secret_env(name: str, key: str) -> bytes:
    """The secret in the environment variable ``name``, read and stripped exactly as read_secret_file
    reads a file (bytes, ASCII whitespace stripped, bytes counted), so the same secret in a file on
    one node and in a variable on another always matches; a ConfigError naming ``key`` and ``name``
    (never the value) when it is not set, is empty, is longer than ``MAX_SECRET`` bytes (as a file) or is
    shorter than ``MIN_SECRET`` bytes."""
    if not ENV_NAME.fullmatch(name):  # not echoed: it may be the secret itself, pasted in its place
        raise ConfigError(
            key, "expected the name of an environment variable (letters, digits and _, not starting with a digit)"
        )
    value = os.environb.get(name.encode("ascii"))  # its own bytes, whatever the locale
    if value is None:
        raise ConfigError(key, f"the environment variable {name!r} is not set")
    source = f"the environment variable {name!r}"
    return _checked_secret(value.strip(), key, source, source)  # stripped as a file's: ASCII whitespace, bytes


SECRET_KEYS = ("secret", "secret_file", "secret_env")


def _check_secret(config: ReplicationConfig, where: str, bad: Callable[[str, str], ConfigError]) -> None:
    given = [key for key in SECRET_KEYS if getattr(config, key)]
    if len(given) > 1:
        raise bad(given[-1], f"set one of {', '.join(SECRET_KEYS)}, not {' and '.join(given)}")
    if config.secret and len(config.secret) < MIN_SECRET:
        raise bad("secret", f"must be at least {MIN_SECRET} characters ({SECRET_ADVICE})")
    if len(config.secret.encode("utf-8")) > MAX_SECRET:  # as a file's or a variable's
        raise bad("secret", "is larger than 64 KiB (in UTF-8)")
    if config.secret_file:
        read_secret_file(config.secret_file, f"{where}.secret_file")
    if config.secret_env:
        read_secret_env(config.secret_env, f"{where}.secret_env")
    if not math.isfinite(config.handshake_timeout) or config.handshake_timeout <= 0:
        raise bad("handshake_timeout", f"must be a finite number of seconds above 0, got {config.handshake_timeout!r}")


def _check_addresses(config: ReplicationConfig, where: str) -> None:
    _address(f"{where}.listen", config.listen)
    if config.advertise:
        _address(f"{where}.advertise", config.advertise)


def _check_names(config: ReplicationConfig, bad: Callable[[str, str], ConfigError]) -> None:
    """``name`` and ``cluster``, with fixed roles too (as documented)."""
    if name_problem(config.name):
        raise bad(
            "name",
            f"{config.name[:80]!r}: a name without '/', '+', '#' or a control character, at most {NAME_MAX_BYTES} "
            "bytes of UTF-8 (it is one level of the $SYS topics replication/backup/<name>/... and of the etcd key "
            "members/<name>)",
        )
    if not config.cluster or "/" in config.cluster:
        raise bad("cluster", f"expected a name, not empty and without '/', got {config.cluster!r}")


def _check_roles(config: ReplicationConfig, where: str, bad: Callable[[str, str], ConfigError]) -> None:
    _check_names(config, bad)
    for url in config.coordinator:
        _coordinator_url(url, bad)
    if config.coordinator:
        if config.role != "auto":
            raise bad("role", f"must be auto with a coordinator (its lease picks the primary), not {config.role!r}")
        if not config.name:
            raise bad("name", "needed with a coordinator: this broker's unique name in the cluster")
    elif config.role == "auto":
        raise bad("role", "auto needs a coordinator (etcd endpoints); without one, set primary or backup")
    if config.role == "backup" and not config.primary:
        raise bad("primary", "needed on a backup without a coordinator: the primary's host:port")
    if config.primary:
        if config.coordinator:  # the leader key names the primary: this one would be ignored
            raise bad("primary", "a fixed-role backup's setting: with a coordinator, its lease names the primary")
        _address(f"{where}.primary", config.primary)  # on role: primary too (kept for a later role: backup)
        if config.role == "backup" and _as_written(config.primary) in (
            _as_written(config.listen),
            _as_written(config.advertise) if config.advertise else None,
        ):
            raise bad("primary", f"{config.primary!r} is this node's own replication address (listen or advertise): "
                      "give the primary's replication.listen")  # fmt: skip


def _as_written(address: str) -> tuple[str, int]:
    """(host, port) of a checked address for comparing two: the host as written but for its case
    (``DB1`` is ``db1``); a name is not resolved (``localhost`` is not ``127.0.0.1``)."""
    host, port = split_host_port(address)
    return host.lower(), port


def _coordinator_url(url: str, bad: Callable[[str, str], ConfigError]) -> None:
    """An etcd client URL: http://host[:port], the port (2379 when left out) from 1 to 65535; a
    malformed one (an unclosed IPv6 bracket, a port that is not a number, a host in non-ASCII
    characters: etcd.py's Host header is ASCII) is refused here, not when etcd.py first connects,
    and so is one with parts etcd.py would ignore (a user or password: it sends no credentials; a
    path, query or fragment: it calls /v3/... on host:port)."""
    usage = f"expected etcd client URLs like http://127.0.0.1:2379, got {url!r}"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:  # urlsplit: "Invalid IPv6 URL"; .port: not a number, or out of range
        raise bad("coordinator", f"{usage} ({exc})") from None
    if parts.scheme != "http" or not parts.hostname:
        raise bad("coordinator", usage)
    try:
        parse_host(parts.hostname)  # a space or NUL in it: urlsplit keeps them
    except ValueError as exc:
        raise bad("coordinator", f"{usage} ({exc})") from None
    if port == 0:
        raise bad("coordinator", f"{usage} (port 0)")
    if not parts.netloc.isascii():  # etcd.py's Host header (netloc, not the lower-cased hostname: K, U+212A) is ASCII
        raise bad("coordinator", f"{usage} (a host in non-ASCII characters: write an internationalised name "
                  "in its ASCII xn-- form)")  # fmt: skip
    if "@" in parts.netloc:  # etcd.py sends no credentials: a user or password here would be ignored
        raise bad("coordinator", f"{usage} (a user or password in the URL: etcd authentication is not supported)")
    if parts.path not in ("", "/") or parts.query or parts.fragment or url.endswith(("?", "#")):
        raise bad("coordinator", f"{usage} (a path, query or fragment, which would be ignored: host and port only)")


def _check_timing(config: ReplicationConfig, bad: Callable[[str, str], ConfigError]) -> None:
    if config.lease_ttl < MIN_LEASE_TTL:
        raise bad("lease_ttl", f"must be at least {MIN_LEASE_TTL} s (etcd's shortest lease), got {config.lease_ttl}")
    if config.lease_ttl > MAX_LEASE_TTL:
        raise bad("lease_ttl", f"must be at most {MAX_LEASE_TTL} s (etcd's longest lease), got {config.lease_ttl}")
    for key in ("loop_wait", "demote_margin", "ack_timeout", "catch_up_timeout"):
        value = getattr(config, key)
        if not math.isfinite(value) or value <= 0:
            raise bad(key, f"must be a finite number of seconds above 0, got {value!r}")
    if config.demote_margin >= config.lease_ttl:
        raise bad("demote_margin", f"must be below lease_ttl ({config.lease_ttl}), got {config.demote_margin}")
    # In decimal, as the numbers were written: in binary floating point 2 * 0.45 > 2 - 1.1, which refused
    # loop_wait 0.45 with lease_ttl 2 and demote_margin 1.1 as "at most ... = 0.45 s, got 0.45".
    # Exactly (Fraction): 28-digit decimals took (9000000000 - 1e-300) / 2 for 4.5e9.
    bound = (_written(config.lease_ttl) - _written(config.demote_margin)) / 2
    if _written(config.loop_wait) > bound:
        with localcontext() as context:  # 28 digits rounded down: a bound rounded up could equal the value refused
            context.rounding = ROUND_FLOOR
            shown = Decimal(bound.numerator) / Decimal(bound.denominator)
        raise bad(
            "loop_wait",
            f"must be at most (lease_ttl - demote_margin) / 2 = {shown.normalize():f} s "
            f"so a primary gets two renewal attempts before it must step down, got {config.loop_wait}",
        )


def _written(number: float) -> Fraction:
    """A setting's number as broker.yaml wrote it, exactly: repr is the shortest decimal that reads back as it."""
    return Fraction(repr(number))


def _check_sizes(config: ReplicationConfig, bad: Callable[[str, str], ConfigError]) -> None:
    for key in ("retained_batches", "max_backups"):
        if getattr(config, key) < 1:
            raise bad(key, f"must be at least 1, got {getattr(config, key)}")
    for key in ("retained_bytes", "snapshot_chunk_bytes"):
        if getattr(config, key) < 1024:
            raise bad(key, f"must be at least 1024 bytes, got {getattr(config, key)}")
    if config.snapshot_chunk_bytes > MAX_SNAPSHOT_CHUNK:
        raise bad(
            "snapshot_chunk_bytes",
            f"must be at most {MAX_SNAPSHOT_CHUNK} bytes (half the largest frame a backup reads: a chunk ends with "
            f"the row that reaches the setting), got {config.snapshot_chunk_bytes}",
        )
