"""amqtt-durable: crash-proof durable MQTT sessions for amqtt, stored in embedded LevelDB.

Load it from broker.yaml as ``amqtt_durable.DurableSessionsPlugin``.
"""

from .amqtt_glue import DurableSessionsPlugin
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
