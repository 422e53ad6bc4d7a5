"""The etcd v3 backend of the coordinator, over etcd's JSON gateway (plain HTTP/1.0).

Why not a client library: etcd3 (grpc) is unmaintained since 2020 and pins old protobuf;
etcd3gw (OpenStack) is maintained but synchronous (requests, futurist, pbr), so every call
would need a worker thread and its timeouts are per socket operation, not per call. The
gateway calls a leader lease and the members' records need (lease grant, keepalive, revoke,
range, put, txn) are JSON POSTs to ``/v3/...``; here each is one HTTP/1.0 request on asyncio
streams, bounded by one ``asyncio.timeout`` for the whole call, which the lease timing relies
on (ha.py). No dependency is added. Tested against Debian's etcd-server 3.4.23.

Keys (under ``prefix``, e.g. ``/amqtt-durable/<cluster>/``)::

    leader      -> {"name": ..., "address": ...}   put with the leader's lease (expires with it);
                   its create_revision is the holder's term (``Leader.term``)
    primary     -> the same, put in the same transaction as ``leader`` but without a lease: the
                   last node that took the lease, kept after it ended (a full stop's election);
                   its mod_revision is that term
    initialize  -> name of the node that bootstrapped the cluster (no lease, never removed)
    sync        -> {"leader": ..., "term": ..., "members": [...]}  the synchronous set, written only by the
                   leader (a transaction comparing the leader key's value), no lease; deleted
                   by a node in async mode (the same leader comparison) once its promotion succeeded
    members/<name> -> {"name", "role", "store_id", "batch", "candidate", "address",
                   "promotion_failed"}  each node's
                   position, put every cycle under the node's own member lease (TTL ``ttl``,
                   renewed each cycle): a node that stops cycling drops out by itself. Put only
                   where absent, under the node's own lease, or at its address (its own from
                   before a restart): another broker's record under the name is left alone

The leader key is created only if absent (a transaction comparing its create_revision to 0,
Patroni's etcd3 ``attempt_to_acquire_leader``), so two nodes never both hold it; and only if the
``primary`` key was not written since the node's last ``leader()`` found no leader (its
mod_revision below that read's revision), so a node never takes the lease on reads that a whole
term of another node (taken and given up between them) made stale.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from collections.abc import Callable, Iterator
from typing import Any, TypeVar
from urllib.parse import urlsplit

from .coordinator import Coordinator, Leader, Member, read_record, record_field
from .errors import CoordinatorError, MalformedRecordError, MemberNameTakenError, ReplicationError
from .tool import split_peer_address

REQUEST_TIMEOUT = 2.0
"""Seconds one gateway call may take (callers may bound it tighter)."""


_Record = TypeVar("_Record")


class _Reply(dict[str, Any]):
    """etcd's reply to one call, with the endpoint that sent it (an error reading it names that one)."""

    endpoint = ""


@contextlib.contextmanager
def _reading(reply: _Reply) -> Iterator[None]:
    """Reading fields of ``reply``: one of another shape than etcd's (a JSON object without its fields, or
    with fields of other types: a KeyError, TypeError, ValueError, AttributeError or IndexError, which would
    end the HA loop) is a CoordinatorError naming the endpoint that sent it, as no answer is. Only the
    reading: an error of this module's own code elsewhere is raised as it is."""
    try:
        yield
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        detail = f"answered no reply of etcd's shape ({type(exc).__name__}: {exc})"
        raise CoordinatorError(reply.endpoint, detail) from None


def _b64(raw: bytes | str) -> str:
    return base64.b64encode(raw.encode("utf-8") if isinstance(raw, str) else raw).decode("ascii")


