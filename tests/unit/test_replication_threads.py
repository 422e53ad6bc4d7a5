"""``in_thread``: LevelDB work in a worker thread outlives no cancellation of its caller."""

from __future__ import annotations

import asyncio
import threading

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
