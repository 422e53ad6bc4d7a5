"""The backup's FrameQueue without sockets: order, its end, a cancelled put, and both bounds
(frames and payload bytes), a frame larger than the byte bound taken alone."""

from __future__ import annotations

import asyncio

from amqtt_durable.replication.backup import FrameQueue
from amqtt_durable.replication.framing import Frame

WAIT = 5.0


def frame(size: int, tag: int = 0) -> tuple[Frame, bytes]:
    return Frame.BATCH, bytes([tag]) * size


async def blocked(task: asyncio.Task[None]) -> bool:
    """Whether ``task`` (a put) still waits after the loop ran everything else ready."""
    for _ in range(5):
        await asyncio.sleep(0)
    return not task.done()


def test_frames_come_out_in_order_across_takes() -> None:
    async def main() -> list[list[int]]:
        queue = FrameQueue(100, 1000)
        taken = []
        for batch in ([0, 1, 2], [3], [4, 5]):
            for tag in batch:
                await queue.put(frame(1, tag))
            taken.append([payload[0] for _, payload in await queue.take()])
        return taken

    assert asyncio.run(main()) == [[0, 1, 2], [3], [4, 5]]


def test_after_end_take_returns_what_is_left_then_nothing() -> None:
    async def main() -> tuple[list[int], list[tuple[Frame, bytes]], list[tuple[Frame, bytes]]]:
        queue = FrameQueue(100, 1000)
        await queue.put(frame(1, 7))
        await queue.put(frame(1, 8))
        queue.end()
        left = [payload[0] for _, payload in await queue.take()]
        return left, await asyncio.wait_for(queue.take(), WAIT), await asyncio.wait_for(queue.take(), WAIT)

    assert asyncio.run(main()) == ([7, 8], [], [])


def test_a_take_waiting_on_an_empty_queue_returns_nothing_once_ended() -> None:
    async def main() -> list[tuple[Frame, bytes]]:
        queue = FrameQueue(100, 1000)
        waiting = asyncio.create_task(queue.take())
        await asyncio.sleep(0)
        queue.end()
        return await asyncio.wait_for(waiting, WAIT)

    assert asyncio.run(main()) == []


def test_a_waiting_put_that_is_cancelled_queues_nothing() -> None:
    async def main() -> tuple[list[int], int]:
        queue = FrameQueue(1, 1000)
        await queue.put(frame(1, 1))
        put = asyncio.create_task(queue.put(frame(1, 2)))
        assert await blocked(put)
        put.cancel()
        await asyncio.gather(put, return_exceptions=True)
        assert put.cancelled()
        taken = [payload[0] for _, payload in await queue.take()]
        queue.end()
        return taken, len(await asyncio.wait_for(queue.take(), WAIT))

    assert asyncio.run(main()) == ([1], 0)


def test_the_count_bound_holds_a_put_back_before_the_byte_bound() -> None:
    async def main() -> None:
        queue = FrameQueue(2, 1000)
        await queue.put(frame(1, 1))
        await queue.put(frame(1, 2))
        put = asyncio.create_task(queue.put(frame(1, 3)))
        assert await blocked(put)  # 2 frames, 2 bytes of 1000: the count holds it back
        assert len(await queue.take()) == 2
        await asyncio.wait_for(put, WAIT)
        assert [payload[0] for _, payload in await queue.take()] == [3]

    asyncio.run(main())


def test_the_byte_bound_holds_a_put_back() -> None:
    async def main() -> None:
        queue = FrameQueue(100, 10)
        await queue.put(frame(6, 1))
        put = asyncio.create_task(queue.put(frame(5, 2)))
        assert await blocked(put)  # 6 + 5 bytes > 10
        assert len(await queue.take()) == 1
        await asyncio.wait_for(put, WAIT)
        assert queue.bytes == 5

    asyncio.run(main())


def test_a_frame_larger_than_the_byte_bound_waits_for_an_empty_queue_then_is_taken_alone() -> None:
    async def main() -> None:
        queue = FrameQueue(100, 10)
        await queue.put(frame(1, 1))
        large = asyncio.create_task(queue.put(frame(50, 2)))
        assert await blocked(large)
        assert [payload[0] for _, payload in await queue.take()] == [1]
        await asyncio.wait_for(large, WAIT)  # an empty queue admits it
        after = asyncio.create_task(queue.put(frame(1, 3)))
        assert await blocked(after)  # nothing joins it
        group = await queue.take()
        assert [(payload[0], len(payload)) for _, payload in group] == [(2, 50)]
        await asyncio.wait_for(after, WAIT)
        assert [payload[0] for _, payload in await queue.take()] == [3]

    asyncio.run(main())
