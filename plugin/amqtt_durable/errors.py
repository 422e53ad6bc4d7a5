"""Errors of the durable-sessions plugin; each message says what happened and what to do."""

from __future__ import annotations


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


class StoreLockedError(StoreError):
    """Another process holds the store's LOCK file."""

    def __init__(self, path: str) -> None:
        self.path = path
        super().__init__(
            f"store '{path}' is locked by another process (is a broker or 'amqtt-durable inspect' "
            "already running on it?). Stop that process, or point 'store' at another folder."
        )


class StoreCorruptedError(StoreError):
    """LevelDB reports corruption, or the store's layout version is unknown."""

    def __init__(self, path: str, detail: str) -> None:
        self.path = path
        super().__init__(
            f"store '{path}' is corrupted or unreadable: {detail}. Queued messages are still on disk; "
            f"run 'amqtt-durable repair {path}' (LevelDB's repair, keeps every readable record) "
            "with the broker stopped, then start the broker again."
        )


class InternalsMismatchError(DurableError):
    """The installed amqtt lacks an internal the glue module needs."""


class StoreUnavailableError(StoreError):
    """The store cannot write now (disk full, I/O error); the write is retried until it succeeds."""

    def __init__(self, cause: BaseException) -> None:
        self.cause = cause
        super().__init__(
            f"the durable store cannot write ({cause}); the broker retries by itself and serves "
            "normally again once a write succeeds: free space on the store's disk"
        )
