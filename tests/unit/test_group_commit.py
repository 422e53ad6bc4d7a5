"""GroupCommitter: XAP batch semantics over a real LevelDB.

"One loop pass" is ``await asyncio.sleep(0)``: a commit started with ``call_soon`` runs
before the yielding task resumes, so a future that is done after one pass was committed
without any timer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from amqtt_durable.store import GroupCommitter

LONG_DELAY_MS = 60_000.0  # a commit that waits for this timer would never finish inside the test
GENEROUS = 5.0


def make(
    db: Any,
    *,
    sync: bool = False,
    batch_size: int = 5000,
    batch_delay_ms: float = LONG_DELAY_MS,
    pending_threshold: int = 100,
) -> GroupCommitter:
    return GroupCommitter(
        db, sync=sync, batch_size=batch_size, batch_delay_ms=batch_delay_ms, pending_threshold=pending_threshold
    )


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(test())


async def one_pass() -> None:
    await asyncio.sleep(0)


def test_threshold_commits_without_waiting_for_the_delay(db: Any) -> None:
    async def main() -> None:
        committer = make(db, pending_threshold=3)
        futures = []
        for i in range(2):
            committer.put(b"k%d" % i, b"v%d" % i)
            futures.append(committer.commit())
        await one_pass()
        assert committer.commits == 0
        assert not any(f.done() for f in futures)
        assert db.get(b"k0") is None, "below the threshold nothing may be written yet"
        committer.put(b"k2", b"v2")
        futures.append(committer.commit())
        await one_pass()
        assert committer.commits == 1
        assert all(f.done() and f.exception() is None for f in futures)
        assert [db.get(b"k%d" % i) for i in range(3)] == [b"v0", b"v1", b"v2"]

    run(main)


def test_units_count_toward_the_threshold(db: Any) -> None:
    async def main() -> None:
        committer = make(db, pending_threshold=10)
        committer.put(b"a", b"1")
        small = committer.commit(units=9)
        await one_pass()
        assert not small.done()
        committer.put(b"b", b"2")
        big = committer.commit(units=1)
        await one_pass()
        assert small.done() and big.done()
        assert committer.commits == 1
        assert db.get(b"a") == b"1" and db.get(b"b") == b"2"

    run(main)


def test_batch_size_below_threshold_starts_the_commit(db: Any) -> None:
    async def main() -> None:
        committer = make(db, batch_size=2, pending_threshold=100)
        committer.put(b"a", b"1")
        first = committer.commit()
        await one_pass()
        assert not first.done()
        committer.put(b"b", b"2")
        second = committer.commit()
        await one_pass()
        assert first.done() and second.done()
        assert committer.commits == 1

    run(main)


def test_below_threshold_waits_for_the_delay(db: Any) -> None:
    async def main() -> None:
        delay_ms = 30.0
        committer = make(db, batch_delay_ms=delay_ms, pending_threshold=100)
        loop = asyncio.get_running_loop()
        started = loop.time()
        futures = []
        for i in range(3):
            committer.put(b"k%d" % i, b"v")
            futures.append(committer.commit())
        for _ in range(10):
            await one_pass()
        assert committer.commits == 0
        assert not any(f.done() for f in futures)
        assert db.get(b"k0") is None
        await asyncio.wait_for(asyncio.gather(*futures), GENEROUS)
        assert committer.commits == 1, "all three below-threshold commits share one write"
        assert all(db.get(b"k%d" % i) == b"v" for i in range(3))
        # one-sided: the timer may not fire before its delay (minus the loop's clock resolution)
        assert loop.time() - started >= delay_ms / 1000 - 0.005

    run(main)


def test_urgent_commits_at_the_end_of_the_pass_and_takes_earlier_work_along(db: Any) -> None:
    async def main() -> None:
        committer = make(db, pending_threshold=100)
        committer.put(b"early", b"1")
        early = committer.commit()
        committer.put(b"urgent", b"2")
        urgent = committer.commit(urgent=True)
        assert not urgent.done(), "the commit runs at the end of the pass, not inside commit()"
        await one_pass()
        assert early.done() and urgent.done()
        assert committer.commits == 1
        assert db.get(b"early") == b"1" and db.get(b"urgent") == b"2"

    run(main)


def test_zero_delay_commits_every_pass(db: Any) -> None:
    async def main() -> None:
        committer = make(db, batch_delay_ms=0, pending_threshold=100)
        committer.put(b"a", b"1")
        first = committer.commit()
        await one_pass()
        assert first.done()
        committer.put(b"b", b"2")
        second = committer.commit()
        await one_pass()
        assert second.done()
        assert committer.commits == 2

    run(main)


def test_commit_without_operations_is_a_barrier(db: Any) -> None:
    async def main() -> None:
        committer = make(db)
        barrier = committer.commit(urgent=True)
        await one_pass()
        assert barrier.done() and barrier.exception() is None

    run(main)


def test_operations_apply_in_arrival_order(db: Any) -> None:
    async def main() -> None:
        committer = make(db)
        db.put(b"old", b"x")
        committer.put(b"a", b"1")
        committer.delete(b"a")
        committer.put(b"a", b"2")
        committer.delete(b"old")
        committer.put(b"b", b"1")
        await committer.commit(urgent=True)
        committer.put(b"b", b"2")
        await committer.commit(urgent=True)
        assert db.get(b"a") == b"2"
        assert db.get(b"old") is None
        assert db.get(b"b") == b"2"
        assert committer.commits == 2

    run(main)


def test_on_durable_runs_after_the_write_and_before_waiters_resume(db: Any) -> None:
    async def main() -> None:
        committer = make(db)
        events: list[str] = []

        def durable() -> None:
            events.append(f"durable:{db.get(b'k')!r}:{future.done()}")

        committer.put(b"k", b"v")
        future = committer.commit(durable, urgent=True)

        async def waiter() -> None:
            await future
            events.append("resumed")

        task = asyncio.ensure_future(waiter())
        await asyncio.wait_for(task, GENEROUS)
        assert events == ["durable:b'v':False", "resumed"]

    run(main)


def test_on_durable_fifo_across_commits(db: Any) -> None:
    async def main() -> None:
        committer = make(db, pending_threshold=3)
        order: list[int] = []

        def note(n: int) -> Callable[[], None]:
            return lambda: order.append(n)

        futures = [committer.commit(note(1), units=3)]
        await one_pass()
        assert order == [1]
        futures.append(committer.commit(note(2)))
        futures.append(committer.commit(note(3)))
        assert order == [1]
        futures.append(committer.commit(note(4), urgent=True))
        futures.append(committer.commit(note(5)))  # joins the already scheduled commit
        await one_pass()
        assert order == [1, 2, 3, 4, 5]
        assert committer.commits == 2
        futures.append(committer.commit(note(6), urgent=True))
        await asyncio.wait_for(asyncio.gather(*futures), GENEROUS)
        assert order == [1, 2, 3, 4, 5, 6]
        assert committer.commits == 3

    run(main)


def test_sync_write_in_thread(db: Any) -> None:
    async def main() -> None:
        committer = make(db, sync=True, pending_threshold=2)
        committer.put(b"a", b"1")
        first = committer.commit(units=2)
        await asyncio.wait_for(first, GENEROUS)
        assert db.get(b"a") == b"1"
        assert committer.commits == 1

    run(main)


def test_sync_commits_during_a_write_follow_it_in_order(db: Any) -> None:
    async def main() -> None:
        committer = make(db, sync=True, pending_threshold=100)
        order: list[str] = []
        committer.put(b"k", b"first")
        first = committer.commit(lambda: order.append("first"), urgent=True)
        await one_pass()  # the first batch is now being written in a worker thread
        committer.put(b"k", b"second")
        second = committer.commit(lambda: order.append(f"second:{db.get(b'k')!r}"))
        committer.put(b"other", b"x")
        third = committer.commit(lambda: order.append("third"), urgent=True)
        await asyncio.wait_for(asyncio.gather(first, second, third), GENEROUS)
        assert order == ["first", "second:b'second'", "third"]
        assert committer.commits == 2, "what arrives during a write is gathered into the next one"
        assert db.get(b"k") == b"second"

    run(main)


def test_sync_below_threshold_uses_the_timer(db: Any) -> None:
    async def main() -> None:
        committer = make(db, sync=True, batch_delay_ms=20, pending_threshold=100)
        committer.put(b"a", b"1")
        future = committer.commit()
        for _ in range(5):
            await one_pass()
        assert db.get(b"a") is None
        await asyncio.wait_for(future, GENEROUS)
        assert db.get(b"a") == b"1"

    run(main)


def test_before_flush_adds_to_the_same_batch(db: Any) -> None:
    async def main() -> None:
        committer = make(db, pending_threshold=100)
        calls: list[bytes | None] = []

        def totals() -> None:
            calls.append(db.get(b"a"))
            committer.put(b"totals", b"%d" % len(calls))

        committer.before_flush = totals
        committer.put(b"a", b"1")
        await committer.commit(urgent=True)
        assert calls == [None], "before_flush runs before the write"
        assert db.get(b"totals") == b"1"
        committer.put(b"a", b"2")
        await committer.commit(urgent=True)
        assert db.get(b"totals") == b"2"

    run(main)


def test_flush_now_writes_and_resolves_everything(db: Any) -> None:
    async def main() -> None:
        committer = make(db, pending_threshold=100)
        called: list[int] = []
        committer.put(b"a", b"1")
        first = committer.commit(lambda: called.append(1))
        committer.put(b"b", b"2")
        second = committer.commit(lambda: called.append(2))
        committer.flush_now()
        assert db.get(b"a") == b"1" and db.get(b"b") == b"2"
        assert called == [1, 2]
        assert first.done() and second.done()
        await one_pass()
        assert called == [1, 2], "nothing runs twice after flush_now"

    run(main)
