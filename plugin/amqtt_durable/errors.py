"""Errors of the durable-sessions plugin; each message says what happened and what to do."""

from __future__ import annotations

import os
import socket


class DurableError(Exception):
    """Base of every error this package raises on purpose."""


class ConfigError(DurableError):
    """A plugin setting in broker.yaml is missing, unknown or out of range."""

    def __init__(self, key: str, problem: str) -> None:
        self.key = key
        self.problem = problem
        super().__init__(f"amqtt_durable config: '{key}': {problem}")


class StoreError(DurableError):
    """The LevelDB store cannot be opened or used."""


class DamagedRecordError(StoreError):
    """A stored record does not decode; the opener of the store wraps it with the store's path."""


class StoreReadError(StoreError):
    """Reading one session's queue failed: the store is damaged there (or its disk fails)."""

    def __init__(self, client_id: str, after_seq: int, detail: str) -> None:
        self.client_id = client_id
        self.after_seq = after_seq
        super().__init__(f"session {client_id}: reading its queue after message {after_seq} failed: {detail}")


class StoreLockedError(StoreError):
    """Another process holds the store's LOCK file."""

    def __init__(self, path: str) -> None:
        self.path = path
        super().__init__(
            f"store '{path}' is locked by another process (is a broker or 'amqtt-durable inspect' "
            "already running on it?). Stop that process, or point 'store' at another folder."
        )


class StoreCorruptedError(StoreError):
    """LevelDB reports corruption, or a record does not decode (another layout version is
    ForeignLayoutError, not this: not damage)."""

    def __init__(self, path: str, detail: str) -> None:
        self.path = path
        super().__init__(
            f"store '{path}' is corrupted or unreadable: {detail}. Queued messages are still on disk; "
            f"run 'amqtt-durable repair {path}' (LevelDB's repair keeps every readable record, then session "
            "records and queue totals are rebuilt from the queues) with the broker stopped, then start the "
            "broker again."
        )


def _leveldb_repaired(path: str) -> str:
    return (
        "LevelDB's repair has run on it (its readable records kept: the logs' and damaged tables' in new table "
        f"files; the logs, damaged tables and old MANIFESTs moved to '{path}/lost')"
    )


class ForeignLayoutError(StoreError):
    """The store was written by another release of this plugin (another layout version): not
    damage, so not something repair changes, and not a StoreCorruptedError (which earlier
    builds raised for it): catch StoreError for both."""

    def __init__(self, path: str, version: bytes, reads: bytes, *, repaired: bool = False) -> None:
        self.path = path
        self.version = version
        self.repaired = repaired
        named = (
            f"store '{path}' was written by another release of amqtt_durable: layout version {version!r}, "
            f"this release reads {reads!r}."
        )
        if repaired:  # it did not open (damaged), so its version was only readable after LevelDB's repair
            super().__init__(
                f"{named} It did not open, so {_leveldb_repaired(path)}, but none of its sessions, "
                "queue totals or references was rebuilt (this release does not know that layout): run the "
                "release that wrote it (its repair too)."
            )
            return
        super().__init__(
            f"{named} Run the release that wrote it, or point 'store' at another folder; "
            "'amqtt-durable repair' does not change a store's layout (it refuses such a store)."
        )


class ForeignStoreError(StoreError):
    """``amqtt-durable repair`` on a LevelDB folder of another program (store_owner.py's rule): refused
    before anything in the folder is touched, since LevelDB's repair would rewrite that program's data;
    or, ``repaired``, found so only once LevelDB's repair had run on a folder LevelDB could not read."""

    def __init__(self, path: str, why: str, *, repaired: bool = False) -> None:
        self.path = path
        self.why = why
        self.repaired = repaired
        if repaired:
            super().__init__(
                f"repair of '{path}' stopped: it is not an amqtt-durable store but another program's LevelDB ({why}). "
                f"It could not be read, so {_leveldb_repaired(path)}, but nothing was rebuilt and no version key "
                "written"
            )
            return
        super().__init__(
            f"repair of '{path}' refused: it is not an amqtt-durable store but another program's LevelDB ({why}); "
            "nothing was changed. Point repair at the plugin's 'store' folder"
        )


class BrokerNotStartedError(DurableError):
    """amqtt's broker did not start; the message is the innermost reason, the one that names what to fix."""


class InternalsMismatchError(DurableError):
    """The installed amqtt lacks an internal the glue module needs."""


class NotSessionOwnerError(DurableError):
    """A CONNECT of another user than the owner of the durable session of its client id."""

    def __init__(self, client_id: str, owner: str | None, username: str | None) -> None:
        self.client_id = client_id
        self.owner = owner
        self.username = username
        super().__init__(
            f"CONNECT of client id {client_id!r} by user {username!r} refused (CONNACK 5): its durable session "
            f"belongs to user {owner!r} (session_takeover: owner-only). Connect as that user, use another "
            "client id, or set session_takeover: any-user to let other users take sessions over."
        )


class ProtocolViolationError(DurableError):
    """A client broke MQTT in a way that ends its connection (MQTT-4.8.0-1: close, never guess)."""


class PacketTooLargeError(ProtocolViolationError):
    """A packet's remaining length is past ``max_packet_size``: refused before its body is read."""

    def __init__(self, size: int, limit: int) -> None:
        self.size = size
        self.limit = limit
        super().__init__(
            f"a packet of {size} bytes is larger than max_packet_size ({limit} bytes); "
            "raise max_packet_size in broker.yaml if such packets are legitimate"
        )


class StoreUnavailableError(StoreError):
    """The store cannot write now (disk full, I/O error); the write is retried until it succeeds."""

    def __init__(self, cause: BaseException) -> None:
        self.cause = cause
        super().__init__(
            f"the durable store cannot write ({cause}); the broker retries by itself and serves "
            "normally again once a write succeeds: free space on the store's disk"
        )


class NotPrimaryError(StoreUnavailableError):
    """A replicated broker that is not (or no longer) the primary: it acknowledges nothing."""

    def __init__(self, reason: str) -> None:
        self.cause = self
        StoreError.__init__(
            self,
            f"this broker is not the primary of its replication group ({reason}): nothing is "
            "acknowledged here; clients reconnect to the primary and send again",
        )


def os_error_reason(exc: OSError | ValueError) -> str:
    """``[Errno 98] Address already in use``: asyncio's bind error repeats the address, which the
    message names already; a resolver's error (gaierror) and a ValueError are kept as they are."""
    if isinstance(exc, OSError) and not isinstance(exc, socket.gaierror) and exc.errno is not None:
        return f"[Errno {exc.errno}] {os.strerror(exc.errno)}"
    return str(exc) or repr(exc)


class SessionLimitError(DurableError):
    """A CONNECT with clean_session=false would create a durable session past ``max_durable_sessions``."""

    def __init__(self, client_id: str, limit: int) -> None:
        self.client_id = client_id
        self.limit = limit
        super().__init__(
            f"CONNECT of client id {client_id!r} refused: the store holds max_durable_sessions ({limit}) "
            "durable sessions"
        )
