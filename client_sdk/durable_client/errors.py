"""The SDK's errors: one base class, and a subclass per thing an application handles differently.

Each message says what happened, what it affects and what to do, so a log line is enough to
act on.
"""

from __future__ import annotations

# N818 (an "Error" suffix) is waived for the public names below: they read as what happened
# (``except Unconnected``), after GemFire's UnconnectedException, and are the SDK's API.


class DurableClientError(Exception):
    """Base of every error the SDK raises on purpose: catch it to handle them all."""


class WrongTypeError(ValueError, TypeError):
    """An option or argument of the wrong type (docs/sdk.md, "Bad input"): a ValueError like every
    bad option (``except ValueError`` catches any), and a TypeError too, as Python's own checks
    raise for a wrong type (``except TypeError`` catches it)."""


class Unconnected(DurableClientError):  # noqa: N818
    """The operation needs a live connection (GemFire's UnconnectedException).

    Raised while the client reconnects and after close(). Nothing was sent: retry once
    ``on_connected`` fires, or keep reading the (stale) last-value cache meanwhile.
    """


class ConnectFailed(DurableClientError):  # noqa: N818
    """connect() gave up: the broker refused the client, or no session was set up in time.

    The background thread has stopped; connect() may be called again.
    """


class ControlRequestFailed(DurableClientError):  # noqa: N818
    """The broker refused a control request (docs/protocol.md, "Replies"); nothing changed."""

    def __init__(self, op: str, code: str, message: str) -> None:
        super().__init__(f"the broker refused '{op}' with {code}: {message}")
        self.op = op
        self.code = code
        """One of protocol.ERROR_CODES, e.g. ``unknown_stream`` or ``not_authorized``."""
        self.message = message


class RequestTimeout(DurableClientError, TimeoutError):  # noqa: N818
    """No answer (PUBACK or control reply) in time; the outcome is unknown, not failed.

    A QoS 1/2 publish stays queued in the client and is re-sent after a reconnect, so it may
    still arrive: publish idempotent payloads or check on the receiving side.
    """


class PersistenceError(DurableClientError):
    """The client-side state folder cannot be used safely (in use by another process, or damaged).

    Unlike an I/O error (which falls back to in-memory state), this stops the client: two
    processes sharing one folder, or state that cannot be read, would break exactly-once.
    """


class EventNotProcessedError(DurableClientError):
    """An AsyncDurableClient's loop did not finish an event (its body raised, or the loop was
    left): it is not acknowledged, and the broker sends it again."""