class EtcdCoordinator(Coordinator):
    """A leader lease in etcd; ``endpoints`` are tried in order (``http://host:port``)."""

    def __init__(self, endpoints: list[str], *, prefix: str, ttl: float, timeout: float = REQUEST_TIMEOUT) -> None:
        if not endpoints:
            raise ValueError("at least one etcd endpoint is needed")
        self.endpoints = endpoints
        self.prefix = prefix if prefix.endswith("/") else prefix + "/"
        self.ttl = ttl
        self.timeout = timeout
        self.lease_id: int | None = None
        self.term = 0
        """The revision of this node's last acquire (its leader key's create_revision)."""
        self._no_leader_at: int | None = None
        """etcd's revision when ``leader()`` last found no leader (None: it found one, or never ran)."""
        self._leader_key = _b64(self.prefix + "leader")
        self._init_key = _b64(self.prefix + "initialize")
        self._sync_key = _b64(self.prefix + "sync")
        self._primary_key = _b64(self.prefix + "primary")
        self.member_lease: int | None = None
        self._members_from = _b64(self.prefix + "members/")
        self._members_end = _b64(self.prefix + "members0")  # "/" + 1: the range of every members/ key

    # --- the interface ----------------------------------------------------------------------

    async def leader(self) -> Leader | None:
        reply = await self._call("/v3/kv/range", {"key": self._leader_key})
        with _reading(reply):
            kvs = reply.get("kvs") or []
            revision = reply.get("header", {}).get("revision")
            # no revision in the reply (not from a real etcd): no compare, rather than one that always fails
            self._no_leader_at = None if kvs or revision is None else int(revision)
            if not kvs:
                return None
            return _term(_decoded(reply, kvs[0], _leader), kvs[0].get("create_revision"))

    async def acquire(self, me: Leader) -> bool:
        grant = await self._call("/v3/lease/grant", {"TTL": max(1, round(self.ttl))})
        with _reading(grant):
            lease = int(grant["ID"])
        put = {"key": self._leader_key, "value": _b64(me.encode()), "lease": str(lease)}
        taken = _create_if_absent(self._leader_key, put)
        if self._no_leader_at is not None:
            # Nobody took the lease since leader() found none (a node that took it and gave it back
            # meanwhile, a term this node's reads never saw, rewrote ``primary``): else no acquire.
            since = str(self._no_leader_at + 1)
            unchanged = {"key": self._primary_key, "target": "MOD", "result": "LESS", "mod_revision": since}
            taken["compare"].append(unchanged)
        taken["success"].append({"request_put": {"key": self._primary_key, "value": _b64(me.encode())}})
        reply = await self._call("/v3/kv/txn", taken)
        with _reading(reply):
            taken_at = int(reply["header"]["revision"]) if reply.get("succeeded") else None
        if taken_at is not None:
            self.lease_id, self.term = lease, taken_at  # the leader key's create_revision
            return True
        await self._call("/v3/lease/revoke", {"ID": str(lease)})
        return False

    async def renew(self, me: Leader) -> bool:
        if self.lease_id is None:
            return False
        if not _alive(await self._call("/v3/lease/keepalive", {"ID": str(self.lease_id)})):
            self.lease_id = None
            return False
        holder = await self._call("/v3/kv/range", {"key": self._leader_key})
        with _reading(holder):
            kvs = holder.get("kvs") or []
            if not kvs or int(kvs[0].get("lease", 0)) != self.lease_id:
                return False
            return _decoded(holder, kvs[0], Leader.decode) == me

    async def release(self, me: Leader) -> None:
        if self.lease_id is None:
            return
        lease, self.lease_id = self.lease_id, None
        await self._call("/v3/lease/revoke", {"ID": str(lease)})  # deletes the leader key with it

    async def initialize(self, name: str) -> bool:
        put = {"key": self._init_key, "value": _b64(name)}
        reply = await self._call("/v3/kv/txn", _create_if_absent(self._init_key, put))
        return bool(reply.get("succeeded"))

    async def publish_sync(self, me: Leader, members: frozenset[str] | None) -> bool:
        if members is None:
            write: dict[str, Any] = {"request_delete_range": {"key": self._sync_key}}
        else:
            record = json.dumps({"leader": me.name, "term": self.term, "members": sorted(members)}).encode("utf-8")
            write = {"request_put": {"key": self._sync_key, "value": _b64(record)}}
        reply = await self._call(
            "/v3/kv/txn",
            {
                "compare": [
                    {"key": self._leader_key, "target": "VALUE", "result": "EQUAL", "value": _b64(me.encode())}
                ],
                "success": [write],
            },
        )
        return bool(reply.get("succeeded"))

    async def sync_members(self) -> frozenset[str] | None:
        record = await self._sync_record()
        return None if record is None else record[2]

    async def former_primaries(self) -> frozenset[tuple[str, int]]:
        terms = set()
        reply = await self._call("/v3/kv/range", {"key": self._primary_key})
        with _reading(reply):
            for kv in reply.get("kvs") or []:
                # Written in acquire's transaction: its mod_revision is that leader key's create_revision.
                terms.add((_decoded(reply, kv, Leader.decode).name, int(kv.get("mod_revision", 0))))
        record = await self._sync_record()
        if record is not None:
            terms.add(record[:2])
        return frozenset(terms)

    async def _sync_record(self) -> tuple[str, int, frozenset[str]] | None:
        reply = await self._call("/v3/kv/range", {"key": self._sync_key})
        with _reading(reply):
            kvs = reply.get("kvs") or []
            return _decoded(reply, kvs[0], _sync) if kvs else None

    async def publish_member(self, member: Member) -> None:
        if self.member_lease is not None and not _alive(
            await self._call("/v3/lease/keepalive", {"ID": str(self.member_lease)})
        ):
            self.member_lease = None  # expired (the node was stopped, or cut off): a new one
        if self.member_lease is None:
            grant = await self._call("/v3/lease/grant", {"TTL": max(1, round(self.ttl))})
            with _reading(grant):
                self.member_lease = int(grant["ID"])
        key = _b64(self.prefix + "members/" + member.name)
        put = {"request_put": {"key": key, "value": _b64(member.encode()), "lease": str(self.member_lease)}}
        for compare in (
            {"key": key, "target": "LEASE", "result": "EQUAL", "lease": str(self.member_lease)},  # ours already
            {"key": key, "target": "CREATE", "result": "EQUAL", "create_revision": "0"},  # nobody's
        ):
            reply = await self._call(
                "/v3/kv/txn", {"compare": [compare], "success": [put], "failure": [{"request_range": {"key": key}}]}
            )
            with _reading(reply):
                if reply.get("succeeded"):
                    return
                kvs = (reply.get("responses") or [{}])[0].get("response_range", {}).get("kvs") or []
                holder = _member(kvs[0], member.name) if kvs else None
            if holder is not None:
                if holder.address and holder.address != member.address:
                    raise MemberNameTakenError(holder)
                # At this node's address (or from an earlier version, which does not say): this node
                # before it restarted, its record not expired yet; it is this node's from now on.
                await self._call("/v3/kv/put", put["request_put"])
                return
        # Created and gone again between the two transactions (a record that just expired): the next cycle
        raise CoordinatorError(reply.endpoint, f"members/{member.name} changed while it was written")

    async def members(self) -> list[Member]:
        reply = await self._call("/v3/kv/range", {"key": self._members_from, "range_end": self._members_end})
        found = []
        with _reading(reply):
            for kv in reply.get("kvs") or []:
                try:
                    found.append(Member.decode(base64.b64decode(kv.get("value", ""))))
                except ValueError:
                    continue  # not a record this version writes: it counts as absent
        return found

    async def withdraw_member(self) -> None:
        if self.member_lease is None:
            return
        lease, self.member_lease = self.member_lease, None
        await self._call("/v3/lease/revoke", {"ID": str(lease)})  # deletes the record with it

    # --- HTTP -------------------------------------------------------------------------------

    async def _call(self, path: str, body: dict[str, Any]) -> _Reply:
        errors = []
        for endpoint in self.endpoints:
            try:
                async with asyncio.timeout(self.timeout):
                    reply = _Reply(await _post(endpoint, path, body))
                reply.endpoint = endpoint
                return reply
            except (OSError, TimeoutError, ValueError) as exc:
                errors.append(f"{endpoint}: {type(exc).__name__}: {exc}")
        raise CoordinatorError(", ".join(self.endpoints), f"{path} failed ({'; '.join(errors)})")


