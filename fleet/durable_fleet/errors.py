"""The fleet's errors: each says what happened and what to do (a log to read, an option to change).

``amqtt-durable fleet`` exits 2 for a FleetError (the run could not start or go on), 1 for a
BrokerLostError (what is under test failed), and reports a ScheduleError as a usage error.
"""

from __future__ import annotations

from pathlib import Path


class FleetError(Exception):
    """A run that cannot start or go on (bad options, a broker that does not start): exit 2."""


class BrokerLostError(FleetError):
    """The broker did not come back after its SIGKILL: what is under test failed (exit 1)."""


class ScheduleError(FleetError, ValueError):
    """A schedule that cannot be run, with where it went wrong: the file, the fault (1-based, in
    file order) and the field, so the script's author can go straight to the line."""

    def __init__(self, what: str, *, path: Path | None = None, fault: int | None = None, field: str | None = None):
        self.path = path
        self.fault = fault
        self.field = field
        where = [str(path)] if path is not None else []
        if fault is not None:
            where.append(f"fault {fault}")
        if field is not None:
            where.append(field)
        super().__init__(": ".join([*where, what]))
