"""Who is primary: the coordinator interface (Patroni's dcs model), one backend per module.

The HA loop (ha.py) never speaks a backend's API: it asks this interface for the leader, for
the leader lease, for the members' published positions (Patroni's /members keys: the most
advanced backup takes over) and (sync mode) for the synchronous set: the backups the primary
waits for before acknowledging, the only ones that may take over without losing an
acknowledged publish. The lease is the only authority: a node is primary exactly while it holds the
leader key under a lease with a time to live (TTL) that the coordination service expires by
itself when the holder stops renewing. Backends: etcd.py (etcd v3). Tests fake the
coordinator at this interface.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, TypeVar

from durable_protocol.jsontext import json_kind, json_object

_Value = TypeVar("_Value")


def read_record(raw: bytes) -> dict[str, Any]:
    """A record read from outside the process (a coordinator's, a node's answer to a tool): its JSON object,
    NaN, Infinity and numbers past a float's range refused; a ValueError saying what is wrong otherwise."""
    return json_object(raw, finite=True)


def record_field(data: dict[str, Any], key: str, kind: type[_Value], default: _Value | None = None) -> _Value:
    """``data[key]`` when it is a ``kind`` (an int that is not a bool, a str, a list of str), else ``default``
    when one is given and the key is absent; a ValueError naming the key otherwise (a record from outside
    the process: a KeyError, TypeError or OverflowError where it is used would end the HA loop)."""
    if key not in data:
        if default is None:
            raise ValueError(f"no '{key}'")
        return default
    value = data[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"'{key}' is not {_KINDS[kind]}: {_shown(value)}")
    if kind is list and not all(isinstance(item, str) for item in data[key]):
        raise ValueError(f"'{key}' is not {_KINDS[list]}: {_shown(value)}")
    return value


_KINDS = {int: "an integer", str: "a string", bool: "a boolean", list: "an array of strings"}
"""What record_field asks of a field, in JSON's words (whoever wrote the record reads the error)."""


def _shown(value: object) -> str:
    """``value`` as a record's error shows it: what it is in JSON's words, and a boolean's, number's or text's
    first characters as JSON writes them (``true``, not Python's ``True``)."""
    kind = json_kind(value)
    return f"{kind} {json.dumps(value)[:40]}" if isinstance(value, int | float | str) else kind


@dataclass(frozen=True, slots=True)
class Leader:
    """The node holding the leader lease and where its backups reach it."""

    name: str
    address: str
    """host:port of the primary's replication listener."""
    term: int = field(default=0, compare=False)
    """Which of its terms: a number the coordinator gives each taking of the lease, larger for a
    later one (etcd: the leader key's create_revision); 0 where unknown (a node's own ``me``, a
    record of an earlier version). Not part of the encoded record nor of equality."""

    def encode(self) -> bytes:
        return json.dumps({"name": self.name, "address": self.address}, sort_keys=True).encode("utf-8")

    @classmethod
    def decode(cls, raw: bytes) -> Leader:
        data = read_record(raw)
        return cls(record_field(data, "name", str), record_field(data, "address", str))


@dataclass(frozen=True, slots=True)
class Member:
    """What one node publishes about itself every HA cycle (under its own short lease)."""

    name: str
    role: str
    """"primary" or "backup"."""
    store_id: int
    seq: int
    """The last batch its store holds: the primary's newest, a backup's last applied."""
    candidate: bool
    """A backup that may take over: caught up with the last primary, and its last promotion
    did not fail. Only candidates hold the others back (ha.ahead_of)."""
    address: str = ""
    """Its replication address (replication.advertise or listen); "" in an earlier version's record."""
    promotion_failed: bool = False
    """Its last promotion failed (the store would not load, the port was taken): after a full stop
    of the group it holds no other node that may take over back (ha.py). False in an earlier
    version's record."""

    def encode(self) -> bytes:
        record = {
            "name": self.name, "role": self.role, "store_id": self.store_id, "batch": self.seq,
            "candidate": self.candidate, "address": self.address, "promotion_failed": self.promotion_failed,
        }  # fmt: skip
        return json.dumps(record, sort_keys=True).encode("utf-8")

    @classmethod
    def decode(cls, raw: bytes) -> Member:
        data = read_record(raw)
        return cls(
            record_field(data, "name", str),
            record_field(data, "role", str),
            record_field(data, "store_id", int),
            record_field(data, "batch", int),
            record_field(data, "candidate", bool),
            record_field(data, "address", str, ""),
            record_field(data, "promotion_failed", bool, False),
        )