def _decoded(reply: _Reply, kv: dict[str, Any], decode: Callable[[bytes], _Record]) -> _Record:
    """The record in ``kv`` (a range result of ``reply``); one this version cannot read is a CoordinatorError
    naming the endpoint that sent it and its key, as an unreadable answer is (a ValueError would end the HA loop)."""
    try:
        return decode(base64.b64decode(kv.get("value", "")))
    except ValueError as exc:
        raise MalformedRecordError(reply.endpoint, _key(kv), str(exc)) from None


def _alive(keepalive: _Reply) -> bool:
    """Whether a lease ``keepalive`` renewed still lives (a TTL left)."""
    with _reading(keepalive):
        return int(keepalive.get("result", {}).get("TTL", 0)) > 0


def _term(leader: Leader, revision: object) -> Leader:
    """``leader`` with the term its key's ``revision`` (a create_revision) gives it."""
    return Leader(leader.name, leader.address, int(str(revision or 0)))


def _member(kv: dict[str, Any], name: str) -> Member:
    """The record in ``kv`` (a range result), or one that says only its name when it does not decode."""
    try:
        return Member.decode(base64.b64decode(kv.get("value", "")))
    except ValueError:
        return Member(name, "?", 0, 0, False)


def _leader(raw: bytes) -> Leader:
    """The ``leader`` record, its address one a backup can follow (split_peer_address reads it): one that is
    not (``nonsense``, ``127.0.0.1:99999``) is malformed, as a field of another type is, not an error that
    ends the HA loop when the node follows it."""
    leader = Leader.decode(raw)
    try:
        split_peer_address(leader.address, "the record")
    except ReplicationError as exc:
        raise ValueError(str(exc)) from None
    return leader


