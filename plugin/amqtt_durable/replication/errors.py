"""Errors of replication; each says what happened, what it affects and what to do.

Kept apart from the plugin's errors.py while the rest of the plugin is being restructured;
every class derives from the plugin's DurableError so callers catch them the same way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import DurableError, os_error_reason

if TYPE_CHECKING:
    from .coordinator import Member


class ReplicationError(DurableError):
    """Base of every replication error."""


class ReplicationListenError(ReplicationError):
    """The replication address (replication.listen) cannot be listened on: in use, no such host.
    Raised only by binding that address, once at start (its one listener hands connections to
    whichever end the node runs, a backup's tools or a primary's channel), so a start that fails
    with it is the address's fault, not the store's."""

    def __init__(self, address: str, cause: OSError | ValueError) -> None:
        self.address = address
        self.reason = os_error_reason(cause)
        super().__init__(f"replication.listen {address}: {self.reason}")


class PromotionRefusedError(ReplicationError):
    """A promotion asked for while another one is under way or a primary end serves already:
    refused before any step of the promotion, so nothing of the node changes (no second
    primary end, which nothing would close)."""


class PromotionStoppedError(ReplicationError):
    """A promotion ended by the broker's stop before the node served as primary: not a failure
    (nothing to retry, nothing to report), and not a success (the node never served)."""


class FrameError(ReplicationError):
    """Bytes on the replication channel do not decode (bad checksum, truncated, unknown type). It
    says only that: what follows is for whoever logs it to say, a backup's channel (channel_ended)
    and a tool (the address answers no replication frame) alike. Like every replication error
    below, its text does not begin with ``replication:``: each line that shows it names replication
    itself (``replication: backup b: channel to ...: ended: a frame does not decode ...``)."""

    def __init__(self, what: str, detail: str) -> None:
        super().__init__(f"a {what} does not decode ({detail})")


def channel_ended(exc: BaseException) -> str:
    """Why a backup's channel ended, as either end of it logs ``exc``: its text, and after a
    FrameError's (what does not decode) what the channel does about it."""
    if isinstance(exc, FrameError):
        return (
            f"{exc}; the channel is closed and the backup reconnects and is caught up again (check the network "
            "path, or versions of both brokers)"
        )
    return str(exc)


class FrameMacError(ReplicationError):
    """A frame after the handshake of replication.secret failed its MAC (auth.Session): forged,
    altered, replayed or reordered on the way. Nothing in it is used; the connection is closed.
    Not a FrameError: the frame decodes, and the text says itself what follows."""

    def __init__(self, number: int, sender: str) -> None:
        self.number = number
        super().__init__(
            f"frame {number} from {sender} failed its MAC (forged or altered on the way: only a peer that "
            "passed the handshake with the secret can send frames on this connection); the frame is not "
            "used and the connection is closed"
        )


class ReplicationGapError(ReplicationError):
    """A backup received a batch that does not follow the last one it applied."""

    def __init__(self, applied: int, received: int) -> None:
        self.applied = applied
        self.received = received
        super().__init__(
            f"batch {received} received after batch {applied}: a gap. The backup applies "
            "nothing out of order; it drops the channel and is caught up again from its applied batch"
        )


class StoreMismatchError(ReplicationError):
    """A batch names another store than the one the backup replicates."""

    def __init__(self, expected: int, received: int) -> None:
        self.expected = expected
        self.received = received
        super().__init__(
            f"batch of store {received:#x} received by a backup of store {expected:#x}; "
            "the backup drops the channel and asks for a new snapshot"
        )


class ChannelClosedError(ReplicationError):
    """The replication channel to a backup or to the primary closed."""


class CoordinatorError(ReplicationError):
    """The coordination service (etcd) cannot be reached or answered an error."""

    def __init__(self, endpoint: str, detail: str) -> None:
        self.endpoint = endpoint
        super().__init__(
            f"coordinator {endpoint}: {detail}. A primary that cannot renew its lease demotes itself "
            "before the lease ends; check that etcd runs and is reachable from this broker"
        )


class MalformedRecordError(CoordinatorError):
    """A record in etcd this version cannot read (its ``leader``, ``primary`` or ``sync`` key): it stays
    until it is fixed or deleted (only ``leader`` has a lease to end it), so the error says so rather
    than to check that etcd runs. The HA loop takes it as etcd not answering."""

    def __init__(self, endpoint: str, key: str, reason: str) -> None:
        self.endpoint = endpoint
        self.key = key
        ReplicationError.__init__(
            self,
            f"coordinator {endpoint}: {key} holds a malformed record ({reason}); it counts as etcd not "
            f"answering until it is fixed or deleted (etcdctl del {key})",
        )


class MemberNameTakenError(ReplicationError):
    """The coordinator's record of this node's name (members/<name>) is another broker's (at
    another address), until that record expires. It is not overwritten."""

    def __init__(self, holder: Member) -> None:
        self.holder = holder
        super().__init__(f"members/{holder.name} is held by the broker at {holder.address}")