class Coordinator(ABC):
    """A leader lease in a coordination service. Every method may raise CoordinatorError
    (unreachable, refused); callers bound each call with a timeout of their own."""

    ttl: float
    """Seconds the service keeps the lease after its last renewal."""

    @abstractmethod
    async def leader(self) -> Leader | None:
        """The current lease holder, None when nobody holds it."""

    @abstractmethod
    async def acquire(self, me: Leader) -> bool:
        """Take the leader key under a new lease if nobody holds it; False if somebody does, or
        if it was taken (by any node) since this coordinator's last ``leader()``, when that call
        found nobody (and given up again: a term the decision's reads never saw, whose primary
        may have acknowledged publishes this node lacks). ``me`` becomes the last primary
        (``former_primaries``) in the same atomic step. The synchronous set an earlier primary
        published is left as it is (a primary in async mode deletes it with
        ``publish_sync(me, None)`` once its promotion succeeded)."""

    @abstractmethod
    async def renew(self, me: Leader) -> bool:
        """Renew our lease; False when it is gone (expired, or the key names another node)."""

    @abstractmethod
    async def release(self, me: Leader) -> None:
        """Give the lease up at once (a clean stop: a backup need not wait for the TTL)."""

    @abstractmethod
    async def initialize(self, name: str) -> bool:
        """Claim the cluster's bootstrap once ever (True for the one caller that did): the
        first primary of a new cluster is the node that claims it, not one that is caught up."""

    @abstractmethod
    async def publish_sync(self, me: Leader, members: frozenset[str] | None) -> bool:
        """As the leader (checked atomically), record the backups that hold every acknowledged
        batch (Patroni's /sync key) with the leader's name and term (of its last ``acquire``), or
        with None delete the record (async mode: nobody but ``me`` holds what it acknowledges);
        False when ``me`` is not the leader."""

    @abstractmethod
    async def former_primaries(self) -> frozenset[tuple[str, int]]:
        """The nodes that held the leader lease last, each with the term it held it in (as
        ``Leader.term``; 0 in a record of an earlier version), kept after their leases ended: the
        last node to take it (recorded with it, Patroni's leader history) and the leader that last
        published the synchronous set. Empty when neither was ever recorded (a new cluster;
        one of an earlier version in async mode). After a full stop of the group they, with the
        synchronous set, are the nodes that may take over without being caught up (ha.py)."""

    @abstractmethod
    async def sync_members(self) -> frozenset[str] | None:
        """The backups last recorded by ``publish_sync``; None when none was ever recorded
        (async mode): then any caught-up backup may be promoted."""

    @abstractmethod
    async def publish_member(self, member: Member) -> None:
        """Write this node's record under its own lease of ``ttl`` seconds and renew that lease
        (a new one when it expired): called every cycle, so the record outlives the node by at
        most ``ttl``. The record's key is the member's name: one another broker wrote under that
        name, at another address, is left as it is, and MemberNameTakenError names it (a record
        at this node's address, or without one, is this node's from before it restarted: it is
        taken over)."""

    @abstractmethod
    async def members(self) -> list[Member]:
        """The records of the live members (an expired record is gone), this node's included."""

    @abstractmethod
    async def withdraw_member(self) -> None:
        """Remove this node's record at once (a clean stop)."""
