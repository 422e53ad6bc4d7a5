"""LevelDB work off the event loop, safe against cancellation.

plyvel objects (iterators, snapshots, the DB) crash the process when closed while a thread
uses them, and ``asyncio.to_thread`` returns on cancellation while its thread runs on. Every
thread hand-off of replication goes through ``in_thread``, which waits for the thread first.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

_R = TypeVar("_R")


async def in_thread(fn: Callable[..., _R], *args: Any) -> _R:
    """``asyncio.to_thread`` that, when cancelled, still waits for the thread to finish."""
    task = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait({task})
        raise
