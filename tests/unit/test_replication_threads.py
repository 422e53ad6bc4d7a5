"""``in_thread``: LevelDB work in a worker thread outlives no cancellation of its caller."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from amqtt_durable.replication.threads import in_thread


def test_a_caller_cancelled_twice_still_ends_only_after_the_thread() -> None:
    """A second cancellation (a stop after a leader change) during the wait for the thread ended
    the caller at once, the thread still using the store the caller's owner then closes."""
    release, finished = threading.Event(), threading.Event()

    def work() -> None:
        assert release.wait(30)
        finished.set()

    async def main() -> None:
        started = asyncio.Event()

        async def caller() -> None:
            started.set()
            await in_thread(work)

        task = asyncio.create_task(caller())
        await started.wait()
        for _ in range(2):
            task.cancel()
            for _ in range(5):  # loop passes, for the cancellation to reach in_thread's wait
                await asyncio.sleep(0)
        assert not task.done(), "the caller ended while its thread still ran"
        release.set()
        await asyncio.wait_for(asyncio.wait({task}), 30)
        assert task.cancelled() and finished.is_set()

    asyncio.run(main())


def test_an_error_of_a_cancelled_callers_thread_is_logged_an_error_unless_the_store_was_closed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Nobody else sees the error of a thread whose caller was cancelled: a failed write is an
    ERROR; plyvel's "Database is closed" (the owner closed the store: a stop) a WARNING."""
    caplog.set_level(logging.WARNING, "amqtt_durable.replication")

    async def cancelled_with(error: Exception) -> None:
        release = threading.Event()

        def work() -> None:
            assert release.wait(30)
            raise error

        task = asyncio.ensure_future(in_thread(work))
        for _ in range(5):  # loop passes, for the task to reach its wait for the thread
            await asyncio.sleep(0)
        task.cancel()
        for _ in range(5):
            await asyncio.sleep(0)
        release.set()
        await asyncio.wait_for(asyncio.wait({task}), 30)
        assert task.cancelled()

    asyncio.run(cancelled_with(OSError("No space left on device")))
    asyncio.run(cancelled_with(RuntimeError("Database is closed")))
    logged = [(record.levelno, record.getMessage().rpartition(": ")[2]) for record in caplog.records]
    assert logged == [
        (logging.ERROR, "OSError('No space left on device')"),
        (logging.WARNING, "RuntimeError('Database is closed')"),
    ], logged
