"""amqtt-durable: crash-proof durable MQTT sessions for amqtt, stored in embedded LevelDB.

Load it from broker.yaml as ``amqtt_durable.DurableSessionsPlugin``.
"""

from typing import TYPE_CHECKING, Any

from .config import DurableConfig
from .errors import (
    ConfigError,
    DurableError,
    ForeignLayoutError,
    ForeignStoreError,
    StoreCorruptedError,
    StoreError,
    StoreLockedError,
)

if TYPE_CHECKING:
    from .amqtt_glue import DurableSessionsPlugin

__all__ = [
    "ConfigError",
    "DurableConfig",
    "DurableError",
    "DurableSessionsPlugin",
    "ForeignLayoutError",
    "ForeignStoreError",
    "StoreCorruptedError",
    "StoreError",
    "StoreLockedError",
]


if not TYPE_CHECKING:  # a type checker sees the import above: a misspelt name stays an error there

    def __getattr__(name: str) -> Any:
        """``DurableSessionsPlugin`` (and amqtt with it) imported when first asked for, by amqtt's plugin loader
        or ``from amqtt_durable import ...``: the store tools (inspect, repair, promote) start without amqtt."""
        if name == "DurableSessionsPlugin":
            from .amqtt_glue import DurableSessionsPlugin  # noqa: PLC0415

            return DurableSessionsPlugin
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's names and the plugin, not imported yet (``dir``, ``inspect.getmembers``, completion)."""
    return sorted({*globals(), *__all__})