def _sync(raw: bytes) -> tuple[str, int, frozenset[str]]:
    """The ``sync`` record's leader, its term (0 in an earlier release's record, which has none) and members."""
    data = read_record(raw)
    members = record_field(data, "members", list)
    return record_field(data, "leader", str), record_field(data, "term", int, 0), frozenset(members)


def _key(kv: dict[str, Any]) -> str:
    """The key of ``kv`` (a range result) as text; what etcd sent when it is not base64."""
    sent = kv.get("key", "")
    try:
        return base64.b64decode(sent, validate=True).decode("utf-8", "replace")
    except (ValueError, TypeError):
        return repr(sent)[:80]


def _create_if_absent(key: str, put: dict[str, str]) -> dict[str, list[dict[str, Any]]]:
    """A transaction that puts only if ``key`` does not exist (its create_revision is 0)."""
    return {
        "compare": [{"key": key, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
        "success": [{"request_put": put}],
    }


async def _post(endpoint: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    url = urlsplit(endpoint)
    if url.scheme != "http" or url.hostname is None:
        raise ValueError(f"endpoint {endpoint!r} is not http://host:port")
    reader, writer = await asyncio.open_connection(url.hostname, url.port or 2379)
    try:
        data = json.dumps(body).encode("utf-8")
        head = (
            f"POST {path} HTTP/1.0\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n"
        )
        writer.write(head.encode("ascii") + data)
        await writer.drain()
        reply = await reader.read()  # HTTP/1.0: the server closes after the response
    finally:
        writer.close()
    status_line, _, rest = reply.partition(b"\r\n")
    _, _, payload = rest.partition(b"\r\n\r\n")
    parts = status_line.split(b" ", 2)
    if len(parts) < 2 or parts[1] != b"200":
        raise ValueError(f"HTTP {status_line.decode('latin-1')!r}: {payload[:200].decode('utf-8', 'replace')}")
    return read_record(payload)  # ValueError (deep nesting too): _call's CoordinatorError names the endpoint
