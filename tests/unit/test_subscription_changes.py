"""SubscriptionChanges: one connection's SUBSCRIBEs and UNSUBSCRIBEs in arrival order, each kept
until applied, and ``drained`` true only once every one that arrived has been applied."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from amqtt_durable.subscription_changes import SubscriptionChanges

BOUND = 5.0


async def drained_within(changes: SubscriptionChanges[str], seconds: float) -> bool:
    try:
        async with asyncio.timeout(seconds):
            await changes.drained()
    except TimeoutError:
        return False
    return True


def run(test: Callable[[], Awaitable[None]]) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(BOUND):
            await test()

    asyncio.run(bounded())


async def apply_all(changes: SubscriptionChanges[str], applied: list[str]) -> None:
    """The message loop's part: take the head, apply it, mark it done, for ever."""
    while True:
        change = await changes.next()
        assert changes.start(change)
        await asyncio.sleep(0)  # applying takes a loop pass (a commit), as a real one does
        applied.append(change)
        changes.done(change)


def test_changes_are_handed_out_in_arrival_order_each_until_done() -> None:
    async def main() -> None:
        changes: SubscriptionChanges[str] = SubscriptionChanges()
        for change in ("sub a", "unsub a", "sub a"):
            changes.add(change)
        assert await changes.next() == "sub a"
        assert await changes.next() == "sub a", "the head stays queued until done"
        changes.done("sub a")
        assert await changes.next() == "unsub a"
        changes.done("unsub a")
        assert await changes.next() == "sub a"
        assert len(changes) == 1

    run(main)


def test_next_waits_for_a_change_to_arrive() -> None:
    async def main() -> None:
        changes: SubscriptionChanges[str] = SubscriptionChanges()
        waiter = asyncio.ensure_future(changes.next())
        await asyncio.sleep(0)
        assert not waiter.done()
        changes.add("unsub b")
        assert await waiter == "unsub b"

    run(main)


def test_drained_waits_until_the_last_change_is_applied_not_only_taken() -> None:
    async def main() -> None:
        changes: SubscriptionChanges[str] = SubscriptionChanges()
        assert await drained_within(changes, 0.01), "nothing arrived: drained at once"
        for change in ("unsub a", "unsub b", "sub c"):
            changes.add(change)
        assert not await drained_within(changes, 0.01), "nothing applied yet"
        applied: list[str] = []
        loop = asyncio.ensure_future(apply_all(changes, applied))
        assert await drained_within(changes, BOUND)
        assert applied == ["unsub a", "unsub b", "sub c"]
        loop.cancel()

    run(main)


def test_a_change_stays_queued_until_it_is_done() -> None:
    """Handed out and never applied (the loop's waiter cancelled after), or another change marked
    done: the head is handed out again and the queue is not drained."""

    async def main() -> None:
        changes: SubscriptionChanges[str] = SubscriptionChanges()
        changes.add("sub a")
        changes.add("sub b")
        assert await changes.next() == "sub a"
        changes.done("sub b")
        assert await changes.next() == "sub a"
        assert len(changes) == 2
        assert not await drained_within(changes, 0.01)

    run(main)


def test_close_drops_what_waits_and_ends_every_wait() -> None:
    async def main() -> None:
        changes: SubscriptionChanges[str] = SubscriptionChanges()
        changes.add("sub a")
        changes.add("sub b")
        waiting = asyncio.ensure_future(drained_within(changes, BOUND))
        await asyncio.sleep(0)
        assert changes.close() == 2
        assert await waiting, "a closed queue is drained"
        changes.add("sub c")  # arrived after the loop ended: nothing would apply it
        assert len(changes) == 0
        taker = asyncio.ensure_future(changes.next())
        await asyncio.sleep(0)
        assert not taker.done(), "a closed queue hands nothing out"
        taker.cancel()

    run(main)


def test_close_does_not_count_the_change_being_applied_and_counts_once() -> None:
    async def main() -> None:
        changes: SubscriptionChanges[str] = SubscriptionChanges()
        for change in ("sub a", "unsub a", "sub b"):
            changes.add(change)
        head = await changes.next()
        assert changes.start(head)  # being applied
        assert changes.close() == 2, "the one under way completes: not dropped"
        changes.done(head)
        assert changes.close() == 0, "a closed queue drops nothing more"
        assert await drained_within(changes, 0.01)

    run(main)


def test_a_change_handed_out_but_not_started_when_closed_is_dropped_and_counted() -> None:
    async def main() -> None:
        changes: SubscriptionChanges[str] = SubscriptionChanges()
        for change in ("sub a", "unsub a"):
            changes.add(change)
        head = await changes.next()  # taken by the loop, which has not begun it yet
        assert changes.close() == 2, "not under way: dropped with the rest"
        assert not changes.start(head), "closed since it was handed out: not to be applied"
        changes.done(head)
        assert await drained_within(changes, 0.01)

    run(main)


def test_fewer_than_waits_until_enough_changes_are_done_or_the_queue_closes() -> None:
    """The reader's bound (FastReader._room): it reads on once fewer than ``count`` changes wait."""

    async def main() -> None:
        changes: SubscriptionChanges[str] = SubscriptionChanges()
        await changes.fewer_than(1)  # none waits: at once
        for index in range(4):
            changes.add(f"sub {index}")
        waiter = asyncio.ensure_future(changes.fewer_than(2))
        for _ in range(3):
            await asyncio.sleep(0)  # a pass of the waiter
            assert not waiter.done(), f"done with {len(changes)} waiting"
            change = await changes.next()
            assert changes.start(change)
            changes.done(change)
        await asyncio.wait_for(waiter, BOUND)
        assert len(changes) == 1
        changes.add("sub 4")
        closed = asyncio.ensure_future(changes.fewer_than(1))
        await asyncio.sleep(0)
        assert not closed.done()
        changes.close()
        await asyncio.wait_for(closed, BOUND)

    run(main)
