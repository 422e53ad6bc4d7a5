"""The wire protocol v1 under the SDK's name: the code is ``durable_protocol`` (shared with the plugin)."""

import durable_protocol
from durable_protocol import *  # noqa: F403  (the SDK's name for the same objects, not a copy)

__all__ = durable_protocol.__all__
