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
    then is the caller's no longer (it was cancelled): it is logged, never left unretrieved in
    its task: a WARNING when the store was closed under it (a stop: plyvel's "Database is
    closed"), an ERROR otherwise (a failed write nobody else reports)."""
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
            log.log(
                logging.WARNING if _store_closed(error) else logging.ERROR,
                "replication: %s in a worker thread failed after its task was cancelled: %r",
                getattr(fn, "__name__", fn),
                error,
            )
        raise


def _store_closed(error: BaseException) -> bool:
    """plyvel's error for a call on a closed database: the owner closed the store (it stops)."""
    return isinstance(error, RuntimeError) and str(error) == "Database is closed"
