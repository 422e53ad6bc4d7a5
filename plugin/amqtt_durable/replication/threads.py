"""LevelDB work off the event loop, safe against cancellation.

plyvel objects (iterators, snapshots, the DB) crash the process when closed while a thread
uses them, and ``asyncio.to_thread`` returns on cancellation while its thread runs on. Every
thread hand-off of replication goes through ``in_thread``, which waits for the thread first.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, TypeVar

_R = TypeVar("_R")

log = logging.getLogger("amqtt_durable.replication")


async def in_thread(fn: Callable[..., _R], *args: Any) -> _R:
    """``asyncio.to_thread`` that, when cancelled, still waits for the thread to finish (however
    often it is cancelled meanwhile), then ends cancelled. An error of the thread's work found
    then is the caller's no longer (it was cancelled): it is logged as a WARNING, never left
    unretrieved in its task."""
    task = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        while not task.done():
            try:
                await asyncio.wait({task})
            except asyncio.CancelledError:
                continue  # cancelled again: the thread still holds the store; ends cancelled below
        error = None if task.cancelled() else task.exception()
        if error is not None:
            log.warning(
                "replication: %s in a worker thread failed after its task was cancelled: %r",
                getattr(fn, "__name__", fn),
                error,
            )
        raise
